import warnings

import pytest


@pytest.fixture(autouse=True)
def _quiet_hf():
    # transformers announces future API changes of its own on every model built; they are
    # not ours to fix (DeprecationWarnings are not hidden: pytest lists them)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
        yield


@pytest.fixture(autouse=True)
def _own_plan_cache(tmp_path_factory, monkeypatch):
    # the CLI caches plans (autopar/plan_cache.py): each test starts with an empty cache of
    # its own, not the user's
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path_factory.mktemp("plan-cache")))


# NOTE: these tests carry the pinned_torch_only marker from here, by file and name; the rest
# carry it in their own files (pytestmark, a case's marks). A decorator on each of these, in
# its file, would select the same.
PINNED_TORCH_ONLY = {
    "test_attention.py": {
        "test_sdpa_model_plans_attention_sharded_and_no_slower_than_its_eager_twin",
        "test_cuda_attention_takes_flash_only_where_torch_would",
    },
    # codegen's CUDA emission of FSDP's buckets and prefetches
    "test_codegen.py": {
        "test_cuda_reduce_scatter_buckets_hold_one_input_per_axis",
        "test_cuda_reshards_are_issued_ahead_of_their_consumers",
        "test_cuda_weights_cast_ahead_of_their_gathers",
    },
    "test_memory.py": {"test_sharded_parameters_and_adamw_state_are_the_local_shards"},
    "test_plan.py": {
        "test_same_model_inputs_and_mesh_give_the_same_plan_json",
        "test_memory_budget_forces_parameters_to_be_sharded",
        "test_impossible_memory_budget_is_a_clear_error",
    },
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if getattr(item, "originalname", item.name) in PINNED_TORCH_ONLY.get(item.path.name, ()):
            item.add_marker(pytest.mark.pinned_torch_only)

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

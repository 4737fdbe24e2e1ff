"""The zoo trained by autopar on gloo meshes equals the single-device model.

Every case plans with folding on (the default: the transformers' layers share one set of
choices) and with a parameter-memory budget below the whole model, so the plan must
shard: the collectives it inserts are exercised. Each case checks the loss of every step,
every gathered gradient of the first step, and every parameter after 3 AdamW steps.
``gpt-tied`` ties its LM head to its token embedding: two names, one weight, whose gradient
sums both uses. The Hugging Face models are built as users build them, with the library's
default attention (SDPA, traced as autopar's attention op) and no setting changed.
"""

import pytest

from autopar import Plan
from autopar.verify import verify

CASES = [
    # (example, mesh, axes, dtype, memory fraction)
    ("mlp", (2,), ("dp",), "float64", 0.6),
    ("gpt", (2,), ("dp",), "float64", 0.6),
    ("gpt", (4,), ("dp",), "float64", 0.3),
    ("gpt", (2, 2), ("dp", "tp"), "float64", 0.5),
    ("gpt-tied", (2, 2), ("dp", "tp"), "float64", 0.5),
    ("hf-gpt2", (2,), ("dp",), "float64", 0.6),
    ("hf-gpt2", (2, 2), ("dp", "tp"), "float64", 0.5),
    ("hf-llama", (2,), ("dp",), "float64", 0.6),
    ("hf-llama", (4,), ("dp",), "float64", 0.3),
    ("hf-llama", (2, 2), ("dp", "tp"), "float64", 0.5),
    ("mlp", (4,), ("dp",), "float64", 0.3),
    ("mlp", (2, 2), ("dp", "tp"), "float64", 0.5),
    ("hf-gpt2", (4,), ("dp",), "float64", 0.3),
]

TOL = {"float64": 1e-8, "float32": 1e-4}


def _on_gloo(counts: dict) -> dict:
    """gloo has no all_to_all: DTensor runs Shard(a)->Shard(b) as all_gather + chunk."""
    out: dict = {}
    for (kind, axis), n in counts.items():
        kind = "all_gather" if kind == "all_to_all" else kind
        out[(kind, axis)] = out.get((kind, axis), 0) + n
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("example,mesh,axes,dtype,fraction", CASES, ids=lambda v: str(v))
def test_zoo_matches_single_device(example, mesh, axes, dtype, fraction):
    reports = verify(example, mesh, axes, steps=3, dtype=dtype, memory_fraction=fraction)
    tol = TOL[dtype]
    for rank, r in enumerate(reports):
        for a, b in zip(r.losses, r.ref_losses):
            assert a == pytest.approx(b, rel=tol), f"rank {rank} loss {a} vs {b}"
        assert r.grad_rel_err <= tol, f"rank {rank} gradient of {r.worst_grad}: {r.grad_rel_err}"
        assert r.param_rel_err <= tol, f"rank {rank} parameter {r.worst_param}: {r.param_rel_err}"
    r0 = reports[0]
    # every rank returns the same loss
    assert all(r.losses == r0.losses for r in reports)
    # the plan shards something (the memory budget forces it) ...
    assert r0.predicted, "the plan inserted no collective"
    # ... and the collectives it predicts are the ones the compiled step runs
    assert _on_gloo(r0.predicted) == r0.ran
    assert r0.mismatches == []
    # one local parameter per model parameter (a tied weight is one shard under two names)
    assert r0.local_params == r0.model_params
    plan = Plan.from_json(r0.plan_json)
    if example == "gpt-tied":
        # the two names of the tied weight are placed alike, and the budget shards them
        pp = plan.param_placements
        assert pp["tok.weight"] == pp["head.weight"]
        assert any(p != ("R", "R") for p in (plan.nodes[n].out[0] for n in plan.params.values()))
    if example != "mlp":
        # planned with folding (the default): the layers shared one set of choices
        assert plan.stats["fold_groups"], plan.summary()
        assert plan.stats["solver_nodes"] < plan.stats["nodes"]
    else:
        # mse_loss has no sharding rule: replicated, said so, and still exact
        assert any(w.startswith("aten.mse_loss.default (<top level>") for w in plan.warnings)

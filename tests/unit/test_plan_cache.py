"""The plan cache: the same step, mesh, profile and options plan once; anything else in
the key plans again."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

import autopar
from autopar import plan_cache
from autopar.cli import main

pytestmark = pytest.mark.pinned_torch_only


def _planned(capsys, tmp_path, *args) -> tuple[autopar.Plan, str]:
    """The plan ``autopar plan gpt`` writes, and its stage lines (stderr)."""
    out = tmp_path / "plan.json"
    assert main(["plan", "gpt", "--mesh", "2", "--out", str(out), *args]) == 0
    return autopar.Plan.load(out), capsys.readouterr().err


def test_planning_again_is_a_cache_hit(capsys, tmp_path):
    a, log = _planned(capsys, tmp_path)
    assert "autopar: solve" in log and "plan cache hit" not in log
    files = list((plan_cache.cache_dir() / "plans").glob("*.json"))
    assert len(files) == 1
    b, log = _planned(capsys, tmp_path)
    assert "plan cache hit" in log and "autopar: solve" not in log
    assert a.to_json() == b.to_json() and "cache_s" in b.stats and "cache_s" not in a.stats
    assert "read from the plan cache" in b.summary()
    _, log = _planned(capsys, tmp_path, "--no-cache")
    assert "plan cache hit" not in log and "autopar: solve" in log
    _, log = _planned(capsys, tmp_path, "--memory-fraction", "0.5")  # another key
    assert "plan cache hit" not in log
    assert len(list((plan_cache.cache_dir() / "plans").glob("*.json"))) == 2
    # a file that does not read back is a miss, and is replaced
    files[0].write_text("{broken")
    _, log = _planned(capsys, tmp_path)
    assert "does not read back" in log and "autopar: solve" in log
    # (less what `autopar plan` adds to the plan it writes)
    stats = {k: v for k, v in a.stats.items() if k != "source"}
    bare = dataclasses.replace(a, stats=stats, source={})
    assert autopar.Plan.load(files[0]).to_json() == bare.to_json()


def test_the_key_holds_the_dtypes_the_mesh_and_the_profile():
    def fingerprint(dtype):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)
        x, y = torch.randn(4, 8, dtype=dtype), torch.randn(4, 4, dtype=dtype)
        plan = autopar.plan(
            model, autopar.Mesh(2, "dp"), (x,), loss_fn=nn.functional.mse_loss,
            example_targets=(y,),
        )  # fmt: skip
        return plan.fingerprint

    # the same graph in another dtype is another graph (its bytes and costs differ)
    assert fingerprint(torch.float32) != fingerprint(torch.float64)
    from autopar.passes.pipeline import PlanOptions

    opts = PlanOptions()
    keys = {
        plan_cache.key("f", autopar.Mesh(2, "dp"), opts),
        plan_cache.key("g", autopar.Mesh(2, "dp"), opts),
        plan_cache.key("f", autopar.Mesh(2, "tp"), opts),
        plan_cache.key("f", autopar.Mesh(2, "dp", device="cpu"), opts),
        plan_cache.key("f", autopar.Mesh(2, "dp", ranks_per_node=1), opts),
        plan_cache.key("f", autopar.Mesh(2, "dp"), PlanOptions(checkpointing=False)),
        plan_cache.key("f", autopar.Mesh(2, "dp"), PlanOptions(memory_fraction=0.5)),
    }
    assert len(keys) == 7
    assert plan_cache.key("f", autopar.Mesh(2, "dp"), opts) in keys  # deterministic


def test_the_key_holds_the_planners_source(tmp_path, monkeypatch):
    """A change to the code that plans is another key, though autopar's version is the same
    (a plan cached before the change would not be the plan the search now makes)."""
    from autopar.passes.pipeline import PlanOptions

    mesh, opts = autopar.Mesh(2, "dp"), PlanOptions()
    before = plan_cache.key("f", mesh, opts)
    assert plan_cache.key("f", mesh, opts) == before
    # the same package, one pass changed by a byte
    copy = tmp_path / "passes"
    copy.mkdir()
    passes_dir = Path(str(plan_cache.passes.__file__)).parent
    for f in passes_dir.glob("*.py"):
        (copy / f.name).write_bytes(f.read_bytes())
    (copy / "prefetch.py").write_bytes((copy / "prefetch.py").read_bytes() + b"\n")
    monkeypatch.setattr(plan_cache.passes, "__file__", str(copy / "__init__.py"))
    plan_cache._code_digest.cache_clear()
    try:
        assert plan_cache.key("f", mesh, opts) != before
    finally:
        monkeypatch.undo()
        plan_cache._code_digest.cache_clear()
    assert plan_cache.key("f", mesh, opts) == before

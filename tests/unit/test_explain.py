"""``autopar explain``: the best plan without a choice, what it costs, and what binds."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autopar import Plan
from autopar.cli import main

pytestmark = pytest.mark.pinned_torch_only


@pytest.fixture(scope="module")
def mlp_plan(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("explain") / "mlp.json"
    assert main(["plan", "mlp", "--mesh", "2x2", "-q", "--no-cache", "--out", str(path)]) == 0
    return str(path)


def _explain(capsys, *args) -> dict | list:
    assert main(["explain", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_explain_a_parameter_plans_without_its_placement(capsys, mlp_plan):
    plan = Plan.load(mlp_plan)
    r = _explain(capsys, mlp_plan, "layers.1.weight")
    node = plan.params["layers.1.weight"]
    assert r["kind"] == "parameter" and r["nodes"] == [node]
    assert r["chosen"] == [",".join(plan.nodes[node].placement())]
    assert r["alternative"] != r["chosen"]  # the choice was forbidden
    # the plan was optimal (within the solver's gap): nothing cheaper without the choice
    assert r["delta_s"] >= -1e-3 * r["cost_s"]
    # the parts of the difference add up to it
    assert sum(r["deltas_s"].values()) == pytest.approx(r["delta_s"], abs=1e-12)
    assert r["binds"]
    assert main(["explain", mlp_plan, "layers.1.weight", "--width", "200"]) == 0
    out = capsys.readouterr().out
    assert "the best plan without the choice" in out and "binds: " in out


def test_explain_a_module_changes_at_least_one_of_its_parameters(capsys, mlp_plan):
    r = _explain(capsys, mlp_plan, "layers.0")
    assert r["kind"] == "module" and len(r["nodes"]) == 2  # weight and bias
    assert r["alternative"] != r["chosen"]


def test_explain_all_ranks_every_parameter_group(capsys, mlp_plan):
    plan = Plan.load(mlp_plan)
    results = _explain(capsys, mlp_plan, "--all", "--top", "3")
    assert len(results) == 3 <= len(plan.params)
    deltas = [r["delta_s"] for r in results]
    assert deltas == sorted(deltas)
    assert all(r["alternative"] != r["chosen"] for r in results)


def test_explain_bad_targets_and_plans_are_one_line(capsys, mlp_plan, tmp_path):
    assert main(["explain", mlp_plan, "layer.1.weight"]) == 2
    err = capsys.readouterr().err
    assert "did you mean layers.1.weight" in err and len(err.strip().splitlines()) == 1
    # a plan that does not record its model (made from Python): --model is needed
    plan = Plan.load(mlp_plan)
    assert plan.source["model"] == "mlp"
    stats = {k: v for k, v in plan.stats.items() if k != "source"}
    plan = dataclasses.replace(plan, stats=stats, source={})
    bare = tmp_path / "bare.json"
    plan.save(bare)
    assert main(["explain", str(bare), "head.weight"]) == 2
    assert "give --model MODEL" in capsys.readouterr().err
    # another model's step is not this plan's
    assert main(["explain", str(bare), "head.weight", "--model", "gpt"]) == 2
    err = capsys.readouterr().err
    assert "trace to graph" in err and len(err.strip().splitlines()) == 1

"""Activation checkpointing (passes/remat): what a layer recomputes, and the step it makes.

On one device the checkpointed step, rewritten as codegen rewrites it and run by an fx
Interpreter that frees each value after its last use, must compute the same values as the
step without checkpointing, to the bit, and peak at the bytes passes/memory predicts, to the
byte.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

import autopar
from autopar.core import roles
from autopar.models import EXAMPLES, mse_loss
from autopar.passes import remat
from autopar.passes import solve as solve_pass
from autopar.passes.fold import fold_regions
from autopar.passes.memory import liveness, measure, simulate
from autopar.passes.solve import branches, highs
from autopar.passes.strategies import build_strategies
from autopar.passes.trace import trace_step
from autopar.verify import run_measured

MESH = autopar.Mesh((1,), ("dp",), device="cpu")


def _space(model, inputs, loss_fn, targets, mesh=MESH):
    with contextlib.ExitStack() as stack:
        step = trace_step(model, inputs, loss_fn=loss_fn, example_targets=targets, stack=stack)
    return step, build_strategies(step, mesh, folded=fold_regions(step))


def test_each_layer_recomputes_its_inside_and_keeps_its_boundary():
    torch.manual_seed(0)
    model, inputs, loss_fn, targets = EXAMPLES["gpt"]()
    _, space = _space(model, inputs, loss_fn, targets)
    found = remat.candidates(space)
    assert [c.region for c in found] == ["blocks.0", "blocks.1"]
    assert {c.group for c in found} == {"blocks.0"}  # folded: one choice for both
    index = {n: i for i, n in enumerate(space.order)}
    for c in found:
        assert c.nodes and set(c.moved) <= set(c.nodes)
        for n in c.nodes:
            assert space.roles[n] == roles.FORWARD and space.regions[n] == c.region
            assert index[n] < index[c.before]
        assert space.roles[c.before] == roles.BACKWARD
        assert space.regions[c.before] == c.region
        # the layer's output (the residual stream) is read by the next layer: kept
        users = {n: [] for n in space.order}
        for n in space.order:
            for src, _ in space.in_sources[n]:
                users[src].append(n)
        for n in c.nodes:
            assert all(space.regions.get(u) == c.region for u in users[n])


class _Dropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 16))
            for _ in range(2)
        )

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_random_ops_are_kept_not_recomputed():
    model = _Dropout().train()
    _, space = _space(model, (torch.randn(8, 16),), mse_loss, (torch.randn(8, 16),))
    found = remat.candidates(space)
    assert found
    for c in found:
        inside = [n for n, r in space.regions.items() if r == c.region]
        random = [n for n in inside if _random(space.targets[n])]
        assert random  # the layer draws random numbers ...
        assert not set(random) & set(c.nodes)  # ... and keeps them


def _random(target) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


def test_nothing_checkpointed_is_the_step_without_checkpointing():
    torch.manual_seed(0)
    model, inputs, loss_fn, targets = EXAMPLES["hf-llama"]()
    _, space = _space(model, inputs, loss_fn, targets)
    found = remat.candidates(space)
    plain = measure(liveness(space), lambda n, o: None, lambda n, j: None, "none")
    offered = measure(liveness(space, found), lambda n, o: None, lambda n, j: None, "none")
    assert offered.timeline == plain.timeline
    assert offered.by_category == plain.by_category
    every = measure(
        liveness(space, found),
        lambda n, o: None,
        lambda n, j: None,
        "none",
        {c.group for c in found},
    )
    assert every.peak_bytes < plain.peak_bytes
    assert every.at_peak["activations"] < plain.at_peak["activations"]
    copies = [n for n, _ in every.timeline if n.startswith(remat.COPY)]
    assert len(copies) == sum(len(c.nodes) for c in found)


def test_the_layers_are_offered_to_checkpoint_only_once_a_plan_exceeds_the_budget(monkeypatch):
    # the solver measures its plans on the step as traced until one exceeds the budget,
    # then on the step in which any layer may be checkpointed (passes/solve ``_Lives``):
    # the same bytes at the traced points (the test above), found only where needed
    found = []
    real = remat.candidates
    monkeypatch.setattr(remat, "candidates", lambda space: found.append(space) or real(space))
    torch.manual_seed(0)
    example = EXAMPLES["gpt"]()
    roomy = _plan(example, 1.5)
    assert found == [] and not roomy.recompute
    assert roomy.stats["peak_bytes"] <= roomy.stats["memory_budget"]
    tight = _plan(example, 0.85)
    assert len(found) == 1 and len(tight.recompute) == 2


def _plan(example, fraction: float, mesh: autopar.Mesh = MESH) -> autopar.Plan:
    """The plan of a zoo ``example`` on ``mesh`` (default: one CPU device) within
    ``fraction`` of its step's memory, without an optimizer."""
    model, inputs, loss_fn, targets = example
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(
            model,
            mesh,
            inputs,
            loss_fn=loss_fn,
            example_targets=targets,
            memory_fraction=fraction,
            optimizer="none",
        )


@pytest.mark.parametrize(
    "fraction, checkpointed, want",
    [
        # the relaxation at r = 1 is the lower: that branch first; r = 0's bound is above
        # its plan, and r = 0 is not solved
        (0.3, True, [[1.0]]),
        # a round at r = 0 alone (r = 1's bound above its plan), then one whose r = 0
        # plan is above r = 1's bound: both branches solved, r = 1's plan kept
        (0.4, True, [[0.0], [0.0], [1.0]]),
        # r = 0 first, and r = 1's bound is above its plan
        (0.5, False, [[0.0]]),
    ],
)
def test_the_solver_branches_on_checkpointing_and_finds_the_plan_of_the_whole_ilp(
    monkeypatch, fraction, checkpointed, want
):
    # passes/solve ``branches.by_checkpointing``: the relaxations at r = 0 and r = 1 order the
    # branches; the second is solved only where its relaxation is below the first's plan.
    # The plan is that of the ILP solved whole (big-M terms for r), its objective within
    # the gap
    solved = []  # each branch solved: the checkpointing flags it fixed
    real = highs.solve_copy

    def solve_copy(model, *args, **kwargs):
        flags = [v for v in model.variable if v.name.startswith("r_")]
        solved.append([v.upper_bound for v in flags if v.lower_bound == v.upper_bound])
        return real(model, *args, **kwargs)

    monkeypatch.setattr(highs, "solve_copy", solve_copy)
    torch.manual_seed(0)
    example = EXAMPLES["gpt"]()
    mesh = autopar.Mesh((4,), ("dp",), device="cpu")
    split = _plan(example, fraction, mesh)
    assert bool(split.recompute) == checkpointed
    assert split.stats["peak_bytes"] <= split.stats["memory_budget"]
    assert solved == want
    monkeypatch.setattr(branches, "by_checkpointing", lambda *a: None)
    whole = _plan(example, fraction, mesh)
    assert {r.region for r in whole.recompute} == {r.region for r in split.recompute}
    assert whole.cost["objective_s"] == pytest.approx(
        split.cost["objective_s"], rel=solve_pass.MIP_GAP
    )


@pytest.mark.parametrize("name, fraction", [("gpt", 0.85), ("hf-llama", 0.8)])
def test_checkpointed_step_computes_the_same_and_peaks_as_predicted(name, fraction):
    torch.manual_seed(0)
    model, inputs, loss_fn, targets = EXAMPLES[name]()
    plan = _plan((model, inputs, loss_fn, targets), fraction)
    # one device cannot shard: only checkpointing meets the budget
    assert len(plan.recompute) == 2
    step, space = _space(model, inputs, loss_fn, targets)
    report = simulate(space, plan, optimizer="none")
    assert report.peak_bytes <= plan.stats["memory_budget"]
    # a checkpointed step runs in traced order: the order stage's traced peak is its peak
    assert plan.stats["traced_peak_bytes"] == report.peak_bytes
    gm, copy_of = remat.checkpointed(step.gm, plan.recompute)
    assert len(copy_of) == sum(len(r.nodes) for r in plan.recompute)
    gm.graph.eliminate_dead_code()  # as codegen: an original nothing reads any more goes
    gm.recompile()
    got, peak = run_measured(gm, step, model, inputs, targets)
    want, _ = run_measured(step.gm, step, model, inputs, targets)
    assert report.peak_bytes == peak, (report.at_peak, peak)
    got, want = tree_flatten(got)[0], tree_flatten(want)[0]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b

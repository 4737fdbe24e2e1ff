"""The step memory simulator (passes/memory) against what the step really allocates.

On one device the simulated peak must equal, to the byte, the peak of live storages when the
step runs for real, in the order the plan runs it (passes/order): an fx Interpreter frees each value after its last use (as the
compiled step does) under a ``TorchDispatchMode`` that sees every tensor an op returns and
counts a storage live while any tensor on it is alive. On a sharded plan, the parameter and
optimizer bytes are the local shards'.
"""

from __future__ import annotations

import contextlib
import gzip
import math
import warnings
from pathlib import Path

import pytest
import torch

import autopar
from autopar.core import local_shape
from autopar.models import EXAMPLES
from autopar.passes import order
from autopar.passes.fold import fold_regions
from autopar.passes.memory import CATEGORIES, simulate
from autopar.passes.strategies import build_strategies
from autopar.passes.trace import trace_step
from autopar.verify import build_example, run_measured


def _traced(name, mesh, mp_policy=None, **plan_kwargs):
    torch.manual_seed(0)
    model, inputs, loss_fn, targets = EXAMPLES[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(
            model,
            mesh,
            inputs,
            loss_fn=loss_fn,
            example_targets=targets,
            mp_policy=mp_policy,
            **plan_kwargs,
        )
    stack = contextlib.ExitStack()
    with stack:
        step = trace_step(
            model,
            inputs,
            loss_fn=loss_fn,
            example_targets=targets,
            stack=stack,
            mp_policy=mp_policy,
        )
    return model, inputs, targets, plan, step, build_strategies(step, mesh)


MP = autopar.MixedPrecision(torch.bfloat16, torch.float32)


@pytest.mark.parametrize(
    "name, mp_policy",
    [("mlp", None), ("gpt-tied", None), ("hf-llama", None), ("hf-llama", MP)],
    ids=["mlp", "gpt-tied", "hf-llama", "hf-llama-bf16-mixed"],
)
def test_simulated_peak_is_the_measured_peak_on_one_device(name, mp_policy):
    model, inputs, targets, plan, step, space = _traced(
        name, autopar.Mesh((1,), ("dp",), device="cpu"), mp_policy
    )
    report = simulate(space, plan, optimizer="none")
    # the step in the order it runs (passes/order's, where it chose another than traced)
    _, peak = run_measured(order.apply(step.gm, plan.order), step, model, inputs, targets)
    assert report.peak_bytes == peak, (report.at_peak, peak)
    assert report.at_peak["optimizer_state"] == 0
    assert sum(report.at_peak.values()) == report.peak_bytes
    assert set(report.at_peak) == set(CATEGORIES)
    # the step holds what the backward needs (at the peak, unless the order moved it)
    assert max(report.by_category["activations"]) > 0
    assert report.at_peak["activations"] > 0 or plan.order
    assert max(total for _, total in report.timeline) == report.peak_bytes


def _golden_gpt_2x2():
    """The CPU profile's budget-bound plan of the gpt example on (2, 2), read from its
    golden file (which test_golden_plans checks is the plan the search makes, as the search
    would take 30 s here), the step's space and the model (on meta)."""
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
    golden = Path(__file__).resolve().parent.parent / "golden" / "gpt-2x2-cpu-mem0.5.json.gz"
    plan = autopar.Plan.from_json(gzip.decompress(golden.read_bytes()).decode())
    model, inputs, loss_fn, targets = build_example("gpt", batch=8)  # as cli.plan_example
    model = model.to("meta")
    with contextlib.ExitStack() as stack, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = trace_step(
            model,
            tuple(t.to("meta") for t in inputs),
            loss_fn=loss_fn,
            example_targets=tuple(t.to("meta") for t in targets),
            stack=stack,
        )
    assert step.fingerprint() == plan.fingerprint
    return plan, build_strategies(step, mesh, folded=fold_regions(step)), model, mesh


@pytest.mark.pinned_torch_only
def test_sharded_parameters_and_adamw_state_are_the_local_shards():
    # (the accounting is the device's bytes alone)
    plan, space, model, mesh = _golden_gpt_2x2()
    report = simulate(space, plan, optimizer="adamw")
    named = dict(model.named_parameters())
    local = {
        n: math.prod(local_shape(tuple(named[n].shape), ps, mesh.shape))
        for n, ps in plan.param_placements.items()
        if n in named
    }
    assert sum(local.values()) < sum(p.numel() for p in model.parameters())  # it shards
    assert report.at_peak["parameters"] == 4 * sum(local.values())  # float32
    assert report.at_peak["optimizer_state"] == 2 * 4 * sum(local.values())
    # the plan redistributes somewhere: a collective buffer is live at that node
    assert plan.collectives
    # the plan carries the timeline by category, and it round-trips through JSON
    step = plan.memory["step"]
    tl = step["timeline"]
    # every node, then the return
    assert len(tl["nodes"]) == plan.stats["nodes"] + 1 and tl["nodes"][-1] == "output"
    assert set(tl) == {"nodes", *CATEGORIES}
    totals = [sum(tl[c][i] for c in CATEGORIES) for i in range(len(tl["nodes"]))]
    assert max(totals) == step["peak_bytes"] == report.peak_bytes
    assert tl["nodes"][totals.index(max(totals))] == step["peak_node"]
    assert autopar.Plan.from_json(plan.to_json()).memory == plan.memory
    # the solver bounded what the report says
    assert step["peak_bytes"] <= plan.stats["memory_budget"]
    sgd = simulate(space, plan, optimizer="sgd")
    assert sgd.at_peak["optimizer_state"] == 0
    assert sgd.peak_bytes < report.peak_bytes
    with pytest.raises(ValueError, match="optimizer 'lion'"):
        simulate(space, plan, optimizer="lion")


def test_a_liveness_made_from_the_last_ones_half_is_the_one_made_afresh(monkeypatch):
    """``liveness`` keeps what depends on the order and the checkpointed layers alone from
    its last call (``StrategySpace.derived``): a plan's step after the solver's (the same
    order and layers, its buckets' issue points and holds its own), and each after another
    order's, is the step read on a space that kept nothing, and is made from it once."""
    from autopar.passes import memory, remat

    plan, space, _, _ = _golden_gpt_2x2()
    layers = tuple(remat.candidates(space))  # (every layer's copies: their storages too)
    assert layers
    backward = [n for n in space.order if space.roles[n] == "backward"]
    grads = [k for k in space.sinks if k.like is not None][:3]
    early = {k.position: backward[len(backward) // 2] for k in grads}  # bucket issue points
    held = {grads[0].position: backward[-1]}
    placeholders = [n for n in space.order if space.targets[n] == "placeholder"]
    other = placeholders[::-1] + [n for n in space.order if n not in set(placeholders)]
    made = []

    class Counted(memory._LifeBase):
        def __init__(self, *args):
            made.append(args[2])
            super().__init__(*args)

    monkeypatch.setattr(memory, "_LifeBase", Counted)

    def afresh(**kw):
        space.derived.clear()
        return memory.liveness(space, layers, **kw)

    want = afresh(early=early, held=held)
    want_other = afresh(early=early, order=other)
    space.derived.clear()
    made.clear()
    memory.liveness(space, layers)  # (the solver's: no buckets)
    assert memory.liveness(space, layers, early=early, held=held) == want
    assert memory.liveness(space, layers, early=early, order=other) == want_other
    assert memory.liveness(space, layers, early=early, held=held) == want
    assert made == [None, other, None]  # one per change of the order
    assert want.early and want.held and want != memory.liveness(space, layers)


def test_placements_made_afresh_at_each_call_are_sized_as_their_own(monkeypatch):
    """``measure`` sizes each shape once per placement object (a deep step's layers share
    them): placements made afresh at every call, each freed before the next (whose id may
    then be the freed one's), are each sized as they are."""
    from autopar.passes import memory

    plan, space, _, _ = _golden_gpt_2x2()
    want = simulate(space, plan, optimizer="adamw")
    kept = memory.plan_placements

    def afresh(plan):
        out_ps, in_ps = kept(plan)

        def copy(ps):
            return None if ps is None else tuple(list(ps))

        return (lambda n, o: copy(out_ps(n, o))), (lambda n, j: copy(in_ps(n, j)))

    monkeypatch.setattr(memory, "plan_placements", afresh)
    got = simulate(space, plan, optimizer="adamw")
    assert got.by_category == want.by_category and got.peak_bytes == want.peak_bytes


def test_a_peak_bound_from_another_plans_peak_is_at_least_the_plans_peak():
    """``peak_bound``: from one plan's measured peak and the nodes another changes, at least
    the other's peak (and the peak itself where nothing changed), on the step with every
    layer's copies, one layer checkpointed: from a plan that shards what it can, others
    that replicate some nodes (their storages, optimizer state, reshards and outputs
    grow), and random plans."""
    import random

    from autopar.passes import memory, remat

    _, space, _, _ = _golden_gpt_2x2()
    layers = tuple(remat.candidates(space))
    lv = memory.liveness(space, layers)
    recompute = {layers[0].group}
    rng = random.Random(3)

    def placements(choice):
        pick = {n: space.strategies[n][k] for n, k in choice.items()}
        return (lambda n, o: pick[n].out[o]), (lambda n, j: pick[n].ins[j])

    def peak(choice):
        return memory.measure(lv, *placements(choice), "adamw", recompute, layout=False).peak_bytes

    def shards(s):
        return sum(type(p).__name__ == "Shard" for ps in s.out if ps for p in ps)

    several = [n for n in space.order if len(space.strategies[n]) > 1]
    sharded = {
        n: max(range(len(ss)), key=lambda k: shards(ss[k])) for n, ss in space.strategies.items()
    }
    replicated = {
        n: min(range(len(space.strategies[n])), key=lambda k: shards(space.strategies[n][k]))
        for n in several
    }
    cases = []
    for share in (0.02, 0.1, 0.5):
        for _ in range(4):
            moved = rng.sample(several, max(1, int(share * len(several))))
            cases.append((sharded, moved, {**sharded, **{n: replicated[n] for n in moved}}))
            base = {n: rng.randrange(len(space.strategies[n])) for n in space.order}
            other = {**base, **{n: rng.randrange(len(space.strategies[n])) for n in moved}}
            cases.append((base, moved, other))
    grew = 0
    for base, moved, other in cases:
        was, now = peak(base), peak(other)
        same = memory.peak_bound(
            lv, placements(base), placements(base), [], was, "adamw", recompute
        )
        assert same == was
        bound = memory.peak_bound(
            lv, placements(base), placements(other), moved, was, "adamw", recompute
        )
        assert bound >= now, (len(moved), bound, now)
        grew += now > was
    assert grew >= 10  # (most cases raise the peak: a bound of the old peak would fail)
    # a parameter replicated, the rest as sharded: it and its optimizer state grow at every
    # point, what its readers gather shrinks; the peak grows by exactly its growth where
    # the sharded plan's peak gathers none of it
    was = peak(sharded)
    exact = 0
    for n in [n for n in space.params.values() if n in replicated]:
        other = {**sharded, n: replicated[n]}
        bound = memory.peak_bound(
            lv, placements(sharded), placements(other), [n], was, "adamw", recompute
        )
        now = peak(other)
        assert bound >= now
        exact += bound == now > was
    assert exact >= 8  # (12 of its 37 parameters)
    with pytest.raises(ValueError, match="buckets"):
        memory.peak_bound(
            memory.liveness(space, (), early={space.sinks[-1].position: space.order[-2]}),
            placements(sharded), placements(sharded), [], 0,
        )  # fmt: skip


def test_a_gather_along_a_dim_inner_in_memory_holds_its_copy_along_the_dim_too():
    """``reshard_bytes``: the collective gathers along the dim outermost in memory, so a
    gather along another also holds the copy that lays it out along its dim (and a
    transposed tensor, which codegen redistributes in its memory order, the other way
    round); a reduce-scatter along such a dim holds its input laid out first."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    from autopar.passes.memory import reshard_bytes

    whole = 8 * 4 * 4  # float32 (8, 4)
    for dim, layout, held in [
        (0, None, whole),
        (1, None, 2 * whole),
        (0, (1, 0), 2 * whole),  # (transposed: dim 1 is the outermost in memory)
        (1, (1, 0), whole),
    ]:
        got = reshard_bytes((8, 4), torch.float32, (Shard(dim),), (Replicate(),), (2,), layout)
        assert got == held, (dim, layout)
    assert reshard_bytes((8, 4), torch.float32, (Partial(),), (Shard(1),), (2,)) == whole * 3 // 2
    assert reshard_bytes((8, 4), torch.float32, (Partial(),), (Shard(0),), (2,)) == whole // 2


class _Viewed(torch.nn.Module):
    """A product viewed twice into the next one's input: the backward reads the second
    view (the weight's gradient), not the product."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16, bias=False)
        self.b = torch.nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.b(self.a(x).view(32, 8).view(64, 4))


def _squares(y, t):
    return ((y - t) ** 2).sum()


def test_a_reshard_into_a_view_is_the_views_storage_and_frees_what_it_views():
    """A gather into a view's input: the gathered buffer is what the view, its view and
    the backward's read of that then hold (to the last reader), and the product it views
    is read no more (freed after the view); a reshard into the second view in turn frees
    the first's buffer. Measured against the plan that keeps the product's placement
    into both views, on the step's every point; passes/order's model of the step gives
    the same bytes at every node."""
    import dataclasses

    from autopar.passes import memory

    torch.manual_seed(0)
    model, x, t = _Viewed(), torch.randn(16, 8), torch.randn(64, 4)
    mesh = autopar.Mesh((2,), ("dp",), device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, mesh, (x,), loss_fn=_squares, example_targets=(t,))
    with contextlib.ExitStack() as stack:
        step = trace_step(model, (x,), loss_fn=_squares, example_targets=(t,), stack=stack)
    space = build_strategies(step, mesh)
    lv = memory.liveness(space)
    forward = [h for h in lv.viewed if space.roles[h.node] == "forward"]
    (first,) = [h for h in forward if space.targets[h.src] is torch.ops.aten.mm.default]
    (second,) = [h for h in forward if h.src == first.node]
    last = second.last
    assert space.roles[lv.order[last]] == "backward"  # (the weight gradient's product)
    whole = 16 * 16 * 4
    half = whole // 2

    def placed(into_first: str, into_second: str):
        nodes = dict(plan.nodes)
        nodes[first.src] = dataclasses.replace(nodes[first.src], out=(("S(0)",),))
        for h, into in ((first, into_first), (second, into_second)):
            nodes[h.node] = dataclasses.replace(nodes[h.node], ins=((into,),))
        nodes[first.node] = dataclasses.replace(nodes[first.node], out=((into_first,),))
        nodes[second.node] = dataclasses.replace(nodes[second.node], out=((into_second,),))
        for n in space.order:  # (the second view's readers take it as it is made)
            ins = [(into_second,) if s == (second.node, 0) else p for s, p in
                   zip(space.in_sources[n], nodes[n].ins)]  # fmt: skip
            nodes[n] = dataclasses.replace(nodes[n], ins=tuple(ins))
        return dataclasses.replace(plan, nodes=nodes, collectives=(), order=())

    plans = {
        "kept": placed("S(0)", "S(0)"),
        "gathered": placed("R", "R"),
        "cut": placed("R", "S(0)"),
    }
    reports = {k: memory.simulate(space, p, optimizer="none") for k, p in plans.items()}
    totals = {k: [total for _, total in r.timeline] for k, r in reports.items()}
    assert [n for n, _ in reports["kept"].timeline] == [*lv.order, "output"]
    held = {i: whole - half for i in range(first.at + 1, last + 1)}
    for k, want in [
        # the whole product gathered beside the half (the view's reshard), then the whole
        # held instead of the half, to the backward's read
        ("gathered", {**held, first.at: whole}),
        # and the second view's half made from it (the whole freed after it)
        ("cut", {first.at: whole, second.at: whole}),
    ]:
        more = [b - a for a, b in zip(totals["kept"], totals[k])]
        assert more == [want.get(i, 0) for i in range(len(more))], k
    for k, report in reports.items():
        problem = order._Problem(space, step.gm, plans[k])
        each: list[int] = []
        problem.sweep(range(len(problem.names)), each)
        want = dict(report.timeline)
        assert each == [want[n] for n in problem.names]

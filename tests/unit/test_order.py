"""Operator order (passes/order): the order chosen lowers the step's peak, runs what the
traced order runs bit for bit, and is the order the emitted step runs.

The model where order matters: k branches, each a wide temporary (a linear layer's output
repeated, times two: nothing of it is saved for the backward) summed back to narrow. The
traced order makes every wide temporary before summing any; the best order sums each as
soon as it is made, holding one at a time.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

# NOTE: private testing module: torch has no public fake process group (test_codegen.py)
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._pytree import tree_leaves

import autopar
from autopar.passes import order
from autopar.passes.codegen import codegen
from autopar.passes.memory import simulate
from autopar.passes.remat import storage_map
from autopar.passes.strategies import build_strategies
from autopar.passes.trace import trace_step
from autopar.verify import run_measured

from helpers import plan_quietly

K, D, WIDE = 4, 32, 64


class Branches(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.ins = nn.ModuleList(nn.Linear(D, D) for _ in range(K))
        self.dropout = dropout

    def forward(self, x):
        wide = [
            nn.functional.dropout(lin(x).repeat(1, WIDE) * 2.0, self.dropout, self.training)
            for lin in self.ins
        ]
        return torch.stack([w.sum(-1) for w in wide], -1)


def _loss(y, t):
    return (y * t).sum()


def _example():
    torch.manual_seed(0)
    return torch.randn(8, D, dtype=torch.float64), torch.randn(8, K, dtype=torch.float64)


def _planned(model, mesh, **kwargs):
    x, t = _example()
    model = model.double()
    plan = plan_quietly(model, mesh, (x,), loss_fn=_loss, example_targets=(t,), **kwargs)
    with contextlib.ExitStack() as stack:
        step = trace_step(model, (x,), loss_fn=_loss, example_targets=(t,), stack=stack)
    return model, (x,), (t,), plan, step


ONE = autopar.Mesh((1,), ("dp",), device="cpu")


def test_the_order_lowers_the_measured_peak_and_computes_the_same_bits():
    model, inputs, targets, plan, step = _planned(Branches(), ONE)
    assert plan.order, plan.stats
    assert plan.stats["order"] and plan.stats["order_moved"] > 0
    # every node once, placeholders first as traced
    names = [n.name for n in step.gm.graph.nodes if n.op != "output"]
    assert sorted(plan.order) == sorted(names)
    n_ph = len(step.placeholders())
    assert list(plan.order[:n_ph]) == names[:n_ph]
    reordered = order.apply(step.gm, plan.order)
    out_traced, peak_traced = run_measured(step.gm, step, model, inputs, targets)
    out_ordered, peak_ordered = run_measured(reordered, step, model, inputs, targets)
    # the same loss and gradients, to the bit (float64)
    flat_traced, flat_ordered = tree_leaves(out_traced), tree_leaves(out_ordered)
    assert len(flat_traced) == len(flat_ordered) >= 1 + 2 * K  # the loss, the gradients
    for a, b in zip(flat_traced, flat_ordered):
        assert (a is None and b is None) or torch.equal(a, b)
    # measured: one wide temporary at a time instead of K
    wide = 8 * D * WIDE * 8  # one branch's wide temporary, float64
    assert peak_traced - peak_ordered >= (K - 2) * wide, (peak_traced, peak_ordered)
    # the simulator measures the order that runs, to the byte, and the plan says so
    space = build_strategies(step, ONE)
    assert simulate(space, plan, optimizer="none").peak_bytes == peak_ordered
    assert plan.memory["step"]["peak_bytes"] < plan.stats["traced_peak_bytes"]
    # the traced order's peak, taken from the solver's measurement: that step's, measured
    traced = simulate(space, dataclasses.replace(plan, order=()), optimizer="adamw")
    assert plan.stats["traced_peak_bytes"] == traced.peak_bytes


def test_a_gradients_view_runs_right_after_what_it_views():
    """Not at the backward's end: the gradient's bucket (passes/buckets) is issued after
    it, and a bucket issued at the end overlaps nothing."""
    model, inputs, targets, plan, step = _planned(Branches(), ONE)
    assert plan.order
    at = {n: i for i, n in enumerate(plan.order)}
    outputs = next(n for n in step.gm.graph.nodes if n.op == "output").args[0]
    views = [
        o
        for o in outputs
        if o is not None and o.target in (torch.ops.aten.t.default, torch.ops.aten.view.default)
    ]
    assert len(views) == 2 * K  # each linear layer's weight and bias
    for v in views:
        (made,) = v.all_input_nodes
        assert at[v.name] == at[made.name] + 1, (v.name, made.name)


def test_the_order_is_deterministic_and_round_trips_through_json():
    *_, first, _ = _planned(Branches(), ONE)
    *_, second, _ = _planned(Branches(), ONE)
    assert first.order == second.order
    assert autopar.Plan.from_json(first.to_json()).order == first.order


def test_what_the_order_derives_from_the_graph_is_made_once_per_space_and_graph():
    """The storage map, the order's storage graph (its dependencies, storages, readers)
    are the same for every plan of a step (and its units for plans with the same neutral
    nodes): kept on the space (``StrategySpace.derived``) and read by each plan the overlap
    rounds judge; a space made by ``dataclasses.replace`` makes its own, and another graph
    its storage graph."""
    model, inputs, targets, plan, step = _planned(Branches(), ONE)
    space = build_strategies(step, ONE)
    first = order.order_step(space, step.gm, plan)
    made, graph = space.derived["order_graph"]
    assert made is step.gm
    units = space.derived["order_units"][2]
    again = order.order_step(space, step.gm, plan)
    assert again.order == first.order == list(plan.order)
    # the storage graph, and the units of a plan with the same neutral nodes, kept too
    assert space.derived["order_graph"][1] is graph
    assert space.derived["order_units"][2] is units
    assert storage_map(space) is storage_map(space)
    other = dataclasses.replace(space, order=list(space.order))
    assert other.derived == {}
    assert storage_map(other) is not storage_map(space) and storage_map(other) == storage_map(space)
    copied = copy.deepcopy(step.gm)
    assert order.order_step(space, copied, plan).order == first.order
    assert space.derived["order_graph"][0] is copied


def test_the_units_made_ahead_are_the_plans_where_it_reshards_into_no_neutral_node():
    """``prepare`` makes the units of a plan whose neutral nodes are the nodes that make no
    bytes (no reshard into one of them), before any plan: such a plan reads them, and
    orders as on a space that made none ahead; a plan that reshards into such a node makes
    its own, and orders as well."""
    two = autopar.Mesh((2,), ("dp",), device="cpu")
    model, inputs, targets, plan, step = _planned(Branches(), two)
    ahead = build_strategies(step, two)
    order.prepare(ahead, step.gm)
    made = ahead.derived["order_units"][2]
    graph = ahead.derived["order_graph"][1]
    got = order.order_step(ahead, step.gm, plan)
    assert ahead.derived["order_units"][2] is made  # read, not made again
    fresh = build_strategies(step, two)
    assert got.order == order.order_step(fresh, step.gm, plan).order
    p = order._Problem(fresh, step.gm, plan)
    p.searchable()
    assert p.neutral == graph.quiet
    assert made == order._make_units(graph, p.neutral)
    # a reshard into a view: that node is not neutral, and the plan's units are its own
    view = next(
        n
        for n in graph.names
        if graph.quiet[graph.names.index(n)]
        and str(ahead.targets[n]) == "aten.view.default"
        and plan.nodes[n].ins
    )
    was = plan.nodes[view]
    moved = "S(0)" if was.ins[0] != ("S(0)",) else "R"
    other = dataclasses.replace(
        plan,
        nodes={**plan.nodes, view: dataclasses.replace(was, ins=((moved,), *was.ins[1:]))},
    )
    got = order.order_step(ahead, step.gm, other)
    assert ahead.derived["order_units"][2] is not made
    again = build_strategies(step, two)
    assert got.order == order.order_step(again, step.gm, other).order
    q = order._Problem(again, step.gm, other)
    q.searchable()
    assert q.neutral != graph.quiet


def test_skipping_the_stage_keeps_the_traced_order():
    *_, plan, _ = _planned(Branches(), ONE, skip={"order"})
    assert plan.order == ()
    assert plan.stats["order"] is False


def test_random_ops_keep_their_relative_order():
    model, *_, plan, step = _planned(Branches(dropout=0.25), ONE)
    random = {
        n.name
        for n in step.gm.graph.nodes
        if n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded in n.target.tags
    }
    assert len(random) >= K
    traced = [n.name for n in step.gm.graph.nodes if n.name in random]
    chosen = [n for n in (plan.order or traced) if n in random]
    assert chosen == traced


def test_apply_refuses_an_order_that_is_not_the_steps():
    _, _, _, plan, step = _planned(Branches(), ONE)
    with pytest.raises(ValueError, match="every node"):
        order.apply(step.gm, plan.order[:-1])


@pytest.fixture
def fake_dp():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    finally:
        dist.destroy_process_group()


def test_the_emitted_step_runs_in_the_chosen_order(fake_dp):
    model, _, _, plan, _ = _planned(Branches(), autopar.Mesh((2,), ("dp",), device="cpu"))
    assert plan.order

    def forward_pattern(p):
        # codegen compiles the step's joint graph once: a fresh trace each time
        x, t = _example()
        with contextlib.ExitStack() as stack:
            step = trace_step(model, (x,), loss_fn=_loss, example_targets=(t,), stack=stack)
            graph = codegen(step, p, fake_dp).graphs["forward"]
        ops = {torch.ops.aten.repeat.default: "r", torch.ops.aten.sum.dim_IntList: "s"}
        return "".join(ops[n.target] for n in graph.graph.nodes if n.target in ops)

    # in the forward aot_autograd partitioned out of the local graph, each wide temporary
    # is summed before the next is made; in the traced order all are made first
    assert forward_pattern(plan) == "rs" * K
    assert forward_pattern(dataclasses.replace(plan, order=())) == "r" * K + "s" * K


def test_a_node_placed_before_its_input_waits_for_it():
    # (a neutral node hung on a reader that runs before another of its inputs)
    preds = [[], [0], [1], []]
    assert order._topological([2, 3, 0, 1], preds) == [3, 0, 1, 2]
    assert order._topological([0, 1, 2, 3], preds) == [0, 1, 2, 3]


def _random_orders(p, count: int, seed: int = 0):
    """``count`` random orders of the step's nodes: each topological, forward first."""
    import random

    rng = random.Random(seed)
    n = len(p.names)
    for _ in range(count):
        left = [len(p.preds[i]) for i in range(n)]
        users: list[list[int]] = [[] for _ in range(n)]
        for i in range(n):
            for a in p.preds[i]:
                users[a].append(i)
        ready = {i for i in range(n) if left[i] == 0}
        seq = []
        while ready:
            forward = [i for i in ready if not p.backward[i]]
            i = rng.choice(sorted(forward or ready))
            ready.remove(i)
            seq.append(i)
            for u in users[i]:
                left[u] -= 1
                if left[u] == 0:
                    ready.add(u)
        assert len(seq) == n
        yield seq


def test_no_order_peaks_below_the_bound_or_the_proven_least():
    model, *_, plan, step = _planned(Branches(), ONE)
    space = build_strategies(step, ONE)
    # searched whole (no window) and exactly (a beam wider than any layer): proven
    best = order.order_step(space, step.gm, plan, beam=10**5, window=10**5)
    assert best.stats["optimal"]
    assert best.stats["bound_bytes"] <= best.peak < best.traced_peak
    p = order._Problem(space, step.gm, plan)
    swept = [p.sweep(seq) for seq in _random_orders(p, 200)]
    peaks = [peak for peak, _ in swept]
    assert min(peaks) >= best.peak  # no sampled order below the proven least
    # live(forward) is the same in every order that runs the forward first, and below each
    held = {forward for _, forward in swept}
    assert len(held) == 1 and 0 < held.pop() <= min(peaks)
    assert max(peaks) > best.peak  # the orders differ (the check can see a difference)
    # cut into windows, the search proves nothing
    windowed = order.order_step(space, step.gm, plan, beam=10**5, window=4)
    assert not windowed.stats["optimal"]


def test_a_step_whose_peak_every_order_shares_is_proven_in_traced_order():
    from autopar.models import EXAMPLES

    torch.manual_seed(0)
    model, inputs, loss_fn, targets = EXAMPLES["gpt"]()  # the zoo's GPT, as planned
    plan = plan_quietly(model, autopar.Mesh((2,), ("dp",), device="cpu"), inputs,
                        loss_fn=loss_fn, example_targets=targets)  # fmt: skip
    # the peak is where the whole forward is held into the backward: no order lowers it
    assert plan.stats["order_bound_bytes"] == plan.stats["order_traced_bytes"]
    assert plan.stats["order_optimal"] and plan.stats["order_moved"] == 0
    assert plan.stats["order_searched"] == 0  # proven by the bound: nothing searched


def _ready_by_definition(space, fed) -> frozenset:
    """``ready_nodes``' docstring, from scratch: the model's state, and each operator that
    reads only it and such operators, is not fed by a reshard, and neither writes nor draws."""
    found = {n for n in space.order if space.roles[n] in ("param", "buffer")}
    for n in space.order:
        ins = space.in_sources[n]
        if space.targets[n] == "placeholder" or not ins or n in fed:
            continue
        if not order.mutates_or_draws(space.targets[n]) and all(s in found for s, _ in ins):
            found.add(n)
    return frozenset(found)


def test_what_a_reshard_into_the_model_states_computations_takes_away_is_the_definitions():
    """A GPT in bf16: each weight's cast, and what reads the cast (a transpose). Whatever
    ``fed`` takes away from the nodes made once is what the definition gives afresh, and a
    cast fed takes its readers with it."""
    from autopar.models import GPT, GPTConfig, cross_entropy_loss

    cfg = GPTConfig(vocab=64, seq=8, hidden=32, heads=2, layers=2, ffn=64)
    with torch.device("meta"):
        model = GPT(cfg)
    tokens = torch.zeros(2, cfg.seq, dtype=torch.long, device="meta")
    mp = autopar.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32)
    with contextlib.ExitStack() as stack:
        step = trace_step(model, (tokens,), loss_fn=cross_entropy_loss,
                          example_targets=(tokens,), stack=stack, mp_policy=mp)  # fmt: skip
        space = build_strategies(step, autopar.Mesh((2,), ("dp",), device="cpu"))
    every = order.ready_nodes(space)
    assert every == _ready_by_definition(space, ())
    made = [n for n in space.order if n in every and space.targets[n] != "placeholder"]
    casts = [
        n for n in made if any(s in made for n2 in made for s, _ in space.in_sources[n2] if s == n)
    ]
    assert len(made) > 10 and casts
    cases = [
        {made[0]},
        {made[len(made) // 2]},
        set(made[::3]),
        {casts[-1], "not a node"},
        set(casts),
    ]
    for fed in cases:
        fewer = order.ready_nodes(space, fed)
        assert fewer == _ready_by_definition(space, fed), sorted(fed)
    assert len(every - order.ready_nodes(space, {casts[0]})) >= 2  # the cast and its readers


def test_the_model_states_computations_are_made_once_and_a_reshard_into_one_takes_it_away():
    *_, plan, step = _planned(Branches(), ONE)
    space = build_strategies(step, ONE)
    every = order.ready_nodes(space)
    assert order.ready_nodes(space, fed={"a node made of activations"}) is every  # kept
    made = sorted(n for n in every if space.targets[n] != "placeholder")
    assert made  # (a weight's transpose)
    fed = made[0]
    fewer = order.ready_nodes(space, fed={fed})
    assert fed not in fewer and fewer < every
    # what reads it, and only model state besides, goes with it
    readers = {n for n in made if any(s == fed for s, _ in space.in_sources[n])}
    assert not readers & fewer
    assert fewer == order.ready_nodes(dataclasses.replace(space, order=list(space.order)), {fed})

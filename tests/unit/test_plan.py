import gzip
import json
import math
import re
import warnings
from pathlib import Path

import pytest
import torch

import autopar
from autopar import Mesh, Plan
from autopar.core import PlannedCollective
from autopar.models import GPT, MLP, GPTConfig, cross_entropy_loss, mse_loss
from autopar.passes.solve import SolveError

from helpers import staged_plan


def _gpt_plan(mesh, cfg=None, batch=4, **kw):
    cfg = cfg or GPTConfig(layers=1, hidden=32, heads=2, ffn=64, vocab=64, seq=8)
    with torch.device("meta"):
        model = GPT(cfg)
    tokens = torch.zeros(batch, cfg.seq, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(
            model, mesh, (tokens,), loss_fn=cross_entropy_loss, example_targets=(tokens,), **kw
        )


def test_plan_json_round_trips_exactly():
    plan = _gpt_plan(Mesh((2,), ("dp",)))
    again = Plan.from_json(plan.to_json(timings=True))
    assert again == plan
    assert again.to_json() == plan.to_json()
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()


def test_plan_json_reads_line_by_line():
    plan = _gpt_plan(Mesh((2,), ("dp",)), memory_fraction=0.6)  # sharded: collectives
    text = plan.to_json()
    lines = [line.rstrip(",") for line in text.splitlines()]
    # one line per node choice, per collective and per parameter: a short file
    for name, choice in plan.nodes.items():
        assert f'  "{name}": {json.dumps(choice.to_dict())}' in lines
    for c in plan.collectives:
        assert f"  {json.dumps(c.to_dict())}" in lines
    for name, node in plan.params.items():
        assert f'  "{name}": "{node}"' in lines
    # (besides: the outputs, one line per statistic, the parameter shapes among them)
    assert plan.collectives
    n_stats = len(plan.to_dict()["stats"])
    assert (
        len(lines) < len(plan.nodes) + len(plan.collectives) + 4 * len(plan.params) + n_stats + 30
    )
    assert json.loads(text) == plan.to_dict()


@pytest.mark.pinned_torch_only
def test_same_model_inputs_and_mesh_give_the_same_plan_json():
    mesh = Mesh((2, 2), ("dp", "tp"))
    assert _gpt_plan(mesh).to_json() == _gpt_plan(mesh).to_json()


def test_plan_records_param_placements_stats_and_summary():
    plan = _gpt_plan(Mesh((2,), ("dp",)))
    assert set(plan.param_placements) == {
        n
        for n, _ in GPT(
            GPTConfig(layers=1, hidden=32, heads=2, ffn=64, vocab=64, seq=8)
        ).named_parameters()
    }
    for placements in plan.param_placements.values():
        assert len(placements) == 1
    assert plan.stats["trace_s"] > 0 and plan.stats["search_s"] > 0
    assert plan.stats["variables"] > 0 and plan.solver_status == "optimal"
    text = plan.summary()
    assert "blocks.0.fc1.weight" in text and "estimated step time" in text


@pytest.mark.pinned_torch_only
def test_memory_budget_forces_parameters_to_be_sharded():
    mesh = Mesh((4,), ("dp",))
    one = _gpt_plan(Mesh((1,), ("dp",)))  # what one device holds for the whole step
    free = _gpt_plan(mesh, memory_budget=math.inf)
    assert all(p == ("R",) for p in (free.nodes[n].out[0] for n in free.params.values()))
    tight = _gpt_plan(mesh, memory_fraction=0.4)
    assert tight.memory_budget == int(0.4 * one.memory["step"]["peak_bytes"])
    assert tight.memory["step"]["peak_bytes"] <= tight.memory_budget
    assert free.memory["step"]["peak_bytes"] > tight.memory_budget
    assert any(p != ("R",) for p in (tight.nodes[n].out[0] for n in tight.params.values()))
    assert tight.cost["total_s"] >= free.cost["total_s"]


@pytest.mark.pinned_torch_only
def test_impossible_memory_budget_is_a_clear_error():
    mesh = Mesh((2,), ("dp",))
    # below what the parameters and their AdamW state take: said at once, with that floor
    with pytest.raises(SolveError, match="memory budget of 0.0 MiB") as e:
        _gpt_plan(mesh, memory_budget=1000)
    floor = e.value.floor_bytes
    assert floor is not None and e.value.least_bytes is None
    assert f"alone take at least {floor / 2**20:.1f} MiB ({floor} bytes)" in str(e.value)
    # above it, below every plan: the solver names the smallest budget that fits
    with pytest.raises(SolveError, match="smallest budget that fits") as e:
        _gpt_plan(mesh, memory_budget=floor + 1024)
    (least,) = re.findall(r"\((\d+) bytes\)", str(e.value))
    assert int(least) == e.value.least_bytes > floor
    assert "whose largest part is" in str(e.value)
    _gpt_plan(mesh, memory_budget=int(least))  # that one fits


def test_plan_takes_an_autopar_mesh():
    with pytest.raises(TypeError, match="autopar.Mesh"):
        autopar.plan(
            MLP(),
            (2, 2),
            (torch.randn(4, 16),),
            loss_fn=mse_loss,
            example_targets=(torch.randn(4, 8),),
        )


def test_mesh_checks_itself():
    with pytest.raises(ValueError, match="axis names"):
        Mesh((2, 2), ("dp",))
    with pytest.raises(ValueError, match="distinct"):
        Mesh((2, 2), ("dp", "dp"))
    assert Mesh((2, 4), ("dp", "tp")).size == 8


def test_mesh_ranks_per_node_puts_outer_axes_across_nodes():
    from autopar.cost_models import axis_link, get_profile

    h100 = get_profile("h100")
    intra = (h100.intra_node_latency, h100.intra_node_bandwidth)
    inter = (h100.inter_node_latency, h100.inter_node_bandwidth)
    two_nodes = Mesh((2, 2), ("dp", "tp"), ranks_per_node=2)
    assert axis_link(two_nodes, 1) == intra
    assert axis_link(two_nodes, 0) == inter
    assert axis_link(Mesh((2, 2), ("dp", "tp")), 0) == intra  # 8 H100s per node
    assert Mesh.from_dict(two_nodes.to_dict()) == two_nodes


def test_plan_step_on_a_traced_step_records_every_stage():
    import contextlib

    from autopar.passes.trace import trace_step

    cfg = GPTConfig(layers=1, hidden=32, heads=2, ffn=64, vocab=64, seq=8)
    tokens = torch.zeros(4, cfg.seq, dtype=torch.long)
    with contextlib.ExitStack() as stack, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = trace_step(
            GPT(cfg), (tokens,), loss_fn=cross_entropy_loss, example_targets=(tokens,), stack=stack
        )
        plan = autopar.plan_step(step, Mesh((2,), ("dp",)))
    n_nodes = sum(1 for n in step.gm.graph.nodes if n.op != "output")
    assert plan.stats["nodes"] == n_nodes
    for stage in ("trace", "fold", "strategies", "solve"):
        assert f"{stage}_s" in plan.stats, stage
    assert plan.stats["strategies"] > n_nodes and plan.stats["variables"] > 0


def test_the_plan_keeps_every_report_stage_statistics_when_prefetch_moves_a_reshard():
    # passes/prefetch returns a plan with a stats dict of its own; what the stages after
    # it record (the memory's peak, their times) must still reach the plan
    plan = _small_gpt_plan()
    assert plan.stats["prefetched"] >= 1  # the path under test: a reshard moved ahead
    for stage in ("order", "buckets", "prefetch", "memory"):
        assert f"{stage}_s" in plan.stats, stage
    assert plan.stats["step_peak_bytes"] == plan.memory["step"]["peak_bytes"]


def _small_gpt_plan(**kw) -> autopar.Plan:
    """A GPT on (2, 2) whose plan prefetches a reshard (h100: the overlap rounds run). At a
    batch of 8 it prefetched none once the h100 matmul curves were measured."""
    return _gpt_plan(Mesh((2, 2), ("dp", "tp")), _SMALL_GPT, batch=4, **kw)


_SMALL_GPT = GPTConfig(layers=2, hidden=128, heads=4, ffn=512, vocab=512, seq=64)


def _small_gpt_staged(fresh=False, **kw):
    """``_small_gpt_plan`` with the pipeline's state (tests/helpers ``staged_plan``)."""
    cfg = _SMALL_GPT
    with torch.device("meta"):
        model = GPT(cfg)
    tokens = torch.zeros(4, cfg.seq, dtype=torch.long, device="meta")
    return staged_plan(
        model, Mesh((2, 2), ("dp", "tp")), (tokens,), loss_fn=cross_entropy_loss,
        example_targets=(tokens,), fresh=fresh, **kw,
    )  # fmt: skip


def test_the_report_stages_take_the_kept_rounds_plan_and_it_is_the_plan_they_would_make():
    """The overlap rounds judge each round's plan by the step it emits (passes/emit); the
    report stages take what the kept round made of its solution, and that is the plan, the
    memory and the step length they make anew from the solution alone."""
    reused, state = _small_gpt_staged()
    rounds = reused.stats["overlap_rounds"]
    assert rounds  # on h100 the rounds judge the emitted step
    kept = state.emitter.of(state.solve)
    assert kept is not None and kept.prefetched is not None  # the kept round was judged
    # the stages took the round's plan rather than making it again
    assert state.plan.collectives is kept.prefetched.collectives
    assert reused.cost["total_s"] == kept.length == min(rounds)
    again, fresh = _small_gpt_staged(fresh=True)
    assert fresh.emitter.of(fresh.solve) is None  # (nothing to take: each stage made its own)
    assert reused.to_json() == again.to_json()
    assert reused.stats["prefetched"] == again.stats["prefetched"] >= 1
    assert reused.memory["step"] == again.memory["step"]
    assert reused.cost["total_s"] == pytest.approx(again.cost["total_s"], rel=1e-12)


def test_a_kept_plan_the_order_stage_reorders_is_made_again_in_that_order(monkeypatch):
    """The rounds judge their plans in the traced order; where the order stage orders the
    kept one otherwise, its buckets, prefetches, memory and step length are of that order:
    the plan the stages make with nothing taken from the rounds."""
    from autopar.core import roles
    from autopar.passes import emit, order

    def swapped(space, gm, plan):  # two forward nodes side by side, neither reading the other
        names = list(space.order)
        for k in range(len(names) - 1):
            a, b = names[k], names[k + 1]
            if (
                space.roles[a] == space.roles[b] == roles.FORWARD
                and not any(order.mutates_or_draws(space.targets[n]) for n in (a, b))
                and all(src != a for src, _ in space.in_sources[b])
            ):
                names[k], names[k + 1] = b, a
                return order.Ordering(names, traced_peak=2, peak=1)  # (changed)
        raise AssertionError("no two independent forward nodes side by side")

    monkeypatch.setattr(emit, "order_step", swapped)
    reordered, state = _small_gpt_staged()
    assert reordered.stats["order"] is True and reordered.order
    assert reordered.stats["overlap_rounds"] and state.emitter.of(state.solve) is not None
    # the rounds' plans were in the traced order: the stages after the order made theirs
    # again, as without the rounds' (and the step's length is simulated in this order)
    again, _ = _small_gpt_staged(fresh=True)
    assert reordered.to_json() == again.to_json()
    assert reordered.cost["total_s"] == pytest.approx(reordered.emitted_step_s(), rel=1e-12)


def test_the_budget_checks_measure_where_their_bound_may_pass_the_budget(monkeypatch):
    """The buckets' and the prefetches' budget checks skip measuring the step where the
    solver's peak and everything they hold beside it fit the budget (passes/prefetch
    ``_held_bound``). The bound holds on the plan, and a budget under it is measured and
    kept."""
    from autopar.passes import buckets, prefetch

    plan = _small_gpt_plan()
    early = {id(c) for c in plan.collectives if c.issue_after is not None}
    assert early and not plan.stats["prefetch_moved"]
    bound = prefetch._held_bound(plan, early, 0)
    peak = plan.memory["step"]["peak_bytes"]
    assert plan.solver_peak_bytes is not None and plan.solver_peak_bytes <= peak < bound
    measured = []
    for module in (buckets, prefetch):
        real = module.simulate

        def counted(*args, real=real, **kw):
            measured.append(args[1])
            return real(*args, **kw)

        monkeypatch.setattr(module, "simulate", counted)
    _small_gpt_plan()
    assert measured == []  # the device's budget: far above the bound
    budget = (peak + bound) // 2
    tight = _small_gpt_plan(memory_budget=budget)
    assert measured  # under the bound: measured
    assert tight.memory["step"]["peak_bytes"] <= budget


def test_planning_pauses_the_garbage_collector_and_gives_it_back(monkeypatch):
    import gc

    from autopar import api

    seen = []
    run = api.run_stages

    def recording(stages, *args, **kw):
        seen.append((stages[0].name, gc.isenabled(), gc.get_freeze_count() > 0))
        return run(stages, *args, **kw)

    monkeypatch.setattr(api, "run_stages", recording)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    _gpt_plan(Mesh((2,), ("dp",)))
    # planning and its report stages ran with the collector off and the graph frozen
    assert ("fold", False, True) in seen and ("order", False, True) in seen
    assert gc.isenabled() and gc.get_freeze_count() == 0
    # a process that turned the collector off keeps it off
    gc.disable()
    try:
        seen.clear()
        _gpt_plan(Mesh((2,), ("dp",)))
        assert ("fold", False, False) in seen and not gc.isenabled()
    finally:
        gc.enable()


def test_what_planning_made_is_freed_without_the_garbage_collector(monkeypatch):
    """Nothing the stages keep of the step (``StrategySpace.derived``: the memory stage's
    liveness, the order's graphs) holds the space in a cycle: a deep step's space is
    hundreds of thousands of objects, which a cycle leaves to the collection that ends
    planning (``_gc_paused``) to walk and free (at 96 layers, ~0.1-0.2 s of the search).
    Planned for a CUDA device: the overlap rounds' plans too."""
    import gc
    import weakref

    from autopar.passes import pipeline

    spaces = []
    build = pipeline.build_strategies

    def kept(*args, **kw):
        space = build(*args, **kw)
        spaces.append(weakref.ref(space))
        return space

    monkeypatch.setattr(pipeline, "build_strategies", kept)
    cfg = GPTConfig(layers=2, hidden=32, heads=2, ffn=64, vocab=64, seq=8)
    gc.collect()
    gc.disable()  # (planning then leaves it off: what is freed, reference counting frees)
    try:
        plan = _gpt_plan(Mesh((2, 2), ("dp", "tp"), device="h100"), cfg)
        assert len(spaces) == 1 and spaces[0]() is None
    finally:
        gc.enable()
    assert plan.memory["step"]["peak_bytes"] > 0


def test_the_garbage_a_search_leaves_does_not_grow_with_depth(monkeypatch):
    """What the search leaves in reference cycles, the collection that ends it
    (``_gc_paused``) walks and frees: a cycle made per node (a recursive closure, say) is
    garbage that grows with the step (at 96 layers, ~16,000 closures and ~0.08 s of the
    collection). Searched again on the same step (DTensor's rules then cached), a GPT of
    six layers leaves as little as one of two."""
    import contextlib
    import gc

    import autopar.api as api
    from autopar.api import plan_step
    from autopar.passes.trace import trace_step

    found: list[int] = []
    collect = gc.collect
    monkeypatch.setattr(api.gc, "collect", lambda *a: found.append(collect(*a)) or found[-1])
    mesh = Mesh((2, 2), ("dp", "tp"), device="h100")
    left = {}
    for layers in (2, 6):
        cfg = GPTConfig(layers=layers, hidden=32, heads=2, ffn=64, vocab=64, seq=8)
        with torch.device("meta"):
            model = GPT(cfg)
        tokens = torch.zeros(4, cfg.seq, dtype=torch.long, device="meta")
        with contextlib.ExitStack() as stack, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step = trace_step(model, (tokens,), loss_fn=cross_entropy_loss,
                              example_targets=(tokens,), stack=stack)  # fmt: skip
            plan_step(step, mesh)
            found.clear()
            plan_step(step, mesh)
        assert found, "the search ended without its collection"
        left[layers] = found[-1]
    assert left[6] - left[2] < 50, left


def test_a_plan_made_on_another_solutions_plan_is_the_plan_made_afresh():
    """``Plan.from_solution``'s ``base`` (an earlier overlap round's solution and plan):
    the node choices the two share are taken from it, the others made; the plan is the one
    made without it, node for node and in the same order."""
    import contextlib
    import dataclasses

    from autopar.passes.fold import fold_regions
    from autopar.passes.solve import solve
    from autopar.passes.strategies import build_strategies
    from autopar.passes.trace import trace_step

    cfg = GPTConfig(layers=2, hidden=32, heads=2, ffn=64, vocab=64, seq=8)
    with torch.device("meta"):
        model = GPT(cfg)
    tokens = torch.zeros(4, cfg.seq, dtype=torch.long, device="meta")
    with contextlib.ExitStack() as stack:
        step = trace_step(
            model, (tokens,), loss_fn=cross_entropy_loss, example_targets=(tokens,), stack=stack
        )
    space = build_strategies(step, Mesh((2, 2), ("dp", "tp")), folded=fold_regions(step))
    first = solve(space)
    # another solution: some nodes take another strategy (and cost), one another cost alone
    several = [n for n in space.order if len(space.strategies[n]) > 1]
    moved = several[:: max(1, len(several) // 5)]
    choice = dict(first.choice)
    cost = dict(first.node_cost_s)
    for n in moved:
        choice[n] = (choice[n] + 1) % len(space.strategies[n])
        cost[n] += 1e-3
    repriced = next(n for n in space.order if n not in moved)
    cost[repriced] += 2e-3
    other = dataclasses.replace(first, choice=choice, node_cost_s=cost)
    base = (first, Plan.from_solution(space, first, fingerprint="", stats={}))
    want = Plan.from_solution(space, other, fingerprint="", stats={})
    got = Plan.from_solution(space, other, fingerprint="", stats={}, base=base)
    assert list(got.nodes.items()) == list(want.nodes.items())
    assert got.to_json() == want.to_json()
    kept = [n for n in space.order if n not in moved and n != repriced]
    assert all(got.nodes[n] is base[1].nodes[n] for n in kept)  # taken, not made
    assert got.nodes[repriced].cost_s == base[1].nodes[repriced].cost_s + 2e-3


# each kind of entry as its producer wrote it when the entries were dicts, in its key order
ENTRIES = {
    "reshard": {
        "edge": "t->mm", "module": "blocks.0.fc1", "kind": "all_gather", "axis": "dp",
        "nbytes": 4096, "group_size": 2, "time_s": 1.5e-05,
    },
    "gradient reduction": {
        "edge": "mm_3->output[2] (as primals_2)", "param": "blocks.0.fc1.weight",
        "kind": "all_reduce", "axis": "dp", "nbytes": 4096, "group_size": 2, "time_s": 2e-05,
    },
    "prefetched reshard": {
        "edge": "t->mm", "module": "blocks.0.fc1", "kind": "all_gather", "axis": "dp",
        "nbytes": 4096, "group_size": 2, "time_s": 1.5e-05, "issue_after": "view_2",
    },
    "one-step bucket": {
        "edge": "mm_3->output[2,3] (bucket 0: 2 gradients)",
        "param": "2 gradients (blocks.0.fc1.weight, ...)",
        "params": ["blocks.0.fc1.weight", "blocks.0.fc1.bias"], "kind": "reduce_scatter",
        "axis": "dp", "nbytes": 8192, "group_size": 2, "time_s": 3e-05, "bucket": 0,
        "dtype": "float32", "op": "sum", "overlap": True, "wait_after": "mm_1",
    },
    "gloo bucket": {
        "edge": "mm_3->output[2,3] (bucket 0: 2 gradients)",
        "param": "2 gradients (blocks.0.fc1.weight, ...)",
        "params": ["blocks.0.fc1.weight", "blocks.0.fc1.bias"], "kind": "all_reduce",
        "axis": "dp", "nbytes": 8192, "group_size": 2, "time_s": 3e-05, "bucket": 0,
        "dtype": "float32", "op": "sum", "overlap": False,
    },
    "a step of a bucket of several": {
        "edge": "mm_3->output[2,3] (bucket 1: 2 gradients)",
        "param": "2 gradients (blocks.0.fc1.weight, ...)",
        "params": ["blocks.0.fc1.weight", "blocks.0.fc1.bias"], "kind": "all_reduce",
        "axis": "tp", "nbytes": 4096, "group_size": 2, "time_s": 3e-05, "bucket": 1,
        "dtype": "float32", "op": "sum", "overlap": True, "step": 1, "steps": 2,
        "step_after": "mm_1",
    },
}  # fmt: skip


@pytest.mark.parametrize("kind", list(ENTRIES))
def test_a_planned_collective_round_trips_each_kind_of_entry(kind):
    entry = ENTRIES[kind]
    record = PlannedCollective.from_dict(entry)
    assert record.to_dict() == entry
    assert list(record.to_dict()) == list(entry)  # the same key order: the same JSON text
    assert PlannedCollective.from_dict(record.to_dict()) == record
    assert record.edge == entry["edge"] and record.kind == entry["kind"]
    assert (record.bucket is not None) == ("bucket" in entry)
    assert record.issue_after == entry.get("issue_after")
    if "params" in entry:
        assert record.params == tuple(entry["params"])


GOLDEN = Path(__file__).resolve().parent.parent / "golden"


def test_saved_plans_read_back_to_the_same_json_and_typed_fields():
    """The committed plans, read into records and typed fields and written again, give the
    same text; the typed fields are the statistics they were written as. Between them they
    hold a reshard, a prefetched reshard, a bucket of gradient reductions, and one waited
    for where the next is issued, each in its producer's key order (``ENTRIES``)."""
    layouts = set()
    for path in sorted(GOLDEN.glob("*.json.gz")):
        text = gzip.decompress(path.read_bytes()).decode()
        plan = Plan.from_json(text)
        assert plan.to_json() == text, path.name
        assert all(isinstance(c, PlannedCollective) for c in plan.collectives)
        stats = json.loads(text)["stats"]
        assert plan.memory_budget == stats.get("memory_budget")
        assert plan.solver_peak_bytes == stats.get("peak_bytes")
        assert plan.overlaps_collectives is bool(stats.get("overlaps_collectives"))
        assert plan.solver_status == stats["status"]
        assert plan.folded is stats["fold"] and plan.source == stats.get("source", {})
        layouts |= {tuple(c) for c in json.loads(text)["collectives"]}
    held = ("reshard", "prefetched reshard", "one-step bucket", "gloo bucket")
    assert {tuple(ENTRIES[k]) for k in held} <= layouts  # (the last: a bucket's keys alone)


def test_a_made_plans_typed_fields_are_its_statistics():
    """``Plan.from_solution`` and the stages after it set the typed fields to what they
    record in ``stats``, so that a saved plan reads back equal."""
    plan = _gpt_plan(Mesh((2,), ("dp",), device="h100"), memory_fraction=0.6)
    assert plan.memory_budget == plan.stats["memory_budget"] > 0
    assert plan.solver_peak_bytes == plan.stats["peak_bytes"] > 0
    assert plan.overlaps_collectives is plan.stats["overlaps_collectives"] is True
    assert plan.solver_status == plan.stats["status"] == "optimal"
    assert plan.folded is plan.stats["fold"] is True and plan.source == {}
    assert Plan.from_json(plan.to_json(timings=True)) == plan

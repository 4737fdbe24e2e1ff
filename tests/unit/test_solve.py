"""The solver on small hand-made strategy spaces whose optimum is known, and on one traced
Llama layer where its options change the plan.

Two chained matmuls ``y = (x @ w1) @ w2`` with a replicated loss: each matmul may run
replicated, column-parallel (``R, S(1) -> S(1)``), row-parallel (``S(1), S(0) -> P``) and,
where the batch allows, data-parallel (``S(0), R -> S(0)``). The optimum is found by brute
force over every combination (the space is small), priced with the same cost models the
solver uses, and the solver must find it.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re
import threading
import types
import warnings

import pytest
import torch
from ortools.linear_solver import linear_solver_pb2, pywraplp
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar.passes.solve as solve_pass
from autopar.core import Edge, Mesh, MixedPrecision, Sink, Strategy, StrategySpace, TensorInput
from autopar.cost_models import compute_time, get_profile, redistribute_time
from autopar.models import hf_llama, hf_logits_loss, lm_batch
from autopar.passes.fold import fold_regions
from autopar.passes.options import PlanOptions
from autopar.passes.pins import Pin
from autopar.passes.solve import SolveError, backend, build_ilp, driver, highs, overlap, solve
from autopar.passes.solve import ilp as solve_ilp
from autopar.passes.strategies import build_strategies
from autopar.passes.trace import trace_step

R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()
MM = torch.ops.aten.mm.default
F32 = torch.float32

REPLICATED = Strategy(out=((R,),), ins=((R,), (R,)))
COLUMN = Strategy(out=((S1,),), ins=((R,), (S1,)))
ROW = Strategy(out=((P,),), ins=((S1,), (S0,)))
DATA = Strategy(out=((S0,),), ins=((S0,), (R,)))


def _space(batch: int, hidden: int, ffn: int, *, data_parallel: bool) -> StrategySpace:
    mesh = Mesh((2,), ("tp",), device="h100")
    mm = [REPLICATED, COLUMN, ROW] + ([DATA] if data_parallel else [])
    stored = [Strategy(out=((p,),), ins=()) for p in (R, S0, S1)]
    return StrategySpace(
        mesh=mesh,
        order=["x", "w1", "w2", "h", "y"],
        strategies={
            "x": [s for s in stored if data_parallel or s.out[0] != (S0,)],
            "w1": stored,
            "w2": stored,
            "h": mm,
            "y": mm,
        },
        edges=[Edge("x", 0, "h", 0), Edge("w1", 0, "h", 1), Edge("h", 0, "y", 0)]
        + [Edge("w2", 0, "y", 1)],
        sinks=[Sink("y", 0, None, 0)],
        shapes={
            "x": [((batch, hidden), F32)],
            "w1": [((hidden, ffn), F32)],
            "w2": [((ffn, hidden), F32)],
            "h": [((batch, ffn), F32)],
            "y": [((batch, hidden), F32)],
        },
        targets={"x": "placeholder", "w1": "placeholder", "w2": "placeholder", "h": MM, "y": MM},
        roles={"x": "input", "w1": "param", "w2": "param", "h": "forward", "y": "forward"},
        modules=dict.fromkeys(["x", "w1", "w2", "h", "y"], ""),
        calls={
            "h": ((TensorInput(0), TensorInput(1)), {}),
            "y": ((TensorInput(0), TensorInput(1)), {}),
        },
        params={"w1": "w1", "w2": "w2"},
        inputs=["x"],
        n_outputs=1,
    )


def _local(shape, ps):
    out = list(shape)
    for p in ps:
        if isinstance(p, Shard):
            out[p.dim] //= 2
    return torch.Size(out)


def _brute_force(space: StrategySpace) -> list[tuple[float, dict[str, Strategy]]]:
    """Every feasible combination with its step time, cheapest first."""
    profile = get_profile("h100")
    mesh = space.mesh
    results = []
    names = space.order
    for combo in itertools.product(*(space.strategies[n] for n in names)):
        pick = dict(zip(names, combo))
        total = 0.0
        shape, dtype = space.shapes["x"][0]
        total += math.prod(_local(shape, pick["x"].out[0])) * 4 / profile.mem_bandwidth
        for n in ("h", "y"):
            s = pick[n]
            ins = [space.shapes[src][0][0] for src, _ in space.in_sources[n]]
            args = tuple(_local(a, ps) for a, ps in zip(ins, s.ins))
            out = _local(space.shapes[n][0][0], s.out[0])
            total += compute_time(profile, MM, args, {}, out, F32)
        feasible = True
        for e in space.edges:
            p, q = pick[e.src].out[0], pick[e.dst].ins[e.dst_in]
            if p == q:
                continue
            try:
                total += redistribute_time(p, q, *space.shapes[e.src][0], mesh, profile)
            except ValueError:
                feasible = False
        p = pick["y"].out[0]
        total += (
            redistribute_time(p, (R,), *space.shapes["y"][0], mesh, profile) if p != (R,) else 0
        )
        if feasible:
            results.append((total, pick))
    return sorted(results, key=lambda r: r[0])


def _peak(space, pick) -> int:
    """The step's peak bytes per rank, by hand for this graph: the batch and each weight
    with its two AdamW moments held throughout; h from its matmul through y's; y to the
    end; a redistributed input's buffer at the node that takes it; at the return, the loss
    y replicated beside y as made, if y was not."""

    def size(name, ps):
        return math.prod(_local(space.shapes[name][0][0], ps)) * 4

    held = size("x", pick["x"].out[0]) + sum(3 * size(w, pick[w].out[0]) for w in ("w1", "w2"))

    def buffers(n):
        total = 0
        for j, (src, _) in enumerate(space.in_sources[n]):
            q = pick[n].ins[j]
            total += size(src, q) if q != pick[src].out[0] else 0
        return total

    h, y = size("h", pick["h"].out[0]), size("y", pick["y"].out[0])
    returned = size("y", (R,)) if pick["y"].out[0] != (R,) else 0
    return max(held + h + buffers("h"), held + h + y + buffers("y"), held + y + returned)


def test_chained_matmuls_pair_column_then_row():
    # no data parallelism: sharding the weights halves the matmuls, and a column-parallel
    # matmul feeding a row-parallel one needs one all-reduce where the others need more
    space = _space(batch=64, hidden=1024, ffn=4096, data_parallel=False)
    by_pair: dict[tuple, float] = {}
    for t, p in _brute_force(space):
        by_pair.setdefault((p["h"], p["y"]), t)
    (pair, best), (_, second) = sorted(by_pair.items(), key=lambda kv: kv[1])[:2]
    assert pair == (COLUMN, ROW)
    assert second > best * 1.02, "the known optimum must win clearly"
    sol = solve(space, mip_gap=0.0)
    assert sol.chosen(space, "h") == COLUMN and sol.chosen(space, "y") == ROW
    assert sol.objective_s == pytest.approx(best, rel=1e-9)
    # the one collective: the row-parallel output's partial sums, all-reduced for the loss
    assert [(c.kind, c.axis) for _, c, _ in sol.collectives] == [("all_reduce", 0)]
    assert sol.comm_s + sol.compute_s == pytest.approx(sol.objective_s, rel=1e-12)


def test_a_memory_budget_forces_the_weights_to_be_sharded():
    # a large batch: the matmuls are compute bound, and splitting the batch wins
    space = _space(batch=4096, hidden=1024, ffn=4096, data_parallel=True)
    ranked = _brute_force(space)
    free = solve(space, mip_gap=0.0)
    # without a budget the batch is split and the weights stay whole
    assert free.chosen(space, "h") == DATA and free.chosen(space, "w1").out[0] == (R,)
    assert free.objective_s == pytest.approx(ranked[0][0], rel=1e-9)
    free_pick = {n: free.chosen(space, n) for n in space.order}
    assert free.stats["peak_bytes"] == _peak(space, free_pick)
    budget = 0.75 * _peak(space, free_pick)  # the whole weights no longer fit beside the rest
    tight = solve(space, PlanOptions(memory_budget=budget), mip_gap=0.0)
    pick = {n: tight.chosen(space, n) for n in space.order}
    assert _peak(space, pick) <= budget
    assert tight.stats["peak_bytes"] == _peak(space, pick)
    assert pick["w1"].out[0] != (R,) or pick["w2"].out[0] != (R,)
    best_within = min(t for t, p in ranked if _peak(space, p) <= budget)
    assert tight.objective_s == pytest.approx(best_within, rel=1e-9)
    assert tight.objective_s > free.objective_s


def test_an_impossible_budget_names_the_smallest_feasible_one():
    space = _space(batch=4096, hidden=1024, ffn=4096, data_parallel=True)
    least = min(_peak(space, p) for _, p in _brute_force(space))
    with pytest.raises(SolveError, match="smallest budget that fits") as e:
        solve(
            space, PlanOptions(memory_budget=least - 1024)
        )  # above the solver's tolerance (~0.1 byte)
    (named,) = re.findall(r"\((\d+) bytes\)", str(e.value))
    assert int(named) == least
    assert "largest part is optimizer state" in str(e.value)  # 2 of every 3 weight bytes
    # and that budget is feasible
    solve(space, PlanOptions(memory_budget=least))


def test_a_time_limit_with_a_plan_in_hand_is_reported(monkeypatch):

    space = _space(batch=64, hidden=1024, ffn=4096, data_parallel=False)
    real_run = backend.run

    def stopped_early(ilp, time_limit_s, mip_gap):
        real_run(ilp, time_limit_s, mip_gap)
        return pywraplp.Solver.FEASIBLE  # what HiGHS says when the clock stops it

    monkeypatch.setattr(backend, "run", stopped_early)
    sol = solve(space, PlanOptions(time_limit_s=7))
    assert sol.stats["status"] == "time_limit"
    assert sol.stats["best_bound"] <= sol.stats["incumbent"] + 1e-12
    (warning,) = sol.warnings
    assert "time limit of 7 s" in warning and "raise time_limit_s" in warning


class _Judge:
    """A ``StepJudge`` (passes/solve/rounds) whose ``prepare`` is the caller's work: it must
    run on the caller's thread, once, while the first solve runs on another."""

    def __init__(self, on_prepare=lambda: None):
        self.on_prepare = on_prepare

    def prepare(self) -> None:
        self.on_prepare()

    def length(self, solution) -> float:
        return solution.objective_s

    def idle(self) -> None:
        pass


@pytest.mark.parametrize("budget", [None, 1e12])
def test_the_callers_work_runs_on_its_thread_while_the_first_solve_runs(monkeypatch, budget):
    # the judge's ``prepare``: done once, on the caller's thread, while the first solve runs
    # on another; the first solve waits until it has run, so done after it, it would time out
    space = _space(batch=8, hidden=1024, ffn=4096, data_parallel=True)
    real_run = backend.run
    ran, solves = threading.Event(), []
    caller = threading.get_ident()

    def run(ilp, time_limit_s, mip_gap):
        solves.append(threading.get_ident())
        if len(solves) == 1:
            assert ran.wait(30), "the caller's work did not run beside the first solve"
        return real_run(ilp, time_limit_s, mip_gap)

    def prepare():
        assert threading.get_ident() == caller and not ran.is_set()
        ran.set()

    monkeypatch.setattr(backend, "run", run)
    sol = solve(space, PlanOptions(memory_budget=budget), judge=_Judge(prepare))
    assert ran.is_set() and solves[0] != caller
    assert sol.objective_s == pytest.approx(
        solve(space, PlanOptions(memory_budget=budget)).objective_s
    )

    def failing(ilp, time_limit_s, mip_gap):
        raise RuntimeError("the solver failed")

    monkeypatch.setattr(backend, "run", failing)  # raised on the caller's thread
    with pytest.raises(RuntimeError, match="the solver failed"):
        solve(space, PlanOptions(memory_budget=budget), judge=_Judge())


def test_no_plan_within_the_time_limit_is_an_error_that_says_so(monkeypatch):

    space = _space(batch=8, hidden=1024, ffn=4096, data_parallel=True)
    monkeypatch.setattr(backend, "run", lambda *a: pywraplp.Solver.NOT_SOLVED)
    # the clock runs 5 s a reading: the solve took longer than its limit
    ticks = itertools.count(0.0, 5.0)
    monkeypatch.setattr(driver, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    with pytest.raises(SolveError, match="no plan within its time limit of 3 s") as e:
        solve(space, PlanOptions(time_limit_s=3, memory_budget=1e12))
    assert "raise time_limit_s" in str(e.value) and "memory" not in str(e.value).split(":")[0]


def test_a_solver_that_gives_up_before_its_time_limit_is_not_said_to_have_run_out(
    monkeypatch,
):
    space = _space(batch=8, hidden=1024, ffn=4096, data_parallel=True)
    monkeypatch.setattr(backend, "run", lambda *a: pywraplp.Solver.NOT_SOLVED)
    with pytest.raises(SolveError, match="stopped without a plan after") as e:
        solve(space, PlanOptions(time_limit_s=600, memory_budget=1e12))
    assert "before its time limit of 600 s" in str(e.value)
    assert "raise time_limit_s" not in str(e.value) and "AUTOPAR_SOLVER" in str(e.value)


def _binary_model(rhs: float, profit: tuple[float, float]):
    """max profit . (x, y) with x + y <= rhs, x and y binary, as a model proto."""
    lp = pywraplp.Solver.CreateSolver("HIGHS")
    x, y = lp.IntVar(0, 1, "x"), lp.IntVar(0, 1, "y")
    lp.Add(x + y <= rhs)
    lp.Maximize(profit[0] * x + profit[1] * y)
    model = linear_solver_pb2.MPModelProto()
    lp.ExportModelToProto(model)
    return model


def test_an_integral_relaxation_is_the_ilps_optimum_and_a_fractional_one_is_not_taken():
    # x + y <= 1: the relaxation's optimum is a vertex, x = 1, as the ILP's
    values, value, bound = highs.relaxed(_binary_model(1.0, (2.0, 1.0)), "HIGHS", 10.0)
    assert values == [1.0, 0.0] and value == bound == 2.0
    # x + y <= 1.5: the relaxation takes half of y, the ILP cannot: solved as an ILP
    assert highs.relaxed(_binary_model(1.5, (2.0, 1.0)), "HIGHS", 10.0) is None


def test_the_relaxation_runs_presolve_only_where_the_ilp_has_memory_cuts(monkeypatch):
    # passes/solve ``_relax_presolve``: HiGHS's presolve is skipped before the relaxation
    # of an ILP without cuts (it cost more than it spared), kept where cuts bound memory
    space = _space(batch=4096, hidden=1024, ffn=4096, data_parallel=True)
    calls = []
    real = highs.relaxation

    def relaxation(model, *args, presolve=True, **kwargs):
        calls.append((len(model.constraint), presolve))
        return real(model, *args, presolve=presolve, **kwargs)

    monkeypatch.setattr(highs, "relaxation", relaxation)
    free = solve(space)
    assert calls and not any(presolve for _, presolve in calls)
    calls.clear()
    budget = 0.75 * free.stats["peak_bytes"]
    tight = solve(space, PlanOptions(memory_budget=budget))
    # the first round has no cut; the rounds after it add them, and presolve with them
    assert not calls[0][1] and calls[-1][1] and calls[-1][0] > calls[0][0]
    monkeypatch.setattr(highs, "relaxation", real)
    # the plans are the ILP's either way
    assert free.choice == solve(space, mip_gap=0.0).choice
    assert tight.objective_s == pytest.approx(
        solve(space, PlanOptions(memory_budget=budget), mip_gap=0.0).objective_s
    )


def test_the_search_takes_the_relaxation_where_it_is_integral_and_the_ilp_elsewhere(monkeypatch):
    space = _space(batch=64, hidden=1024, ffn=4096, data_parallel=False)
    exact = solve(space)
    taken = []
    real = highs.relaxed
    monkeypatch.setattr(highs, "relaxed", lambda *a, **k: taken.append(real(*a, **k)) or taken[-1])
    assert solve(space).choice == exact.choice and taken and taken[-1] is not None
    # with no relaxation taken, the ILP itself gives the same plan
    monkeypatch.setattr(highs, "relaxed", lambda *a, **k: None)
    again = solve(space)
    assert again.choice == exact.choice
    assert again.objective_s == pytest.approx(exact.objective_s, rel=1e-9)


def test_a_held_solution_is_read_after_a_later_solve():
    # the overlap rounds undo a round by reading the last plan again, not by solving again
    space = _space(batch=64, hidden=1024, ffn=4096, data_parallel=False)
    ilp = build_ilp(space, get_profile("h100"), solver="HIGHS")
    assert highs.solved(backend.run(ilp, 60, 0.0))
    first, held = ilp.choice(), ilp.hold()
    (value, bound), h_vars = ilp.objective_value(), ilp.x["h"]
    # price the chosen strategy of h out of reach: the next solve picks another
    ilp.objective({**ilp.coef, **{v: 1e9 for v in h_vars[first["h"]]}})
    assert highs.solved(backend.run(ilp, 60, 0.0))
    assert ilp.choice()["h"] != first["h"]
    ilp.restore(held)
    assert ilp.choice() == first and ilp.objective_value() == (value, bound)
    backend.run(ilp, 60, 0.0)  # a solve reads its own solution again, not the held one
    assert ilp.held is not held and ilp.choice()["h"] != first["h"]
    # a variable a later round made (memory cuts make a fold group's r at its first use)
    # is not in the held solution: 0 there, as the plan held has none of it
    later = ilp.lp.BoolVar("r_later")
    ilp.lp.Add(later == 1)
    assert highs.solved(backend.run(ilp, 60, 0.0)) and ilp.value(later) == 1
    ilp.restore(held)
    assert ilp.value(later) == 0.0 and ilp.choice() == first


def test_what_is_read_of_a_held_solution_is_made_once_per_solution():
    # the overlap rounds read a round's choice and overlap two or three times each (the
    # memory check, the step's length, the plan): made once while the solution is held
    space = _space(batch=64, hidden=1024, ffn=4096, data_parallel=False)
    ilp = build_ilp(space, get_profile("h100"), solver="HIGHS")
    assert highs.solved(backend.run(ilp, 60, 0.0))
    held = ilp.held  # a solve in place holds its solution
    assert held is not None
    first, step = ilp.choice(), overlap.overlap(ilp)
    assert ilp.choice() is first and overlap.overlap(ilp) is step
    ilp.objective({**ilp.coef, **{v: 1e9 for v in ilp.x["h"][first["h"]]}})
    assert highs.solved(backend.run(ilp, 60, 0.0))
    second = ilp.choice()
    assert second is not first and second["h"] != first["h"]
    ilp.restore(held)
    before = ilp.choice()
    assert before is not first and before == first  # (made again, the same)
    ilp.lp.BoolVar("r_later")  # a variable added: what is read may change, made again
    again = ilp.choice()
    assert again is not before and again == first and ilp.choice() is again


@pytest.fixture(scope="module")
def llama_layer() -> StrategySpace:
    """One Llama layer in bf16 with float32 gradients (``reduce_dtype``) on 4 CPU ranks:
    gloo hides no reduction, so a gradient reduced in bf16 would cost half as much."""
    with torch.device("meta"):
        model = hf_llama(layers=1, hidden=256, heads=8, kv_heads=2, ffn=1024, vocab=512, seq=256)
    tokens, targets = lm_batch(512, 8, 256, device="meta")
    with contextlib.ExitStack() as stack, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = trace_step(
            model, (tokens,), loss_fn=hf_logits_loss, example_targets=(targets,), stack=stack,
            mp_policy=MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32),
        )  # fmt: skip
        return build_strategies(step, Mesh((4,), ("dp",), device="cpu"), folded=fold_regions(step))


def test_gradients_are_reduced_in_the_reduce_dtype(llama_layer, monkeypatch):
    chain = solve_ilp._gradient_chains(llama_layer, solve_ilp._consumers(llama_layer))
    # a weight's gradient: mm -> t -> cast to float32; a norm's: sum -> view -> cast
    assert {llama_layer.targets[n] for n in chain} >= {
        torch.ops.aten.t.default,
        torch.ops.aten.view.default,
    }

    def reduced_before_the_cast(sol):
        return [
            label
            for label, c, _ in sol.collectives
            if label.split("->")[1].split(" ")[0] in chain
            and c.kind in ("all_reduce", "reduce_scatter")
        ]

    # unmerged (as autopar.evaluate solves), every node of a chain has an edge of its own
    sol = solve(llama_layer, merge=False)
    assert not reduced_before_the_cast(sol)
    assert any("->output[" in label and c.kind == "all_reduce" for label, c, _ in sol.collectives)
    # without the chains the solver reduces in bf16, before the cast, at half the bytes
    monkeypatch.setattr(solve_ilp, "_gradient_chains", lambda space, uses: set())
    loose = solve(llama_layer, merge=False)
    assert reduced_before_the_cast(loose)
    assert loose.objective_s < sol.objective_s


def test_a_following_node_read_twice_is_not_merged(llama_layer, monkeypatch):
    merged = solve(llama_layer)
    exact = solve(llama_layer, merge=False)
    assert exact.stats["merged_nodes"] == 0 < merged.stats["merged_nodes"]
    assert merged.stats["variables"] < exact.stats["variables"]
    assert merged.objective_s == pytest.approx(exact.objective_s, rel=1e-6)
    # merging those too (a weight's transpose, read by two matmuls) loses here
    monkeypatch.setattr(
        solve_pass.IlpBuilder, "_following", lambda ilp, n: solve_ilp._follows(ilp.space, n)
    )
    every = solve(llama_layer)
    assert every.stats["merged_nodes"] > merged.stats["merged_nodes"]
    assert every.objective_s > 1.02 * exact.objective_s


def test_the_gap_reaches_highs_through_its_own_parameters():
    """OR-Tools' HiGHS interface drops ``RELATIVE_MIP_GAP``; the solver-specific string
    reaches HiGHS (``solve._parameters``): a value HiGHS cannot read fails the solve, and
    the gap as ``_parameters`` writes it solves."""
    lp = pywraplp.Solver.CreateSolver("HIGHS")
    x = lp.IntVar(0, 10, "x")
    lp.Add(x >= 2.5)
    lp.Minimize(x)
    lp.SuppressOutput()
    lp.SetSolverSpecificParametersAsString("mip_rel_gap=not-a-number,output_flag=false")
    assert lp.Solve() not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE)
    params = highs.parameters(lp, "HIGHS", 0.0, quiet=True)
    assert lp.Solve(params) == pywraplp.Solver.OPTIMAL
    assert x.solution_value() == 3


def test_a_budget_below_the_models_state_is_said_at_once_with_that_floor(monkeypatch):
    """The parameters and their AdamW moments, each split evenly over the ranks, are a floor
    under every plan's peak: a budget below it is refused before any ILP is built, with the
    floor and the least mesh it needs; a budget above it is solved as before."""
    space = _space(batch=4096, hidden=1024, ffn=4096, data_parallel=True)
    floor = solve_pass.state_floor(space)
    # by hand: each weight's elements halved over the 2 ranks, 4 bytes and two moments each
    by_hand = sum(math.prod(space.shapes[w][0][0]) // 2 * 4 * 3 for w in ("w1", "w2"))
    assert floor == by_hand
    least = min(_peak(space, p) for _, p in _brute_force(space))
    assert floor <= least  # no plan holds less
    assert solve_pass.state_floor(space, "sgd") == by_hand // 3  # no state: the weights alone

    def never(*args, **kwargs):
        raise AssertionError("an ILP was built for a budget below the model's state")

    monkeypatch.setattr(driver, "build_ilp", never)
    with pytest.raises(SolveError, match="alone take at least") as e:
        solve(space, PlanOptions(memory_budget=floor - 1024))
    assert e.value.floor_bytes == floor and e.value.least_bytes is None
    assert "a mesh of at least 3 ranks" in str(e.value)  # twice the floor over 2 ranks, and more
    with pytest.raises(SolveError, match="alone take at least") as e:
        solve(space, PlanOptions(memory_budget=1))  # (a budget is > 0: PlanOptions)
    assert "or a larger budget" in str(e.value)
    monkeypatch.undo()
    # at the floor itself, the solver decides (here: nothing fits, and it names the least)
    with pytest.raises(SolveError, match="smallest budget that fits") as e:
        solve(space, PlanOptions(memory_budget=floor))
    assert e.value.least_bytes == least and e.value.floor_bytes is None


def test_pinned_parameters_count_at_their_placement_in_the_floor(monkeypatch):
    """A parameter the constraints pin holds what its placement holds on a rank: pinned
    replicated (data parallelism), the whole weight and its state on every rank, a floor
    above the even split's; a budget between the two is refused before any ILP, and the
    error names the pins, not a larger mesh (more ranks do not shrink a replica)."""
    space = _space(batch=4096, hidden=1024, ffn=4096, data_parallel=True)
    even = solve_pass.state_floor(space)
    replicated = [Pin("w1", "R"), Pin("w2", "R")]
    floor = solve_pass.state_floor(space, pins=replicated)
    assert floor == 2 * even  # each weight whole on both ranks, and its two moments
    one = solve_pass.state_floor(space, pins=[Pin("w1", "R"), Pin("w2", "S(1)")])
    assert even < one < floor
    monkeypatch.setattr(driver, "build_ilp", lambda *a, **k: pytest.fail("an ILP was built"))
    with pytest.raises(SolveError, match="the 2 pinned parameters as pinned") as e:
        solve(space, PlanOptions(memory_budget=(even + floor) / 2, pins=tuple(replicated)))
    assert e.value.floor_bytes == floor and "a mesh of at least" not in str(e.value)
    monkeypatch.undo()
    # unpinned, the same budget is above the floor: the ILP decides (and names the least)
    with pytest.raises(SolveError, match="smallest budget that fits") as e:
        solve(space, PlanOptions(memory_budget=(even + floor) / 2))
    assert e.value.floor_bytes is None


def test_the_state_floor_is_under_a_traced_layers_plan_and_refuses_below_it(llama_layer):
    """On a traced Llama layer in bf16 mixed precision (float32 parameters held), the floor
    is under the peak of the plan found, and a budget just below it is refused at once."""
    floor = solve_pass.state_floor(llama_layer)
    plan = solve(llama_layer)
    assert 0 < floor <= plan.stats["peak_bytes"]
    with pytest.raises(SolveError, match="alone take at least") as e:
        solve(llama_layer, PlanOptions(memory_budget=0.99 * floor))
    assert e.value.floor_bytes == floor

"""The pass runner: the pipeline as named stages, run by one driver.

Takes: a list of ``Stage``s and a state dict holding what the first stage reads. Returns:
the state, with each stage's output under the stage's name, and the stage statistics added
to ``stats``. The pipeline of docs/architecture.md, as entries:

    stage        reads                                   output        statistics
    trace        model, example_inputs, loss_fn,         StepGraph     nodes,
                 example_targets, stack, mp_policy                     mixed_precision
    fold         trace                                   FoldedGraph   fold, fold_regions,
                                                          (None when     folded_nodes,
                                                          skipped)       fold_groups
    strategies   trace, fold, mesh                       StrategySpace strategies
    solve        strategies, options                     Solution      the solver's (problem
                 (on CUDA also trace, mesh: each                       size, status, phases,
                 overlap round's plan ordered,                         overlap_rounds)
                 bucketed and prefetched as the
                 stages below will, ``_emitted``)
    order        strategies, trace, plan                 Ordering      order_segments,
                 (on the Plan assembled after solve;                   order_exact, ...,
                 the state's plan is replaced by                       traced_peak_bytes
                 one with plan.order)
    buckets      strategies, plan, options               (count)       buckets,
                 (the state's plan is replaced by one                  bucketed_reductions
                 with its gradient reductions bucketed)
    prefetch     strategies, plan, options               (count)       prefetched
                 (the state's plan is replaced by one
                 with its reshards issued early)
    memory       strategies, plan, options                   MemoryReport  step_peak_bytes,
                                                                       arena_bytes
                 (into plan.memory["step"], in
                 plan.order)
    codegen      trace, plan, dmesh                      CompiledStep  local_nodes,
                                                                       local_collectives

Where the solver's overlap rounds judged the solution the plan is (``_emitted``, on
CUDA), the plan is assembled from the round's (``assemble``: its nodes and collectives),
the four report stages take what the rounds made of it (the order, the bucketed and the
prefetched plan, the memory report; ``state["assessed"]``) instead of making it again,
where the round made it in the order the plan has (a later round's plan, judged in the
traced order, is ordered by the order stage: ``_emitted``), and the step's length is the
round's where the step is the same (``emitted_length``); the order stage takes the traced
order's peak from the solver's measurement of its plan (``stats["peak_bytes"]``: the same
step). A round's memory report is the one the buckets' or prefetch's budget check
measured of the same plan, where one did, or the one measured while the solver waited for
a round solved beside (``_idle``: the shortest plan judged so far, ``state["shortest"]``);
else the memory stage measures the kept round's plan (a round's step length needs none:
core/schedule runs the plan's order with its checkpointed layers' copies).

``run_stages`` runs the stages in order. For each it records the wall time as
``stats["<name>_s"]`` and the stage's own statistics, and logs one line (logger
``autopar``). A stage named in ``skip`` does not run: its output is None and its statistics
say so; only stages marked ``skippable`` may be skipped (``fold``: ``fold=False`` of the
public API is ``skip={"fold"}``; ``order``: the traced order; ``buckets``: one all-reduce
per gradient; ``prefetch``: each reshard issued at its consumer; ``memory``). A new stage is a new entry in a list (``PLAN_STAGES``,
``COMPILE_STAGES``), not an edit of the driver.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from autopar.core import CompiledStep, Plan, Solution, StrategySpace
from autopar.core.schedule import schedule_inputs

from .buckets import DEFAULT_BUCKET_BYTES, bucket_measured, bucket_reductions
from .codegen import codegen
from .fold import FoldedGraph, fold_regions
from .memory import OPTIMIZERS, MemoryReport, simulate
from .order import Ordering, order_step
from .order import prepare as prepare_order
from .pins import Pin
from .pins import resolve as resolve_pins
from .prefetch import prefetch_measured
from .solve import DEVICE_BUDGET, overlaps_collectives, solve, within
from .strategies import build_strategies
from .trace import StepGraph, trace_step

__all__ = [
    "COMPILE_STAGES",
    "DEFAULT_BUCKET_BYTES",
    "PLAN_STAGES",
    "REPORT_STAGES",
    "STAGE_NAMES",
    "TRACE",
    "PlanOptions",
    "Stage",
    "assemble",
    "emitted_length",
    "run_stages",
]

log = logging.getLogger("autopar")


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """What the planning stages take besides the model and the mesh."""

    time_limit_s: float = 600.0
    """The solver's time limit in seconds."""

    memory_budget: float | None = None
    """The most bytes one rank may hold at any point of the step (passes/memory). None: the
    device profile's usable memory; ``math.inf``: no bound."""

    memory_fraction: float | None = None
    """Instead of ``memory_budget``: this fraction of what one device holds running the
    whole step."""

    skip: frozenset[str] = frozenset()
    """Names of stages not to run (only skippable ones: ``fold``, ``order``, ``memory``)."""

    optimizer: str = "adamw"
    """Whose state the step memory counts (passes/memory.OPTIMIZERS)."""

    checkpointing: bool = True
    """The solver may recompute layers' activations where the budget binds (passes/remat)."""

    constraints: tuple[tuple[str, str], ...] = ()
    """Placements fixed before the search: ``(pattern, placements text)`` pairs over
    parameter names and ``input:N`` (passes/pins)."""

    pins: tuple[Pin, ...] = ()
    """Nodes fixed to strategies before the search (a whole plan: ``autopar.evaluate``)."""

    bucket_bytes: float = DEFAULT_BUCKET_BYTES
    """The gradient reductions are grouped into buckets of about this many bytes
    (passes/buckets; ``skip={"buckets"}``: one reduction per gradient, at the end)."""

    forbid: tuple[tuple[tuple[str, str], ...], ...] = ()
    """Choices the plan may not make: each a tuple of ``(node, placements text)``, not all
    of which the plan may keep (passes/solve ``forbid``; ``autopar explain``)."""

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r}: one of {sorted(OPTIMIZERS)}")
        if self.time_limit_s <= 0:
            raise ValueError(f"time_limit_s must be > 0, got {self.time_limit_s}")
        if not self.bucket_bytes > 0:
            raise ValueError(f"bucket_bytes must be > 0, got {self.bucket_bytes}")
        if self.memory_budget is not None and not self.memory_budget > 0:
            raise ValueError(
                f"memory_budget must be a positive number of bytes, got {self.memory_budget}"
            )
        if self.memory_fraction is not None:
            if self.memory_budget is not None:
                raise ValueError("give memory_budget or memory_fraction, not both")
            if not self.memory_fraction > 0:
                raise ValueError(f"memory_fraction must be > 0, got {self.memory_fraction}")
        unknown = set(self.skip) - set(STAGE_NAMES)
        if unknown:
            raise ValueError(f"unknown stage(s) {sorted(unknown)}; stages are {STAGE_NAMES}")
        fixed = [s.name for s in ALL_STAGES if s.name in self.skip and not s.skippable]
        if fixed:
            skippable = [s.name for s in ALL_STAGES if s.skippable]
            raise ValueError(f"stage(s) {fixed} cannot be skipped; skippable: {skippable}")


@dataclass(frozen=True, slots=True)
class Stage:
    """One named stage of the pipeline.

    Attributes:
        name: the stage's name: its output's key in the state, its time's in ``stats``.
        run: ``run(state) -> output``; reads earlier outputs from ``state`` by name.
        stats: ``stats(output) -> dict`` of sizes for ``plan.stats`` (``output`` is None
            when the stage was skipped).
        skippable: whether ``skip`` may name it (later stages accept its None output).
    """

    name: str
    run: Callable[[dict], Any]
    stats: Callable[[Any], dict] = field(default=lambda out: {})
    skippable: bool = False


def run_stages(
    stages: Sequence[Stage], state: dict, stats: dict, *, skip: Collection[str] = ()
) -> dict:
    """Run ``stages`` in order on ``state`` (module docstring); returns ``state``."""
    for stage in stages:
        if stage.name in skip:
            if not stage.skippable:
                raise ValueError(f"stage {stage.name!r} cannot be skipped")
            state[stage.name] = None
            stats.update(stage.stats(None))
            log.info("autopar: %-10s skipped", stage.name)
            continue
        t0 = time.perf_counter()
        log.info("autopar: %s ...", stage.name, extra={"stage_start": stage.name})
        out = stage.run(state)
        seconds = time.perf_counter() - t0
        state[stage.name] = out
        sizes = stage.stats(out)
        stats[f"{stage.name}_s"] = seconds
        stats.update(sizes)
        shown = ", ".join(f"{k} {v}" for k, v in sizes.items() if isinstance(v, (int, str)))
        log.info("autopar: %-10s %7.2f s  %s", stage.name, seconds, shown)
    return state


# -- the stages ----------------------------------------------------------------------------


def _trace(state: dict) -> StepGraph:
    return trace_step(
        state["model"],
        state["example_inputs"],
        loss_fn=state.get("loss_fn"),
        example_targets=state.get("example_targets"),
        stack=state["stack"],
        meta_device=state.get("meta_device", "cpu"),
        mp_policy=state.get("mp_policy"),
    )


def _trace_stats(step: StepGraph | None) -> dict:
    if step is None:
        return {}
    stats: dict[str, Any] = {"nodes": sum(1 for n in step.gm.graph.nodes if n.op != "output")}
    if step.mp_policy is not None:
        stats["mixed_precision"] = step.mp_policy.text()
    return stats


def _fold(state: dict) -> FoldedGraph:
    folded = fold_regions(state["trace"])
    log.info("autopar: %s", folded.report())
    return folded


def _fold_stats(folded: FoldedGraph | None) -> dict:
    if folded is None:
        return {"fold": False, "fold_regions": 0, "folded_nodes": 0, "fold_groups": []}
    return {"fold": True, **folded.stats()}


def _strategies(state: dict) -> StrategySpace:
    # NOTE: DTensor's rules may warn once per process; recording with "always" and warning
    # again through the caller's filters shows each planning run's warnings to the caller.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        space = build_strategies(state["trace"], state["mesh"], folded=state.get("fold"))
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return space


def _solve(state: dict) -> Solution:
    options: PlanOptions = state["options"]
    budget: float | str | None
    if options.memory_fraction is not None or (
        options.memory_budget is not None and math.isinf(options.memory_budget)
    ):
        budget = None
    elif options.memory_budget is None:
        budget = DEVICE_BUDGET
    else:
        budget = options.memory_budget
    pins, frozen = resolve_pins(state["strategies"], options.constraints)
    return solve(
        state["strategies"],
        time_limit_s=options.time_limit_s,
        memory_budget=budget,
        memory_fraction=options.memory_fraction,
        optimizer=options.optimizer,
        checkpointing=options.checkpointing,
        forbid=options.forbid,
        pins=pins + list(options.pins),
        frozen=frozen,
        assess=_emitted(state) if overlaps_collectives(state["mesh"]) else None,
        hides=_hides(options.skip),
        meanwhile=_meanwhile(state),
        idle=_idle(state),
    )


def _meanwhile(state: dict) -> Callable[[], None] | None:
    """What the report stages (and the overlap rounds' ``_emitted``) read of the step
    whatever the plan, made while the solver's first solve runs (passes/solve
    ``meanwhile``): the order's storage graph (~0.2 s of a 96-layer step)."""
    if "order" in state["options"].skip:
        return None
    space, gm = state["strategies"], state["trace"].gm
    return lambda: prepare_order(space, gm)


def _hides(skip: Collection[str]) -> frozenset[str]:
    """The kinds of overlap the emitted step will have (passes/solve ``hides``): the
    buckets' and the prefetches', unless their stage is skipped."""
    kinds = set()
    if "buckets" not in skip:
        kinds |= {"all_reduce", "reduce_scatter", "multi_axis"}
    if "prefetch" not in skip:
        kinds.add("prefetch")
    return frozenset(kinds)


@dataclass(slots=True)
class _Assessed:
    """What the report stages made of one solution while the overlap rounds judged it
    (``_emitted``): each stage's plan and what it added to the plan's statistics."""

    plan: Plan | None = None  # the solution's, as Plan.from_solution made it
    ordering: Ordering | None = None  # where the round ordered it
    bucketed: Plan | None = None
    bucket_stats: dict = field(default_factory=dict)
    prefetched: Plan | None = None
    prefetch_stats: dict = field(default_factory=dict)
    report: MemoryReport | None = None
    judged: Plan | None = None  # the plan whose step was simulated, and the step's length
    length: float = 0.0


def _solution_key(solution: Solution) -> tuple:
    """What makes two solutions one plan to the report stages: the choice, the layers
    checkpointed, and the objective (the overlap's shares priced in)."""
    return (
        tuple(solution.choice.items()),
        tuple(r.group for r in solution.recompute),
        solution.objective_s,
        solution.comm_s,
    )


def _added(before: dict, after: dict) -> dict:
    return {k: v for k, v in after.items() if k not in before or before[k] != v}


def _emitted(state: dict) -> Callable[[Solution], float]:
    """The length of the step a solution emits, in seconds: its plan in the order, the
    buckets, the prefetches and the memory timeline the report stages give it (those not
    skipped), simulated (core/schedule). The solver's overlap rounds compare their plans
    by it (passes/solve, "Overlap"). What each stage made is kept by solution
    (``state["assessed"]``): the report stages take the kept round's instead of making it
    again (each is linear in the step's nodes: ~0.8 s of a 96-layer plan). A later round's
    plan takes the first's node choices where they are the same (``Plan.from_solution``
    ``base``: 1-2% of a 96-layer step's nodes change).

    The order: the first round's plan is ordered as the order stage will order it; where
    that keeps the traced order, the later rounds' plans are judged in the traced order,
    not ordered (~0.17 s a round at 96 layers). The order is chosen for memory alone
    (passes/order) and keeps the traced one unless a lower peak needs another: the zoo's
    transformers keep it (their peak is the whole forward held into the backward), where
    an FSDP MLP's reduce-scatter buckets reorder it in every round. Where the order stage
    orders a later round's kept plan otherwise, the stages after it make their plans
    again, and the step's length is simulated in that order (``emitted_length``)."""
    space, options = state["strategies"], state["options"]
    assessed: dict[tuple, _Assessed] = state.setdefault("assessed", {})
    # whether the order stage orders the first round's plan otherwise (None: none judged)
    reorders: list[bool | None] = [None]

    first: list[tuple[Solution, Plan]] = []  # the first round's solution and plan

    def length(solution: Solution) -> float:
        made = _Assessed()
        plan = Plan.from_solution(
            space,
            solution,
            fingerprint="",
            stats=dict(solution.stats),
            base=first[0] if first else None,
        )
        if not first:
            first.append((solution, plan))
        made.plan = plan
        # the first round's plan ordered; the later rounds' only where it was not in the
        # traced order
        if "order" not in options.skip and reorders[0] is not False:
            made.ordering = order_step(space, state["trace"].gm, plan)
            if reorders[0] is None:
                reorders[0] = made.ordering.changed
            if made.ordering.changed:
                plan = dataclasses.replace(plan, order=tuple(made.ordering.order))
        measured = None  # the memory of the plan as it stands, where a budget check measured it
        if "buckets" not in options.skip:
            before = dict(plan.stats)
            plan, measured = bucket_measured(space, plan, options.bucket_bytes, options.optimizer)
            made.bucketed = plan
            made.bucket_stats = _added(before, plan.stats)
        if "prefetch" not in options.skip:
            before = dict(plan.stats)
            given = plan
            plan, prefetched = prefetch_measured(space, plan, options.optimizer)
            # (prefetch returns the plan it was given where it measured nothing)
            measured = prefetched if prefetched is not None or plan is not given else measured
            made.prefetched = plan
            made.prefetch_stats = _added(before, plan.stats)
        if measured is not None and "memory" not in options.skip:
            # (unmeasured, the step's points are the plan's order and its copies alike,
            # core/schedule; the memory stage measures the kept round's plan once)
            made.report = measured
            plan.memory["step"] = measured.to_dict()
        made.judged, made.length = plan, plan.emitted_step_s()
        key = _solution_key(solution)
        assessed[key] = made
        shortest = assessed.get(state.get("shortest", ()))
        if shortest is None or made.length < shortest.length:
            state["shortest"] = key
        return made.length

    return length


def _idle(state: dict) -> Callable[[], None]:
    """What the solver's thread does where it would wait for an overlap round solved beside
    (passes/solve ``idle``): the step memory of the shortest plan judged so far, as the
    memory stage measures it (``_memory`` takes it where that plan is kept: the zoo's
    rounds keep their first plan as a rule), in time that would be spent waiting."""

    def idle() -> None:
        options = state["options"]
        made = state.get("assessed", {}).get(state.get("shortest", ()))
        if made is None or made.report is not None or made.prefetched is None:
            return
        if "memory" in options.skip:
            return
        made.report = simulate(state["strategies"], made.prefetched, optimizer=options.optimizer)

    return idle


def emitted_length(state: dict, plan: Plan) -> float:
    """``plan.emitted_step_s()``: the overlap round's where it judged the same step (the
    same inputs of core/schedule), else simulated."""
    made = _reused(state)
    if made is not None and made.judged is not None:
        if schedule_inputs(made.judged) == schedule_inputs(plan):
            return made.length
    return plan.emitted_step_s()


def assemble(state: dict, fingerprint: str, stats: dict) -> Plan:
    """The plan of the state's solution (``Plan.from_solution``), its nodes and collectives
    taken from the overlap round that judged it where one did (``_emitted``)."""
    made = _reused(state)
    return Plan.from_solution(
        state["strategies"],
        state["solve"],
        fingerprint=fingerprint,
        stats=stats,
        like=None if made is None else made.plan,
    )


def _reused(state: dict) -> _Assessed | None:
    """What the overlap rounds made of the solution the plan is (``_emitted``), if any."""
    assessed, solution = state.get("assessed"), state.get("solve")
    if not assessed or solution is None:
        return None
    # (read by each report stage: the key, a tuple of every node's choice, made once)
    held = state.get("reused")
    if held is None or held[0] is not solution:
        held = state["reused"] = (solution, assessed.get(_solution_key(solution)))
    return held[1]


def _codegen(state: dict) -> CompiledStep:
    return codegen(state["trace"], state["plan"], state["dmesh"])


def _codegen_stats(compiled: CompiledStep | None) -> dict:
    if compiled is None:
        return {}
    return {
        "local_nodes": len(compiled.gm.graph.nodes),
        "local_collectives": sum(compiled.collective_counts.values()),
    }


def _order(state: dict) -> Ordering:
    plan = state["plan"]
    made = _reused(state)
    if made is not None and made.ordering is not None:
        ordering = made.ordering
    else:
        ordering = order_step(state["strategies"], state["trace"].gm, plan)
    if ordering.changed:  # the plan the later stages read, and the caller takes
        state["plan"] = dataclasses.replace(plan, order=tuple(ordering.order))
    # the traced order's peak as passes/memory measures it (optimizer state, the return):
    # the solver's measurement of the plan it chose is of that step (the traced order, its
    # checkpointed layers' copies, no bucket, no prefetch; passes/solve), else measured
    solver = plan.stats.get("peak_bytes")
    ordering.traced_step_peak = (
        solver
        if solver is not None
        else simulate(state["strategies"], plan, optimizer=state["options"].optimizer).peak_bytes
    )
    return ordering


def _order_stats(ordering: Ordering | None) -> dict:
    if ordering is None:
        return {"order": False}
    return {
        "order": ordering.changed,
        **{f"order_{k}": v for k, v in ordering.stats.items()},
        "traced_peak_bytes": ordering.traced_step_peak,
    }


def _buckets(state: dict) -> int:
    plan, made = state["plan"], _reused(state)
    if made is not None and made.bucketed is not None and made.bucketed.order == plan.order:
        # what bucket_reductions changes: the collectives and their cost, and it adds to
        # the plan's own statistics
        b = made.bucketed
        plan = dataclasses.replace(plan, collectives=b.collectives, cost=b.cost)
        plan.stats.update(made.bucket_stats)
    else:
        options = state["options"]
        plan = bucket_reductions(state["strategies"], plan, options.bucket_bytes, options.optimizer)
    state["plan"] = plan
    return int(plan.stats.get("buckets", 0))


def _buckets_stats(buckets: int | None) -> dict:
    return {"buckets": 0 if buckets is None else buckets}


def _prefetch(state: dict) -> int:
    plan, made = state["plan"], _reused(state)
    if (
        made is not None
        and made.prefetched is not None
        and made.bucketed is not None
        and plan.collectives == made.bucketed.collectives
        and plan.order == made.bucketed.order  # (made in the order the plan has)
    ):
        if made.prefetched is not made.bucketed:  # what prefetch changes
            p = made.prefetched
            plan = dataclasses.replace(
                plan,
                collectives=p.collectives,
                order=p.order,
                stats={**plan.stats, **made.prefetch_stats},  # (a copy, as it makes)
            )
    else:
        plan, _ = prefetch_measured(state["strategies"], plan, state["options"].optimizer)
    state["plan"] = plan
    return int(plan.stats.get("prefetched", 0))


def _prefetch_stats(prefetched: int | None) -> dict:
    return {"prefetched": 0 if prefetched is None else prefetched}


def _memory(state: dict) -> MemoryReport:
    plan, made = state["plan"], _reused(state)
    report = None
    if made is not None and made.report is not None and made.prefetched is not None:
        if plan.collectives == made.prefetched.collectives and plan.order == made.prefetched.order:
            report = made.report
    if report is None:
        report = simulate(state["strategies"], plan, optimizer=state["options"].optimizer)
    state["plan"] = _over_budget(plan, report)
    return report


def _over_budget(plan: Plan, report: MemoryReport) -> Plan:
    """``plan``, with a warning where its step (``report``: the order, the buckets and the
    prefetches as emitted) peaks above the memory budget although the solver's step did
    not (passes/solve warns of its own): the buckets' and the prefetches' budget checks
    should keep it within (passes/buckets, passes/prefetch)."""
    budget = plan.stats.get("memory_budget")
    solver = plan.stats.get("peak_bytes")
    if budget is None or solver is None or solver > budget + within(budget):
        return plan
    if report.peak_bytes <= budget + within(budget):
        return plan
    mib = 2**20
    return dataclasses.replace(
        plan,
        warnings=(
            *plan.warnings,
            f"the emitted step's memory ({report.peak_bytes / mib:,.1f} MiB per rank at "
            f"{report.peak_node}) is above the budget of {budget / mib:,.1f} MiB that the "
            f"solver's step keeps ({solver / mib:,.1f} MiB): please report it with the model",
        ),
    )


def _memory_stats(report: MemoryReport | None) -> dict:
    if report is None:
        return {}
    return {"step_peak_bytes": report.peak_bytes, "arena_bytes": report.arena_bytes}


TRACE = Stage("trace", _trace, _trace_stats)
PLAN_STAGES = (
    Stage("fold", _fold, _fold_stats, skippable=True),
    Stage("strategies", _strategies, lambda sp: {"strategies": sp.n_strategies()}),
    Stage("solve", _solve, lambda sol: dict(sol.stats)),
)
"""From a traced step to a solution: what ``autopar.plan`` runs after ``TRACE``."""
REPORT_STAGES = (
    Stage("order", _order, _order_stats, skippable=True),
    Stage("buckets", _buckets, _buckets_stats, skippable=True),
    Stage("prefetch", _prefetch, _prefetch_stats, skippable=True),
    Stage("memory", _memory, _memory_stats, skippable=True),
)
"""On the assembled Plan: the operator order (passes/order), into ``plan.order``; the
gradient buckets (passes/buckets) and the reshards issued early (passes/prefetch), into
``plan.collectives``; and the step memory per rank in that order (passes/memory), into
``plan.memory``."""
COMPILE_STAGES = (Stage("codegen", _codegen, _codegen_stats),)
"""From a plan to the compiled local step: what ``autopar.compile`` runs after planning."""
ALL_STAGES = (TRACE, *PLAN_STAGES, *REPORT_STAGES, *COMPILE_STAGES)
STAGE_NAMES = tuple(s.name for s in ALL_STAGES)

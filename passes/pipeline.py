"""The pass runner: the pipeline as named stages, run by one driver.

Takes: a list of ``Stage``s and a ``State`` holding what the first stage reads. Returns:
the state, with each stage's output in the field of the stage's name, and the stage
statistics added to ``stats``. The pipeline of docs/architecture.md, as entries:

    stage        reads                                   output        statistics
    trace        model, example_inputs, loss_fn,         StepGraph     nodes,
                 example_targets, stack, mp_policy                     mixed_precision
    fold         trace                                   FoldedGraph   fold, fold_regions,
                                                          (None when     folded_nodes,
                                                          skipped)       fold_groups
    strategies   trace, fold, mesh                       StrategySpace strategies
    solve        strategies, options; makes the          Solution      the solver's (problem
                 ``emitter`` (passes/emit), which                      size, status, phases,
                 judges each overlap round's plan                      overlap_rounds)
                 by the step it emits
    (assembly)   solve, emitter                          plan          search_s
    order        emitter, solve, plan                    Ordering      order_segments,
                                                                       order_exact, ...,
                                                                       traced_peak_bytes
    buckets      emitter, solve, plan                    Plan          buckets,
                                                                       bucketed_reductions
    prefetch     emitter, solve, plan                    Plan          prefetched
    memory       emitter, solve, plan                    MemoryReport  step_peak_bytes,
                                                                       arena_bytes
    codegen      trace, plan, dmesh                      CompiledStep  local_nodes,
                                                                       local_collectives

The emitted step's stages (``REPORT_STAGES``: order, buckets, prefetch, memory) each ask the
emitter for their artifact of the solution on the plan the stage before gave: the emitter
takes it from what the solver's overlap rounds made of the same solution on the same plan,
else makes it (passes/emit). Each stage that gives a plan (the order's, the buckets', the
prefetches', the memory stage's with its budget warning) sets ``state.plan``, which the
next stage reads and the caller takes.

``run_stages`` runs the stages in order. For each it records the wall time as
``stats["<name>_s"]`` and the stage's own statistics, and logs one line (logger
``autopar``). A stage named in ``skip`` does not run: its output is None and its statistics
say so; only stages marked ``skippable`` may be skipped (``fold``: ``fold=False`` of the
public API is ``skip={"fold"}``; ``order``: the traced order; ``buckets``: one all-reduce
per gradient; ``prefetch``: each reshard issued at its consumer; ``memory``). A new stage is
a new entry in a list (``PLAN_STAGES``, ``REPORT_STAGES``, ``COMPILE_STAGES``) and a field
of ``State`` for its output, not an edit of the driver.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from autopar.core import CompiledStep, Mesh, Plan, Solution, StrategySpace

from .buckets import DEFAULT_BUCKET_BYTES
from .codegen import codegen
from .emit import Emitter
from .fold import FoldedGraph, fold_regions
from .memory import MemoryReport
from .options import PlanOptions
from .order import Ordering
from .solve import solve
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
    "check_skip",
    "Stage",
    "State",
    "run_stages",
]

log = logging.getLogger("autopar")


@dataclass(slots=True)
class State:
    """What the stages read and make: the inputs a caller gives, then one field per stage
    (its output, None until it runs or where it is skipped), and the plan as the stages
    after the solve leave it."""

    options: PlanOptions = field(default_factory=lambda: PlanOptions())
    # the trace stage's inputs
    model: Any = None
    example_inputs: Any = None
    loss_fn: Any = None
    example_targets: Any = None
    stack: Any = None
    meta_device: str = "cpu"
    mp_policy: Any = None
    mesh: Mesh | None = None  # the planning mesh (strategies)
    dmesh: Any = None  # the torch DeviceMesh (codegen)
    # the stages' outputs
    trace: StepGraph | None = None
    fold: FoldedGraph | None = None
    strategies: StrategySpace | None = None
    solve: Solution | None = None
    order: Ordering | None = None
    buckets: Plan | None = None
    prefetch: Plan | None = None
    memory: MemoryReport | None = None
    codegen: CompiledStep | None = None
    # the emitted step of the search's solutions (made by the solve stage, passes/emit) and
    # the plan: assembled from the solution, then as each later stage leaves it
    emitter: Emitter | None = None
    plan: Plan | None = None

    def assemble(self, fingerprint: str, stats: dict) -> Plan:
        """The plan of the solve stage's solution, from the emitter where the overlap
        rounds judged it (passes/emit ``assemble``); it becomes ``plan``."""
        assert self.emitter is not None and self.solve is not None
        self.plan = self.emitter.assemble(self.solve, fingerprint, stats)
        return self.plan

    def emitted_length(self) -> float:
        """The length of the step ``plan`` emits (passes/emit ``emitted_length``)."""
        assert self.emitter is not None and self.solve is not None and self.plan is not None
        return self.emitter.emitted_length(self.solve, self.plan)


@dataclass(frozen=True, slots=True)
class Stage:
    """One named stage of the pipeline.

    Attributes:
        name: the stage's name: its output's field in the ``State``, its time's key in
            ``stats``.
        run: ``run(state) -> output``; reads earlier outputs from the ``State``'s fields.
        stats: ``stats(output) -> dict`` of sizes for ``plan.stats`` (``output`` is None
            when the stage was skipped).
        skippable: whether ``skip`` may name it (later stages accept its None output).
    """

    name: str
    run: Callable[[State], Any]
    stats: Callable[[Any], dict] = field(default=lambda out: {})
    skippable: bool = False


def run_stages(
    stages: Sequence[Stage], state: State, stats: dict, *, skip: Collection[str] = ()
) -> State:
    """Run ``stages`` in order on ``state`` (module docstring); returns ``state``."""
    for stage in stages:
        if stage.name in skip:
            if not stage.skippable:
                raise ValueError(f"stage {stage.name!r} cannot be skipped")
            setattr(state, stage.name, None)
            stats.update(stage.stats(None))
            log.info("autopar: %-10s skipped", stage.name)
            continue
        t0 = time.perf_counter()
        log.info("autopar: %s ...", stage.name, extra={"stage_start": stage.name})
        out = stage.run(state)
        seconds = time.perf_counter() - t0
        setattr(state, stage.name, out)
        sizes = stage.stats(out)
        stats[f"{stage.name}_s"] = seconds
        stats.update(sizes)
        shown = ", ".join(f"{k} {v}" for k, v in sizes.items() if isinstance(v, (int, str)))
        log.info("autopar: %-10s %7.2f s  %s", stage.name, seconds, shown)
    return state


# -- the stages ----------------------------------------------------------------------------


def _trace(state: State) -> StepGraph:
    return trace_step(
        state.model,
        state.example_inputs,
        loss_fn=state.loss_fn,
        example_targets=state.example_targets,
        stack=state.stack,
        meta_device=state.meta_device,
        mp_policy=state.mp_policy,
    )


def _trace_stats(step: StepGraph | None) -> dict:
    if step is None:
        return {}
    stats: dict[str, Any] = {"nodes": sum(1 for n in step.gm.graph.nodes if n.op != "output")}
    if step.mp_policy is not None:
        stats["mixed_precision"] = step.mp_policy.text()
    return stats


def _fold(state: State) -> FoldedGraph:
    assert state.trace is not None
    folded = fold_regions(state.trace)
    log.info("autopar: %s", folded.report())
    return folded


def _fold_stats(folded: FoldedGraph | None) -> dict:
    if folded is None:
        return {"fold": False, "fold_regions": 0, "folded_nodes": 0, "fold_groups": []}
    return {"fold": True, **folded.stats()}


def _strategies(state: State) -> StrategySpace:
    assert state.trace is not None and state.mesh is not None
    # NOTE: DTensor's rules may warn once per process; recording with "always" and warning
    # again through the caller's filters shows each planning run's warnings to the caller.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        space = build_strategies(state.trace, state.mesh, folded=state.fold)
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return space


def _solve(state: State) -> Solution:
    options, space = state.options, state.strategies
    assert space is not None and state.trace is not None
    state.emitter = emitter = Emitter(
        space,
        state.trace.gm,
        skip=options.skip,
        bucket_bytes=options.bucket_bytes,
        optimizer=options.optimizer,
    )
    return solve(space, options, judge=emitter)


def _emitted(state: State) -> tuple[Emitter, Solution, Plan]:
    assert state.emitter is not None and state.solve is not None and state.plan is not None
    return state.emitter, state.solve, state.plan


def _order(state: State) -> Ordering:
    emitter, solution, plan = _emitted(state)
    ordering, state.plan = emitter.order(solution, plan)
    return ordering


def _order_stats(ordering: Ordering | None) -> dict:
    if ordering is None:
        return {"order": False}
    return {
        "order": ordering.changed,
        **{f"order_{k}": v for k, v in ordering.stats.items()},
        "traced_peak_bytes": ordering.traced_step_peak,
    }


def _buckets(state: State) -> Plan:
    emitter, solution, plan = _emitted(state)
    state.plan = emitter.buckets(solution, plan)
    return state.plan


def _buckets_stats(plan: Plan | None) -> dict:
    if plan is None:
        return {"buckets": 0}
    return {"buckets": len({c.bucket for c in plan.collectives if c.bucket is not None})}


def _prefetch(state: State) -> Plan:
    emitter, solution, plan = _emitted(state)
    state.plan = emitter.prefetch(solution, plan)
    return state.plan


def _prefetch_stats(plan: Plan | None) -> dict:
    if plan is None:
        return {"prefetched": 0}
    return {"prefetched": sum(c.issue_after is not None for c in plan.collectives)}


def _memory(state: State) -> MemoryReport:
    emitter, solution, plan = _emitted(state)
    report, state.plan = emitter.memory(solution, plan)
    return report


def _memory_stats(report: MemoryReport | None) -> dict:
    if report is None:
        return {}
    return {"step_peak_bytes": report.peak_bytes, "arena_bytes": report.arena_bytes}


def _codegen(state: State) -> CompiledStep:
    assert state.trace is not None and state.plan is not None
    return codegen(state.trace, state.plan, state.dmesh)


def _codegen_stats(compiled: CompiledStep | None) -> dict:
    if compiled is None:
        return {}
    return {
        "local_nodes": len(compiled.gm.graph.nodes),
        "local_collectives": sum(compiled.collective_counts.values()),
    }


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
"""On the assembled Plan, the emitted step's stages (passes/emit): the operator order
(passes/order), into ``plan.order``; the gradient buckets (passes/buckets) and the reshards
issued early (passes/prefetch), into ``plan.collectives``; and the step memory per rank in
that order (passes/memory), into ``plan.memory``."""
COMPILE_STAGES = (Stage("codegen", _codegen, _codegen_stats),)
"""From a plan to the compiled local step: what ``autopar.compile`` runs after planning."""
ALL_STAGES = (TRACE, *PLAN_STAGES, *REPORT_STAGES, *COMPILE_STAGES)
STAGE_NAMES = tuple(s.name for s in ALL_STAGES)


def check_skip(skip: Collection[str]) -> None:
    """Refuse stage names in ``skip`` that are no stage, or a stage that cannot be skipped
    (``PlanOptions.skip``), before any stage runs."""
    unknown = set(skip) - set(STAGE_NAMES)
    if unknown:
        raise ValueError(f"unknown stage(s) {sorted(unknown)}; stages are {STAGE_NAMES}")
    fixed = [s.name for s in ALL_STAGES if s.name in skip and not s.skippable]
    if fixed:
        skippable = [s.name for s in ALL_STAGES if s.skippable]
        raise ValueError(f"stage(s) {fixed} cannot be skipped; skippable: {skippable}")

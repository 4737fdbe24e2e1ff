"""The emitted step: a solution turned into the step codegen runs, stage by stage.

Takes: a ``StrategySpace``, its traced graph and the planning options (which stages run, the
bucket size, the optimizer). Returns, for a ``Solution``: its ``Plan`` (``assemble``), in the
order the step runs (passes/order), its gradient reductions bucketed (passes/buckets), its
reshards issued early (passes/prefetch), its step memory (passes/memory), and the length of
that step simulated (core/schedule, ``length``). The stages skipped in the options are not
run: their plan is the one before.

One ``Emitter`` serves two callers (docs/architecture.md, "the emitter"):

    the solver's overlap rounds   ``length(solution)``: each round's plan judged by the step
                                  it emits (passes/solve, "Overlap"); ``prepare()``: what
                                  the stages read of the step whatever the plan, made while
                                  the first solve runs; ``idle()``: the step memory of the
                                  shortest plan so far, made while a round solved beside is
                                  awaited (the solver's ``StepJudge``)
    the pipeline's later stages   ``order``, ``buckets``, ``prefetch``, ``memory``: each on
                                  the plan the stage before gave, taken from what a round
                                  made of the same solution where its input was the same
                                  plan (the same order, the same collectives), else made

What each stage made of a solution is kept by solution (``_key``: the choice, the layers
checkpointed, the objective and the communication time: what makes two solutions one plan
to these stages): a round's stages are each linear in the step's nodes (~0.8 s of a
96-layer plan), and the pipeline's stages run on the kept round's solution again. A later
round's plan takes the first's node choices where they are the same (``Plan.from_solution``
``base``).

The order in the rounds: the first round's plan is ordered as the order stage orders it;
where that keeps the traced order, the later rounds' plans are judged in the traced order,
not ordered (the order is chosen for memory alone and keeps the traced one unless a lower
peak needs another). Where the order stage then orders the kept plan otherwise, the stages
after it make their plans again, and the step's length is simulated in that order
(``emitted_length``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field

import torch.fx

from autopar.core import Plan, Solution, StrategySpace
from autopar.core.schedule import schedule_inputs

from .buckets import bucket_measured, bucket_reductions
from .memory import MemoryReport, simulate
from .order import Ordering, order_step
from .order import prepare as prepare_order
from .prefetch import prefetch_measured
from .solve import within

__all__ = ["EMIT_STAGES", "Emitted", "Emitter"]

EMIT_STAGES = ("order", "buckets", "prefetch", "memory")
"""The stages of the emitted step, in the order they run (each skippable)."""


@dataclass(slots=True)
class Emitted:
    """What the stages made of one solution while the overlap rounds judged it: each stage's
    plan and what it added to the plan's statistics."""

    plan: Plan | None = None  # the solution's, as Plan.from_solution made it
    ordering: Ordering | None = None  # where the round ordered it
    bucketed: Plan | None = None
    bucket_stats: dict = field(default_factory=dict)
    prefetched: Plan | None = None
    prefetch_stats: dict = field(default_factory=dict)
    report: MemoryReport | None = None
    judged: Plan | None = None  # the plan whose step was simulated, and the step's length
    length: float = 0.0


def _key(solution: Solution) -> tuple:
    """What makes two solutions one plan to the emitted step's stages: the choice, the layers
    checkpointed, and the objective (the overlap's shares priced in)."""
    return (
        tuple(solution.choice.items()),
        tuple(r.group for r in solution.recompute),
        solution.objective_s,
        solution.comm_s,
    )


def _added(before: dict, after: dict) -> dict:
    return {k: v for k, v in after.items() if k not in before or before[k] != v}


class Emitter:
    """The emitted step of the solutions of one search (module docstring).

    ``skip``: the stages not to run (of ``EMIT_STAGES``); ``bucket_bytes``: the buckets'
    size (passes/buckets); ``optimizer``: whose state the step memory counts."""

    def __init__(
        self,
        space: StrategySpace,
        gm: torch.fx.GraphModule,
        *,
        skip: Collection[str] = (),
        bucket_bytes: float,
        optimizer: str = "adamw",
    ):
        self.space, self.gm = space, gm
        self.skip = frozenset(skip)
        self.bucket_bytes, self.optimizer = bucket_bytes, optimizer
        self.made: dict[tuple, Emitted] = {}
        self._shortest: tuple = ()  # the key of the shortest step judged so far
        self._reorders: bool | None = None  # whether the first round's plan was reordered
        self._first: tuple[Solution, Plan] | None = None  # the first round's, and its plan
        self._of: tuple[Solution, Emitted | None] | None = None  # ``of``'s last answer

    # -- the solver's rounds (passes/solve ``StepJudge``) ----------------------------------

    def prepare(self) -> None:
        """What the stages read of the step whatever the plan: the order's storage graph
        (~0.2 s of a 96-layer step), made while the solver's first solve runs."""
        if "order" not in self.skip:
            prepare_order(self.space, self.gm)

    def length(self, solution: Solution) -> float:
        """The length of the step ``solution`` emits, in seconds: its plan in the order, the
        buckets, the prefetches and the memory timeline the stages give it, simulated
        (core/schedule). What each stage made is kept (``made``)."""
        skip, space = self.skip, self.space
        made = Emitted()
        plan = Plan.from_solution(
            space,
            solution,
            fingerprint="",
            stats=dict(solution.stats),
            base=self._first,
        )
        if self._first is None:
            self._first = (solution, plan)
        made.plan = plan
        # the first round's plan ordered; the later rounds' only where it was not in the
        # traced order
        if "order" not in skip and self._reorders is not False:
            made.ordering = order_step(space, self.gm, plan)
            if self._reorders is None:
                self._reorders = made.ordering.changed
            if made.ordering.changed:
                plan = dataclasses.replace(plan, order=tuple(made.ordering.order))
        measured = None  # the memory of the plan as it stands, where a budget check measured it
        if "buckets" not in skip:
            before = dict(plan.stats)
            plan, measured = bucket_measured(space, plan, self.bucket_bytes, self.optimizer)
            made.bucketed = plan
            made.bucket_stats = _added(before, plan.stats)
        if "prefetch" not in skip:
            before = dict(plan.stats)
            given = plan
            plan, prefetched = prefetch_measured(space, plan, self.optimizer)
            # (prefetch returns the plan it was given where it measured nothing)
            measured = prefetched if prefetched is not None or plan is not given else measured
            made.prefetched = plan
            made.prefetch_stats = _added(before, plan.stats)
        if measured is not None and "memory" not in skip:
            # (unmeasured, the step's points are the plan's order and its copies alike,
            # core/schedule; the memory stage measures the kept round's plan once)
            made.report = measured
            plan = dataclasses.replace(plan, memory={**plan.memory, "step": measured.to_dict()})
        made.judged, made.length = plan, plan.emitted_step_s()
        key = _key(solution)
        self.made[key] = made
        shortest = self.made.get(self._shortest)
        if shortest is None or made.length < shortest.length:
            self._shortest = key
        return made.length

    def idle(self) -> None:
        """The step memory of the shortest plan judged so far, as the memory stage measures
        it (the memory stage takes it where that plan is kept: the zoo's rounds keep their
        first plan as a rule), in time the solver would spend waiting."""
        made = self.made.get(self._shortest)
        if made is None or made.report is not None or made.prefetched is None:
            return
        if "memory" in self.skip:
            return
        made.report = simulate(self.space, made.prefetched, optimizer=self.optimizer)

    # -- the pipeline's stages, on the kept solution -----------------------------------------

    def of(self, solution: Solution | None) -> Emitted | None:
        """What the rounds made of ``solution``, if they judged it (read once per solution:
        the key is a tuple of every node's choice)."""
        if not self.made or solution is None:
            return None
        if self._of is None or self._of[0] is not solution:
            self._of = (solution, self.made.get(_key(solution)))
        return self._of[1]

    def assemble(self, solution: Solution, fingerprint: str, stats: dict) -> Plan:
        """The plan of ``solution`` (``Plan.from_solution``), its nodes and collectives taken
        from the round that judged it where one did."""
        made = self.of(solution)
        return Plan.from_solution(
            self.space,
            solution,
            fingerprint=fingerprint,
            stats=stats,
            like=None if made is None else made.plan,
        )

    def order(self, solution: Solution, plan: Plan) -> tuple[Ordering, Plan]:
        """The order stage: ``plan``'s ``Ordering`` (passes/order) and the plan in it."""
        made = self.of(solution)
        if made is not None and made.ordering is not None:
            ordering = made.ordering
        else:
            ordering = order_step(self.space, self.gm, plan)
        # the traced order's peak as passes/memory measures it (optimizer state, the
        # return): the solver's measurement of the plan it chose is of that step (the
        # traced order, its checkpointed layers' copies, no bucket, no prefetch), else
        # measured
        solver = plan.solver_peak_bytes
        ordering.traced_step_peak = (
            solver
            if solver is not None
            else simulate(self.space, plan, optimizer=self.optimizer).peak_bytes
        )
        if ordering.changed:
            plan = dataclasses.replace(plan, order=tuple(ordering.order))
        return ordering, plan

    def buckets(self, solution: Solution, plan: Plan) -> Plan:
        """The buckets stage: ``plan`` with its gradient reductions bucketed."""
        made = self.of(solution)
        if made is not None and made.bucketed is not None and made.bucketed.order == plan.order:
            # what bucket_reductions changes: the collectives, their cost and the stream
            # semantics, and it adds to the plan's own statistics (in a copy, as it makes)
            b = made.bucketed
            return dataclasses.replace(
                plan,
                collectives=b.collectives,
                cost=b.cost,
                overlaps_collectives=b.overlaps_collectives,
                stats={**plan.stats, **made.bucket_stats},
            )
        return bucket_reductions(self.space, plan, self.bucket_bytes, self.optimizer)

    def prefetch(self, solution: Solution, plan: Plan) -> Plan:
        """The prefetch stage: ``plan`` with its reshards issued ahead of their consumers."""
        made = self.of(solution)
        if (
            made is not None
            and made.prefetched is not None
            and made.bucketed is not None
            and plan.collectives == made.bucketed.collectives
            and plan.order == made.bucketed.order  # (made in the order the plan has)
        ):
            if made.prefetched is made.bucketed:  # (prefetch changed nothing)
                return plan
            p = made.prefetched
            return dataclasses.replace(
                plan,
                collectives=p.collectives,
                order=p.order,
                stats={**plan.stats, **made.prefetch_stats},  # (a copy, as it makes)
            )
        return prefetch_measured(self.space, plan, self.optimizer)[0]

    def memory(self, solution: Solution, plan: Plan) -> tuple[MemoryReport, Plan]:
        """The memory stage: ``plan``'s step memory per rank (passes/memory), and the plan
        with a warning where that is above the budget the solver's step keeps."""
        made = self.of(solution)
        report = None
        if made is not None and made.report is not None and made.prefetched is not None:
            if (
                plan.collectives == made.prefetched.collectives
                and plan.order == made.prefetched.order
            ):
                report = made.report
        if report is None:
            report = simulate(self.space, plan, optimizer=self.optimizer)
        return report, _over_budget(plan, report)

    def emitted_length(self, solution: Solution, plan: Plan) -> float:
        """``plan.emitted_step_s()``: the round's where it judged the same step (the same
        inputs of core/schedule), else simulated."""
        made = self.of(solution)
        if made is not None and made.judged is not None:
            if schedule_inputs(made.judged) == schedule_inputs(plan):
                return made.length
        return plan.emitted_step_s()


def _over_budget(plan: Plan, report: MemoryReport) -> Plan:
    """``plan``, with a warning where its step (``report``: the order, the buckets and the
    prefetches as emitted) peaks above the memory budget although the solver's step did
    not (passes/solve warns of its own): the buckets' and the prefetches' budget checks
    should keep it within (passes/buckets, passes/prefetch)."""
    budget, solver = plan.memory_budget, plan.solver_peak_bytes
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

"""``solve``: the driver of the search (passes/solve's docstring is the math).

Takes: a ``StrategySpace`` and the options. Returns: a ``Solution``. It builds the ILP with
the constraints laid on it, solves it (under a budget, in rounds of cuts; where collectives
overlap, in overlap rounds), retries without the simplifications where constraints make it
infeasible, and turns every failure into a ``SolveError`` that says what to change.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from ortools.linear_solver import pywraplp

from autopar.core import Solution, StrategySpace

from ..memory import MemoryReport, measure
from ..options import PlanOptions
from ..pins import Pin, check_folding, parameter_uses
from ..pins import resolve as resolve_pins
from ..pricing import DeviceProfile, get_profile
from . import backend, highs, memory_rows, overlap
from .cuts import MAX_ROUNDS, _bounded, _Lives, _new_cuts, _PeakBound, smallest_budget, within
from .errors import SolveError
from .floor import _budget_error, _floor_error, state_floor
from .ilp import IlpBuilder, build_ilp, forbid_choice, freeze_axes, pin_node
from .readout import read_solution
from .rounds import OverlapRounds, StepJudge
from .settings import _MIB, MIP_GAP, hidden_kinds

log = logging.getLogger("autopar")


SIMPLIFICATIONS: tuple[tuple[str, str, Callable[[StrategySpace], dict]], ...] = (
    (
        "merge",
        "right before a following node or out of a parameter on several axes",
        lambda space: {"merge": False, "wide": parameter_uses(space)},
    ),
    ("reshard_axes", "on several axes anywhere", lambda space: {"reshard_axes": space.mesh.ndim}),
)
"""The ILP's simplifications (module docstring) in the order an ILP that constraints make
infeasible is solved without them: the name of each, the resharding it leaves out (as the
warning says it), and the options that leave it out."""


def solve(
    space: StrategySpace,
    options: PlanOptions | None = None,
    *,
    judge: StepJudge | None = None,
    solver: str | None = None,
    reshard_axes: int | None = 1,
    merge: bool = True,
    mip_gap: float = MIP_GAP,
) -> Solution:
    """Solve the ILP of the module docstring for ``space`` under ``options`` (passes/options:
    the planning options, whole; None: the defaults with no memory bound).

    What ``solve`` reads of the options: ``memory_budget`` (None: the device profile's
    usable memory, ``DeviceProfile.usable_memory``; ``math.inf``: no bound) or
    ``memory_fraction`` (that fraction of what one device holds running the whole step, the
    plan that replicates everything); ``optimizer`` (whose state the memory counts);
    ``checkpointing`` ("Checkpointing"); ``constraints`` (placements fixed before the
    search: passes/pins, ``pin_node``, and the mesh axes on which no edge between operators
    runs a collective, ``freeze_axes``) and ``pins``; ``forbid`` (choices the plan may not
    make: it changes at least one of each, ``forbid_choice``); ``time_limit_s``; and
    ``skip``: the kinds of overlap the emitted step has are the buckets' and the
    prefetches' unless their stage is skipped (``hidden_kinds``).
    ``judge``: what the caller makes of the step a solution emits (passes/emit
    ``Emitter``): the overlap's rounds are compared by its ``length`` ("Overlap"; without
    it, by T), its ``prepare`` runs on this thread while the first solve runs on another,
    and its ``idle`` where this thread would wait for a round solved beside.
    The ILP's own knobs: ``solver`` (OR-Tools' name; default ``$AUTOPAR_SOLVER`` or HiGHS);
    ``reshard_axes``: the most mesh axes an edge between two operators may change at once
    (None: no limit; graph outputs may always change every axis); ``merge``:
    simplification 1 (following nodes: a smaller ILP that can lose, module docstring;
    False gives every node its own variables and every edge all its pairs); ``mip_gap``:
    stop once the incumbent is within this fraction of the best bound.
    """
    if options is None:
        options = PlanOptions(memory_budget=math.inf)
    solver = solver or os.environ.get("AUTOPAR_SOLVER", "HIGHS")
    pinned, frozen = resolve_pins(space, options.constraints)
    pins = [*pinned, *options.pins]
    ilp_options = dict(merge=merge, reshard_axes=reshard_axes, hides=hidden_kinds(options.skip))
    profile = get_profile(space.mesh.device)
    bounded = options.memory_fraction is not None or not (
        options.memory_budget is not None and math.isinf(options.memory_budget)
    )
    lives = _Lives(space, options.checkpointing and bounded)
    budget = _budget(space, profile, lives, options, pins) if bounded else None
    search = Search(
        space, profile, lives, budget, options, pins=pins, frozen=frozen, solver=solver,
        mip_gap=mip_gap, judge=judge,
    )  # fmt: skip
    t0 = time.perf_counter()
    ilp, status, report = search.attempt(ilp_options)
    retried: list[tuple[str, str]] = []  # the simplifications left out, and what they leave out
    constrained = pins or frozen or options.forbid
    for name, what, without in SIMPLIFICATIONS:
        if not constrained or status != pywraplp.Solver.INFEASIBLE:
            break
        loosened = dict(ilp_options, **without(space))
        if loosened == ilp_options:
            continue
        # NOTE: the simplifications (module docstring) leave out pairs that a constrained
        # plan may need (a pinned parameter resharded on two axes into its consumer, a
        # following node resharded right before it): constraints are never infeasible
        # because of them, so the ILP without them is asked, one at a time, before saying no
        log.info("the constraints admit no plan of the simplified ILP: resharding %s too", what)
        ilp, status, report = search.attempt(loosened)
        retried.append((name, what))
        ilp_options = loosened
    ilp_s = round(time.perf_counter() - t0, 6)
    if not highs.solved(status):
        raise _unsolved(search, ilp, status, ilp_s, ilp_options)
    assert report is not None
    return _solution(search, ilp, status, report, ilp_s, retried)


def _budget(
    space: StrategySpace,
    profile: DeviceProfile,
    lives: _Lives,
    options: PlanOptions,
    pins: Sequence[Pin],
) -> float:
    """The budget in bytes per rank that bounded ``options`` give (``solve``); a budget below
    the model's state is refused at once, not after the rounds of cuts and the
    smallest-budget ILP find that nothing fits ("Memory")."""
    optimizer = options.optimizer
    if options.memory_fraction is not None:
        # nothing checkpointed: the whole step as one device runs it
        whole = measure(lives.now, lambda n, o: None, lambda n, j: None, optimizer).peak_bytes
        budget = options.memory_fraction * whole
    elif options.memory_budget is None:
        budget = profile.usable_memory
    else:
        budget = float(options.memory_budget)
    floor = state_floor(space, optimizer, pins)
    if floor > budget + within(budget):
        raise _floor_error(budget, floor, space, optimizer, pins)
    return budget


class Search:
    """One search's state: the ILP's inputs and the solves it runs (an attempt, a solve in
    place, a round taken from beside), in place of closures over ``solve``'s arguments."""

    def __init__(
        self,
        space: StrategySpace,
        profile: DeviceProfile,
        lives: _Lives,
        budget: float | None,
        options: PlanOptions,
        *,
        pins: Sequence[Pin],
        frozen: Mapping[int, Collection[str]] | None,
        solver: str,
        mip_gap: float,
        judge: StepJudge | None,
    ):
        self.space, self.profile, self.lives, self.budget = space, profile, lives, budget
        self.solver, self.time_limit_s, self.mip_gap = solver, options.time_limit_s, mip_gap
        self.optimizer, self.pins, self.frozen = options.optimizer, pins, frozen
        self.forbid = options.forbid
        self.judge = judge
        self.pending: list[Callable[[], Any]] = [self.warm]  # done while the first solve runs

    def warm(self) -> None:
        """What the first solve leaves this thread free for: the step the solver measures
        its plans on, and the judge's ``prepare``."""
        self.lives.now  # noqa: B018 (made where first read)
        if self.judge is not None:
            self.judge.prepare()

    def attempt(self, options: dict) -> tuple[IlpBuilder, int, MemoryReport | None]:
        """The ILP of ``options`` built, constrained and solved: its overlap rounds too
        ("Overlap": re-price what may hide at the share the last plan leaves unhidden; keep
        the plan whose step, as the judge says, is the shortest)."""
        space = self.space
        ilp = build_ilp(
            space, self.profile, solver=self.solver, optimizer=self.optimizer, **options
        )
        check_folding(space, ilp.folding.rep, list(self.pins))
        for pin in self.pins:
            pin_node(ilp, pin)
        if self.frozen:
            freeze_axes(ilp, self.frozen)
        for choice in self.forbid:
            forbid_choice(ilp, choice)
        status, report = self.once(ilp)
        if ilp.hide_coef and highs.solved(status):
            step, scales = overlap.overlap(ilp)
            ilp, status, report = OverlapRounds(self, ilp).run(step, scales, status, report)
        if report is None and highs.solved(status):  # (no budget: the kept plan's, measured once)
            report = memory_rows.evaluate(ilp, self.lives.now)
        return ilp, status, report

    def once(self, ilp: IlpBuilder) -> tuple[int, MemoryReport | None]:
        """A solve in place: its status and, under a budget, the step memory of its plan
        (passes/memory). Without one, no report: the rounds compare their steps' lengths
        alone, and ``attempt`` measures the plan it keeps (each is linear in the step's
        nodes)."""
        work = self.pending.pop() if self.pending else None
        if self.budget is None:
            return backend.run_beside(ilp, self.time_limit_s, self.mip_gap, work), None
        return _bounded(ilp, self.lives, self.budget, self.time_limit_s, self.mip_gap, work)

    def take(
        self, ilp: IlpBuilder, beside: backend.SolveBeside
    ) -> tuple[int, MemoryReport | _PeakBound | None]:
        """The round solved beside, as ``once`` would have solved it in place: its plan,
        where no memory cut binds it, else the round solved here. Its step memory is the
        bound from the last plan measured where that fits the budget (``_PeakBound``:
        then no cut binds), else measured."""
        status, held = beside.result(None if self.judge is None else self.judge.idle)
        if held is None:
            return self.once(ilp)
        ilp.restore(held)
        if self.budget is None:
            return status, None
        # where a bound from the last plan measured fits, no cut can bind: measured only
        # where the rounds keep it (``OverlapRounds.run``)
        bound = memory_rows.peak_bound(ilp, self.lives.now)
        if bound is not None and bound <= self.budget:
            return status, _PeakBound(bound)
        report = memory_rows.evaluate(ilp, self.lives.now)
        if _new_cuts(ilp, report, self.budget):
            return self.once(ilp)
        return status, report


def _unsolved(
    search: Search, ilp: IlpBuilder, status: int, ilp_s: float, options: dict
) -> SolveError:
    """The error of a search that ended without a plan, saying what to change."""
    budget, time_limit_s, space = search.budget, search.time_limit_s, search.space
    if status == pywraplp.Solver.NOT_SOLVED:
        size = f"{ilp.lp.NumVariables()} variables, {ilp.lp.NumConstraints()} constraints"
        if ilp_s < 0.9 * time_limit_s:  # the solver gave up on its own, not at the limit
            return SolveError(
                f"the solver ({search.solver}) stopped without a plan after {ilp_s:.1f} s, "
                f"before its time limit of {time_limit_s:.0f} s ({size}): please report it "
                "with the model; another solver may solve it (AUTOPAR_SOLVER=SCIP)"
            )
        return SolveError(
            f"the solver found no plan within its time limit of {time_limit_s:.0f} s "
            f"({size}): raise time_limit_s (autopar.plan(..., time_limit_s=...))"
            + ("" if budget is None else ", or the memory budget")
        )
    pins, frozen = search.pins, search.frozen
    if (pins or frozen) and status == pywraplp.Solver.INFEASIBLE:
        held = [f"{len(pins)} pinned nodes"] if pins else []
        held += [f"no reshard on axis {space.mesh.axis_names[a]}" for a in frozen or {}]
        return SolveError(
            f"no plan keeps the constraints ({', '.join(held)})"
            + ("" if budget is None else f" within a memory budget of {budget / _MIB:,.2f} MiB")
            + ": loosen them (fewer patterns, or a 'reshard:AXIS' of 'params' for 'none')"
            + ("" if budget is None else ", or raise the budget")
        )
    if budget is not None and status == pywraplp.Solver.INFEASIBLE:
        search.lives.widen()
        least = smallest_budget(
            space, search.profile, search.lives.now, solver=search.solver,
            time_limit_s=time_limit_s, optimizer=search.optimizer, **options,
        )  # fmt: skip
        return _budget_error(budget, least, time_limit_s, search.lives.checkpointing)
    # NOTE: every node may replicate everything (passes/strategies), so without a budget
    # the all-replicated plan is always a solution: this is a bug, not the model's fault
    return SolveError(
        f"the sharding ILP has no solution (solver status {status}) although the "
        "all-replicated plan should be one: please report it with the model"
    )


def _solution(
    search: Search,
    ilp: IlpBuilder,
    status: int,
    report: MemoryReport,
    ilp_s: float,
    retried: Sequence[tuple[str, str]],
) -> Solution:
    """The kept plan read back, with the search's statistics and warnings."""
    budget = search.budget
    stats: dict[str, Any] = {**ilp.times, "ilp_s": ilp_s}
    if ilp.rounds:
        stats["overlap_rounds"] = ilp.rounds
    warnings = []
    if retried:
        stats["unsimplified"] = [name for name, _ in retried]
        warnings.append(
            "the constraints admit no plan without resharding "
            f"{' or '.join(what for _, what in retried)}: "
            f"solved without {'those simplifications' if len(retried) > 1 else 'that simplification'}"
        )
    if budget is not None:
        stats.update(memory_budget=int(budget), memory_cuts=len(ilp.cuts))
        if report.peak_bytes > budget + within(budget):
            warnings.append(
                f"the plan's step memory ({report.peak_bytes / _MIB:.1f} MiB per rank at "
                f"{report.peak_node}) is above the budget of {budget / _MIB:.1f} MiB: the "
                f"solver stopped after {MAX_ROUNDS} rounds of bounding it"
            )
    stats["peak_bytes"] = report.peak_bytes
    sol = read_solution(
        ilp, status, stats, search.time_limit_s, like=ilp.kept,
        memory_budget=None if budget is None else int(budget), peak_bytes=report.peak_bytes,
    )  # fmt: skip
    sol.warnings.extend(warnings)
    return sol

"""The overlap rounds: the ILP solved again with each hiding term at the share the last plan
left unhidden ("Overlap" in passes/solve).

Takes: the search (passes/solve/driver ``Search``: how to solve a round in place or take one
solved beside) and its ILP after the first solve. Returns: the ILP holding the kept round's
solution, its status and its step memory. Each round's step is judged by the caller's
``StepJudge`` where it gives one (passes/emit: the emitted step simulated), else by T
(passes/solve/overlap ``overlap``); the shortest is kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from autopar.core import Solution

from ..memory import MemoryReport
from . import backend, highs, memory_rows, overlap
from .cuts import _PeakBound
from .ilp import IlpBuilder
from .readout import read_solution
from .settings import FIRST_SHARE, OVERLAP_ROUNDS

if TYPE_CHECKING:
    from .driver import Search

__all__ = ["OverlapRounds", "StepJudge"]


class StepJudge(Protocol):
    """What the caller makes of the step a solution emits (passes/emit ``Emitter``)."""

    def prepare(self) -> None:
        """Work that reads no solution, done on the solver's thread while its first solve
        runs on another."""

    def length(self, solution: Solution) -> float:
        """The length of the step ``solution`` emits, in seconds: the rounds are compared
        by it."""
        ...

    def idle(self) -> None:
        """Work done where the solver would wait for a round solved beside."""


@dataclass(slots=True)
class _Round:
    """One round as the rounds keep it: its step's length, the solution held, its shares,
    its status and step memory, and its solution as ``length`` read it (or None)."""

    length: float
    held: tuple[list[float], float, float]
    hide_scale: dict[tuple[str, int], float]
    status: int
    report: MemoryReport | _PeakBound | None
    solution: Solution | None


class OverlapRounds:
    """The rounds after the first solve (module docstring). Where the solver can
    (``highs.BESIDE_SOLVERS``), a round whose shares are known is solved beside the rounds
    before it are judged: the next round's once a round is solved, and the last round's
    (``LAST``) once the first is, where the first plan hides nothing in a part; each is read
    where the rounds reach it (``Search.take``), as solved in place, and dropped where they
    stop before."""

    def __init__(self, search: Search, ilp: IlpBuilder):
        self.search, self.ilp = search, ilp
        self.read: Solution | None = None  # the last round's solution, as ``length`` read it

    def length(self, step: float, status: int, report) -> float:
        """The round's step: as the judge says, else T (``step``)."""
        self.read = None
        judge = self.search.judge
        if judge is None:
            return step
        # (the solver's peak: passes/buckets measures only where buckets may pass it)
        stats: dict = {"memory_budget": self.search.budget}
        peak = None if report is None else report.peak_bytes
        if peak is not None:
            stats["peak_bytes"] = peak
        self.read = read_solution(
            self.ilp, status, stats, self.search.time_limit_s,
            memory_budget=self.search.budget, peak_bytes=peak,
        )  # fmt: skip
        return judge.length(self.read)

    def next_shares(self, scales: Mapping) -> dict[tuple[str, int], float] | None:
        """The shares of the next round, or None where they settled."""
        ilp = self.ilp
        counted = {k: ilp.hide_scale.get(k, overlap._first_share(ilp, k)) for k in scales}
        # where the plan has none of it, halfway to nothing unhidden: taken whole, that
        # share (0) swings the plan from one extreme to the other
        shares = {k: counted[k] / 2 if v is None else v for k, v in scales.items()}
        if all(abs(shares[k] - counted[k]) < 0.05 for k in scales):
            return None  # settled
        return shares

    def ahead(self, shares: Mapping[tuple[str, int], float] | None) -> backend.SolveBeside | None:
        """The round at ``shares`` started on a copy beside, where it can be."""
        ilp, search = self.ilp, self.search
        if shares is None or ilp.cuts or ilp.solver.upper() not in highs.BESIDE_SOLVERS:
            return None  # (a memory cut: the rounds after solve with more of them)
        return backend.SolveBeside(ilp, shares, search.time_limit_s, search.mip_gap)

    def _solve(self, beside: backend.SolveBeside | None):
        return self.search.once(self.ilp) if beside is None else self.search.take(self.ilp, beside)

    def _kept(self, length: float, status: int, report) -> _Round:
        ilp = self.ilp
        return _Round(length, ilp.hold(), dict(ilp.hide_scale), status, report, self.read)

    def run(
        self,
        step: float,
        scales: dict[tuple[str, int], float | None],
        status: int,
        report: MemoryReport | _PeakBound | None,
    ) -> tuple[IlpBuilder, int, MemoryReport | None]:
        """The rounds from the first solve's ``step`` and ``scales`` (its overlap)."""
        ilp = self.ilp
        last = {k: FIRST_SHARE["all_reduce"] for k in scales}
        shares = self.next_shares(scales) if OVERLAP_ROUNDS > 1 else None
        # the last round is read only where the kept plan hides nothing in a part: started
        # ahead where the first plan has such a part (in the zoo's and the tests' plans, a
        # first plan without one never kept one), else solved in place if it comes to it
        hides_nothing = any(v is None for v in scales.values())
        beside, beside_last = self.ahead(shares), self.ahead(last) if hides_nothing else None
        best = self._kept(self.length(step, status, report), status, report)
        best_scales = scales
        rounds = [best.length]
        for i in range(OVERLAP_ROUNDS - 1):
            if shares is None:
                break
            ilp.hide_scale = shares
            ilp.objective()
            status, report = self._solve(beside)
            if not highs.solved(status):
                break
            step, scales = overlap.overlap(ilp)
            shares = self.next_shares(scales) if i + 2 < OVERLAP_ROUNDS else None
            beside = self.ahead(shares)
            rounds.append(self.length(step, status, report))
            if rounds[-1] >= best.length * (1 - 1e-6):
                break  # no shorter: the rounds swing; the shortest so far is kept
            best, best_scales = self._kept(rounds[-1], status, report), scales
        if not ilp.cuts and any(v is None for v in best_scales.values()):
            # where the kept plan hides nothing in a part of the step (no gathers ahead in
            # the forward: data parallelism), the rounds judged that part's share from a
            # plan without it; one more round prices every part's at an all-reduce
            # bucket's share, all alike, and is kept where its step is shorter. Not where
            # the memory budget binds (the ILP has cuts): there each round is several
            # solves, and the plan shards already
            ilp.hide_scale = last
            ilp.objective()
            status, report = self._solve(beside_last)
            if highs.solved(status):
                step, _ = overlap.overlap(ilp)
                rounds.append(self.length(step, status, report))
                if rounds[-1] < best.length * (1 - 1e-6):
                    best = self._kept(rounds[-1], status, report)
        ilp.hide_scale, status, report, ilp.kept = (
            best.hide_scale,
            best.status,
            best.report,
            best.solution,
        )
        ilp.objective()
        ilp.restore(best.held)
        ilp.rounds = rounds
        if isinstance(report, _PeakBound):  # (the kept plan's step memory, measured)
            report = memory_rows.evaluate(ilp, self.search.lives.now)
        return ilp, status, report

"""The memory cutting-plane loop ("Memory" in passes/solve).

Takes: an ``IlpBuilder``, the step it measures its plans on (``_Lives``) and a budget.
Returns: the last status and the plan's step memory. Each round solves, measures bytes(i)
at every point (passes/memory), and bounds the points above the budget (``_new_cuts``:
the peak, the other half's highest point, the highest of each of ``CUT_SPANS`` spans);
``smallest_budget`` minimizes a bound M over the same points instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autopar.core import StrategySpace, roles

from .. import remat
from ..memory import Liveness, MemoryReport, liveness
from ..pricing import DeviceProfile
from . import backend, highs, memory_rows
from .ilp import IlpBuilder, build_ilp
from .settings import _MIB, _SCALE

log = logging.getLogger("autopar")


MAX_ROUNDS = 16
"""Rounds of the cutting-plane loop (module docstring, "Memory")."""


def within(budget: float) -> float:
    """What a plan may exceed a memory bound by: the solver's feasibility tolerance, in
    bytes."""
    return 1e-9 * budget + 64


CUT_SPANS = 4
"""A round bounds the highest point of each of this many equal spans of the step, besides
the peak and the other half's highest point (module docstring, "Memory")."""


def _new_cuts(ilp: IlpBuilder, report: MemoryReport, bound: float) -> list[int]:
    """Points of ``report`` above ``bound`` to bound next: the peak, the highest point of
    the other half of the step (forward, backward), and the highest of each of
    ``CUT_SPANS`` spans of it, if not bounded yet."""
    space = ilp.space
    totals = [t for _, t in report.timeline]
    backward = [space.roles.get(n, roles.BACKWARD) == roles.BACKWARD for n, _ in report.timeline]
    peak = report.peak_index
    other = [k for k in range(len(totals)) if backward[k] != backward[peak]]
    ks = [peak]
    if other:
        ks.append(max(other, key=lambda k: totals[k]))
    n = len(totals)
    for j in range(CUT_SPANS):
        span = range(j * n // CUT_SPANS, (j + 1) * n // CUT_SPANS)
        if len(span):
            ks.append(max(span, key=lambda k: totals[k]))
    points = dict.fromkeys(report.points[k] for k in ks if totals[k] > bound)
    return [i for i in points if i not in ilp.cuts]


class _Lives:
    """The step the solver measures its plans on ("Checkpointing"): as traced, until a plan
    exceeds the budget (``widen``); then, where the solver may checkpoint, the step in
    which any layer may be (passes/remat ``candidates``), kept from then on."""

    def __init__(self, space: StrategySpace, checkpointing: bool) -> None:
        self.space, self.checkpointing, self.wide = space, checkpointing, False
        self._now: Liveness | None = None

    @property
    def now(self) -> Liveness:
        """The step measured now (made where first read: ``solve`` reads it while its
        first solve runs)."""
        if self._now is None:
            self._now = liveness(self.space)
        return self._now

    def widen(self) -> bool:
        """Whether the step measured changed (the candidates added: measure again)."""
        if self.wide or not self.checkpointing:
            return False
        self.wide = True
        self._now = liveness(self.space, remat.candidates(self.space))
        return True


@dataclass(frozen=True)
class _PeakBound:
    """In place of a round's ``MemoryReport`` where a bound of its peak fits the budget
    (``IlpBuilder.peak_bound``): at least its peak, not measured."""

    peak_bytes: int


def _bounded(
    ilp: IlpBuilder,
    lives: _Lives,
    budget: float,
    time_limit_s: float,
    mip_gap: float,
    meanwhile: Callable[[], Any] | None = None,
) -> tuple[int, MemoryReport | None]:
    """Solve, then bound the points where the plan's step memory exceeds ``budget`` and solve
    again, until it fits (module docstring, "Memory"). Returns the last status and the
    plan's memory (None if the solver found no plan). ``meanwhile``: done while the first
    solve runs (``backend.run``)."""
    deadline = time.perf_counter() + time_limit_s
    report = None
    for round_ in range(MAX_ROUNDS):
        status = backend.run_beside(
            ilp, max(deadline - time.perf_counter(), 1.0), mip_gap, meanwhile
        )
        meanwhile = None
        if not highs.solved(status):
            return status, None
        report = memory_rows.evaluate(ilp, lives.now)
        points = _new_cuts(ilp, report, budget)
        if points and lives.widen():  # the cuts are made on the step that may checkpoint
            report = memory_rows.evaluate(ilp, lives.now)
            points = _new_cuts(ilp, report, budget)
        value, best_bound = ilp.objective_value()
        log.info(
            "autopar: solve round %d: %.4f ms (bound %.4f ms), peak %.2f of %.2f MiB "
            "per rank%s; %d variables, %d constraints",
            round_ + 1,
            value / _SCALE * 1e3,
            best_bound / _SCALE * 1e3,
            report.peak_bytes / _MIB,
            budget / _MIB,
            f": bounding {len(points)} more points" if points else ": fits",
            ilp.lp.NumVariables(),
            ilp.lp.NumConstraints(),
        )
        if not points:
            return status, report
        for i in points:
            memory_rows.memory_cut(ilp, lives.now, i, budget)
    return status, report


def smallest_budget(
    space: StrategySpace,
    profile: DeviceProfile,
    lv: Liveness,
    *,
    solver: str,
    time_limit_s: float,
    optimizer: str = "adamw",
    **options,
) -> MemoryReport | None:
    """The step memory of the plan with the smallest peak per rank the ILP allows: the
    ILP without a budget, minimizing a bound M on bytes(i) at the points the loop adds
    (module docstring, "Memory"). None if the solver finds no plan in ``time_limit_s``."""
    ilp = build_ilp(space, profile, solver=solver, optimizer=optimizer, **options)
    bound = ilp.lp.NumVar(0.0, ilp.lp.infinity(), "peak_mib")
    ilp.objective({bound: 1.0})
    deadline = time.perf_counter() + time_limit_s
    best = None
    for _ in range(4 * MAX_ROUNDS):
        if not highs.solved(backend.run(ilp, max(deadline - time.perf_counter(), 1.0), 0.0)):
            return best
        report = memory_rows.evaluate(ilp, lv)
        if best is None or report.peak_bytes < best.peak_bytes:
            best = report
        points = _new_cuts(ilp, report, ilp.value(bound) * _MIB)
        if not points:
            return best
        for i in points:
            memory_rows.memory_cut(ilp, lv, i, bound)
    return best

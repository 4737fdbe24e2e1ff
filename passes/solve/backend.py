"""A solve of the ILP in place, and a solve of its copy beside the caller ("Solving",
"Overlap" in passes/solve).

Takes: an ``IlpBuilder`` as it stands. Returns: the solver's status, the solution held in
the builder (``IlpBuilder.hold``/``restore``). ``run``: checkpointing branches where the
ILP has flags (passes/solve/branches), else the relaxation first and the ILP where it is
not integral; ``run_beside``: the same, with the caller's work on this thread meanwhile;
``SolveBeside``: a copy of the model at other hiding shares, solved on a thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ortools.linear_solver import linear_solver_pb2, pywraplp

from . import branches, highs

if TYPE_CHECKING:
    from .ilp import IlpBuilder


def run(ilp: IlpBuilder, time_limit_s: float, mip_gap: float) -> int:
    ilp.held = None
    model = linear_solver_pb2.MPModelProto()
    ilp.lp.ExportModelToProto(model)
    t0 = time.perf_counter()
    # a fold group's checkpointing flag: branches on it, each an ILP (``branches.by_checkpointing``);
    # the relaxation with the flags free is not tried first (its big-M terms are not
    # integral where a cut binds; Llama-3-8B over (2, 4): 1.7 s of the round's 43.0 s)
    flags = [r.index() for r, *_ in ilp.remat.values()]
    split = branches.by_checkpointing(model, flags, ilp.solver, time_limit_s, mip_gap)
    if split is not None:
        status, held = split
        if held is not None:
            ilp.restore(held)
        return status
    held = highs.relaxed(model, ilp.solver, time_limit_s, presolve=relax_presolve(ilp))
    if held is not None:
        ilp.restore(held)
        return pywraplp.Solver.OPTIMAL
    ilp.lp.SetTimeLimit(highs.left_ms(time_limit_s, t0))
    params = highs.parameters(ilp.lp, ilp.solver, mip_gap)
    with highs.quiet_stdout():
        status = ilp.lp.Solve(params)
    if highs.solved(status):  # (held: what each round reads of it is made once, ``_once``)
        ilp.restore(ilp.hold())
    return status


def run_beside(
    ilp: IlpBuilder, time_limit_s: float, mip_gap: float, meanwhile: Callable[[], Any] | None
) -> int:
    """``backend.run``; ``meanwhile``: the caller's work, done on this thread while the solve runs
    on another (the solver holds no lock of Python's: the two overlap on two cores). What
    it prints to the process's stdout is lost: the solve holds fd 1 (``highs.quiet_stdout``)."""
    if meanwhile is None:
        return run(ilp, time_limit_s, mip_gap)
    return highs.beside(lambda: run(ilp, time_limit_s, mip_gap), meanwhile)


def relax_presolve(ilp: IlpBuilder) -> bool:
    """Whether the relaxation tried before the ILP (``highs.relaxed``) runs HiGHS's presolve:
    only where the ILP has memory cuts. Without them HiGHS's presolve took longer than the
    simplex it spared: the search's relaxations (search_scaling's GPT at 12 and 96 layers
    over (8, 8); GPT-3 over (16, 8); Llama-3-8B over (8) and (2, 4), bf16, H100; the tests'
    GPTs) solved in 0.012-0.56 s without it against 0.022-1.28 s with it, to the same
    objective and an integral solution each time; Llama-3-8B's search over (8, 8) (bf16,
    traced once) took 4.9-5.5 s instead of 7.8-8.4 s, the same plan. With cuts it is kept:
    the relaxations of GPT-3's and the tests' cut rounds took 1.4-2.4 times as long
    without it (Llama-3-8B's over (2, 4) took less, 0.79-2.22 s against 1.59-2.35 s)."""
    return bool(ilp.cuts)


class SolveBeside:
    """The ILP as it stands with its hiding terms at other shares, solved on a thread beside
    the caller's own work: a copy of the model, which a second core solves while the first
    solves or simulates another round ("Overlap"). ``result`` waits for it and gives
    ``(status, held)``, ``held`` as ``IlpBuilder.hold`` gives it (None where unsolved). A
    copy no round reads is left to finish on its own (a daemon thread, printing nothing).
    The caller's thread only copies the model and sets the objective; the thread solves the
    relaxation, and loads and solves the ILP itself only where that is not integral."""

    def __init__(
        self,
        ilp: IlpBuilder,
        hide_scale: Mapping[tuple[str, int], float],
        time_limit_s: float,
        mip_gap: float,
    ):
        self.solver, self._model = ilp.solver, ilp.model_at(hide_scale)
        self._mip_gap, self._presolve = mip_gap, relax_presolve(ilp)
        self._out: tuple[int, tuple[list[float], float, float] | None] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._solve, args=(time_limit_s,), daemon=True)
        self._thread.start()

    def _solve(self, time_limit_s: float) -> None:
        try:
            self._out = highs.solve_copy(
                self._model, self.solver, time_limit_s, self._mip_gap, presolve=self._presolve
            )
        except BaseException as e:  # raised again by result, on the caller's thread
            self._error = e

    def result(
        self, idle: Callable[[], Any] | None = None
    ) -> tuple[int, tuple[list[float], float, float] | None]:
        """``(status, held)``; ``idle`` is run first where the solve has not ended."""
        if idle is not None and self._thread.is_alive():
            idle()
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._out is not None
        return self._out

"""The HiGHS backend through OR-Tools: model copies, relaxations, parameters, threads.

Takes: ``MPModelProto`` models. Returns: statuses and held solutions ``(values by variable
index, objective, best bound)``. Nothing here knows the formulation; passes/solve/backend
and branches compose these into the solves the driver runs.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ortools.linear_solver import linear_solver_pb2, pywraplp


@contextlib.contextmanager
def quiet_stdout():
    """HiGHS prints a banner on the process's stdout (fd 1), below Python's reach."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def parameters(
    lp: pywraplp.Solver, solver: str, mip_gap: float, *, quiet: bool = False
) -> pywraplp.MPSolverParameters:
    """The solve's parameters: the gap, and (``quiet``) no output from HiGHS itself."""
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, mip_gap)
    if solver.upper() == "HIGHS":
        # NOTE: OR-Tools' HiGHS interface drops RELATIVE_MIP_GAP (it keeps no parameters of
        # its own, and answers False here) but hands this string to HiGHS, which reads it
        # before it prints anything (tests/unit/test_solve.py: a bad value is refused)
        lp.SetSolverSpecificParametersAsString(
            f"mip_rel_gap={mip_gap!r}" + (",output_flag=false" if quiet else "")
        )
    return params


INTEGRAL_TOL = 1e-9  # how far from 0 or 1 an integer variable of the relaxation may lie


def left_ms(time_limit_s: float, t0: float) -> int:
    """Milliseconds left of ``time_limit_s`` since ``t0`` (the relaxation took the rest), at
    least one second's."""
    return int(max(time_limit_s - (time.perf_counter() - t0), 1.0) * 1000)


def relaxation(
    model: linear_solver_pb2.MPModelProto,
    solver: str,
    time_limit_s: float,
    *,
    presolve: bool = True,
) -> tuple[int, list[float], float]:
    """The linear relaxation of ``model`` (every variable continuous), solved: its status,
    its values and its objective (``math.inf`` where infeasible, ``-math.inf`` where
    unsolved: a minimization's bound either way). ``presolve``: False solves it without
    HiGHS's presolve (``backend.relax_presolve``)."""
    relaxed = linear_solver_pb2.MPModelProto()
    relaxed.CopyFrom(model)
    for v in relaxed.variable:
        v.is_integer = False
    lp = pywraplp.Solver.CreateSolver(solver)
    if lp is None or lp.LoadModelFromProto(relaxed):
        return pywraplp.Solver.NOT_SOLVED, [], -math.inf
    lp.SuppressOutput()
    if solver.upper() == "HIGHS":
        # (not quiet_stdout: a solve beside the caller's runs this on another thread, and
        # two threads swapping fd 1 can leave it closed; HiGHS reads this before its banner)
        lp.SetSolverSpecificParametersAsString(
            "output_flag=false" + ("" if presolve else ",presolve=off")
        )
    lp.SetTimeLimit(int(time_limit_s * 1000))
    status = lp.Solve()
    if status != pywraplp.Solver.OPTIMAL:
        return status, [], math.inf if status == pywraplp.Solver.INFEASIBLE else -math.inf
    return status, [v.solution_value() for v in lp.variables()], lp.Objective().Value()


def relaxed(
    model: linear_solver_pb2.MPModelProto,
    solver: str,
    time_limit_s: float,
    *,
    presolve: bool = True,
) -> tuple[list[float], float, float] | None:
    """The ILP's linear relaxation solved (every variable continuous): its solution, held
    (``IlpBuilder.hold``), where every integer variable came out integral, which makes it
    the ILP's optimum; else None (the ILP is solved as one; module docstring).
    ``presolve``: as ``highs.relaxation``'s."""
    status, values, value = relaxation(model, solver, time_limit_s, presolve=presolve)
    if status != pywraplp.Solver.OPTIMAL:
        return None
    integer = [i for i, v in enumerate(model.variable) if v.is_integer]
    if any(abs(values[i] - round(values[i])) > INTEGRAL_TOL for i in integer):
        return None
    for i in integer:
        values[i] = float(round(values[i]))
    return values, value, value


def fixed(
    model: linear_solver_pb2.MPModelProto, values: Mapping[int, float]
) -> linear_solver_pb2.MPModelProto:
    """A copy of ``model`` with each variable of ``values`` (its index) fixed at its value."""
    out = linear_solver_pb2.MPModelProto()
    out.CopyFrom(model)
    for i, value in values.items():
        out.variable[i].lower_bound = out.variable[i].upper_bound = value
    return out


def solve_copy(
    model: linear_solver_pb2.MPModelProto,
    solver: str,
    time_limit_s: float,
    mip_gap: float,
    *,
    relax_first: bool = True,
    presolve: bool = True,
) -> tuple[int, tuple[list[float], float, float] | None]:
    """``model`` solved on a solver of its own: its relaxation (``relax_first``; with
    HiGHS's presolve or not, ``presolve``), then the ILP itself, loaded only where that
    is not integral. ``(status, held)``, ``held`` as
    ``IlpBuilder.hold`` gives it (None where there is no plan). Prints nothing (the
    process's stdout is left alone: ``backend.SolveBeside``'s copies run beside the caller's
    thread)."""
    t0 = time.perf_counter()
    if relax_first:
        held = relaxed(model, solver, time_limit_s, presolve=presolve)
        if held is not None:
            return pywraplp.Solver.OPTIMAL, held
    lp = pywraplp.Solver.CreateSolver(solver)
    error = lp.LoadModelFromProto(model)
    if error:
        raise RuntimeError(f"the ILP's copy did not load: {error}")
    lp.SuppressOutput()
    params = parameters(lp, solver, mip_gap, quiet=True)
    lp.SetTimeLimit(left_ms(time_limit_s, t0))
    status = lp.Solve(params)
    if not solved(status):
        return status, None
    obj = lp.Objective()
    return status, ([v.solution_value() for v in lp.variables()], obj.Value(), obj.BestBound())


def beside(run: Callable[[], Any], meanwhile: Callable[[], Any]) -> Any:
    """``run()`` on a thread while ``meanwhile()`` runs on this one; ``run``'s result (its
    exception raised here)."""
    out: list = []

    def target() -> None:
        try:
            out.append((True, run()))
        except BaseException as e:  # raised again on the caller's thread
            out.append((False, e))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        meanwhile()
    finally:
        thread.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


BESIDE_SOLVERS = ("HIGHS",)
"""Solvers whose rounds run on threads beside each other (``backend.SolveBeside``): HiGHS lets go
of Python's lock while it solves and takes ``output_flag`` before it prints its banner, so
a copy solves without the process's stdout sent to /dev/null (``highs.quiet_stdout``)."""


def solved(status: int) -> bool:
    return status in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE)

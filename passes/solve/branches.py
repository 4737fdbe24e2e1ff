"""The ILP with checkpointing flags, solved in branches on them ("Checkpointing" in
passes/solve).

Takes: the model's proto and the indices of its flags r. Returns: ``(status, held)`` of the
best branch, or None where the ILP is to be solved whole (no flag, or two groups or more
left open). Each branch fixes every r; its relaxation bounds its plans, and a branch whose
bound is not below the best plan's objective (within the gap) is not solved.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from ortools.linear_solver import linear_solver_pb2, pywraplp

from . import highs


def by_checkpointing(
    model: linear_solver_pb2.MPModelProto,
    flags: Sequence[int],
    solver: str,
    time_limit_s: float,
    mip_gap: float,
) -> tuple[int, tuple[list[float], float, float] | None] | None:
    """The ILP ``model`` solved as branches on its fold groups' checkpointing flags r
    (``flags``: their indices; "Checkpointing", module docstring), each branch an ILP with
    every r fixed. A relaxation bounds each branch: with one group, the relaxations at r = 0
    and at r = 1 (solved beside each other, ``BESIDE_SOLVERS``) order the two branches, and
    the ILP of the lower is solved first; the other's is solved only where its bound is
    below that plan's objective (within ``mip_gap``), and the better plan of the two is the
    ILP's. With several groups, the ILP with every r = 0 is solved first, and beside it,
    for each group, the relaxation with its r = 1 (the others free), a bound on every plan
    that checkpoints the group; a group whose bound is not below the first plan's objective
    is not checkpointed; where one group is left, the ILP with its r = 1 and the others 0
    is the second branch. ``(status, held)`` as ``highs.solve_copy`` gives them, the best bound
    the least of the branches'; None where there is no r, or two groups or more are left
    (the ILP is solved whole). The branches' ILPs are solved without trying their
    relaxation first: under memory cuts it is seldom integral."""
    if not flags:
        return None
    deadline = time.perf_counter() + time_limit_s

    def left() -> float:
        return max(deadline - time.perf_counter(), 1.0)

    def branch(ones: Collection[int]) -> tuple[int, tuple[list[float], float, float] | None]:
        """The ILP with the flags of ``ones`` at 1 and the others at 0."""
        fixed = highs.fixed(model, {i: float(i in ones) for i in flags})
        return highs.solve_copy(fixed, solver, left(), mip_gap, relax_first=False)

    def bound(values: Mapping[int, float]) -> float:
        return highs.relaxation(highs.fixed(model, values), solver, left())[2]

    def both(run: Callable[[], Any], meanwhile: Callable[[], Any]) -> Any:
        """``run()``, with ``meanwhile()`` beside it where the solver allows (else after)."""
        if solver.upper() in highs.BESIDE_SOLVERS:
            return highs.beside(run, meanwhile)
        out = run()
        meanwhile()
        return out

    # the branches not solved first: the flags each sets to 1, and its relaxation's bound
    rest: list[tuple[tuple[int, ...], float]] = []
    if len(flags) == 1:
        (flag,) = flags
        zero: list[float] = []
        one = both(lambda: bound({flag: 1.0}), lambda: zero.append(bound({flag: 0.0})))
        # the lower bound first (r = 0 where they tie); a branch without a plan is +inf
        (first, _), other = sorted([((), zero[0]), ((flag,), one)], key=lambda b: b[1])
        rest.append(other)
        status, held = branch(first)
    else:
        ones: list[float] = []
        status, held = both(lambda: branch(()), lambda: ones.extend(bound({i: 1.0}) for i in flags))
        rest += [((i,), b) for i, b in zip(flags, ones)]
    if held is None and status != pywraplp.Solver.INFEASIBLE:
        return status, None  # (the clock stopped it with no plan in hand)
    best = math.inf if held is None else held[1]
    cutoff = best if math.isinf(best) else best - mip_gap * abs(best)
    bounds = [math.inf if held is None else held[2]]  # each branch's, or a left-out one's
    left_open = [(o, b) for o, b in rest if b < cutoff]
    bounds += [b for _, b in rest if b >= cutoff]
    if len(left_open) > 1:
        return None
    if not left_open:
        if held is None:
            return pywraplp.Solver.INFEASIBLE, None
        return status, (held[0], held[1], min(bounds))
    ((second, open_bound),) = left_open
    status1, held1 = branch(second)
    if held1 is not None:
        bounds.append(held1[2])
    elif status1 != pywraplp.Solver.INFEASIBLE:
        bounds.append(open_bound)  # (stopped by the clock: its relaxation bounds it)
    plans = [h for h in (held, held1) if h is not None]
    if not plans:
        both_infeasible = status == status1 == pywraplp.Solver.INFEASIBLE
        return (pywraplp.Solver.INFEASIBLE if both_infeasible else status1), None
    values, value, _ = min(plans, key=lambda h: h[1])
    exact = {status, status1} <= {pywraplp.Solver.OPTIMAL, pywraplp.Solver.INFEASIBLE}
    status = pywraplp.Solver.OPTIMAL if exact else pywraplp.Solver.FEASIBLE
    return status, (values, value, min(bounds))

"""The overlap of collectives with the compute, read from the ILP ("Overlap" in
passes/solve).

Takes: an ``IlpBuilder`` at a solution. Returns: the objective's coefficients with each
hiding term at its share (``objective_terms``), and the step's length T with the share of
each H_pa left unhidden (``overlap``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import TYPE_CHECKING

from .settings import _SCALE, FIRST_SHARE, PARTS

if TYPE_CHECKING:
    from .ilp import IlpBuilder


def _first_share(ilp: IlpBuilder, key: tuple[str, int]) -> float:
    """The share the first solve counts of a part's and axis's hiding terms: the largest
    ``FIRST_SHARE`` of the kinds it has."""
    return max(FIRST_SHARE[kind] for kind, part, axis in ilp.hide_coef if (part, axis) == key)


def objective_terms(ilp: IlpBuilder, hide_scale: Mapping[tuple[str, int], float]) -> dict:
    """The objective's coefficient of each variable, the hiding terms at ``hide_scale``."""
    terms: dict = defaultdict(float, ilp.coef)
    for v, c in ilp.ties.items():
        terms[v] += c
    for (kind, part, axis), pool in ilp.hide_coef.items():
        share = hide_scale.get((part, axis), FIRST_SHARE[kind])
        for v, c in pool.items():
            terms[v] += share * c
    return terms


def overlap(ilp: IlpBuilder) -> tuple[float, dict[tuple[str, int], float | None]]:
    """At the solution: the step's length (seconds) with what may hide beside the
    compute of its part, W + sum over parts of max_a max(0, H_pa - (W_p - B_pa)), and
    the share of each H_pa that is not hidden (None where the plan has none of it:
    "Overlap")."""
    return ilp._once("overlap", lambda: _overlap(ilp))


def _overlap(ilp: IlpBuilder) -> tuple[float, dict[tuple[str, int], float | None]]:

    # the choice variables rounded (the solver's tolerance leaves 1e-7 on a continuous
    # e; the plan is the rounded choice); a checkpointed group's time t as it is
    times = {t for _, t, _, _ in ilp.remat.values()}

    def value(part: dict) -> float:
        return (
            sum(c * (ilp.value(v) if v in times else round(ilp.value(v))) for v, c in part.items())
            / _SCALE
        )

    whole, forward = value(ilp.coef), value(ilp.forward_coef)
    length = {"forward": forward, "backward": whole - forward}
    hides: dict[tuple[str, int], float] = defaultdict(float)
    for (_, part, axis), pool in ilp.hide_coef.items():
        hides[(part, axis)] += value(pool)
    others = {k: value(pool) for k, pool in ilp.axis_coef.items()}
    exposed = dict.fromkeys(PARTS, 0.0)
    scales = {}
    for (part, axis), h in hides.items():
        shown = max(0.0, h - (length[part] - others.get((part, axis), 0.0)))
        exposed[part] = max(exposed[part], shown)
        scales[(part, axis)] = shown / h if h > 0 else None
    # the step's length has each step of the buckets' chains over several axes beside
    # the compute on its axis, as the hiding terms; the shares are those of the plan
    # with the chains whole (the ILP counts them so, "Overlap")
    multi = {k: value(pool) for k, pool in ilp.multi_coef.items()}
    if not any(multi.values()):
        return whole + sum(exposed.values()), scales
    # (B_pa without the chains: their pairs' whole time on each axis they run on)
    chains = {v for pool in ilp.multi_coef.values() for v in pool}
    for key, pool in ilp.axis_coef.items():
        others[key] -= value({v: c for v, c in pool.items() if v in chains})
    chained = dict.fromkeys(PARTS, 0.0)
    for (part, _), h in multi.items():
        chained[part] += h
    length = {p: length[p] - chained[p] for p in PARTS}
    exposed = dict.fromkeys(PARTS, 0.0)
    for key in set(hides) | set(multi):
        part = key[0]
        h = hides.get(key, 0.0) + multi.get(key, 0.0)
        exposed[part] = max(exposed[part], h - (length[part] - others.get(key, 0.0)))
    return whole - sum(chained.values()) + sum(exposed.values()), scales

"""The solver's constants: units, shares, limits (passes/solve, module docstring)."""

from __future__ import annotations

from collections.abc import Collection

from autopar.core import roles

GRAD_OVERLAP = 0.75  # the share of all-reduce buckets first counted as hidden ("Overlap")


# per kind of hiding term, the share the first solve counts: an all-reduce bucket's at a
# quarter, a reduce-scatter bucket's and a prefetch's whole (the plan without their overlap)
FIRST_SHARE = {"all_reduce": 1.0 - GRAD_OVERLAP, "reduce_scatter": 1.0, "prefetch": 1.0}


MULTI = "multi_axis"  # a bucket's reduction over several axes (passes/buckets ``chain``)


OVERLAP_ROUNDS = 3  # solves at most, each re-pricing what may hide at the last one's overlap


PARTS = ("forward", "backward")


HIDES = frozenset(FIRST_SHARE) | {MULTI}  # the kinds of overlap the emitted step has (all)


def hidden_kinds(skip: Collection[str]) -> frozenset[str]:
    """The kinds of overlap the emitted step has (``HIDES``): the buckets' and the
    prefetches', unless their stage is skipped (``PlanOptions.skip``)."""
    kinds = set()
    if "buckets" not in skip:
        kinds |= {"all_reduce", "reduce_scatter", MULTI}
    if "prefetch" not in skip:
        kinds.add("prefetch")
    return frozenset(kinds)


MIP_GAP = 1e-4  # stop within 0.01% of the optimum (HiGHS's own default)


_SCALE = 1e6  # seconds -> microseconds inside the ILP, to keep coefficients well scaled


TIE_BREAK_US = 1e-4  # preference for earlier strategies, microseconds per node


_MIB = 2**20  # bytes -> MiB in the smallest-budget ILP's objective


_STATE_ROLES = (roles.PARAM, roles.BUFFER, roles.INPUT, roles.TARGET, roles.TANGENT)

"""A bound on a plan's peak without a sweep: from another plan's measured peak, where the
two place only some nodes otherwise.

Takes: a ``Liveness`` (passes/memory_liveness), the placements before and after, the nodes
that changed and the peak passes/memory's ``measure`` found before.
Returns: bytes, at least ``measure``'s peak under the placements after (the peak itself
where nothing changed).

Each storage, reshard and graph output lives over the same points under both, so the
other's total at any point is the first's plus their changes there; the first's peak, plus
the optimizer state's change and every one of them that grows, is at least the other's peak
(the solver's overlap rounds check their plans' budget so):

    bytes'(i) = bytes(i) + sum_t (size'(t) - size(t)) [t live at i]
             <= peak + d(optimizer state) + sum_t max(0, size'(t) - size(t))
                     + sum_{t live longer after} min(size'(t), size(t))

over the terms t the changed nodes touch (a storage read through views, or a view's
buffer, may live longer where the change cuts no chain it was read through before).
"""

from __future__ import annotations

from collections.abc import Collection

from .memory_liveness import (
    Liveness,
    Storage,
    optimizer_bytes,
    output_redistributions,
    redistributes,
    resharded_views,
    view_held,
)
from .memory_sizes import InPlacement, OutPlacement, local_bytes, resharder, sizer

__all__ = ["peak_bound"]


def peak_bound(
    lv: Liveness,
    before: tuple[OutPlacement, InPlacement],
    after: tuple[OutPlacement, InPlacement],
    changed: Collection[str],
    peak_bytes: int,
    optimizer: str = "adamw",
    recompute: Collection[str] = (),
) -> int:
    """At least ``measure``'s peak under the placements ``after``, from its peak under
    ``before`` (``peak_bytes``; the same ``lv``, ``optimizer`` and ``recompute``) where only
    the nodes ``changed`` place their outputs or inputs otherwise; linear in the storages,
    inputs and graph outputs they touch, not in the step's points.

    Every storage, reshard and graph output's redistribution lives over the same points
    under both, so at any point the total changes by the sum of their changes there, and
    the optimizer state's change at every point: the old peak, plus the optimizer state's
    change, plus each of the others' growth (where each grows), bounds the new total at
    every point. Buckets (``lv.early``) are not bounded: a ValueError."""
    if lv.early:
        raise ValueError("peak_bound: a step with buckets (measure it)")
    space = lv.space
    mesh_shape = tuple(space.mesh.shape)
    nbytes, reshard = sizer(mesh_shape), resharder(mesh_shape)
    params = set(lv.params)
    owned, reads, viewed = lv.touching()
    grow = 0

    def stored(s: Storage, out_ps: OutPlacement) -> tuple[int, int]:
        ps = out_ps(s.owner, s.out)
        size = nbytes(s.shape, s.dtype, ps) if s.counted else 0
        return size, optimizer_bytes(s, ps, mesh_shape, optimizer) if s.owner in params else 0

    def resharded(entry, out_ps: OutPlacement, in_ps: InPlacement) -> int:
        _, name, j, src, so, _ = entry
        q = in_ps(name, j)
        p = None if q is None else out_ps(src, so)
        if p is None or q is None or not redistributes(p, q):
            return 0
        shape, dtype = space.tensor(src, so)
        return reshard(tuple(shape), dtype, p, q, space.layouts.get((src, so)))

    # (which views' inputs each plan redistributes: how long a storage read through views,
    # or a view's buffer, lives)
    cut_before, cut_after = resharded_views(space, *before), resharded_views(space, *after)

    storages = {id(s): s for n in changed for s in owned.get(n, ())}
    for s in storages.values():
        if not s.counts(recompute):
            continue
        (was, was_opt), (now, now_opt) = stored(s, before[0]), stored(s, after[0])
        grow += max(0, now - was) + now_opt - was_opt  # (the optimizer's at every point)
        if s.views and s.until(cut_after) > s.until(cut_before):
            grow += min(now, was)  # (live at points it was not: all of ``now`` there)
    entries = {(e[0], e[2]): e for n in changed for e in reads.get(n, ())}
    for e in entries.values():
        if e[5] is not None and e[5] not in recompute:  # (a copy not in this step)
            continue
        grow += max(0, resharded(e, *after) - resharded(e, *before))
    for h in {id(h): h for n in changed for h in viewed.get(n, ())}.values():
        if h.when is not None and (h.when[0] in recompute) != h.when[1]:
            continue
        now, was = view_held(lv, h, *after, nbytes), view_held(lv, h, *before, nbytes)
        grow += max(0, now - was)
        if h.views and h.until(cut_after) > h.until(cut_before):
            grow += min(now, was)

    # the graph outputs whose node or parameter changed (the others' bytes are the same
    # under both), all at the step's return
    moved = set(changed)
    sinks = [s for s in space.sinks if s.src in moved or s.like in moved]

    def outputs(out_ps: OutPlacement) -> int:
        return sum(
            local_bytes(*space.tensor(src, so), target, mesh_shape)
            for src, so, target, _ in output_redistributions(lv, out_ps, sinks)
        )

    grow += max(0, outputs(after[0]) - outputs(before[0]))
    return peak_bytes + grow

"""Tensor layout: an offset for every storage of the step in one arena per rank.

Takes: blocks ``(first, last, size)``, a storage live from point ``first`` to point ``last``
(inclusive) of the step as passes/memory counts it. Returns: an offset per block and the
arena's size, such that two blocks live at the same point never share a byte.

How (dynamic storage allocation, as ROAM lays tensors out, with lifetimes known ahead):
the points are swept in order; at each, the blocks whose life ended before it return their
range to a free list (adjacent ranges merge), then the blocks born there are placed,
largest first, each in the smallest free range that holds it (best fit), else at the top
of the arena (growing it; a free range at the top is extended). The arena is at least the
step's peak of live bytes (the sum of the sizes live at one point); what exceeds it is
fragmentation.

What it is for: a report of how much of the peak a static layout would waste
(``MemoryReport.arena_bytes``). The emitted step on the GPU allocates through torch's
caching allocator, not this arena: an allocation plan would have to beat it in a
measurement on the GPU first, and none has been made.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence

__all__ = ["arena"]


def arena(blocks: Sequence[tuple[int, int, int]]) -> tuple[list[int], int]:
    """``(offsets, arena size)`` of ``blocks`` (module docstring)."""
    born: dict[int, list[int]] = defaultdict(list)
    dies: dict[int, list[int]] = defaultdict(list)
    for k, (first, last, size) in enumerate(blocks):
        if size > 0:
            born[first].append(k)
            dies[last + 1].append(k)
    offsets = [0] * len(blocks)
    free: list[tuple[int, int]] = []  # (start, size) ranges, sorted by start
    top = 0
    for t in sorted(set(born) | set(dies)):
        for k in dies.get(t, ()):
            start, size = offsets[k], blocks[k][2]
            i = bisect.bisect_left(free, (start, 0))
            # merge with the range before and the one after when they touch
            if i > 0 and free[i - 1][0] + free[i - 1][1] == start:
                i -= 1
                start, size = free[i][0], free[i][1] + size
                del free[i]
            if i < len(free) and start + size == free[i][0]:
                size += free[i][1]
                del free[i]
            if start + size == top:  # the top of the arena: give it back
                top = start
            else:
                free.insert(i, (start, size))
        for k in sorted(born.get(t, ()), key=lambda k: (-blocks[k][2], k)):
            size = blocks[k][2]
            # best fit: the smallest range that holds it, the lowest of equal ones (an
            # exact fit ends the search)
            i, s = -1, 0
            for at, (_, room) in enumerate(free):
                if room >= size and (i < 0 or room < s):
                    i, s = at, room
                    if room == size:
                        break
            if i >= 0:
                start = free[i][0]
                if s == size:
                    del free[i]
                else:
                    free[i] = (start + size, s - size)
                offsets[k] = start
            else:
                offsets[k] = top
                top += size
    # the arena is the highest byte any block reached
    return offsets, max((offsets[k] + b[2] for k, b in enumerate(blocks) if b[2] > 0), default=0)

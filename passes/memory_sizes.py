"""A tensor's bytes on one rank under a choice of placements: as it is held, while it is
redistributed, and its optimizer state (the sizes passes/memory's step model sums).

Takes: a tensor's global shape and dtype, its placements (torch's ``Shard``, ``Replicate``,
``Partial``, one per mesh axis; None: whole, on every rank) and the mesh's shape.
Returns: bytes per rank. Nothing here reads the graph.

    size(s, P)   = prod(local_shape(shape(s), P(s), mesh)) * itemsize(s)
                   P(s): the placement of the output that made storage s (placeholders:
                   their own placement)                                  → ``local_bytes``
    reshard(p, q) = the most bytes one rank holds at once while a tensor is redistributed
                   from p to q, its source left out (it is a storage of its own): over
                   DTensor's steps, one mesh axis a at a time in mesh order, of the step
                   before's result (freed after it) and the step's own buffers: its result
                   r_a, and beside it, for a gather along a dim that is not the outermost
                   in memory, r_a more (the collective gathers along the outermost; its
                   result is then copied along the dim), for a reduce-scatter along one,
                   its input laid out along the outermost; and at least size(q). codegen
                   redistributes a permuted tensor in its memory order
                   (``StrategySpace.layouts``), others made contiguous  → ``reshard_bytes``
    state(e)     = 4 * OPTIMIZERS[optimizer] bytes per parameter element: AdamW two float32
                   moments, SGD with momentum one, none zero   → ``state_bytes_per_element``

``sizer`` and ``resharder`` are the first two memoised per placements object: a deep step's
layers share their placements, and a sweep sizes ~90,000 inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from autopar.core import local_shape

__all__ = [
    "InPlacement",
    "OPTIMIZERS",
    "OutPlacement",
    "Placements",
    "local_bytes",
    "reshard_bytes",
    "resharder",
    "sizer",
    "state_bytes_per_element",
]

OPTIMIZERS = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0, "none": 0}
"""Optimizer -> float32 state tensors per parameter element."""

Placements = tuple
OutPlacement = Callable[[str, int], "Placements | None"]
"""(node, output index) -> the placements of that output (None: whole, on every rank)."""
InPlacement = Callable[[str, int], "Placements | None"]
"""(node, tensor input j) -> the placements node runs input j with (None: as it comes)."""


def local_bytes(shape, dtype: torch.dtype, ps: Placements | None, mesh_shape) -> int:
    """Bytes one rank holds of a tensor of global ``shape`` placed ``ps`` (None: whole)."""
    shape = tuple(shape) if ps is None else local_shape(tuple(shape), ps, mesh_shape)
    return math.prod(shape) * dtype.itemsize


def reshard_bytes(
    shape,
    dtype: torch.dtype,
    p: Placements,
    q: Placements,
    mesh_shape,
    layout: Sequence[int] | None = None,
) -> int:
    """The most bytes one rank holds at once while a tensor of global ``shape`` is
    redistributed from ``p`` to ``q``, its source left out (module docstring,
    ``reshard(p, q)``): DTensor's steps, one mesh axis at a time in mesh order; during a
    step, the step before's result (freed after it) and the step's own buffers: its result,
    and beside it, for a gather along a dim that is not the outermost in memory (``layout``:
    the dims from the outermost, ``StrategySpace.layouts``; None: in their own order; codegen
    redistributes a permuted tensor in its memory order), the gathered buffer (the
    collective gathers along the outermost; the result is its copy laid out along the dim),
    and for a reduce-scatter along one, its input laid out along the outermost. At least
    the result, ``size(q)``."""

    def inner(dim: int) -> bool:
        return (dim if layout is None else list(layout).index(dim)) != 0

    cur = list(p)
    held = most = 0  # (the step before's result; the first step's input is the source)
    for a, (src, dst) in enumerate(zip(p, q)):
        if src == dst:
            continue
        before = local_bytes(shape, dtype, tuple(cur), mesh_shape)
        cur[a] = dst
        after = local_bytes(shape, dtype, tuple(cur), mesh_shape)
        work = after
        if src.is_shard() and dst.is_replicate() and inner(src.dim):
            work = 2 * after  # the gathered buffer and its copy along the dim
        elif src.is_partial() and dst.is_shard() and inner(dst.dim):
            work = before + after  # the input laid out along the outermost dim, the result
        most = max(most, held + work)
        held = after
    return max(most, local_bytes(shape, dtype, q, mesh_shape))


def resharder(
    mesh_shape,
) -> Callable[[tuple, torch.dtype, Placements, Placements, tuple | None], int]:
    """``reshard_bytes`` on ``mesh_shape``, each (shape, p, q, layout) once per pair of
    placements objects (kept beside, as ``sizer`` keeps its own)."""
    made: dict[tuple, tuple] = {}

    def nbytes(shape: tuple, dtype: torch.dtype, p: Placements, q: Placements, layout) -> int:
        k = (shape, dtype, id(p), id(q), layout)
        got = made.get(k)
        if got is None:
            got = made[k] = (p, q, reshard_bytes(shape, dtype, p, q, mesh_shape, layout))
        return got[2]

    return nbytes


def sizer(mesh_shape) -> Callable[[tuple, torch.dtype, Placements | None], int]:
    """``local_bytes`` on ``mesh_shape``, each shape sized once per placements object: a
    deep step's layers share theirs (a fold group's strategies, a plan's parsed texts).
    Each object is kept beside its size, so that its id names it as long as the sizer
    lives (one made afresh at each call and freed would hand its id to the next)."""
    sized: dict[tuple, tuple] = {}

    def nbytes(shape: tuple, dtype: torch.dtype, ps: Placements | None) -> int:
        k = (shape, dtype, id(ps))
        got = sized.get(k)
        if got is None:
            got = sized[k] = (ps, local_bytes(shape, dtype, ps, mesh_shape))
        return got[1]

    return nbytes


def state_bytes_per_element(optimizer: str) -> int:
    """Optimizer state bytes per parameter element: ``OPTIMIZERS``' tensors, float32."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r}: one of {sorted(OPTIMIZERS)}")
    return 4 * OPTIMIZERS[optimizer]

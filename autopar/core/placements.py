"""Placements as plans write them, and the local shape of a sharded tensor.

autopar plans with torch's own placements (``Shard(dim)``, ``Replicate()``,
``Partial(op)``, and ``_StridedShard``, which DTensor produces when a view flattens a dim
sharded inside another). This module is their codec for the plan's JSON and the arithmetic
every layer needs on them:

    text        ``S(0)``, ``R``, ``P(sum)``, ``SS(0,4)``  (``placement_str`` / ``parse_placement``)
    local shape dim d of a tensor placed by ``ps`` on a mesh of sizes ``m`` holds
                ceil(shape[d] / prod{m[a] : ps[a] shards d}) elements on one rank, as
                ``torch.chunk`` splits it (``local_shape``)
    divisible   a placement is planned only where every sharded dim divides evenly by the
                product of the mesh sizes sharding it (``divides``)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

__all__ = [
    "Placements",
    "contiguous_stride",
    "divides",
    "hierarchical_axes",
    "is_planned",
    "is_strided",
    "local_offset",
    "local_shape",
    "parse_placement",
    "parse_placements",
    "placement_str",
    "reduction",
]

Placements = tuple[Placement, ...]
"""One placement per mesh axis."""


def placement_str(p: Placement) -> str:
    """``S(0)``, ``R``, ``P(sum)``, ``SS(0,4)``: the short, stable text of a placement."""
    if type(p) is _StridedShard:
        return f"SS({p.dim},{p.split_factor})"
    if type(p) is Shard:
        return f"S({p.dim})"
    if type(p) is Replicate:
        return "R"
    if type(p) is Partial:
        return f"P({p.reduce_op})"
    raise ValueError(f"placement {p!r} is not one autopar plans with")


def parse_placement(s: str) -> Placement:
    """The placement whose text (``placement_str``) is ``s``."""
    if s == "R":
        return Replicate()
    if s.startswith("SS("):
        d, f = s[3:-1].split(",")
        return _StridedShard(int(d), split_factor=int(f))
    if s.startswith("S("):
        return Shard(int(s[2:-1]))
    if s.startswith("P("):
        return Partial(s[2:-1])
    raise ValueError(f"cannot parse placement {s!r}")


def parse_placements(texts) -> Placements:
    """One placement per mesh axis from their texts (each tuple of texts parsed once: a
    plan's ~18,000 nodes name a few dozen; the placements are shared, read only)."""
    return _parsed(tuple(texts))


@functools.lru_cache(maxsize=4096)
def _parsed(texts: tuple[str, ...]) -> Placements:
    return tuple(parse_placement(t) for t in texts)


def is_planned(p: Placement) -> bool:
    """A placement autopar plans with: Shard, _StridedShard, Replicate, Partial(sum|avg)."""
    if type(p) in (Shard, Replicate, _StridedShard):
        return True
    return type(p) is Partial and p.reduce_op in ("sum", "avg")


def is_strided(ps: Placements | None) -> bool:
    """Some axis of ``ps`` holds a ``_StridedShard``."""
    return ps is not None and any(type(p) is _StridedShard for p in ps)


def divides(placements: Placements, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> bool:
    """Every dim ``placements`` shard exists and splits evenly over the axes sharding it."""
    factor = [1] * len(shape)
    for size, p in zip(mesh_shape, placements):
        if isinstance(p, (Shard, _StridedShard)):
            if p.dim >= len(shape) or p.dim < -len(shape):
                return False
            factor[p.dim] *= size
    return all(f == 1 or (s % f == 0 and s >= f) for s, f in zip(shape, factor))


def local_shape(shape: tuple[int, ...], placements: Placements, mesh_shape) -> tuple[int, ...]:
    """The shape one rank holds of a tensor of global ``shape`` placed by ``placements``."""
    out = list(shape)
    for size, p in zip(mesh_shape, placements):
        if isinstance(p, (Shard, _StridedShard)):
            out[p.dim] = math.ceil(out[p.dim] / size)
    return tuple(out)


def local_offset(
    shape: tuple[int, ...], placements: Placements, mesh_shape, coordinate
) -> tuple[int, ...]:
    """Where the block of the rank at mesh ``coordinate`` starts in each dim of a tensor of
    global ``shape`` (evenly divided: ``divides``). Axes split a dim in mesh order, each the
    chunk the axes before it left, as DTensor's ``Shard`` does."""
    start, size = [0] * len(shape), list(shape)
    for n, p, c in zip(mesh_shape, placements, coordinate):
        if isinstance(p, Shard) and not isinstance(p, _StridedShard):
            size[p.dim] //= n
            start[p.dim] += c * size[p.dim]
        elif isinstance(p, _StridedShard):
            raise ValueError(f"no contiguous block for {placement_str(p)}")
    return tuple(start)


def reduction(src: Placements, dst: Placements) -> tuple[int, int | None] | None:
    """``(axis, scatter dim)`` where ``src -> dst`` is one reduction on one mesh axis, the
    other axes unchanged: ``Partial -> Replicate`` there is one all-reduce (``(axis,
    None)``), ``Partial -> Shard(d)`` one reduce-scatter along ``d`` (``(axis, d)``; not a
    ``_StridedShard``, which is no plain scatter). Else None: ``reductions`` on one axis,
    the one-collective reduction the solver counts as hiding in a bucket."""
    found = reductions(src, dst)
    if found is None or len(found) != 1:
        return None
    ((axis, dim),) = found.items()
    return axis, dim


def reductions(src: Placements, dst: Placements) -> dict[int, int | None] | None:
    """Mesh axis -> scatter dim (None: all-reduce) where every axis ``src -> dst`` changes
    goes from a ``Partial`` to ``Replicate`` or to a plain ``Shard(d)``, all of one reduce
    op: a gradient's reduction over one axis or several (``reduction`` is the one-axis
    case), which passes/buckets may bucket. Else None."""
    changed = [i for i, (a, b) in enumerate(zip(src, dst)) if a != b]
    if not changed:
        return None
    out: dict[int, int | None] = {}
    ops = set()
    for i in changed:
        p, q = src[i], dst[i]
        if not isinstance(p, Partial):
            return None
        ops.add(p.reduce_op)
        if isinstance(q, Replicate):
            out[i] = None
        elif type(q) is Shard:
            out[i] = q.dim
        else:
            return None
    return out if len(ops) == 1 else None


def contiguous_stride(shape) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def hierarchical_axes(
    src: Sequence[Placement], dst: Sequence[Placement]
) -> tuple[int, tuple[int, ...]] | None:
    """``(inner axis, outer axes)`` of a hierarchical reduction (cost_models/comm) where
    ``src -> dst`` sums a Partial over two mesh axes or more into Replicate and leaves every
    other axis as it is; else None."""
    summed = [
        i
        for i, (p, q) in enumerate(zip(src, dst))
        if isinstance(p, Partial) and p.reduce_op == "sum" and isinstance(q, Replicate)
    ]
    rest = [i for i in range(len(src)) if i not in summed]
    if len(summed) < 2 or any(src[i] != dst[i] for i in rest):
        return None
    return summed[-1], tuple(summed[:-1])

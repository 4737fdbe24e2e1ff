"""Alpha-beta times of collectives on mesh axes, and of DTensor redistributions.

Takes placements (torch's ``Shard``, ``Replicate``, ``Partial``, one per mesh axis), a global
tensor shape and dtype, and a ``Mesh``; returns the collectives DTensor runs to redistribute
(``redistribute_collectives``) and their time in seconds (``redistribute_time``). Nothing to
do (same placements, or only local steps such as Replicate -> Shard) gives ``[]`` and 0.0.

Alpha-beta model of a collective over ``n`` ranks (``collective_time``), with ``o`` the
fixed cost of one call (``DeviceProfile.collective_overhead``), ``a`` the latency of one
step and ``bw`` the per-rank link bandwidth (bytes/s). Ring algorithms::

    all_gather:      o +   (n-1) * a  +   (n-1)/n * S / bw   S = bytes of the gathered tensor
    reduce_scatter:  o +   (n-1) * a  +   (n-1)/n * S / bw   S = bytes of the input tensor
    all_reduce:      o + 2*(n-1) * a  + 2*(n-1)/n * S / bw   S = bytes of the tensor
    all_to_all:      o +   (n-1) * a  +   (n-1)/n * S / bw   S = bytes of one rank's buffer
    n == 1: 0

An all-reduce may also run as a tree (NCCL's double binary tree: a reduce up and a
broadcast down, ``ceil(log2 n)`` steps each, every rank sending and receiving the whole
tensor once each way)::

    all_reduce (tree):  o + 2*ceil(log2 n) * a  +  2 * S / bw

and the library picks the fastest of the algorithms the profile names
(``DeviceProfile.all_reduce_algorithms``): the tree for small tensors over many ranks,
where the ring's 2(n-1) latencies dominate, the ring for large ones.

"Full" means unsharded along the axis the collective runs on; the tensor may still be sharded
on other axes, which makes S smaller.

Which link an axis uses (``axis_link``): axes are row-major over ranks, the last innermost, so
the ranks of one group along axis ``i`` are spread over ``prod(shape[i:])`` consecutive ranks.
If ``prod(shape[i:]) <= ranks_per_node`` the group stays inside one node and uses
``(intra_node_latency, intra_node_bandwidth)``, otherwise
``(inter_node_latency, inter_node_bandwidth)``.

Which collectives a redistribution runs (``redistribute_collectives``) is a pure
reimplementation of DTensor's greedy planner (``torch.distributed.tensor._redistribute``,
``DTensorRedistributePlanner.generate_greedy_transform_infos``, torch 2.13), which DTensor
uses for the default shard order. It yields one transform per mesh axis that changes:

    1. if the source is sharded (over more than one rank): axes from innermost to outermost; an axis whose target is
       Shard(d) while the outer axes shard dim d differently in source and target (nested
       sharding that does not line up) goes to Replicate first;
    2. axes from outermost to innermost: each remaining axis goes straight to its target.

and ``redistribute_local_tensor`` turns each transform (current -> target on axis ``i``)
into at most one collective on axis ``i``:

    Shard -> Replicate      all_gather         Partial -> Replicate   all_reduce
    Partial -> Shard        reduce_scatter     Shard(a) -> Shard(b)   all_to_all
    Replicate -> Shard      local chunk        Replicate -> Partial   local (no collective)
    axis of size 1          nothing            Shard -> Partial       unsupported (ValueError)

Byte sizes use the tensor as it is at that step: the global shape divided by the shards on
the other axes (ceil division, as torch.chunk pads the first chunks).

Hierarchical reductions (``reshard_collectives``). A Partial(sum) over several mesh axes
reduced into Replicate runs, in DTensor, as one full all-reduce per axis; across nodes the
outer one moves the whole tensor over the slow links. The emitted step may run it instead as

    reduce_scatter over the inner axis (the tensor flat, padded to a multiple of its n_i)
    all_reduce over each outer axis, of the 1/n_i shard
    all_gather over the inner axis

(``hierarchical_collectives``; the inner axis is the innermost one summed, on the fastest
link): 2 (n_i - 1)/n_i S over the inner link and 2 (n_o - 1)/n_o S/n_i over each outer one,
where DTensor's moves 2 (n_o - 1)/n_o S over the outer, for one more call's latency.
``reshard_collectives`` takes whichever of the two ``collectives_time`` prices lower, per
edge: the solver's candidate algorithms, and the plan lists the one chosen (passes/codegen
runs an edge whose listed collectives use one axis twice as the hierarchical reduction).

NOTE: reimplemented rather than called: DTensor's planner needs a ``DeviceMesh``, i.e. an
initialised process group, and a cost model must run inside the planner process without
one. ``tests/unit/test_cost_models.py`` checks the reimplementation against DTensor's own
planner on a fake process group. Two DTensor behaviours are not modelled: (a) with
``_StridedShard`` DTensor switches to its graph-based planner; here ``_StridedShard`` is
treated as ``Shard`` on its dim (same bytes, possibly a different order); (b) DTensor merges
consecutive same-kind collectives into one on a flattened mesh only if the user created that
flattened mesh (``DeviceMesh._flatten``); here they stay separate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from functools import lru_cache

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.core import COLLECTIVE_KINDS, Collective, Mesh, hierarchical_axes

from .devices import DeviceProfile, get_profile

__all__ = [
    "COLLECTIVE_KINDS",
    "Collective",
    "axis_link",
    "collective_time",
    "collectives_time",
    "redistribute_collectives",
    "redistribute_time",
    "spans_nodes",
]


def axis_link(mesh: Mesh, axis: int, profile: DeviceProfile | None = None) -> tuple[float, float]:
    """``(latency_s, bandwidth_Bps)`` of the link the groups along mesh ``axis`` use.

    Intra-node when the axis and all axes inner to it fit in one node
    (``prod(mesh.shape[axis:]) <= ranks_per_node``), inter-node otherwise; ranks_per_node
    is the mesh's own (``Mesh.ranks_per_node``) where it gives one, else the profile's.
    ``profile`` defaults to ``get_profile(mesh.device)``.
    """
    profile = profile if profile is not None else get_profile(mesh.device)
    if not spans_nodes(mesh, axis, profile):
        return profile.intra_node_latency, profile.intra_node_bandwidth
    return profile.inter_node_latency, profile.inter_node_bandwidth


def spans_nodes(mesh: Mesh, axis: int, profile: DeviceProfile | None = None) -> bool:
    """Whether the groups along mesh ``axis`` span nodes (``axis_link``'s inter-node case)."""
    profile = profile if profile is not None else get_profile(mesh.device)
    if not 0 <= axis < mesh.ndim:
        raise IndexError(f"mesh {mesh} has axes 0..{mesh.ndim - 1}, got axis {axis}")
    per_node = getattr(mesh, "ranks_per_node", None) or profile.ranks_per_node
    return math.prod(mesh.shape[axis:]) > per_node


def collective_time(
    kind: str,
    nbytes: float,
    n: int,
    latency: float,
    bandwidth: float,
    *,
    overhead: float = 0.0,
    algorithms: Sequence[str] = ("ring",),
) -> float:
    """Alpha-beta time in seconds of one collective over ``n`` ranks (module docstring).

    ``nbytes`` is the full (unsharded along the axis) tensor for all_gather / reduce_scatter /
    all_reduce, the local buffer for all_to_all. ``overhead`` is added once per call;
    ``algorithms`` are those an all-reduce may run as (``"ring"``, ``"tree"``), the fastest
    taken. A group of one costs 0.
    """
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; use one of {COLLECTIVE_KINDS}")
    if n < 1:
        raise ValueError(f"group size must be >= 1, got {n}")
    if n == 1:
        return 0.0
    steps = n - 1
    ring = steps * latency + steps / n * nbytes / bandwidth
    if kind != "all_reduce":
        return overhead + ring
    # NOTE: ring all_reduce = reduce_scatter + all_gather, hence twice each term.
    times = []
    if "ring" in algorithms:
        times.append(2.0 * ring)
    if "tree" in algorithms:
        times.append(2 * math.ceil(math.log2(n)) * latency + 2.0 * nbytes / bandwidth)
    if not times:
        raise ValueError(f"no all-reduce algorithm among {tuple(algorithms)}; use ring or tree")
    return overhead + min(times)


def collectives_time(
    collectives: Iterable[Collective], mesh: Mesh, profile: DeviceProfile | None = None
) -> float:
    """Sum of ``collective_time`` of ``collectives``, each on its axis's link (``axis_link``),
    times the profile's factor for its kind (``DeviceProfile.collective_factor``)."""
    profile = profile if profile is not None else get_profile(mesh.device)
    total = 0.0
    for c in collectives:
        if c.axis >= mesh.ndim or c.group_size != mesh.shape[c.axis]:
            raise ValueError(
                f"{c} does not fit mesh {mesh}: axis {c.axis} must exist and have group_size ranks"
            )
        latency, bandwidth = axis_link(mesh, c.axis, profile)
        total += profile.collective_factor(c.kind) * collective_time(
            c.kind,
            c.nbytes,
            c.group_size,
            latency,
            bandwidth,
            overhead=profile.collective_overhead,
            algorithms=profile.all_reduce_algorithms,
        )
    return total


def _normalize(p: Placement, ndim: int) -> Placement:
    """``_StridedShard`` -> ``Shard`` on its dim; negative Shard dims -> positive."""
    if isinstance(p, (Shard, _StridedShard)):
        dim = p.dim + ndim if p.dim < 0 else p.dim
        if not 0 <= dim < ndim:
            raise ValueError(f"{p} shards dim {p.dim} of a {ndim}-d tensor")
        return Shard(dim)
    if isinstance(p, (Replicate, Partial)):
        return p
    raise TypeError(f"unsupported placement {p!r}: use Shard, Replicate or Partial")


def _local_shape(
    global_shape: tuple[int, ...],
    placements: Sequence[Placement],
    mesh_shape: tuple[int, ...],
    skip_axis: int,
) -> list[int]:
    """Shape on one rank with every axis but ``skip_axis`` applied; nested shards of one dim
    apply outer axis first (DTensor's default shard order), ceil division as torch.chunk."""
    shape = list(global_shape)
    for axis, p in enumerate(placements):
        if axis != skip_axis and isinstance(p, Shard):
            shape[p.dim] = -(-shape[p.dim] // mesh_shape[axis])
    return shape


def _greedy_transforms(
    src: list[Placement], dst: list[Placement], mesh_shape: tuple[int, ...]
) -> list[tuple[int, Placement, Placement]]:
    """DTensor's ``generate_greedy_transform_infos``: ``(axis, current, target)`` steps."""
    if len(src) == 1:
        return [(0, src[0], dst[0])] if src[0] != dst[0] else []
    current = list(src)
    steps: list[tuple[int, Placement, Placement]] = []
    # NOTE: DTensor tests ``src_spec.num_shards > 1``, not "has a Shard": sharding only on
    # axes of size 1 skips this pass, which changes e.g. (S0, P) -> (R, S0) on a (1, 4) mesh
    # from all_reduce + chunk to one reduce_scatter.
    num_shards = math.prod(n for p, n in zip(src, mesh_shape) if isinstance(p, Shard))
    if num_shards > 1:
        for axis in reversed(range(len(current))):
            target = dst[axis]
            if isinstance(target, Shard):
                d = target.dim
                cur_outer = [i for i in range(axis) if current[i].is_shard(d)]
                dst_outer = [i for i in range(axis) if dst[i].is_shard(d)]
                if cur_outer != dst_outer:
                    target = Replicate()
            if current[axis] != target:
                steps.append((axis, current[axis], target))
                current[axis] = target
    for axis, target in enumerate(dst):
        if current[axis] != target:
            steps.append((axis, current[axis], target))
            current[axis] = target
    return steps


def _collective_kind(current: Placement, target: Placement) -> str | None:
    """What ``redistribute_local_tensor`` runs for one step; None for a local step."""
    if current.is_partial():
        if target.is_replicate():
            return "all_reduce"
        if target.is_shard():
            return "reduce_scatter"
    elif current.is_shard():
        if target.is_replicate():
            return "all_gather"
        if target.is_shard():
            return "all_to_all"  # same dim never gets here: the step would be a no-op
    elif current.is_replicate():
        return None  # Replicate -> Shard: local chunk; Replicate -> Partial: local scaling
    raise ValueError(
        f"DTensor cannot redistribute {current} -> {target} on one mesh axis; "
        "go through Replicate (or change the strategy that asked for this)"
    )


@lru_cache(maxsize=65536)
def _plan(
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    global_shape: tuple[int, ...],
    itemsize: int,
    mesh_shape: tuple[int, ...],
) -> tuple[Collective, ...]:
    ndim = len(global_shape)
    if not len(src) == len(dst) == len(mesh_shape):
        raise ValueError(
            f"need one placement per mesh axis: mesh shape {mesh_shape}, src {src}, dst {dst}"
        )
    src_n = [_normalize(p, ndim) for p in src]
    dst_n = [_normalize(p, ndim) for p in dst]
    for placements in (src_n, dst_n):
        ops = {p.reduce_op for p in placements if isinstance(p, Partial)}
        if len(ops) > 1:
            raise ValueError(f"DTensor forbids mixing Partial types in one placement: {placements}")
    current = list(src_n)
    out: list[Collective] = []
    for axis, cur, target in _greedy_transforms(src_n, dst_n, mesh_shape):
        n = mesh_shape[axis]
        # NOTE: DTensor skips an axis of size 1 before looking at the placements, so even
        # Shard -> Partial is fine there.
        kind = _collective_kind(cur, target) if n > 1 else None
        if kind is not None:
            shape = _local_shape(global_shape, current, mesh_shape, skip_axis=axis)
            if kind == "all_to_all":
                assert isinstance(cur, Shard)
                shape[cur.dim] = -(-shape[cur.dim] // n)
            out.append(Collective(kind, axis, math.prod(shape) * itemsize, n))
        current[axis] = target
    return tuple(out)


def redistribute_collectives(
    src_placements: Sequence[Placement],
    dst_placements: Sequence[Placement],
    global_shape: Sequence[int],
    dtype: torch.dtype,
    mesh_shape: Sequence[int],
) -> list[Collective]:
    """Collectives DTensor runs to take a tensor from ``src_placements`` to ``dst_placements``.

    One placement per mesh axis; ``global_shape`` is the unsharded tensor's shape. In DTensor's
    order (see the module docstring). Raises ``ValueError`` for a redistribution DTensor does
    not support (Shard -> Partial, Partial of one op -> Partial of another, mixed Partials).
    """
    return list(
        _plan(
            tuple(src_placements),
            tuple(dst_placements),
            tuple(int(s) for s in global_shape),
            dtype.itemsize,
            tuple(int(s) for s in mesh_shape),
        )
    )


def redistribute_time(
    src_placements: Sequence[Placement],
    dst_placements: Sequence[Placement],
    global_shape: Sequence[int],
    dtype: torch.dtype,
    mesh: Mesh,
    profile: DeviceProfile | None = None,
) -> float:
    """Seconds DTensor spends redistributing: ``collectives_time`` of
    ``redistribute_collectives``. ``profile`` defaults to ``get_profile(mesh.device)``."""
    collectives = redistribute_collectives(
        src_placements, dst_placements, global_shape, dtype, mesh.shape
    )
    return collectives_time(collectives, mesh, profile)


def hierarchical_collectives(
    src: Sequence[Placement],
    dst: Sequence[Placement],
    global_shape: Sequence[int],
    dtype: torch.dtype,
    mesh_shape: Sequence[int],
) -> list[Collective] | None:
    """The collectives of ``src -> dst`` as a hierarchical reduction (module docstring), or
    None where it is not one: a reduce-scatter over the inner axis, an all-reduce of the
    shard over each outer axis, an all-gather over the inner axis. The tensor is reduced
    flat, padded to a multiple of the inner axis's size."""
    axes = hierarchical_axes(src, dst)
    if axes is None:
        return None
    inner, outer = axes
    n = int(mesh_shape[inner])
    full = tuple(int(s) for s in global_shape)
    placed = [_normalize(p, len(full)) for p in src]
    shape = _local_shape(full, placed, tuple(mesh_shape), skip_axis=-1)
    shard = -(-math.prod(shape) // n) * dtype.itemsize
    return [
        Collective("reduce_scatter", inner, shard * n, n),
        *(Collective("all_reduce", a, shard, int(mesh_shape[a])) for a in outer),
        Collective("all_gather", inner, shard * n, n),
    ]


def reshard_collectives(
    src_placements: Sequence[Placement],
    dst_placements: Sequence[Placement],
    global_shape: Sequence[int],
    dtype: torch.dtype,
    mesh: Mesh,
    profile: DeviceProfile | None = None,
) -> list[Collective]:
    """The collectives the emitted step runs for ``src -> dst``: DTensor's
    (``redistribute_collectives``), or the hierarchical reduction where there is one and it
    is faster (``hierarchical_collectives``; passes/codegen runs it where the plan lists
    it). Raises ``ValueError`` where DTensor cannot redistribute."""
    greedy = redistribute_collectives(
        src_placements, dst_placements, global_shape, dtype, mesh.shape
    )
    tiered = hierarchical_collectives(
        src_placements, dst_placements, global_shape, dtype, mesh.shape
    )
    if tiered is not None and collectives_time(tiered, mesh, profile) < collectives_time(
        greedy, mesh, profile
    ):
        return tiered
    return greedy


def reshard_time(
    src_placements: Sequence[Placement],
    dst_placements: Sequence[Placement],
    global_shape: Sequence[int],
    dtype: torch.dtype,
    mesh: Mesh,
    profile: DeviceProfile | None = None,
) -> float:
    """Seconds of ``reshard_collectives``: what the solver prices an edge at."""
    return collectives_time(
        reshard_collectives(src_placements, dst_placements, global_shape, dtype, mesh, profile),
        mesh,
        profile,
    )

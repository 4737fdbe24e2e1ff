"""Prices: the one module that reads the cost models (cost_models/).

Takes: a ``StrategySpace`` (or a mesh) and a device profile. Returns: seconds. The passes
that need a price ask here: the solver (C[v,k], R(p, q), the ring attention's overlap, the
host's time per node), passes/buckets (a bucket's collective) and passes/prefetch (whether
the device overlaps collectives at all).

    C[v,k]   roofline time of v's op on strategy k's local shapes, plus the collectives
             the op runs inside itself                           (``node_costs``)
    ring     sum_i max(c / n, m_i) + m_tail where collectives overlap, else
             c + sum_i m_i + m_tail                              (``ring_time``)
    R(p, q)  the alpha-beta time of DTensor's redistribution p -> q (or a hierarchical
             reduction where faster); None where DTensor cannot (``edge_cost``)
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._pytree import tree_map

from autopar.core import Collective, Mesh, Strategy, StrategySpace, TensorInput, local_shape, roles
from autopar.cost_models import (
    DeviceProfile,
    collectives_time,
    compute_time,
    get_profile,
    host_time,
    redistribute_collectives,
    reshard_collectives,
    reshard_time,
)

from . import rules, vocab

__all__ = [
    "DeviceProfile",
    "collective_s",
    "collectives_time",
    "edge_cost",
    "get_profile",
    "host_times",
    "inner_collectives",
    "node_costs",
    "overlaps_collectives",
    "redistribute_collectives",
    "reshard_collectives",
    "ring_time",
]


def node_costs(space: StrategySpace, name: str, profile: DeviceProfile) -> list[float]:
    """C[v,k] for every strategy k of node ``name`` (seconds)."""
    target = space.targets[name]
    strats = space.strategies[name]
    if target == "placeholder" and space.roles[name] in roles.BATCH_ROLES:
        # the batch is read into device memory: each rank reads its local part
        shape, dtype = space.tensor(name)
        sizes = [
            math.prod(local_shape(shape, s.output(), space.mesh.shape)) * dtype.itemsize
            for s in strats
        ]
        return [n / profile.bandwidth(n) for n in sizes]
    if target == "placeholder" or not isinstance(target, torch._ops.OpOverload):
        return [0.0] * len(strats)
    args, kwargs = space.calls[name]
    in_shapes = [space.tensor(src, src_out) for src, src_out in space.in_sources[name]]
    outs = space.shapes[name]
    dtype = next((sd[1] for sd in outs if sd is not None), torch.float32)
    mesh_shape = space.mesh.shape
    cache: dict = {}
    local_cost: dict[tuple, float] = {}
    costs = []
    for s in strats:
        key = (s.ins, s.out)
        if key in cache:
            costs.append(cache[key])
            continue

        # a ring's kernels read every key in turn: priced on the keys gathered
        ins = rules.keys_gathered(target, s.ins)
        lins = tuple(
            torch.Size(local_shape(sd[0], ps, mesh_shape)) for sd, ps in zip(in_shapes, ins)
        )
        lout = tuple(
            None if sd is None or ps is None else torch.Size(local_shape(sd[0], ps, mesh_shape))
            for sd, ps in zip(outs, s.out)
        )
        # the kernel's time is its local shapes': strategies that give the same (a shard
        # over either axis of a square mesh) are priced once
        c = local_cost.get((lins, lout))
        if c is None:
            c = local_cost[(lins, lout)] = _local_time(
                profile, target, args, kwargs, lins, lout, dtype
            )
        ring = _ring_steps(space, name, s)
        if ring is not None:
            c = ring_time(c, ring[0], ring[1], space.mesh, profile)
        inner = _balance_exchanges(space, name, s) + _class_reductions(space, name, s)
        if inner:
            c += collectives_time(inner, space.mesh, profile)
        cache[key] = c
        costs.append(c)
    return costs


def _local_time(profile: DeviceProfile, target, args, kwargs, lins, lout, dtype) -> float:
    """The compute time of ``target`` called on one rank: its tensor inputs
    (``TensorInput`` in ``args``/``kwargs``) of shapes ``lins``, its outputs ``lout``."""

    def local(a):
        return lins[a.index] if isinstance(a, TensorInput) else a

    largs, lkwargs = tree_map(local, args), tree_map(local, kwargs)
    out = lout[0] if len(lout) == 1 else lout
    try:
        return compute_time(profile, target, largs, lkwargs, out, dtype)
    except Exception:  # noqa: BLE001 - a formula that cannot price it: price by bytes
        return compute_time(profile, torch.ops.aten.add.Tensor, (), {}, out if out else (), dtype)


def host_times(space: StrategySpace, profile: DeviceProfile) -> dict[str, float]:
    """The host's seconds to issue each node, where the profile runs the host on its own
    clock (``DeviceProfile.host_clock``; cost_models.compute.host_time): the nodes that
    cost any, whatever their strategy (a node runs the same op on any shapes)."""
    if not profile.host_clock:
        return {}
    out = {}
    by_op: dict[object, float] = {}
    for name, target in space.targets.items():
        if isinstance(target, torch._ops.OpOverload):
            t = by_op.get(target)
            if t is None:
                t = by_op[target] = host_time(profile, target)
            if t > 0:
                out[name] = t
    return out


def collective_s(mesh, kind: str, axis: int, nbytes: int) -> float:
    """One collective of ``kind`` moving ``nbytes`` over mesh ``axis``, priced as the
    solver prices every collective (cost_models/comm on the mesh's profile): for the
    passes that regroup collectives after the search (passes/buckets)."""
    return collectives_time(
        [Collective(kind, axis, int(nbytes), mesh.shape[axis])], mesh, get_profile(mesh.device)
    )


def overlaps_collectives(mesh) -> bool:
    """Whether the step on ``mesh``'s profile runs collectives beside its kernels
    (``DeviceProfile.overlaps_collectives``: CUDA streams, not gloo)."""
    return bool(get_profile(mesh.device).overlaps_collectives)


def inner_collectives(space: StrategySpace, name: str, s: Strategy) -> list[Collective]:
    """The collectives node ``name`` runs inside its op under strategy ``s``: a causal
    attention whose query rows are split, load-balanced over their axis, and a ring
    attention's shifts (passes/rules), and a class-split loss's reductions (passes/vocab)."""
    out = _balance_exchanges(space, name, s) + _class_reductions(space, name, s)
    ring = _ring_steps(space, name, s)
    if ring is not None:
        steps, tail = ring
        out += [c for step in steps for c in step] + tail
    return out


def _class_reductions(space: StrategySpace, name: str, s: Strategy) -> list[Collective]:
    """The all-reduces of a cross-entropy op that splits its classes, or a ``mean`` loss's
    rows (its count of targets) (passes/vocab)."""
    target = space.targets[name]
    if target not in vocab.CLASS_OPS:
        return []
    args, _ = space.calls[name]
    in_shapes = [space.tensor(src, i)[0] for src, i in space.in_sources[name]]
    out = vocab.count_reductions(target, args, s.ins, in_shapes, space.mesh.shape)
    split = vocab.split_axis(target, args, s.ins, in_shapes)
    if split is None:
        return out
    axis, cdim, pos = split
    shape, dtype = space.tensor(*space.in_sources[name][pos])
    local = local_shape(shape, s.ins[pos], space.mesh.shape)
    return out + vocab.reductions(target, local, cdim, dtype, axis, space.mesh.shape[axis])


def _balance_exchanges(space: StrategySpace, name: str, s: Strategy) -> list[Collective]:
    target = space.targets[name]
    at = rules.ATTENTION_Q.get(target)
    if at is None:
        return []
    axes = rules.sequence_axes(s.ins[at])
    if not axes:
        return []
    args, _ = space.calls[name]
    q_shape, dtype = space.tensor(*space.in_sources[name][at])
    v_shape, _ = space.tensor(*space.in_sources[name][at + 2])
    ranks = space.mesh.shape[axes[0]]
    local_q = local_shape(q_shape, s.ins[at], space.mesh.shape)
    return rules.balance_exchanges(
        target, rules.is_causal(target, args), local_q, v_shape[-1], dtype, axes[0], ranks
    )


def _ring_steps(
    space: StrategySpace, name: str, s: Strategy
) -> tuple[list[list[Collective]], list[Collective]] | None:
    """``rules.ring_steps`` of a ring attention strategy, else None."""
    target = space.targets[name]
    if rules.context_variant(target, s.ins) != "ring":
        return None
    at = rules.ATTENTION_Q[target]
    (axis,) = rules.sequence_axes(s.ins[at])
    if space.mesh.shape[axis] == 1:  # a ring of one: every key at home, nothing shifts
        return None
    k_shape, dtype = space.tensor(*space.in_sources[name][at + 1])
    v_shape, _ = space.tensor(*space.in_sources[name][at + 2])
    local_k = local_shape(k_shape, s.ins[at + 1], space.mesh.shape)
    return rules.ring_steps(target, local_k, v_shape[-1], dtype, axis, space.mesh.shape[axis])


def ring_time(
    compute_s: float,
    steps: list[list[Collective]],
    tail: list[Collective],
    mesh: Mesh,
    profile: DeviceProfile,
) -> float:
    """A ring attention's time (passes/rules, ``ring``): each of its n steps the longer of
    its kernels (``compute_s`` / n, the blocks alike) and the shifts in flight, then the
    shifts after the last step; kernels plus every shift where the profile does not overlap
    collectives (gloo waits for each at once)."""
    block = compute_s / len(steps)
    times = [collectives_time(step, mesh, profile) for step in steps]
    if not profile.overlaps_collectives:  # each shift waited for at once (gloo)
        return compute_s + sum(times) + collectives_time(tail, mesh, profile)
    return sum(max(block, t) for t in times) + collectives_time(tail, mesh, profile)


def edge_cost(src_ps, dst_ps, shape_dtype, mesh, profile) -> float | None:
    """R(p, q) in seconds; None where DTensor cannot redistribute p -> q."""
    if src_ps == dst_ps:
        return 0.0
    if any(type(p) is _StridedShard for p in src_ps + dst_ps):
        # NOTE: DTensor redistributes a _StridedShard with data-dependent indexing that
        # make_fx cannot trace; strided placements only flow between ops that take them.
        return None
    try:
        return reshard_time(src_ps, dst_ps, shape_dtype[0], shape_dtype[1], mesh, profile)
    except ValueError:
        return None

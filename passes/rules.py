"""autopar's own sharding rules, for ops DTensor has none for.

Takes nothing, returns nothing: importing this module registers each rule with DTensor's
public ``register_sharding`` (``torch.distributed.tensor.experimental``), so that the planner
(passes/strategies asks DTensor's propagator) and codegen (which runs ops through DTensor)
read the same rule. A rule lists, for one mesh axis, the acceptable (output placements,
input placements) pairs; DTensor expands them over the mesh.

``autopar::sdpa`` (core/ops.py) and its backward, shapes q [B, H, S, D], k/v [B, K, T, *],
out [B, H, S, E], lse [B, H, S], mask broadcastable to [B, H, S, T]:

    replicated   everything Replicate
    batch        q, k, v, out, lse, grads: Shard(0); the mask Shard(0) where it has the batch
                 (its dim 0 is B > 1), else Replicate
    heads        q, k, v, out, lse, grads: Shard(1) (query heads and key/value heads split
                 alike, so each rank keeps whole groups of a grouped-query layer: query head
                 h reads key/value head h // (H / K) on the same rank); the mask Shard(1)
                 where it has the heads, else Replicate

A split that does not divide (K heads over more ranks than K) is dropped by the planner's
divisibility check (``core.placements.divides``).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from autopar.core import ops  # noqa: F401 - defines torch.ops.autopar

__all__ = ["sdpa_rule", "sdpa_backward_rule"]

_SDPA = torch.ops.autopar.sdpa.default
_SDPA_BACKWARD = torch.ops.autopar.sdpa_backward.default


def _mask_placement(mask, dim: int, full: int):
    """The mask's placement when the others shard ``dim`` (None: no mask)."""
    if mask is None:
        return None
    shape = mask.tensor_meta.shape if hasattr(mask, "tensor_meta") else mask.shape
    lead = len(shape) - 4  # a mask may have fewer dims than 4 (broadcast)
    d = dim + lead
    if d >= 0 and shape[d] == full and full > 1:
        return Shard(d)
    return Replicate()


def _shape(spec) -> tuple[int, ...]:
    return tuple(spec.tensor_meta.shape)


@register_sharding(_SDPA)
def sdpa_rule(q, k, v, mask, is_causal, scale):
    """Acceptable placements of ``autopar::sdpa`` on one mesh axis (module docstring)."""
    b, h = _shape(q)[:2]
    out: list[tuple[list, list]] = [
        ([Replicate(), Replicate()], [Replicate()] * 3 + [_rep(mask), None, None])
    ]
    for dim, full in ((0, b), (1, h)):
        out.append(
            (
                [Shard(dim), Shard(dim)],
                [Shard(dim)] * 3 + [_mask_placement(mask, dim, full), None, None],
            )
        )
    return out


@register_sharding(_SDPA_BACKWARD)
def sdpa_backward_rule(grad_out, q, k, v, out, lse, mask, is_causal, scale):
    """Acceptable placements of ``autopar::sdpa_backward`` on one mesh axis."""
    b, h = _shape(q)[:2]
    rules: list[tuple[list, list]] = [
        ([Replicate()] * 3, [Replicate()] * 6 + [_rep(mask), None, None])
    ]
    for dim, full in ((0, b), (1, h)):
        rules.append(
            (
                [Shard(dim)] * 3,
                [Shard(dim)] * 6 + [_mask_placement(mask, dim, full), None, None],
            )
        )
    return rules


def _rep(mask):
    return None if mask is None else Replicate()

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

Mixture-of-experts grouped matmuls (``transformers::grouped_mm_fallback`` and its backward,
the expert layers of Hugging Face MoE models off CUDA), input [S, I] sorted by expert, weight
[E, I, O], offs [E] the end row of each expert's group (``grouped_mm_rule``, registered once
the op exists: ``register_library_rules``):

    replicated   everything Replicate
    column       weight Shard(2), input and offs Replicate -> out Shard(1)
                 (backward: grad_out Shard(1) -> grad_input Partial(sum), grad_weight Shard(2))
    row          input Shard(1), weight Shard(1) -> out Partial(sum)
                 (backward: grad_out Replicate -> grad_input Shard(1), grad_weight Shard(1))

Each expert's matmul is split by hidden, as Megatron splits a dense MLP; the rows (tokens)
stay whole, since ``offs`` numbers them globally. Sharding by expert (expert parallelism)
needs the tokens moved to their expert's rank (all-to-all dispatch), which no rule can
express: not offered yet.

Ops with no rule that torch can decompose (``decompositions_without_rules``): passes/trace
hands aot_autograd their decompositions, so the step graph holds the ops they decompose into,
which have rules (``mse_loss`` becomes a subtraction, a square and a mean, its backward
likewise, with the global element count a constant: exact when sharded). Left out: ops with
no tensor argument (factories) and random ops (their decompositions draw differently).
"""

from __future__ import annotations

import functools

import torch
from torch._decomp import decomposition_table
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from autopar.core import ops  # noqa: F401 - defines torch.ops.autopar

__all__ = [
    "decompositions_without_rules",
    "grouped_mm_backward_rule",
    "grouped_mm_rule",
    "has_rule",
    "register_library_rules",
    "sdpa_backward_rule",
    "sdpa_rule",
]

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


def grouped_mm_rule(input, weight, offs):
    """Acceptable placements of a grouped matmul on one mesh axis (module docstring)."""
    r = Replicate()
    return [
        ([r], [r, r, r]),
        ([Shard(1)], [r, Shard(2), r]),
        ([Partial()], [Shard(1), Shard(1), r]),
    ]


def grouped_mm_backward_rule(input, weight, offs, grad_output):
    """Acceptable placements of a grouped matmul's backward on one mesh axis."""
    r = Replicate()
    return [
        ([r, r], [r, r, r, r]),
        ([Partial(), Shard(2)], [r, Shard(2), r, Shard(1)]),
        ([Shard(1), Shard(1)], [Shard(1), Shard(1), r, r]),
    ]


_LIBRARY_RULES = {
    ("transformers", "grouped_mm_fallback"): grouped_mm_rule,
    ("transformers", "grouped_mm_fallback_backward"): grouped_mm_backward_rule,
}


def register_library_rules() -> None:
    """Register the rules of ``_LIBRARY_RULES`` for the ops a library has defined by now
    (they exist only once the library is imported); each once."""
    for (namespace, name), rule in _LIBRARY_RULES.items():
        try:
            op = getattr(getattr(torch.ops, namespace), name).default
        except AttributeError:
            continue
        if not has_rule(op):
            register_sharding(op)(rule)


def has_rule(op) -> bool:
    """DTensor (with autopar's rules registered) has a sharding rule for ``op``."""
    prop = DTensor._op_dispatcher.sharding_propagator
    return (
        op in prop.op_strategy_funcs
        or op in prop.op_single_dim_strategy_funcs
        or op in getattr(prop, "op_to_rules", {})
    )


@functools.cache
def decompositions_without_rules() -> dict:
    """``{op: decomposition}`` for the ops without a rule that torch decomposes (module
    docstring); what passes/trace hands aot_autograd."""
    out = {}
    for op, fn in decomposition_table.items():
        if not isinstance(op, torch._ops.OpOverload) or has_rule(op):
            continue
        schema = op._schema
        if not any(isinstance(a.type, torch.TensorType) for a in schema.arguments):
            continue
        if torch.Tag.nondeterministic_seeded in op.tags or schema.is_mutable:
            continue
        out[op] = fn
    return out

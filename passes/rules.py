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

    sequence     q, out, lse, grad_out: Shard(2) (each rank a run of query rows); k, v
                 Replicate (every key, all-gathered over the axis: context parallelism as
                 Llama 3 trains it); the mask Shard(2) where it has the query rows, else
                 Replicate; backward: dq Shard(2), dk and dv Partial(sum) (each rank's rows'
                 share of every key's gradient, reduce-scattered or all-reduced by the plan)

    ring         (self-attention: S = T) q, k, v, out, lse, grad_out and every gradient
                 Shard(2); the mask as in ``sequence``. Each rank holds a run of rows and
                 the keys and values of the same positions, passed around the axis (ring
                 attention, passes/codegen): in n steps, at step i rank c computes its rows
                 against the block of rank c - i (mod n) while the block it holds travels on
                 to rank c + 1 (on CUDA sent before the step's kernels and waited for
                 after them: overlapped; on gloo waited for at once). The backward passes the blocks around again, and with each an
                 accumulator of its keys' and values' gradients (in the lse's dtype: float32
                 for 16-bit inputs), to which each rank adds its rows' share and sends on, one
                 step behind the block; after n steps each accumulator is home, so dk and dv
                 are Shard(2) with no reduction after. ``ring_steps`` lists the shifts in
                 flight during each step: passes/solve prices a step as the longer of its
                 kernels and its shifts, the backward's last shift after (nothing overlaps it),
                 or as their sum where the profile does not overlap collectives (gloo).
                 Unlike ``sequence`` no rank ever holds every key: the choice for contexts
                 whose keys and values do not fit whole, or whose gather would not hide.

``context_variant`` tells ``sequence`` ("gather") from ``ring`` by the keys' placement.

A split that does not divide (K heads over more ranks than K) is dropped by the planner's
divisibility check (``core.placements.divides``).

The sequence split needs each rank to know which rows it holds: a causal row o + i sees keys
up to o + i, which the kernel cannot tell from the local tensors. passes/codegen runs a
sequence-sharded attention node as ``autopar::sdpa_rows`` / ``sdpa_rows_backward``
(core/ops.py) with the rank's row offset (``sequence_axes`` says where the rule split the rows),
and a ring node block by block with each block's key offset too (``core.ops.key_blocks``).
The rows are split over one mesh axis at most (``split_once`` drops the rest).

Causal rows are load-balanced (gathered or ring): with the rows split in n runs of S over the
axis, run c's last rows see more keys than run c - 1's. Rank c keeps the first half of its run and computes the
second half of its partner's, rank n - 1 - c (and the partner the other two halves), so each
rank computes rows whose key counts add up to S (T + 1) / 2, the average, whatever c (the
middle rank of an odd axis pairs with itself). The halves travel there and back in three
pairwise exchanges per node (``balance_exchanges``, ``all_to_all`` over the axis):
    forward   q's second half there; out's and lse's back
    backward  grad_out's, q's and out's second halves there (one buffer), lse's; dq's back
(dk and dv stay where they are computed: summed over the axis anyway, or, in the ring, added
to the accumulator of the block they belong to, wherever it is). On the ring, rank c then
computes, at every step, both its rows and its partner's against the block it holds. An odd run
length S is not split (not balanced: priced at the last rank's share, cost_models/compute).

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

from autopar.core import Collective, ops

__all__ = [
    "ATTENTION_Q",
    "balance_exchanges",
    "balanced",
    "context_variant",
    "decompositions_without_rules",
    "grouped_mm_backward_rule",
    "grouped_mm_rule",
    "is_causal",
    "has_rule",
    "keys_gathered",
    "register_library_rules",
    "ring_steps",
    "sdpa_backward_rule",
    "sdpa_rule",
    "sequence_axes",
    "split_once",
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
    b, h, s = _shape(q)[:3]
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
    rows = [Shard(2), Replicate(), Replicate(), _mask_placement(mask, 2, s), None, None]
    out.append(([Shard(2), Shard(2)], rows))
    if _shape(k)[2] == s:  # self-attention: the keys split as the rows are
        out.append(([Shard(2), Shard(2)], [Shard(2)] * 3 + rows[3:]))
    return out


@register_sharding(_SDPA_BACKWARD)
def sdpa_backward_rule(grad_out, q, k, v, out, lse, mask, is_causal, scale):
    """Acceptable placements of ``autopar::sdpa_backward`` on one mesh axis."""
    b, h, s = _shape(q)[:3]
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
    seq, r = Shard(2), Replicate()
    rows = [seq, seq, r, r, seq, seq, _mask_placement(mask, 2, s), None, None]
    rules.append(([seq, Partial(), Partial()], rows))
    if _shape(k)[2] == s:
        rules.append(([seq] * 3, [seq] * 6 + rows[6:]))
    return rules


ATTENTION_Q: dict[object, int] = {_SDPA: 0, _SDPA_BACKWARD: 1}
"""The attention ops, each with the position of q among its tensor inputs."""


def is_causal(target, args) -> bool:
    """The ``is_causal`` argument of an attention call (``sdpa`` or its backward)."""
    return bool(args[4] if target == _SDPA else args[7])


def split_once(target, ins) -> bool:
    """Not an attention strategy that splits the query rows over two mesh axes or more."""
    at = ATTENTION_Q.get(target)
    return at is None or len(sequence_axes(ins[at])) <= 1


def balanced(is_causal: bool, rows: int, ranks: int) -> bool:
    """Causal rows split over an axis of ``ranks`` in runs of ``rows``: load-balanced
    (module docstring)."""
    return is_causal and ranks > 1 and rows % 2 == 0


def balance_exchanges(
    target, is_causal: bool, q_shape, v_dim: int, dtype: torch.dtype, axis: int, ranks: int
) -> list[Collective]:
    """The pairwise exchanges a load-balanced rows-split attention node runs (module
    docstring), one per tensor it swaps, ``q_shape`` the local q. Each is priced as an
    ``all_to_all`` whose bandwidth term is the half's bytes over the link (``nbytes`` scaled
    by n / (n - 1)); its latency term counts n - 1 hops for the one it takes."""
    b, h, s, d = q_shape
    if not balanced(is_causal, s, ranks):
        return []
    half = b * h * (s // 2)
    lse = half * ops.lse_dtype(dtype).itemsize
    size = dtype.itemsize
    if target == _SDPA:  # q there; out and lse back
        swaps = [half * d * size, half * v_dim * size, lse]
    else:  # grad_out, q and out there (one buffer), lse there; dq back
        swaps = [half * (d + 2 * v_dim) * size, lse, half * d * size]
    scale = ranks / (ranks - 1)
    return [Collective("all_to_all", axis, int(n * scale), ranks) for n in swaps]


def context_variant(target, ins) -> str | None:
    """How an attention strategy (its inputs' placements ``ins``) splits the query rows:
    ``"gather"`` (every key on every rank), ``"ring"`` (the keys split as the rows, passed
    around), or None (not split)."""
    at = ATTENTION_Q.get(target)
    if at is None:
        return None
    axes = sequence_axes(ins[at])
    if not axes:
        return None
    return "ring" if ins[at + 1][axes[0]] == Shard(2) else "gather"


def keys_gathered(target, ins) -> tuple:
    """``ins`` with a ring strategy's keys and values whole along the rows' axis: the
    shapes its kernels compute on over the ring, all the keys in turn (passes/pricing ``node_costs``)."""
    if context_variant(target, ins) != "ring":
        return tuple(ins)
    at = ATTENTION_Q[target]
    (axis,) = sequence_axes(ins[at])
    out = list(ins)
    for j in (at + 1, at + 2):
        ps = list(out[j])
        ps[axis] = Replicate()
        out[j] = tuple(ps)
    return tuple(out)


def ring_steps(
    target, kv_shape, v_dim: int, dtype: torch.dtype, axis: int, ranks: int
) -> tuple[list[list[Collective]], list[Collective]]:
    """The shifts of a ring attention node (module docstring), ``kv_shape`` the local k:
    ``(steps, tail)``, the collectives in flight while each of the ``ranks`` key blocks is
    computed, and those after the last. Each shift sends one rank's buffer to the next rank,
    priced as an ``all_to_all`` whose bandwidth term is the buffer's bytes over the link
    (``nbytes`` scaled by n / (n - 1)), as ``balance_exchanges``."""
    b, kh, s, d = kv_shape
    scale = ranks / (ranks - 1)
    kv = Collective(
        "all_to_all", axis, int(b * kh * s * (d + v_dim) * dtype.itemsize * scale), ranks
    )
    if target == _SDPA:
        return [[kv] if i < ranks - 1 else [] for i in range(ranks)], []
    acc = ops.lse_dtype(dtype).itemsize
    grads = Collective("all_to_all", axis, int(b * kh * s * (d + v_dim) * acc * scale), ranks)
    steps = [([kv] if i < ranks - 1 else []) + ([grads] if i > 0 else []) for i in range(ranks)]
    return steps, [grads]


def sequence_axes(q_placements) -> tuple[int, ...]:
    """The mesh axes on which an attention node's query rows are split (the ``sequence``
    entry of ``sdpa_rule``): where q is ``Shard(2)``."""
    return tuple(i for i, p in enumerate(q_placements) if p == Shard(2))


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

"""autopar's own operators: one attention node, the same on every device.

A step graph is traced once and planned for a device it may not run on (a laptop plans for
H100s). PyTorch's ``scaled_dot_product_attention`` turns into a different ATen op on each
device (``_scaled_dot_product_flash_attention_for_cpu`` on the CPU; flash, memory-efficient
or cuDNN attention on CUDA), so passes/trace puts this op in its place, and every layer
reads one node: passes/strategies shards it (batch, heads), cost_models prices it as a
fused attention kernel, and at run time it calls the kernel of the device it runs on.

    sdpa(q_BHSD, k_BKTD, v_BKTE, mask, is_causal, scale) -> (out_BHSE, lse_BHS)
    sdpa_backward(grad_out, q, k, v, out, lse, mask, is_causal, scale) -> (dq, dk, dv)

Shapes: B batch, H query heads, K key/value heads (H = g * K: grouped-query attention, query
head h reads key/value head h // g), S query length, T key length, D head dim, E value head
dim. ``mask`` is None or an additive float mask broadcastable to [B, H, S, T] (passes/trace
turns a boolean mask into 0 / -inf). ``scale`` is explicit (1/sqrt(D) when the model gave
none). ``lse`` is the log-sum-exp of each query row's scores, in float32 for 16-bit inputs
(as the fused kernels keep it), what the backward reads instead of the [S, T] probabilities.

Kernels, by device:
    cpu   ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward.
    cuda  ``aten._scaled_dot_product_flash_attention`` and its backward where torch's own
          attention would pick flash (``cuda_kernel``: 16-bit, no mask, equal head dims of
          at most 256 and a multiple of 8, as many keys as rows where causal, an sm80 or
          newer GPU, and flash not switched off by
          ``torch.backends.cuda.enable_flash_sdp(False)``); otherwise
          ``aten._scaled_dot_product_efficient_attention`` and its backward (they take a mask;
          their ``lse`` is padded to a multiple of 32 rows, cut here and padded back). The
          kernel reads the mask as a bias of [B, H, S, T] in the query's dtype, each row
          starting 16-element aligned (``efficient_bias``: the mask expanded, not copied,
          and its columns padded first where T is not a multiple of 16, as torch's own
          ``scaled_dot_product_attention`` prepares it).
Grouped-query key/value heads are repeated to H before the kernel and their gradients summed
back over each group.

Sequence-sharded attention (context parallelism, passes/rules): one rank holds query rows
[o, o + S) of a sequence of T and every key (gathered), and runs

    sdpa_rows(q, k, v, mask, is_causal, scale, o) -> (out, lse)
    sdpa_rows_backward(grad_out, q, k, v, out, lse, mask, is_causal, scale, o) -> (dq, dk, dv)

where causal means global row o + i sees key j <= o + i. ``mask`` holds the rank's rows (or
broadcasts over them). Causal rows split the keys into blocks, each one kernel call
(``key_blocks``, for any run of keys [a, a + L), the ring's blocks included):

    prefix   keys [a, min(a + L, o)): every one visible to every local row (no causal mask)
    diagonal keys [o, min(a + L, o + S)): the causal block, as the kernel aligns it (top-left:
             local row i sees local key j <= i), which is why such a block must start at o
    after    keys past o + S: seen by no local row, never read

The blocks' partial results merge by their log-sum-exps (the online softmax,
``merge_partial``, one block at a time, in the lse's dtype):

    lse = logaddexp(lse_1, lse_2),   out = sum_b exp(lse_b - lse) * out_b

and the backward runs each block's kernel backward with the merged ``out`` and ``lse``: the
kernel recomputes P = exp(scale q k^T - lse) and D = rowsum(dO * out), which are then the
whole row's, so each block's dq adds up to the row's and its dk, dv are the block's keys'.
``dk``/``dv`` come back for all T keys (zero where no local row looks): each rank's part of
a sum over the ranks (a ``Partial`` gradient, reduce-scattered by the plan).

Ring attention (passes/codegen) calls ``sdpa`` and ``sdpa_backward`` on these blocks itself,
one block of keys at a time as they pass around the ring, with ``key_blocks`` and
``merge_partial`` (and ``after``, for the last block, which a rank may receive and not read).
A causal mask and an explicit ``mask`` never come together (torch's attention refuses both),
so a causal block needs no mask columns.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "after",
    "cuda_kernel",
    "dense_order",
    "efficient_bias",
    "in_layout_of",
    "key_blocks",
    "lse_dtype",
    "mask_cols",
    "memory_order",
    "merge_partial",
    "sdpa",
    "sdpa_backward",
    "sdpa_rows",
    "sdpa_rows_backward",
]

aten = torch.ops.aten


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels keep the log-sum-exp in."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def memory_order(x: Tensor) -> list[int]:
    """``x``'s dims from the outermost in memory to the innermost (by stride; ties in dim
    order): ``x.permute(memory_order(x))`` is contiguous where ``x`` is a permutation of a
    contiguous tensor (a transposed weight)."""
    strides = x.stride()
    return sorted(range(x.dim()), key=lambda d: (-strides[d], d))


def dense_order(x: Tensor) -> list[int] | None:
    """``memory_order(x)`` where ``x`` is a permutation of a contiguous tensor (its strides
    are a contiguous tensor's in that order), else None; from the strides alone (no op
    dispatched: a fake tensor's permute is one)."""
    dims = memory_order(x)
    expected = 1
    for d in reversed(dims):
        size = x.shape[d]
        if size != 1 and x.stride()[d] != expected:
            return None
        expected *= size
    return dims


def in_layout_of(t: Tensor, like: Tensor) -> Tensor:
    """``t`` with its dims laid out in memory in the order of ``like``'s (a copy only where
    the orders differ): what a kernel returns must match the layout its fake promised."""
    want = memory_order(like)
    if memory_order(t) == want:
        return t
    inverse = [want.index(d) for d in range(like.dim())]
    return t.permute(want).contiguous().permute(inverse)


def _repeat_kv(t: Tensor, groups: int) -> Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _sum_groups(t: Tensor, groups: int) -> Tensor:
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(dim=2)


BIAS_ALIGN = 16
"""Elements each row of the memory-efficient kernel's bias starts on (torch pads to it)."""


def efficient_bias(mask: Tensor | None, q: Tensor, k: Tensor) -> Tensor | None:
    """``mask`` as the CUDA memory-efficient kernel reads it (module docstring): a view of
    shape [B, H, S, T] in ``q``'s dtype whose rows start ``BIAS_ALIGN``-aligned. A mask that
    broadcasts over batch or heads stays broadcast (stride 0), so it costs no memory."""
    if mask is None:
        return None
    b, h, s, _ = q.shape
    t = k.shape[2]
    bias = mask.to(q.dtype)
    while bias.dim() < 4:  # broadcast from the right, as attention's mask is
        bias = bias.unsqueeze(0)
    if t % BIAS_ALIGN or bias.stride(-2) % BIAS_ALIGN:  # rows must start aligned
        pad = -t % BIAS_ALIGN
        bias = F.pad(bias.expand(bias.shape[0], bias.shape[1], s, t), (0, pad))[..., :t]
    return bias.expand(b, h, s, t)


def cuda_kernel(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> str:
    """``"flash"`` or ``"efficient"``: the kernel ``sdpa`` (and its backward, on the same
    inputs) runs on CUDA, as torch's attention chooses between the two (module docstring).
    Flash aligns a causal mask bottom-right, the others top-left (what ``sdpa_rows`` and the
    ring's diagonal blocks rely on): torch gives it no causal block of fewer or more keys
    than rows, and neither does this."""
    d = q.shape[-1]
    if (
        mask is None
        and not (is_causal and q.shape[2] != k.shape[2])
        and q.dtype in (torch.float16, torch.bfloat16)
        and d == v.shape[-1]
        and d % 8 == 0
        and d <= 256
        and torch.backends.cuda.flash_sdp_enabled()
        and torch.cuda.get_device_capability(q.device)[0] >= 8
    ):
        return "flash"
    return "efficient"


def _lse_rows(lse: Tensor, rows: int) -> Tensor:
    return lse[..., :rows].contiguous()


@torch.library.custom_op("autopar::sdpa", mutates_args=())
def sdpa(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """Attention of ``q`` over ``k``/``v`` (module docstring): the output and the row lse."""
    groups = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    # NOTE: the kernels by their ATen names: torch's public attention returns no log-sum-exp,
    # which the backward and the ring's merges read (tests/unit/test_torch_internals.py)
    if q.device.type == "cuda" and cuda_kernel(q, k, v, mask, is_causal) == "flash":
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, scale=scale)[
            :2
        ]
        return out, _lse_rows(lse, q.shape[2])
    if q.device.type == "cuda":
        out, lse, _, _ = aten._scaled_dot_product_efficient_attention(
            q, k, v, efficient_bias(mask, q, k), True, 0.0, is_causal, scale=scale
        )
        return out, _lse_rows(lse, q.shape[2])
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale
    )
    return out, lse


def _empty_attention(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """An attention's outputs, unfilled: out [B, H, S, E] and lse [B, H, S]."""
    b, h, s, _ = q.shape
    out = q.new_empty((b, h, s, v.shape[-1]))
    return out, q.new_empty((b, h, s), dtype=lse_dtype(q.dtype))


@sdpa.register_fake
def _(q, k, v, mask, is_causal, scale):
    return _empty_attention(q, v)


@torch.library.custom_op("autopar::sdpa_backward", mutates_args=())
def sdpa_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    mask: Tensor | None,
    is_causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``sdpa`` with respect to ``q``, ``k`` and ``v``."""
    groups = q.shape[1] // k.shape[1]
    kr, vr = _repeat_kv(k, groups), _repeat_kv(v, groups)
    if q.device.type == "cuda" and cuda_kernel(q, kr, vr, mask, is_causal) == "flash":
        zero = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: unread
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            grad_out.contiguous(),
            q,
            kr,
            vr,
            out,
            lse,
            None,  # not variable-length: the cumulative lengths are undefined tensors
            None,
            q.shape[2],
            kr.shape[2],
            0.0,
            is_causal,
            zero,
            zero,
            scale=scale,
        )
    elif q.device.type == "cuda":
        rows = 32 * math.ceil(q.shape[2] / 32)
        padded = F.pad(lse, (0, rows - lse.shape[-1]))
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            grad_out.contiguous(),
            q,
            kr,
            vr,
            efficient_bias(mask, q, kr),
            out,
            padded,
            zero,
            zero,
            0.0,
            [True, True, True, False],
            is_causal,
            scale=scale,
        )
    else:
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.contiguous(), q, kr, vr, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale
        )
    # each gradient laid out as its input (as the fake below says): a key gradient flows
    # back through the transpose of the projection it came from, whose view needs that layout
    dk, dv = _sum_groups(dk, groups), _sum_groups(dv, groups)
    return in_layout_of(dq, q), in_layout_of(dk, k), in_layout_of(dv, v)


@sdpa_backward.register_fake
def _(grad_out, q, k, v, out, lse, mask, is_causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, mask, is_causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask)
    ctx.is_causal, ctx.scale = is_causal, scale


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, mask = ctx.saved_tensors
    dq, dk, dv = sdpa_backward(grad_out, q, k, v, out, lse, mask, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None, None


sdpa.register_autograd(_backward, setup_context=_setup)


def key_blocks(
    q_offset: int, rows: int, k_offset: int, keys: int, is_causal: bool
) -> list[tuple[int, int, bool]]:
    """``(start, end, causal)`` of the parts of the keys [k_offset, k_offset + keys) that
    rows [q_offset, q_offset + rows) read, in the block's own key indices (module docstring):
    the prefix every row sees whole, then the part of the diagonal the block holds, which
    must start at the rows' first (the kernels align a causal mask top-left); nothing past
    the last row's key."""
    if not is_causal:
        return [(0, keys, False)]
    end = k_offset + keys
    blocks = []
    prefix = min(end, q_offset) - k_offset
    if prefix > 0:
        blocks.append((0, prefix, False))
    lo, hi = max(k_offset, q_offset), min(end, q_offset + rows)
    if lo < hi:
        if lo != q_offset:
            raise ValueError(
                f"keys [{k_offset}, {end}) cut the causal diagonal of rows "
                f"[{q_offset}, {q_offset + rows}) after its first row"
            )
        blocks.append((lo - k_offset, hi - k_offset, True))
    return blocks


def merge_partial(
    acc: tuple[Tensor, Tensor] | None, out: Tensor, lse: Tensor
) -> tuple[Tensor, Tensor]:
    """Fold one key block's ``(out, lse)`` into the running ``acc`` (module docstring, the
    online softmax), ``acc``'s output kept in the lse's dtype (float32 for 16-bit inputs)."""
    if acc is None:
        return out.to(lse.dtype), lse
    acc_out, acc_lse = acc
    merged = torch.logaddexp(acc_lse, lse)
    acc_out = acc_out * torch.exp(acc_lse - merged).unsqueeze(-1)
    return acc_out + out.to(lse.dtype) * torch.exp(lse - merged).unsqueeze(-1), merged


def mask_cols(mask: Tensor | None, start: int, end: int) -> Tensor | None:
    """The columns [start, end) of an additive mask (all of a mask that broadcasts them)."""
    if mask is None or mask.shape[-1] == 1:
        return mask
    return mask[..., start:end]


@torch.library.custom_op("autopar::sdpa_rows", mutates_args=())
def sdpa_rows(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    is_causal: bool,
    scale: float,
    offset: int,
) -> tuple[Tensor, Tensor]:
    """Attention of the query rows starting at global row ``offset`` (module docstring)."""
    blocks = key_blocks(offset, q.shape[2], 0, k.shape[2], is_causal)
    if len(blocks) == 1:
        start, end, causal = blocks[0]
        kb, vb, m = k[:, :, start:end], v[:, :, start:end], mask_cols(mask, start, end)
        out, lse = sdpa(q, kb, vb, m, causal, scale)
        return out.clone(), lse.clone()
    acc = None
    for start, end, causal in blocks:
        kb, vb = k[:, :, start:end], v[:, :, start:end]
        acc = merge_partial(acc, *sdpa(q, kb, vb, mask_cols(mask, start, end), causal, scale))
    assert acc is not None
    return acc[0].to(q.dtype), acc[1]


@sdpa_rows.register_fake
def _(q, k, v, mask, is_causal, scale, offset):
    return _empty_attention(q, v)


@torch.library.custom_op("autopar::sdpa_rows_backward", mutates_args=())
def sdpa_rows_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    mask: Tensor | None,
    is_causal: bool,
    scale: float,
    offset: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``sdpa_rows``: dq for the local rows, dk and dv for all T keys."""
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for start, end, causal in key_blocks(offset, q.shape[2], 0, k.shape[2], is_causal):
        kb, vb = k[:, :, start:end], v[:, :, start:end]
        m = mask_cols(mask, start, end)
        dq_b, dk_b, dv_b = sdpa_backward(grad_out, q, kb, vb, out, lse, m, causal, scale)
        dq += dq_b
        dk[:, :, start:end] = dk_b
        dv[:, :, start:end] = dv_b
    return dq, dk, dv


@sdpa_rows_backward.register_fake
def _(grad_out, q, k, v, out, lse, mask, is_causal, scale, offset):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op("autopar::after", mutates_args=())
def after(t: Tensor, held: Tensor) -> Tensor:
    """``t`` (a copy), computed after ``held``: keeps alive, in a graph, a collective whose
    result this rank does not read, which a partitioner would otherwise drop with the send its
    peer waits for (ring attention's last block, on a rank whose rows see none of it)."""
    return t.clone()


@after.register_fake
def _(t, held):
    return torch.empty_like(t)

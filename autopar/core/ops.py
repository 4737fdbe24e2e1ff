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
    cuda  ``aten._scaled_dot_product_efficient_attention`` and its backward (they take a mask;
          their ``lse`` is padded to a multiple of 32 rows, cut here and padded back).
Grouped-query key/value heads are repeated to H before the kernel and their gradients summed
back over each group.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["sdpa", "sdpa_backward", "lse_dtype"]

aten = torch.ops.aten


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels keep the log-sum-exp in."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _repeat_kv(t: Tensor, groups: int) -> Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _sum_groups(t: Tensor, groups: int) -> Tensor:
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(dim=2)


def _lse_rows(lse: Tensor, rows: int) -> Tensor:
    return lse[..., :rows].contiguous()


@torch.library.custom_op("autopar::sdpa", mutates_args=())
def sdpa(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """Attention of ``q`` over ``k``/``v`` (module docstring): the output and the row lse."""
    groups = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    if q.device.type == "cuda":
        out, lse, _, _ = aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, True, 0.0, is_causal, scale=scale
        )
        return out, _lse_rows(lse, q.shape[2])
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale
    )
    return out, lse


@sdpa.register_fake
def _(q, k, v, mask, is_causal, scale):
    b, h, s, _ = q.shape
    out = q.new_empty((b, h, s, v.shape[-1]))
    return out, q.new_empty((b, h, s), dtype=lse_dtype(q.dtype))


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
    if q.device.type == "cuda":
        rows = 32 * math.ceil(q.shape[2] / 32)
        padded = F.pad(lse, (0, rows - lse.shape[-1]))
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            grad_out.contiguous(),
            q,
            kr,
            vr,
            mask,
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
    return dq, _sum_groups(dk, groups), _sum_groups(dv, groups)


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

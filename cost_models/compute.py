"""Roofline compute time of one ATen op on local (per-rank) shapes.

Takes one op (an ``OpOverload`` such as ``torch.ops.aten.mm.default``) with its arguments and
result described by shape: every tensor in ``args``, ``kwargs`` and ``out`` is replaced by its
``torch.Size``; everything else (ints, int lists, None, nested lists and tuples) stays as the
op got it. Non-tensor int lists must stay lists, not ``torch.Size``: a ``torch.Size`` always
means "a tensor of this shape". Returns seconds.

The model, for an op that runs a kernel::

    t(op) = S max(F / P(kind, dtype, F), B / W) + L

    F  FLOPs of the op                                  ``op_flops``
    P  sustained FLOP/s of this kind of kernel at this size in this dtype
       (``DeviceProfile.kernel_rate``): GEMMs (mm, addmm, bmm, baddbmm, convolutions) and
       fused attention (autopar's sdpa, torch's flash / memory-efficient / cuDNN attention)
       by their curves, anything else at the dtype's peak (``DeviceProfile.flops_for``)
    B  bytes read + written = sum over tensors of numel * element size   ``op_bytes``
    W  device memory bandwidth at B bytes               ``DeviceProfile.bandwidth(B)``
       (``mem_bandwidth``, or its curve by size where the profile has one: a CPU's caches)
    L  fixed per-op overhead                            ``DeviceProfile.kernel_launch``
    S  the step's kernels against the curves timed alone  ``DeviceProfile.roofline_scale``
       (1, but on the CPU, where a step's tensors come cold from memory: ~2-3)

``compute_time`` puts the terms together. F comes from ``torch.utils.flop_counter``'s
formulas (mm, addmm, bmm, baddbmm, convolution, scaled-dot-product attention and their
backward), called the way ``FlopCounterMode`` calls them, and for autopar's attention op
(core/ops.py) from ``attention_flops``, the fused kernel's count; an op without a formula counts one
FLOP per output element (pointwise ops, reductions: both far below the ridge point
P / W, so F hardly matters for them). B counts the input tensors and the written tensors
(the outputs, or the mutated arguments of an op that returns nothing) once each; it ignores
caches, so it is the compulsory traffic.

Ops that run no kernel cost only the host's call, ``DeviceProfile.view_launch`` (measured
by ``autopar calibrate``):
    - view ops (``is_view_op``): the output aliases an input, no kernel runs;
    - allocation-only ops (``empty``, ``empty_strided``, ...) and shape queries.
Ops with no tensor among their inputs or outputs cost 0.

Where the host runs ahead of the device (``DeviceProfile.host_clock``: CUDA, kernels
queued), ``compute_time`` is the device's time alone (L the device's own per-kernel time, a
view 0), and ``host_time`` the host's to issue the node (``DeviceProfile.host_time``: the
measured cost of its op, ``host_launch`` for another kernel, ``view_launch`` for a view);
core/schedule runs the two clocks. On a profile of one clock ``host_time`` is 0 and the
host's call is in L.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from autopar.core import ops  # noqa: F401 - defines torch.ops.autopar, priced below

from .devices import DeviceProfile

__all__ = [
    "attention_flops",
    "compute_time",
    "host_time",
    "is_view_op",
    "kernel_kind",
    "op_bytes",
    "op_flops",
    "profiler_name",
    "runs_kernel",
]

aten = torch.ops.aten

# The ops each size curve of a profile prices (``DeviceProfile.kernel_rates``).
_KERNEL_PACKETS = {
    "matmul": (
        aten.mm,
        aten.addmm,
        aten.bmm,
        aten.baddbmm,
        aten.convolution,
        aten.convolution_backward,
    ),
    "attention": (
        torch.ops.autopar.sdpa,
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_cudnn_attention,
    ),
    "attention_backward": (
        torch.ops.autopar.sdpa_backward,
        aten._scaled_dot_product_flash_attention_backward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward,
        aten._scaled_dot_product_efficient_attention_backward,
        aten._scaled_dot_product_cudnn_attention_backward,
    ),
}
_KIND_OF_PACKET = {p: kind for kind, packets in _KERNEL_PACKETS.items() for p in packets}


def attention_flops(q_shape, k_shape, v_shape, is_causal: bool, *, backward: bool) -> float:
    """FLOPs of a fused attention kernel (flash / memory-efficient) on these shapes.

    Forward: 2 B H S T (D + E) (scores Q K^T, then P V). Backward: 2 B H S T (3 D + 2 E): the
    kernel recomputes the scores, then dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q.
    With ``is_causal`` only the unmasked pairs count (the kernels skip masked blocks): row i
    of S sees min(T, i + 1) keys (top-left aligned, as torch's causal mask) when S = T. When
    S < T the rows are one rank's share of a sequence split over ranks (passes/rules,
    ``sequence``), load-balanced when S is even: every rank computes S (T + 1) / 2 pairs, the
    average. An odd S is not balanced, and counts the last rank's share, rows T - S + i seeing
    T - S + i + 1 keys: the slowest rank, which the step waits for."""
    b, h, s, d = q_shape
    t, e = k_shape[2], v_shape[3]
    if not is_causal:
        pairs = s * t
    elif s == t:
        pairs = s * (s + 1) // 2
    elif s < t and s % 2 == 0:
        pairs = s * (t + 1) // 2
    elif s < t:
        pairs = s * (t - s) + s * (s + 1) // 2
    else:
        pairs = sum(min(t, i + 1) for i in range(s))
    per_pair = 2 * (3 * d + 2 * e) if backward else 2 * (d + e)
    return float(b * h * pairs * per_pair)


def _sdpa_flops(q, k, v, mask, is_causal, scale, out_val=None):
    return attention_flops(q.shape, k.shape, v.shape, is_causal, backward=False)


def _sdpa_backward_flops(grad_out, q, k, v, out, lse, mask, is_causal, scale, out_val=None):
    return attention_flops(q.shape, k.shape, v.shape, is_causal, backward=True)


# FLOP formulas torch's registry lacks for ops a CPU trace contains; same math as the CUDA
# variants (the registry's sdpa formulas take (query, key, value, ...) / (grad_out, query,
# key, value, ...), which is how these ops order their arguments too).
_EXTRA_FLOP_FORMULAS: dict[Any, Any] = {
    torch.ops.autopar.sdpa: _sdpa_flops,
    torch.ops.autopar.sdpa_backward: _sdpa_backward_flops,
    aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[
        aten._scaled_dot_product_flash_attention
    ],
    aten._scaled_dot_product_flash_attention_for_cpu_backward: flop_registry[
        aten._scaled_dot_product_flash_attention_backward
    ],
}

# Aliasing ops whose schema does not say so (``OpOverload.is_view`` is False for them).
_EXTRA_VIEW_PACKETS = frozenset({aten._unsafe_view})

# Ops that launch no kernel though they return a tensor or a number.
_NO_KERNEL_PACKETS = frozenset(
    {
        aten.empty,
        aten.empty_like,
        aten.empty_strided,
        aten.new_empty,
        aten.new_empty_strided,
        aten.sym_size,
        aten.sym_stride,
        aten.sym_numel,
        aten.sym_storage_offset,
    }
)


def _is_size(x: Any) -> bool:
    return isinstance(x, torch.Size)


def _sizes(tree: Any) -> list[torch.Size]:
    """The ``torch.Size`` leaves of a pytree, in order."""
    leaves, _ = tree_flatten(tree, is_leaf=_is_size)
    return [x for x in leaves if isinstance(x, torch.Size)]


def _packet(op: Any) -> Any:
    return getattr(op, "overloadpacket", op)


def is_view_op(op: Any) -> bool:
    """True when ``op``'s output aliases its input, so it runs no kernel.

    Uses the schema (``OpOverload.is_view``: view, reshape, t, transpose, permute, expand,
    squeeze, unsqueeze, slice, select, split, alias, detach, as_strided, ...) plus
    ``aten._unsafe_view`` and ``operator.getitem`` (picks one output of a multi-output op).
    """
    # NOTE: reshape/contiguous are "views" by schema but copy when strides forbid a view; in a
    # traced aten graph (post-dispatch) they are already split into clone + _unsafe_view, and
    # the clone pays for the copy.
    if op is operator.getitem:
        return True
    if isinstance(op, torch._ops.OpOverload):
        return bool(op.is_view) or op.overloadpacket in _EXTRA_VIEW_PACKETS
    return False


def _runs_no_kernel(op: Any) -> bool:
    return is_view_op(op) or _packet(op) in _NO_KERNEL_PACKETS


def kernel_kind(op: Any) -> str | None:
    """The ``KERNEL_KINDS`` curve that prices ``op`` ("matmul", "attention",
    "attention_backward"), or None for an op priced at the dtype's peak."""
    return _KIND_OF_PACKET.get(_packet(op))


def _written_sizes(op: Any, args: tuple, kwargs: dict, out: Any) -> list[torch.Size]:
    """Shapes the op writes: its outputs, or, when it returns no tensor (``_foreach_add_``),
    the arguments its schema marks as mutated (``Tensor(a!)``)."""
    written = _sizes(out)
    if written or not isinstance(op, torch._ops.OpOverload):
        return written
    for i, arg in enumerate(op._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        if not arg.kwarg_only and i < len(args):
            written += _sizes(args[i])
        elif arg.name in kwargs:
            written += _sizes(kwargs[arg.name])
    return written


def op_flops(op: Any, args: tuple, kwargs: dict | None, out: Any) -> float:
    """FLOPs of ``op`` on the shapes in ``args``/``kwargs``/``out`` (tensors as ``torch.Size``).

    Ops with a formula in ``torch.utils.flop_counter.flop_registry`` (keyed by
    ``op.overloadpacket``) use it: each ``torch.Size`` becomes a meta tensor and the formula
    is called as ``FlopCounterMode`` calls it, ``formula(*args, **kwargs, out_val=out)``.
    View ops count 0; any other op counts one FLOP per written element (see module docstring).
    """
    kwargs = kwargs or {}
    if _runs_no_kernel(op):
        return 0.0
    packet = _packet(op)
    formula = flop_registry.get(packet) or _EXTRA_FLOP_FORMULAS.get(packet)
    if formula is not None:
        # NOTE: meta tensors rather than bare sizes: some registered formulas are "raw" (they
        # read ``.shape`` and ``.device`` themselves, e.g. _flash_attention_forward), the
        # others strip tensors to shapes in their wrapper. Meta tensors serve both, for free.
        m_args, m_kwargs, m_out = tree_map(
            lambda x: torch.empty(x, device="meta") if isinstance(x, torch.Size) else x,
            (tuple(args), dict(kwargs), out),
            is_leaf=_is_size,
        )
        return float(formula(*m_args, **m_kwargs, out_val=m_out))
    return float(sum(math.prod(s) for s in _written_sizes(op, tuple(args), kwargs, out)))


def op_bytes(
    in_sizes_dtypes: Iterable[tuple[torch.Size, torch.dtype]],
    out_sizes_dtypes: Iterable[tuple[torch.Size, torch.dtype]],
) -> float:
    """Bytes read + written: sum over all given tensors of numel * element size."""
    total = 0
    for size, dtype in (*in_sizes_dtypes, *out_sizes_dtypes):
        total += math.prod(size) * dtype.itemsize
    return float(total)


def compute_time(
    profile: DeviceProfile,
    op: Any,
    args: tuple,
    kwargs: dict | None,
    out: Any,
    dtype: torch.dtype,
    *,
    nbytes: float | None = None,
) -> float:
    """Roofline time in seconds of one ``op`` on local shapes (see the module docstring).

    Args:
        profile: the device (``devices.get_profile(mesh.device)``).
        op: an ``OpOverload`` (or ``operator.getitem``).
        args, kwargs, out: the op's arguments and result, every tensor as its ``torch.Size``.
        dtype: the dtype the op computes in; picks the peak FLOP/s and, unless ``nbytes`` is
            given, the element size of every tensor.
        nbytes: bytes read + written, when the caller knows each tensor's dtype (compute it
            with ``op_bytes``); default: every tensor counted at ``dtype``'s element size.
    """
    kwargs = kwargs or {}
    if _runs_no_kernel(op):
        return 0.0 if profile.host_clock else profile.view_launch
    read = _sizes((tuple(args), kwargs))
    written = _written_sizes(op, tuple(args), kwargs, out)
    if not read and not written:
        return 0.0
    flops = op_flops(op, args, kwargs, out)
    if nbytes is None:
        nbytes = op_bytes([(s, dtype) for s in read], [(s, dtype) for s in written])
    kind = kernel_kind(op)
    rate = profile.flops_for(dtype) if kind is None else profile.kernel_rate(kind, dtype, flops)
    roof = max(flops / rate, nbytes / profile.bandwidth(nbytes))
    return roof * profile.roofline_scale + profile.kernel_launch


def profiler_name(op: Any) -> str:
    """``op``'s name as torch's profiler records it (``aten::mm``), the key of
    ``DeviceProfile.host_op_costs``."""
    name = getattr(_packet(op), "_qualified_op_name", None)
    return name if isinstance(name, str) else getattr(op, "__name__", str(op))


def runs_kernel(op: Any) -> bool:
    """Whether ``op`` runs a kernel (not a view, an allocation or a shape query)."""
    return not _runs_no_kernel(op)


def host_time(profile: DeviceProfile, op: Any) -> float:
    """Host seconds to issue one node of ``op`` where the host runs ahead of the device
    (module docstring); 0 on a profile of one clock."""
    return profile.host_time(profiler_name(op), runs_kernel(op))

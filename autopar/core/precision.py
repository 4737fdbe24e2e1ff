"""Mixed precision as FSDP2's ``MixedPrecisionPolicy`` does it: a policy and the casts it means.

``MixedPrecision(param_dtype, reduce_dtype, output_dtype)``: the parameters are stored (and
the optimizer steps them, and keeps its state) in their own dtype, float32 as a rule; the
forward and backward compute with a copy of each parameter cast to ``param_dtype``, made in
the module that owns the parameter when that module runs; floating-point inputs are cast to
``param_dtype`` as they enter the model; gradients are reduced across ranks in
``reduce_dtype`` and handed to the optimizer in the parameter's dtype; the model's floating
outputs are cast to ``output_dtype`` (None: left as computed) before the loss.

``cast_parameters(model, policy)`` is that forward, as a context manager: inside it, running
``model`` computes what the planned step computes. passes/trace traces under it (so the
casts are ops of the step graph, and the solver places them: an all-gather before or after
a cast moves float32 or bfloat16), and a single-device reference runs under it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["MixedPrecision", "cast_parameters"]

_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True)
class MixedPrecision:
    """What runs in which dtype (module docstring).

    Attributes:
        param_dtype: the dtype of the parameters' compute copies (and of the activations).
        reduce_dtype: the dtype gradients are reduced in across ranks: the parameter's own
            dtype (float32: reduce after casting the gradient back) or ``param_dtype``
            (reduce first, then cast). None: ``param_dtype``, as FSDP2.
        output_dtype: the dtype of the model's floating outputs (None: as computed).
    """

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype | None = torch.float32
    output_dtype: torch.dtype | None = None

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _FLOATS:
                raise ValueError(f"MixedPrecision.{name} must be a floating dtype, got {value}")

    @property
    def reduce(self) -> torch.dtype:
        return self.param_dtype if self.reduce_dtype is None else self.reduce_dtype

    def text(self) -> str:
        def name(d):
            return str(d).removeprefix("torch.")

        out = "" if self.output_dtype is None else f", output {name(self.output_dtype)}"
        return f"param {name(self.param_dtype)}, reduce {name(self.reduce)}{out}"


def _cast(x, dtype: torch.dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    if isinstance(x, (tuple, list)):
        return type(x)(_cast(v, dtype) for v in x)
    return x


@contextlib.contextmanager
def cast_parameters(model: nn.Module, policy: MixedPrecision | None):
    """Run ``model`` under ``policy`` while inside (module docstring); None does nothing.

    Each module that owns floating parameters swaps in their ``param_dtype`` copies for
    the length of its own forward (a forward pre-hook and a forward hook), so the casts are
    recorded inside the module that uses them; the root casts its floating inputs, and its
    outputs to ``output_dtype``. Gradients reach the stored parameters through the casts."""
    if policy is None:
        yield
        return
    dtype = policy.param_dtype
    saved: dict[int, list[dict]] = {}

    def before(mod, args):
        own = {
            n: p
            for n, p in mod._parameters.items()
            if p is not None and p.is_floating_point() and p.dtype != dtype
        }
        saved.setdefault(id(mod), []).append(own)
        for n, p in own.items():
            mod._parameters[n] = p.to(dtype)

    def after(mod, args, out):
        for n, p in saved[id(mod)].pop().items():
            mod._parameters[n] = p

    def root_in(mod, args):
        return _cast(args, dtype)

    def root_out(mod, args, out):
        return out if policy.output_dtype is None else _cast(out, policy.output_dtype)

    handles = [model.register_forward_pre_hook(root_in)]
    for m in model.modules():
        if any(p.is_floating_point() for p in m.parameters(recurse=False)):
            handles.append(m.register_forward_pre_hook(before))
            handles.append(m.register_forward_hook(after, always_call=True))
    handles.append(model.register_forward_hook(root_out))
    try:
        yield
    finally:
        for h in handles:
            h.remove()

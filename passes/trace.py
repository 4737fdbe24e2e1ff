"""Trace one training step into a joint forward+backward ATen graph.

Takes: an ``nn.Module``, example inputs (real, meta or fake tensors), optionally a loss
function and example targets. Returns: a ``StepGraph`` whose ``gm`` is the joint graph that
aot_autograd builds for

    step(params, buffers, inputs, targets) = loss_fn(model(*inputs), *targets)

(or the model outputs when there is no loss function), with the gradient of every
parameter among its outputs and one tangent input per differentiable output.

Route: ``torch.export.export(strict=False)`` of a wrapper module that calls the model and the
loss, then ``aot_export_joint_with_descriptors`` on the exported module. The descriptors on
placeholders and outputs (``ParamAOTInput``, ``PlainAOTInput``, ``TangentAOTInput``,
``GradAOTOutput``) give every graph input and output its role.

Buffers the forward updates in place (BatchNorm's running statistics) are graph outputs
too (their new values, ``StepGraph.mutated_buffers``); the compiled step writes them back
into the buffers, as eager PyTorch does.

The step's own buffers: a loss module's (``nn.CrossEntropyLoss(weight=w)``: its class
weight, ``loss_fn.weight``), and each tensor the step reads that is neither a parameter
nor a buffer (a loss function's class weight from its scope, ``lifted_tensor_0``; a
model's plain tensor attribute, under its name; torch.export lifts them as constants, and
``_constants_as_buffers`` makes them buffers of the exported step), are buffer
placeholders, their values in ``StepGraph.constants``: planned as buffers, fed by the
runtime beside the model's, never in the model's state.

Node meta written here (read by later passes; names in core/roles.py):
    ``autopar_role``   "param" | "buffer" | "input" | "target" | "tangent" for placeholders,
                       "forward" | "backward" for operators.
    ``autopar_module`` the module path of the original model the node came from
                       (backward nodes inherit their forward node's path), "" at the top.

Attention is traced as the one device-neutral op ``autopar::sdpa`` (core/ops.py), not as the
ATen op of the tracing machine's device: ``_TargetAttention``, a ``TorchFunctionMode``
active during the export, replaces each ``F.scaled_dot_product_attention`` call (the
library default of Hugging Face models) by it. Why not trace under fake CUDA tensors: the
kernel a CUDA trace records (flash, memory-efficient, cuDNN) depends on dtype, mask and
hardware, so a plan made on one machine would not match the graph traced where it runs, and
the CPU meshes of the tests would plan another graph than the GPUs; one node, lowered to
the device's kernel when it runs, is the same graph everywhere. Calls it cannot express
stay torch's (and say why in a warning): dropout in attention, a mask that needs a gradient
(T5's learned position bias), a grouped-query call without ``enable_gqa``; torch then
traces them as its math attention (matmuls, softmax), which is planned op by op.

Masks as the eager step makes them (``_masks_as_eager``): a Hugging Face model with no padding
mask calls SDPA with ``is_causal=True`` (or no mask at all, bidirectionally) when it runs, but
builds the whole [B, 1, S, T] mask when it sees ``torch.export`` (whose exported program might
later be called at other lengths; a training step is traced for its shapes). That mask is
S x T elements live through the step (64 GiB in float32 at 128k tokens) and hides the causal
structure the attention kernels and the sequence split (passes/rules) use, so the library is
told it is not exporting while the step is traced: it then skips the mask exactly where its
eager run does (no padding mask given, no sliding window reached); a padding mask is still
read as a traced tensor, which the library never skips on. Position ids the model counts
itself (``arange``) are not packed sequences, as its eager run finds; position ids among the
step's inputs may be, and keep the library's packed-sequence mask.

Ops without a sharding rule that torch can decompose are decomposed while the joint graph is
built (``rules.decompositions_without_rules``: ``mse_loss``, ``floor_divide``, ...), so the
graph holds ops the planner can shard.

Mixed precision (``mp_policy``, core/precision.py): the export runs under
``cast_parameters``, so each parameter's compute copy is a ``_to_copy`` node inside the module
that owns it (and folds with it), and each gradient reaches its float32 parameter through the
backward ``_to_copy``; those casts are listed in ``StepGraph.reduce_at`` with the side of them
on which ``reduce_dtype`` puts the gradient's reduction (the solver keeps to it).

A model on the meta device is traced as fake CPU tensors (``_meta_to_fake``); shape
assertions of the global graph are dropped (``_drop_asserts``: no rank holds global shapes);
a parameter tied under two names is two graph inputs, recorded in ``StepGraph.alias_of``.

The export needs an open ``contextlib.ExitStack`` (aot_autograd's fake mode and tracing
context live in it): compile the graph before the stack closes.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import math
import re
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._functorch._aot_autograd.descriptors import (
    BufferAOTInput,
    GradAOTOutput,
    InputMutationAOTOutput,
    ParamAOTInput,
    PlainAOTInput,
    PlainAOTOutput,
    TangentAOTInput,
)
from torch._functorch.aot_autograd import (
    JointWithDescriptors,
    aot_export_joint_with_descriptors,
)
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from autopar.core import MixedPrecision, cast_parameters, ops, roles

from . import rules

__all__ = ["AttentionNotLoweredWarning", "StepGraph", "TraceError", "trace_step"]

_PREFIX = "model."


class TraceError(RuntimeError):
    """The model could not be traced; the message says what failed and where."""


class _Step(nn.Module):
    """``forward(*inputs, *targets) = loss_fn(model(*inputs), *targets)``."""

    def __init__(self, model: nn.Module, loss_fn, n_inputs: int):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.n_inputs = n_inputs

    def forward(self, *args):
        self.inputs = args  # what the trace is called with (_masks_as_eager)
        out = self.model(*args[: self.n_inputs])
        if self.loss_fn is None:
            return out
        return self.loss_fn(out, *args[self.n_inputs :])


@dataclass
class StepGraph:
    """The joint graph of one training step and what its inputs and outputs are.

    Attributes:
        gm: the joint forward+backward graph; placeholders are params, buffers, inputs,
            targets, tangents in that order.
        joint: aot_autograd's ``JointWithDescriptors`` (needed to compile ``gm``).
        param_names: original model parameter names, in placeholder order.
        buffer_names: original model buffer names and the step's own (``constants``), in
            placeholder order.
        n_inputs / n_targets: how many user inputs and targets the step takes.
        has_loss: the step returns a scalar loss (else the model outputs).
        n_outputs: how many plain (non-gradient) outputs the step returns.
        grad_of: output position -> parameter name whose gradient it is.
        mutated_buffers: output position -> name of the buffer whose new value it is (a
            buffer the forward updates in place: BatchNorm's running statistics).
        notes: what the user should know of the trace (attention left as torch's, and why);
            they reach ``plan.warnings``.
        alias_of: for a tied parameter (one tensor under several names), each later name
            -> the first name; both are graph inputs, and must be placed alike.
        trace_s: seconds spent tracing.
        constants: the step's buffers that are not the model's, by name, with their
            values: a loss module's (``loss_fn.weight`` of ``nn.CrossEntropyLoss(weight=w)``)
            and each tensor the step closes over (``_constants_as_buffers``); the runtime
            feeds them as it feeds the model's buffers.
        mp_policy: the mixed precision the step was traced under (None: none).
        reduce_at: for each gradient cast of ``mp_policy`` (the backward's cast of a
            parameter's gradient from the compute dtype to the parameter's), where the
            gradient must be reduced across ranks: ``"after"`` the cast (in the parameter's
            dtype) or ``"before"`` it (in the compute dtype), as ``reduce_dtype`` says.
    """

    gm: torch.fx.GraphModule
    joint: JointWithDescriptors
    param_names: list[str]
    buffer_names: list[str]
    n_inputs: int
    n_targets: int
    has_loss: bool
    n_outputs: int
    grad_of: dict[int, str] = field(default_factory=dict)
    mutated_buffers: dict[int, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    alias_of: dict[str, str] = field(default_factory=dict)
    trace_s: float = 0.0
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    mp_policy: MixedPrecision | None = None
    reduce_at: dict[str, str] = field(default_factory=dict)
    _fingerprint: str | None = field(default=None, init=False, repr=False, compare=False)

    def placeholders(self) -> list[torch.fx.Node]:
        return list(self.gm.graph.find_nodes(op="placeholder"))

    def output_node(self) -> torch.fx.Node:
        return next(iter(self.gm.graph.find_nodes(op="output")))

    def fingerprint(self) -> str:
        """A hash of the graph's structure: ops, shapes, dtypes and edges, in order; made
        once (``autopar.plan`` keys its cache by it, and the plan carries it: a 96-layer
        step's hash is ~0.1 s). The graph is not changed once traced: the passes that
        rewrite a step (passes/order, remat, codegen) rewrite a copy of it."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for n in self.gm.graph.nodes:
                v = n.meta.get("val")
                tensor = (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None
                args = [a.name if isinstance(a, torch.fx.Node) else repr(a) for a in n.args]
                h.update(f"{n.op}|{n.name}|{n.target}|{tensor}|{args}\n".encode())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint


def _decompositions() -> dict:
    rules.register_library_rules()  # a library imported since may have brought ops we rule
    return rules.decompositions_without_rules()


class AttentionNotLoweredWarning(UserWarning):
    """An attention call stays ATen's op (no sharding rule): the message says why."""


def _lower_sdpa(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
):
    """``autopar::sdpa`` for one ``F.scaled_dot_product_attention`` call, or (None, why)."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return None, "inputs are not [batch, heads, sequence, dim]"
    if dropout_p != 0.0:
        return None, f"attention dropout ({dropout_p}) is not planned"
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads != kv_heads and not (enable_gqa and heads % kv_heads == 0):
        return None, f"{heads} query heads over {kv_heads} key/value heads without enable_gqa"
    if attn_mask is not None:
        if attn_mask.requires_grad:
            return None, "its mask needs a gradient (a learned position bias)"
        if is_causal:
            return None, "it gives both a mask and is_causal"
        if attn_mask.dtype == torch.bool:
            keep = attn_mask
            attn_mask = torch.zeros(keep.shape, dtype=query.dtype, device=query.device)
            attn_mask = attn_mask.masked_fill(~keep, float("-inf"))
        else:
            attn_mask = attn_mask.to(query.dtype)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    out, _lse = ops.sdpa(query, key, value, attn_mask, bool(is_causal), scale)
    return out, ""


class _TargetAttention(TorchFunctionMode):
    """Trace ``F.scaled_dot_product_attention`` as ``autopar::sdpa`` (module docstring).

    ``notes``: one line for each reason a call was left as torch's."""

    def __init__(self):
        super().__init__()
        self.notes: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            out, why = _lower_sdpa(*args, **kwargs)
            if out is not None:
                return out
            note = (
                f"scaled_dot_product_attention is traced as torch's own attention, not as "
                f"autopar::sdpa, because {why}: its ops are planned one by one"
            )
            if note not in self.notes:
                self.notes.append(note)
                warnings.warn(note, AttentionNotLoweredWarning, stacklevel=2)
        return func(*args, **kwargs)


def _constants_as_buffers(module: nn.Module, ep) -> None:
    """Register each tensor the exported step closes over (``ep.constants``: torch.export
    lifts a tensor that is neither a parameter nor a buffer, as a loss function's class
    weight captured from its scope, or a model's plain tensor attribute) as a buffer of the
    exported ``module``, under its name: aot_autograd takes a buffer as a graph input,
    where it traces a constant's real tensor inside its fake tensors and fails ("convert
    all Tensors to FakeTensors")."""
    for name, value in ep.constants.items():
        if not isinstance(value, torch.Tensor):
            continue
        path, _, attr = name.rpartition(".")
        owner = module.get_submodule(path)
        held = dict(owner.named_buffers(recurse=False))
        if attr in held or not isinstance(getattr(owner, attr, None), torch.Tensor):
            continue
        delattr(owner, attr)
        owner.register_buffer(attr, value)


def _strip(name: str) -> str:
    return name[len(_PREFIX) :] if name.startswith(_PREFIX) else name


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    if path == "model":
        return ""
    return _strip(path)


@contextlib.contextmanager
def _without_partial_graph():
    """Keep torch.export from printing its partial graph when it fails.

    NOTE: on a failure torch.export prints the exception's ``partial_fx_graph`` (dozens
    of lines of generated code) to ``sys.stderr`` before raising, ahead of the one line that
    says what went wrong (TraceError). What export writes to ``sys.stderr`` is held here and
    passed on, less that graph; a warning shown meanwhile passes on unchanged.
    """
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    except Exception as e:
        text = held.getvalue()
        graph = getattr(e, "partial_fx_graph", None)
        if graph is not None:
            text = text.replace(str(graph), "").strip("\n")
        if text:
            sys.stderr.write(text + "\n")
        raise
    sys.stderr.write(held.getvalue())


@contextlib.contextmanager
def _masks_as_eager(step: _Step):
    """Let Hugging Face's mask builders skip the masks its eager run skips (module docstring).

    NOTE: ``transformers.masking_utils`` asks ``is_torchdynamo_exporting`` before skipping a
    causal or bidirectional mask for SDPA, and ``find_packed_sequence_indices`` returns a
    packed-sequence index whenever it cannot read the position ids (a traced tensor); no
    argument or setting changes either. Both module-level names are swapped for the trace's
    duration. Some releases (5.17) have no ``is_torchdynamo_exporting`` there and ask
    ``is_tracing(padding_mask)`` instead, which is true under export even for no padding
    mask (None); where the module has that name, it is swapped for one that calls no mask
    traced when there is none (a given padding mask is still asked about, so its contents
    are never read while tracing).
    tests/unit/test_attention.py fails if they move (the mask would come back).
    """
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    names = ("is_torchdynamo_exporting", "is_tracing", "find_packed_sequence_indices")
    real = {n: getattr(masking, n) for n in names if hasattr(masking, n)}

    def packed(position_ids):
        given = getattr(step, "inputs", ())
        if any(position_ids is t or position_ids._base is t for t in given):
            return real["find_packed_sequence_indices"](position_ids)
        return None  # counted by the model: one sequence per row

    def tracing(tensor=None):
        return tensor is not None and real["is_tracing"](tensor)

    swapped = {
        "is_torchdynamo_exporting": lambda: False,
        "is_tracing": tracing,
        "find_packed_sequence_indices": packed,
    }
    for n in real:
        setattr(masking, n, swapped[n])
    try:
        yield
    finally:
        for n, f in real.items():
            setattr(masking, n, f)


def _failing_module(model: nn.Module, exc: BaseException) -> str:
    """The innermost module of ``model`` whose ``forward`` is on the exception's stack."""
    names = {id(m): n for n, m in model.named_modules()}
    found = ""
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in names and tb.tb_frame.f_code.co_name == "forward":
            found = names[id(owner)] or found
        tb = tb.tb_next
    return found


_ASSERTS = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
}


def _drop_asserts(gm: torch.fx.GraphModule) -> None:
    """Remove metadata assertions: they check global shapes, which no rank holds."""
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in _ASSERTS and not n.users:
            gm.graph.erase_node(n)
    gm.recompile()


def _meta_to_fake(model: nn.Module, inputs, targets, device: str = "cpu"):
    """Trace a meta model as fake tensors on ``device`` (the device it will run on; CPU
    when only planning): same shapes, still no memory.

    NOTE: aot_autograd on meta tensors loses grad mode after a ``torch.no_grad`` region
    (the rotary embedding of HF Llama has one), so the joint graph would have no backward;
    fake tensors on the CPU device trace like real ones.
    """
    mode = FakeTensorMode(allow_non_fake_inputs=False)

    def fake(t: torch.Tensor) -> torch.Tensor:
        device_ = device if t.is_meta else t.device
        with mode:
            out = torch.empty(t.shape, dtype=t.dtype, device=device_)
        return out

    model = copy.deepcopy(model)
    memo: dict[int, Any] = {}  # tied weights stay tied
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                if id(p) not in memo:
                    memo[id(p)] = nn.Parameter(fake(p), requires_grad=p.requires_grad)
                mod._parameters[name] = memo[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None:
                if id(b) not in memo:
                    memo[id(b)] = fake(b)
                mod._buffers[name] = memo[id(b)]
    return model, tuple(fake(t) for t in inputs), tuple(fake(t) for t in targets)


def _gradient_casts(gm, out, grad_of: dict[int, str], policy: MixedPrecision | None) -> dict:
    """``StepGraph.reduce_at``: the backward casts that make a parameter's gradient from its
    compute copy's (``_to_copy`` from ``param_dtype``, as the output of the step)."""
    if policy is None:
        return {}
    found = {}
    outs = out.args[0]
    for i in grad_of:
        n = outs[i]
        if not isinstance(n, torch.fx.Node) or n.target is not torch.ops.aten._to_copy.default:
            continue
        src = n.args[0]
        if not isinstance(src, torch.fx.Node) or src.meta["val"].dtype != policy.param_dtype:
            continue
        keep = n.meta["val"].dtype == policy.reduce
        found[n.name] = "after" if keep else "before"
    return found


def _check_inputs(model, example_inputs, loss_fn, example_targets):
    if not isinstance(model, nn.Module):
        raise TypeError(f"autopar traces an nn.Module, got {type(model).__name__}")
    if example_inputs is None or (isinstance(example_inputs, (tuple, list)) and not example_inputs):
        raise ValueError(
            "example_inputs are missing: pass a tuple of tensors shaped like one global batch, "
            "e.g. example_inputs=(tokens,) (meta tensors work for planning)"
        )
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    targets = () if example_targets is None else example_targets
    if isinstance(targets, torch.Tensor):
        targets = (targets,)
    targets = tuple(targets)
    for i, t in enumerate(example_inputs + targets):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"example input {i} is a {type(t).__name__}; autopar takes tensors only"
            )
    return example_inputs, targets


def _tied_names(model: nn.Module) -> dict[str, str]:
    """``StepGraph.alias_of``: each later name of a parameter tied under several -> its
    first name."""
    first_name: dict[int, str] = {}
    alias_of: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first_name:
            alias_of[name] = first_name[id(p)]
        else:
            first_name[id(p)] = name
    return alias_of


def _export_error(model: nn.Module, e: BaseException) -> TraceError:
    """What ``torch.export`` failing on ``model`` means: the module that failed, the call
    that raised, the first line of the error, and what autopar needs."""
    where = _failing_module(model, e)
    where_txt = f" in module '{where}'" if where else ""
    call = re.search(
        r'The following call raised this error:\s*File "([^"]+)", line (\d+), in \S+\s*\n'
        r"\s*(.*)",
        str(e),
    )
    at = f" at {call[1]}:{call[2]} ({call[3].strip()})" if call else ""
    return TraceError(
        f"torch.export could not trace {type(model).__name__}{where_txt}{at}: "
        f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}\n"
        "autopar needs a model torch.export can trace (no data-dependent Python control "
        "flow, no unsupported ops); see the torch.export docs for the usual rewrites."
    )


def _export(
    model: nn.Module, step: _Step, args: tuple, mp_policy: MixedPrecision | None
) -> tuple[torch.export.ExportedProgram, list[str]]:
    """``torch.export`` of ``step`` under the trace's modes (attention as ``autopar::sdpa``,
    ``mp_policy``'s casts, masks as eager, no partial graph printed): the exported program
    and the notes of the attention calls left as torch's."""
    attention = _TargetAttention()
    try:
        with (
            attention,
            cast_parameters(model, mp_policy),
            _masks_as_eager(step),
            _without_partial_graph(),
        ):
            ep = torch.export.export(step, args, strict=False)
    except Exception as e:  # noqa: BLE001 - rewrap with the module that failed
        raise _export_error(model, e) from e
    return ep, list(attention.notes)


def _step_constants(model: nn.Module, exported: nn.Module) -> dict[str, torch.Tensor]:
    """``StepGraph.constants``: the exported step's buffers that are not the model's."""
    # a loss module's, and the constants ``_constants_as_buffers`` made buffers, the
    # model's plain tensor attributes among them (taken before aot_autograd, whose fake
    # mode the stack holds open after it)
    own = {_PREFIX + n for n, _ in model.named_buffers(remove_duplicate=False)}
    return {
        _strip(name): b.detach()
        for name, b in exported.named_buffers(remove_duplicate=False)
        if name not in own
    }


def _joint(
    stack: contextlib.ExitStack, exported: nn.Module, args: tuple, model: nn.Module
) -> JointWithDescriptors:
    """aot_autograd's joint graph of the exported step, the ops without a sharding rule
    decomposed."""
    try:
        return aot_export_joint_with_descriptors(
            stack,
            exported,
            args,
            decompositions=_decompositions(),
            _record_nn_module_stack=True,
        )
    except Exception as e:  # noqa: BLE001
        raise TraceError(
            f"aot_autograd could not build the joint graph of {type(model).__name__}: "
            f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        ) from e


def _mark_roles(gm: torch.fx.GraphModule, n_inputs: int) -> tuple[list[str], list[str]]:
    """Write ``autopar_role`` and ``autopar_module`` on every placeholder and operator
    (module docstring; a backward node takes its forward node's module, by ``seq_nr``);
    returns the parameter and buffer names in placeholder order."""
    param_names, buffer_names = [], []
    seq_module: dict[int, str] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            desc = n.meta.get("desc")
            if isinstance(desc, ParamAOTInput):
                role = roles.PARAM
                param_names.append(_strip(desc.target))
            elif isinstance(desc, BufferAOTInput):
                role = roles.BUFFER
                buffer_names.append(_strip(desc.target))
            elif isinstance(desc, PlainAOTInput):
                role = roles.INPUT if desc.idx < n_inputs else roles.TARGET
            elif isinstance(desc, TangentAOTInput):
                role = roles.TANGENT
            else:
                raise TraceError(f"unexpected graph input {n.name} ({desc!r})")
            n.meta[roles.META_ROLE] = role
            n.meta[roles.META_MODULE] = ""
        elif n.op == "call_function":
            backward = n.meta.get("partitioner_tag") == "is_backward"
            n.meta[roles.META_ROLE] = roles.BACKWARD if backward else roles.FORWARD
            path = _module_path(n)
            seq = n.meta.get("seq_nr")
            if not backward and seq is not None:
                seq_module.setdefault(seq, path)
            elif not path and seq is not None:
                path = seq_module.get(seq, "")
            n.meta[roles.META_MODULE] = path
    return param_names, buffer_names


def _read_outputs(
    out: torch.fx.Node, model: nn.Module
) -> tuple[dict[int, str], dict[int, str], list[int]]:
    """``(grad_of, mutated_buffers, plain)`` of the step's outputs, by their descriptors:
    which parameter's gradient, which buffer's new value, and the plain outputs' positions.
    An input other than a buffer changed in place is refused."""
    grad_of: dict[int, str] = {}
    mutated: dict[int, str] = {}
    plain: list[int] = []
    for i, desc in enumerate(out.meta.get("desc", [])):
        if isinstance(desc, GradAOTOutput) and isinstance(desc.grad_of, ParamAOTInput):
            grad_of[i] = _strip(desc.grad_of.target)
        elif isinstance(desc, PlainAOTOutput):
            plain.append(i)
        elif isinstance(desc, InputMutationAOTOutput):
            if not isinstance(desc.mutated_input, BufferAOTInput):
                raise TraceError(
                    f"{type(model).__name__} changes {desc.mutated_input} in place in its "
                    "forward; autopar plans in-place updates of buffers only (BatchNorm's "
                    "running statistics): update a buffer, or return the new value"
                )
            mutated[i] = _strip(desc.mutated_input.target)
    return grad_of, mutated, plain


def _check_loss(out, plain: list[int]) -> None:
    """The loss (the first plain output of the output node ``out``) must be a scalar tensor."""
    val = out.args[0][plain[0]].meta.get("val") if plain else None
    if not isinstance(val, torch.Tensor) or val.numel() != 1:
        raise TraceError(
            f"loss_fn must return a scalar tensor, got "
            f"{tuple(val.shape) if isinstance(val, torch.Tensor) else type(val).__name__}"
        )


def trace_step(
    model: nn.Module,
    example_inputs,
    *,
    loss_fn=None,
    example_targets=None,
    stack: contextlib.ExitStack,
    meta_device: str = "cpu",
    mp_policy: MixedPrecision | None = None,
) -> StepGraph:
    """Trace ``loss_fn(model(*example_inputs), *example_targets)`` into a joint graph
    (meta tensors as fake tensors on ``meta_device``), under ``mp_policy``'s casts
    (core/precision.py) when given."""
    inputs, targets = _check_inputs(model, example_inputs, loss_fn, example_targets)
    alias_of = _tied_names(model)
    if any(t.is_meta for t in list(model.parameters()) + list(inputs + targets)):
        model, inputs, targets = _meta_to_fake(model, inputs, targets, meta_device)
    step = _Step(model, loss_fn, len(inputs))
    args = inputs + targets
    t0 = time.perf_counter()
    ep, notes = _export(model, step, args, mp_policy)
    exported = ep.module()
    _constants_as_buffers(exported, ep)
    constants = _step_constants(model, exported)
    joint = _joint(stack, exported, args, model)
    gm = joint.graph_module
    _drop_asserts(gm)
    trace_s = time.perf_counter() - t0

    param_names, buffer_names = _mark_roles(gm, len(inputs))
    out = next(iter(gm.graph.find_nodes(op="output")))
    grad_of, mutated, plain = _read_outputs(out, model)
    if loss_fn is not None:
        _check_loss(out, plain)
    return StepGraph(
        gm=gm,
        joint=joint,
        mp_policy=mp_policy,
        reduce_at=_gradient_casts(gm, out, grad_of, mp_policy),
        param_names=param_names,
        buffer_names=buffer_names,
        n_inputs=len(inputs),
        n_targets=len(targets),
        has_loss=loss_fn is not None,
        n_outputs=len(plain),
        grad_of=grad_of,
        mutated_buffers=mutated,
        notes=notes,
        alias_of=alias_of,
        trace_s=trace_s,
        constants=constants,
    )

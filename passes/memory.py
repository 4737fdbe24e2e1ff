"""Step memory: the bytes one rank holds after every node of the planned step, by category.

Takes: the ``StepGraph`` (passes/trace) and a ``Plan``. Returns: a ``MemoryReport`` with the
peak per rank, the node at the peak, what is live there by category, and the timeline.

The model of the emitted step (codegen runs the joint graph in its traced order, on local
tensors):

    size(v)      = prod(local_shape(shape(v), placement(v), mesh)) * itemsize(v)
                   placement(v): the plan's output placement of v's node (placeholders:
                   their own placement)
    storage(v)   = storage(input 0) if v's op returns a view or writes its input in place
                   (its schema's alias annotation; ``_unsafe_view``; ``getitem`` picks one
                   output of a multi-output node), else a new storage of size(v)
    live(s, i)   = first(s) <= i <= last(s): from the node that makes storage s to the last
                   node that uses any tensor on it (graph outputs: to the end of the step)
    redistribution of input j of node i from p to q != p:
                   a collective buffer of size under q, live at node i only
    bytes(i)     = sum of live(s, i) sizes + collective buffers of node i + optimizer state

Categories: ``parameters`` (parameters and buffers, the whole step; a tied parameter once),
``inputs`` (inputs and targets, the whole step), ``gradients`` (a parameter's gradient, from
its node to the end: the optimizer reads it), ``activations`` (made in the forward, last used
in the backward: saved for it), ``temporaries`` (every other op output, and the tangent),
``collective_buffers``, ``optimizer_state`` (per parameter shard: AdamW two float32 moments,
SGD with momentum one, none zero; constant over the step).

What it leaves out: the allocator's rounding and fragmentation, and kernels' own workspace.
Where it can be off: the emitted step runs aot_autograd's partitioned forward and backward,
whose backward order (and what it saves rather than recomputes) can differ from the joint
graph walked here; benchmarks/memory_check.py measures by how much. Not yet: mixed precision,
and a bound in the ILP (the budget still counts 4 x parameter bytes); this is the report.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch

from autopar.core import Plan, local_shape, parse_placements, roles

from .trace import StepGraph

__all__ = ["CATEGORIES", "MemoryReport", "OPTIMIZERS", "simulate"]

CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer_state",
    "activations",
    "temporaries",
    "collective_buffers",
    "inputs",
)
OPTIMIZERS = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0, "none": 0}
"""Optimizer -> float32 state tensors per parameter element."""


@dataclass
class MemoryReport:
    """Bytes one rank holds over the step (see the module docstring for the model).

    Attributes:
        peak_bytes: the largest total over the step.
        peak_node: the node after which it is reached.
        at_peak: bytes by category at the peak.
        timeline: ``(node name, total bytes)`` after every node, in step order.
        optimizer: the optimizer whose state is counted.
    """

    peak_bytes: int
    peak_node: str
    at_peak: dict[str, int]
    timeline: list[tuple[str, int]] = field(default_factory=list)
    optimizer: str = "adamw"

    def to_dict(self) -> dict:
        return {
            "peak_bytes": self.peak_bytes,
            "peak_node": self.peak_node,
            "at_peak": dict(self.at_peak),
            "optimizer": self.optimizer,
        }


def _is_alias(target) -> bool:
    """The op returns (a view of) its first input: no new storage."""
    if target is torch.ops.aten._unsafe_view.default:  # a view, though its schema says not
        return True
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    return schema.returns[0].alias_info is not None


def _bytes(val, placements, mesh_shape) -> int:
    if not isinstance(val, torch.Tensor):
        return 0
    shape = tuple(val.shape)
    if placements is not None:
        shape = local_shape(shape, placements, mesh_shape)
    return math.prod(shape) * val.element_size()


def simulate(step: StepGraph, plan: Plan, optimizer: str = "adamw") -> MemoryReport:
    """The per-rank memory of ``plan``'s step (see the module docstring)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r}: one of {sorted(OPTIMIZERS)}")
    mesh_shape = tuple(plan.mesh.shape)
    nodes = [n for n in step.gm.graph.nodes if n.op != "output"]
    index = {n: i for i, n in enumerate(nodes)}
    end = len(nodes)
    out_node = step.output_node()
    outs = out_node.args[0]
    if not isinstance(outs, (list, tuple)):
        raise TypeError(f"the step's output node holds {type(outs).__name__}, not a list")
    outputs = list(outs)
    grad_outputs = {outputs[i] for i in step.grad_of if isinstance(outputs[i], torch.fx.Node)}

    # storages: key -> [first index, last index, bytes, category]
    storage_of: dict[tuple, tuple] = {}  # (node, output idx) -> storage key
    storages: dict[tuple, list] = {}

    def out_placement(n, idx):
        if n.op == "placeholder":
            return plan.placements_of(n.name)
        choice = plan.nodes.get(n.name)
        if choice is None or idx >= len(choice.out) or choice.out[idx] is None:
            return None
        return parse_placements(choice.out[idx])

    aliases = set(step.alias_of)
    param_nodes = {}
    for n in step.placeholders():
        role = n.meta[roles.META_ROLE]
        key = (n, 0)
        storage_of[key] = key
        size = _bytes(n.meta["val"], out_placement(n, 0), mesh_shape)
        if role in (roles.PARAM, roles.BUFFER):
            category = "parameters"
        elif role in roles.BATCH_ROLES:
            category = "inputs"
        else:
            category = "temporaries"
        storages[key] = [index[n], index[n], size, category]
        if role == roles.PARAM:
            param_nodes[n] = size
    # a tied parameter's later names are the same tensor: counted once
    for n, name in zip(
        [n for n in step.placeholders() if n.meta[roles.META_ROLE] == roles.PARAM],
        step.param_names,
    ):
        if name in aliases:
            storages[(n, 0)][2] = 0
            param_nodes[n] = 0

    def use(key, i):
        if key in storage_of:  # (a node whose first output is not a tensor has none)
            s = storages[storage_of[key]]
            s[1] = max(s[1], i)

    collective_at: dict[int, int] = {}
    for n in nodes:
        if n.op != "call_function":
            continue
        i = index[n]
        if n.target is operator.getitem:
            src, idx = n.args
            storage_of[(n, 0)] = storage_of.get((src, idx), (src, idx))
            if storage_of[(n, 0)] not in storages:  # an output nobody had picked yet
                val = src.meta["val"][idx]
                storages[storage_of[(n, 0)]] = [
                    index[src],
                    i,
                    _bytes(val, out_placement(src, idx), mesh_shape),
                    "temporaries",
                ]
            use((n, 0), i)
            continue
        choice = plan.nodes.get(n.name)
        inputs = [a for a in n.all_input_nodes]
        for j, a in enumerate(inputs):
            use((a, 0), i)
            if choice is not None and j < len(choice.ins):
                src = out_placement(a, 0)
                dst = parse_placements(choice.ins[j])
                if src is not None and tuple(src) != tuple(dst):
                    collective_at[i] = collective_at.get(i, 0) + _bytes(
                        a.meta.get("val"), dst, mesh_shape
                    )
        val = n.meta.get("val")
        if _is_alias(n.target) and inputs and (inputs[0], 0) in storage_of:
            storage_of[(n, 0)] = storage_of[(inputs[0], 0)]
            continue
        vals = list(val) if isinstance(val, (tuple, list)) else [val]
        role = n.meta.get(roles.META_ROLE)
        for idx, v in enumerate(vals):
            if not isinstance(v, torch.Tensor):
                continue
            key = (n, idx)
            storage_of[key] = key
            category = "temporaries"
            storages[key] = [i, i, _bytes(v, out_placement(n, idx), mesh_shape), category]
            if role == roles.FORWARD:
                storages[key][3] = "forward"  # decided below: activation or temporary

    # graph outputs live to the end; gradients are their own category
    for o in outputs:
        if isinstance(o, torch.fx.Node) and (o, 0) in storage_of:
            s = storages[storage_of[(o, 0)]]
            s[1] = end
            if o in grad_outputs:
                s[3] = "gradients"
    for s in storages.values():
        if s[3] == "forward":
            last = nodes[min(s[1], end - 1)]
            backward = s[1] < end and last.meta.get(roles.META_ROLE) == roles.BACKWARD
            s[3] = "activations" if backward else "temporaries"
        if s[3] in ("parameters", "inputs"):
            s[0], s[1] = 0, end

    state_per_elem = OPTIMIZERS[optimizer] * 4
    opt_bytes = 0
    for n, size in param_nodes.items():
        itemsize = n.meta["val"].element_size()
        opt_bytes += size // itemsize * state_per_elem

    # sweep: +size at first, -size after last
    starts: dict[int, list] = {}
    stops: dict[int, list] = {}
    for s in storages.values():
        starts.setdefault(s[0], []).append(s)
        stops.setdefault(s[1], []).append(s)
    live = dict.fromkeys(CATEGORIES, 0)
    live["optimizer_state"] = opt_bytes
    timeline: list[tuple[str, int]] = []
    peak, peak_node, at_peak = -1, "", dict(live)
    for i, n in enumerate(nodes):
        for s in starts.get(i, ()):
            live[s[3]] += s[2]
        live["collective_buffers"] = collective_at.get(i, 0)
        total = sum(live.values())
        timeline.append((n.name, total))
        if total > peak:
            peak, peak_node, at_peak = total, n.name, dict(live)
        for s in stops.get(i, ()):
            live[s[3]] -= s[2]
    return MemoryReport(
        peak_bytes=peak,
        peak_node=peak_node,
        at_peak=at_peak,
        timeline=timeline,
        optimizer=optimizer,
    )

"""Step memory: the bytes one rank holds after every node of the planned step, by category.

Takes: the ``StrategySpace`` (passes/strategies: the step graph's nodes in order, their
tensors, edges and graph outputs) and a ``Plan``, or any choice of one strategy per node.
Returns: a ``MemoryReport`` with the peak per rank, the node at the peak, what is live there
by category, and the timeline. passes/solve bounds the same quantity in its ILP.

Two parts. ``liveness(space)`` depends on the graph alone, not on the placements: which
storage each tensor lives on, and from which node to which node it is live. ``measure``
sizes those storages under a choice of placements and sweeps over the step. The model of the
emitted step (codegen runs the joint graph in its traced order, on local tensors):

    size(s, P)   = prod(local_shape(shape(s), P(s), mesh)) * itemsize(s)
                   P(s): the placement of the output that made storage s (placeholders:
                   their own placement)
    storage(v)   = storage(input 0) if v's op returns a view or writes its input in place
                   (its schema's alias annotation; ``_unsafe_view``; ``getitem`` picks one
                   output of a multi-output node), else a new storage
    live(s, i)   = first(s) <= i <= last(s): from the node that makes storage s to the last
                   node that uses any tensor on it (graph outputs: to the end of the step)
    redistribution of tensor input j of node i from p to q != p:
                   a collective buffer of size(q), live at node i only
    bytes(i)     = sum_{s live at i} size(s, P) + collective buffers of node i
                   + optimizer state
    bytes(out)   = one more point after the last node, where the step returns: what
                   lives to the end (the outputs, parameters, inputs), plus each output
                   redistributed to the placement it leaves with (a gradient to its
                   parameter's, the loss to Replicate): size under that placement, all of
                   them live at once (codegen redistributes the outputs one after another
                   and returns them together); the collective's own transient buffer is
                   not counted

bytes(i) is linear in the choice of placements (each term depends on one node's output
placement or one edge's pair of placements), which is what lets the ILP bound it.

Categories: ``parameters`` (parameters and buffers, the whole step; a tied parameter once),
``inputs`` (inputs and targets, the whole step), ``gradients`` (a parameter's gradient, from
its node to the end: the optimizer reads it), ``activations`` (made in the forward, last used
in the backward: saved for it), ``temporaries`` (every other op output, and the tangent),
``collective_buffers``, ``optimizer_state`` (per parameter shard: AdamW two float32 moments,
SGD with momentum one, none zero; constant over the step).

What it leaves out: the allocator's rounding and fragmentation, and kernels' own workspace.
Where it can be off: the emitted step runs aot_autograd's partitioned forward and backward
(``default_partition``: it saves what the backward reads, and keeps the joint graph's order
of each part); benchmarks/memory_check.py measures by how much. Mixed precision needs nothing
of its own: the compute copies are ``_to_copy`` outputs of the graph (passes/trace), sized
in their dtype like any other tensor; the optimizer state is float32 per element of the
stored (float32) parameters.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import Replicate

from autopar.core import Plan, StrategySpace, local_shape, parse_placements, roles

__all__ = [
    "CATEGORIES",
    "Liveness",
    "MemoryReport",
    "OPTIMIZERS",
    "Storage",
    "liveness",
    "local_bytes",
    "measure",
    "simulate",
]

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

Placements = tuple
OutPlacement = Callable[[str, int], "Placements | None"]
"""(node, output index) -> the placements of that output (None: whole, on every rank)."""
InPlacement = Callable[[str, int], "Placements | None"]
"""(node, tensor input j) -> the placements node runs input j with (None: as it comes)."""


def local_bytes(shape, dtype: torch.dtype, ps: Placements | None, mesh_shape) -> int:
    """Bytes one rank holds of a tensor of global ``shape`` placed ``ps`` (None: whole)."""
    shape = tuple(shape) if ps is None else local_shape(tuple(shape), ps, mesh_shape)
    return math.prod(shape) * dtype.itemsize


@dataclass(frozen=True, slots=True)
class Storage:
    """One storage of the step: made by output ``out`` of node ``owner``, live from node
    index ``first`` to ``last`` (inclusive), of global ``shape`` and ``dtype``.
    ``counted`` is False for a storage counted elsewhere (a tied parameter's later names)."""

    owner: str
    out: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    first: int
    last: int
    category: str
    counted: bool = True

    def nbytes(self, ps: Placements | None, mesh_shape) -> int:
        """Bytes one rank holds of this storage when its owner's output is placed ``ps``."""
        return local_bytes(self.shape, self.dtype, ps, mesh_shape) if self.counted else 0


@dataclass
class Liveness:
    """The placement-free half of the model (module docstring).

    Attributes:
        order: node names in step order (``bytes(i)`` is after ``order[i]``; point
            ``len(order)`` is the step's return).
        storages: every storage, with its life.
        params: placeholders of the stored parameters (a tied one once): optimizer state.
        space: the strategy space it was read from (its tensors and edges).
    """

    order: list[str]
    storages: list[Storage]
    params: list[str]
    space: StrategySpace

    OUTPUT = "output"
    """The name of the last point, ``len(order)``: where the step returns (``bytes(out)``)."""

    def live_at(self, i: int) -> list[Storage]:
        """The storages live at point ``i`` (``len(order)``: the step's return)."""
        return [s for s in self.storages if s.first <= i <= s.last]

    def point_name(self, i: int) -> str:
        return self.order[i] if i < len(self.order) else self.OUTPUT

    def reshard_inputs(self, i: int) -> list[tuple[int, str, int]]:
        """``(j, producer, output)`` of each tensor input of node ``order[i]``: where a
        collective buffer appears when input j is redistributed."""
        return [(j, src, so) for j, (src, so) in enumerate(self.space.in_sources[self.order[i]])]


@dataclass
class MemoryReport:
    """Bytes one rank holds over the step (see the module docstring for the model).

    Attributes:
        peak_bytes: the largest total over the step.
        peak_node: the node after which it is reached.
        at_peak: bytes by category at the peak.
        timeline: ``(node name, total bytes)`` after every node, in step order.
        by_category: per category, its bytes after every node (aligned with ``timeline``).
        optimizer: the optimizer whose state is counted.
    """

    peak_bytes: int
    peak_node: str
    at_peak: dict[str, int]
    timeline: list[tuple[str, int]] = field(default_factory=list)
    by_category: dict[str, list[int]] = field(default_factory=dict)
    optimizer: str = "adamw"

    @property
    def peak_index(self) -> int:
        return next(i for i, (n, _) in enumerate(self.timeline) if n == self.peak_node)

    def dominant(self) -> str:
        """The category holding the most bytes at the peak."""
        return max(self.at_peak, key=lambda k: self.at_peak[k])

    def to_dict(self, *, timeline: bool = True) -> dict:
        d = {
            "peak_bytes": self.peak_bytes,
            "peak_node": self.peak_node,
            "at_peak": dict(self.at_peak),
            "optimizer": self.optimizer,
        }
        if timeline:
            d["timeline"] = {
                "nodes": [n for n, _ in self.timeline],
                **{c: list(v) for c, v in self.by_category.items()},
            }
        return d


def _is_alias(target) -> bool:
    """The op returns (a view of) its first input: no new storage."""
    if target is torch.ops.aten._unsafe_view.default:  # a view, though its schema says not
        return True
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    return schema.returns[0].alias_info is not None


def liveness(space: StrategySpace) -> Liveness:
    """Every storage of ``space``'s step and its life (module docstring)."""
    order = space.order
    index = {n: i for i, n in enumerate(order)}
    end = len(order)
    # storage key (owner, out) -> [first, last, category]; (node, out) -> its storage key
    life: dict[tuple[str, int], list] = {}
    storage_of: dict[tuple[str, int], tuple[str, int]] = {}
    params: list[str] = []
    for name in order:
        i = index[name]
        role = space.roles[name]
        if space.targets[name] == "placeholder":
            if role in (roles.PARAM, roles.BUFFER):
                category = "parameters"
                if role == roles.PARAM and name not in space.aliases:
                    params.append(name)
            elif role in roles.BATCH_ROLES:
                category = "inputs"
            else:
                category = "temporaries"
            storage_of[(name, 0)] = (name, 0)
            life[(name, 0)] = [i, i, category]
            continue
        ins = space.in_sources[name]
        for key in dict.fromkeys(ins):
            s = storage_of.get(key)
            if s is not None:  # (an output that is not a tensor has no storage)
                life[s][1] = max(life[s][1], i)
        target = space.targets[name]
        shapes = space.shapes[name]
        if ins and (target is operator.getitem or _is_alias(target)) and ins[0] in storage_of:
            storage_of[(name, 0)] = storage_of[ins[0]]
            continue
        for idx, sd in enumerate(shapes):
            if sd is None:
                continue
            storage_of[(name, idx)] = (name, idx)
            life[(name, idx)] = [i, i, "forward" if role == roles.FORWARD else "temporaries"]

    # graph outputs live to the end; gradients are their own category
    for sink in space.sinks:
        s = storage_of.get((sink.src, sink.src_out))
        if s is None:
            continue
        life[s][1] = end
        if sink.like is not None and space.roles[sink.like] == roles.PARAM:
            life[s][2] = "gradients"
    storages = []
    for (owner, out), (first, last, category) in life.items():
        if category == "forward":
            backward = last < end and space.roles[order[last]] == roles.BACKWARD
            category = "activations" if backward else "temporaries"
        if category in ("parameters", "inputs"):
            first, last = 0, end
        shape, dtype = space.tensor(owner, out)
        counted = owner not in space.aliases
        storages.append(Storage(owner, out, tuple(shape), dtype, first, last, category, counted))
    return Liveness(order=list(order), storages=storages, params=params, space=space)


def output_redistributions(lv: Liveness, out_ps: OutPlacement) -> list[tuple]:
    """``(node, output, placement, category)`` of each graph output that leaves the step
    with another placement than it is made with (``bytes(out)``)."""
    space = lv.space
    found = []
    for sink in space.sinks:
        p = out_ps(sink.src, sink.src_out)
        if p is None:
            continue
        q: Placements | None = (
            tuple(Replicate() for _ in p) if sink.like is None else out_ps(sink.like, 0)
        )
        if q is None or tuple(q) == tuple(p):
            continue
        grad = sink.like is not None and space.roles[sink.like] == roles.PARAM
        found.append((sink.src, sink.src_out, q, "gradients" if grad else "temporaries"))
    return found


def optimizer_bytes(storage: Storage, ps: Placements | None, mesh_shape, optimizer: str) -> int:
    """Optimizer state one rank holds for a parameter shard (float32 per element)."""
    return storage.nbytes(ps, mesh_shape) // storage.dtype.itemsize * 4 * OPTIMIZERS[optimizer]


def measure(
    lv: Liveness, out_ps: OutPlacement, in_ps: InPlacement, optimizer: str = "adamw"
) -> MemoryReport:
    """Size ``lv``'s storages under the placements ``out_ps`` / ``in_ps`` and sweep over the
    step (module docstring)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r}: one of {sorted(OPTIMIZERS)}")
    space = lv.space
    mesh_shape = tuple(space.mesh.shape)
    n = len(lv.order) + 1  # the nodes, and the return
    # per category, the change of live bytes at each point: +size at first, -size after last
    delta = {c: [0] * (n + 1) for c in CATEGORIES}
    opt = 0
    param_set = set(lv.params)
    for s in lv.storages:
        size = s.nbytes(out_ps(s.owner, s.out), mesh_shape)
        d = delta[s.category]
        d[s.first] += size
        if s.last + 1 <= n:
            d[s.last + 1] -= size
        if s.owner in param_set:
            opt += optimizer_bytes(s, out_ps(s.owner, s.out), mesh_shape, optimizer)
    for src, so, target, category in output_redistributions(lv, out_ps):
        shape, dtype = space.tensor(src, so)
        delta[category][n - 1] += local_bytes(shape, dtype, target, mesh_shape)
    buffers = delta["collective_buffers"]
    for i, name in enumerate(lv.order):
        if space.targets[name] == "placeholder":
            continue
        for j, src, so in lv.reshard_inputs(i):
            q = in_ps(name, j)
            if q is None:
                continue
            p = out_ps(src, so)
            if p is None or tuple(p) == tuple(q):
                continue
            shape, dtype = space.tensor(src, so)
            size = local_bytes(shape, dtype, q, mesh_shape)
            buffers[i] += size
            buffers[i + 1] -= size
    by_category: dict[str, list[int]] = {}
    for c in CATEGORIES:
        acc, out = 0, []
        for i in range(n):
            acc += delta[c][i]
            out.append(acc)
        by_category[c] = out
    by_category["optimizer_state"] = [opt] * n
    totals = [sum(by_category[c][i] for c in CATEGORIES) for i in range(n)]
    peak_i = max(range(n), key=lambda i: totals[i]) if n else 0
    return MemoryReport(
        peak_bytes=totals[peak_i] if n else 0,
        peak_node=lv.point_name(peak_i) if n else "",
        at_peak={c: by_category[c][peak_i] for c in CATEGORIES} if n else {},
        timeline=list(zip([*lv.order, lv.OUTPUT], totals)),
        by_category=by_category,
        optimizer=optimizer,
    )


def simulate(space: StrategySpace, plan: Plan, optimizer: str = "adamw") -> MemoryReport:
    """The per-rank memory of ``plan``'s step (see the module docstring)."""
    cache: dict = {}

    def parsed(text):
        if text not in cache:
            cache[text] = parse_placements(text)
        return cache[text]

    def out_ps(name: str, idx: int):
        choice = plan.nodes.get(name)
        if choice is None or idx >= len(choice.out) or choice.out[idx] is None:
            return None
        return parsed(choice.out[idx])

    def in_ps(name: str, j: int):
        choice = plan.nodes.get(name)
        if choice is None or j >= len(choice.ins):
            return None
        return parsed(choice.ins[j])

    return measure(liveness(space), out_ps, in_ps, optimizer)

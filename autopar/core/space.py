"""What the solver chooses from, and what it chose: the types between the passes.

``StrategySpace`` (made by passes/strategies, read by passes/solve and ``Plan.from_solution``)
holds for every node of a step graph the ``Strategy`` list it may take, the graph's tensor
``Edge``s, the constraints at its outputs (``Sink``) and the facts a cost model needs.
``Solution`` (made by passes/solve) is one strategy per node with its cost, and the
``Collective``s the choice runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from .mesh import Mesh
from .placements import Placements, is_planned, placement_str

__all__ = [
    "COLLECTIVE_KINDS",
    "Collective",
    "Edge",
    "Recompute",
    "Sink",
    "Solution",
    "Strategy",
    "StrategySpace",
    "TensorInput",
]

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True, slots=True)
class Recompute:
    """One layer's checkpointing (passes/remat).

    Attributes:
        region: the layer (``model.layers.3``).
        group: the fold group's first region (the layer itself when not folded): one
            choice per group.
        nodes: the forward nodes it recomputes (C(R)), in step order.
        before: the backward node their copies run before (before(R)).
        moved: the nodes of ``nodes`` that no longer run in the forward (nothing there
            reads them): they run once, in the backward (moved(R)).
    """

    region: str
    group: str
    nodes: tuple[str, ...]
    before: str
    moved: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {
            "region": self.region,
            "group": self.group,
            "nodes": list(self.nodes),
            "before": self.before,
            "moved": list(self.moved),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Recompute:
        return cls(
            d["region"], d["group"], tuple(d["nodes"]), d["before"], tuple(d.get("moved", ()))
        )


@dataclass(frozen=True, slots=True)
class Strategy:
    """One way to run a node: placements of its outputs and of its tensor inputs.

    ``out[i]`` is a tuple of placements (one per mesh axis) for output ``i`` (``None`` for a
    non-tensor output); ``ins[j]`` the same for the node's ``j``-th tensor input, in the order
    of ``tree_flatten((node.args, node.kwargs))``.
    """

    out: tuple[Placements | None, ...]
    ins: tuple[Placements, ...]

    def __post_init__(self):
        for ps in self.out + self.ins:
            if ps is not None and not all(is_planned(p) for p in ps):
                raise ValueError(f"strategy has a placement autopar does not plan with: {ps}")

    def output(self, idx: int = 0) -> Placements:
        """The placements of tensor output ``idx`` (an error for a non-tensor output)."""
        ps = self.out[idx]
        if ps is None:
            raise ValueError(f"output {idx} of this strategy is not a tensor: {self.text()}")
        return ps

    def text(self) -> str:
        def f(ps):
            return "-" if ps is None else "(" + ",".join(placement_str(p) for p in ps) + ")"

        ins = " ".join(f(p) for p in self.ins)
        outs = " ".join(f(p) for p in self.out)
        return f"{ins} -> {outs}" if ins else outs


@dataclass(frozen=True, slots=True)
class Edge:
    """Output ``src_out`` of node ``src`` feeds tensor input ``dst_in`` of node ``dst``."""

    src: str
    src_out: int
    dst: str
    dst_in: int


@dataclass(frozen=True, slots=True)
class Sink:
    """A graph output: output ``src_out`` of ``src`` must end with a given placement.

    ``like`` names a node whose output-0 placement the sink must match (a parameter for its
    gradient, the first input for a model output); ``like=None`` means ``Replicate`` on
    every axis (the loss). ``position`` is the output's index among the graph's outputs.
    """

    src: str
    src_out: int
    like: str | None
    position: int


@dataclass(frozen=True, slots=True)
class TensorInput:
    """Stands for the ``index``-th tensor input of a node in ``StrategySpace.calls``."""

    index: int


ShapeDtype = tuple[tuple[int, ...], torch.dtype]


@dataclass
class StrategySpace:
    """Everything the solver chooses from.

    Attributes:
        mesh: the mesh planned for.
        order: node names in graph (topological) order, placeholders first.
        strategies: node name -> candidate strategies.
        edges: tensor edges between nodes.
        sinks: constraints at the graph outputs.
        ties: pairs of nodes that must take the same output placement.
        shapes: node name -> per output (global shape, dtype) or None.
        targets: node name -> op (OpOverload or callable) or "placeholder".
        roles / modules: node name -> role and module path (from passes/trace).
        fallbacks: node name -> the warning given for an op without a rule.
        calls: node name -> (args, kwargs) of the op with its ``j``-th tensor input replaced
            by ``TensorInput(j)`` (what a cost model needs to price the op on local shapes).
        aliases: placeholders of tied parameters other than the first (same memory).
        rep: node name -> its representative (passes/fold): the node whose strategy it takes;
            a node missing here represents itself. Instances share their representative's
            strategy list (the same list object).
        params / buffers: original parameter / buffer name -> its placeholder, in graph order.
        inputs: placeholders of the user inputs, then the targets.
        n_outputs: how many outputs the graph returns (tensors or not).
        has_loss: the step returns a scalar loss (else the model outputs).
        notes: what the trace left for the user to know (they reach ``plan.warnings``).
        reduce_at: gradient cast of a mixed-precision step -> where its gradient is reduced
            across ranks: ``"after"`` (no reduction on its input edge) or ``"before"`` (its
            input arrives reduced: no Partial placement into it). passes/trace.
        regions: node name -> its layer (passes/fold's region, ``model.layers.3``); nodes
            outside every layer are missing.
        region_groups: layer -> the first layer of its fold group (a layer missing here is
            its own group): passes/remat checkpoints a group's layers alike.
        layouts: (node, output) -> the order its dims lie in memory, outermost first, where
            that is not their own order (a transposed weight); passes/memory sizes a
            redistribution's buffers by it.
    """

    mesh: Mesh
    order: list[str]
    strategies: dict[str, list[Strategy]]
    edges: list[Edge]
    sinks: list[Sink]
    ties: list[tuple[str, str]] = field(default_factory=list)
    shapes: dict[str, list[ShapeDtype | None]] = field(default_factory=dict)
    targets: dict[str, object] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    modules: dict[str, str] = field(default_factory=dict)
    fallbacks: dict[str, str] = field(default_factory=dict)
    calls: dict[str, tuple] = field(default_factory=dict)
    aliases: set[str] = field(default_factory=set)
    rep: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    buffers: dict[str, str] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    n_outputs: int = 0
    has_loss: bool = True
    notes: list[str] = field(default_factory=list)
    reduce_at: dict[str, str] = field(default_factory=dict)
    regions: dict[str, str] = field(default_factory=dict)
    region_groups: dict[str, str] = field(default_factory=dict)
    layouts: dict[tuple[str, int], tuple[int, ...]] = field(default_factory=dict)
    derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """What the passes derive from the step's graph alone (its nodes, targets, edges and
    shapes, which nothing changes once the space is built; pins narrow only the strategy
    lists), made once per space and kept here by name: passes/remat's storage map,
    passes/order's dependencies and storage graph (with the fx graph they were read from),
    and the units of the last plan it ordered (with the nodes that were neutral in it). A
    space made by ``dataclasses.replace`` starts without any."""

    @functools.cached_property
    def in_sources(self) -> dict[str, list[tuple[str, int]]]:
        """Node name -> (producer, output index) of each of its tensor inputs, in order."""
        ins: dict[str, list] = {n: [] for n in self.order}
        for e in self.edges:
            ins[e.dst].append((e.dst_in, e.src, e.src_out))
        return {n: [(src, so) for _, src, so in sorted(v)] for n, v in ins.items()}

    @functools.cached_property
    def position(self) -> dict[str, int]:
        """Node name -> its index in ``order`` (the traced order)."""
        return {n: i for i, n in enumerate(self.order)}

    def n_strategies(self) -> int:
        return sum(len(s) for s in self.strategies.values())

    def tensor(self, name: str, idx: int = 0) -> ShapeDtype:
        """(global shape, dtype) of output ``idx`` of node ``name`` (an error if no tensor)."""
        sd = self.shapes[name][idx]
        if sd is None:
            raise ValueError(f"output {idx} of node {name} is not a tensor")
        return sd


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective on one mesh axis.

    Attributes:
        kind: one of ``COLLECTIVE_KINDS``.
        axis: the mesh axis it runs over.
        nbytes: for all_gather / reduce_scatter / all_reduce, the bytes of the tensor unsharded
            along ``axis`` (the gathered output, the scattered input); for all_to_all, the
            bytes of one rank's local buffer.
        group_size: ranks in the group (the size of ``axis``).
    """

    kind: str
    axis: int
    nbytes: int
    group_size: int

    def __post_init__(self):
        if self.kind not in COLLECTIVE_KINDS:
            raise ValueError(
                f"unknown collective kind {self.kind!r}; use one of {COLLECTIVE_KINDS}"
            )
        if self.axis < 0 or self.nbytes < 0 or self.group_size < 1:
            raise ValueError(
                f"Collective needs axis >= 0, nbytes >= 0, group_size >= 1; got {self}"
            )


@dataclass
class Solution:
    """The chosen strategy per node and what it costs.

    Attributes:
        choice: node name -> index into ``space.strategies[node]``.
        objective_s: the ILP objective (seconds of one step, compute + communication).
        compute_s / comm_s: its two parts.
        collectives: (edge text, Collective, seconds) for every collective the plan runs.
        node_cost_s: node name -> its compute time under the chosen strategy.
        stats: solver statistics (problem size, status, seconds per phase).
        warnings: what the user should know of the solve (a time limit reached).
        recompute: the layers checkpointed (passes/remat); their time is in
            ``compute_s`` and ``comm_s``.
        runtime_s: the host's fixed time per step outside the graph's nodes
            (``DeviceProfile.step_overhead`` and ``param_overhead``) on a profile of one
            clock (the CPU); in ``objective_s``.
        host_s: where the host runs ahead of the device on its own clock
            (``DeviceProfile.host_clock``), node name -> the host's seconds to issue it
            (the nodes that cost any); ``host_start_s`` and ``host_end_s`` the runtime's
            host time before the first node and after the last (core/schedule).
            ``objective_s`` is then at least the host's whole time.
        memory_budget: the step memory per rank, in bytes, the solve bounded the step by
            (None: unbounded).
        peak_bytes: the peak per rank of the step the solver measured (passes/memory: the
            traced order, every gradient reduced at the graph's end, nothing prefetched);
            None where it measured none.
        status: ``optimal``, or ``time_limit`` where the solver stopped at its time limit
            ("" before the solution is read back with its status).
    """

    choice: dict[str, int]
    objective_s: float
    compute_s: float
    comm_s: float
    collectives: list[tuple[str, Collective, float]] = field(default_factory=list)
    node_cost_s: dict[str, float] = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    recompute: list[Recompute] = field(default_factory=list)
    runtime_s: float = 0.0
    host_s: dict[str, float] = field(default_factory=dict)
    host_start_s: float = 0.0
    host_end_s: float = 0.0
    memory_budget: float | None = None
    peak_bytes: int | None = None
    status: str = ""

    def chosen(self, space: StrategySpace, name: str) -> Strategy:
        """The strategy node ``name`` takes."""
        return space.strategies[name][self.choice[name]]

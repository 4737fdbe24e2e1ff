"""``Plan``: what the planner chose, serializable, deterministic and readable.

``Plan.from_solution(space, solution, ...)`` builds it from the solver's result. A plan names, for every node of the traced step graph (by its stable fx name), the strategy
it takes: the placements of its outputs and of its tensor inputs on every mesh axis, as short
text (``S(0)``, ``R``, ``P(sum)``). It also records the collectives the plan runs per step,
the cost breakdown, and statistics of the planning run.

``to_json()`` leaves out the wall-clock timings (``stats`` keys ending in ``_s``): they belong
to a run, not to the plan, and the same model, inputs and mesh must give the same JSON byte
for byte. ``to_json(timings=True)`` keeps them; ``from_json`` reads either, and
``Plan.from_json(p.to_json(timings=True)) == p``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .mesh import Mesh
from .placements import parse_placements, placement_str
from .planned import PlannedCollective
from .roles import op_name
from .schedule import COMPUTE, inside_op, schedule, schedule_length
from .space import Recompute, Solution, StrategySpace
from .version import __version__

__all__ = [
    "LAYER_INDEX",
    "NodeChoice",
    "PLAN_FORMAT",
    "Plan",
    "PlannedCollective",
    "STATS_ORDER",
    "comm_by_kind",
    "index_ranges",
    "name_pattern",
]

PLAN_FORMAT = 1

STATS_ORDER = (
    "solver",
    "status",
    "nodes",
    "solver_nodes",
    "merged_nodes",
    "strategies",
    "edge_variables",
    "variables",
    "constraints",
    "param_shapes",
    "fold",
    "fold_regions",
    "folded_nodes",
    "fold_groups",
)
"""The order of ``Plan.stats`` keys in the JSON (the rest follow in the order given)."""


LAYER_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")
"""A layer index in a dotted name: ``blocks.3.attn`` -> ``3``."""


def name_pattern(names: list[str]) -> str:
    """One name for ``names`` that differ only in their layer indices:
    ``[blocks.0.q, blocks.1.q]`` -> ``blocks.{0..1}.q``."""
    if len(names) == 1:
        return names[0]
    out = LAYER_INDEX.sub("#", names[0])
    for vals in zip(*([int(i) for i in LAYER_INDEX.findall(n)] for n in names)):
        part = str(vals[0]) if len(set(vals)) == 1 else "{" + index_ranges(list(set(vals))) + "}"
        out = out.replace("#", part, 1)
    return out


def index_ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0..2,5``."""
    out, start, prev = [], None, None
    for i in sorted(indices) + [None]:
        if start is None:
            start = prev = i
            continue
        if i is not None and prev is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}..{prev}")
        start = prev = i
    return ",".join(out)


_EDGE = re.compile(r"^(\S+)->(\S+)(?: \(as (\S+)\))?")


def _collective_site(
    label: str, modules: dict[str, str], param_of: dict[str, str]
) -> tuple[str | None, str | None]:
    """Where a collective runs, in the model's terms, as ``(module, param)``: the module path
    of the node it feeds (a reshard), or the parameter whose gradient it reduces; the
    other None."""
    m = _EDGE.match(label)
    if m is None:
        return None, None
    dst, like = m[2], m[3]
    if dst.startswith("output["):
        return (None, param_of[like]) if like in param_of else ("(step output)", None)
    return modules.get(dst, ""), None


@dataclass(frozen=True, slots=True)
class NodeChoice:
    """The strategy chosen for one node.

    Attributes:
        op: the op's name (``aten.mm.default``) or ``placeholder``.
        module: module path of the original model the node came from ("" at top level).
        role: ``param``/``buffer``/``input``/``target``/``tangent``/``forward``/``backward``.
        out: per output, the placement text per mesh axis (None for a non-tensor output).
        ins: per tensor input, the placement text per mesh axis.
        cost_s: the node's compute time under this strategy (seconds): where the host
            runs ahead of the device (``DeviceProfile.host_clock``), the device's alone.
        host_s: there, the host's seconds to issue the node (core/schedule's host clock);
            0 on a profile of one clock.
    """

    op: str
    module: str
    role: str
    out: tuple[tuple[str, ...] | None, ...]
    ins: tuple[tuple[str, ...], ...]
    cost_s: float
    host_s: float = 0.0

    def placement(self, idx: int = 0) -> tuple[str, ...]:
        """The placement texts of tensor output ``idx``, one per mesh axis."""
        ps = self.out[idx]
        if ps is None:
            raise ValueError(f"output {idx} of this {self.op} node is not a tensor")
        return ps

    def to_dict(self) -> dict:
        return {
            "op": self.op,
            "module": self.module,
            "role": self.role,
            "out": [None if o is None else list(o) for o in self.out],
            "ins": [list(i) for i in self.ins],
            "cost_s": self.cost_s,
            **({"host_s": self.host_s} if self.host_s else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> NodeChoice:
        return cls(
            op=d["op"],
            module=d["module"],
            role=d["role"],
            out=tuple(None if o is None else tuple(o) for o in d["out"]),
            ins=tuple(tuple(i) for i in d["ins"]),
            cost_s=d["cost_s"],
            host_s=d.get("host_s", 0.0),
        )


def _nodes_and_collectives(
    space: StrategySpace, solution: Solution, base: tuple[Solution, Plan] | None = None
) -> tuple[dict[str, NodeChoice], tuple[PlannedCollective, ...]]:
    """``Plan.from_solution``'s nodes and collectives of ``solution``; ``base``: another
    solution over ``space`` and its plan, whose node choices are taken where the node's
    strategy, cost and host time are the same."""
    mesh = space.mesh

    def text(ps):
        return None if ps is None else tuple(placement_str(p) for p in ps)

    # a fold group's instances share their strategy objects (passes/fold), and many
    # nodes one op: each text made once (a 96-layer step has ~18,000 nodes)
    texts: dict[int, tuple] = {}
    ops: dict[object, str] = {}
    nodes = {}
    host_s = solution.host_s
    names: Sequence[str] = space.order
    if base is not None:
        # (an overlap round's plan differs from the first's in 1-2% of a deep step's nodes)
        was, plan = base
        choice, cost = solution.choice, solution.node_cost_s
        was_choice, was_cost, was_host = was.choice, was.node_cost_s, was.host_s
        nodes = dict(plan.nodes)  # (in space.order: the changed are replaced in place)
        names = [
            n
            for n in space.order
            if choice[n] != was_choice.get(n)
            or cost[n] != was_cost.get(n)
            or host_s.get(n, 0.0) != was_host.get(n, 0.0)
        ]
    # (each read once into a local: ~18,000 nodes in the first round's plan)
    strategies, chosen, targets = space.strategies, solution.choice, space.targets
    modules, node_roles, node_cost_s = space.modules, space.roles, solution.node_cost_s
    for name in names:
        s = strategies[name][chosen[name]]  # (solution.chosen)
        made = texts.get(id(s))
        if made is None:
            made = texts[id(s)] = (
                tuple(text(o) for o in s.out),
                tuple(text(i) for i in s.ins),
            )
        target = targets[name]
        op = ops.get(target)
        if op is None:
            op = ops[target] = op_name(target)
        # (by position: ~18,000 per plan, each made again by every overlap round's)
        nodes[name] = NodeChoice(
            op,
            modules[name],
            node_roles[name],
            made[0],
            made[1],
            node_cost_s[name],
            host_s.get(name, 0.0),
        )
    collectives = []
    param_of = {node: name for name, node in space.params.items()}
    # each edge's site read once per space (the overlap rounds' plans share most edges)
    sites: dict[str, tuple] = space.derived.setdefault("collective_sites", {})
    axis_names = mesh.axis_names
    for label, c, t in solution.collectives:
        site = sites.get(label)
        if site is None:
            site = sites[label] = _collective_site(label, space.modules, param_of)
        collectives.append(
            PlannedCollective(
                label,
                c.kind,
                axis_names[c.axis],
                int(c.nbytes),
                int(c.group_size),
                t,
                module=site[0],
                param=site[1],
            )
        )
    return nodes, tuple(collectives)


def comm_by_kind(collectives: Sequence[PlannedCollective]) -> dict[str, float]:
    """The seconds of a plan's collectives by kind, an op's own left out (in its node's
    cost, ``compute_s``), the kinds in the order they come."""
    by_kind: dict[str, float] = {}
    for c in collectives:
        if not inside_op(c.edge):
            by_kind[c.kind] = by_kind.get(c.kind, 0.0) + c.time_s
    return by_kind


@dataclass(frozen=True)
class Plan:
    """A sharding plan for one training step on one mesh.

    Attributes:
        fingerprint: hash of the traced step graph the plan was made for.
        mesh: the mesh planned for.
        nodes: node name -> ``NodeChoice``, in graph order.
        params: original parameter name -> its placeholder node name.
        buffers: original buffer name -> its placeholder node name.
        inputs: placeholder node names of the user inputs, then the targets.
        has_loss: the step returns a loss (else the model outputs).
        outputs: per graph output (loss or model outputs, then gradients), the placement
            it leaves the step with (None for a non-tensor output).
        fallback_nodes: nodes replicated because their op has no sharding rule.
        collectives: the collectives one step runs, predicted: ``PlannedCollective``
            records (core/planned), each with its ``edge`` (the graph edge:
            ``producer->consumer`` node names), ``module`` (the module path of the
            consumer) or ``param`` (a gradient reduction: the parameter's name), ``kind``,
            ``axis`` (name), ``nbytes``, ``group_size`` and ``time_s``; a bucket of
            gradient reductions (passes/buckets: all-reduces, or reduce-scatters into
            sharded parameters) is one entry per step with ``bucket`` (its index),
            ``params``, ``dtype``, ``op``, ``overlap`` and, where it is waited for where
            the next is issued, ``wait_after``. A reshard issued ahead of its consumer
            (passes/prefetch) has ``issue_after``: the node after which it is issued.
        cost: ``compute_s`` (every node's ``cost_s``, with the collectives an op runs
            inside itself: edges ``n->n``), ``comm_s`` (every other collective of the
            step, nothing hidden), ``total_s``, ``objective_s`` and ``comm_by_kind_s``
            (``comm_s`` by kind). ``total_s`` is the
            emitted step simulated (``emitted_step_s``: its buckets and prefetches as
            codegen emits them, in the plan's order); ``objective_s`` is the solver's
            objective. Where the profile prices the host's fixed time per step (a
            calibrated CPU), it is ``runtime_s``, in both. Where the host runs ahead of
            the device on its own clock (a calibrated GPU), ``host_start_s`` and
            ``host_end_s`` are the runtime's host time before the first node and after
            the last (each node's own is its ``host_s``; core/schedule).
        memory: ``param_bytes_per_rank`` and ``param_bytes_total``; ``step``: the step
            memory per rank (passes/memory: ``peak_bytes``, ``peak_node``, ``at_peak`` by
            category, ``optimizer``, and ``timeline``: ``nodes`` in step order and, per
            category, the bytes after each). The budget it was bounded by is
            ``memory_budget``.
        warnings: ops replicated for lack of a rule, and similar notes.
        recompute: the layers whose activations the step recomputes in the backward
            (activation checkpointing, passes/remat).
        order: every node of the step in the order it runs, when passes/order chose
            another than the traced one for its peak memory (empty: the traced order).
        stats: planning statistics, telemetry that no stage reads: problem size, solver
            status, and timings (``trace_s``, ``search_s`` and per stage ``*_s``). The
            typed fields below are written there too (``memory_budget``, ``peak_bytes``,
            ``overlaps_collectives``, ``status``, ``fold``, ``source``), and
            ``from_dict`` reads them back from there.
        versions: versions of autopar and torch that made the plan.
        memory_budget: the step memory per rank, in bytes, the solver bounded the step
            by (None: unbounded).
        solver_peak_bytes: the solver's own measurement of its step's peak per rank (the
            traced order, every gradient reduced at the graph's end, nothing prefetched;
            passes/solve), which bounds what passes/buckets and passes/prefetch measure;
            None where the solver did not measure it.
        overlaps_collectives: whether the step's collectives run beside its compute and
            beside each other's axes (passes/buckets sets it from the profile: CUDA);
            core/schedule simulates the streams by it.
        solver_status: ``optimal``, or ``time_limit`` where the solver stopped at its
            time limit ("" where not recorded).
        folded: whether the repeated layers were planned as one (passes/fold ran; False:
            ``fold=False``); ``stats["fold"]``.
        source: how ``autopar plan`` made it (``model``, ``batch``, ``precision`` and the
            planning options given; ``stats["source"]``): what ``autopar explain`` plans
            its alternatives from. Empty for a plan not made by the CLI.
    """

    fingerprint: str
    mesh: Mesh
    nodes: dict[str, NodeChoice]
    params: dict[str, str]
    buffers: dict[str, str]
    inputs: tuple[str, ...]
    has_loss: bool
    outputs: tuple[tuple[str, ...] | None, ...] = ()
    fallback_nodes: tuple[str, ...] = ()
    collectives: tuple[PlannedCollective, ...] = ()
    cost: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    stats: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    recompute: tuple[Recompute, ...] = ()
    order: tuple[str, ...] = ()
    memory_budget: float | None = None
    solver_peak_bytes: int | None = None
    overlaps_collectives: bool = False
    solver_status: str = ""
    folded: bool = True
    source: dict = field(default_factory=dict)

    # -- construction --------------------------------------------------------------------

    @classmethod
    def from_solution(
        cls,
        space: StrategySpace,
        solution: Solution,
        *,
        fingerprint: str,
        stats: dict,
        like: Plan | None = None,
        base: tuple[Solution, Plan] | None = None,
    ) -> Plan:
        """The plan of ``solution`` (passes/solve) over ``space`` (passes/strategies).

        ``stats``: what the pass runner recorded (stage times and sizes); the solver's own
        statistics are added, and the keys ordered by ``STATS_ORDER``. ``like``: a plan made
        of a solution with the same choice, node costs and collectives (the overlap round
        kept, passes/pipeline): its nodes and collectives are taken, not made again (each
        linear in the step's nodes). ``base``: another solution over ``space`` and its
        plan (an earlier overlap round's): the node choices it shares are taken.
        """
        mesh = space.mesh
        if like is not None:
            nodes, collectives = like.nodes, like.collectives
        else:
            nodes, collectives = _nodes_and_collectives(space, solution, base)
        outputs: list = [None] * space.n_outputs
        replicated = ("R",) * mesh.ndim
        for sink in space.sinks:
            outputs[sink.position] = (
                replicated if sink.like is None else nodes[sink.like].placement()
            )

        per_rank = total = 0
        for node in space.params.values():
            if node in space.aliases:
                continue  # a tied parameter is stored once
            shape, dtype = space.tensor(node)
            nbytes = math.prod(shape) * dtype.itemsize
            shards = math.prod(
                size for size, p in zip(mesh.shape, nodes[node].placement()) if p.startswith("S")
            )
            total += nbytes
            per_rank += nbytes // shards
        merged = {
            **solution.stats,
            **stats,
            "param_shapes": {
                name: list(space.tensor(node)[0]) for name, node in space.params.items()
            },
        }
        ordered = {k: merged[k] for k in STATS_ORDER if k in merged}
        ordered.update((k, v) for k, v in merged.items() if k not in ordered)
        return cls(
            fingerprint=fingerprint,
            mesh=mesh,
            nodes=nodes,
            params=dict(space.params),
            buffers=dict(space.buffers),
            inputs=tuple(space.inputs),
            has_loss=space.has_loss,
            outputs=tuple(outputs),
            fallback_nodes=tuple(sorted(space.fallbacks)),
            collectives=collectives,
            cost={
                "compute_s": solution.compute_s,
                "comm_s": solution.comm_s,
                "total_s": solution.objective_s,
                "comm_by_kind_s": dict(sorted(comm_by_kind(collectives).items())),
                # the host's fixed time per step, where the profile has one (the CPU's)
                **({"runtime_s": solution.runtime_s} if solution.runtime_s else {}),
                # the runtime's host time before the first node and after the last, where
                # the host runs on its own clock (a GPU's; core/schedule)
                **(
                    {"host_start_s": solution.host_start_s, "host_end_s": solution.host_end_s}
                    if solution.host_s
                    else {}
                ),
            },
            memory={"param_bytes_per_rank": int(per_rank), "param_bytes_total": int(total)},
            warnings=tuple(solution.warnings)
            + tuple(space.notes)
            + tuple(space.fallbacks[n] for n in sorted(space.fallbacks)),
            stats=ordered,
            versions={"autopar": __version__, "torch": torch.__version__.split("+")[0]},
            recompute=tuple(solution.recompute),
            memory_budget=solution.memory_budget,
            solver_peak_bytes=solution.peak_bytes,
            solver_status=solution.status,
            folded=bool(merged.get("fold", True)),
        )

    # -- views ---------------------------------------------------------------------------

    def placements_of(self, node: str) -> tuple:
        """Torch placements (one per mesh axis) of output 0 of ``node``."""
        return parse_placements(self.nodes[node].placement())

    @property
    def param_placements(self) -> dict[str, tuple]:
        """``{parameter name: tuple of torch placements, one per mesh axis}``."""
        return {name: self.placements_of(node) for name, node in self.params.items()}

    @property
    def buffer_placements(self) -> dict[str, tuple]:
        """``{buffer name: tuple of torch placements, one per mesh axis}``."""
        return {name: self.placements_of(node) for name, node in self.buffers.items()}

    @property
    def input_placements(self) -> list[tuple]:
        """Placements of each user input, then each target, one tuple per tensor."""
        return [self.placements_of(n) for n in self.inputs]

    @property
    def output_placements(self) -> tuple[tuple[str, ...] | None, ...]:
        return self.outputs

    def collective_counts(self) -> dict[tuple[str, str], int]:
        """``{(kind, axis name): how many per step}`` of the predicted collectives."""
        counts: dict[tuple[str, str], int] = {}
        for c in self.collectives:
            key = (c.kind, c.axis)
            counts[key] = counts.get(key, 0) + 1
        return dict(sorted(counts.items()))

    def emitted_step_s(self) -> float:
        """The predicted time of the step codegen emits: one rank's compute and
        communication streams simulated (``core.schedule``), every collective waited for
        where it is issued, except, where the profile overlaps collectives, the gradient
        buckets (passes/buckets), which overlap the rest of the backward, and the reshards
        issued ahead of their consumers (passes/prefetch)."""
        return schedule_length(self)

    def host_s(self) -> float:
        """Where the host runs ahead of the device on its own clock (core/schedule): the
        host's time to issue the step, the runtime's before the first node and after the
        last, and every point's call (a recomputed copy's too); 0 on a profile of one
        clock."""
        if "host_start_s" not in self.cost:
            return 0.0
        calls = sum(
            self.nodes[s.name.removeprefix("recompute:")].host_s
            for s in schedule(self)
            if s.stream == COMPUTE
        )
        return self.cost["host_start_s"] + calls + self.cost["host_end_s"]

    def _host_lines(self) -> list[str]:
        host = self.host_s()
        if not host:
            return []
        runtime = self.cost["host_start_s"] + self.cost["host_end_s"]
        total = self.cost.get("total_s", 0.0)
        whose = "the host's: the device waits for it" if host >= total * 0.99 else "the device's"
        return [
            f"the host, apart from the device: {host * 1e3:.4f} ms to issue the step (the "
            f"runtime {runtime * 1e3:.4f} ms, each node's call the rest); the step is {whose}"
        ]

    def collective_bytes(self) -> dict[tuple[str, str], int]:
        """``{(kind, axis name): bytes per step}`` of the predicted collectives, each counted
        as the cost model prices it (cost_models/comm: the gathered tensor of an all-gather,
        the input of a reduce-scatter, the tensor of an all-reduce, one rank's buffer of an
        all-to-all)."""
        total: dict[tuple[str, str], int] = {}
        for c in self.collectives:
            key = (c.kind, c.axis)
            total[key] = total.get(key, 0) + int(c.nbytes)
        return dict(sorted(total.items()))

    def _step_memory_lines(self) -> list[str]:
        step = self.memory.get("step")
        if not step:
            return []
        parts = ", ".join(
            f"{k.replace('_', ' ')} {v / 2**20:.2f}" for k, v in step["at_peak"].items() if v
        )
        budget = self.memory_budget
        of = "" if budget is None else f" of a {budget / 2**20:.2f} MiB budget"
        lines = [
            f"step memory peak per rank: {step['peak_bytes'] / 2**20:.2f} MiB{of} at "
            f"{step['peak_node']} ({step['optimizer']}; MiB: {parts})"
        ]
        traced = self.stats.get("traced_peak_bytes")
        if traced:
            moved = self.stats.get("order_moved", 0)
            least = ""
            if self.stats.get("order_optimal"):
                least = "; no order is lower"
            elif self.stats.get("order_traced_bytes"):
                bound = self.stats["order_bound_bytes"] / self.stats["order_traced_bytes"]
                least = f"; any order's peak over the nodes >= {bound:.0%} of the traced one's"
            lines.append(
                f"operator order: peak {step['peak_bytes'] / 2**20:.2f} MiB, traced order "
                f"{traced / 2**20:.2f} MiB ({step['peak_bytes'] / traced - 1:+.1%}; "
                f"{moved} nodes moved{least})"
            )
        if step.get("arena_bytes"):
            lines.append(
                f"layout: every tensor at an offset of one arena of "
                f"{step['arena_bytes'] / 2**20:.2f} MiB per rank "
                f"({step['arena_bytes'] / step['peak_bytes'] - 1:+.1%} over the peak)"
            )
        return lines

    def checkpointing_text(self) -> str:
        """The layers checkpointed, their indices as ranges: ``model.layers.{0..31}``."""
        by_prefix: dict[str, list[int]] = {}
        for r in self.recompute:
            prefix, _, idx = r.region.rpartition(".")
            by_prefix.setdefault(prefix, []).append(int(idx) if idx.isdigit() else -1)
        return ", ".join(f"{p}.{{{index_ranges(ix)}}}" for p, ix in by_prefix.items())

    def _checkpointing_lines(self) -> list[str]:
        if not self.recompute:
            return []
        extra = self.stats.get("recompute_s", 0.0) * 1e3
        return [
            f"activation checkpointing: {len(self.recompute)} layers recompute their "
            f"activations in the backward ({self.checkpointing_text()}; +{extra:.4f} ms)"
        ]

    def summary(self) -> str:
        """A readable table: parameters and their placements, the step's costs, the
        collectives per step, and the planning statistics."""
        axes = self.mesh.axis_names
        lines = [f"autopar plan for {self.mesh} (graph {self.fingerprint})", ""]
        width = max([len(n) for n in self.params] + [9])
        head = f"{'parameter':<{width}}  {'shape':<14}" + "".join(f"  {a:<6}" for a in axes)
        lines += [head, "-" * len(head)]
        shapes = self.stats.get("param_shapes", {})
        for name, node in self.params.items():
            ps = self.nodes[node].placement()
            shape = "x".join(str(s) for s in shapes.get(name, ())) or "?"
            lines.append(f"{name:<{width}}  {shape:<14}" + "".join(f"  {p:<6}" for p in ps))
        lines.append("")
        for i, node in enumerate(self.inputs):
            ps = self.nodes[node].placement()
            lines.append(f"input {i}: " + ", ".join(f"{a}={p}" for a, p in zip(axes, ps)))
        c = self.cost
        precision = self.stats.get("mixed_precision")
        lines += [
            "",
            *([f"mixed precision: {precision}"] if precision else []),
            f"estimated step time: {c.get('total_s', 0) * 1e3:.4f} ms "
            f"(compute {c.get('compute_s', 0) * 1e3:.4f} ms, "
            f"communication {c.get('comm_s', 0) * 1e3:.4f} ms)",
            *self._host_lines(),
            f"the step as emitted, simulated: {self.emitted_step_s() * 1e3:.4f} ms "
            "(gradient buckets beside the backward where the device overlaps them; every "
            "other collective waited for)",
            *(
                [
                    f"the solver's objective: {c['objective_s'] * 1e3:.4f} ms (gradient "
                    "buckets hidden behind the backward up to its length)"
                ]
                if "objective_s" in c
                else []
            ),  # fmt: skip
            f"parameter memory per rank: {self.memory.get('param_bytes_per_rank', 0) / 2**20:.2f} MiB"
            f" of {self.memory.get('param_bytes_total', 0) / 2**20:.2f} MiB",
            *self._step_memory_lines(),
            *self._checkpointing_lines(),
            "collectives per step: "
            + (
                ", ".join(f"{k}@{a} x{n}" for (k, a), n in self.collective_counts().items())
                or "none"
            ),
        ]
        st = self.stats
        lines.append(
            f"problem: {st.get('nodes', '?')} nodes, {st.get('strategies', '?')} strategies, "
            f"{st.get('variables', '?')} variables, {st.get('constraints', '?')} constraints; "
            f"solver {st.get('solver', '?')} {self.solver_status or '?'}"
        )
        if st.get("fold"):
            groups = st.get("fold_groups", [])
            lines.append(
                f"folded: {st.get('solver_nodes', '?')} of {st.get('nodes', '?')} nodes solved; "
                + (
                    "; ".join(
                        f"{g['instances']} x {g['nodes']} nodes {g['regions']}" for g in groups
                    )
                    or "no repeated regions"
                )
            )
        if "trace_s" in st:
            lines.append(
                f"time: trace {st['trace_s']:.2f} s, search {st.get('search_s', 0):.2f} s "
                f"(fold {st.get('fold_s', 0):.2f}, strategies {st.get('strategies_s', 0):.2f}, "
                f"solve {st.get('solve_s', 0):.2f}: costs {st.get('cost_s', 0):.2f}, "
                f"ILP build {st.get('build_s', 0):.2f}, ILP solve {st.get('ilp_s', 0):.2f})"
            )
        if "cache_s" in st:
            lines.append(
                f"read from the plan cache in {st['cache_s']:.3f} s (the times above are "
                "those of the run that made it)"
            )
        for w in self.warnings:
            lines.append(f"warning: {w}")
        return "\n".join(lines)

    # -- serialization -------------------------------------------------------------------

    def to_dict(self, *, timings: bool = False) -> dict:
        stats = {k: v for k, v in self.stats.items() if timings or not k.endswith("_s")}
        return {
            "format": PLAN_FORMAT,
            "fingerprint": self.fingerprint,
            "mesh": self.mesh.to_dict(),
            "nodes": {k: v.to_dict() for k, v in self.nodes.items()},
            "params": dict(self.params),
            "buffers": dict(self.buffers),
            "inputs": list(self.inputs),
            "has_loss": self.has_loss,
            "outputs": [None if o is None else list(o) for o in self.outputs],
            "fallback_nodes": list(self.fallback_nodes),
            "collectives": [c.to_dict() for c in self.collectives],
            "cost": dict(self.cost),
            "memory": dict(self.memory),
            "warnings": list(self.warnings),
            "recompute": [r.to_dict() for r in self.recompute],
            "order": list(self.order),
            "stats": stats,
            "versions": dict(self.versions),
        }

    def to_json(self, *, timings: bool = False) -> str:
        """The plan as JSON text: one line per node, per collective and per parameter,
        so that a plan reads (and diffs) line by line (``_lines``)."""
        return "\n".join(_lines(self.to_dict(timings=timings), 0)) + "\n"

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        if d.get("format") != PLAN_FORMAT:
            raise ValueError(
                f"plan format {d.get('format')!r} is not {PLAN_FORMAT}: re-plan with this autopar"
            )
        stats = d["stats"]
        return cls(
            fingerprint=d["fingerprint"],
            mesh=Mesh.from_dict(d["mesh"]),
            nodes={k: NodeChoice.from_dict(v) for k, v in d["nodes"].items()},
            params=dict(d["params"]),
            buffers=dict(d["buffers"]),
            inputs=tuple(d["inputs"]),
            has_loss=d["has_loss"],
            outputs=tuple(None if o is None else tuple(o) for o in d["outputs"]),
            fallback_nodes=tuple(d["fallback_nodes"]),
            collectives=tuple(PlannedCollective.from_dict(c) for c in d["collectives"]),
            cost=dict(d["cost"]),
            memory=dict(d["memory"]),
            warnings=tuple(d["warnings"]),
            stats=dict(d["stats"]),
            versions=dict(d["versions"]),
            recompute=tuple(Recompute.from_dict(r) for r in d.get("recompute", ())),
            order=tuple(d.get("order", ())),
            # (the typed fields, written in ``stats`` where their stage recorded them)
            memory_budget=stats.get("memory_budget"),
            solver_peak_bytes=stats.get("peak_bytes"),
            overlaps_collectives=bool(stats.get("overlaps_collectives", False)),
            solver_status=stats.get("status", ""),
            folded=bool(stats.get("fold", True)),
            source=dict(stats.get("source") or {}),
        )

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path, *, timings: bool = False) -> None:
        Path(path).write_text(self.to_json(timings=timings))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """The plan saved at ``path``; an error naming the file if it holds none."""
        try:
            return cls.from_json(Path(path).read_text())
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                f"{path} does not hold an autopar plan ({type(e).__name__}: {e})"
            ) from None


_WIDTH = 120


def _one_line(obj, flat: str, depth: int) -> bool:
    """Whether ``_lines`` keeps ``obj`` on one line: a scalar; a list of scalars (a memory
    timeline); a record (a dict of at most 16 keys, none holding a dict: a node's choice,
    a collective, a gradient bucket's 13); anything that fits in ``_WIDTH`` columns."""
    if not isinstance(obj, (dict, list)) or len(flat) + depth <= _WIDTH:
        return True
    if isinstance(obj, list):
        return all(not isinstance(v, (dict, list)) for v in obj)
    return len(obj) <= 16 and not any(isinstance(v, dict) for v in obj.values())


def _lines(obj, depth: int) -> list[str]:
    """``obj`` as indented JSON lines (``_one_line`` says which values stay whole)."""
    flat = json.dumps(obj)
    if _one_line(obj, flat, depth):
        return [flat]
    pad = " " * (depth + 1)
    if isinstance(obj, dict):
        items = [(json.dumps(k) + ": ", v) for k, v in obj.items()]
        opening, closing = "{", "}"
    else:
        items = [("", v) for v in obj]
        opening, closing = "[", "]"
    out = [opening]
    for i, (head, v) in enumerate(items):
        inner = _lines(v, depth + 1)
        inner[0] = pad + head + inner[0]
        if i < len(items) - 1:
            inner[-1] += ","
        out.extend(inner)
    out.append(" " * depth + closing)
    return out

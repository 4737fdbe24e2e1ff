"""Reshard prefetch: on a device that overlaps collectives, each reshard issued ahead of the
node that reads it, as FSDP2 issues the next layer's all-gather before this layer runs.

Takes: the ``StrategySpace`` (roles, the nodes' inputs) and an assembled ``Plan`` (its
collectives, its order, its memory budget and the solver's peak). Returns: a new plan with
``issue_after`` (a node name) on each reshard issued early (``dataclasses.replace`` of its
``PlannedCollective``), or the plan given where none is. Nothing where the profile does not
overlap collectives (gloo: two collectives in flight on one group can mix their messages,
passes/codegen ``_Ring``; every collective is waited for where it is issued).

Which: a reshard (an edge ``src->dst`` between two nodes, not into a recomputed copy nor
into the step's outputs) that runs one collective, on one mesh axis, into a node that reads
``src`` once.

Where: per mesh axis, the reshards in the order their consumers run, ``c_1, c_2, ...``;
``c_k+1`` is issued right before ``c_k``'s consumer runs (after the point before it), when
``c_k`` is waited for, but not before its own input is made, nor before the part
(forward, backward) of its consumer begins (each part is its own graph):

    issue(c_k+1) = max(pos(consumer(c_k)) - 1, pos(src(c_k+1)), start of its part)

and not at all where that is already the point before its own consumer (nothing to gain).
So an axis holds at most two reshards in flight or waiting, the one its next consumer
waits for and the one after it, and the compute from ``c_k``'s consumer to ``c_k+1``'s
runs beside ``c_k+1``: one layer's all-gather of its weights beside the layer before it.
The first reshard of an axis is issued once its input is made (a parameter's: at its
part's start).

The model's state. A reshard's input made from the parameters alone (passes/order
``ready_nodes``: a parameter's cast to the compute dtype, its transpose; none of it through
another reshard, nothing random) can be made at any point: passes/order puts such a node
right before the node that reads it, where holding it costs the least, and there it would
bound its reshard's issue to the point before its consumer (FSDP in bf16: each weight's
all-gather waited for at once). So first, per axis in the same sequence, each such input
made after the point ``c_k+1`` would be issued at (``pos(consumer(c_k)) - 1``; the part's
start for ``c_1``) moves there, with the nodes of its kind it reads, in the plan's order
(``plan.order``; ``_moved_ahead``); the rule above then issues ``c_k+1`` right after it.
They are held from there on, which the memory model counts and the budget check sees.

Its output is held from the issue to its consumer: passes/memory counts it there
(``Liveness.prefetched``), core/schedule issues it at its point (the compute stream waits
for it at its consumer), and passes/codegen moves the collective, with the ops that prepare
its input, to right after that point in the local graph, leaving its wait before the
consumer. Where the held outputs raise the step's peak above the plan's memory budget
(``plan.memory_budget``; the solver bounds the step without them), the reshards held at
the peak are issued at their consumers instead, and the step is measured again, at most
``BUDGET_ROUNDS`` times; then, or where none is held at the peak, nothing is prefetched.
The step is measured only where it may pass the budget: the solver's peak
(``plan.solver_peak_bytes``, the step without buckets and prefetches), every bucket's flat
input (passes/buckets), every reshard issued early and every output of a node moved ahead,
all held at once, bound it (``_held_bound``; the operator order only lowers the solver's
step's peak). ``prefetch_measured`` returns the last measurement with the plan, where it
made one (the memory stage's report of it, which the overlap rounds take:
passes/pipeline).

``plan.stats`` (telemetry, in a copy): ``prefetched`` (reshards issued early),
``prefetch_moved`` (inputs moved ahead for them).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Collection, Sequence, Set

from autopar.core import Plan, PlannedCollective, StrategySpace, parse_placements, roles
from autopar.core.schedule import edge_ends, purpose

from .buckets import flat_bytes
from .memory import MemoryReport, local_bytes, simulate
from .order import ready_nodes
from .pricing import overlaps_collectives

__all__ = ["BUDGET_ROUNDS", "prefetch_measured", "prefetch_reshards"]

BUDGET_ROUNDS = 8
"""Times the step is measured with fewer prefetches held at its peak, until it fits the
memory budget (module docstring)."""


def _candidates(
    space: StrategySpace, plan: Plan, position: dict[str, int]
) -> list[PlannedCollective]:
    """The reshards the module docstring names, each one collective of one edge."""
    per_edge: dict[str, list[PlannedCollective]] = defaultdict(list)
    for c in plan.collectives:
        per_edge[c.edge].append(c)
    found = []
    for edge, cs in per_edge.items():
        if len(cs) != 1 or purpose(cs[0]) != "reshard" or " " in edge:
            continue  # (several collectives; a gradient's; a recomputed copy's)
        src, dst = edge_ends(edge)
        if src == dst or src not in position or dst not in position:
            continue
        if sum(s == src for s, _ in space.in_sources[dst]) != 1:
            continue
        found.append(cs[0])
    return found


def _chain(space: StrategySpace, node: str, ready: Set[str]) -> set[str]:
    """``node`` and the operators of ``ready`` it reads, transitively."""
    found, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in found:
            continue
        found.add(n)
        stack.extend(
            s for s, _ in space.in_sources[n] if s in ready and space.targets[s] != "placeholder"
        )
    return found


@dataclasses.dataclass(frozen=True, slots=True)
class _Order:
    """An order of the step's nodes, with what the rules read of it: each node's position,
    whether it runs in the backward, and where the backward and the forward's operators
    begin."""

    names: Sequence[str]
    position: dict[str, int]
    backward: list[bool]
    first_backward: int
    first_forward: int


def _order_of(space: StrategySpace, names: Sequence[str]) -> _Order:
    """``names`` as an ``_Order``; the traced order's made once per space (each overlap
    round's plan after the first is judged in it, passes/pipeline)."""
    traced = names is space.order
    if traced and "prefetch_order" in space.derived:
        return space.derived["prefetch_order"]
    backward = [space.roles[n] == roles.BACKWARD for n in names]
    made = _Order(
        names,
        space.position if traced else {n: i for i, n in enumerate(names)},
        backward,
        backward.index(True) if any(backward) else len(names),
        next(i for i, n in enumerate(names) if space.targets[n] != "placeholder"),
    )
    if traced:
        space.derived["prefetch_order"] = made
    return made


def _sequence(space: StrategySpace, plan: Plan, order: _Order) -> list[list[PlannedCollective]]:
    """Per mesh axis, the candidates in the order their consumers run in ``order``."""
    position = order.position
    by_axis: dict[str, list[PlannedCollective]] = defaultdict(list)
    for c in _candidates(space, plan, position):
        by_axis[c.axis].append(c)
    for cs in by_axis.values():
        cs.sort(key=lambda c: position[edge_ends(c.edge)[1]])
    return list(by_axis.values())


def _moved_ahead(
    space: StrategySpace, plan: Plan, order: _Order, sequence: list[list[PlannedCollective]]
) -> tuple[Sequence[str], list[str]]:
    """``order`` with each candidate's input that is one of ``ready_nodes`` (passes/order)
    and is made after the point its reshard would be issued at, moved there with the ready
    nodes it reads (module docstring, "The model's state"), and the nodes moved; the
    candidates of ``order`` in ``sequence`` (``_sequence``)."""
    fed = {edge_ends(c.edge)[1] for c in plan.collectives if purpose(c) == "reshard"}
    ready = ready_nodes(space, fed)
    position, backward = order.position, order.backward
    before: dict[str, int] = {}  # moved node -> the position it is put before
    for cs in sequence:
        previous = None
        for c in cs:
            src, dst = edge_ends(c.edge)
            if backward[position[dst]]:
                start = order.first_backward + 1
            else:
                start = order.first_forward
            at = start if previous is None else max(start, previous)
            previous = position[dst]
            if src not in ready or position[src] < at:
                continue
            for n in _chain(space, src, ready):
                if position[n] >= at:
                    before[n] = min(before.get(n, at), at)
    if not before:
        return order.names, []
    slots: dict[int, list[str]] = defaultdict(list)
    for n in order.names:  # the moved nodes keep their order among themselves
        if n in before:
            slots[before[n]].append(n)
    out: list[str] = []
    for i, n in enumerate(order.names):
        out.extend(slots.get(i, ()))
        if n not in before:
            out.append(n)
    return out, list(before)


def prefetch_reshards(space: StrategySpace, plan: Plan, optimizer: str = "adamw") -> Plan:
    """``plan`` with its reshards issued ahead of their consumers (module docstring)."""
    return prefetch_measured(space, plan, optimizer)[0]


def prefetch_measured(
    space: StrategySpace, plan: Plan, optimizer: str = "adamw"
) -> tuple[Plan, MemoryReport | None]:
    """``prefetch_reshards``, and the step memory of the plan it returns where the budget
    check measured it (passes/memory ``simulate``; else None): the memory stage's report of
    that plan, which the overlap rounds take rather than measure again (passes/pipeline)."""
    if not overlaps_collectives(plan.mesh):
        return plan, None
    given = _order_of(space, plan.order or space.order)
    sequence = _sequence(space, plan, given)
    order, moved = _moved_ahead(space, plan, given, sequence)
    if moved:
        given = _order_of(space, order)
        sequence = _sequence(space, plan, given)
    position, backward, first_backward = given.position, given.backward, given.first_backward
    early: dict[int, str] = {}  # id(collective) -> the node after which it is issued
    for cs in sequence:
        previous = None  # the consumer of the axis's reshard before
        for c in cs:
            src, dst = edge_ends(c.edge)
            at = position[src]
            if previous is not None:
                at = max(at, previous - 1)
            if backward[position[dst]]:
                at = max(at, first_backward)
            if at < position[dst] - 1:
                early[id(c)] = order[at]
            previous = position[dst]
    budget = plan.memory_budget
    consumer = {id(c): edge_ends(c.edge)[1] for c in plan.collectives}
    bound = None if budget is None else _held_bound(plan, early, _moved_bytes(space, plan, moved))
    for _ in range(BUDGET_ROUNDS):
        if not early:
            return plan, None
        collectives = tuple(
            dataclasses.replace(c, issue_after=early[id(c)]) if id(c) in early else c
            for c in plan.collectives
        )
        out = dataclasses.replace(
            plan, collectives=collectives, order=tuple(order) if moved else plan.order
        )
        report = None
        if budget is None or (bound is not None and bound <= budget):
            break
        bound = None  # (once measured, measured each round)
        report = simulate(space, out, optimizer)
        if report.peak_bytes <= budget:
            break
        # the prefetches held at the peak go back to their consumers
        point = {n: i for i, (n, _) in enumerate(report.timeline)}
        peak = report.peak_index
        held = [k for k, after in early.items() if point[after] < peak <= point[consumer[k]]]
        if not held:
            return plan, None
        for k in held:
            del early[k]
    else:
        return plan, None
    stats = {**plan.stats, "prefetched": len(early), "prefetch_moved": len(moved)}
    return dataclasses.replace(out, stats=stats), report


def _held_bound(plan: Plan, early: Collection[int], kept: int) -> int | None:
    """A bound on the prefetched step's peak, where the plan carries the solver's
    (``plan.solver_peak_bytes``: the step without buckets and prefetches, in traced order):
    that, and every bucket's flat input (passes/buckets: no more than that beside the
    solver's step), every reshard of ``early`` (ids of the plan's collectives issued early;
    each entry's bytes: at least its buffer) and ``kept`` (``_moved_bytes``), all held at
    once. None without it."""
    solver = plan.solver_peak_bytes
    if solver is None:
        return None
    flat = flat_bytes(plan)
    ahead = sum(c.nbytes for c in plan.collectives if id(c) in early)
    return int(solver) + flat + ahead + kept


def _moved_bytes(space: StrategySpace, plan: Plan, moved: Sequence[str]) -> int:
    """Bytes one rank holds of the outputs of the nodes ``moved`` ahead (``_moved_ahead``)."""
    mesh = tuple(plan.mesh.shape)
    kept = 0
    for n in moved:
        for sd, text in zip(space.shapes[n], plan.nodes[n].out):
            if sd is not None:
                ps = None if text is None else parse_placements(text)
                kept += local_bytes(sd[0], sd[1], ps, mesh)
    return kept

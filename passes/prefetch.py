"""Reshard prefetch: on a device that overlaps collectives, each reshard issued ahead of the
node that reads it, as FSDP2 issues the next layer's all-gather before this layer runs.

Takes: the ``StrategySpace`` (roles, the nodes' inputs) and an assembled ``Plan`` (its
collectives, its order, its memory budget). Returns: the plan with ``issue_after`` (a node
name) on each reshard issued early. Nothing where the profile does not overlap
collectives (gloo: two collectives in flight on one group can mix their messages,
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

Its output is held from the issue to its consumer: passes/memory counts it there
(``Liveness.prefetched``), core/schedule issues it at its point (the compute stream waits
for it at its consumer), and passes/codegen moves the collective, with the ops that prepare
its input, to right after that point in the local graph, leaving its wait before the
consumer. Where the held outputs raise the step's peak above the plan's memory budget
(``stats["memory_budget"]``), nothing is prefetched (the solver bounds the step without
them).

``plan.stats``: ``prefetched`` (reshards issued early).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from autopar.core import Plan, StrategySpace, roles
from autopar.core.schedule import edge_ends, purpose

from .memory import simulate
from .solve import overlaps_collectives

__all__ = ["prefetch_reshards"]


def _candidates(space: StrategySpace, plan: Plan, position: dict[str, int]) -> list[dict]:
    """The reshards the module docstring names, each one collective of one edge."""
    per_edge: dict[str, list[dict]] = defaultdict(list)
    for c in plan.collectives:
        per_edge[c["edge"]].append(c)
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


def prefetch_reshards(space: StrategySpace, plan: Plan, optimizer: str = "adamw") -> Plan:
    """``plan`` with its reshards issued ahead of their consumers (module docstring)."""
    if not overlaps_collectives(plan.mesh):
        return plan
    order = list(plan.order) if plan.order else list(space.order)
    position = {n: i for i, n in enumerate(order)}
    backward = [space.roles[n] == roles.BACKWARD for n in order]
    first_backward = backward.index(True) if any(backward) else len(order)
    by_axis: dict[str, list[dict]] = defaultdict(list)
    for c in _candidates(space, plan, position):
        by_axis[c["axis"]].append(c)
    early: dict[int, str] = {}  # id(collective) -> the node after which it is issued
    for cs in by_axis.values():
        cs.sort(key=lambda c: position[edge_ends(c["edge"])[1]])
        previous = None  # the consumer of the axis's reshard before
        for c in cs:
            src, dst = edge_ends(c["edge"])
            at = position[src]
            if previous is not None:
                at = max(at, previous - 1)
            if backward[position[dst]]:
                at = max(at, first_backward)
            if at < position[dst] - 1:
                early[id(c)] = order[at]
            previous = position[dst]
    if not early:
        return plan
    collectives = tuple(
        {**c, "issue_after": early[id(c)]} if id(c) in early else c for c in plan.collectives
    )
    out = dataclasses.replace(plan, collectives=collectives, stats=dict(plan.stats))
    budget = plan.stats.get("memory_budget")
    if budget is not None and simulate(space, out, optimizer).peak_bytes > budget:
        return plan
    out.stats["prefetched"] = len(early)
    return out

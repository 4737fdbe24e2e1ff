"""Activation checkpointing: what a layer can recompute in the backward, and the rewrite.

Takes: the ``StrategySpace`` (passes/strategies: the step's nodes in order, their roles,
inputs and regions). Returns: one ``Recompute`` per layer that can recompute something
(``candidates``). passes/solve decides which to take (one boolean per fold group: every
instance of a folded layer is checkpointed alike, as hand-written plans do), passes/memory
counts the bytes either way, and codegen rewrites the step graph with the chosen ones
(``apply``) before it localizes it.

The model. A layer is a region R of passes/fold (a numbered child of a ``ModuleList``, with
the forward and backward nodes that came from it). A storage (passes/memory: a tensor and
its views) made by R's forward is *recomputable* when

    every node that is (a view of) it is a forward node of R,
    every node that reads it is in R (forward or backward),
    it is not a graph output,

and a forward node of R is recomputable when every storage it makes or views is, its op
draws no random numbers (``nondeterministic_seeded``: dropout would draw other numbers),
and, a view, the node it views is recomputable. Then

    C(R)       the recomputable nodes a backward node reads, and, recursively, every
               recomputable forward node of R they read: what is recomputed
    before(R)  the first backward node (in step order) that reads a node of C(R)
    moved(R)   the nodes of C(R) whose every reader is a backward node or another node of
               moved(R): once the backward reads the copies, nothing reads the original,
               and the forward does not run it (it runs once, in the backward)

and the checkpointed step runs a copy n' of every n in C(R), in step order, right before
before(R). Every backward read of n reads n' instead; a copy reads the copies of its inputs
in C(R) and every other input as it is (the parameters, the layer's input, and what R
keeps because another region reads it: the residual stream). So the forward keeps of R only
what crosses its boundary, and nothing inside it, as ``torch.utils.checkpoint`` around the
layer does. The copies run with their original's strategy: the redistributions of their
inputs (an all-gather of a sharded weight, say) run again too.

Numerics: a copy computes what its original did from the same inputs with the same kernel,
so the checkpointed step computes the same values (tests/distributed/test_checkpointing.py).
"""

from __future__ import annotations

import functools
import operator
from collections import defaultdict
from collections.abc import Iterator, Sequence

import torch

from autopar.core import Recompute, StrategySpace, roles
from autopar.core.schedule import COPY  # the name of a copy's point in the step

__all__ = [
    "COPY",
    "Recompute",
    "apply",
    "candidates",
    "checkpointed",
    "is_alias",
    "storage_map",
    "view_inputs",
    "views_through",
]


@functools.cache
def is_alias(target) -> bool:
    """The op returns (a view of) its first input, or writes it in place: no new storage.
    (Cached by op: a 96-layer step asks for each of its ~18,000 nodes.)"""
    if target is operator.getitem:
        return True
    if target is torch.ops.aten._unsafe_view.default:  # a view, though its schema says not
        return True
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    return schema.returns[0].alias_info is not None


def storage_map(space: StrategySpace) -> dict[tuple[str, int], tuple[str, int]]:
    """(node, output) -> the (node, output) that made its storage (passes/memory's rule:
    a view, an in-place op and a ``getitem`` share their first input's). Made once per
    space (``StrategySpace.derived``): callers must not change it."""
    made = space.derived.get("storage_map")
    if made is None:
        made = space.derived["storage_map"] = _storage_map(space)
    return made


def _storage_map(space: StrategySpace) -> dict[tuple[str, int], tuple[str, int]]:
    storage_of: dict[tuple[str, int], tuple[str, int]] = {}
    for name in space.order:
        if space.targets[name] == "placeholder":
            storage_of[(name, 0)] = (name, 0)
            continue
        ins = space.in_sources[name]
        if ins and is_alias(space.targets[name]) and ins[0] in storage_of:
            storage_of[(name, 0)] = storage_of[ins[0]]
            continue
        for idx, sd in enumerate(space.shapes[name]):
            if sd is not None:
                storage_of[(name, idx)] = (name, idx)
    return storage_of


def view_inputs(space: StrategySpace) -> dict[str, tuple[str, int]]:
    """Node -> its first tensor input (producer, output), of each node whose output is on
    that input's storage (``storage_map``: a view, an in-place op, a ``getitem``). A
    redistribution into such a node's first input makes a buffer its output then lives on
    (passes/memory, "Reshards into a view"). Made once per space."""
    made = space.derived.get("view_inputs")
    if made is None:
        storage_of = storage_map(space)
        made = space.derived["view_inputs"] = {
            name: ins[0]
            for name in space.order
            if (ins := space.in_sources[name])
            and space.targets[name] != "placeholder"
            and (name, 0) in storage_of
            and storage_of[(name, 0)] != (name, 0)
            and storage_of.get(ins[0]) == storage_of[(name, 0)]
        }
    return made


def views_through(views: dict[str, tuple[str, int]], src: str) -> Iterator[str]:
    """The views a read of ``src``'s output reads through: ``src``, the node it views, and
    so on, while each is a view (``view_inputs``)."""
    while src in views:
        yield src
        src = views[src][0]


def _random(target) -> bool:
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def candidates(space: StrategySpace) -> list[Recompute]:
    """Every layer of ``space`` with something to recompute (module docstring)."""
    regions = space.regions
    if not regions:
        return []
    order, role = space.order, space.roles
    index = {n: i for i, n in enumerate(order)}
    storage_of = storage_map(space)
    members: dict[tuple, set[str]] = defaultdict(set)
    for (node, _), s in storage_of.items():
        members[s].add(node)
    readers: dict[tuple, set[str]] = defaultdict(set)
    users: dict[str, set[str]] = defaultdict(set)
    for name in order:
        for src, so in space.in_sources[name]:
            users[src].add(name)
            key = storage_of.get((src, so))
            if key is not None:
                readers[key].add(name)
    outputs = {storage_of.get((sink.src, sink.src_out)) for sink in space.sinks}

    def forward_in(n: str, r: str) -> bool:
        return role.get(n) == roles.FORWARD and regions.get(n) == r

    def storage_ok(s: tuple) -> bool:
        r = regions.get(s[0], "")
        return (
            bool(r)
            and s not in outputs
            and all(forward_in(m, r) for m in members[s])
            and all(regions.get(u) == r for u in readers[s])
        )

    ok: dict[str, bool] = {}
    for name in order:
        r = regions.get(name, "")
        target = space.targets[name]
        if not forward_in(name, r) or _random(target):
            ok[name] = False
            continue
        keys = [(name, i) for i in range(len(space.shapes[name]))]
        good = all(storage_ok(storage_of[k]) for k in keys if k in storage_of)
        ins = space.in_sources[name]
        if good and ins and is_alias(target):
            good = ok.get(ins[0][0], False)
        ok[name] = good

    by_region: dict[str, list[str]] = defaultdict(list)
    for name in order:
        if ok[name] and any(role.get(u) == roles.BACKWARD for u in users[name]):
            by_region[regions[name]].append(name)
    found = []
    for r, needed in by_region.items():
        closure: set[str] = set()
        stack = list(needed)
        while stack:
            n = stack.pop()
            if n in closure:
                continue
            closure.add(n)
            stack.extend(src for src, _ in space.in_sources[n] if ok.get(src, False))
        nodes = tuple(sorted(closure, key=index.__getitem__))
        first = min(
            (index[u] for n in nodes for u in users[n] if role.get(u) == roles.BACKWARD),
        )
        # the originals nothing reads once the backward reads the copies: gone from the
        # forward (codegen's dead-code elimination), they run once, in the backward
        moved: set[str] = set()
        for n in reversed(nodes):
            if all(role.get(u) == roles.BACKWARD or u in moved for u in users[n]):
                moved.add(n)
        found.append(
            Recompute(
                r,
                space.region_groups.get(r, r),
                nodes,
                order[first],
                tuple(n for n in nodes if n in moved),
            )
        )
    return found


def checkpointed(
    gm: torch.fx.GraphModule, chosen: Sequence[Recompute]
) -> tuple[torch.fx.GraphModule, dict[str, str]]:
    """``gm``, or a copy of it rewritten to recompute ``chosen`` (``apply``), and each
    copy's original's name."""
    if not chosen:
        return gm, {}
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph.set_codegen(gm.graph._codegen)  # the same calling convention (pytree in and out)
    new = torch.fx.GraphModule(gm, graph)
    return new, apply(new, chosen)


def apply(gm: torch.fx.GraphModule, chosen: Sequence[Recompute]) -> dict[str, str]:
    """Rewrite ``gm`` (a step graph, in place) to recompute ``chosen`` (module docstring).
    Returns each copy's name -> its original's."""
    if not chosen:
        return {}
    nodes = {n.name: n for n in gm.graph.nodes}
    copy_of: dict[str, str] = {}
    for rec in chosen:
        env: dict[torch.fx.Node, torch.fx.Node] = {}

        def arg(a: torch.fx.Node, env=env) -> torch.fx.Node:
            return env.get(a, a)

        with gm.graph.inserting_before(nodes[rec.before]):
            for name in rec.nodes:
                n = nodes[name]
                c = gm.graph.node_copy(n, arg)
                c.meta = dict(n.meta)
                c.meta[roles.META_ROLE] = roles.BACKWARD
                c.meta["partitioner_tag"] = "is_backward"
                env[n] = c
                copy_of[c.name] = name
        for n, c in env.items():
            for u in list(n.users):
                if u.meta.get(roles.META_ROLE) == roles.BACKWARD and u.name not in copy_of:
                    u.replace_input_with(n, c)
    gm.graph.lint()
    gm.recompile()
    return copy_of

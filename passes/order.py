"""Operator order: the order the planned step runs its nodes in, chosen for its peak memory.

Takes: the ``StrategySpace`` (passes/strategies: the step's nodes in traced order, their
tensors and edges), the traced ``StepGraph`` (its fx graph: every dependency, tensor or not)
and a ``Plan``. Returns: an ``Ordering``: every node of the step in the order chosen, the
peak per rank of the traced order and of the chosen one under passes/memory's model, and
how it was solved. codegen runs the step in that order (``apply``); passes/memory measures
it (``plan.order``), so the peak the plan reports is the peak of the order that runs.

The model is passes/memory's, restated on sets of nodes. A storage ``s`` (made by a node,
shared by its views and in-place updates) has a size under the plan, ``size(s)``, its
readers ``R(s)`` (the nodes that read any tensor on it) and is pinned when it lives to the
end of the step whatever the order (parameters, inputs, graph outputs). After the nodes
of a set ``D`` closed under dependencies have run, the bytes live are

    live(D)      = sum of size(s) over the storages made in D (a tangent: read in D, the
                   backward makes it) that are pinned or have a reader outside D
    during(D, v) = live(D) + size of what v makes (and of a tangent v reads first)
                   + v's collective buffers

Where the plan redistributes into a view's first input (passes/memory, "Reshards into a
view"), the view makes a storage (the collective's result) read by whoever reads through
the view, and a reader that reaches the viewed storage only through such views is not
one of its readers: readers and sizes both come from the plan, and the rest holds as is.
live(D) is a function of the set D alone, not of the order it ran in. An order
``v_1 .. v_n`` has peak ``max_k during({v_1..v_k-1}, v_k)``: exactly passes/memory's
``bytes(i)`` at every node (the point after the return adds the same bytes to every order
and is left out). Minimising that peak is a bottleneck shortest path over the lattice of
dependency-closed sets, ``best(D + v) = min(best(D + v), max(best(D), during(D, v)))``,
solved layer by layer (sets of k units, then k + 1). This is the exact search ROAM and
MODeL hand an ILP solver; because live(D) depends on D alone it needs none: a dynamic
program over sets, exact where the sets are few (a segment's nodes are mostly a chain).

Units. Views and other nodes that make no storage and run no collective change no live
byte: they are left out of the search, and each runs just before the first node that reads
it. A node that reads only what lives through the whole step (a parameter's mixed-precision
cast, a weight times the input) frees nothing when it runs, so running it later never
raises a point between: it joins the unit of the first node that reads it and runs just
before it. The search orders the remaining nodes with those they bring: the units. A node
stays in its part (forward or backward): one whose first reader is in the other part, or
that nothing reads, is a unit of its own (a view: runs at the end of its part), but for a
backward node read only by the step's return (a gradient's view): it runs right after the
last node it reads through neutral ones, so that the gradient's bucket (passes/buckets),
issued after it, goes as early as it can. Which nodes are neutral depends on the plan only
through the reshards into the nodes that make no bytes under any placements: the units
(and their segments, below) of a plan with none are made ahead, while the solver's first
solve runs (``prepare``), and each plan with other neutral nodes makes its own.

Decomposition (ROAM's key points). The forward runs before the backward (aot_autograd's
partition runs them so). Within each, a unit that every other unit either precedes or
follows runs at one position in every order; the set run before it is fixed, so the
segments between such units are ordered independently, and the step's peak is the largest
segment peak. A segment longer than ``window`` units is cut into windows of consecutive
traced units (a traced prefix is closed under dependencies, so each window is ordered
alone). Only the peak matters: the segment at the peak is searched, then the one at the
new peak, until the segment at the peak gains nothing; the others keep the traced order.

Bound. The same reasoning bounds every order from below. Before a key point, the set run
is fixed, so the bytes while it runs are the same in every order; after the whole forward,
live(forward) is held in every order into the first backward node. Both are computed
under the search's model, where a storage is freed once its last searched reader has run
and a source node runs at its first reader: an order of the step's nodes frees no storage
sooner and runs no source later, so its bytes at those points are at least these. Their
maximum, ``stats["bound_bytes"]``, is at most the least peak any order running the
forward first can reach; where it equals the traced order's peak, no order lowers the
peak, and the traced order is kept without a search (nor a run of the units' order):
the zoo's transformers, whose peak is the whole forward held into the backward.
live(forward) under the step's own model (every node a reader; a function of the set
alone) bounds it as well: it is read off the run of the traced order that gives its peak
(``_Problem.sweep``). Where the search ends at a key point, or at a segment it searched
exactly without cutting it into windows, that segment's peak is the least any order can
give it, and the step's peak is the largest segment peak: ``stats["optimal"]``, no order
is lower under this model.

Per segment: exact while a layer of the search holds at most ``beam`` sets; above, the
``beam`` sets of least (peak, live bytes) are kept (a beam search; ``Ordering.stats``
counts the ``exact`` ones). The result is never worse than the traced order: a searched
segment that does not lower its peak keeps the traced one, and so does the step if the
whole order does not. Ties go to the traced order (the set whose nodes come earliest in
it), and the order is deterministic.

What keeps its relative order: ops that draw random numbers (dropout: reordering them would
change which numbers each draws), ops that mutate an input, and the recomputed copies of a
checkpointed step (a plan with ``recompute`` is run in traced order: the copies are placed
by passes/remat).
"""

from __future__ import annotations

import copy
import functools
import heapq
import math
import warnings
from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from autopar.core import Plan, StrategySpace, roles

from .memory import plan_placements, resharder, sizer
from .remat import COPY, storage_map, view_inputs, views_through

__all__ = ["Ordering", "apply", "mutates_or_draws", "order_step", "prepare", "ready_nodes"]

BEAM = 64
"""Sets kept per layer of a segment's search above which it is a beam search."""
WINDOW = 48
"""Units per search: a longer segment is ordered this many traced units at a time."""
END_OF_FORWARD, END = -2, -1
"""Where a neutral node that no node of its part reads runs (``_Units.hang``)."""


@dataclass
class Ordering:
    """The order chosen for a step (module docstring).

    Attributes:
        order: every node name of the step, placeholders first, in the order it runs.
        traced_peak / peak: the peak bytes per rank of the traced order and of ``order``
            under the model of the module docstring (the return's point left out).
        stats: ``segments`` (and windows) of the step, ``searched`` of them, ``exact``
            of those solved exactly, the ``largest``'s unit count, ``moved`` nodes not at
            their traced position, ``traced_bytes`` (``traced_peak``), ``bound_bytes``
            (no order running the forward first peaks lower) and ``optimal`` (no order
            does better than ``peak``; both "Bound"; the pass runner records its time,
            ``order_s``).
    """

    order: list[str]
    traced_peak: int
    peak: int
    stats: dict = field(default_factory=dict)
    traced_step_peak: int = 0
    """The traced order's peak as passes/memory measures the whole step (optimizer state
    and the return included; set by the pipeline)."""

    @property
    def changed(self) -> bool:
        return self.peak < self.traced_peak


@functools.cache
def mutates_or_draws(target) -> bool:
    """The op draws random numbers or writes one of its inputs: it keeps its place among
    such ops. (Cached by op: a 96-layer step asks ~50,000 times per plan.)

    NOTE: an op's schema (``_schema``) is the only record of which arguments it writes
    (tests/unit/test_torch_internals.py)."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        return True
    return any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)


def ready_nodes(space: StrategySpace, fed: Collection[str] = ()) -> frozenset[str]:
    """The model's state and what the step makes of it alone: the parameters and buffers,
    and each node that reads only those and such nodes, none of it through a reshard into
    a node of ``fed``, and draws no random numbers and writes nothing (a parameter's cast
    to the compute dtype, its view). A part of the step can run them at its start:
    passes/prefetch runs them ahead, so that a reshard of their output is issued early.

    Those with ``fed`` empty are made once per space (``StrategySpace.derived``); where no
    node of ``fed`` is among them, ``fed`` takes none away, and they are the answer; else
    those of ``fed`` go, and each of them that reads one gone (read in step order, among
    those alone: a node of them reads only nodes of them)."""
    every = space.derived.get("ready_nodes")
    if every is None:
        every = space.derived["ready_nodes"] = _ready(space)
    if every.isdisjoint(fed):
        return every
    gone: set[str] = set()
    for n in space.derived["ready_operators"]:
        if n in fed or any(s in gone for s, _ in space.in_sources[n]):
            gone.add(n)
    return every - gone


def prepare(space: StrategySpace, gm: torch.fx.GraphModule) -> None:
    """Make what ``order_step`` and ``ready_nodes`` read of the step whatever the plan (the
    step's storage graph, the model's state and what reads it alone), ahead of the first
    plan (passes/solve reads the solver's first solution meanwhile)."""
    g = _Graph.of(space, gm)
    ready_nodes(space)
    # the units of a plan that redistributes into no node making no bytes (the neutral
    # nodes are then the same under every such plan: ``_Problem.searchable``), which the
    # zoo's first plans are: a plan that does is given its own
    _units_of(space, g, g.quiet, _mask(g.quiet)).segments(space, g.names)


def _ready(space: StrategySpace) -> frozenset[str]:
    """``ready_nodes(space)``; its operators, in step order, into
    ``space.derived["ready_operators"]``."""
    found = {n for n in space.order if space.roles[n] in (roles.PARAM, roles.BUFFER)}
    operators = []
    for n in space.order:
        target = space.targets[n]
        ins = space.in_sources[n]
        if (
            target != "placeholder"
            and ins
            and not mutates_or_draws(target)
            and all(s in found for s, _ in ins)
        ):
            found.add(n)
            operators.append(n)
    space.derived["ready_operators"] = operators
    return frozenset(found)


class _Graph:
    """What ``_Problem`` reads of the step that no plan changes: positions, dependencies,
    storages, who makes and who reads each. Made once per space and graph
    (``StrategySpace.derived``), and read only."""

    def __init__(self, space: StrategySpace, gm: torch.fx.GraphModule):
        order = [n for n in space.order if space.targets[n] != "placeholder"]
        self.placeholders = [n for n in space.order if space.targets[n] == "placeholder"]
        self.names = order
        self.backward = [space.roles[name] == roles.BACKWARD for name in order]
        pos = {n: i for i, n in enumerate(order)}
        n = len(order)
        # what each node must run after: its inputs in the fx graph (every input node,
        # tensor or not), and the op before it that draws random numbers or writes an
        # input, where it does too
        fx_nodes = {x.name: x for x in gm.graph.nodes}
        self.preds: list[list[int]] = [
            [pos[a.name] for a in fx_nodes[name].all_input_nodes if a.name in pos] for name in order
        ]
        self.mutates = [mutates_or_draws(space.targets[name]) for name in order]
        chained = [i for i, m in enumerate(self.mutates) if m]
        for a, b in zip(chained, chained[1:]):
            self.preds[b].append(a)
        storage_of = storage_map(space)
        # each storage: its key (owner, output), shape, dtype, counted (not an alias)
        self.storages: list[tuple[tuple, tuple, torch.dtype, bool]] = []
        self.pinned: set[tuple] = set()
        self.tangents: set[tuple] = set()
        readers: dict[tuple, set[int]] = {}
        self.makes: list[list[tuple]] = [[] for _ in range(n)]
        for (node, idx), key in storage_of.items():
            if key != (node, idx):
                continue
            shape, dtype = space.tensor(node, idx)
            self.storages.append((key, tuple(shape), dtype, node not in space.aliases))
            readers[key] = set()
            if node in pos:
                self.makes[pos[node]].append(key)
            elif space.roles[node] == roles.TANGENT:
                self.tangents.add(key)  # the backward makes it: live from its first read
            else:
                self.pinned.add(key)  # parameters, buffers, inputs: the whole step
        for sink in space.sinks:
            out = storage_of.get((sink.src, sink.src_out))
            if out is not None:
                self.pinned.add(out)
        # each node's tensor inputs: (input index, source, output), for its reshards
        self.inputs: list[list[tuple[int, str, int]]] = [[] for _ in range(n)]
        # a reshard into a view's first input (passes/memory, "Reshards into a view"):
        # its buffer is the view's storage, read by whoever reads the view or a view of
        # it, and the storage it views is read through it no more. Each node's ways in:
        # the chain of views it reads through, below each view (``view_ways``: view ->
        # reader -> chains; ``view_sinks``: the graph outputs' chains), and to each
        # storage made here that nothing pins (``paths``: storage -> reader -> chains,
        # empty: directly); a reader reads through a chain while none of its views has
        # its input redistributed. ``through``: the views each node reads through.
        views = view_inputs(space)
        self.viewed = [(pos[v], (COPY + v, -1), *views[v]) for v in order if v in views]
        self.through: list[list[int]] = [[] for _ in range(n)]
        paths: dict[tuple, defaultdict[int, set[tuple]]] = defaultdict(lambda: defaultdict(set))
        self.view_ways: dict[int, defaultdict[int, set[tuple]]] = defaultdict(
            lambda: defaultdict(set)
        )
        self.view_sinks: dict[int, set[tuple]] = defaultdict(set)
        for name in order:
            i = pos[name]
            for j, (src, so) in enumerate(space.in_sources[name]):
                read = storage_of.get((src, so))
                if read is not None:
                    readers[read].add(i)
                self.inputs[i].append((j, src, so))
                chain = [pos[v] for v in views_through(views, src)]
                for k, v in enumerate(chain):
                    self.view_ways[v][i].add(tuple(chain[:k]))
                    if v not in self.through[i]:
                        self.through[i].append(v)
                if read is not None and read[0] in pos and read not in self.pinned:
                    paths[read][i].add(tuple(chain))
        for sink in space.sinks:
            chain = [pos[v] for v in views_through(views, sink.src)]
            for k, v in enumerate(chain):
                self.view_sinks[v].add(tuple(chain[:k]))
        # (through views only: the others stay as they are under every plan)
        self.paths = {
            key: dict(ways)
            for key, ways in paths.items()
            if any(() not in w for w in ways.values())
        }
        self.reads: list[list[tuple]] = [[] for _ in range(n)]
        self.readers: dict[tuple, list[int]] = {}
        for key, rs in readers.items():
            self.readers[key] = sorted(rs)
            for r in rs:
                self.reads[r].append(key)
        self.reader_count = {key: len(rs) for key, rs in readers.items()}
        self.touch = [list(dict.fromkeys(self.reads[i] + self.makes[i])) for i in range(n)]
        self.tangent_reads = [[k for k in self.reads[i] if k in self.tangents] for i in range(n)]
        self.outside = {key for key in self.pinned if key[0] not in pos}  # (held from the start)
        # the nodes neutral under a plan that redistributes into none of them: they make
        # no byte under any placements (a view's storage is its base's; an empty tensor)
        counted = {key: c and math.prod(shape) > 0 for key, shape, _, c in self.storages}
        self.quiet = [
            not self.mutates[i] and not any(counted[k] for k in self.makes[i]) for i in range(n)
        ]
        # the traced order runs the whole forward first, then the backward: its prefix of
        # ``forward`` nodes is the set every order runs before the backward ("Bound")
        self.forward = self.backward.index(True) if True in self.backward else n
        if any(not b for b in self.backward[self.forward :]):
            self.forward = -1  # (not so: no such prefix)

    @staticmethod
    def of(space: StrategySpace, gm: torch.fx.GraphModule) -> _Graph:
        made = space.derived.get("order_graph")
        if made is None or made[0] is not gm:
            made = (gm, _Graph(space, gm))
            space.derived["order_graph"] = made
        return made[1]


class _Problem:
    """The step as sets of nodes under a plan: the step's ``_Graph`` with each storage's
    size and each node's reshard buffers under the plan's placements (module docstring)."""

    def __init__(self, space: StrategySpace, gm: torch.fx.GraphModule, plan: Plan):
        g = _Graph.of(space, gm)
        self.space, self.graph = space, g
        self.placeholders, self.names, self.backward = g.placeholders, g.names, g.backward
        self.preds, self.makes, self.reads, self.touch = g.preds, g.makes, g.reads, g.touch
        self.pinned, self.tangents, self.tangent_reads = g.pinned, g.tangents, g.tangent_reads
        mesh_shape = tuple(space.mesh.shape)
        n = len(g.names)
        out_ps, in_ps = plan_placements(plan)
        nbytes = sizer(mesh_shape)  # (plan_placements: one tuple per placement text)

        reshard = resharder(mesh_shape)
        self.size: dict[tuple, int] = {
            key: nbytes(shape, dtype, out_ps(*key)) if counted else 0
            for key, shape, dtype, counted in g.storages
        }
        # each node's inputs redistributed into it (``measure``'s reshard buffers): the
        # placement texts compared first, the parsed placements where the texts differ
        nodes = plan.nodes
        self.transient = [0] * n
        for i in range(n):
            choice = nodes.get(g.names[i])
            if choice is None:
                continue
            ins = choice.ins
            for j, src, so in g.inputs[i]:
                made = nodes.get(src)
                if j >= len(ins) or made is None or so >= len(made.out):
                    continue
                if made.out[so] is None or made.out[so] == ins[j]:
                    continue
                p, q = out_ps(src, so), in_ps(g.names[i], j)
                if p is not None and q is not None and tuple(p) != tuple(q):
                    shape, dtype = space.tensor(src, so)
                    layout = space.layouts.get((src, so))
                    self.transient[i] += reshard(tuple(shape), dtype, p, q, layout)
        self.reader_count, self.readers = g.reader_count, g.readers
        self._reshard_views(out_ps, in_ps, nbytes)
        self.new = [sum(self.size[k] for k in self.makes[i]) for i in range(n)]
        # the bytes live before the first node: what the parameters and inputs hold
        self.base = sum(self.size[key] for key in g.outside)
        # what only the search reads (``searchable``)
        self.neutral: list[bool] = []
        self.searched_mask = 0
        self.readers_searched: dict[tuple, int] = {}

    def _reshard_views(self, out_ps, in_ps, nbytes) -> None:
        """The plan's reshards into views' first inputs: each view makes its buffer (not a
        transient one as well), read by whoever reads through the view; a reader of the
        storage it views that reads it only through such views reads it no more. The
        graph's lists are copied where they change."""
        g, space = self.graph, self.space
        on: dict[int, tuple] = {}
        for i, key, src, so in g.viewed:
            p, q = out_ps(src, so), in_ps(g.names[i], 0)
            if p is not None and q is not None and p is not q and tuple(p) != tuple(q):
                shape, dtype = space.tensor(src, so)
                on[i] = (key, nbytes(tuple(shape), dtype, q))
        if not on:
            return
        reads, makes, touched = list(self.reads), list(self.makes), set()
        readers, count = dict(self.readers), dict(self.reader_count)
        self.pinned = set(self.pinned)

        def whole(chains) -> bool:  # (some chain none of whose views is redistributed into)
            return any(not any(v in on for v in chain) for chain in chains)

        for i, (key, held) in on.items():
            self.size[key] = held
            self.transient[i] -= held
            makes[i] = [*makes[i], key]
            readers[key] = sorted(r for r, ways in g.view_ways.get(i, {}).items() if whole(ways))
            count[key] = len(readers[key])
            for r in readers[key]:
                reads[r] = [*reads[r], key]
            touched.update(readers[key])
            touched.add(i)
            if whole(g.view_sinks.get(i, ())):
                self.pinned.add(key)
        for key, paths in g.paths.items():
            gone = {r for r, ways in paths.items() if not whole(ways)}
            if gone:
                readers[key] = [r for r in readers[key] if r not in gone]
                count[key] = len(readers[key])
                for r in gone:
                    reads[r] = [k for k in reads[r] if k != key]
                touched |= gone
        touch, tangent_reads = list(self.touch), list(self.tangent_reads)
        for i in touched:
            touch[i] = list(dict.fromkeys(reads[i] + makes[i]))
            tangent_reads[i] = [k for k in reads[i] if k in self.tangents]
        self.reads, self.makes, self.touch, self.tangent_reads = reads, makes, touch, tangent_reads
        self.readers, self.reader_count = readers, count

    def searchable(self) -> None:
        """Make what the search reads: the neutral nodes (they change no live byte: views,
        getitem, ...; placed, not searched) and who of the searched nodes reads each
        storage (the search runs a neutral node just before its first searched reader)."""
        g, n = self.graph, len(self.names)
        self.neutral = [
            self.new[i] == 0 and self.transient[i] == 0 and not g.mutates[i] for i in range(n)
        ]
        self.searched_mask = _mask(self.neutral)
        neutral = self.neutral
        self.readers_searched = {}
        for key, rs in self.readers.items():
            m = 0
            for r in rs:
                if not neutral[r]:
                    m |= 1 << r
            self.readers_searched[key] = m

    # -- the model ---------------------------------------------------------------------

    def sweep(self, seq: Sequence[int], during_each: list[int] | None = None) -> tuple[int, int]:
        """(peak, live(forward)) running the whole step in the order ``seq`` (a topological
        order of every node that runs the forward first; each storage freed once its last
        reader has run: counted down, the bytes ``step`` gives with every node a reader).
        live(forward), the bytes held into the backward, is the same in every such order
        ("Bound"); -1 where the traced order does not run the forward first, or there is
        no backward. ``during_each``: where given, each node's bytes during it are added
        to it, in the order run."""
        left = dict(self.reader_count)
        count, size, new, transient = self.reader_count, self.size, self.new, self.transient
        tangent_reads, reads, touch, pinned = (
            self.tangent_reads, self.reads, self.touch, self.pinned
        )  # fmt: skip
        forward = self.graph.forward
        live, peak, held = self.base, 0, -1
        for k, i in enumerate(seq):
            if k == forward:
                held = live
            made = new[i]
            for key in tangent_reads[i]:  # a tangent's first reader brings it
                if left[key] == count[key]:
                    made += size[key]
            during = live + made + transient[i]
            if during > peak:
                peak = during
            if during_each is not None:
                during_each.append(during)
            for key in reads[i]:
                left[key] -= 1
            live += made
            for key in touch[i]:
                if key not in pinned and left[key] == 0:
                    live -= size[key]
        return peak, held

    def step(self, done: int, live: int, i: int) -> tuple[int, int]:
        """Run node ``i`` after the set ``done``, as the search runs it (the readers that
        count are the searched nodes): (bytes during it, bytes live after)."""
        readers = self.readers_searched
        made = self.new[i]
        for key in self.tangent_reads[i]:  # a tangent's first reader brings it
            if readers[key] & done == 0:
                made += self.size[key]
        during = live + made + self.transient[i]
        after_done = done | (1 << i)
        freed = 0
        for key in self.touch[i]:
            if key in self.pinned:
                continue
            if readers[key] & ~after_done == 0:
                freed += self.size[key]
        return during, live + made - freed

    def peak_of(self, seq: Sequence[int], done: int, live: int) -> tuple[int, int, int]:
        """(peak, set done after, live after) running ``seq`` after ``done`` (``step``)."""
        peak = 0
        for i in seq:
            during, live = self.step(done, live, i)
            done |= 1 << i
            peak = max(peak, during)
        return peak, done, live


def _mask(neutral: list[bool]) -> int:
    """The nodes not ``neutral``, bit i for node i (made at once: one shift at a time
    copies the growing integer, quadratic in a deep step's nodes)."""
    return int("".join("0" if x else "1" for x in reversed(neutral)) or "0", 2)


@dataclass
class _Units:
    """The search's units (module docstring): ``heads`` in traced order, each with the
    nodes it runs (``members``: what it alone reads of the parameters' computations, then
    itself), the heads it follows (``preds``), and the neutral nodes that run just before
    each node (``hang``; ``hang[END_OF_FORWARD]`` / ``hang[END]``: read by no node of
    their part, run at its end, but for those in ``after``)."""

    heads: list[int]
    members: dict[int, list[int]]
    preds: dict[int, list[int]]
    hang: dict[int, list[int]]
    after: dict[int, list[int]] = field(default_factory=dict)
    """A neutral backward node that no node of the backward reads (a gradient's view, read
    by the step's return) -> the nearest searched nodes it reads through neutral ones: it
    runs right after the last of them to run, as soon as it can."""
    _segments: list[list[int]] | None = field(default=None, init=False, repr=False, compare=False)

    def segments(self, space: StrategySpace, names: list[str]) -> list[list[int]]:
        """The heads split at their key points (``_segments``), the forward's before the
        backward's, as aot_autograd's partition runs them (made once: the units are kept
        for the plans that share them, ``_units``)."""
        if self._segments is None:
            found: list[list[int]] = []
            for part in (roles.FORWARD, roles.BACKWARD):
                mine = [h for h in self.heads if space.roles[names[h]] == part]
                found += _segments(mine, self.preds)
            if sum(map(len, found)) != len(self.heads):
                raise AssertionError("order: a node neither forward nor backward")
            self._segments = found
        return [list(seg) for seg in self._segments]


def _units(p: _Problem) -> _Units:
    """The units of ``p`` (module docstring). They depend on the plan only through which
    nodes are neutral: the last plan's are kept (``StrategySpace.derived``), for the next
    plan of the step with the same neutral nodes (an overlap round's), and read only."""
    return _units_of(p.space, p.graph, p.neutral, p.searched_mask)


def _units_of(space: StrategySpace, g: _Graph, neutral: list[bool], mask: int) -> _Units:
    """``_units`` of the step ``g`` whose neutral nodes are ``neutral`` (``mask``: the others,
    a bit each), the last made where it is of the same (``StrategySpace.derived``)."""
    made = space.derived.get("order_units")
    if made is not None and made[0] is g and made[1] == mask:
        return made[2]
    units = _make_units(g, neutral)
    space.derived["order_units"] = (g, mask, units)
    return units


def _make_units(g: _Graph, neutral: list[bool]) -> _Units:
    """The units of the step ``g`` whose neutral nodes are ``neutral`` (``_units``)."""
    n = len(g.names)
    users: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):
        for a in g.preds[i]:
            users[a].append(i)
    # nodes that read only what lives through the whole step (a parameter's
    # mixed-precision cast, a product of a weight and the input): running one frees
    # nothing, so it runs just before the first node that reads it, in that node's unit
    source = [False] * n
    for i in range(n):
        source[i] = (
            not neutral[i]
            and not g.mutates[i]
            and all(k in g.pinned for k in g.reads[i])
            and all(neutral[v] for v in g.through[i])  # (not a view's reshard buffer)
            and all(neutral[a] or source[a] for a in g.preds[i])
        )

    def first_reader(i: int, passes) -> int | None:
        """The earliest (in traced order) node reading ``i`` through nodes ``passes``."""
        first = None
        stack, seen = list(users[i]), set()
        while stack:
            u = stack.pop()
            if u in seen:
                continue
            seen.add(u)
            if passes(u):
                stack.extend(users[u])
            elif first is None or u < first:
                first = u
        return first

    # a node stays in its part: aot_autograd's default partition takes every node up to
    # the last forward one as the forward, by position
    backward = g.backward
    head_of = list(range(n))
    for i in range(n):
        if source[i]:
            c = first_reader(i, lambda u: neutral[u])
            head_of[i] = i if c is None or backward[c] != backward[i] else c
    hang: dict[int, list[int]] = {}
    for i in range(n):
        if neutral[i]:
            c = first_reader(i, lambda u: neutral[u])
            if c is None or backward[c] != backward[i]:  # at the end of its part
                c = END if backward[i] else END_OF_FORWARD
            hang.setdefault(c, []).append(i)
    # a node's nearest non-neutral ancestors, through neutral nodes
    through: list[set[int]] = [set() for _ in range(n)]
    members: dict[int, list[int]] = {}
    preds: dict[int, set[int]] = {}
    for i in range(n):
        acc: set[int] = set()
        for a in g.preds[i]:
            if neutral[a]:
                acc |= through[a]
            else:
                acc.add(a)
        if neutral[i]:
            through[i] = acc
            continue
        h = head_of[i]
        members.setdefault(h, []).append(i)
        preds.setdefault(h, set()).update(head_of[a] for a in acc)
    heads = sorted(members)
    # a gradient's view runs as soon as what it views is made, not at the backward's end:
    # its bucket (passes/buckets) is issued after it
    after = {i: sorted(through[i]) for i in hang.get(END, ()) if through[i]}
    if after:
        hang[END] = [i for i in hang[END] if i not in after]
    return _Units(
        heads=heads,
        members=members,
        preds={h: sorted(preds[h] - {h}) for h in heads},
        hang=hang,
        after=after,
    )


def _segments(searched: list[int], spreds) -> list[list[int]]:
    """Split ``searched`` (in traced order; its dependencies on nodes before it are met)
    at its key points (module docstring)."""
    idx = {v: k for k, v in enumerate(searched)}
    m = len(searched)
    anc = [0] * m
    for k, v in enumerate(searched):
        a = 0
        for u in spreds[v]:
            if u in idx:
                a |= anc[idx[u]] | (1 << idx[u])
        anc[k] = a
    desc = [0] * m
    succ: list[list[int]] = [[] for _ in range(m)]
    for k, v in enumerate(searched):
        for u in spreds[v]:
            if u in idx:
                succ[idx[u]].append(k)
    for k in range(m - 1, -1, -1):
        d = 0
        for s in succ[k]:
            d |= desc[s] | (1 << s)
        desc[k] = d
    segments: list[list[int]] = []
    cur: list[int] = []
    for k, v in enumerate(searched):
        if anc[k].bit_count() + desc[k].bit_count() == m - 1:  # a key point
            if cur:
                segments.append(cur)
            segments.append([v])
            cur = []
        else:
            cur.append(v)
    if cur:
        segments.append(cur)
    return segments


def _order_segment(
    p: _Problem, seg: list[int], units: _Units, done: int, live: int, beam: int
) -> tuple[list[int], bool]:
    """The order of the units ``seg`` of least peak after ``done`` (module docstring);
    whether the search was exact."""
    inside = set(seg)
    succ: dict[int, list[int]] = {v: [] for v in seg}
    pred_mask: dict[int, int] = {}
    for v in seg:
        m = 0
        for u in units.preds[v]:
            if u in inside:
                succ[u].append(v)
                m |= 1 << u
        pred_mask[v] = m
    ready0 = tuple(v for v in seg if pred_mask[v] == 0)
    members = units.members
    # a layer: units run (by head) -> (peak so far, live bytes, nodes run, ready heads,
    # parent, head run)
    layer: dict[int, tuple] = {0: (0, live, done, ready0, None, None)}
    history: list[dict[int, tuple]] = []
    exact = True
    for _ in range(len(seg)):
        nxt: dict[int, tuple] = {}
        for key, (peak, lv, d, ready, _, _) in layer.items():
            for v in ready:
                np_, nd, after = p.peak_of(members[v], d, lv)
                np_ = max(peak, np_)
                nkey = key | (1 << v)
                old = nxt.get(nkey)
                if old is not None and (old[0], old[1]) <= (np_, after):
                    continue
                nr = tuple(r for r in ready if r != v) + tuple(
                    s for s in succ[v] if pred_mask[s] & ~nkey == 0
                )
                nxt[nkey] = (np_, after, nd, nr, key, v)
        if len(nxt) > beam:
            exact = False
            # least peak, then least live, then the set that is earliest in traced order
            keep = sorted(nxt, key=lambda k: (nxt[k][0], nxt[k][1], k))[:beam]
            nxt = {k: nxt[k] for k in keep}
        history.append(layer)
        layer = nxt
    final = min(layer, key=lambda k: (layer[k][0], k))
    seq: list[int] = []
    key = final
    for past in reversed(history + [layer]):
        entry = past[key]
        if entry[5] is None:
            break
        seq.append(entry[5])
        key = entry[4]
    seq.reverse()
    return seq, exact


def _run_units(p: _Problem, heads: Sequence[int], units: _Units, done: int, live: int):
    """(peak, nodes run after, live after) running the units ``heads`` after ``done``."""
    peak = 0
    for h in heads:
        mine, done, live = p.peak_of(units.members[h], done, live)
        peak = max(peak, mine)
    return peak, done, live


def order_step(
    space: StrategySpace,
    gm: torch.fx.GraphModule,
    plan: Plan,
    *,
    beam: int = BEAM,
    window: int = WINDOW,
) -> Ordering:
    """The order of least peak memory for ``plan``'s step (module docstring)."""
    p = _Problem(space, gm, plan)
    n = len(p.names)
    traced = list(range(n))
    traced_peak, held = p.sweep(traced)
    unsearched = {"segments": 0, "searched": 0, "exact": 0, "largest": 0, "moved": 0}
    if plan.recompute:
        return Ordering(list(space.order), traced_peak, traced_peak, unsearched)
    p.searchable()
    units = _units(p)
    segments = units.segments(p.space, p.names)
    # a segment larger than a window is ordered a window of traced units at a time (each
    # window's nodes are closed under dependencies with everything traced before it)
    # (a segment of one unit is a key point: the set before it is fixed)
    cut = [(seg[k : k + window], len(seg) <= window, len(seg) == 1)
           for seg in segments for k in range(0, len(seg), window)]  # fmt: skip
    segments = [c[0] for c in cut]
    # the live set where a segment starts is the same whatever order the others take:
    # the step's peak is the largest segment peak, so only the segment at the peak is
    # searched, then the one at the new peak, until the one at the peak gains nothing
    seqs: list[list[int]] = []
    starts: list[tuple[int, int]] = []
    heap: list[tuple[int, int]] = []
    done, live = 0, p.base
    # "Bound": the bytes at the points every order running the forward first shares, under
    # the search's model (a key point: the same set of nodes runs before it; the whole
    # forward, held into the backward), read off the same run of the segments
    bound = max(held, 0)  # (live(forward) under the step's model: a bound as well)
    for k, seg in enumerate(segments):
        starts.append((done, live))
        seqs.append(seg)
        peak_k, done, live = _run_units(p, seg, units, done, live)
        heapq.heappush(heap, (-peak_k, k))
        if cut[k][2]:  # (a window of one unit of a longer segment is no key point)
            bound = max(bound, peak_k)
        if k + 1 < len(segments) and not p.backward[seg[-1]] and p.backward[segments[k + 1][0]]:
            bound = max(bound, live)
    largest = max((len(s) for s in segments), default=0)
    if bound >= traced_peak:  # no order peaks lower: the traced one, nothing searched
        stats = {**unsearched, "segments": len(segments), "largest": largest}
        stats.update(traced_bytes=traced_peak, bound_bytes=bound, optimal=True)
        return Ordering(list(space.order), traced_peak, traced_peak, stats)
    searched: dict[int, bool] = {}  # segment -> searched exactly
    optimal = False  # the segment at the peak has no order of a lower peak ("Bound")
    while heap:
        neg, k = heapq.heappop(heap)
        if k in searched or len(segments[k]) == 1:
            # the peak's segment is as low as it gets
            optimal = cut[k][2] or (searched.get(k, False) and cut[k][1])
            break
        seq, exact = _order_segment(p, segments[k], units, *starts[k], beam)
        searched[k] = exact
        mine, _, _ = _run_units(p, seq, units, *starts[k])
        if mine < -neg:
            seqs[k] = seq
            heapq.heappush(heap, (-mine, k))
        else:
            optimal = exact and cut[k][1]
            break  # nothing gained where the peak is: the traced order stays
    chosen = [h for seq in seqs for h in seq]
    # each unit's nodes, each after the neutral nodes it reads first (in traced order
    # among themselves); at the end of each part, its neutral nodes read in no other
    full: list[int] = []
    for k, h in enumerate(chosen):
        if p.backward[h] and (k == 0 or not p.backward[chosen[k - 1]]):
            full.extend(units.hang.get(END_OF_FORWARD, ()))
        for v in units.members[h]:
            full.extend(units.hang.get(v, ()))
            full.append(v)
    if not any(p.backward[h] for h in chosen):
        full.extend(units.hang.get(END_OF_FORWARD, ()))
    full.extend(units.hang.get(END, ()))
    if units.after:  # each right after the last node it reads to run (traced order among them)
        place = {v: k for k, v in enumerate(full)}
        follow: dict[int, list[int]] = {}
        for i, anchors in sorted(units.after.items()):
            follow.setdefault(max(anchors, key=place.__getitem__), []).append(i)
        full = [w for v in full for w in (v, *follow.get(v, ()))]
    full = _topological(full, p.preds)
    if len(full) != n or any(p.backward[a] and not p.backward[b] for a, b in zip(full, full[1:])):
        raise AssertionError("order: a node out of its part")
    # (the traced order again, where no searched segment moved a node: its peak is known)
    peak = traced_peak if full == traced else p.sweep(full)[0]
    if peak >= traced_peak:
        full, peak = traced, traced_peak
    moved = sum(1 for k, v in enumerate(full) if k != v)
    stats = {
        "segments": len(segments),
        "searched": len(searched),
        "exact": sum(searched.values()),
        "largest": largest,
        "moved": moved,
        "traced_bytes": traced_peak,
        "bound_bytes": bound,
        "optimal": optimal,
    }
    return Ordering(p.placeholders + [p.names[i] for i in full], traced_peak, peak, stats)


def _topological(seq: list[int], preds: list[list[int]]) -> list[int]:
    """``seq`` with any node whose dependency comes later moved after it (a neutral node
    hung on a reader that runs before another of its inputs): stable otherwise."""
    placed: set[int] = set()
    waiting: dict[int, list[int]] = {}
    out: list[int] = []

    for first in seq:
        stack = [first]  # a node, then those that waited for it (no recursion)
        while stack:
            v = stack.pop()
            missing = [u for u in preds[v] if u not in placed]
            if missing:
                waiting.setdefault(missing[0], []).append(v)
                continue
            out.append(v)
            placed.add(v)
            stack.extend(reversed(waiting.pop(v, [])))
    if len(out) != len(seq):
        raise AssertionError("order: a dependency cycle")  # cannot happen on a DAG
    return out


def apply(gm: torch.fx.GraphModule, order: Sequence[str]) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose nodes run in ``order`` (every node but the output, each
    once; an empty ``order`` keeps ``gm``'s). The copy shares ``gm``'s submodules and
    node metadata."""
    if not order:
        return gm
    with warnings.catch_warnings():
        # NOTE: copying the graph's pytree codegen makes torch warn of its own LeafSpec
        # check (torch 2.13); nothing of ours is deprecated
        warnings.simplefilter("ignore", FutureWarning)
        graph = copy.deepcopy(gm.graph)  # fx's own copy: node metadata shared, codegen kept
    nodes = {n.name: n for n in graph.nodes}
    if len(order) != len(nodes) - 1 or set(order) != {
        n for n, x in nodes.items() if x.op != "output"
    }:
        raise ValueError("the order does not name every node of the step exactly once")
    prev = None
    for name in order:
        node = nodes[name]
        if prev is not None and prev.next is not node:
            prev.append(node)
        prev = node
    graph.lint()
    new = torch.fx.GraphModule(gm, graph)
    new.meta.update(gm.meta)
    return new

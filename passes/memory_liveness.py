"""The step's storages and their lives: the placement-free half of passes/memory's model.

Takes: the ``StrategySpace`` (passes/strategies: the step graph's nodes, their tensors,
edges, graph outputs and views), the order the step runs its nodes in, and the layers that
may be checkpointed (passes/remat).
Returns: what passes/memory's ``liveness`` assembles a ``Liveness`` from: the points of the
step and each storage's life before the graph outputs (``_LifeBase``), each ``Storage`` and
``ViewReshard``; and the bytes each of them holds under a choice of placements
(``Storage.nbytes``, ``optimizer_bytes``, ``view_held``, ``output_redistributions``), which
passes/memory's ``measure`` and passes/memory_bound's ``peak_bound`` both read. The sizes
are passes/memory_sizes'.

    storage(v)   = storage(input 0) if v's op returns a view or writes its input in place
                   (its schema's alias annotation; ``_unsafe_view``; ``getitem`` picks one
                   output of a multi-output node), else a new storage
    live(s, i)   = first(s) <= i <= last(s): from the node that makes storage s to the last
                   node that uses any tensor on it (graph outputs: to the end of the step;
                   passes/memory ``liveness``)

A storage's category: a placeholder's by its role (``parameters``, ``inputs``; the tangent
a temporary, live from its first read: the backward makes it), an op output made in the
forward and last read in the backward ``activations`` (saved for it; a recomputed copy
too), any other ``temporaries``.

Reshards into a view. A view (or an in-place op, or a ``getitem``: any node whose output
is on its first input's storage) whose first input is redistributed views the collective's
result, not its input's storage. So, where p != q on that edge:

    the buffer     size(q) lives on from the view to the last node that reads the view or
                   a view of it (graph outputs: to the end) (``ViewReshard``)
    the storage s  viewed: a read of s through a chain of views none of whose inputs is
                   redistributed keeps s alive, a read through any other chain does not
                   (``Storage.views``: s's last point is the latest of its direct reads
                   and the chains left whole)

This is exact for a given plan (passes/memory ``measure``; passes/order states the same on
sets of nodes). The storage's term is not linear in the edges (it is live through a chain
while no edge of the chain redistributes); the ILP bounds it (passes/solve, ``_held_var``):
one variable h per storage read past some point through one chain alone,
h >= size(s) - M * (the chain's redistributing pairs), exact at integer points, and
before that point it is counted whatever is chosen (an overestimate where the other
chains are cut too).

Checkpointing (passes/remat): the step in which any of the layers ``recompute`` lists may
be checkpointed. Its points are the nodes and, before a layer's first backward read, a copy
of every node it recomputes. A copy's storage, and the reads it makes of what it does not
recompute, count only when its fold group is checkpointed; an original's reads by the
backward (which then reads the copy), and the whole life of an original nothing in the
forward reads, count only when it is not (``Storage.when``). An input two layers' copies
read beyond its own last read is counted live to the later of them whatever is chosen (an
overestimate).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch.distributed.tensor import Replicate

from autopar.core import Recompute, Sink, StrategySpace, roles
from autopar.core.schedule import step_points

from .memory_sizes import (
    InPlacement,
    OutPlacement,
    Placements,
    local_bytes,
    state_bytes_per_element,
)
from .remat import COPY, storage_map, view_inputs, views_through

__all__ = [
    "Liveness",
    "Storage",
    "ViewReshard",
    "optimizer_bytes",
    "output_redistributions",
    "redistributes",
    "resharded_views",
    "view_held",
]


@dataclass(frozen=True, slots=True)
class Storage:
    """One storage of the step: made by output ``out`` of node ``owner``, live from node
    index ``first`` to ``last`` (inclusive), of global ``shape`` and ``dtype``.
    ``counted`` is False for a storage counted elsewhere (a tied parameter's later names).
    ``when``: ``(group, checkpointed)``: live only when that fold group's checkpointing
    (passes/remat) is ``checkpointed`` (None: always). ``views``: ``(chain, last)`` of
    each chain of views through which it is read (``chain``: the view read, the view it
    views, ..., up to a view of this storage) later than anything reads it directly (to
    point ``last``); ``base``: the last point it is read directly (or made). A reshard
    into a view's input makes that view, and the views of it, read a buffer of their
    own: the storage lives to ``last`` only through the chains none of whose views has
    its input redistributed ("Reshards into a view"); ``last`` is the latest of all."""

    owner: str
    out: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    first: int
    last: int
    category: str
    counted: bool = True
    when: tuple[str, bool] | None = None
    views: tuple[tuple[tuple[str, ...], int], ...] = ()
    base: int = -1

    def counts(self, recompute: Collection[str]) -> bool:
        """Live in the step whose checkpointed groups are ``recompute``."""
        return self.when is None or (self.when[0] in recompute) == self.when[1]

    def until(self, resharded: Callable[[str], bool]) -> int:
        """Its last point, where ``resharded(view)`` tells which views have their input
        redistributed."""
        return _until(self.last, self.base, self.views, resharded)

    def held_by(self) -> tuple[tuple[str, ...], int] | None:
        """``(chain, after)``: where one chain of views alone reads it after point
        ``after`` (the ILP's bound: live past ``after`` only when none of the chain's
        views has its input redistributed; until then, whatever is chosen)."""
        if not self.views:
            return None
        ordered = sorted(self.views, key=lambda cb: cb[1])
        after = max(self.base, ordered[-2][1] if len(ordered) > 1 else -1)
        return (ordered[-1][0], after) if ordered[-1][1] > after else None

    def nbytes(self, ps: Placements | None, mesh_shape) -> int:
        """Bytes one rank holds of this storage when its owner's output is placed ``ps``."""
        return local_bytes(self.shape, self.dtype, ps, mesh_shape) if self.counted else 0


def _until(last: int, base: int, views, resharded: Callable[[str], bool]) -> int:
    """``last``, or where ``views`` (``(chain, last)``) are read through views some of
    which ``resharded`` cuts: the latest of ``base`` and the chains left whole."""
    if not views:
        return last
    kept = (b for chain, b in views if not any(map(resharded, chain)))
    return max([base, *kept])


@dataclass(frozen=True, slots=True)
class ViewReshard:
    """A redistribution into a view's first input (the view at point ``at``, node ``node``,
    reading output ``out`` of ``src``) whose buffer the view's storage then is: held from
    ``first`` to ``last`` (the points after ``at`` up to the last read of the view or a
    view of it), when ``when`` holds (``Storage.when``); ``category`` at the peak.
    ``views`` and ``base``: as a ``Storage``'s (its reads through views of the view, one
    of which may have its input redistributed too: then up to ``until``)."""

    at: int
    node: str
    src: str
    out: int
    first: int
    last: int
    category: str
    when: tuple[str, bool] | None = None
    views: tuple[tuple[tuple[str, ...], int], ...] = ()
    base: int = -1

    def until(self, resharded: Callable[[str], bool]) -> int:
        """Its last point (``Storage.until``)."""
        return _until(self.last, self.base, self.views, resharded)


@dataclass
class Liveness:
    """The placement-free half of the model (module docstring).

    Attributes:
        order: the points of the step: node names in step order, and the copies of the
            nodes a layer may recompute (``recompute:<node>``, before the layer's first
            backward read) (``bytes(i)`` is after ``order[i]``; point ``len(order)`` is the
            step's return).
        storages: every storage, with its life.
        params: placeholders of the stored parameters (a tied one once): optimizer state.
        space: the strategy space it was read from (its tensors and edges).
        node_at: the node each point runs (a copy: its original).
        unit_at: a copy's fold group (None: a node of the step itself).
        groups: fold group -> its layers' ``Recompute``s (passes/remat).
    """

    order: list[str]
    storages: list[Storage]
    params: list[str]
    space: StrategySpace
    node_at: list[str] = field(default_factory=list)
    unit_at: list[str | None] = field(default_factory=list)
    groups: dict[str, list[Recompute]] = field(default_factory=dict)
    early: dict[int, int] = field(default_factory=dict)
    """Graph output position -> the point whose end issues its bucket (passes/buckets)."""
    held: dict[int, int] = field(default_factory=dict)
    """Graph output position -> the last point its bucket's flat input is held to, where
    that is past the issue (passes/buckets: a reduce-scatter waited for later)."""
    prefetched: dict[tuple[str, str], int] = field(default_factory=dict)
    """``(producer, consumer)`` of a reshard issued early -> the point whose end issues it
    (passes/prefetch)."""
    viewed: list[ViewReshard] = field(default_factory=list)
    """What a redistribution into each view's first input holds after the view runs
    ("Reshards into a view")."""

    OUTPUT = "output"
    """The name of the last point, ``len(order)``: where the step returns (``bytes(out)``,
    passes/memory)."""

    _inputs: list[tuple[int, str, int, str, int, str | None]] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    _touching: tuple[dict, dict, dict] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def tensor_inputs(self) -> list[tuple[int, str, int, str, int, str | None]]:
        """``(i, node, j, producer, output, group)`` of each tensor input j of each point i
        that runs an operator (``reshard_inputs``; ``group``: ``unit_at[i]``), in point
        order: made once, read by passes/memory's ``measure`` at each plan it sizes (an overlap round's)."""
        if self._inputs is None:
            self._inputs = _tensor_inputs(self.space, self.node_at, self.unit_at)
        return self._inputs

    def touching(
        self,
    ) -> tuple[
        dict[str, list[Storage]],
        dict[str, list[tuple[int, str, int, str, int, str | None]]],
        dict[str, list[ViewReshard]],
    ]:
        """Each node's storages (by owner), the tensor inputs it reads or feeds
        (``tensor_inputs``' entries, by consumer and by producer), and the ``viewed``
        entries it runs or feeds: made once, read by passes/memory_bound's ``peak_bound``."""
        if self._touching is None:
            views = view_inputs(self.space)
            owned: dict[str, list[Storage]] = defaultdict(list)
            for s in self.storages:
                owned[s.owner].append(s)
                for v in {v for chain, _ in s.views for v in chain}:
                    owned[v].append(s)  # (its life: by whether v's input is redistributed)
                    owned[views[v][0]].append(s)
            reads: dict[str, list] = defaultdict(list)
            for entry in self.tensor_inputs():
                reads[entry[1]].append(entry)
                if entry[3] != entry[1]:
                    reads[entry[3]].append(entry)
            viewed: dict[str, list[ViewReshard]] = defaultdict(list)
            for h in self.viewed:
                viewed[h.node].append(h)
                viewed[h.src].append(h)
                for v in {v for chain, _ in h.views for v in chain}:
                    viewed[v].append(h)  # (its life: by whether v's input is redistributed)
                    viewed[views[v][0]].append(h)
            self._touching = (dict(owned), dict(reads), dict(viewed))
        return self._touching

    def live_at(self, i: int) -> list[Storage]:
        """The storages live at point ``i`` (``len(order)``: the step's return)."""
        return [s for s in self.storages if s.first <= i <= s.last]

    def viewed_at(self, i: int) -> list[ViewReshard]:
        """The ``viewed`` entries that hold their buffer at point ``i``."""
        return [h for h in self.viewed if h.first <= i <= h.last]

    def point_name(self, i: int) -> str:
        return self.order[i] if i < len(self.order) else self.OUTPUT

    def reshard_inputs(self, i: int) -> list[tuple[int, str, int]]:
        """``(j, producer, output)`` of each tensor input of node ``order[i]``: where a
        collective buffer appears when input j is redistributed."""
        return [(j, src, so) for j, (src, so) in enumerate(self.space.in_sources[self.node_at[i]])]

    def shown(self, i: int, recompute: Collection[str]) -> bool:
        """Point ``i`` runs in the step whose checkpointed groups are ``recompute``."""
        g = self.unit_at[i] if i < len(self.unit_at) else None
        return g is None or g in recompute


def _tensor_inputs(
    space: StrategySpace, node_at: list[str], unit_at: list[str | None]
) -> list[tuple[int, str, int, str, int, str | None]]:
    """``Liveness.tensor_inputs`` of the points ``node_at`` (their groups ``unit_at``)."""
    targets, in_sources = space.targets, space.in_sources
    return [
        (i, name, j, src, so, unit_at[i] if i < len(unit_at) else None)
        for i, name in enumerate(node_at)
        if targets[name] != "placeholder"
        for j, (src, so) in enumerate(in_sources[name])
    ]


_WHOLE = ("parameters", "inputs", "gradients")
"""Categories that live through the step's end whatever reads them."""


class _LifeBase:
    """``liveness``'s half that depends on the order and the checkpointed layers alone:
    the points, each storage's life ``[first, last, category]`` before the graph outputs
    (``life``, in the order made) and its last reads under each checkpointing condition,
    and the storages of those no graph output reads (``kept``, made once)."""

    def __init__(self, space: StrategySpace, recompute: Sequence[Recompute], order) -> None:
        order = space.order if order is None else order
        groups: dict[str, list[Recompute]] = defaultdict(list)
        unit: dict[str, str] = {}  # a node recomputed -> its group
        moved: dict[str, str] = {}  # a node that then runs only in the backward -> its group
        for rec in recompute:
            groups[rec.group].append(rec)
            unit.update((n, rec.group) for n in rec.nodes)
            moved.update((n, rec.group) for n in rec.moved)
        # the points: every node, and before a layer's first backward read, its copies
        at = step_points(order, recompute)
        points = [p for p, _, _ in at]
        node_at = [n for _, n, _ in at]
        unit_at = [g for _, _, g in at]
        storage_of = storage_map(space)
        # storage key -> [first, last, category]: a copy's storages are keyed by the copy
        life: dict[tuple[str, int], list] = {}
        # storage key -> condition -> the last point at which a read under it keeps it alive
        cond_last: dict[tuple[str, int], dict[tuple[str, bool], int]] = defaultdict(dict)
        params: list[str] = []

        tangents: set[tuple[str, int]] = set()
        views = view_inputs(space)
        # a view's point -> condition -> the chain of views of it read through (empty:
        # itself) -> the last point ("Reshards into a view"; a copy's views: their copies')
        through: dict[str, dict] = defaultdict(dict)

        def mark(src: str, i: int, when=None, copied: str | None = None) -> None:
            below: list[str] = []
            for v in views_through(views, src):
                at = through[COPY + v if copied is not None and unit.get(v) == copied else v]
                chains = at.setdefault(when, {})
                chain = tuple(below)
                chains[chain] = max(chains.get(chain, -1), i)
                below.append(v)

        # storage key -> the chain of views it is read through (empty: directly) -> the
        # last point
        via: dict[tuple[str, int], dict[tuple[str, ...], int]] = defaultdict(dict)

        def through_view(key, src: str, i: int) -> None:
            chain = tuple(views_through(views, src))
            at = via[key]
            at[chain] = max(at.get(chain, -1), i)

        def read(key, i: int, when=None) -> None:
            if key not in life:  # (an output that is not a tensor has no storage)
                return
            if key in tangents:  # the backward makes it: live from its first read
                tangents.discard(key)
                life[key][0] = i
            if when is None:
                life[key][1] = max(life[key][1], i)
            else:
                cond_last[key][when] = max(cond_last[key].get(when, -1), i)

        for i, (point, name) in enumerate(zip(points, node_at)):
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
                    if role == roles.TANGENT:
                        tangents.add((name, 0))
                life[(name, 0)] = [i, i, category]
                continue
            g = unit_at[i]
            for src, so in dict.fromkeys(space.in_sources[name]):
                key = storage_of.get((src, so))
                if key is None:
                    continue
                if g is not None:  # a copy reads the copies of its inputs, and the rest as is
                    if unit.get(src) == g:
                        read((COPY + key[0], key[1]), i, (g, True))
                    else:
                        read(key, i, (g, True))
                    mark(src, i, (g, True), g)
                elif role == roles.BACKWARD and src in unit:  # the original, or its copy
                    read(key, i, (unit[src], False))
                    read((COPY + key[0], key[1]), i, (unit[src], True))
                    mark(src, i, (unit[src], False))
                    mark(src, i, (unit[src], True), unit[src])
                else:
                    read(key, i)
                    mark(src, i)
                    through_view(key, src, i)
            if g is None:
                made = [(name, idx) for idx in range(len(space.shapes[name]))]
            else:
                made = [(point, idx) for idx in range(len(space.shapes[name]))]
            for key in made:
                orig = (name, key[1])
                if orig not in storage_of:
                    continue
                if storage_of[orig] != orig:  # a view: no storage of its own
                    continue
                category = "forward" if role == roles.FORWARD else "temporaries"
                if g is not None:
                    category = "recomputed"
                life[key] = [i, i, category]
        for sink in space.sinks:  # (a graph output: to the end, even where bucketed)
            mark(sink.src, len(points))
        self.viewed = _view_reshards(space, points, node_at, unit_at, views, through)
        # (not the space: kept in ``space.derived``, this would make it a cycle, which only
        # the garbage collector frees, with all the space holds)
        self.points, self.node_at, self.unit_at = points, node_at, unit_at
        self.point_of = {p: i for i, p in enumerate(points)}
        self.life, self.cond_last, self.params, self.groups = life, cond_last, params, dict(groups)
        self.via = via
        self.moved = moved
        self._kept: dict[tuple[str, int], list[Storage]] = {}
        self._inputs: list[tuple[int, str, int, str, int, str | None]] | None = None

    def tensor_inputs(
        self, space: StrategySpace
    ) -> list[tuple[int, str, int, str, int, str | None]]:
        """``Liveness.tensor_inputs`` of these points (made once: the solver's step and the
        memory stage's, buckets and prefetches aside, run the same points)."""
        if self._inputs is None:
            self._inputs = _tensor_inputs(space, self.node_at, self.unit_at)
        return self._inputs

    def kept(self, space: StrategySpace, key: tuple[str, int]) -> list[Storage]:
        """The storages of ``key``, which no graph output reads (made once)."""
        made = self._kept.get(key)
        if made is None:
            made = self._kept[key] = self.storages_of(space, key, self.life[key])
        return made

    def storages_of(
        self, space: StrategySpace, key: tuple[str, int], life: list, output: bool = False
    ) -> list[Storage]:
        """The storages of ``key`` living ``life`` (``[first, last, category]``; ``output``:
        a graph output's): one, or one per checkpointing condition under which it is read
        later ("Checkpointing")."""
        node_at, unit_at, end = self.node_at, self.unit_at, len(self.points)
        first, last, category = life
        copy = key[0].startswith(COPY)
        owner = key[0][len(COPY) :] if copy else key[0]
        conds = self.cond_last.get(key, {})
        full = max([last, *conds.values()])
        if category == "forward":
            backward = full < end and space.roles[node_at[full]] == roles.BACKWARD
            category = "activations" if backward else "temporaries"
        elif category == "recomputed":
            category = "activations"
        if category in ("parameters", "inputs"):
            first, last = 0, end
        shape, dtype = space.tensor(owner, key[1])
        counted = owner not in space.aliases
        base = Storage(owner, key[1], tuple(shape), dtype, first, last, category, counted)
        if copy:  # only when its group is checkpointed
            end_copy = max(conds.values(), default=first)
            return [replace(base, last=end_copy, when=(unit_at[first], True))]
        if owner in self.moved:  # not run at all in the forward of the checkpointed step
            end_orig = max([last, *conds.values()])
            return [replace(base, last=end_orig, when=(self.moved[owner], False))]
        later = {c: b for c, b in conds.items() if b > last}
        if len(later) > 1:
            # read under several conditions (two layers' copies read it): counted live to
            # the latest of them whatever is chosen (an overestimate)
            base, later = replace(base, last=max(later.values())), {}
        elif not conds and category not in _WHOLE and space.targets[owner] != "placeholder":
            # read through views: how long depends on which of them read a buffer of their
            # own (``Storage.views``; not where it is a graph output, or read under a
            # checkpointing condition: the latest read counts, an overestimate)
            reads = self.via.get(key, {})
            rest = max(first, reads.get((), first))
            views = tuple((c, b) for c, b in reads.items() if c and b > rest)
            if views and not output:
                base = replace(base, views=views, base=rest)
        return [base, *(replace(base, first=last + 1, last=b, when=c) for c, b in later.items())]


def _view_reshards(
    space: StrategySpace,
    points: list[str],
    node_at: list[str],
    unit_at: list[str | None],
    views: Mapping[str, tuple[str, int]],
    through: Mapping[str, dict],
) -> list[ViewReshard]:
    """The ``ViewReshard`` of each point that runs a view (``through``: each view's point
    -> condition -> the chain of views of it read through -> the last point)."""
    end = len(points)
    found = []
    for i, (point, name) in enumerate(zip(points, node_at)):
        if name not in views:
            continue
        src, so = views[name]
        g = unit_at[i]
        own = None if g is None else (g, True)
        conds = dict(through.get(point, {}))
        mine = conds.pop(own, {})
        base = max(i, mine.get((), i))
        chains = tuple((c, b) for c, b in mine.items() if c and b > base)
        last = max([base, *(b for _, b in chains)])
        later = {c: max(d.values()) for c, d in conds.items()}
        later = {c: b for c, b in later.items() if b > last}
        if len(later) > 1:  # (as ``storages_of``: live to the latest, an overestimate)
            last, later, chains = max(later.values()), {}, ()
        held = [(i + 1, last, own, chains, base)] if last > i else []
        held += [(last + 1, b, c, (), -1) for c, b in later.items()]
        for first, to, when, cut, before in held:
            saved = to < end and space.roles[node_at[to]] == roles.BACKWARD
            saved = saved and space.roles[name] != roles.BACKWARD
            category = "activations" if saved else "collective_buffers"
            found.append(ViewReshard(i, name, src, so, first, to, category, when, cut, before))
    return found


def optimizer_bytes(storage: Storage, ps: Placements | None, mesh_shape, optimizer: str) -> int:
    """Optimizer state one rank holds for a parameter shard (``state_bytes_per_element``)."""
    elements = storage.nbytes(ps, mesh_shape) // storage.dtype.itemsize
    return elements * state_bytes_per_element(optimizer)


def output_redistributions(
    lv: Liveness, out_ps: OutPlacement, sinks: Iterable[Sink] | None = None
) -> list[tuple]:
    """``(node, output, placement, category)`` of each graph output (of ``sinks``, where
    given) that leaves the step with another placement than it is made with
    (``bytes(out)``, passes/memory)."""
    space = lv.space
    found = []
    for sink in space.sinks if sinks is None else sinks:
        if sink.position in lv.early:  # (its bucket: passes/memory ``measure``)
            continue
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


def redistributes(p: Placements | None, q: Placements | None) -> bool:
    """Placements ``p`` redistributed to ``q``."""
    return p is not None and q is not None and p is not q and tuple(p) != tuple(q)


def resharded_views(
    space: StrategySpace, out_ps: OutPlacement, in_ps: InPlacement
) -> Callable[[str], bool]:
    """Whether a view's input is redistributed into it."""
    views = view_inputs(space)
    return lambda view: redistributes(out_ps(*views[view]), in_ps(view, 0))


def view_held(lv: Liveness, h: ViewReshard, out_ps: OutPlacement, in_ps: InPlacement, nbytes):
    """The bytes ``h`` holds under the placements ``out_ps`` / ``in_ps`` (``nbytes``: a
    ``sizer``): the source's size as the view reads it, where that is redistributed."""
    q = in_ps(h.node, 0)
    if not redistributes(None if q is None else out_ps(h.src, h.out), q):
        return 0
    shape, dtype = lv.space.tensor(h.src, h.out)
    return nbytes(tuple(shape), dtype, q)

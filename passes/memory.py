"""Step memory: the bytes one rank holds after every node of the planned step, by category.

Takes: the ``StrategySpace`` (passes/strategies: the step graph's nodes in order, their
tensors, edges and graph outputs) and a ``Plan``, or any choice of one strategy per node.
Returns: a ``MemoryReport`` with the peak per rank, the node at the peak, what is live there
by category, and the timeline. passes/solve bounds the same quantity in its ILP.

Two parts. ``liveness(space)`` depends on the graph alone, not on the placements: which
storage each tensor lives on, and from which node to which node it is live. ``measure``
sizes those storages under a choice of placements and sweeps over the step. The model of the
emitted step (codegen runs the joint graph on local tensors, in its traced order or the one
passes/order chose, ``plan.order``):

    size(s, P)   = prod(local_shape(shape(s), P(s), mesh)) * itemsize(s)
                   P(s): the placement of the output that made storage s (placeholders:
                   their own placement)
    storage(v)   = storage(input 0) if v's op returns a view or writes its input in place
                   (its schema's alias annotation; ``_unsafe_view``; ``getitem`` picks one
                   output of a multi-output node), else a new storage
    live(s, i)   = first(s) <= i <= last(s): from the node that makes storage s to the last
                   node that uses any tensor on it (graph outputs: to the end of the step)
    redistribution of tensor input j of node i from p to q != p:
                   collective buffers of reshard(p, q) bytes, live at node i only:
                   size(q), and for a gather along a dim that is not the outermost
                   in memory, size(q) more (the collective gathers along the outermost;
                   its result is then copied along the dim; a reduce-scatter along one:
                   its input laid out first). DTensor's steps one mesh axis at a time;
                   codegen redistributes a permuted tensor in its memory order
                   (``StrategySpace.layouts``), others made contiguous
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

Reshards into a view. A view (or an in-place op, or a ``getitem``: any node whose output
is on its first input's storage) whose first input is redistributed views the collective's
result, not its input's storage. So, where p != q on that edge:

    the buffer     size(q) lives on from the view to the last node that reads the view or
                   a view of it (graph outputs: to the end) (``Liveness.viewed``)
    the storage s  viewed: a read of s through a chain of views none of whose inputs is
                   redistributed keeps s alive, a read through any other chain does not
                   (``Storage.views``: s's last point is the latest of its direct reads
                   and the chains left whole)

This is exact for a given plan (``measure``; passes/order states the same on sets of
nodes). The storage's term is not linear in the edges (it is live through a chain while
no edge of the chain redistributes); the ILP bounds it (passes/solve, ``_held_var``): one
variable h per storage read past some point through one chain alone,
h >= size(s) - M * (the chain's redistributing pairs), exact at integer points, and
before that point it is counted whatever is chosen (an overestimate where the other
chains are cut too).

Checkpointing (passes/remat): ``liveness(space, recompute)`` holds the step in which any of
the layers ``recompute`` lists may be checkpointed. Its points are the nodes and, before a
layer's first backward read, a copy of every node it recomputes. A copy's storage, and the
reads it makes of what it does not recompute, count only when its fold group is
checkpointed; an original's reads by the backward (which then reads the copy), and the
whole life of an original nothing in the forward reads, count only when it is not
(``Storage.when``). ``measure(..., recompute)`` sizes the step with those groups
checkpointed, and its timeline leaves out the copies of the others; with none, it is the
step without checkpointing. An input two layers' copies read beyond its own last read is
counted live to the later of them whatever is chosen (an overestimate).

Buckets (passes/buckets): a gradient in a bucket lives from its node to the node after
which its bucket is issued (``Liveness.early``), not to the end; at that point the bucket's
flattened input (the members' sizes as made) is a collective buffer, and from the next
point to the end its reduced output (the members' sizes as they leave) counts as
gradients. Those outputs are left out of ``bytes(out)``. A reduce-scatter bucket whose
wait is later (on CUDA: the process group holds its input to the wait, the entry's
``wait_after`` or the step's end; a bucket of several steps whose first is a
reduce-scatter: to its second step's ``step_after``; ``Liveness.held``) holds its flat
input to that point.

Prefetch (passes/prefetch): a reshard issued ahead of its consumer (the entry's
``issue_after``) holds its output, a collective buffer, from the point after its issue to
its consumer (``Liveness.prefetched``), not at the consumer alone.

Categories: ``parameters`` (parameters and buffers, the whole step; a tied parameter once),
``inputs`` (inputs and targets, the whole step), ``gradients`` (a parameter's gradient, from
its node to the end: the optimizer reads it), ``activations`` (made in the forward, last used
in the backward: saved for it; and a recomputed copy), ``temporaries`` (every other op output,
and the tangent, from its first read: the backward makes it),
``collective_buffers``, ``optimizer_state`` (per parameter shard: AdamW two float32 moments,
SGD with momentum one, none zero; constant over the step).

Layout: ``arena_bytes`` places every storage (and collective buffer) at an offset of one
arena per rank (passes/layout) in the order the step runs; the peak counts no
fragmentation, the arena does. The solver's own measurements of its plans (passes/solve,
which reads their peaks alone) are not laid out (``layout=False``: ``arena_bytes`` 0).

A bound without a sweep: ``peak_bound`` takes a measured plan's peak to another plan that
places some nodes otherwise. Each storage, reshard and graph output lives over the same
points under both, so the other's total at any point is the first's plus their changes
there; the first's peak, plus the optimizer state's change and every one of them that grows,
is at least the other's peak (the solver's overlap rounds check their plans' budget so).

What it leaves out: the allocator's rounding and fragmentation, and kernels' own workspace.
It overcounts a node that redistributes an input read there for the last time: the step
frees that input after its collective, before the node's outputs are made, where the model
counts both at the node (memory_check's gpt on (2, 2): 3% over).
Where it can be off: the emitted step runs aot_autograd's partitioned forward and backward
(``default_partition``: it saves what the backward reads, and keeps the joint graph's order
of each part); benchmarks/memory_check.py measures by how much. Mixed precision needs nothing
of its own: the compute copies are ``_to_copy`` outputs of the graph (passes/trace), sized
in their dtype like any other tensor; the optimizer state is float32 per element of the
stored (float32) parameters.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch.distributed.tensor import Replicate

from autopar.core import Plan, Recompute, Sink, StrategySpace, local_shape, parse_placements, roles
from autopar.core.schedule import bucket_site, edge_ends, step_points

from .layout import arena
from .remat import COPY, storage_map, view_inputs, views_through

__all__ = [
    "CATEGORIES",
    "Liveness",
    "MemoryReport",
    "OPTIMIZERS",
    "Storage",
    "ViewReshard",
    "bucketed",
    "held_inputs",
    "liveness",
    "local_bytes",
    "measure",
    "plan_placements",
    "prefetched",
    "reshard_bytes",
    "resharder",
    "simulate",
    "state_bytes_per_element",
    "view_held",
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


def reshard_bytes(
    shape,
    dtype: torch.dtype,
    p: Placements,
    q: Placements,
    mesh_shape,
    layout: Sequence[int] | None = None,
) -> int:
    """The most bytes one rank holds at once while a tensor of global ``shape`` is
    redistributed from ``p`` to ``q``, its source left out (module docstring,
    ``reshard(p, q)``): DTensor's steps, one mesh axis at a time in mesh order; during a
    step, the step before's result (freed after it) and the step's own buffers: its result,
    and beside it, for a gather along a dim that is not the outermost in memory (``layout``:
    the dims from the outermost, ``StrategySpace.layouts``; None: in their own order; codegen
    redistributes a permuted tensor in its memory order), the gathered buffer (the
    collective gathers along the outermost; the result is its copy laid out along the dim),
    and for a reduce-scatter along one, its input laid out along the outermost. At least
    the result, ``size(q)``."""

    def inner(dim: int) -> bool:
        return (dim if layout is None else list(layout).index(dim)) != 0

    cur = list(p)
    held = most = 0  # (the step before's result; the first step's input is the source)
    for a, (src, dst) in enumerate(zip(p, q)):
        if src == dst:
            continue
        before = local_bytes(shape, dtype, tuple(cur), mesh_shape)
        cur[a] = dst
        after = local_bytes(shape, dtype, tuple(cur), mesh_shape)
        work = after
        if src.is_shard() and dst.is_replicate() and inner(src.dim):
            work = 2 * after  # the gathered buffer and its copy along the dim
        elif src.is_partial() and dst.is_shard() and inner(dst.dim):
            work = before + after  # the input laid out along the outermost dim, the result
        most = max(most, held + work)
        held = after
    return max(most, local_bytes(shape, dtype, q, mesh_shape))


def resharder(
    mesh_shape,
) -> Callable[[tuple, torch.dtype, Placements, Placements, tuple | None], int]:
    """``reshard_bytes`` on ``mesh_shape``, each (shape, p, q, layout) once per pair of
    placements objects (kept beside, as ``sizer`` keeps its own)."""
    made: dict[tuple, tuple] = {}

    def nbytes(shape: tuple, dtype: torch.dtype, p: Placements, q: Placements, layout) -> int:
        k = (shape, dtype, id(p), id(q), layout)
        got = made.get(k)
        if got is None:
            got = made[k] = (p, q, reshard_bytes(shape, dtype, p, q, mesh_shape, layout))
        return got[2]

    return nbytes


def sizer(mesh_shape) -> Callable[[tuple, torch.dtype, Placements | None], int]:
    """``local_bytes`` on ``mesh_shape``, each shape sized once per placements object: a
    deep step's layers share theirs (a fold group's strategies, a plan's parsed texts).
    Each object is kept beside its size, so that its id names it as long as the sizer
    lives (one made afresh at each call and freed would hand its id to the next)."""
    sized: dict[tuple, tuple] = {}

    def nbytes(shape: tuple, dtype: torch.dtype, ps: Placements | None) -> int:
        k = (shape, dtype, id(ps))
        got = sized.get(k)
        if got is None:
            got = sized[k] = (ps, local_bytes(shape, dtype, ps, mesh_shape))
        return got[1]

    return nbytes


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
    """The name of the last point, ``len(order)``: where the step returns (``bytes(out)``)."""

    _inputs: list[tuple[int, str, int, str, int, str | None]] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    _touching: tuple[dict, dict, dict] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def tensor_inputs(self) -> list[tuple[int, str, int, str, int, str | None]]:
        """``(i, node, j, producer, output, group)`` of each tensor input j of each point i
        that runs an operator (``reshard_inputs``; ``group``: ``unit_at[i]``), in point
        order: made once, read by ``measure`` at each plan it sizes (an overlap round's)."""
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
        entries it runs or feeds: made once, read by ``peak_bound``."""
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
        points: the ``Liveness`` point of each timeline entry (the copies of a layer not
            checkpointed are not in the step).
        recompute: the fold groups checkpointed (passes/remat).
        arena_bytes: one arena holding every storage of the step at an offset of its own
            (passes/layout), plus the optimizer state: at least ``peak_bytes``; the rest
            is what a static layout loses to fragmentation. 0 where not laid out
            (``measure``'s ``layout``).
    """

    peak_bytes: int
    peak_node: str
    at_peak: dict[str, int]
    timeline: list[tuple[str, int]] = field(default_factory=list)
    by_category: dict[str, list[int]] = field(default_factory=dict)
    optimizer: str = "adamw"
    points: list[int] = field(default_factory=list)
    recompute: list[str] = field(default_factory=list)
    arena_bytes: int = 0

    @property
    def peak_index(self) -> int:
        """The peak's position in ``timeline``."""
        return next(i for i, (n, _) in enumerate(self.timeline) if n == self.peak_node)

    @property
    def peak_point(self) -> int:
        """The peak's point of the ``Liveness`` measured."""
        return self.points[self.peak_index]

    def dominant(self) -> str:
        """The category holding the most bytes at the peak."""
        return max(self.at_peak, key=lambda k: self.at_peak[k])

    def to_dict(self, *, timeline: bool = True) -> dict:
        d = {
            "peak_bytes": self.peak_bytes,
            "peak_node": self.peak_node,
            "at_peak": dict(self.at_peak),
            "optimizer": self.optimizer,
            "recompute": list(self.recompute),
            "arena_bytes": self.arena_bytes,
        }
        if timeline:
            d["timeline"] = {
                "nodes": [n for n, _ in self.timeline],
                **{c: list(v) for c, v in self.by_category.items()},
            }
        return d


def liveness(
    space: StrategySpace,
    recompute: Sequence[Recompute] = (),
    early: Mapping[int, str] = {},
    held: Mapping[int, str] = {},
    prefetched: Mapping[tuple[str, str], str] = {},
    order: Sequence[str] | None = None,
) -> Liveness:
    """Every storage of ``space``'s step and its life (module docstring); with
    ``recompute`` (passes/remat), the step in which any of them may be checkpointed
    ("Checkpointing"); ``early``: graph output position -> the node after which its
    gradient's bucket is issued, ``held``: -> the node after which the bucket's input is
    freed, where later (``output``: the step's end) (passes/buckets; "Buckets");
    ``prefetched``: ``(producer, consumer)`` -> the node after which that reshard is issued
    (passes/prefetch; "Prefetch"); ``order``: the order the step runs its nodes in
    (passes/order; placeholders first), else the traced one.

    What depends on the order and ``recompute`` alone (the points, each storage's life
    before the graph outputs, the storages no graph output reads) is made once for the
    last pair asked (``StrategySpace.derived``): the solver's step and the plan's, in the
    traced order, share it (passes/solve, the memory stage)."""
    base = _life_base(space, recompute, order)
    points, node_at, unit_at, end = base.points, base.node_at, base.unit_at, len(base.points)
    storage_of = storage_map(space)
    # graph outputs live to the end (a bucketed gradient: to its bucket's issue); gradients
    # are their own category
    point_of = base.point_of
    issue_at = {pos: point_of[node] for pos, node in early.items()}
    outs: dict[tuple[str, int], list] = {}  # a graph output's storage -> its life, as read
    for sink in space.sinks:
        s = storage_of.get((sink.src, sink.src_out))
        if s is None:
            continue
        life = outs.get(s)
        if life is None:
            life = outs[s] = list(base.life[s])
        if sink.position in issue_at:
            life[1] = max(life[1], issue_at[sink.position])
        else:
            life[1] = end
        if sink.like is not None and space.roles[sink.like] == roles.PARAM:
            life[2] = "gradients"
    storages: list[Storage] = []
    for key in base.life:
        if key in outs:
            storages.extend(base.storages_of(space, key, outs[key], output=True))
        else:
            storages.extend(base.kept(space, key))
    lv = Liveness(
        order=points,
        storages=storages,
        params=base.params,
        space=space,
        node_at=node_at,
        unit_at=unit_at,
        groups=base.groups,
        early=issue_at,
        held={pos: point_of.get(node, end) for pos, node in held.items()},
        prefetched={e: point_of[node] for e, node in prefetched.items() if node in point_of},
        viewed=base.viewed,
    )
    lv._inputs = base.tensor_inputs(space)  # (the order's: the same under any buckets)
    return lv


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


_WHOLE = ("parameters", "inputs", "gradients")
"""Categories that live through the step's end whatever reads them."""


def _life_base(space: StrategySpace, recompute: Sequence[Recompute], order) -> _LifeBase:
    """The ``_LifeBase`` of this order and these checkpointed layers: the last one made, where
    it is of the same (``StrategySpace.derived``), else made (and kept)."""
    key = (None if order is None else tuple(order), tuple(recompute))
    made = space.derived.get("lives")
    if made is None or made[0] != key:
        made = space.derived["lives"] = (key, _LifeBase(space, recompute, order))
    return made[1]


def output_redistributions(
    lv: Liveness, out_ps: OutPlacement, sinks: Iterable[Sink] | None = None
) -> list[tuple]:
    """``(node, output, placement, category)`` of each graph output (of ``sinks``, where
    given) that leaves the step with another placement than it is made with
    (``bytes(out)``)."""
    space = lv.space
    found = []
    for sink in space.sinks if sinks is None else sinks:
        if sink.position in lv.early:  # (its bucket: ``measure``)
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


def state_bytes_per_element(optimizer: str) -> int:
    """Optimizer state bytes per parameter element: ``OPTIMIZERS``' tensors, float32."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r}: one of {sorted(OPTIMIZERS)}")
    return 4 * OPTIMIZERS[optimizer]


def optimizer_bytes(storage: Storage, ps: Placements | None, mesh_shape, optimizer: str) -> int:
    """Optimizer state one rank holds for a parameter shard (``state_bytes_per_element``)."""
    elements = storage.nbytes(ps, mesh_shape) // storage.dtype.itemsize
    return elements * state_bytes_per_element(optimizer)


def peak_bound(
    lv: Liveness,
    before: tuple[OutPlacement, InPlacement],
    after: tuple[OutPlacement, InPlacement],
    changed: Collection[str],
    peak_bytes: int,
    optimizer: str = "adamw",
    recompute: Collection[str] = (),
) -> int:
    """At least ``measure``'s peak under the placements ``after``, from its peak under
    ``before`` (``peak_bytes``; the same ``lv``, ``optimizer`` and ``recompute``) where only
    the nodes ``changed`` place their outputs or inputs otherwise; linear in the storages,
    inputs and graph outputs they touch, not in the step's points.

    Every storage, reshard and graph output's redistribution lives over the same points
    under both, so at any point the total changes by the sum of their changes there, and
    the optimizer state's change at every point: the old peak, plus the optimizer state's
    change, plus each of the others' growth (where each grows), bounds the new total at
    every point. Buckets (``lv.early``) are not bounded: a ValueError."""
    if lv.early:
        raise ValueError("peak_bound: a step with buckets (measure it)")
    space = lv.space
    mesh_shape = tuple(space.mesh.shape)
    nbytes, reshard = sizer(mesh_shape), resharder(mesh_shape)
    params = set(lv.params)
    owned, reads, viewed = lv.touching()
    grow = 0

    def stored(s: Storage, out_ps: OutPlacement) -> tuple[int, int]:
        ps = out_ps(s.owner, s.out)
        size = nbytes(s.shape, s.dtype, ps) if s.counted else 0
        return size, optimizer_bytes(s, ps, mesh_shape, optimizer) if s.owner in params else 0

    def resharded(entry, out_ps: OutPlacement, in_ps: InPlacement) -> int:
        _, name, j, src, so, _ = entry
        q = in_ps(name, j)
        p = None if q is None else out_ps(src, so)
        if p is None or q is None or not _differ(p, q):
            return 0
        shape, dtype = space.tensor(src, so)
        return reshard(tuple(shape), dtype, p, q, space.layouts.get((src, so)))

    # (which views' inputs each plan redistributes: how long a storage read through views,
    # or a view's buffer, lives)
    cut_before, cut_after = _resharded_view(space, *before), _resharded_view(space, *after)

    storages = {id(s): s for n in changed for s in owned.get(n, ())}
    for s in storages.values():
        if not s.counts(recompute):
            continue
        (was, was_opt), (now, now_opt) = stored(s, before[0]), stored(s, after[0])
        grow += max(0, now - was) + now_opt - was_opt  # (the optimizer's at every point)
        if s.views and s.until(cut_after) > s.until(cut_before):
            grow += min(now, was)  # (live at points it was not: all of ``now`` there)
    entries = {(e[0], e[2]): e for n in changed for e in reads.get(n, ())}
    for e in entries.values():
        if e[5] is not None and e[5] not in recompute:  # (a copy not in this step)
            continue
        grow += max(0, resharded(e, *after) - resharded(e, *before))
    for h in {id(h): h for n in changed for h in viewed.get(n, ())}.values():
        if h.when is not None and (h.when[0] in recompute) != h.when[1]:
            continue
        now, was = view_held(lv, h, *after, nbytes), view_held(lv, h, *before, nbytes)
        grow += max(0, now - was)
        if h.views and h.until(cut_after) > h.until(cut_before):
            grow += min(now, was)

    # the graph outputs whose node or parameter changed (the others' bytes are the same
    # under both), all at the step's return
    moved = set(changed)
    sinks = [s for s in space.sinks if s.src in moved or s.like in moved]

    def outputs(out_ps: OutPlacement) -> int:
        return sum(
            local_bytes(*space.tensor(src, so), target, mesh_shape)
            for src, so, target, _ in output_redistributions(lv, out_ps, sinks)
        )

    grow += max(0, outputs(after[0]) - outputs(before[0]))
    return peak_bytes + grow


def _differ(p: Placements | None, q: Placements | None) -> bool:
    """Placements ``p`` redistributed to ``q``."""
    return p is not None and q is not None and p is not q and tuple(p) != tuple(q)


def _resharded_view(
    space: StrategySpace, out_ps: OutPlacement, in_ps: InPlacement
) -> Callable[[str], bool]:
    """Whether a view's input is redistributed into it."""
    views = view_inputs(space)
    return lambda view: _differ(out_ps(*views[view]), in_ps(view, 0))


def view_held(lv: Liveness, h: ViewReshard, out_ps: OutPlacement, in_ps: InPlacement, nbytes):
    """The bytes ``h`` holds under the placements ``out_ps`` / ``in_ps`` (``nbytes``: a
    ``sizer``): the source's size as the view reads it, where that is redistributed."""
    q = in_ps(h.node, 0)
    if not _differ(None if q is None else out_ps(h.src, h.out), q):
        return 0
    shape, dtype = lv.space.tensor(h.src, h.out)
    return nbytes(tuple(shape), dtype, q)


def measure(
    lv: Liveness,
    out_ps: OutPlacement,
    in_ps: InPlacement,
    optimizer: str = "adamw",
    recompute: Collection[str] = (),
    layout: bool = True,
) -> MemoryReport:
    """Size ``lv``'s storages under the placements ``out_ps`` / ``in_ps``, with the fold
    groups ``recompute`` checkpointed, and sweep over the step (module docstring); with
    ``layout``, lay them out in one arena too (``arena_bytes``; linear in the step's
    storages, as the sweep)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r}: one of {sorted(OPTIMIZERS)}")
    space = lv.space
    mesh_shape = tuple(space.mesh.shape)
    n = len(lv.order) + 1  # the nodes, and the return
    # per category, the change of live bytes at each point: +size at first, -size after last
    delta = {c: [0] * (n + 1) for c in CATEGORIES}
    opt = 0
    param_set = set(lv.params)
    blocks: list[tuple[int, int, int]] = []  # (first, last, size): passes/layout
    nbytes, reshard = sizer(mesh_shape), resharder(mesh_shape)
    resharded = _resharded_view(space, out_ps, in_ps)

    for s in lv.storages:
        when = s.when  # (``Storage.counts``, inline: a deep step has ~30,000 storages)
        if when is not None and (when[0] in recompute) != when[1]:
            continue
        ps = out_ps(s.owner, s.out)
        size = nbytes(s.shape, s.dtype, ps) if s.counted else 0
        last = s.last if not s.views else s.until(resharded)
        if layout:
            blocks.append((s.first, min(last, n - 1), size))
        d = delta[s.category]
        d[s.first] += size
        if last + 1 <= n:
            d[last + 1] -= size
        if s.owner in param_set:
            opt += optimizer_bytes(s, ps, mesh_shape, optimizer)
    for src, so, target, category in output_redistributions(lv, out_ps):
        shape, dtype = space.tensor(src, so)
        size = local_bytes(shape, dtype, target, mesh_shape)
        delta[category][n - 1] += size
        blocks.append((n - 1, n - 1, size))
    buffers = delta["collective_buffers"]
    # a bucket: its flat input from the point that issues it to its wait (``held``), its
    # output from then to the end
    issued: dict[tuple[int, int], list[Sink]] = defaultdict(list)
    for sink in space.sinks:
        if sink.position in lv.early:
            i = lv.early[sink.position]
            issued[(i, max(i, lv.held.get(sink.position, i)))].append(sink)
    for (i, freed), sinks in issued.items():
        flat = sum(
            local_bytes(*space.tensor(k.src, k.src_out), out_ps(k.src, k.src_out), mesh_shape)
            for k in sinks
        )
        reduced = sum(
            local_bytes(*space.tensor(k.src, k.src_out), out_ps(k.like, 0), mesh_shape)
            for k in sinks
            if k.like is not None
        )
        buffers[i] += flat
        buffers[freed + 1] -= flat
        delta["gradients"][i + 1] += reduced
        blocks.extend([(i, freed, flat), (i + 1, n - 1, reduced)])
    # whether two placements objects differ, by their ids (each kept beside, as ``sizer``
    # keeps its own): torch's placements compare in Python, ~90,000 inputs a deep step
    differ: dict[tuple[int, int], tuple] = {}
    for i, name, j, src, so, g in lv.tensor_inputs():
        if g is not None and g not in recompute:  # (a copy not in this step: ``shown``)
            continue
        q = in_ps(name, j)
        if q is None:
            continue
        p = out_ps(src, so)
        if p is None or p is q:
            continue
        known = differ.get((id(p), id(q)))
        if known is None:
            known = differ[(id(p), id(q))] = (p, q, tuple(p) != tuple(q))
        if not known[2]:
            continue
        shape, dtype = space.tensor(src, so)
        size = nbytes(tuple(shape), dtype, q)
        # what the redistribution holds beyond its result while it runs, at its issue
        extra = reshard(tuple(shape), dtype, p, q, space.layouts.get((src, so))) - size
        first = i
        if lv.order[i] == name:  # (not a copy) issued ahead: held from its issue on
            first = min(i, lv.prefetched.get((src, name), i - 1) + 1)
        buffers[first] += size + extra
        buffers[first + 1] -= extra
        buffers[i + 1] -= size
        if layout:
            blocks.append((first, i, size))
            if extra:
                blocks.append((first, first, extra))
    for h in lv.viewed:  # (its buffer at the view itself: the reshard's, above)
        if h.when is not None and (h.when[0] in recompute) != h.when[1]:
            continue
        size = view_held(lv, h, out_ps, in_ps, nbytes)
        last = h.until(resharded) if size and h.views else h.last
        if size and last >= h.first:
            delta[h.category][h.first] += size
            delta[h.category][last + 1] -= size
            if layout:
                blocks.append((h.first, last, size))
    copies = any(g is not None for g in lv.unit_at)  # (none: every point is shown)
    shown = [i for i in range(n) if lv.shown(i, recompute)] if copies else list(range(n))
    every = len(shown) == n
    by_category: dict[str, list[int]] = {}
    for c in CATEGORIES:
        out = list(itertools.accumulate(delta[c][:n]))
        by_category[c] = out if every else [out[i] for i in shown]
    by_category["optimizer_state"] = [opt] * len(shown)
    totals = list(map(sum, zip(*(by_category[c] for c in CATEGORIES))))
    peak = max(range(len(shown)), key=totals.__getitem__)
    names = [*lv.order, lv.OUTPUT]  # (``point_name``)
    arena_bytes = arena(blocks)[1] + opt if layout else 0
    return MemoryReport(
        arena_bytes=arena_bytes,
        peak_bytes=totals[peak],
        peak_node=lv.point_name(shown[peak]),
        at_peak={c: by_category[c][peak] for c in CATEGORIES},
        timeline=list(zip(names if every else [names[i] for i in shown], totals)),
        by_category=by_category,
        optimizer=optimizer,
        points=shown,
        recompute=sorted(recompute),
    )


def plan_placements(plan: Plan) -> tuple[OutPlacement, InPlacement]:
    """``plan``'s placements as ``measure`` reads them: of each node's outputs, and of the
    inputs each node runs with (their texts parsed once: one tuple per text, so that equal
    placements are one object). Inline, not through a helper: ``measure`` and passes/order
    ask ~130,000 times of a deep step."""
    cache: dict[tuple[str, ...], tuple] = {}
    nodes = plan.nodes

    def out_ps(name: str, idx: int):
        choice = nodes.get(name)
        if choice is None:
            return None
        outs = choice.out
        if idx >= len(outs):
            return None
        text = outs[idx]
        if text is None:
            return None
        ps = cache.get(text)
        if ps is None:
            ps = cache[text] = parse_placements(text)
        return ps

    def in_ps(name: str, j: int):
        choice = nodes.get(name)
        if choice is None:
            return None
        ins = choice.ins
        if j >= len(ins):
            return None
        text = ins[j]
        ps = cache.get(text)
        if ps is None:
            ps = cache[text] = parse_placements(text)
        return ps

    return out_ps, in_ps


def bucketed(plan: Plan) -> dict[int, str]:
    """Graph output position -> the node after which its gradient's bucket is issued, of
    each bucket in ``plan.collectives`` (passes/buckets: edge
    ``<node>->output[<positions>] (bucket k: ...)``)."""
    early: dict[int, str] = {}
    for c in plan.collectives:
        if "bucket" in c:
            src, positions = bucket_site(c)
            early.update((p, src) for p in positions)
    return early


def held_inputs(plan: Plan) -> dict[int, str]:
    """Graph output position -> the node after which its bucket's flat input is freed
    (``output``: the step's end), of each bucket that holds it past its issue: a
    reduce-scatter waited for later (passes/buckets: the entry's ``overlap`` and
    ``wait_after``; a bucket of several steps whose first is a reduce-scatter: waited for
    where its second is issued, the entry's ``step_after``)."""
    held: dict[int, str] = {}
    first: dict[int, dict] = {}
    for c in plan.collectives:
        if "bucket" not in c or not c.get("overlap"):
            continue
        if "steps" not in c:
            if c["kind"] == "reduce_scatter":
                until = c.get("wait_after", Liveness.OUTPUT)
                held.update((p, until) for p in bucket_site(c)[1])
        elif c["step"] == 0:
            first[c["bucket"]] = c
        elif c["step"] == 1 and first[c["bucket"]]["kind"] == "reduce_scatter":
            until = c.get("step_after", Liveness.OUTPUT)
            held.update((p, until) for p in bucket_site(c)[1])
    return held


def prefetched(plan: Plan) -> dict[tuple[str, str], str]:
    """``(producer, consumer)`` -> the node after which that reshard is issued, of each
    reshard issued ahead of its consumer (passes/prefetch: the entry's ``issue_after``)."""
    found = {}
    for c in plan.collectives:
        if "issue_after" in c:
            src, dst = edge_ends(c["edge"])
            found[(src, dst)] = c["issue_after"]
    return found


def simulate(space: StrategySpace, plan: Plan, optimizer: str = "adamw") -> MemoryReport:
    """The per-rank memory of ``plan``'s step, in the order it runs (``plan.order``, else
    the traced one; see the module docstring)."""
    out_ps, in_ps = plan_placements(plan)
    lv = liveness(
        space,
        plan.recompute,
        bucketed(plan),
        held_inputs(plan),
        prefetched(plan),
        # the order passes/order chose (placeholders first, as traced)
        order=plan.order or None,
    )
    return measure(lv, out_ps, in_ps, optimizer, {r.group for r in plan.recompute})

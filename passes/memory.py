"""Step memory: the bytes one rank holds after every node of the planned step, by category.

Takes: the ``StrategySpace`` (passes/strategies: the step graph's nodes in order, their
tensors, edges and graph outputs) and a ``Plan``, or any choice of one strategy per node.
Returns: a ``MemoryReport`` with the peak per rank, the node at the peak, what is live there
by category, and the timeline. passes/solve bounds the same quantity in its ILP.

Two parts. ``liveness(space)`` depends on the graph alone, not on the placements: which
storage each tensor lives on, and from which node to which node it is live
(passes/memory_liveness: ``storage(v)``, ``live(s, i)``, with their math). ``measure``
sizes those storages under a choice of placements (passes/memory_sizes: ``size(s, P)``,
``reshard(p, q)``) and sweeps over the step. The model of the emitted step (codegen runs
the joint graph on local tensors, in its traced order or the one passes/order chose,
``plan.order``):

    redistribution of tensor input j of node i from p to q != p:
                   collective buffers of reshard(p, q) bytes, live at node i only
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
placement or one edge's pair of placements), which is what lets the ILP bound it; a
reshard into a view is not quite (passes/memory_liveness, "Reshards into a view": the
buffer then lives with the view, and the storage viewed may be freed sooner).

Checkpointing (passes/remat): ``liveness(space, recompute)`` holds the step in which any of
the layers ``recompute`` lists may be checkpointed (passes/memory_liveness,
"Checkpointing"). ``measure(..., recompute)`` sizes the step with those groups
checkpointed, and its timeline leaves out the copies of the others; with none, it is the
step without checkpointing.

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

A bound without a sweep: ``peak_bound`` (passes/memory_bound) takes a measured plan's peak
to another plan that places some nodes otherwise (the solver's overlap rounds check their
plans' budget so).

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
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from autopar.core import (
    Plan,
    PlannedCollective,
    Recompute,
    Sink,
    StrategySpace,
    parse_placements,
    roles,
)
from autopar.core.schedule import bucket_site, edge_ends

from .layout import arena
from .memory_bound import peak_bound
from .memory_liveness import (
    Liveness,
    Storage,
    ViewReshard,
    _LifeBase,
    optimizer_bytes,
    output_redistributions,
    resharded_views,
    view_held,
)
from .memory_sizes import (
    OPTIMIZERS,
    InPlacement,
    OutPlacement,
    local_bytes,
    reshard_bytes,
    resharder,
    sizer,
    state_bytes_per_element,
)
from .remat import storage_map

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
    "optimizer_bytes",
    "peak_bound",
    "plan_placements",
    "prefetched",
    "reshard_bytes",
    "resharder",
    "simulate",
    "sizer",
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


def _life_base(space: StrategySpace, recompute: Sequence[Recompute], order) -> _LifeBase:
    """The ``_LifeBase`` of this order and these checkpointed layers: the last one made, where
    it is of the same (``StrategySpace.derived``), else made (and kept). (Made by this
    module's name for it, which a test may replace to count them.)"""
    key = (None if order is None else tuple(order), tuple(recompute))
    made = space.derived.get("lives")
    if made is None or made[0] != key:
        made = space.derived["lives"] = (key, _LifeBase(space, recompute, order))
    return made[1]


@dataclass(slots=True)
class _Deltas:
    """What ``measure`` sums over the step of ``n`` points (the nodes and the return): per
    category, the change of live bytes at each point (+size at a term's first point, -size
    after its last), and the blocks ``(first, last, size)`` passes/layout places (read only
    where ``layout``)."""

    n: int
    delta: dict[str, list[int]]
    blocks: list[tuple[int, int, int]]
    layout: bool


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
    storages, as the sweep).

    The terms of ``bytes(i)``, each added where it starts and ends, in the order they are
    laid out: the storages (and the optimizer state), the graph outputs' redistributions
    (``bytes(out)``), the buckets, the redistributed inputs, the reshards into views; then
    the sweep (``_sweep``)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r}: one of {sorted(OPTIMIZERS)}")
    n = len(lv.order) + 1  # the nodes, and the return
    acc = _Deltas(n, {c: [0] * (n + 1) for c in CATEGORIES}, [], layout)
    nbytes = sizer(tuple(lv.space.mesh.shape))
    resharded = resharded_views(lv.space, out_ps, in_ps)
    opt = _add_storages(acc, lv, out_ps, optimizer, recompute, nbytes, resharded)
    _add_outputs(acc, lv, out_ps)
    _add_buckets(acc, lv, out_ps)
    _add_reshards(acc, lv, out_ps, in_ps, recompute, nbytes)
    _add_view_buffers(acc, lv, out_ps, in_ps, recompute, nbytes, resharded)
    return _sweep(acc, lv, opt, optimizer, recompute)


def _add_storages(
    acc: _Deltas,
    lv: Liveness,
    out_ps: OutPlacement,
    optimizer: str,
    recompute: Collection[str],
    nbytes: Callable,
    resharded: Callable[[str], bool],
) -> int:
    """Adds to ``acc`` each storage of the step with ``recompute`` checkpointed, sized as its
    owner's output is placed, to its last point (``Storage.until``: as ``resharded`` cuts its
    chains of views); returns the optimizer state's bytes (constant over the step)."""
    mesh_shape = tuple(lv.space.mesh.shape)
    n, delta, blocks, layout = acc.n, acc.delta, acc.blocks, acc.layout
    opt = 0
    param_set = set(lv.params)
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
    return opt


def _add_outputs(acc: _Deltas, lv: Liveness, out_ps: OutPlacement) -> None:
    """Adds to ``acc`` each graph output redistributed as it leaves, at the return
    (``bytes(out)``)."""
    space, mesh_shape, n = lv.space, tuple(lv.space.mesh.shape), acc.n
    for src, so, target, category in output_redistributions(lv, out_ps):
        shape, dtype = space.tensor(src, so)
        size = local_bytes(shape, dtype, target, mesh_shape)
        acc.delta[category][n - 1] += size
        acc.blocks.append((n - 1, n - 1, size))


def _add_buckets(acc: _Deltas, lv: Liveness, out_ps: OutPlacement) -> None:
    """Adds to ``acc`` each bucket: its flat input from the point that issues it to its wait
    (``Liveness.held``), its output from then to the end ("Buckets")."""
    space, mesh_shape, n = lv.space, tuple(lv.space.mesh.shape), acc.n
    buffers = acc.delta["collective_buffers"]
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
        acc.delta["gradients"][i + 1] += reduced
        acc.blocks.extend([(i, freed, flat), (i + 1, n - 1, reduced)])


def _add_reshards(
    acc: _Deltas,
    lv: Liveness,
    out_ps: OutPlacement,
    in_ps: InPlacement,
    recompute: Collection[str],
    nbytes: Callable,
) -> None:
    """Adds to ``acc`` each redistributed input of a point of the step: its result from its
    issue (a prefetch's: ``Liveness.prefetched``) to its consumer, and what the
    redistribution holds beyond its result while it runs (``reshard(p, q) - size(q)``), at
    its issue."""
    space = lv.space
    buffers, blocks, layout = acc.delta["collective_buffers"], acc.blocks, acc.layout
    reshard = resharder(tuple(space.mesh.shape))
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


def _add_view_buffers(
    acc: _Deltas,
    lv: Liveness,
    out_ps: OutPlacement,
    in_ps: InPlacement,
    recompute: Collection[str],
    nbytes: Callable,
    resharded: Callable[[str], bool],
) -> None:
    """Adds to ``acc`` the buffer of each reshard into a view after the view runs (at the
    view itself it is the reshard's, ``_add_reshards``), to its last point
    (``ViewReshard.until``)."""
    delta, blocks, layout = acc.delta, acc.blocks, acc.layout
    for h in lv.viewed:
        if h.when is not None and (h.when[0] in recompute) != h.when[1]:
            continue
        size = view_held(lv, h, out_ps, in_ps, nbytes)
        last = h.until(resharded) if size and h.views else h.last
        if size and last >= h.first:
            delta[h.category][h.first] += size
            delta[h.category][last + 1] -= size
            if layout:
                blocks.append((h.first, last, size))


def _sweep(
    acc: _Deltas, lv: Liveness, opt: int, optimizer: str, recompute: Collection[str]
) -> MemoryReport:
    """The report of ``acc``'s running sums over the points of the step with ``recompute``
    checkpointed (``Liveness.shown``), the optimizer state ``opt`` at every one; laid out
    where ``acc.layout``."""
    n, delta = acc.n, acc.delta
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
    arena_bytes = arena(acc.blocks)[1] + opt if acc.layout else 0
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
        if c.bucket is not None:
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
    first: dict[int, PlannedCollective] = {}
    for c in plan.collectives:
        if c.bucket is None or not c.overlap:
            continue
        if c.steps is None:
            if c.kind == "reduce_scatter":
                until = c.wait_after if c.wait_after is not None else Liveness.OUTPUT
                held.update((p, until) for p in bucket_site(c)[1])
        elif c.step == 0:
            first[c.bucket] = c
        elif c.step == 1 and first[c.bucket].kind == "reduce_scatter":
            until = c.step_after if c.step_after is not None else Liveness.OUTPUT
            held.update((p, until) for p in bucket_site(c)[1])
    return held


def prefetched(plan: Plan) -> dict[tuple[str, str], str]:
    """``(producer, consumer)`` -> the node after which that reshard is issued, of each
    reshard issued ahead of its consumer (passes/prefetch: the entry's ``issue_after``)."""
    found = {}
    for c in plan.collectives:
        if c.issue_after is not None:
            src, dst = edge_ends(c.edge)
            found[(src, dst)] = c.issue_after
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

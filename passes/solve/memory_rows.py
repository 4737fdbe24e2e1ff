"""The memory rows and the checkpointing flags of the ILP ("Memory", "Checkpointing" in
passes/solve).

Takes: an ``IlpBuilder`` and passes/memory's ``Liveness`` of the step. Returns: bytes(i) as
a linear expression (``memory_point``), a point bounded (``memory_cut``), a fold group's r
and t (``remat_var``), the plan measured (``evaluate``) and a bound of its peak from the
last plan measured (``peak_bound``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from .. import remat
from ..memory import (
    Liveness,
    MemoryReport,
    Storage,
    local_bytes,
    measure,
    optimizer_bytes,
    reshard_bytes,
)
from ..memory import (
    peak_bound as memory_peak_bound,
)
from .settings import _MIB, _SCALE

if TYPE_CHECKING:
    from .ilp import IlpBuilder


def memory_point(ilp: IlpBuilder, lv: Liveness, i: int) -> dict:
    """bytes(i) of passes/memory as a linear expression: base variable -> MiB.

    A live storage made by node v's output o adds size(o under strategy k) to x[r(v),k]
    (once per instance: folded, the representative's variables gather every instance's
    bytes); a parameter adds its optimizer state the same way; a tensor input of node i
    redistributed from p to q adds its buffers (``reshard_bytes``) to its edge's
    e[u,p,v,q], and into a view's first input, size(q) at every point its buffer is
    the view's storage (``Liveness.viewed``; to its longest life); a storage that
    one chain of views alone reads past a point (``Storage.held_by``) adds, past it,
    its variable h >= size - M * (the chain's redistributing pairs) (``_held_var``)
    in place of its size; at the return
    (``i == len(lv.order)``), each graph output that leaves with q != p adds size(q) to
    its sink's pair (a fixed target: to the producer's x). What lives only when a fold
    group is, or is not, checkpointed goes through that group's r ("Checkpointing")."""
    space, rep = ilp.space, ilp.folding.rep
    mesh_shape = tuple(space.mesh.shape)
    params = set(lv.params)
    coef: dict = defaultdict(float)
    cond: dict[tuple[str, bool], dict] = defaultdict(lambda: defaultdict(float))
    most: dict[tuple[str, bool], float] = defaultdict(float)  # each part's largest value
    for s in lv.live_at(i):
        r = rep(s.owner)
        into = coef if s.when is None else cond[s.when]
        held = s.held_by()
        if held is not None and i > held[1]:
            # read past here through one chain of views alone: live only where none
            # of them has its input redistributed
            a = _held_var(ilp, s, held[0])
            if a is not None:
                into[a] += 1.0
                continue
        top = 0.0
        for k, st in enumerate(space.strategies[r]):
            ps = st.out[s.out]
            b = s.nbytes(ps, mesh_shape)
            if s.owner in params:
                b += optimizer_bytes(s, ps, mesh_shape, ilp.optimizer)
            top = max(top, b / _MIB)
            if b:
                for v in ilp.x[r][k]:
                    into[v] += b / _MIB
        if s.when is not None:
            most[s.when] += top
    for h in lv.viewed_at(i):  # a reshard into a view, held as the view's storage
        into = coef if h.when is None else cond[h.when]
        shape, dtype = space.tensor(h.src, h.out)
        sizes = [0.0]
        for ev, p, q in ilp.pairs.get((rep(h.src), h.out, rep(h.node), 0), ()):
            if p != q:
                sizes.append(local_bytes(shape, dtype, q, mesh_shape) / _MIB)
                into[ev] += sizes[-1]
        if h.when is not None:
            most[h.when] += max(sizes)
    if i == len(lv.order):  # the return: each output redistributed to where it leaves
        for src, so, pairs, count in ilp.sink_pairs:
            shape, dtype = space.tensor(src, so)
            for v, p, q in pairs:
                if p != q:
                    coef[v] += count * local_bytes(shape, dtype, q, mesh_shape) / _MIB
        return coef
    name, g = lv.node_at[i], lv.unit_at[i]
    if space.targets[name] != "placeholder":
        into = coef if g is None else cond[(g, True)]
        for j, src, so in lv.reshard_inputs(i):
            shape, dtype = space.tensor(src, so)
            layout = space.layouts.get((src, so))
            sizes = [0.0]
            for ev, p, q in ilp.pairs.get((rep(src), so, rep(name), j), ()):
                if p != q:
                    b = reshard_bytes(shape, dtype, p, q, mesh_shape, layout)
                    sizes.append(b / _MIB)
                    into[ev] += sizes[-1]
            if g is not None:
                most[(g, True)] += max(sizes)
    for (group, on), expr in cond.items():
        big = most[(group, on)]
        if big <= 0:
            continue
        r = remat_var(ilp, lv, group)
        a = ilp.lp.NumVar(0.0, ilp.lp.infinity(), "")
        if on:  # counted when r = 1: a >= expr - big (1 - r), a >= 0
            ct = ilp.lp.Constraint(-big, ilp.lp.infinity())
            ct.SetCoefficient(a, 1.0)
            ct.SetCoefficient(r, -big)
            for v, c in expr.items():
                ct.SetCoefficient(v, -c)
            coef[a] += 1.0
        else:  # counted when r = 0: expr - a, a <= expr, a <= big r
            ct = ilp.lp.Constraint(0.0, ilp.lp.infinity())
            ct.SetCoefficient(a, -1.0)
            for v, c in expr.items():
                ct.SetCoefficient(v, c)
                coef[v] += c
            ilp.lp.Add(a <= big * r)
            coef[a] -= 1.0
    return coef


def _held_var(ilp: IlpBuilder, s: Storage, chain: tuple[str, ...]):
    """h >= size(s under x) - M * (the pairs that redistribute into any view of
    ``chain``), h >= 0, in MiB: storage ``s``'s bytes where it is read through
    ``chain`` alone (passes/memory, ``Storage.held_by``); the memory rows' h is as
    small as they let it be. None where no view of the chain may be redistributed."""
    key = (s.owner, s.out, chain)
    if key in ilp.viewed_held:
        return ilp.viewed_held[key]
    rep, views = ilp.folding.rep, remat.view_inputs(ilp.space)
    mesh_shape = tuple(ilp.space.mesh.shape)
    moved = [
        ev
        for v in chain
        for ev, p, q in ilp.pairs.get((rep(views[v][0]), views[v][1], rep(v), 0), ())
        if p != q
    ]
    h = None
    if moved:
        r = rep(s.owner)
        sizes = [s.nbytes(st.out[s.out], mesh_shape) / _MIB for st in ilp.space.strategies[r]]
        h = ilp.lp.NumVar(0.0, ilp.lp.infinity(), "")
        ct = ilp.lp.Constraint(0.0, ilp.lp.infinity())
        ct.SetCoefficient(h, 1.0)
        for k, b in enumerate(sizes):
            for x in ilp.x[r][k]:
                ct.SetCoefficient(x, ct.GetCoefficient(x) - b)
        for ev in moved:
            ct.SetCoefficient(ev, ct.GetCoefficient(ev) + max(sizes, default=0.0))
    ilp.viewed_held[key] = h
    return h


def remat_var(ilp: IlpBuilder, lv: Liveness, group: str):
    """r of fold group ``group`` ("Checkpointing"): made at its first use, with t >= its
    layers' recompute time F(x, e) - M (1 - r), t in the objective."""
    if group in ilp.remat:
        return ilp.remat[group][0]
    rep = ilp.folding.rep
    r = ilp.lp.BoolVar(f"r_{group}")
    t = ilp.lp.NumVar(0.0, ilp.lp.infinity(), f"t_{group}")
    nodes: dict = defaultdict(float)
    edges: dict = defaultdict(float)
    big = 0.0
    for rec in lv.groups[group]:
        for n in rec.nodes:
            rn = rep(n)
            costs = ilp.node_cost[rn] if n not in rec.moved else []
            for k, c in enumerate(costs):
                for v in ilp.x[rn][k]:
                    nodes[v] += c * _SCALE
            big += max(costs, default=0.0) * _SCALE
            for j, (src, so) in enumerate(ilp.space.in_sources[n]):
                pairs = ilp.pairs.get((rep(src), so, rn, j), ())
                cs = [ilp.pair_cost.get(ev, 0.0) * _SCALE for ev, _, _ in pairs]
                for (ev, _, _), c in zip(pairs, cs):
                    if c:
                        edges[ev] += c
                big += max(cs, default=0.0)
    ct = ilp.lp.Constraint(-big, ilp.lp.infinity())  # t - F - big r >= -big
    ct.SetCoefficient(t, 1.0)
    ct.SetCoefficient(r, -big)
    for part in (nodes, edges):
        for v, c in part.items():
            ct.SetCoefficient(v, ct.GetCoefficient(v) - c)
    ilp.remat[group] = (r, t, nodes, edges)
    ilp.coef[t] += 1.0
    if ilp._active is ilp.coef:
        ilp.lp.Objective().SetCoefficient(t, 1.0)
    return r


def recomputed(ilp: IlpBuilder) -> set[str]:
    """The fold groups the solver checkpointed."""
    return {g for g, (r, *_) in ilp.remat.items() if ilp.value(r) > 0.5}


def memory_cut(ilp: IlpBuilder, lv: Liveness, i: int, bound) -> None:
    """bytes(i) <= bound (bytes, or a variable in MiB): one point of the step bounded."""
    ilp.lv = lv
    expr = memory_point(ilp, lv, i)
    rhs = bound if not isinstance(bound, (int, float)) else float(bound) / _MIB
    ilp.lp.Add(sum(c * v for v, c in expr.items()) <= rhs)
    ilp.cuts.append(i)


def evaluate(ilp: IlpBuilder, lv: Liveness) -> MemoryReport:
    """The step memory (passes/memory) of the strategies the solver set: its peak and
    timeline, not laid out (the rounds read the peak alone)."""
    choice, recompute = ilp.choice(), recomputed(ilp)
    report = measure(lv, *_placements(ilp, choice), ilp.optimizer, recompute, layout=False)
    ilp._measured = (lv, recompute, choice, report.peak_bytes)
    return report


def peak_bound(ilp: IlpBuilder, lv: Liveness) -> int | None:
    """At least the step memory's peak of the strategies the solver set (passes/memory
    ``peak_bound``), from the last plan ``evaluate`` measured on ``lv`` with the same
    layers checkpointed: its sums run over what the nodes whose strategy changed touch
    (an overlap round's plan changes 1-2% of a deep step's), not over the step's points.
    None where there is no such plan."""
    if ilp._measured is None:
        return None
    was_lv, was_recompute, was, peak = ilp._measured
    recompute = recomputed(ilp)
    if was_lv is not lv or was_recompute != recompute or lv.early:
        return None
    choice = ilp.choice()
    changed = [n for n, k in choice.items() if was[n] != k]
    before, after = _placements(ilp, was), _placements(ilp, choice)
    return memory_peak_bound(lv, before, after, changed, peak, ilp.optimizer, recompute)


def _placements(ilp: IlpBuilder, choice: Mapping[str, int]) -> tuple[Callable, Callable]:
    """The placements of the plan ``choice`` as passes/memory reads them."""
    strats = ilp.space.strategies  # (read where asked: a bound reads few nodes)
    return (lambda n, o: strats[n][choice[n]].out[o]), (lambda n, j: strats[n][choice[n]].ins[j])

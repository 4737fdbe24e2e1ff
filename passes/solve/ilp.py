"""The ILP's variables and constraints, built one family of terms at a time.

Takes: a ``StrategySpace`` and its device profile. Returns: an ``IlpBuilder`` holding the
OR-Tools model: x per representative (``node_variables``), e per edge and pair
(``edge_variables``), the graph outputs' terms (``output_terms``), the ties, the objective's
coefficients gathered by part and axis for the overlap, and the pins, frozen axes and
forbidden choices laid on it (``pin_node``, ``freeze_axes``, ``forbid_choice``). The
formulation, term by term, is in passes/solve's docstring.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ortools.linear_solver import linear_solver_pb2, pywraplp
from torch.distributed.tensor import Partial, Replicate

from autopar.core import (
    Edge,
    Mesh,
    Solution,
    StrategySpace,
    local_shape,
    placement_str,
    reduction,
    reductions,
    roles,
)

from .. import rules, vocab
from ..buckets import chain, splits_evenly
from ..memory import Liveness
from ..order import ready_nodes
from ..pins import SEALED, Pin
from ..pricing import (
    DeviceProfile,
    collectives_time,
    edge_cost,
    node_costs,
    redistribute_collectives,
    reshard_collectives,
)
from . import highs, overlap
from .errors import SolveError
from .settings import _SCALE, _STATE_ROLES, HIDES, MULTI, TIE_BREAK_US


def _follows(space: StrategySpace, name: str) -> bool:
    """A node that only follows its single tensor input: a view, an elementwise op of one
    tensor, a getitem. Its strategy is a function of its input's placement."""
    strats = space.strategies[name]
    if any(len(s.ins) != 1 for s in strats):
        return False
    return len({s.ins[0] for s in strats}) == len(strats)


def _consumers(space: StrategySpace) -> dict[tuple[str, int], int]:
    """How many edges and graph outputs read each node's output, by ``(node, output)``."""
    uses: dict[tuple[str, int], int] = defaultdict(int)
    for e in space.edges:
        uses[(e.src, e.src_out)] += 1
    for sink in space.sinks:
        uses[(sink.src, sink.src_out)] += 1
    return uses


def _gradient_chains(space: StrategySpace, uses: dict[tuple[str, int], int]) -> set[str]:
    """The following nodes between the op that makes a parameter's gradient and its cast
    whose ``reduce_at`` is "after" (a transpose or view of the gradient, each the only
    consumer of its input): the edges into them keep a Partial unreduced, as the edge into
    the cast does ("Mixed precision")."""
    into: dict[str, list[Edge]] = defaultdict(list)
    for e in space.edges:
        into[e.dst].append(e)
    chain: set[str] = set()
    for cast, side in space.reduce_at.items():
        if side != "after" or len(into[cast]) != 1:
            continue
        e = into[cast][0]
        while (
            uses[(e.src, e.src_out)] == 1
            and len(into[e.src]) == 1
            and _follows(space, e.src)
            and space.roles.get(e.src) not in _STATE_ROLES
        ):
            chain.add(e.src)
            e = into[e.src][0]
    return chain


def _bucket(src_ps, dst_ps, shape_dtype, cost_s: float, mesh: Mesh, profile: DeviceProfile):
    """The collectives of a gradient's reduction that passes/buckets buckets, each ``(kind,
    axis, seconds)`` ("Overlap"): one all-reduce or one reduce-scatter on one axis (its
    seconds ``cost_s``, the edge's); over several axes, the chain a bucket runs (``chain``,
    ``splits_evenly``), each step of kind ``MULTI`` on its axis, the edge's seconds split
    over the steps as each step's own time is of their sum. None where no bucket runs it."""
    one = reduction(src_ps, dst_ps)
    if one is not None:
        return [("all_reduce" if one[1] is None else "reduce_scatter", one[0], cost_s)]
    scattered = reductions(src_ps, dst_ps)
    if scattered is None:
        return None
    shape, dtype = shape_dtype
    colls = reshard_collectives(src_ps, dst_ps, shape, dtype, mesh, profile)
    steps = [(c.kind, c.axis) for c in colls]
    how = chain(steps, scattered)
    if how is None:
        return None
    made = local_shape(tuple(shape), src_ps, mesh.shape)
    if how == "direct" and not splits_evenly(made, steps, scattered, dict(enumerate(mesh.shape))):
        return None
    times = [collectives_time([c], mesh, profile) for c in colls]
    whole = sum(times)
    if whole <= 0:
        return None
    # the edge's seconds, so that counted whole (the first solve) the chain is the edge
    return [(MULTI, c.axis, cost_s * t / whole) for c, t in zip(colls, times)]


def _collective_axes(src_ps, dst_ps) -> list[int]:
    """The mesh axes on which ``src -> dst`` runs a collective: those it changes from a
    ``Shard`` or a ``Partial`` (from ``Replicate`` the change is a local chunk)."""
    return [
        i for i, (a, b) in enumerate(zip(src_ps, dst_ps)) if a != b and not isinstance(a, Replicate)
    ]


def _reduces_as(src_ps, dst_ps, reduce: str) -> bool:
    """Whether p -> q keeps to a gradient cast's ``reduce_at`` (``_pair_variables``)."""
    if reduce == "before":
        return not any(isinstance(b, Partial) for b in dst_ps)
    return not any(
        isinstance(a, Partial) and not isinstance(b, Partial) for a, b in zip(src_ps, dst_ps)
    )


@dataclass
class _Folding:
    """Representatives (module docstring, "Folding"): r(v), n_r, and the producers of each
    representative's inputs where every instance agrees on them."""

    rep_of: dict[str, str]
    count: dict[str, int]
    reps: list[str]
    qsrc: dict[str, tuple | None]

    @classmethod
    def of(cls, space: StrategySpace) -> _Folding:
        rep_of = space.rep
        count: dict[str, int] = defaultdict(int)
        for name in space.order:
            count[rep_of.get(name, name)] += 1
        reps = [n for n in space.order if rep_of.get(n, n) == n]
        # None where the instances' producers differ: such a node is not merged
        qsrc: dict[str, tuple | None] = {}
        for name in space.order:
            srcs = tuple((rep_of.get(s, s), so) for s, so in space.in_sources[name])
            r = rep_of.get(name, name)
            if r not in qsrc:
                qsrc[r] = srcs
            elif qsrc[r] != srcs:
                qsrc[r] = None
        return cls(rep_of, count, reps, qsrc)

    def rep(self, name: str) -> str:
        return self.rep_of.get(name, name)


@dataclass
class _EdgeTerm:
    """A priced pair of an edge: the variables that are 1 when it is taken, and its cost."""

    labels: list[str]
    var: Any  # one e variable, or a list of x variables (a sink into a fixed placement)
    src_ps: tuple
    dst_ps: tuple
    cost_s: float
    shape_dtype: tuple


class IlpBuilder:
    """The ILP of the module docstring over ``space``, built one family of terms at a time.

    ``build_ilp`` calls the methods in order; ``read_solution`` reads the result back.
    Objective coefficients gather in ``coef`` (variable -> microseconds) until
    ``objective`` sets them.
    """

    def __init__(
        self,
        space: StrategySpace,
        profile: DeviceProfile,
        *,
        solver: str,
        merge: bool = True,
        reshard_axes: int | None = 1,
        wide: Collection[str] = frozenset(),
        optimizer: str = "adamw",
        hides: Collection[str] = HIDES,
    ):
        self.space = space
        self.wide = frozenset(wide)  # sources whose edges keep every pair (``SIMPLIFICATIONS``)
        self.hides = frozenset(hides) if profile.overlaps_collectives else frozenset()
        self.profile = profile
        self.merge = merge
        self.reshard_axes = reshard_axes
        self.optimizer = optimizer
        self.solver = solver
        with highs.quiet_stdout():
            lp = pywraplp.Solver.CreateSolver(solver)
        if lp is None:
            raise SolveError(f"OR-Tools has no {solver} solver in this build")
        lp.SetNumThreads(1)
        lp.SuppressOutput()
        self.lp = lp
        self.folding = _Folding.of(space)
        # x[name][k]: the base variables whose sum is x[v,k] (a merged node has none of its
        # own: its entries are its producer's, ``merge_source``)
        self.x: dict[str, list[list[Any]]] = {}
        self.coef: dict = defaultdict(float)
        self.ties: dict = defaultdict(float)  # the tie-break, apart: no part of a time
        # the overlap terms ("Overlap"): the forward's share of ``coef``; per (kind, part,
        # mesh axis) the collectives that may run beside the compute (kept out of ``coef``)
        self.forward_coef: dict = defaultdict(float)
        self.hide_coef: dict[tuple[str, str, int], dict] = defaultdict(lambda: defaultdict(float))
        # per (part, mesh axis), the part's other collectives on it (in ``coef``): they share
        # the axis's stream with those that hide
        self.axis_coef: dict[tuple[str, int], dict] = defaultdict(lambda: defaultdict(float))
        # per (part, axis), the share of its hiding terms the objective counts (the rest
        # hidden); before the first solve, each kind's ``FIRST_SHARE``
        self.hide_scale: dict[tuple[str, int], float] = {}
        # per (part, axis), the steps of the buckets' chains over several axes on it: in
        # the objective whole (their pairs in ``coef`` and ``axis_coef``), in the step's
        # length (``overlap``) beside the compute
        self.multi_coef: dict[tuple[str, int], dict] = defaultdict(lambda: defaultdict(float))
        self.early = ready_nodes(space)
        self.node_cost: dict[str, list[float]] = {}
        self.merged: set[str] = set()
        uses = _consumers(space)
        self.chain = _gradient_chains(space, uses)
        # nodes whose output has several consumers (a following one is not merged)
        self.shared = {n for (n, _), k in uses.items() if k > 1}
        self.edge_terms: list[_EdgeTerm] = []
        # (r(u), output, r(v), input) -> its pairs (e, p, q): where collective buffers live
        self.pairs: dict[tuple, list[tuple[Any, tuple, tuple]]] = {}
        # graph outputs: (r(u), output, its pairs (variable, p, q), how many outputs)
        self.sink_pairs: list[tuple[str, int, list, int]] = []
        self.n_edge_vars = 0
        self.cuts: list[int] = []
        self.times: dict[str, float] = {}
        # e variable -> R(p, q) of its pair (seconds, once)
        self.pair_cost: dict[Any, float] = {}
        # fold group -> (r, t, its recompute time: node part, edge part) ("Checkpointing")
        self.remat: dict[str, tuple[Any, Any, dict, dict]] = {}
        # (storage, output, chain of views) -> its h (``_held_var``)
        self.viewed_held: dict[tuple, Any] = {}
        self._active: dict | None = None
        self.var_index: dict = {}  # variable -> its index in the model, where read
        # a solution kept by ``hold`` (variable index -> value; objective, best bound),
        # read in place of the solver's until the next solve
        self.held: tuple[list[float], float, float] | None = None
        # variable -> its index (OR-Tools' ``index()`` is a wrapped call, ten times a dict
        # lookup: a held solution is read by index hundreds of thousands of times a plan)
        self._index: dict[Any, int] = {}
        # what ``choice`` and ``overlap`` read of the held solution, made once per solution
        # (each is linear in the step's nodes; a round reads both two or three times)
        self._read_of: tuple[tuple | None, int, dict[str, Any]] = (None, 0, {})
        self.lv: Liveness | None = None  # the liveness the memory cuts are made on
        # the last plan ``evaluate`` measured: (its liveness, layers checkpointed, choice,
        # peak), which ``peak_bound`` bounds the next from
        self._measured: tuple[Liveness, set[str], dict[str, int], int] | None = None
        self.rounds: list[float] = []  # each overlap round's step, seconds ("Overlap")
        # the kept round's solution as its step was judged (read_solution ``like``), where
        # the rounds read one: the values held are restored, so it is the plan read again
        self.kept: Solution | None = None
        # ``_texts`` and ``_edge_cost``'s: id of a placement tuple -> (it, its texts); R(p, q)
        self._placement_texts: dict[int, tuple[tuple, tuple[str, ...]]] = {}
        self._inner_names: list[str] | None = None
        self._edge_costs: dict[tuple, float | None] = {}

    # -- margins ---------------------------------------------------------------------------

    def _texts(self, ps: tuple) -> tuple[str, ...]:
        """``ps``'s placement texts (``placement_str``), made once per tuple object (the
        strategies share theirs; the tuple is kept, so its id is not reused)."""
        made = self._placement_texts.get(id(ps))
        if made is None:
            made = self._placement_texts[id(ps)] = (ps, tuple(placement_str(p) for p in ps))
        return made[1]

    def _edge_cost(self, p: tuple, pt: tuple, q: tuple, qt: tuple, shape_dtype) -> float | None:
        """``pricing.edge_cost`` of p -> q (texts ``pt``, ``qt``) for a tensor of ``shape_dtype``,
        priced once per (texts, shape, dtype): a fold's and a layer's edges repeat them."""
        if pt == qt:
            return 0.0
        key = (pt, qt, tuple(shape_dtype[0]), shape_dtype[1])
        if key not in self._edge_costs:
            self._edge_costs[key] = edge_cost(p, q, shape_dtype, self.space.mesh, self.profile)
        return self._edge_costs[key]

    def out_group(self, name: str, idx: int) -> dict:
        """Y[u, p]: the x variables of ``name`` whose output ``idx`` is placed p, by p."""
        g = defaultdict(list)
        for k, s in enumerate(self.space.strategies[name]):
            if s.out[idx] is not None:
                g[s.out[idx]].extend(self.x[name][k])
        return g

    def in_group(self, name: str, j: int) -> dict:
        """Z[v, q]: the x variables of ``name`` whose input ``j`` is placed q, by q."""
        g = defaultdict(list)
        for k, s in enumerate(self.space.strategies[name]):
            g[s.ins[j]].extend(self.x[name][k])
        return g

    # -- x, one-hot, C -------------------------------------------------------------------

    def merge_source(self, name: str) -> tuple[str, int] | None:
        """The producer (representative, output) node ``name`` is merged into, if any."""
        if not self.merge:
            return None
        if self.space.roles.get(name) in _STATE_ROLES or name in self.space.reduce_at:
            return None
        if not self._following(name):
            return None
        srcs = self.folding.qsrc[name]
        return srcs[0] if srcs is not None and len(srcs) == 1 else None

    def _following(self, name: str) -> bool:
        """Simplification 1 applies to ``name``: it follows its input and its output has
        one consumer."""
        return name not in self.shared and _follows(self.space, name)

    def node_variables(self) -> None:
        """x[v,k] with sum_k x[v,k] = 1 for every representative, and C[v,k] * n_v.

        A follower is made after its producer. Folding can order a representative before
        the producer it merges into (a layer's input comes from the previous layer): walk
        the chain of producers first; a chain that closes on itself is cut (the node gets
        variables)."""
        visiting: set[str] = set()
        for name in self.folding.reps:
            chain = []
            v = name
            while v not in self.x and v not in visiting:
                visiting.add(v)
                chain.append(v)
                src = self.merge_source(v)
                if src is None:
                    break
                v = src[0]
            for w in reversed(chain):
                self._node(w)

    def _node(self, name: str) -> None:
        strats = self.space.strategies[name]
        if not strats:
            sp = self.space
            raise SolveError(
                f"node {name} ({sp.targets[name]}, module {sp.modules[name] or '<top level>'}) "
                "has no strategy: passes/strategies offered none"
            )
        costs = node_costs(self.space, name, self.profile)
        self.node_cost[name] = costs
        src = self.merge_source(name)
        groups = self.out_group(*src) if src and src[0] in self.x else None
        if groups is not None and set(groups) <= {st.ins[0] for st in strats}:
            self.x[name] = [list(groups.get(st.ins[0], [])) for st in strats]
            self.merged.add(name)
        else:
            vs = [self.lp.BoolVar(f"x_{name}_{k}") for k in range(len(strats))]
            self.lp.Add(sum(vs) == 1)
            self.x[name] = [[v] for v in vs]
            for k, v in enumerate(vs):
                # tie-break: prefer earlier strategies by a hair, once per instance
                self.ties[v] += TIE_BREAK_US * k / len(vs) * self.folding.count[name]
        forward = self.space.roles[name] != roles.BACKWARD
        for k, c in enumerate(costs):
            for v in self.x[name][k]:
                self.coef[v] += c * self.folding.count[name] * _SCALE
                if forward:
                    self.forward_coef[v] += c * self.folding.count[name] * _SCALE

    # -- e, margins, R ---------------------------------------------------------------------

    def _pair_variables(
        self,
        labels,
        src,
        src_out,
        dst_groups: dict,
        *,
        follow=False,
        max_axes=None,
        forward=False,
        bucket=None,
        prefetch=False,
        reduce: str | None = None,
    ) -> list[tuple[Any, tuple, tuple]]:
        """e[u,p,v,q] for every allowed pair, tied to Y[u,p] and Z[v,q]; R(p,q) * m in the
        objective (``forward``: in the forward's share too), or in the hiding terms of
        its part and axes ("Overlap"): where ``bucket`` (``_bucket``) gives the collectives
        a bucket runs, each in its kind's and axis's term, or where ``prefetch`` and p -> q
        runs a collective on one axis.
        ``reduce`` (a gradient cast's ``reduce_at``): "after" leaves out the pairs that
        reduce a Partial, "before" those that deliver one. Returns the pairs as
        ``(e, p, q)``."""
        space = self.space
        shape_dtype = space.tensor(src, src_out)
        src_groups = self.out_group(src, src_out)
        pair_vars_p = defaultdict(list)
        pair_vars_q = defaultdict(list)
        pairs = []
        # (each placement tuple's texts compared, not its placements: torch's placements
        # compare in Python, and a 12-layer step's ILP compares ~350,000 pairs)
        texts = self._texts
        dst = [(q, texts(q)) for q in dst_groups]
        for p in src_groups:
            pt = texts(p)
            # following: only the pair that keeps p, where the consumer can take p
            same = [(q, qt) for q, qt in dst if qt == pt] if follow else []
            for q, qt in same or dst:
                if max_axes is not None and sum(a != b for a, b in zip(pt, qt)) > max_axes:
                    continue
                if reduce is not None and not _reduces_as(p, q, reduce):
                    continue
                c = self._edge_cost(p, pt, q, qt, shape_dtype)
                if c is None:
                    continue
                ev = self.lp.NumVar(0.0, 1.0, "")
                self.pair_cost[ev] = c
                self.n_edge_vars += 1
                pairs.append((ev, p, q))
                pair_vars_p[p].append(ev)
                pair_vars_q[q].append(ev)
                if c > 0:
                    part = "forward" if forward else "backward"
                    axes = _collective_axes(p, q)
                    hides = None
                    if bucket is not None:
                        hides = bucket(p, q, shape_dtype, c, space.mesh, self.profile)
                    if hides is None and prefetch and len(axes) == 1:
                        hides = [("prefetch", axes[0], c)]
                    if hides is not None and hides[0][0] in self.hides and hides[0][0] != MULTI:
                        ((kind, axis, _),) = hides
                        self.hide_coef[(kind, part, axis)][ev] += c * len(labels) * _SCALE
                    else:
                        self.coef[ev] += c * len(labels) * _SCALE
                        if forward:
                            self.forward_coef[ev] += c * len(labels) * _SCALE
                        if self.profile.overlaps_collectives:
                            for a in axes:
                                self.axis_coef[(part, a)][ev] += c * len(labels) * _SCALE
                        if hides is not None and hides[0][0] == MULTI and MULTI in self.hides:
                            # a bucket's chain over several axes: whole in W, its steps
                            # beside the compute in the step's length ("Overlap")
                            for _, axis, s in hides:
                                self.multi_coef[(part, axis)][ev] += s * len(labels) * _SCALE
                    self.edge_terms.append(_EdgeTerm(labels, ev, p, q, c, shape_dtype))
        for p, xs in src_groups.items():
            self._equal(pair_vars_p[p], xs)
        for q, xs in dst_groups.items():
            self._equal(pair_vars_q[q], xs)
        return pairs

    def _equal(self, a: Sequence, b: Sequence) -> None:
        """sum(a) == sum(b), one row set coefficient by coefficient (OR-Tools' expression
        API builds and walks a tree of Python objects per row: ~0.3 s of a 12-layer step's
        ILP)."""
        coeffs: dict = defaultdict(float)
        for v in a:
            coeffs[v] += 1.0
        for v in b:
            coeffs[v] -= 1.0
        row = self.lp.RowConstraint(0.0, 0.0, "")
        for v, c in coeffs.items():
            row.SetCoefficient(v, c)

    def edge_variables(self) -> None:
        """The edges between representatives, each standing for the m graph edges onto it."""
        space, rep_of, merged = self.space, self.folding.rep_of, self.merged
        q_edges: dict[tuple, list[str]] = defaultdict(list)
        for e in space.edges:
            dst = rep_of.get(e.dst, e.dst)
            if dst in merged:
                continue
            key = (rep_of.get(e.src, e.src), e.src_out, dst, e.dst_in)
            q_edges[key].append(f"{e.src}->{e.dst}")
        for key, labels in q_edges.items():
            src, src_out, dst, dst_in = key
            cast = space.reduce_at.get(dst)
            reduce = "after" if cast is None and dst in self.chain else cast
            once = sum(s == src for s, _ in space.in_sources[dst]) == 1
            self.pairs[key] = self._pair_variables(
                labels,
                src,
                src_out,
                self.in_group(dst, dst_in),
                follow=self.merge and cast is None and self._following(dst),
                max_axes=None if src in self.wide else self.reshard_axes,
                reduce=reduce,
                forward=space.roles[dst] != roles.BACKWARD,
                prefetch=src in self.early and once,
            )

    def output_terms(self) -> None:
        """Graph outputs: the loss into Replicate, a gradient into its parameter's placement
        (a bucketed reduction in its axis's bucket terms, "Overlap")."""
        space, f = self.space, self.folding
        rep_ps = (Replicate(),) * space.mesh.ndim
        q_sinks: dict[tuple, list[str]] = defaultdict(list)
        for sink in space.sinks:
            like = None if sink.like is None else f.rep(sink.like)
            label = f"{sink.src}->output[{sink.position}]"
            if sink.like is not None:
                label += f" (as {sink.like})"
            q_sinks[(f.rep(sink.src), sink.src_out, like)].append(label)
        for (src, src_out, like), labels in q_sinks.items():
            if like is None:
                # a fixed target (the loss: Replicate): priced on the producer's variables
                shape_dtype = space.tensor(src, src_out)
                groups = self.out_group(src, src_out)
                self.sink_pairs.append(
                    (src, src_out, [(x, p, rep_ps) for p, xs in groups.items() for x in xs], 1)
                )
                for p, xs in groups.items():
                    c = edge_cost(p, rep_ps, shape_dtype, space.mesh, self.profile)
                    if c is None:
                        self.lp.Add(sum(xs) == 0)
                    elif c > 0:
                        for v in xs:
                            self.coef[v] += c * len(labels) * _SCALE
                        self.edge_terms.append(_EdgeTerm(labels, xs, p, rep_ps, c, shape_dtype))
                continue
            # a gradient's reduction that codegen buckets overlaps the rest of the backward
            # pass where the device overlaps collectives ("Overlap"); the others run at its end
            grad = space.roles[like] == roles.PARAM and self.profile.overlaps_collectives
            pairs = self._pair_variables(
                labels, src, src_out, self.out_group(like, 0),
                bucket=_bucket if grad else None,
            )  # fmt: skip
            self.sink_pairs.append((src, src_out, pairs, len(labels)))

    # -- ties and memory -------------------------------------------------------------------

    def tie_constraints(self) -> None:
        """Z[a,q] = Z[b,q] for every tied pair of representatives."""
        f = self.folding
        for a, b in dict.fromkeys((f.rep(a), f.rep(b)) for a, b in self.space.ties):
            if a == b:
                continue
            ga, gb = self.out_group(a, 0), self.out_group(b, 0)
            for q in set(ga) | set(gb):
                self._equal(ga.get(q, []), gb.get(q, []))

    def objective(self, coef: dict | None = None) -> None:
        """min sum of the coefficients gathered (``coef``: use these instead), the hiding
        terms of each part and axis counted at its ``hide_scale`` ("Overlap")."""
        obj = self.lp.Objective()
        obj.Clear()
        self._active = self.coef if coef is None else coef
        terms = overlap.objective_terms(self, self.hide_scale) if coef is None else coef
        for v, c in terms.items():
            obj.SetCoefficient(v, c)
        obj.SetMinimization()

    def model_at(
        self, hide_scale: Mapping[tuple[str, int], float]
    ) -> linear_solver_pb2.MPModelProto:
        """A copy of the model as it stands, minimizing the objective with the hiding terms
        at ``hide_scale`` (``objective_terms``), its variables set by index (read once)."""
        model = linear_solver_pb2.MPModelProto()
        self.lp.ExportModelToProto(model)
        variables = model.variable
        if self._active is not self.coef:  # (else the model's coefficients are the terms')
            for var in variables:
                var.objective_coefficient = 0.0
        index = self.var_index
        for v, c in overlap.objective_terms(self, hide_scale).items():
            i = index.get(v)
            if i is None:
                i = index[v] = v.index()
            variables[i].objective_coefficient = c
        model.maximize = False
        return model

    # -- reading back ------------------------------------------------------------------------

    def value(self, v) -> float:
        """Variable ``v`` in the solution: the last solve's, or the one ``restore`` set (0
        for a variable made after it was held: a later round's memory cuts make a fold
        group's r at its first use, ``remat_var``, and the held plan checkpoints none of
        what it did not have)."""
        if self.held is None:
            return v.solution_value()
        values = self.held[0]
        i = self._index.get(v)
        if i is None:
            i = self._index[v] = v.index()
        return values[i] if i < len(values) else 0.0

    def objective_value(self) -> tuple[float, float]:
        """The solution's objective and the solver's best bound, in the objective's units."""
        if self.held is not None:
            return self.held[1], self.held[2]
        obj = self.lp.Objective()
        return obj.Value(), obj.BestBound()

    def hold(self) -> tuple[list[float], float, float]:
        """The solution as it stands, to ``restore`` after a later solve."""
        if self.held is not None:
            return self.held
        return ([v.solution_value() for v in self.lp.variables()], *self.objective_value())

    def restore(self, held: tuple[list[float], float, float]) -> None:
        """Read ``held`` as the solution (no solve)."""
        self.held = held

    def inner_names(self) -> list[str]:
        """The names of the nodes whose op can run collectives inside itself under some
        strategy (``pricing.inner_collectives``: an attention kernel's forward and backward, a
        cross-entropy's ops), sorted (made once: two a layer at most, of the ~190 nodes of
        a GPT layer's step)."""
        if self._inner_names is None:
            targets = self.space.targets
            self._inner_names = sorted(
                n
                for n in self.space.order
                if targets[n] in rules.ATTENTION_Q or targets[n] in vocab.CLASS_OPS
            )
        return self._inner_names

    def _once(self, what: str, make: Callable[[], Any]) -> Any:
        """``make()`` read of the held solution, made once while it is held (and no variable
        is added: a checkpointed group's time enters the objective's coefficients)."""
        if self.held is None:
            return make()
        held, count, made = self._read_of
        if held is not self.held or count != self.lp.NumVariables():
            made = {}
            self._read_of = (self.held, self.lp.NumVariables(), made)
        if what not in made:
            made[what] = make()
        return made[what]

    def choice(self) -> dict[str, int]:
        """Node name -> the index of the strategy the solver set (every node; one dict per
        held solution, read only)."""
        return self._once("choice", self._choice)

    def _choice(self) -> dict[str, int]:
        rep_choice = {}
        for name, vs in self.x.items():
            vals = [sum(self.value(v) for v in group) for group in vs]
            rep_choice[name] = max(range(len(vals)), key=lambda k: vals[k])
        rep_of = self.folding.rep_of
        return {name: rep_choice[rep_of.get(name, name)] for name in self.space.order}


def build_ilp(
    space: StrategySpace,
    profile: DeviceProfile,
    *,
    solver: str,
    **options,
) -> IlpBuilder:
    """The whole ILP of the module docstring: variables, constraints and objective.

    ``ilp.times`` gets ``cost_s`` (the node variables, where the cost model prices every
    strategy) and ``build_s`` (the rest)."""
    t0 = time.perf_counter()
    ilp = IlpBuilder(space, profile, solver=solver, **options)
    ilp.node_variables()
    t_nodes = time.perf_counter()
    ilp.edge_variables()
    ilp.output_terms()
    ilp.tie_constraints()
    ilp.objective()
    ilp.times = {
        "cost_s": round(t_nodes - t0, 6),
        "build_s": round(time.perf_counter() - t_nodes, 6),
    }
    return ilp


def _text(ps) -> str | None:
    return None if ps is None else ",".join(placement_str(p) for p in ps)


def pin_node(ilp: IlpBuilder, pin: Pin) -> None:
    """``pin.node`` takes one of the strategies that agree with ``pin``: its first output
    placed as ``pin.out`` (and its inputs as ``pin.ins``, when given)."""
    space, r = ilp.space, ilp.folding.rep(pin.node)
    if pin.node not in space.strategies:
        raise ValueError(f"pin: no node {pin.node!r} in the step graph")
    ks = [
        k
        for k, st in enumerate(space.strategies[r])
        if st.out and _text(st.out[0]) == pin.out
        and (pin.ins is None or tuple(_text(i) for i in st.ins) == pin.ins)
    ]  # fmt: skip
    if not ks:
        offered = sorted(
            {str(_text(st.out[0])) for st in space.strategies[r] if st.out and st.out[0]}
        )
        raise ValueError(
            f"{pin.why or pin.node}: no strategy places it {pin.out}"
            + ("" if pin.ins is None else f" from inputs {pin.ins}")
            + f"; it may take {', '.join(str(o) for o in offered)}"
        )
    chosen = list(dict.fromkeys(v for k in ks for v in ilp.x[r][k]))
    ilp.lp.Add(sum(chosen) == 1)


def freeze_axes(ilp: IlpBuilder, frozen: Mapping[int, Collection[str]]) -> None:
    """No edge between operators runs a collective on a frozen mesh axis, but those out of
    the axis's allowed nodes, those of a scalar (a mean loss's token count, which the
    backward needs whole) and the reductions of a gradient before its cast (its pairs that
    would are fixed to 0); the step's outputs stay free, but on an axis whose allowed nodes
    hold ``SEALED``, where none runs one either (every rank runs the whole step)."""
    space = ilp.space

    def close(axis: int, pairs, tensor: tuple[str, int]) -> None:
        """Each of ``pairs`` (variable, p, q) whose collectives run on ``axis``: never."""
        shape, dtype = space.tensor(*tensor)
        for var, p, q in pairs:
            if p[axis] == q[axis]:
                continue
            colls = redistribute_collectives(p, q, shape, dtype, space.mesh.shape)
            if any(c.axis == axis for c in colls):
                var.SetUb(0.0)

    for axis, allowed in frozen.items():
        if SEALED in allowed:
            for src, src_out, pairs, _ in ilp.sink_pairs:
                close(axis, pairs, (src, src_out))
    for (src, src_out, dst, _), pairs in ilp.pairs.items():
        if space.reduce_at.get(dst) is not None:
            continue
        if math.prod(space.tensor(src, src_out)[0]) <= 1:
            continue  # a scalar: the loss's token count (DDP reduces it too)
        for axis, allowed in frozen.items():
            if src not in allowed:
                close(axis, pairs, (src, src_out))


def forbid_choice(ilp: IlpBuilder, choice: Sequence[tuple[str, str]]) -> None:
    """Not all of ``choice``'s nodes keep their placement (``solve``'s ``forbid``).

    A node's placement is the text of its first output's placements (``"S(0),R"``); the
    nodes of one fold group share their variables, so each group counts once."""
    space, rep = ilp.space, ilp.folding.rep
    terms: dict[str, list] = {}
    for node, text in choice:
        if node not in space.strategies:
            raise ValueError(f"forbid: no node {node!r} in the step graph")
        r = rep(node)
        if r in terms:
            continue
        ks = [k for k, st in enumerate(space.strategies[r]) if st.out and _text(st.out[0]) == text]
        if not ks:
            raise ValueError(f"forbid: node {node!r} has no strategy placing its output {text}")
        terms[r] = list(dict.fromkeys(v for k in ks for v in ilp.x[r][k]))
    ilp.lp.Add(sum(v for vs in terms.values() for v in vs) <= len(terms) - 1)

"""Choose one strategy per node: an integer linear program over the strategy space.

Takes: a ``StrategySpace`` (passes/strategies) and the device profile of its mesh.
Returns: a ``Solution``: the chosen strategy of every node, the predicted collectives, the
cost breakdown and the solver's statistics. Only this pass imports the cost models.

The ILP (Alpa's intra-operator formulation):

    variables
        x[v,k] in {0,1}        node v takes its k-th strategy
        e[u,p,v,q] in [0,1]    edge u->v carries placement p at u's output
                               and placement q at v's input                (``add_edge``)
    constraints
        sum_k x[v,k] = 1                                 one strategy per node
        sum_q e[u,p,v,q] = Y[u,p] := sum_{k: out_k = p} x[u,k]         (``out_group``)
        sum_p e[u,p,v,q] = Z[v,q] := sum_{k: in_k  = q} x[v,k]         (``in_group``)
        e[u,p,v,q] absent       when DTensor cannot go from p to q (e.g. Shard -> Partial)
        Z[a,q] = Z[b,q]         for tied nodes (tied parameters; the inputs and outputs of
                               a model without a loss)
        sum_{params v,k} 4 * bytes(v, k) x[v,k] <= budget   (optional ``memory_budget``:
                               parameter, gradient and two AdamW moments per rank)
    objective (seconds)
        min  sum_{v,k} C[v,k] x[v,k]  +  sum_{edges} R(p, q) e[u,p,v,q]

``C[v,k]`` is the roofline time of node v's op on the local shapes of strategy k (for a
batch input: the time to read its local part, bytes / memory bandwidth)
(``cost_models.compute.compute_time``, in ``_node_costs``); ``R(p, q)`` the alpha-beta time
of the collectives that redistribute the tensor from p to q
(``cost_models.comm.redistribute_time``, in ``_edge_cost``). Graph outputs are edges into
fixed or tied placements (``Sink``): the loss into Replicate on every axis, a gradient into
its parameter's placement. A gradient's reduction runs while the backward pass goes on
(as DDP and FSDP overlap it), so its edge counts ``(1 - grad_overlap)`` of R(p, q)
(``GRAD_OVERLAP`` = 0.75 by default): without it, a model whose gradients outweigh its
activations would always put tensor parallelism on the slowest axis. Since x is one-hot,
the margins of each edge's e are one-hot, which forces e to the single pair (p, q)
chosen, so e needs no integrality.

Folding (passes/fold, ``StrategySpace.rep``): the instances of a folded region take their
representative's strategy, so only representatives have variables. With r(v) the
representative of v:

    x[v,k] = x[r(v),k]
    C[r,k] is counted n_r times, n_r = |{v : r(v) = r}|
    an edge u->v becomes the edge r(u)->r(v); the m graph edges that map onto one such edge
        (the same edge in every layer, the edge from one layer into the next, the edges
        from one shared producer into every layer) share its variables e and count m times
    memory: sum over parameters v of 4 * bytes(v, k) x[r(v),k]; ties between representatives

so the objective is still that of the whole graph, for plans in which every instance does
as its representative. Unfolded, r is the identity and this is the ILP above.

Simplifications (each loses optimality only in the case it names):
    1. Following nodes (Alpa's): a node that only follows its single tensor input (a view,
       an elementwise op of one tensor, a getitem: ``_follows``) is not resharded right
       before it when it accepts its producer's placement: pairs (p, q != p) are left out.
       Where it accepts every placement its producer can give, it is merged into the
       producer (``merge_source`` in ``solve``): no variables and no edge of its own,
       x[v,k] = Y[u, ins_k], and C[v,k] is added to the producer's variables that give
       ins_k (folded: when every instance of v follows an instance of one representative
       u). Loses where resharding right before such a node beats resharding later; on the
       zoo's GPT (2 layers, (2, 2), H100) both give the same objective
       (tests/unit/test_fold.py::test_merging_following_nodes_keeps_the_optimum).
    2. One axis per edge: an edge between two operators changes the placement on at most
       ``reshard_axes`` mesh axes (default 1); pairs differing on more axes are left out
       (graph outputs, e.g. a gradient all-reduced over every axis, keep all pairs). On a
       2-D mesh this cuts the edge variables about 6x; on the zoo's 2-layer GPT on (2, 2)
       with a parameter budget of half the model (cpu profile, measured before the
       gradient-overlap term below) the objective rose 3.4% (4.548 -> 4.705 ms) while
       the solve dropped from 115 s to 13 s.

Solved to within ``MIP_GAP`` (0.1%) of the optimum with HiGHS through OR-Tools'
``pywraplp`` (single thread: deterministic). Ties in the objective are broken towards the
earlier strategy by a tiny (1e-9 s) preference, so that the same problem gives the same plan.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._pytree import tree_map

from autopar.cost_models import (
    Collective,
    collectives_time,
    compute_time,
    get_profile,
    redistribute_collectives,
    redistribute_time,
)

from .strategies import Strategy, StrategySpace, TensorInput, local_shape

__all__ = ["Solution", "SolveError", "solve"]


class SolveError(RuntimeError):
    """The ILP has no solution or the solver failed."""


@dataclass
class Solution:
    """The chosen strategy per node and what it costs.

    Attributes:
        choice: node name -> index into ``space.strategies[node]``.
        objective_s: the ILP objective (seconds of one step, compute + communication).
        compute_s / comm_s: its two parts.
        collectives: (edge text, Collective, seconds) for every collective the plan runs.
        stats: solver statistics (variables, constraints, status, seconds).
    """

    choice: dict[str, int]
    objective_s: float
    compute_s: float
    comm_s: float
    collectives: list[tuple[str, Collective, float]] = field(default_factory=list)
    node_cost_s: dict[str, float] = field(default_factory=dict)
    stats: dict = field(default_factory=dict)


STATE_COPIES = 4  # parameter + gradient + AdamW exp_avg + exp_avg_sq
GRAD_OVERLAP = 0.75  # share of gradient-reduction time hidden behind backward compute
MIP_GAP = 1e-3  # stop within 0.1% of the optimum
_SCALE = 1e6  # seconds -> microseconds inside the ILP, to keep coefficients well scaled


def _node_costs(space: StrategySpace, name: str, profile) -> list[float]:
    target = space.targets[name]
    strats = space.strategies[name]
    if target == "placeholder" and space.roles[name] in ("input", "target"):
        # the batch is read into device memory: each rank reads its local part
        shape, dtype = space.shapes[name][0]
        return [
            math.prod(local_shape(shape, s.out[0], space.mesh.shape))
            * dtype.itemsize
            / profile.mem_bandwidth
            for s in strats
        ]
    if target == "placeholder" or not isinstance(target, torch._ops.OpOverload):
        return [0.0] * len(strats)
    args, kwargs = space.calls[name]
    in_shapes = [space.shapes[src][src_out] for src, src_out in space.in_sources[name]]
    outs = space.shapes[name]
    dtype = next((sd[1] for sd in outs if sd is not None), torch.float32)
    mesh_shape = space.mesh.shape
    cache: dict = {}
    costs = []
    for s in strats:
        key = (s.ins, s.out)
        if key in cache:
            costs.append(cache[key])
            continue

        def local(a, s=s):
            if isinstance(a, TensorInput):
                sd = in_shapes[a.index]
                return torch.Size(local_shape(sd[0], s.ins[a.index], mesh_shape))
            return a

        largs = tree_map(local, args)
        lkwargs = tree_map(local, kwargs)
        lout = [
            None if sd is None or ps is None else torch.Size(local_shape(sd[0], ps, mesh_shape))
            for sd, ps in zip(outs, s.out)
        ]
        out = lout[0] if len(lout) == 1 else tuple(lout)
        try:
            c = compute_time(profile, target, largs, lkwargs, out, dtype)
        except Exception:  # noqa: BLE001 - a formula that cannot price it: price by bytes
            c = compute_time(profile, torch.ops.aten.add.Tensor, (), {}, out if out else (), dtype)
        cache[key] = c
        costs.append(c)
    return costs


@contextlib.contextmanager
def _quiet_stdout():
    import os
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _follows(space: StrategySpace, name: str) -> bool:
    """A node that only follows its single tensor input: a view, an elementwise op of one
    tensor, a getitem. Its strategy is a function of its input's placement."""
    strats = space.strategies[name]
    if any(len(s.ins) != 1 for s in strats):
        return False
    return len({s.ins[0] for s in strats}) == len(strats)


def _edge_cost(src_ps, dst_ps, shape_dtype, mesh, profile) -> float | None:
    if src_ps == dst_ps:
        return 0.0
    if any(type(p) is _StridedShard for p in src_ps + dst_ps):
        # NOTE: DTensor redistributes a _StridedShard with data-dependent indexing that
        # make_fx cannot trace; strided placements only flow between ops that take them.
        return None
    try:
        return redistribute_time(src_ps, dst_ps, shape_dtype[0], shape_dtype[1], mesh, profile)
    except ValueError:
        return None


def solve(
    space: StrategySpace,
    *,
    time_limit_s: float = 600.0,
    solver: str | None = None,
    memory_budget: float | None = None,
    reshard_axes: int | None = 1,
    grad_overlap: float = GRAD_OVERLAP,
    merge: bool = True,
) -> Solution:
    """Solve the ILP of the module docstring for ``space``.

    ``memory_budget``: bytes per rank for parameter state (the parameter, its gradient and
    two AdamW moments: ``STATE_COPIES`` times the local parameter bytes).
    ``reshard_axes``: the most mesh axes an edge between two operators may change at once
    (None: no limit); graph outputs may always change every axis.
    ``grad_overlap``: the fraction of a gradient's reduction hidden behind the rest of the
    backward pass (counted as ``1 - grad_overlap`` of its time).
    ``merge``: simplification 1 (following nodes); False gives every node its own variables
    and every edge all its pairs.
    """
    if not 0.0 <= grad_overlap < 1.0:
        raise ValueError(f"grad_overlap must be in [0, 1), got {grad_overlap}")
    import os

    from ortools.linear_solver import pywraplp

    solver = solver or os.environ.get("AUTOPAR_SOLVER", "HIGHS")
    t0 = time.perf_counter()
    profile = get_profile(space.mesh.device)
    mesh = space.mesh
    with _quiet_stdout():  # HiGHS prints a banner on stdout
        lp = pywraplp.Solver.CreateSolver(solver)
    if lp is None:
        raise SolveError(f"OR-Tools has no {solver} solver in this build")
    lp.SetNumThreads(1)
    lp.SuppressOutput()

    # Folding (passes/fold): the solver sees representatives only. rep(v) is v's
    # representative, count[r] how many nodes r stands for; costs and edges are summed over
    # the instances, so the objective is that of the whole graph.
    rep_of = space.rep

    def rep(n: str) -> str:
        return rep_of.get(n, n)

    count: dict[str, int] = defaultdict(int)
    for name in space.order:
        count[rep(name)] += 1
    reps = [n for n in space.order if rep(n) == n]
    # the producers of a representative's inputs, as representatives, where every instance
    # agrees on them (None where they differ: such a node is not merged)
    qsrc: dict[str, tuple | None] = {}
    for name in space.order:
        srcs = tuple((rep(s), so) for s, so in space.in_sources[name])
        r = rep(name)
        if r not in qsrc:
            qsrc[r] = srcs
        elif qsrc[r] != srcs:
            qsrc[r] = None

    def merge_source(name: str) -> tuple[str, int] | None:
        if not merge:
            return None
        if space.roles.get(name) in ("param", "buffer", "input", "target", "tangent"):
            return None
        if not _follows(space, name):
            return None
        srcs = qsrc[name]
        return srcs[0] if srcs is not None and len(srcs) == 1 else None

    # x[name][k]: the base variables whose sum is x[v,k]. A node that follows its producer
    # (``merge_source``) has no variables of its own: x[v,k] = Y[u, ins_k].
    x: dict[str, list[list]] = {}
    coef: dict = defaultdict(float)
    node_cost: dict[str, list[float]] = {}
    merged: set[str] = set()

    def out_group(name: str, idx: int) -> dict:
        g = defaultdict(list)
        for k, s in enumerate(space.strategies[name]):
            if s.out[idx] is not None:
                g[s.out[idx]].extend(x[name][k])
        return g

    def in_group(name: str, j: int) -> dict:
        g = defaultdict(list)
        for k, s in enumerate(space.strategies[name]):
            g[s.ins[j]].extend(x[name][k])
        return g

    def make(name: str) -> None:
        strats = space.strategies[name]
        if not strats:
            raise SolveError(f"node {name} has no strategy")
        costs = _node_costs(space, name, profile)
        node_cost[name] = costs
        src = merge_source(name)
        groups = out_group(*src) if src and src[0] in x else None
        if groups is not None and set(groups) <= {st.ins[0] for st in strats}:
            x[name] = [list(groups.get(st.ins[0], [])) for st in strats]
            merged.add(name)
        else:
            vs = [lp.BoolVar(f"x_{name}_{k}") for k in range(len(strats))]
            lp.Add(sum(vs) == 1)
            x[name] = [[v] for v in vs]
            for k, v in enumerate(vs):
                # tie-break: prefer earlier strategies by a hair
                coef[v] += 1e-9 * k / len(vs)
        for k, c in enumerate(costs):
            for v in x[name][k]:
                coef[v] += c * count[name] * _SCALE

    # A follower is made after its producer. Folding can order a representative before the
    # producer it merges into (a layer's input comes from the previous layer): walk the chain
    # of producers first; a chain that closes on itself is cut (the node gets variables).
    visiting: set[str] = set()
    for name in reps:
        chain = []
        v = name
        while v not in x and v not in visiting:
            visiting.add(v)
            chain.append(v)
            src = merge_source(v)
            if src is None:
                break
            v = src[0]
        for w in reversed(chain):
            make(w)
    t_nodes = time.perf_counter()

    edge_vars: list[tuple[list[str], object, object, object, float, tuple]] = []
    n_edge_vars = 0

    def add_edge(labels, src, src_out, dst_groups: dict, follow=False, max_axes=None, scale=1.0):
        nonlocal n_edge_vars
        shape_dtype = space.shapes[src][src_out]
        src_groups = out_group(src, src_out)
        pair_vars_p = defaultdict(list)
        pair_vars_q = defaultdict(list)
        for p in src_groups:
            for q in dst_groups:
                if follow and p in dst_groups and p != q:
                    continue
                if max_axes is not None and sum(a != b for a, b in zip(p, q)) > max_axes:
                    continue
                c = _edge_cost(p, q, shape_dtype, mesh, profile)
                if c is None:
                    continue
                c *= scale
                ev = lp.NumVar(0.0, 1.0, "")
                n_edge_vars += 1
                pair_vars_p[p].append(ev)
                pair_vars_q[q].append(ev)
                if c > 0:
                    coef[ev] += c * len(labels) * _SCALE
                    edge_vars.append((labels, ev, p, q, c, shape_dtype))
        for p, xs in src_groups.items():
            lp.Add(sum(pair_vars_p[p]) == sum(xs))
        for q, xs in dst_groups.items():
            lp.Add(sum(pair_vars_q[q]) == sum(xs))

    # the edges between representatives, each with the edges it stands for
    q_edges: dict[tuple, list[str]] = defaultdict(list)
    for e in space.edges:
        if rep(e.dst) in merged:
            continue
        q_edges[(rep(e.src), e.src_out, rep(e.dst), e.dst_in)].append(f"{e.src}->{e.dst}")
    for (src, src_out, dst, dst_in), labels in q_edges.items():
        add_edge(
            labels,
            src,
            src_out,
            in_group(dst, dst_in),
            follow=merge and _follows(space, dst),
            max_axes=reshard_axes,
        )
    rep_ps = (Replicate(),) * mesh.ndim
    q_sinks: dict[tuple, list[str]] = defaultdict(list)
    for sink in space.sinks:
        like = None if sink.like is None else rep(sink.like)
        label = f"{sink.src}->output[{sink.position}]"
        if sink.like is not None:
            label += f" (as {sink.like})"
        q_sinks[(rep(sink.src), sink.src_out, like)].append(label)
    for (src, src_out, like), labels in q_sinks.items():
        if like is None:
            # a fixed target (the loss: Replicate): priced on the producer's variables
            shape_dtype = space.shapes[src][src_out]
            for p, xs in out_group(src, src_out).items():
                c = _edge_cost(p, rep_ps, shape_dtype, mesh, profile)
                if c is None:
                    lp.Add(sum(xs) == 0)
                elif c > 0:
                    for v in xs:
                        coef[v] += c * len(labels) * _SCALE
                    edge_vars.append((labels, xs, p, rep_ps, c, shape_dtype))
            continue
        # a gradient's reduction overlaps the rest of the backward pass
        scale = 1.0 - grad_overlap if space.roles[like] == "param" else 1.0
        add_edge(labels, src, src_out, out_group(like, 0), scale=scale)
    for a, b in dict.fromkeys((rep(a), rep(b)) for a, b in space.ties):
        if a == b:
            continue
        ga, gb = out_group(a, 0), out_group(b, 0)
        for q in set(ga) | set(gb):
            lp.Add(sum(ga.get(q, [])) == sum(gb.get(q, [])))
    if memory_budget is not None:
        terms = []
        for name in space.order:
            if space.roles[name] != "param" or name in space.aliases:
                continue
            (shape, dtype) = space.shapes[name][0]
            r = rep(name)
            for k, st in enumerate(space.strategies[r]):
                nbytes = math.prod(local_shape(shape, st.out[0], mesh.shape)) * dtype.itemsize
                terms.extend(STATE_COPIES * nbytes * v for v in x[r][k])
        lp.Add(sum(terms) <= float(memory_budget))
    objective = lp.Objective()
    for v, c in coef.items():
        objective.SetCoefficient(v, c)
    objective.SetMinimization()
    t_built = time.perf_counter()
    lp.SetTimeLimit(int(time_limit_s * 1000))
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, MIP_GAP)
    with _quiet_stdout():
        status = lp.Solve(params)
    t_solved = time.perf_counter()
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        hint = (
            f" within the memory budget of {memory_budget / 2**20:.1f} MiB per rank: raise it "
            "or use a larger mesh"
            if memory_budget is not None
            else ": some node has no strategy compatible with its neighbours"
        )
        raise SolveError(f"the sharding ILP has no solution (status {status}){hint}")

    rep_choice = {}
    for name, vs in x.items():
        vals = [sum(v.solution_value() for v in group) for group in vs]
        rep_choice[name] = max(range(len(vals)), key=lambda k: vals[k])
    choice = {name: rep_choice[rep(name)] for name in space.order}
    compute_s = sum(node_cost[rep(n)][k] for n, k in choice.items())
    collectives: list[tuple[str, Collective, float]] = []
    comm_s = 0.0
    for labels, ev, p, q, c, shape_dtype in edge_vars:
        val = sum(v.solution_value() for v in ev) if isinstance(ev, list) else ev.solution_value()
        if val > 0.5:
            comm_s += c * len(labels)
            colls = redistribute_collectives(p, q, shape_dtype[0], shape_dtype[1], mesh.shape)
            for label in labels:
                for coll in colls:
                    collectives.append((label, coll, collectives_time([coll], mesh, profile)))
    stats = {
        "solver": solver,
        "status": "optimal" if status == pywraplp.Solver.OPTIMAL else "feasible",
        "nodes": len(space.order),
        "solver_nodes": len(reps),
        "merged_nodes": len(merged),
        "strategies": space.n_strategies(),
        "edge_variables": n_edge_vars,
        "variables": lp.NumVariables(),
        "constraints": lp.NumConstraints(),
        "cost_s": round(t_nodes - t0, 6),
        "build_s": round(t_built - t_nodes, 6),
        "solve_s": round(t_solved - t_built, 6),
    }
    return Solution(
        choice=choice,
        objective_s=compute_s + comm_s,
        compute_s=compute_s,
        comm_s=comm_s,
        collectives=collectives,
        node_cost_s={n: node_cost[rep(n)][k] for n, k in choice.items()},
        stats=stats,
    )


def chosen(space: StrategySpace, sol: Solution, name: str) -> Strategy:
    return space.strategies[name][sol.choice[name]]

"""The solution read back from the ILP.

Takes: an ``IlpBuilder`` holding a solution and its status. Returns: a ``Solution``: every
node's strategy (instances as their representative), the compute time, the collectives of
the chosen pairs and of the ops' inner collectives and the checkpointed layers' copies,
each priced (passes/pricing), the step's objective, the statistics and warnings.
"""

from __future__ import annotations

from dataclasses import replace

from ortools.linear_solver import pywraplp

from autopar.core import Collective, Recompute, Solution

from ..pricing import collectives_time, host_times, inner_collectives, reshard_collectives
from . import memory_rows, overlap
from .ilp import IlpBuilder
from .settings import _SCALE


def read_solution(
    ilp: IlpBuilder,
    status: int,
    stats: dict,
    time_limit_s: float,
    like: Solution | None = None,
    *,
    memory_budget: float | None = None,
    peak_bytes: int | None = None,
) -> Solution:
    """The chosen strategies, their compute time, and the collectives of the chosen edges.

    A solve stopped by the time limit (status FEASIBLE) is said so: ``status`` (and
    ``stats["status"]``) is ``time_limit``, with the incumbent and the best bound, and the
    solution carries a warning. ``like``: this solution as read before, from the same values
    (an overlap round's, held and restored: ``IlpBuilder.kept``); its plan is taken, and only
    the statistics and warnings are made again (reading one is linear in the step's nodes).
    ``memory_budget``, ``peak_bytes``: the search's budget and its measurement of the step's
    peak, for the solution's fields of those names (``stats``: the caller's telemetry)."""
    read = _read(ilp) if like is None else like
    warnings = []
    extra = {k: read.stats[k] for k in ("recompute_s", "recomputed_layers") if k in read.stats}
    if status != pywraplp.Solver.OPTIMAL:
        incumbent, bound = (v / _SCALE for v in ilp.objective_value())
        gap = (incumbent - bound) / incumbent if incumbent > 0 else 0.0
        extra.update(incumbent=incumbent, best_bound=bound, gap=gap)
        warnings.append(
            f"the solver stopped at its time limit of {time_limit_s:.0f} s with a plan of "
            f"{incumbent * 1e3:.4f} ms, at most {gap:.1%} above the best bound "
            f"({bound * 1e3:.4f} ms): raise time_limit_s for a better plan"
        )
    status_text = "optimal" if status == pywraplp.Solver.OPTIMAL else "time_limit"
    stats = {
        "solver": ilp.solver,
        "status": status_text,
        "solver_nodes": len(ilp.folding.reps),
        "merged_nodes": len(ilp.merged),
        "edge_variables": ilp.n_edge_vars,
        "variables": ilp.lp.NumVariables(),
        "constraints": ilp.lp.NumConstraints(),
        **extra,
        **stats,
    }
    return replace(
        read,
        stats=stats,
        warnings=warnings,
        memory_budget=memory_budget,
        peak_bytes=peak_bytes,
        status=status_text,
    )


def _read(ilp: IlpBuilder) -> Solution:
    """``read_solution``'s plan of the held values: its statistics only the recomputed
    layers' (``recompute_s``, ``recomputed_layers``), no warnings."""
    mesh, profile = ilp.space.mesh, ilp.profile
    choice = dict(ilp.choice())
    rep_of, node_cost = ilp.folding.rep_of, ilp.node_cost
    node_cost_s = {n: node_cost[rep_of.get(n, n)][k] for n, k in choice.items()}
    compute_s = sum(node_cost_s.values())
    collectives: list[tuple[str, Collective, float]] = []
    comm_s = 0.0
    for t in ilp.edge_terms:
        var = t.var
        val = sum(ilp.value(v) for v in var) if isinstance(var, list) else ilp.value(var)
        if val > 0.5:
            comm_s += t.cost_s * len(t.labels)
            colls = reshard_collectives(
                t.src_ps, t.dst_ps, t.shape_dtype[0], t.shape_dtype[1], mesh, profile
            )
            # (priced once for the term's edges: a fold group's, one per instance)
            priced = [(coll, collectives_time([coll], mesh, profile)) for coll in colls]
            for label in t.labels:
                collectives.extend((label, coll, time_s) for coll, time_s in priced)
    # an instance of a fold group runs what its representative's call runs (priced once
    # per representative and strategy); the nodes in name order
    inner: dict[tuple[str, int], list[tuple[Collective, float]]] = {}
    for n in ilp.inner_names():
        r, k = rep_of.get(n, n), choice[n]
        runs = inner.get((r, k))
        if runs is None:
            runs = inner[(r, k)] = [
                (coll, collectives_time([coll], mesh, profile))
                for coll in inner_collectives(ilp.space, r, ilp.space.strategies[n][k])
            ]
        if runs:
            collectives.extend((f"{n}->{n}", coll, t) for coll, t in runs)
    chosen = memory_rows.recomputed(ilp)
    recompute: list[Recompute] = []
    recompute_s = 0.0
    for g in sorted(chosen):
        _, _, nodes, edges = ilp.remat[g]
        compute_s += sum(c * ilp.value(v) for v, c in nodes.items()) / _SCALE
        comm_s += sum(c * ilp.value(v) for v, c in edges.items()) / _SCALE
        recompute_s += sum(c * ilp.value(v) for part in (nodes, edges) for v, c in part.items())
        for rec in ilp.lv.groups[g] if ilp.lv is not None else ():
            recompute.append(rec)
            collectives.extend(_recomputed_collectives(ilp, rec))
    stats = {}
    if chosen:
        stats["recompute_s"] = recompute_s / _SCALE
        stats["recomputed_layers"] = len(recompute)
    # where buckets overlap the backward, the step's length with them ("Overlap")
    step_s = overlap.overlap(ilp)[0] if ilp.hide_coef else compute_s + comm_s
    params = len(set(ilp.space.params.values()))
    host = host_times(ilp.space, profile)
    if profile.host_clock:  # the host's own clock (core/schedule), no choice changes it
        runtime_s = 0.0
        host_start_s = profile.step_overhead
        host_end_s = profile.param_overhead * params
        objective_s = max(step_s, host_start_s + sum(host.values()) + host_end_s)
    else:  # the host's fixed time per step on the step's one clock (the CPU's)
        runtime_s = profile.step_overhead + profile.param_overhead * params
        host_start_s = host_end_s = 0.0
        objective_s = step_s + runtime_s
    return Solution(
        runtime_s=runtime_s,
        host_s=host,
        host_start_s=host_start_s,
        host_end_s=host_end_s,
        choice=choice,
        objective_s=objective_s,
        compute_s=compute_s,
        comm_s=comm_s,
        collectives=collectives,
        node_cost_s=node_cost_s,
        stats=stats,
        recompute=recompute,
    )


def _recomputed_collectives(ilp: IlpBuilder, rec: Recompute) -> list[tuple[str, Collective, float]]:
    """The collectives the copies of ``rec``'s nodes run again: the chosen pairs of the
    edges into them."""
    space, rep = ilp.space, ilp.folding.rep
    found = []
    for n in rec.nodes:
        for j, (src, so) in enumerate(space.in_sources[n]):
            for ev, p, q in ilp.pairs.get((rep(src), so, rep(n), j), ()):
                if p == q or ilp.value(ev) < 0.5:
                    continue
                shape, dtype = space.tensor(src, so)
                for coll in reshard_collectives(p, q, shape, dtype, space.mesh, ilp.profile):
                    t = collectives_time([coll], space.mesh, ilp.profile)
                    found.append((f"{src}->{n} (recomputed)", coll, t))
    return found

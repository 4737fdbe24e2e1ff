"""Gradient buckets: the plan's gradient reductions grouped into few large collectives,
each issued as soon as its last gradient is made.

Takes: the ``StrategySpace`` (its sinks, tensors) and an assembled ``Plan`` (its
collectives, its order). Returns: the plan with each bucket's members replaced in
``plan.collectives`` by one collective, and ``plan.cost`` repriced.

Which reductions: a gradient (a sink ``like`` a parameter) whose redistribution to its
parameter's placement is one collective on one axis, every other axis unchanged
(``core.reduction``; the solver counts both kinds as hiding behind the backward,
passes/solve "Overlap"):

    P -> R      one all-reduce (data parallel, DDP's buckets)
    P -> S(d)   one reduce-scatter along d (a parameter sharded over the axis: FSDP,
                ZeRO; FSDP2 reduces its gradients this way)

Others (two axes reduced, a reduce-scatter into a ``_StridedShard``, the loss) stay as they
are, at the graph's end.

How (at plan time so that counts and costs are the plan's): the candidates, in the order
their gradients are made (``plan.order``, else the traced order), go into one open bucket
per ``(kind, axis, dtype, reduce op)``; a bucket closes when it holds ``bucket_bytes`` or
more (a gradient over the cap is a bucket of its own, issued as early as the others). A
bucket is issued after the node that makes its last gradient (``edge``: ``<that
node>->output[<positions>] (bucket k: n gradients)``). With G ranks on the axis and
``g_i`` the members as made (local, unreduced):

    all-reduce      flat = cat(g_i.view(-1) for i)                  members freed
                    out  = all_reduce(flat, op, axis)               flat freed
                    member i: a view of out (its offset, g_i's shape)
    reduce-scatter  flat = cat(chunk(g_i, G, d_i)[r].view(-1)       rank-major, as FSDP2
                               for r in 0..G-1 for i)               lays out its buckets
                    out  = reduce_scatter(flat, op, axis)           flat freed; 1/G of it
                    member i: a view of out (its offset, g_i's chunk shape)

so rank r's ``out`` holds each member's reduced chunk r: exactly what DTensor's own
``Partial -> Shard(d_i)`` gives each member (one ``reduce_scatter_tensor`` along d_i). The
bucket is priced as one call: ``time(B) = collective_time(kind, sum of member bytes)``
(one ``collective_overhead``, one set of latencies, where n reductions paid n), on the
axis's link. passes/codegen emits exactly this. Where it is waited for:

    gloo            at once (two collectives in flight on one gloo group can mix their
                    messages, passes/codegen ``_Ring``): ``overlap`` False in the entry
    CUDA            all-reduce: at the backward's end (its input is copied into its output
                    at the call and freed there); reduce-scatter: where the next
                    reduce-scatter bucket on its axis is issued (``wait_after``: that
                    bucket's issue node; the last at the backward's end). The process
                    group holds a collective's input until it is waited for, and a
                    reduce-scatter's input is G times its output: so at most one bucket's
                    input is held per axis, as FSDP2 waits for one reduce-scatter before
                    it issues the next

passes/memory counts the members to the issue point, ``flat`` there (to its wait, where
``wait_after`` or a reduce-scatter waited at the end holds it), and ``out`` (the members as
their parameters hold them: 1/G of ``flat`` for a reduce-scatter) from there to the end;
core/schedule issues the bucket after its last gradient and, where the profile overlaps
collectives, lets the compute stream run on to the bucket's wait.

``plan.cost``: ``comm_s`` and ``comm_by_kind_s`` are repriced with the buckets (the sum
of the step's collectives, nothing discounted); the solver's own objective (passes/solve,
"Overlap": the buckets hidden behind the backward up to its length) is kept as
``objective_s``, and ``total_s`` becomes the emitted step's simulated length
(``Plan.emitted_step_s``, autopar/api), which credits exactly the overlap the emitted step
has.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch

from autopar.core import Plan, StrategySpace, parse_placements, reduction, roles

from .solve import collective_s, overlaps_collectives

__all__ = ["DEFAULT_BUCKET_BYTES", "Bucket", "bucket_reductions", "candidates"]

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""DDP's default bucket cap (``bucket_cap_mb=25``)."""


@dataclasses.dataclass
class Bucket:
    """One bucket: its members' sink positions, in the order their gradients are made."""

    kind: str
    axis: str
    dtype: torch.dtype
    op: str
    members: list[dict] = dataclasses.field(default_factory=list)
    positions: list[int] = dataclasses.field(default_factory=list)
    issue: str = ""
    at: int = 0  # the issue node's position in the step's order
    nbytes: int = 0


def candidates(
    space: StrategySpace, plan: Plan
) -> list[tuple[int, dict, int, str, str, torch.dtype]]:
    """``(sink position, its collective, producer index, producer, reduce op, dtype)`` of
    each gradient whose reduction is one all-reduce or one reduce-scatter on one axis
    (module docstring), in the order made."""
    order = list(plan.order) if plan.order else list(space.order)
    index = {n: i for i, n in enumerate(order)}
    per_edge: dict[str, list[dict]] = defaultdict(list)
    for c in plan.collectives:
        per_edge[c["edge"]].append(c)
    found = []
    for sink in space.sinks:
        if sink.like is None or space.roles[sink.like] != roles.PARAM:
            continue
        label = f"{sink.src}->output[{sink.position}] (as {sink.like})"
        cs = per_edge.get(label, [])
        if len(cs) != 1 or sink.src_out != 0:
            continue
        src_ps = plan.nodes[sink.src].out[0]
        dst_ps = plan.nodes[sink.like].out[0]
        if src_ps is None or dst_ps is None:
            continue
        src_p = parse_placements(src_ps)
        reduced = reduction(src_p, parse_placements(dst_ps))
        if reduced is None:
            continue
        axis, dim = reduced
        if cs[0]["kind"] != ("all_reduce" if dim is None else "reduce_scatter"):
            continue
        op = str(getattr(src_p[axis], "reduce_op", "sum"))
        dtype = space.tensor(sink.src, 0)[1]
        found.append((sink.position, cs[0], index[sink.src], sink.src, op, dtype))
    found.sort(key=lambda f: (f[2], f[0]))
    return found


def bucket_reductions(space: StrategySpace, plan: Plan, bucket_bytes: float) -> Plan:
    """``plan`` with its gradient reductions bucketed (module docstring)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    found = candidates(space, plan)
    open_: dict[tuple, Bucket] = {}
    done: list[Bucket] = []
    for position, c, at, src, op, dtype in found:
        key = (c["kind"], c["axis"], dtype, op)
        b = open_.setdefault(key, Bucket(c["kind"], c["axis"], dtype, op))
        b.members.append(c)
        b.positions.append(position)
        b.issue, b.at = src, at
        b.nbytes += int(c["nbytes"])
        if b.nbytes >= bucket_bytes:
            done.append(open_.pop(key))
    done.extend(open_.values())
    axis_index = {a: i for i, a in enumerate(plan.mesh.axis_names)}
    bucketed = {id(c) for b in done for c in b.members}
    done.sort(key=lambda b: b.at)
    collectives = [c for c in plan.collectives if id(c) not in bucketed]
    overlap = overlaps_collectives(plan.mesh)
    for k, b in enumerate(done):
        entry = {
            "edge": f"{b.issue}->output[{','.join(map(str, b.positions))}] "
            f"(bucket {k}: {len(b.members)} gradients)",
            "param": f"{len(b.members)} gradients ({b.members[0].get('param', '?')}, ...)",
            "params": [c.get("param", "") for c in b.members],
            "kind": b.kind,
            "axis": b.axis,
            "nbytes": b.nbytes,
            "group_size": int(b.members[0]["group_size"]),
            "time_s": collective_s(plan.mesh, b.kind, axis_index[b.axis], b.nbytes),
            "bucket": k,
            "dtype": str(b.dtype).removeprefix("torch."),
            "op": b.op,
            "overlap": overlap,
        }
        if overlap and b.kind == "reduce_scatter":  # its input held to its wait: bound it
            later = [n for n in done if n.kind == b.kind and n.axis == b.axis and n.at > b.at]
            if later:
                entry["wait_after"] = later[0].issue
        collectives.append(entry)
    by_kind: dict[str, float] = defaultdict(float)
    for c in collectives:
        by_kind[c["kind"]] += c["time_s"]
    cost = dict(plan.cost)
    cost.setdefault("objective_s", cost.get("total_s", 0.0))
    cost["comm_s"] = sum(by_kind.values())
    cost["comm_by_kind_s"] = dict(sorted(by_kind.items()))
    out = dataclasses.replace(plan, collectives=tuple(collectives), cost=cost)
    out.stats["buckets"] = len(done)
    out.stats["overlaps_collectives"] = overlap
    out.stats["bucketed_reductions"] = len(bucketed)
    return out

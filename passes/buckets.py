"""Gradient buckets: the plan's gradient reductions grouped into few large collectives,
each issued as soon as its last gradient is made.

Takes: the ``StrategySpace`` (its sinks, tensors) and an assembled ``Plan`` (its
collectives, its order, its memory budget and the solver's peak). Returns: a new plan with
each bucket's members replaced in ``plan.collectives`` by its collectives (one
``PlannedCollective`` per step), ``plan.cost`` repriced, ``plan.overlaps_collectives`` set
from the profile, and the statistics below added to a copy of ``plan.stats``.

Which reductions: a gradient (a sink ``like`` a parameter) whose redistribution to its
parameter's placement reduces a Partial on one mesh axis or several, every other axis
unchanged (``core.reductions``), and runs as the plan lists it for that edge in one of two
shapes (``chain``):

    direct          one collective per reduced axis, in the listed order:
        P -> R          an all-reduce (data parallel, DDP's buckets)
        P -> S(d)       a reduce-scatter along d (a parameter sharded over the axis:
                        FSDP, ZeRO; FSDP2 reduces its gradients this way)
                    e.g. (P, P) -> (S(0), R): a norm's weight under FSDP over dp and
                    sequence parallelism over tp: RS(dp) then AR(tp)
    hierarchical    (P, P) -> (R, R) as cost_models/comm's hierarchical reduction:
                    RS(inner), AR(each outer), AG(inner), on the flat tensor

The one-axis cases are the ones the solver counts as hiding behind the backward (passes/solve
"Overlap"); it prices a reduction over several axes whole, its step's length (``objective_s``)
has each of the chain's steps beside the compute on its axis (``chain`` and ``splits_evenly``
are passes/solve's), and the emitted step (the rounds' ``assess``) credits what the bucket
hides. Others (a reduce-scatter into a ``_StridedShard``, a reduce-scatter that would split a
dim unevenly, the loss) stay as they are, at the graph's end.

How (at plan time so that counts and costs are the plan's): the candidates, in the order
their gradients are made (``plan.order``, else the traced order), go into one open bucket
per ``(listed collectives, dtype, reduce op)``; a bucket closes when its flat input holds
``bucket_bytes`` or more (a gradient over the cap is a bucket of its own, issued as early
as the others). A bucket is issued after the node that makes its last gradient (``edge``:
``<that node>->output[<positions>] (bucket k: n gradients)``). With G ranks on the axis and
``g_i`` the members as made (local, unreduced), one step of a bucket:

    all-reduce      flat = cat(g_i.view(-1) for i)                  members freed
                    out  = all_reduce(flat, op, axis)               flat freed
                    member i: a view of out (its offset, g_i's shape)
    reduce-scatter  flat = cat(chunk(g_i, G, d_i)[r].view(-1)       rank-major, as FSDP2
                               for r in 0..G-1 for i)               lays out its buckets
                    out  = reduce_scatter(flat, op, axis)           flat freed; 1/G of it
                    member i: a view of out (its offset, g_i's chunk shape)

so rank r's ``out`` holds each member's reduced chunk r: exactly what DTensor's own
``Partial -> Shard(d_i)`` gives each member (one ``reduce_scatter_tensor`` along d_i). A
direct bucket over several axes runs its steps in the listed order on one flat tensor laid
out rank-major over each reduce-scatter's axis in turn (rank r1 of the first, within it r2
of the second, ..., each member's chunk ``g_i.chunk(G1, d1)[r1].chunk(G2, d2)[r2]``), so
each reduce-scatter leaves the next its layout; an all-reduce between them reduces what is
there. So each member ends as DTensor's steps, one by one, leave it. A hierarchical bucket
reduces ``cat(g_i.view(-1))``, padded to a multiple of the inner axis's size, by its three
steps, and each member is a view of the gathered whole. Each step is one entry of
``plan.collectives`` (``step``, ``steps``, one edge: core/schedule runs them one after
the other), priced as one call on its axis: ``time = collective_time(kind, bytes)``
(``step_bytes``: one ``collective_overhead``, one set of latencies, where n reductions
paid n). passes/codegen emits exactly this. Where it is waited for:

    gloo            every step at once (two collectives in flight on one gloo group can
                    mix their messages, passes/codegen ``_Ring``): ``overlap`` False in
                    the entry
    CUDA            one step: an all-reduce at the backward's end (its input is copied
                    into its output at the call and freed there); a reduce-scatter where
                    the next one-step reduce-scatter bucket on its axis is issued
                    (``wait_after``: that bucket's issue node; the last at the backward's
                    end). The process group holds a collective's input until it is waited
                    for, and a reduce-scatter's input is G times its output: so at most
                    one bucket's input is held per axis, as FSDP2 waits for one
                    reduce-scatter before it issues the next.
                    several steps: step i (i >= 1) where the i-th bucket after this one is
                    issued (``step_after``), the step before waited for there: the graph
                    has no streams to chain them on, so the compute stream runs on while
                    each step runs, and waits for it a bucket later; where no bucket is
                    left, at the backward's end, as is the last step's wait

passes/memory counts the members to the issue point, ``flat`` there (to its wait, where
``wait_after`` or a reduce-scatter waited at the end holds it; a bucket of several steps
whose first is a reduce-scatter, to its second step's issue), and ``out`` (the members as
their parameters hold them: 1/G of ``flat`` for a reduce-scatter) from there to the end;
core/schedule issues the bucket after its last gradient and, where the profile overlaps
collectives, lets the compute stream run on to the bucket's wait.

Memory. The solver bounds the step with every gradient reduced at the graph's end, one at a
time (passes/solve, passes/memory). A bucket holds its members from the first one made to
its issue, and its flat input beside them where it is issued (to its wait, where that is
later): a bucket of many gradients issued late can peak above the plan's memory budget
(``plan.memory_budget``) where the solver's step did not. ``bucket_measured`` measures
the bucketed step (passes/memory ``simulate``); while its peak is above the budget, each
bucket that holds bytes at the peak is split (its key's cap becomes half its bytes), or, a
bucket of one gradient, that gradient is reduced as the plan lists it; after
``BUDGET_ROUNDS`` rounds, none is bucketed. ``stats["bucket_budget"]``: how many keys were
split and gradients left out. Nothing is measured where the solver's peak
(``plan.solver_peak_bytes``) plus every bucket's flat input fits the budget: at any point the
bucketed step holds at most those more than the step the solver bounded (a member is freed
at its bucket's issue, and its reduced part is no larger than it), and the operator order
(passes/order) only lowers that step's peak.

``plan.cost``: ``comm_s`` and ``comm_by_kind_s`` are repriced with the buckets (the sum
of the step's collectives, nothing discounted, but an op's own, ``n->n``, which are in
its node's cost and so in ``compute_s``); the solver's own objective (passes/solve,
"Overlap": the buckets hidden behind the backward up to its length) is kept as
``objective_s``, and ``total_s`` becomes the emitted step's simulated length
(``Plan.emitted_step_s``, autopar/api), which credits exactly the overlap the emitted step
has.

``plan.stats`` (telemetry): ``buckets``, ``overlaps_collectives``, ``bucketed_reductions``
(gradients in a bucket), and ``bucket_budget`` where the budget split or left out any.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from autopar.core import (
    Plan,
    PlannedCollective,
    StrategySpace,
    local_shape,
    parse_placements,
    reductions,
    roles,
)
from autopar.core.plan import comm_by_kind

from .memory import MemoryReport, held_inputs, simulate
from .pricing import collective_s, overlaps_collectives

__all__ = [
    "BUDGET_ROUNDS",
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "bucket_measured",
    "bucket_reductions",
    "candidates",
    "flat_bytes",
]

BUDGET_ROUNDS = 8
"""How many times the buckets held at the peak are split before every gradient is reduced
at the graph's end, as the solver priced the step (``bucket_measured``)."""

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""DDP's default bucket cap (``bucket_cap_mb=25``)."""


def chain(steps: Sequence[tuple[str, Any]], scattered: Mapping[Any, int | None]) -> str | None:
    """``direct`` or ``hierarchical`` where a gradient's collectives (``steps``: ``(kind,
    axis)`` in order) are a reduction over the axes of ``scattered`` (axis -> scatter dim,
    None: reduced into Replicate; ``core.reductions``) that a bucket can run on one flat
    tensor (``bucket_reductions``); else None. Axes by name or by index, alike in both."""
    kinds = [k for k, _ in steps]
    axes = [a for _, a in steps]
    if (
        len(steps) >= 3
        and kinds[0] == "reduce_scatter"
        and kinds[-1] == "all_gather"
        and axes[0] == axes[-1]
        and all(k == "all_reduce" for k in kinds[1:-1])
        and len(set(axes[:-1])) == len(axes) - 1
        and set(axes) == set(scattered)
        and all(d is None for d in scattered.values())
    ):
        return "hierarchical"
    if len(set(axes)) != len(axes) or set(axes) != set(scattered):
        return None
    wanted = {a: ("all_reduce" if d is None else "reduce_scatter") for a, d in scattered.items()}
    return "direct" if all(wanted[a] == k for k, a in steps) else None


def splits_evenly(
    made: Sequence[int],
    steps: Sequence[tuple[str, Any]],
    scattered: Mapping[Any, int | None],
    size: Mapping[Any, int],
) -> bool:
    """Each reduce-scatter of ``steps`` splits what the ones before it left of the local
    shape ``made`` evenly (a bucket's flat tensor is the members' equal chunks, rank by
    rank); ``size``: each axis's ranks."""
    local = list(made)
    for kind, axis in steps:
        d = scattered[axis]
        if kind == "reduce_scatter" and d is not None:
            if local[d] % size[axis]:
                return False
            local[d] //= size[axis]
    return True


@dataclasses.dataclass
class Bucket:
    """One bucket: its members' sink positions, in the order their gradients are made, and
    the collectives it runs (``steps``: ``(kind, axis)``, in order)."""

    steps: tuple[tuple[str, str], ...]
    dtype: torch.dtype
    op: str
    members: list[PlannedCollective] = dataclasses.field(default_factory=list)
    positions: list[int] = dataclasses.field(default_factory=list)
    sources: list[str] = dataclasses.field(default_factory=list)  # the nodes making them
    issue: str = ""
    at: int = 0  # the issue node's position in the step's order
    numel: int = 0  # of the flat input, unpadded


def candidates(space: StrategySpace, plan: Plan) -> list[tuple]:
    """``(sink position, its collectives, producer index, producer, reduce op, dtype,
    local numel as made)`` of each gradient whose reduction a bucket can run (module
    docstring), in the order made."""
    index = {n: i for i, n in enumerate(plan.order)} if plan.order else space.position
    per_edge: dict[str, list[PlannedCollective]] = defaultdict(list)
    for c in plan.collectives:
        per_edge[c.edge].append(c)
    # what a gradient's placements, collectives and tensor make of it, once per space (a
    # fold group's layers share them; each overlap round reads every gradient)
    made_of: dict[tuple, tuple | None] = space.derived.setdefault("bucket_candidates", {})
    found = []
    for sink in space.sinks:
        if sink.like is None or space.roles[sink.like] != roles.PARAM:
            continue
        label = f"{sink.src}->output[{sink.position}] (as {sink.like})"
        cs = per_edge.get(label, [])
        if not cs or sink.src_out != 0:
            continue
        src_ps = plan.nodes[sink.src].out[0]
        dst_ps = plan.nodes[sink.like].out[0]
        if src_ps is None or dst_ps is None:
            continue
        steps = tuple((c.kind, c.axis) for c in cs)
        shape, dtype = space.tensor(sink.src, 0)
        key = (src_ps, dst_ps, steps, tuple(shape), dtype)
        if key not in made_of:
            made_of[key] = _reduction(plan.mesh, src_ps, dst_ps, steps, tuple(shape))
        made = made_of[key]
        if made is not None:
            op, numel = made
            found.append((sink.position, cs, index[sink.src], sink.src, op, dtype, numel))
    found.sort(key=lambda f: (f[2], f[0]))
    return found


def _reduction(
    mesh, src_ps: tuple[str, ...], dst_ps: tuple[str, ...], steps: tuple, shape: tuple
) -> tuple[str, int] | None:
    """``(reduce op, local numel as made)`` of a gradient of ``shape`` made as ``src_ps``
    and held as ``dst_ps``, reduced by the collectives ``steps``, where a bucket can run
    that reduction (``chain``); else None."""
    src_p = parse_placements(src_ps)
    reduced = reductions(src_p, parse_placements(dst_ps))
    if reduced is None:
        return None
    scattered = {mesh.axis_names[a]: d for a, d in reduced.items()}
    how = chain(steps, scattered)
    if how is None:
        return None
    made = local_shape(shape, src_p, mesh.shape)
    if how == "direct" and not splits_evenly(
        made, steps, scattered, dict(zip(mesh.axis_names, mesh.shape))
    ):
        return None
    return str(getattr(src_p[next(iter(reduced))], "reduce_op", "sum")), math.prod(made)


def step_bytes(b: Bucket, mesh) -> list[int]:
    """The bytes each of ``b``'s collectives moves (cost_models/comm's convention: the
    tensor as it is before a reduce-scatter and after an all-gather): a reduce-scatter
    leaves 1/n of the flat tensor to the next; a hierarchical chain (its last an all-gather)
    pads the flat tensor to a multiple of its inner axis's size."""
    size = {a: n for a, n in zip(mesh.axis_names, mesh.shape)}
    item = b.dtype.itemsize
    if b.steps[-1][0] == "all_gather":
        n = size[b.steps[0][1]]
        shard = -(-b.numel // n) * item
        return [shard * n] + [shard] * (len(b.steps) - 2) + [shard * n]
    out, now = [], b.numel * item
    for kind, axis in b.steps:
        out.append(now)
        if kind == "reduce_scatter":
            now //= size[axis]
    return out


def bucket_reductions(
    space: StrategySpace, plan: Plan, bucket_bytes: float, optimizer: str = "adamw"
) -> Plan:
    """``plan`` with its gradient reductions bucketed (module docstring)."""
    return bucket_measured(space, plan, bucket_bytes, optimizer)[0]


def bucket_measured(
    space: StrategySpace, plan: Plan, bucket_bytes: float, optimizer: str = "adamw"
) -> tuple[Plan, MemoryReport | None]:
    """``bucket_reductions``, and the step memory of the plan it returns where the budget
    check measured it (passes/memory ``simulate``; else None): where the buckets raise the
    step's peak above the plan's memory budget, the buckets held at the peak are split,
    and a gradient alone in one is reduced as the solver priced it ("Memory", module
    docstring)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    found = candidates(space, plan)
    budget = plan.memory_budget
    caps: dict[tuple, float] = {}  # (steps, dtype, op) -> its lowered cap
    alone: set[int] = set()  # sink positions reduced as the plan lists them
    # the solver's peak (the gradients reduced at the end) and every bucket's flat input
    # live at once bound the bucketed step's: where that fits, nothing is measured
    solver_peak = plan.solver_peak_bytes
    for _ in range(BUDGET_ROUNDS):
        out, done = _bucketed(plan, [f for f in found if f[0] not in alone], bucket_bytes, caps)
        if budget is None or not done:
            return out, None
        flat = flat_bytes(out)
        if not (alone or caps) and solver_peak is not None and solver_peak + flat <= budget:
            return out, None
        report = simulate(space, out, optimizer)
        if report.peak_bytes <= budget:
            break
        held = _held_at_peak(out, done, report)
        if not held:
            break  # the peak is the step's own (the solver's budget check says so)
        for b in held:
            if len(b.members) == 1:
                alone.update(b.positions)
            else:
                caps[(b.steps, b.dtype, b.op)] = b.numel * b.dtype.itemsize / 2
    else:  # the solver's step: every gradient reduced at the graph's end
        out = _bucketed(plan, [], bucket_bytes, {})[0]
        return _with_budget(out, {"split": len(caps), "unbucketed": len(found)}), None
    if alone or caps:
        out = _with_budget(out, {"split": len(caps), "unbucketed": len(alone)})
    return out, report


def _with_budget(plan: Plan, split: dict) -> Plan:
    """``plan`` with ``stats["bucket_budget"]``: what the budget split and left out."""
    return dataclasses.replace(plan, stats={**plan.stats, "bucket_budget": split})


def flat_bytes(plan: Plan) -> int:
    """The bytes of every bucket's flat input in ``plan`` (each bucket's first step moves
    it whole: padded where a hierarchical bucket pads it, ``step_bytes``)."""
    return sum(c.nbytes for c in plan.collectives if c.bucket is not None and not c.step)


def _held_at_peak(plan: Plan, done: Sequence[Bucket], report: MemoryReport) -> list[Bucket]:
    """The buckets of ``done`` that hold bytes at ``report``'s peak: a member made and not
    yet in its bucket (from the first member's node to the issue), or the flat input not
    yet freed (to its wait: ``wait_after``, ``step_after``, or the step's end where a
    reduce-scatter is waited for there; passes/memory ``held_inputs``)."""
    point = {n: i for i, (n, _) in enumerate(report.timeline)}
    end = len(report.timeline) - 1
    peak = report.peak_index
    until = held_inputs(plan)
    held = []
    for b in done:
        first = min(point.get(src, end) for src in b.sources)
        freed = until.get(b.positions[0])
        last = point.get(b.issue, end) if freed is None else point.get(freed, end)
        if first <= peak <= last:
            held.append(b)
    return held


def _bucketed(
    plan: Plan, found: Sequence[tuple], bucket_bytes: float, caps: dict[tuple, float]
) -> tuple[Plan, list[Bucket]]:
    """``plan`` with the reductions ``found`` (``candidates``) in buckets of at most
    ``bucket_bytes`` (``caps``: a lower cap by the bucket's key), and the buckets."""
    open_: dict[tuple, Bucket] = {}
    done: list[Bucket] = []
    for position, cs, at, src, op, dtype, numel in found:
        steps = tuple((c.kind, c.axis) for c in cs)
        key = (steps, dtype, op)
        b = open_.setdefault(key, Bucket(steps, dtype, op))
        b.members.append(cs[0])
        b.positions.append(position)
        b.sources.append(src)
        b.issue, b.at = src, at
        b.numel += numel
        if b.numel * dtype.itemsize >= caps.get(key, bucket_bytes):
            done.append(open_.pop(key))
    done.extend(open_.values())
    axis_index = {a: i for i, a in enumerate(plan.mesh.axis_names)}
    bucketed = {id(c) for f in found for c in f[1]}  # every candidate is in a bucket
    done.sort(key=lambda b: b.at)
    collectives: list[PlannedCollective] = [c for c in plan.collectives if id(c) not in bucketed]
    overlap = overlaps_collectives(plan.mesh)

    def later_points(b: Bucket) -> list[str]:
        """The points after ``b``'s issue where other buckets are issued, in order: on
        CUDA, step i of a bucket of several is issued at the i-th (module docstring)."""
        return [n for _, n in sorted({o.at: o.issue for o in done if o.at > b.at}.items())]

    for k, b in enumerate(done):
        single = len(b.steps) == 1
        first = b.members[0].param
        params = tuple("" if c.param is None else c.param for c in b.members)
        for i, ((kind, axis), nbytes) in enumerate(zip(b.steps, step_bytes(b, plan.mesh))):
            step_after = wait_after = None
            if not single and overlap and 0 < i <= len(later_points(b)):  # else at the end
                step_after = later_points(b)[i - 1]
            if overlap and single and kind == "reduce_scatter":  # its input held to its wait
                later = [
                    n for n in done if n.steps == b.steps and n.at > b.at
                ]  # the next one-step reduce-scatter bucket on its axis
                if later:
                    wait_after = later[0].issue
            collectives.append(
                PlannedCollective(
                    edge=f"{b.issue}->output[{','.join(map(str, b.positions))}] "
                    f"(bucket {k}: {len(b.members)} gradients)",
                    kind=kind,
                    axis=axis,
                    nbytes=nbytes,
                    group_size=int(plan.mesh.shape[axis_index[axis]]),
                    time_s=collective_s(plan.mesh, kind, axis_index[axis], nbytes),
                    param=f"{len(b.members)} gradients ({'?' if first is None else first}, ...)",
                    params=params,
                    bucket=k,
                    dtype=str(b.dtype).removeprefix("torch."),
                    op=b.op,
                    overlap=overlap,
                    step=None if single else i,
                    steps=None if single else len(b.steps),
                    step_after=step_after,
                    wait_after=wait_after,
                )
            )
    by_kind = comm_by_kind(collectives)
    cost = dict(plan.cost)
    cost.setdefault("objective_s", cost.get("total_s", 0.0))
    cost["comm_s"] = sum(by_kind.values())
    cost["comm_by_kind_s"] = dict(sorted(by_kind.items()))
    stats = {
        **plan.stats,
        "buckets": len(done),
        "overlaps_collectives": overlap,
        "bucketed_reductions": len(found),  # gradients
    }
    out = dataclasses.replace(
        plan,
        collectives=tuple(collectives),
        cost=cost,
        stats=stats,
        overlaps_collectives=overlap,
    )
    return out, done

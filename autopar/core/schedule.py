"""The simulated step of one rank: compute and communication streams, from a plan alone.

``schedule`` is a simulation of one rank's step on two streams, compute and
communication, from the plan's per-node costs and predicted collectives:

    - the compute stream runs the points of the step in the memory timeline's order (step
      order, with the copies a checkpointed layer recomputes, ``recompute:<node>``, before
      the layer's first backward read; without a timeline, ``plan.order``, else graph
      order); each takes its chosen strategy's ``cost_s``;
    - a reshard on the edge ``src->dst`` runs on the communication stream and ``dst`` waits
      for it; a reshard into a recomputed copy (``(recomputed)``) is one into
      ``recompute:dst``;
    - gradient reductions (edges into the step's outputs) run on the communication stream
      after their gradient is made; a bucket of them (passes/buckets: an entry with
      ``bucket``) after its last gradient; the other edges into the outputs (the loss's,
      ``purpose`` ``output``) as a gradient reduction that is not in a bucket;
    - a collective an op runs inside itself (edge ``n->n``: a load-balanced or ring
      attention's exchanges, a class-split cross-entropy's reductions, passes/solve) is
      already in the node's ``cost_s``, overlapped
      as the op overlaps it: it is drawn on the communication stream from the node's start,
      and nothing waits for it;
    - the communication stream runs the collectives of one mesh axis one at a time, in
      the order issued; where the device overlaps collectives
      (``plan.overlaps_collectives``, passes/buckets: CUDA) those of different axes run beside
      each other (each axis is its own process group, with its own NCCL stream and, across
      nodes, its own links); on gloo, one at a time;
    - the collectives of one edge run one after another, in the plan's order, whatever
      their axes: each takes the one before's output (DTensor's reduction over one axis and
      then the next, or a hierarchical reduction's RS(inner) -> AR(outer) -> AG(inner),
      cost_models/comm), so the edge takes the sum of their times, as the solver prices it.
      A node's own exchanges (``n->n``) are drawn from its start, each on its axis.

Where the profile prices the host's fixed time per step (``plan.cost["runtime_s"]``:
the CPU's runtime boundary, passes/solve), the compute stream starts after it.

Where the host runs ahead of the device on its own clock (a calibrated GPU: its nodes have
``host_s``, cost_models.compute.host_time), the step has a third clock, the host's, which
issues the points in order:

    host_0 = plan.cost["host_start_s"]               (the runtime's shards in)
    host_i = host_{i-1} + host_s(i)                  (point i issued)
    start_i >= host_i                                (a kernel runs once it is issued)
    step   >= host_n + plan.cost["host_end_s"]       (the gradients out, after the last)

so a step of small kernels is as long as its host, and one of large kernels as its
device, the host running ahead (queued kernels). A node that runs no kernel (a view,
``cost_s`` 0) takes only host time. The runtime's two parts are the ``host`` stream's
spans.

Two issue rules give two schedules:

    - ``overlap=False``, the step as codegen emits it: a reshard is issued when the compute
      stream reaches its consumer (the functional collective sits right before it), or
      after the point its ``issue_after`` names (passes/prefetch: where the device
      overlaps collectives, ahead of its consumer, which waits for it), and the
      gradient reductions when the backward ends (the graph's outputs, passes/codegen),
      except buckets, issued after their last gradient: where the profile overlaps
      collectives (the entry's ``overlap``: CUDA) the compute stream runs on and the
      bucket is waited for at the end, or after the point its ``wait_after`` names (a
      reduce-scatter bucket, where the next on its axis is issued: the compute stream
      waits there for it to end); a bucket of several steps issues its step i (i >= 1)
      after the point its ``step_after`` names, where the compute stream waits for step
      i - 1 (none: at the backward's end); else (gloo) the compute stream waits for each
      step where the bucket is issued. Nothing else overlaps.
    - ``overlap=True``: every collective is issued as soon as its input is made (a reshard
      when ``src`` ends, a gradient reduction when its gradient does), as a prefetching,
      DDP-style runtime would. Its length shows what overlap the plan leaves room for.

``Plan.emitted_step_s()`` is the emitted schedule's length (``schedule_length``: the same
simulation, without a span per point): the step time the plan predicts
for the step codegen emits, which overlaps its gradient buckets and the reshards it
issues ahead (passes/prefetch), and nothing else. It is
``plan.cost["total_s"]`` once the buckets stage ran; the solver's objective
(``plan.cost["objective_s"]``) is a linear stand-in that the ILP can optimize: it hides
the buckets behind the backward up to the backward's length, whatever their order
(passes/solve, "Overlap"). The report states the lengths side by side.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .planned import PlannedCollective

if TYPE_CHECKING:
    from .plan import Plan
    from .space import Recompute

__all__ = [
    "COMM",
    "COMPUTE",
    "COPY",
    "HOST",
    "Span",
    "bucket_site",
    "edge_ends",
    "purpose",
    "schedule",
    "schedule_inputs",
    "schedule_length",
    "step_length",
    "step_points",
]

COMPUTE, COMM, HOST = "compute", "communication", "host"

COPY = "recompute:"
"""Prefix of the name of a checkpointed layer's copy of a node among the step's points."""

_Cs = list[PlannedCollective]


def step_points(
    order: Sequence[str], recompute: Iterable[Recompute] = ()
) -> list[tuple[str, str, str | None]]:
    """``(point, node, fold group)`` of each point of the step that runs ``order`` with the
    layers ``recompute`` checkpointed (passes/remat): each node (group None), and right
    before the backward node a layer's copies run before (``Recompute.before``), a copy of
    each node it recomputes (``recompute:<node>``, the layer's group). passes/memory's
    timeline has these points; core/schedule runs them where a plan has no timeline."""
    before: dict[str, list[Recompute]] = defaultdict(list)
    for rec in recompute:
        before[rec.before].append(rec)
    points: list[tuple[str, str, str | None]] = []
    for name in order:
        for rec in before.get(name, ()):
            points.extend((COPY + n, n, rec.group) for n in rec.nodes)
        points.append((name, name, None))
    return points


def purpose(collective: PlannedCollective) -> str:
    """``gradient reduction`` (an edge into a gradient the step returns, ``a->output[3]
    (as primals_3)``, or a bucket of them), ``output`` (into another value it returns
    replicated: the loss, or a model's output where there is no loss) or ``reshard``
    (between operators)."""
    edge = collective.edge
    if "->output[" not in edge:
        return "reshard"
    if " (as " in edge or collective.bucket is not None:
        return "gradient reduction"
    return "output"


@dataclass(frozen=True, slots=True)
class Span:
    """One thing a stream does in the simulated step.

    Attributes:
        stream: ``compute`` or ``communication``.
        name: the node (compute) or the collective's edge (communication).
        start_s: when it starts, from the step's start.
        dur_s: how long it runs.
        module: the module path it belongs to (a gradient reduction: its parameter).
        what: the op (compute), or ``kind@axis, bytes`` (communication).
    """

    stream: str
    name: str
    start_s: float
    dur_s: float
    module: str
    what: str

    @property
    def end_s(self) -> float:
        return self.start_s + self.dur_s


def _points(plan: Plan) -> list[str]:
    """The compute stream's points in order: the memory timeline's, else the plan's order
    (passes/order), else graph order, with the copies of the layers it checkpoints
    (``step_points``: the timeline's points, without measuring the step's memory)."""
    step = plan.memory.get("step") or {}
    nodes = (step.get("timeline") or {}).get("nodes")
    if nodes:
        return [n for n in nodes if n != "output"]
    if not plan.recompute:  # (no copies: the order itself)
        return list(plan.order or plan.nodes)
    return [p for p, _, _ in step_points(plan.order or list(plan.nodes), plan.recompute)]


def schedule_inputs(plan: Plan) -> tuple:
    """What ``schedule`` reads of a plan: two plans with equal inputs have one schedule."""
    cost = plan.cost
    return (
        _points(plan),
        plan.nodes,
        plan.collectives,
        plan.overlaps_collectives,
        cost.get("runtime_s", 0.0),
        cost.get("host_start_s", 0.0),
        cost.get("host_end_s", 0.0),
    )


def inside_op(edge: str) -> bool:
    """Whether a collective's edge text is an op's own (``n->n``: run inside the op, its
    time in the node's ``cost_s``)."""
    src, dst = edge_ends(edge)
    return src == dst


def edge_ends(edge: str) -> tuple[str, str]:
    """``(src, dst point)`` of a collective's edge text (``a->b``, ``a->b (recomputed)``,
    ``a->output[3] (as primals_3)``)."""
    src, _, rest = edge.partition("->")
    dst, _, note = rest.partition(" ")
    if note == "(recomputed)":
        dst = f"recompute:{dst}"
    return src, dst


def bucket_site(collective: PlannedCollective) -> tuple[str, list[int]]:
    """``(the node after which it is issued, its graph output positions)`` of a gradient
    bucket's entry (passes/buckets: edge ``<node>->output[<positions>] (bucket k: ...)``)."""
    src, _, rest = collective.edge.partition("->output[")
    return src, [int(p) for p in rest.partition("]")[0].split(",")]


def _comm_span(c: PlannedCollective, start: float) -> Span:
    site = c.param or c.module or ""
    what = f"{c.kind}@{c.axis}, {c.nbytes:,} bytes over {c.group_size} ranks"
    return Span(COMM, c.edge, start, c.time_s, site, what)


def schedule(plan: Plan, *, overlap: bool = False) -> list[Span]:
    """The two streams of one rank's step (module docstring), compute then communication
    spans, each in time order, then the host's where it has its own clock."""
    compute, comm, hosted, _ = _run(plan, overlap, True)
    return compute + sorted(comm, key=lambda s: s.start_s) + hosted


def schedule_length(plan: Plan, *, overlap: bool = False) -> float:
    """``step_length(schedule(plan, overlap=overlap))``, without the compute stream's spans
    (one per point: ~18,000 in a 96-layer step, judged once per overlap round)."""
    _, comm, hosted, compute_end = _run(plan, overlap, False)
    return max(compute_end, step_length(comm), step_length(hosted))


def _run(
    plan: Plan, overlap: bool, spans: bool
) -> tuple[list[Span], list[Span], list[Span], float]:
    """``schedule``'s streams: the compute spans (where ``spans``), the communication
    spans as issued, the host's, and where the compute stream's last span ends."""
    points = _points(plan)
    position = {p: i for i, p in enumerate(points)}
    into: dict[str, _Cs] = defaultdict(list)  # reshards, by the point that waits
    after: dict[str, _Cs] = defaultdict(list)  # what each point's end issues
    grads: _Cs = []
    inside: dict[str, _Cs] = defaultdict(list)  # a node's own, in its cost_s
    waited: set[int] = set()  # a bucket the compute stream waits for where it is issued
    wait_at: dict[str, _Cs] = defaultdict(list)  # buckets waited for after a point
    chained: dict[int, PlannedCollective] = {}  # a bucket of several steps -> its step seen last
    for c in plan.collectives:
        src, dst = edge_ends(c.edge)
        if src == dst:
            inside[src].append(c)
            continue
        if purpose(c) != "reshard":  # into the step's outputs
            bucket = c.bucket
            if bucket is not None and src in position:  # issued after its last gradient
                point = src
                if c.step and c.overlap and not overlap:
                    point = c.step_after or ""  # the step before waited for there
                    if point not in position:
                        grads.append(c)  # at the backward's end
                        continue
                    wait_at[point].append(chained[bucket])
                after[point].append(c)
                chained[bucket] = c
                if not c.overlap and not overlap:
                    waited.add(id(c))
                elif c.wait_after is not None and not overlap:
                    wait_at[c.wait_after].append(c)
                continue
            grads.append(c)
            if overlap and src in position:
                after[src].append(c)
            continue
        if dst not in position and dst.startswith("recompute:"):
            dst = dst.removeprefix("recompute:")  # a plan whose timeline shows no copies
        into[dst].append(c)
        if overlap and src in position and position[src] < position.get(dst, len(points)):
            after[src].append(c)
        elif not overlap and c.issue_after in position:  # prefetched
            after[c.issue_after].append(c)

    compute: list[Span] = []
    comm: list[Span] = []
    ends: dict[int, float] = {}  # id(collective) -> its end
    comm_clock: dict[str, float] = defaultdict(float)  # per mesh axis (gloo: one)
    streams = plan.overlaps_collectives
    edge_clock: dict[str, float] = defaultdict(float)  # where an edge's last one ends

    def issue(cs: _Cs, at: float) -> None:
        for c in cs:
            if id(c) in ends:
                continue
            axis = c.axis if streams else ""
            edge = c.edge
            src, dst = edge_ends(edge)
            chained = src != dst  # a node's own exchanges run beside it (docstring)
            start = max(comm_clock[axis], at, edge_clock[edge] if chained else 0.0)
            span = _comm_span(c, start)
            comm.append(span)
            comm_clock[axis] = ends[id(c)] = span.end_s
            if chained:
                edge_clock[edge] = span.end_s

    if overlap:  # a reshard whose input no point makes is ready at the step's start
        issued_later = {id(c) for c in _flat(after)}
        issue([c for c in _flat(into) if id(c) not in issued_later], 0.0)
    clock = plan.cost.get("runtime_s", 0.0)  # the host's fixed time, before the first node
    host = plan.cost.get("host_start_s", 0.0)  # the host's own clock, where it has one
    hosted: list[Span] = []
    compute_end = 0.0
    if host > 0:
        hosted.append(Span(HOST, "runtime", 0.0, host, "", "the runtime's shards in"))
    for p in points:
        node = plan.nodes.get(p.removeprefix("recompute:"))
        dur = node.cost_s if node is not None else 0.0
        issued_at = clock
        if node is not None and node.host_s:
            host += node.host_s
            issued_at = max(clock, host) if dur > 0 else clock  # a kernel, once issued
        # (the lookups below, each skipped where empty: ~18,000 points per plan)
        start = issued_at
        waits = into.get(p)
        if waits:
            if not overlap:
                issue(waits, issued_at)
            start = max(start, *(ends[id(c)] for c in waits))
        if p in inside:
            issue(inside[p], start)
        if node is not None and (dur > 0 or node.op != "placeholder"):
            if spans:
                compute.append(Span(COMPUTE, p, start, dur, node.module, node.op))
            compute_end = start + dur  # (the stream's clock only grows)
        clock = start + dur
        issued = after.get(p)  # buckets, and reshards issued ahead (prefetched)
        if overlap:
            if issued:
                issue(issued, clock)
            continue
        if p in wait_at:
            clock = max([clock] + [ends[id(c)] for c in wait_at[p] if id(c) in ends])
        if issued:
            issue(issued, clock)
            clock = max([clock] + [ends[id(c)] for c in issued if id(c) in waited])
    # (what no point waited for or ran: none in a whole plan)
    issue(grads + _flat(into) + _flat(inside), clock)
    end = plan.cost.get("host_end_s", 0.0)
    if end > 0:
        hosted.append(Span(HOST, "runtime", host, end, "", "the runtime's gradients out"))
    return compute, comm, hosted, compute_end


def _flat(d: dict[str, _Cs]) -> _Cs:
    return [c for cs in d.values() for c in cs]


def step_length(spans: list[Span]) -> float:
    return max((s.end_s for s in spans), default=0.0)

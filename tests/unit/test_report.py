"""The HTML report and its simulated schedule (autopar/report.py), on committed plans."""

import dataclasses
import gzip
import html
import json
import re
from pathlib import Path

import pytest

from autopar.cli import main
from autopar.core.plan import Plan
from autopar.core.schedule import purpose, schedule_length
from autopar.report import (
    COMM,
    COMPUTE,
    HOST,
    MAX_MEMORY_POINTS,
    chrome_trace,
    render_html,
    schedule,
    step_length,
    write_report,
)
from autopar.show import layer_groups

pytestmark = pytest.mark.pinned_torch_only

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
# a 4-layer GPT on (4,) H100s with a budget: reshards, gradient buckets that overlap the
# backward, and checkpointed layers (a reshard into each recomputed copy); and a GPT on
# (2,2) on gloo, where nothing overlaps
CASES = ["gpt-4-h100-mem0.25-nofold", "gpt-2x2-cpu-mem0.5"]


def _golden(name: str) -> Plan:
    return Plan.from_json(gzip.open(GOLDEN / f"{name}.json.gz").read().decode())


def _ends(edge: str) -> tuple[str, str]:
    src, _, rest = edge.partition("->")
    dst, _, note = rest.partition(" ")
    return src, (f"recompute:{dst}" if note == "(recomputed)" else dst)


def _bucket(span, plan: Plan) -> bool:
    return any(c.edge == span.name and c.bucket is not None for c in plan.collectives)


def _overlapped(span, plan: Plan) -> bool:
    """A bucket, or a reshard issued ahead of its consumer (passes/prefetch)."""
    return any(
        c.edge == span.name and (c.bucket is not None or c.issue_after is not None)
        for c in plan.collectives
    )


def _axis(span) -> str:
    return span.what.partition("@")[2].partition(",")[0]


@pytest.mark.parametrize("name", CASES)
def test_emitted_schedule_waits_for_every_collective_but_the_overlapped_ones(name):
    """Every collective is waited for where it is issued, but the buckets and the reshards
    issued ahead of their consumers, where the device overlaps collectives."""
    plan = _golden(name)
    spans = schedule(plan)
    comm = [s for s in spans if s.stream == COMM]
    assert len(comm) == len(plan.collectives) > 0
    overlaps = plan.overlaps_collectives
    assert overlaps == ("h100" in name)
    hidden = [s for s in comm if overlaps and _overlapped(s, plan)]
    full = plan.cost["compute_s"] + sum(plan.cost["comm_by_kind_s"].values())
    waited = full - sum(s.dur_s for s in hidden)
    assert waited - 1e-12 <= step_length(spans) <= full + 1e-12
    assert plan.emitted_step_s() == pytest.approx(step_length(spans), rel=1e-12)
    assert plan.cost["total_s"] == pytest.approx(step_length(spans), rel=1e-12)
    if not overlaps:  # gloo: compute plus every collective, nothing beside anything
        assert step_length(spans) == pytest.approx(full, rel=1e-9)
    else:  # no longer than that (a collective queued behind a bucket on its axis's stream
        # can make the kernel that waits for it wait as long as without the overlap)
        assert hidden and step_length(spans) <= full + 1e-12
    # the step waits for every collective where it sits, but those it overlaps
    compute = [s for s in spans if s.stream == COMPUTE]
    for c in comm:
        if c in hidden:
            continue
        assert not any(s.start_s < c.end_s - 1e-15 and c.start_s < s.end_s - 1e-15
                       for s in compute if s.dur_s > 0), c  # fmt: skip
    # each gradient reduced once on an axis: in a bucket, or alone at the backward's end
    grads = [c for c in plan.collectives if "->output[" in c.edge and c.param is not None]
    named = [(c.axis, p) for c in grads for p in (c.params or [c.param])]
    assert len(named) == len(set(named))
    assert grads or name == "gpt-2x2-cpu-mem0.5"  # that plan keeps each gradient sharded
    last = max(s.end_s for s in compute)
    alone = [s for s in comm if "->output[" in s.name and not _bucket(s, plan)]
    assert all(s.start_s >= last - 1e-15 for s in alone)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("overlap", [False, True])
def test_schedule_keeps_every_dependency_and_one_thing_per_stream(name, overlap):
    plan = _golden(name)
    spans = schedule(plan, overlap=overlap)
    start = {s.name: s.start_s for s in spans if s.stream == COMPUTE}
    end = {s.name: s.end_s for s in spans if s.stream == COMPUTE}
    streams = plan.stats["overlaps_collectives"]  # one communication stream per axis
    lanes = {(s.stream, _axis(s) if s.stream == COMM and streams else "") for s in spans}
    for lane in lanes:
        own = sorted(
            (s for s in spans if (s.stream, _axis(s) if s.stream == COMM and streams else "")
             == lane), key=lambda s: s.start_s,
        )  # fmt: skip
        for a, b in zip(own, own[1:]):
            assert b.start_s >= a.end_s - 1e-15, (a, b)
    # the collectives of one edge take one another's output: one after the other, in
    # the plan's order, though on different axes (a node's own exchanges aside)
    chains: dict[str, list] = {}
    for s in spans:
        if s.stream == COMM and _ends(s.name)[0] != _ends(s.name)[1]:
            chains.setdefault(s.name, []).append(s)
    for edge, own in chains.items():
        assert [s.what.partition(",")[0] for s in own] == [
            f"{c.kind}@{c.axis}" for c in plan.collectives if c.edge == edge
        ] or overlap  # (the overlapped schedule issues a reshard's when its input ends)
        ordered = sorted(own, key=lambda s: s.start_s)
        for a, b in zip(ordered, ordered[1:]):
            assert b.start_s >= a.end_s - 1e-15, (a, b)
    seen_recomputed = 0
    for s in spans:
        if s.stream != COMM:
            continue
        src, dst = _ends(s.name)
        assert s.start_s >= end.get(src, 0.0) - 1e-15, s  # issued once its input exists
        if dst in start:
            assert start[dst] >= s.end_s - 1e-15, s  # its consumer waits for it
            seen_recomputed += dst.startswith("recompute:")
    if name.startswith("gpt-4"):  # the reshards into the checkpointed layers' copies
        assert plan.recompute
        assert seen_recomputed == sum("(recomputed)" in c.edge for c in plan.collectives)


NOTHING_EARLY = {"gpt-2x2-cpu-mem0.5"}
"""Golden plans each of whose collectives reads what is made right before its consumer
(an activation into the next op, or a weight's view run just before its product): issued
when ready, none starts earlier."""


@pytest.mark.parametrize("name", CASES)
def test_issuing_collectives_when_ready_overlaps_and_never_lengthens(name):
    plan = _golden(name)
    emitted, overlapped = step_length(schedule(plan)), step_length(schedule(plan, overlap=True))
    compute = sum(s.dur_s for s in schedule(plan) if s.stream == COMPUTE)
    assert compute <= overlapped <= emitted
    assert (overlapped < emitted) == (name not in NOTHING_EARLY)


def test_an_edges_collectives_on_two_axes_run_one_after_the_other():
    """A reshard over two axes (DTensor's all-reduce on one and then the other, or a
    hierarchical RS -> AR -> AG) is a chain: on CUDA, where each axis has its own stream,
    the second still waits for the first's output, and the consumer for the last."""
    plan = _golden("hf-gpt2-2x2-h100-mem0.5")
    assert plan.overlaps_collectives
    first = next(c for c in plan.collectives if purpose(c) == "reshard" and c.bucket is None)
    other = next(a for a in plan.mesh.axis_names if a != first.axis)
    second = dataclasses.replace(first, axis=other, kind="all_gather")
    listed = list(plan.collectives)
    listed.insert(listed.index(first) + 1, second)
    chained = dataclasses.replace(plan, collectives=tuple(listed))
    spans = schedule(chained)
    a, b = (next(s for s in spans if s.stream == COMM and s.name == first.edge
                 and _axis(s) == axis) for axis in (first.axis, other))  # fmt: skip
    assert b.start_s >= a.end_s - 1e-15 and a.dur_s > 0
    dst = _ends(first.edge)[1]
    consumer = next(s for s in spans if s.stream == COMPUTE and s.name == dst)
    assert consumer.start_s >= b.end_s - 1e-15
    assert step_length(spans) >= step_length(schedule(plan)) + b.dur_s - 1e-12


def test_a_plan_without_collectives_schedules_its_compute_alone():
    plan = dataclasses.replace(_golden("gpt-2x2-h100"), collectives=())
    spans = schedule(plan, overlap=True)
    assert all(s.stream == COMPUTE for s in spans)
    assert step_length(spans) == pytest.approx(plan.cost["compute_s"], rel=1e-9)


def test_without_a_memory_timeline_the_compute_runs_in_the_plans_order():
    """The solver's overlap rounds simulate a plan the memory stage has not measured: the
    compute stream follows ``plan.order`` (passes/order, passes/prefetch), not graph order,
    with the copies of its checkpointed layers where the memory timeline has them."""
    plan = _golden("gpt-4-h100-mem0.25-nofold")
    assert plan.recompute
    timeline = [n for n in plan.memory["step"]["timeline"]["nodes"] if n != "output"]
    ran = [s.name for s in schedule(plan) if s.stream == COMPUTE]
    memory = {k: v for k, v in plan.memory.items() if k != "step"}
    # the points the memory timeline has, without it
    assert [s.name for s in schedule(dataclasses.replace(plan, memory=memory))
            if s.stream == COMPUTE] == ran == [n for n in timeline if n in ran]  # fmt: skip
    copies = [n for n in ran if n.startswith("recompute:")]
    assert copies and len(ran) > 10
    order = list(reversed([n for n in timeline if n in plan.nodes]))
    bare = dataclasses.replace(plan, memory=memory, order=tuple(order), collectives=())
    ran = [s.name for s in schedule(bare) if s.stream == COMPUTE]
    assert [n for n in ran if n in plan.nodes] == [n for n in order if n in ran]
    assert sorted(n for n in ran if n.startswith("recompute:")) == sorted(copies)
    assert ran != [n for n in plan.nodes if n in ran]


def test_report_is_one_self_contained_page_with_every_section(tmp_path):
    plan = _golden("gpt-4-h100-mem0.25-nofold")
    page = render_html(plan)
    for section in ("summary", "placements", "cost", "timeline", "memory", "solver", "warnings"):
        assert f'<section id="{section}">' in page
    # nothing is fetched: no scripts, no links, no external sources
    assert not re.search(r"https?://(?!www\.w3\.org)", page)
    assert "<script" not in page and "<link" not in page and " src=" not in page
    for svg in ("cost-chart", "timeline-emitted", "timeline-overlapped", "memory-chart"):
        assert f'id="{svg}"' in page
    assert 'id="budget-line"' in page and 'id="peak-line"' in page
    # the figures are the plan's
    assert f"{plan.cost['total_s'] * 1e3:,.4f} ms" in page
    for pattern, count, _, _ in layer_groups(plan):
        assert f'<td>{html.escape(pattern)}</td><td class="n">{count}</td>' in page
    assert "<td>blocks.{0..1}.attn.q.bias</td>" in page  # folded layers shown once
    assert "activation checkpointing" in page


def test_report_escapes_what_it_shows():
    plan = _golden("mlp-2x2-h100-mem0.5")
    plan = dataclasses.replace(plan, warnings=("<script>alert('x')</script> & more",))
    page = render_html(plan)
    assert "<script>" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; more" in page


def test_memory_chart_draws_at_most_its_limit_and_keeps_the_peak():
    plan = _golden("gpt-4-h100-mem0.25-nofold")
    step = plan.memory["step"]
    tl = step["timeline"]
    reps = 2 * MAX_MEMORY_POINTS // len(tl["nodes"]) + 2  # a timeline past the limit
    long_tl = {k: [x for _ in range(reps) for x in v] for k, v in tl.items()}
    n = len(long_tl["nodes"])
    assert n > MAX_MEMORY_POINTS
    cats = [c for c in long_tl if c != "nodes"]
    totals = [sum(long_tl[c][i] for c in cats) for i in range(n)]
    bumped = n // 3  # the one highest point, inside a bucket
    long_tl["activations"][bumped] += 10 * 2**20
    peak = totals[bumped] + 10 * 2**20
    memory = {**plan.memory, "step": {**step, "timeline": long_tl, "peak_bytes": peak}}
    page = render_html(dataclasses.replace(plan, memory=memory))
    chart = page[page.index('id="memory-chart"') :]
    chart = chart[: chart.index("</svg>")]
    polygons = re.findall(r'<polygon class="area" points="([^"]*)"', chart)
    assert polygons
    for pts in polygons:
        assert len(pts.split()) <= 2 * MAX_MEMORY_POINTS  # the top edge and the bottom edge
    # the chart's highest point is the peak: the top of the last stacked area reaches it
    top_edge = polygons[-1].split()[: len(polygons[-1].split()) // 2]
    ys = [float(p.split(",")[1]) for p in top_edge]
    y_peak = re.search(r'id="peak-line" x1="([\d.]+)"', chart)
    assert y_peak is not None
    xs = [float(p.split(",")[0]) for p in top_edge]
    assert abs(xs[ys.index(min(ys))] - float(y_peak.group(1))) < 1e-6


def test_chrome_trace_holds_both_schedules(tmp_path):
    plan = _golden("gpt-2x2-cpu-mem0.5")
    trace = chrome_trace(plan)
    json.dumps(trace)  # serializable
    events = trace["traceEvents"]
    for pid, overlap in ((0, False), (1, True)):
        xs = [e for e in events if e["ph"] == "X" and e["pid"] == pid]
        assert len(xs) == len(schedule(plan, overlap=overlap))
        assert all(e["dur"] >= 0 and e["ts"] >= 0 and e["tid"] in (0, 1) for e in xs)
        assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(
            step_length(schedule(plan, overlap=overlap)) * 1e6
        )
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names[(0, 0)] == "compute" and names[(1, 1)] == "communication"


def test_cli_report_writes_the_page_and_the_trace(tmp_path, capsys):
    src = tmp_path / "plan.json"
    src.write_text(gzip.open(GOLDEN / "gpt-2x2-cpu-mem0.5.json.gz").read().decode())
    out, trace = tmp_path / "r.html", tmp_path / "t.json"
    assert main(["report", str(src), "-o", str(out), "--trace", str(trace)]) == 0
    assert f"report written to {out}, trace to {trace}" in capsys.readouterr().out
    assert out.read_text().startswith("<!DOCTYPE html>")
    assert json.loads(trace.read_text())["traceEvents"]
    write_report(_golden("mlp-2x2-h100-mem0.5"), tmp_path / "only.html")
    assert (tmp_path / "only.html").exists() and not (tmp_path / "only.json").exists()


def test_collectives_an_op_runs_inside_it_are_drawn_under_it_and_not_waited_for():
    # a ring attention's shifts and balancing exchanges (edges "n->n") are in the node's
    # cost_s already (passes/solve): the emitted step is compute plus the other collectives
    import autopar
    from autopar.verify import build_example

    model, inputs, loss_fn, targets = build_example("hf-llama", batch=8)
    meta = lambda ts: tuple(t.to("meta") for t in ts)  # noqa: E731
    plan = autopar.plan(
        model.to("meta"),
        autopar.Mesh((2,), ("cp",), device="h100"),
        meta(inputs),
        loss_fn=loss_fn,
        example_targets=meta(targets),
        constraints={"attention:*": "S(2)", "context": "ring"},
    )
    spans = schedule(plan)
    compute = {s.name: s for s in spans if s.stream == COMPUTE}
    own = lambda edge: len(set(_ends(edge))) == 1  # noqa: E731
    inside = [s for s in spans if s.stream == COMM and own(s.name)]
    assert len(inside) == len([c for c in plan.collectives if own(c.edge)]) > 0
    for s in inside:
        node = compute[_ends(s.name)[0]]
        assert node.start_s <= s.start_s < node.end_s, s
    outside = sum(c.time_s for c in plan.collectives if not own(c.edge))
    total = sum(s.dur_s for s in compute.values()) + outside
    assert step_length(spans) == pytest.approx(total, rel=1e-9)


def _with_host(plan: Plan, per_node: float, start: float, end: float) -> Plan:
    """``plan`` with the host on its own clock: ``per_node`` to issue each op node."""
    nodes = {
        n: dataclasses.replace(c, host_s=per_node) if c.op != "placeholder" else c
        for n, c in plan.nodes.items()
    }
    cost = {**plan.cost, "host_start_s": start, "host_end_s": end}
    return dataclasses.replace(plan, nodes=nodes, cost=cost)


def test_a_host_behind_the_device_sets_the_step_and_one_ahead_of_it_does_not():
    plan = _golden("gpt-4-h100-mem0.25-nofold")
    device = step_length(schedule(plan))
    ops = [c for c in plan.nodes.values() if c.op != "placeholder"]
    # a host far ahead: the device's step, and the host's two spans
    ahead = schedule(_with_host(plan, 1e-12, 1e-9, 1e-9))
    assert step_length(ahead) == pytest.approx(device, rel=1e-6)
    assert [s.what for s in ahead if s.stream == HOST] == [
        "the runtime's shards in",
        "the runtime's gradients out",
    ]
    # a host far behind: its own time, each kernel run once issued
    per_node, start, end = 1e-3, 2e-3, 3e-3
    behind = _with_host(plan, per_node, start, end)
    spans = schedule(behind)
    # every op node issued, and again each copy a checkpointed layer recomputes
    issues = [s for s in spans if s.stream == COMPUTE and s.what != "placeholder"]
    assert len(issues) > len(ops)
    host = start + per_node * len(issues)
    assert step_length(spans) == pytest.approx(host + end, rel=1e-9)
    issued = start
    for s in (s for s in spans if s.stream == COMPUTE):
        node = behind.nodes[s.name.removeprefix("recompute:")]
        issued += node.host_s
        if s.dur_s > 0 and node.host_s:  # (a batch input is read, not issued)
            assert s.start_s >= issued - 1e-12
    # the trace and the page draw the host's lane
    threads = {
        e["args"]["name"]: e["tid"]
        for e in chrome_trace(behind)["traceEvents"]
        if e["name"] == "thread_name"
    }
    assert threads == {COMPUTE: 0, COMM: 1, HOST: 2}
    assert ">host</text>" in render_html(behind)
    # and the plan's JSON keeps the host's times
    again = Plan.from_json(behind.to_json())
    assert again.emitted_step_s() == pytest.approx(step_length(spans), rel=1e-12)


@pytest.mark.parametrize(
    "name", sorted(p.name.removesuffix(".json.gz") for p in GOLDEN.glob("*.json.gz"))
)
def test_the_step_length_without_the_compute_spans_is_the_schedules(name):
    """``schedule_length`` (the overlap rounds' judge: no span per point) is the length of
    ``schedule``'s spans, to the bit: each golden plan as it is (its memory timeline's
    points) and without its timeline (its order, with its checkpointed layers' copies),
    with the host on its own clock behind and ahead of the device, both issue rules."""
    plan = _golden(name)
    untimed = dataclasses.replace(plan, memory={})
    for p in (plan, untimed, _with_host(plan, 1e-3, 2e-3, 3e-3), _with_host(untimed, 1e-12, 0, 0)):
        for overlap in (False, True):
            assert schedule_length(p, overlap=overlap) == step_length(schedule(p, overlap=overlap))
    assert untimed.emitted_step_s() == step_length(schedule(untimed))

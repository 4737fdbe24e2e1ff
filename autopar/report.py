"""``autopar report plan.json -o report.html``: a saved plan as one self-contained HTML page.

Everything is read from the plan's JSON (nothing is re-planned) and drawn as inline SVG with
inline CSS: the page loads nothing from the network and has no script, so it reads offline
and in any browser. It holds the summary, the placement table, the cost breakdown, the
per-rank schedule timeline, the memory timeline, the solver's statistics and stage timings,
and every warning.

The schedule of one rank (``autopar.core.schedule``) is drawn twice: as codegen emits the
step, and with every collective issued as soon as its input is made.

``chrome_trace`` writes both schedules as Chrome trace events (``--trace``: Perfetto,
chrome://tracing), one process each with a compute and a communication thread.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

from .core.plan import Plan
from .core.schedule import COMM, COMPUTE, HOST, Span, schedule, step_length
from .show import collective_rows, tables

__all__ = ["Span", "chrome_trace", "render_html", "schedule", "step_length", "write_report"]

_MIB = 2**20
MAX_MEMORY_POINTS = 1500
"""The memory timeline is drawn with at most this many points, each bucket's highest."""
_WIDTH = 1100  # px of every chart's plotting area
_CATEGORY_COLORS = {
    "parameters": "#4e79a7",
    "gradients": "#f28e2b",
    "optimizer_state": "#76b7b2",
    "activations": "#e15759",
    "temporaries": "#edc948",
    "collective_buffers": "#b07aa1",
    "inputs": "#9c755f",
}
_KIND_COLORS = {
    "all_reduce": "#e15759",
    "all_gather": "#4e79a7",
    "reduce_scatter": "#59a14f",
    "all_to_all": "#b07aa1",
}


def chrome_trace(plan: Plan) -> dict:
    """Both schedules as Chrome trace events (times in microseconds): process 0 the step as
    emitted, process 1 with collectives issued when ready; thread 0 compute, 1 communication
    and, where the host runs on its own clock (core/schedule), 2 the runtime's host time."""
    events: list[dict] = []
    for pid, (label, overlap) in enumerate(
        [("the step as emitted", False), ("collectives issued when ready", True)]
    ):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}})
        spans = schedule(plan, overlap=overlap)
        streams = _streams(spans)
        for tid, stream in enumerate(streams):
            events.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": stream}}
            )
        for s in spans:
            events.append(
                {
                    "ph": "X",
                    "name": s.name,
                    "cat": s.stream,
                    "pid": pid,
                    "tid": streams.index(s.stream),
                    "ts": s.start_s * 1e6,
                    "dur": s.dur_s * 1e6,
                    "args": {"module": s.module, "what": s.what},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


# -- drawing ---------------------------------------------------------------------------------


def _e(x) -> str:
    return html.escape(str(x), quote=True)


def _ms(s: float) -> str:
    return f"{s * 1e3:,.4f}"


def _table(head: list[str], rows: list[list], *, numeric_from: int = 99) -> str:
    out = ["<table><thead><tr>"]
    out += [f"<th>{_e(h)}</th>" for h in head]
    out.append("</tr></thead><tbody>")
    for row in rows:
        out.append("<tr>")
        for i, v in enumerate(row):
            cls = ' class="n"' if i >= numeric_from else ""
            out.append(f"<td{cls}>{_e(v)}</td>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _cost_svg(plan: Plan) -> str:
    """Horizontal bars: compute, each collective kind (before the overlap credit), the
    credit, and the estimate."""
    c = plan.cost
    kinds = dict(c.get("comm_by_kind_s", {}))
    credit = sum(kinds.values()) - c.get("comm_s", 0.0)
    bars = [("compute", c.get("compute_s", 0.0), "#59a14f")]
    bars += [(k.replace("_", " "), s, _KIND_COLORS.get(k, "#bab0ac")) for k, s in kinds.items()]
    if credit > 1e-15:
        bars.append(("overlap credit", -credit, "#bab0ac"))
    bars.append(("estimated step", c.get("total_s", 0.0), "#333333"))
    top = max([abs(s) for _, s, _ in bars] + [1e-12])
    label_w, row_h = 170, 26
    height = row_h * len(bars) + 10
    out = [
        f'<svg id="cost-chart" width="{label_w + _WIDTH + 120}" height="{height}" '
        f'role="img" aria-label="estimated step time by part">'
    ]
    for i, (name, s, color) in enumerate(bars):
        y = 5 + i * row_h
        w = max(abs(s) / top * _WIDTH, 1.0)
        faded = ' fill-opacity="0.5"' if s < 0 else ""
        out.append(
            f'<text x="{label_w - 8}" y="{y + 16}" text-anchor="end">{_e(name)}</text>'
            f'<rect x="{label_w}" y="{y + 3}" width="{w:.1f}" height="{row_h - 8}" '
            f'fill="{color}"{faded}>'
            f"<title>{_e(name)}: {_ms(s)} ms</title></rect>"
            f'<text x="{label_w + w + 6:.1f}" y="{y + 16}">{_ms(s)} ms</text>'
        )
    out.append("</svg>")
    return "".join(out)


def _bars(spans: list[Span], scale: float) -> list[tuple[float, float, str, str]]:
    """``(start, end, title, color key)`` per bar: touching spans of one module are one bar,
    and a bar under a pixel joins the one before it (the title counts what it holds)."""
    merged: list[list] = []  # [start, end, module, count, what kinds]
    for s in spans:
        last = merged[-1] if merged else None
        touching = last is not None and s.start_s - last[1] <= 1e-12
        tiny = last is not None and (last[1] - last[0]) * scale < 1.0
        if last is not None and touching and (s.module == last[2] or tiny):
            last[1] = s.end_s
            last[3] += 1
            last[4].add(s.what.split(",")[0])
            if s.module != last[2]:
                last[2] = "several modules"
        else:
            merged.append([s.start_s, s.end_s, s.module, 1, {s.what.split(",")[0]}])
    out = []
    for start, end, module, count, whats in merged:
        kinds = ", ".join(sorted(whats)[:4]) + (", ..." if len(whats) > 4 else "")
        title = (
            f"{module or '(top level)'}: {count} {'op' if count == 1 else 'ops'} ({kinds}), "
            f"{_ms(end - start)} ms from {_ms(start)} ms"
        )
        key = next(iter(whats)).split("@")[0] if len(whats) == 1 else "mixed"
        out.append((start, end, title, key))
    return out


def _streams(spans: list[Span]) -> tuple[str, ...]:
    """The lanes: compute and communication, and the host's where it has spans."""
    return (COMPUTE, COMM, HOST) if any(s.stream == HOST for s in spans) else (COMPUTE, COMM)


def _timeline_svg(plan: Plan, spans: list[Span], length: float, dom_id: str) -> str:
    """Two lanes, compute over communication (and the host's, where it has its own clock),
    on one time axis of ``length`` seconds."""
    label_w, lane_h, gap = 120, 34, 10
    scale = _WIDTH / max(length, 1e-12)
    lanes = _streams(spans)
    height = len(lanes) * lane_h + (len(lanes) - 1) * gap + 40
    out = [
        f'<svg id="{dom_id}" class="timeline" width="{label_w + _WIDTH + 60}" '
        f'height="{height}" role="img" aria-label="schedule of one rank\'s step">'
    ]
    for lane, stream in enumerate(lanes):
        y = 5 + lane * (lane_h + gap)
        out.append(
            f'<text x="{label_w - 8}" y="{y + lane_h / 2 + 5}" text-anchor="end">{stream}</text>'
            f'<rect x="{label_w}" y="{y}" width="{_WIDTH}" height="{lane_h}" fill="#f4f4f4"/>'
        )
        lane_spans = [s for s in spans if s.stream == stream]
        for start, end, title, key in _bars(lane_spans, scale):
            color = "#59a14f" if stream == COMPUTE else _KIND_COLORS.get(key, "#bab0ac")
            w = max((end - start) * scale, 0.5)
            out.append(
                f'<rect class="span" x="{label_w + start * scale:.2f}" y="{y + 2}" '
                f'width="{w:.2f}" height="{lane_h - 4}" fill="{color}">'
                f"<title>{_e(title)}</title></rect>"
            )
    axis_y = 5 + len(lanes) * lane_h + (len(lanes) - 1) * gap + 4
    out.append(
        f'<line x1="{label_w}" y1="{axis_y}" x2="{label_w + _WIDTH}" y2="{axis_y}" stroke="#666"/>'
    )
    for k in range(6):
        x = label_w + k * _WIDTH / 5
        out.append(
            f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 5}" stroke="#666"/>'
            f'<text x="{x:.1f}" y="{axis_y + 20}" text-anchor="middle">'
            f"{_ms(length * k / 5)} ms</text>"
        )
    out.append("</svg>")
    return "".join(out)


def _downsample(totals: list[int], limit: int) -> list[int]:
    """Indices of at most ``limit`` points: each bucket's highest (the peak always kept)."""
    n = len(totals)
    if n <= limit:
        return list(range(n))
    size = math.ceil(n / limit)
    return [max(range(b, min(b + size, n)), key=lambda i: totals[i]) for b in range(0, n, size)]


def _memory_svg(plan: Plan) -> str:
    step = plan.memory.get("step") or {}
    timeline = step.get("timeline") or {}
    nodes = timeline.get("nodes") or []
    cats = [c for c in timeline if c != "nodes"]
    if not nodes or not cats:
        return "<p>This plan holds no step-memory timeline.</p>"
    totals = [sum(timeline[c][i] for c in cats) for i in range(len(nodes))]
    keep = _downsample(totals, MAX_MEMORY_POINTS)
    budget = plan.memory_budget
    peak = step.get("peak_bytes", max(totals))
    top = max([peak, max(totals)] + ([budget] if budget else [])) * 1.08 or 1.0
    left, height, plot_h = 90, 330, 280
    xs = [left + k * _WIDTH / max(len(keep) - 1, 1) for k in range(len(keep))]

    def y(nbytes: float) -> float:
        return 10 + plot_h * (1 - nbytes / top)

    out = [
        f'<svg id="memory-chart" width="{left + _WIDTH + 190}" height="{height}" role="img" '
        f'aria-label="memory per rank over the step, by category">'
    ]
    below = [0.0] * len(keep)
    for c in cats:
        above = [below[k] + timeline[c][i] for k, i in enumerate(keep)]
        if not any(timeline[c][i] for i in keep):
            continue
        pts = [f"{x:.1f},{y(v):.1f}" for x, v in zip(xs, above)]
        pts += [f"{x:.1f},{y(v):.1f}" for x, v in zip(reversed(xs), reversed(below))]
        color = _CATEGORY_COLORS.get(c, "#bab0ac")
        out.append(
            f'<polygon class="area" points="{" ".join(pts)}" fill="{color}" fill-opacity="0.85">'
            f"<title>{_e(c.replace('_', ' '))}</title></polygon>"
        )
        below = above
    # the peak, and the budget it was bounded by
    peak_k = max(range(len(keep)), key=lambda k: totals[keep[k]])
    px = xs[peak_k]
    out.append(
        f'<line id="peak-line" x1="{px:.1f}" y1="10" x2="{px:.1f}" y2="{10 + plot_h}" '
        f'stroke="#000" stroke-dasharray="3,3"><title>peak {peak / _MIB:,.2f} MiB after '
        f"{_e(step.get('peak_node', nodes[keep[peak_k]]))}</title></line>"
        f'<text x="{min(px + 4, left + _WIDTH - 150):.1f}" y="{y(peak) - 4:.1f}">'
        f"peak {peak / _MIB:,.2f} MiB</text>"
    )
    if budget:
        out.append(
            f'<line id="budget-line" x1="{left}" y1="{y(budget):.1f}" x2="{left + _WIDTH}" '
            f'y2="{y(budget):.1f}" stroke="#c00" stroke-width="2" stroke-dasharray="8,4">'
            f"<title>budget {budget / _MIB:,.2f} MiB</title></line>"
            f'<text x="{left + 4}" y="{y(budget) - 4:.1f}" fill="#c00">'
            f"budget {budget / _MIB:,.2f} MiB</text>"
        )
    for k in range(5):
        v = top * k / 4
        out.append(
            f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v / _MIB:,.1f}</text>'
            f'<line x1="{left}" y1="{y(v):.1f}" x2="{left + _WIDTH}" y2="{y(v):.1f}" '
            f'stroke="#ddd"/>'
        )
    out.append(
        f'<text x="{left - 6}" y="{10 + plot_h + 24}" text-anchor="end">MiB</text>'
        f'<text x="{left + _WIDTH / 2}" y="{10 + plot_h + 24}" text-anchor="middle">'
        f"the step's points in order: forward, then backward ({len(nodes):,} points"
        f"{'' if len(keep) == len(nodes) else f', each bucket of {math.ceil(len(nodes) / len(keep))} drawn at its highest'})"
        "</text>"
    )
    for i, c in enumerate(c for c in cats if any(timeline[c])):
        ly = 14 + i * 20
        out.append(
            f'<rect x="{left + _WIDTH + 16}" y="{ly}" width="12" height="12" '
            f'fill="{_CATEGORY_COLORS.get(c, "#bab0ac")}"/>'
            f'<text x="{left + _WIDTH + 34}" y="{ly + 11}">{_e(c.replace("_", " "))}</text>'
        )
    out.append("</svg>")
    return "".join(out)


_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 8px 0; }
th, td { padding: 3px 10px; border-bottom: 1px solid #e4e4e4; text-align: left; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
svg text { font: 12px system-ui, sans-serif; fill: #222; }
.figures td:first-child { color: #555; }
pre { background: #f6f6f6; padding: 10px; overflow-x: auto; }
.warn { color: #a40; }
"""


def _figures(
    plan: Plan, t: dict, emitted_s: float, overlapped_s: float, budget: float | None
) -> list[list[str]]:
    """The summary's rows: the mesh, the step's estimated and simulated times, the memory
    per rank, checkpointing, collectives and versions."""
    cost = plan.cost
    memory = t["memory"]
    figures = [
        ["mesh", f"{plan.mesh}"],
        ["graph fingerprint", plan.fingerprint],
        ["precision", t["precision"]],
        ["estimated step time (cost model)", f"{_ms(cost.get('total_s', 0.0))} ms"],
        ["  compute", f"{_ms(cost.get('compute_s', 0.0))} ms"],
        ["  communication", f"{_ms(cost.get('comm_s', 0.0))} ms"],
        ["simulated step, as emitted", f"{_ms(emitted_s)} ms"],
        ["simulated step, collectives issued when ready", f"{_ms(overlapped_s)} ms"],
        [
            "parameter memory per rank",
            f"{plan.memory.get('param_bytes_per_rank', 0) / _MIB:,.2f} MiB of "
            f"{plan.memory.get('param_bytes_total', 0) / _MIB:,.2f} MiB",
        ],
    ]
    if memory:
        of = f" of a {budget / _MIB:,.2f} MiB budget" if budget else ""
        figures.append(
            ["step memory peak per rank", f"{memory['peak_bytes'] / _MIB:,.2f} MiB{of}, after "
             f"{memory['peak_node']} ({memory['optimizer']} state)"]
        )  # fmt: skip
    if plan.recompute:
        figures.append(["activation checkpointing", t["checkpointed"]])
    figures.append(["collectives per step", f"{len(plan.collectives):,}"])
    figures.append(
        ["made by", f"autopar {plan.versions.get('autopar', '?')}, "
         f"torch {plan.versions.get('torch', '?')}"]
    )  # fmt: skip
    return figures


def _peak_rows(memory: dict, budget: float | None) -> list[list[str]]:
    """Each category's bytes at the step's memory peak, its share of the peak and (given a
    budget) of the budget; none without a memory timeline."""
    at_peak = []
    if memory:
        for cat, nbytes in memory["at_peak"].items():
            row = [cat.replace("_", " "), f"{nbytes / _MIB:,.2f}",
                   f"{nbytes / memory['peak_bytes']:.1%}"]  # fmt: skip
            at_peak.append(row + ([f"{nbytes / budget:.1%}"] if budget else []))
    return at_peak


def _solver_rows(stats: dict) -> tuple[list[list], list[list]]:
    """The solver's statistics (its fold groups one row each) and each stage's seconds."""
    solver_rows = [
        [k.replace("_", " "), v]
        for k, v in stats.items()
        if k not in ("param_shapes", "fold_groups") and not k.endswith("_s")
        and not isinstance(v, (dict, list))
    ]  # fmt: skip
    for g in stats.get("fold_groups", []):
        solver_rows.append(["fold group", f"{g['instances']} x {g['nodes']} nodes: {g['regions']}"])
    timing_rows = [[k[:-2], f"{v:,.3f}"] for k, v in stats.items() if k.endswith("_s")]
    return solver_rows, timing_rows


def _warnings(plan: Plan) -> list[str]:
    """The plan's warnings, and one for the nodes replicated for lack of a sharding rule."""
    warnings = list(plan.warnings)
    if plan.fallback_nodes:
        warnings.append(
            f"{len(plan.fallback_nodes)} nodes replicated for lack of a sharding rule: "
            + ", ".join(plan.fallback_nodes[:20])
            + (", ..." if len(plan.fallback_nodes) > 20 else "")
        )
    return warnings


def render_html(plan: Plan) -> str:
    """The report page (module docstring) for ``plan``."""
    t = tables(plan)
    emitted = schedule(plan)
    overlapped = schedule(plan, overlap=True)
    emitted_s, overlapped_s = step_length(emitted), step_length(overlapped)
    axes = list(plan.mesh.axis_names)
    memory = t["memory"]
    budget = plan.memory_budget
    figures = _figures(plan, t, emitted_s, overlapped_s, budget)
    params = [
        [r["pattern"], r["count"], "x".join(map(str, r["shape"])) or "-", *r["placements"]]
        for r in t["parameters"]
    ]
    inputs = [
        [f"input {i}", plan.nodes[n].role, *plan.nodes[n].placement()]
        for i, n in enumerate(plan.inputs)
    ]
    colls = [
        [c["purpose"], c["kind"], c["axis"], c["count"], f"{c['bytes'] / _MIB:,.3f}",
         _ms(c["time_s"])]
        for c in collective_rows(plan)
    ]  # fmt: skip
    at_peak = _peak_rows(memory, budget)
    solver_rows, timing_rows = _solver_rows(plan.stats)
    warnings = _warnings(plan)

    length = max(emitted_s, overlapped_s)
    body = [
        f"<h1>autopar plan for {_e(plan.mesh)}</h1>",
        '<section id="summary"><h2>Summary</h2>',
        '<table class="figures"><tbody>',
        *[f"<tr><td>{_e(a)}</td><td>{_e(b)}</td></tr>" for a, b in figures],
        "</tbody></table></section>",
        '<section id="placements"><h2>Placements</h2>',
        "<p>Parameters whose names differ only in their layer indices and take the same "
        "placements are one row.</p>",
        _table(["parameter", "count", "shape", *axes], params, numeric_from=1),
        _table(["input", "role", *axes], inputs),
        "</section>",
        '<section id="cost"><h2>Cost breakdown</h2>',
        "<p>The cost model's estimate of one step: compute, each collective kind at its full "
        "time, and the share of the gradient reductions it counts as hidden behind the "
        "backward.</p>",
        _cost_svg(plan),
        _table(["purpose", "kind", "axis", "count", "MiB", "ms"], colls, numeric_from=3)
        if colls
        else "<p>No collectives: every rank runs the whole step.</p>",
        "</section>",
        '<section id="timeline"><h2>Schedule of one rank</h2>',
        "<p>Compute and communication streams, simulated from the plan's node costs and "
        "collectives (hover a bar for what it holds). Above: the step as emitted, each "
        "reshard issued when its consumer is reached (or, prefetched, ahead of it), each "
        "gradient bucket after its last "
        "gradient and the other gradient reductions after the "
        f"backward ({_ms(emitted_s)} ms). Below: each collective issued as soon as its input "
        f"is made ({_ms(overlapped_s)} ms); what the lanes share there is overlap. Both are "
        "drawn on one time axis.</p>",
        _timeline_svg(plan, emitted, length, "timeline-emitted"),
        _timeline_svg(plan, overlapped, length, "timeline-overlapped"),
        "</section>",
        '<section id="memory"><h2>Memory per rank</h2>',
        _memory_svg(plan),
        _table(
            ["at the peak", "MiB", "of the peak", *(["of the budget"] if budget else [])],
            at_peak,
            numeric_from=1,
        )
        if at_peak
        else "",
        "</section>",
        '<section id="solver"><h2>Solver</h2>',
        _table(["statistic", "value"], solver_rows),
        _table(["stage", "seconds"], timing_rows, numeric_from=1)
        if timing_rows
        else "<p>This plan was saved without its timings.</p>",
        "</section>",
        '<section id="warnings"><h2>Warnings</h2>',
        "<ul>" + "".join(f'<li class="warn">{_e(w)}</li>' for w in warnings) + "</ul>"
        if warnings
        else "<p>None.</p>",
        "</section>",
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>autopar plan {_e(plan.fingerprint)} for {_e(plan.mesh)}</title>"
        f"<style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def write_report(plan: Plan, path: str | Path, *, trace: str | Path | None = None) -> None:
    """Write ``render_html(plan)`` to ``path`` and, given ``trace``, ``chrome_trace(plan)``
    there as JSON."""
    Path(path).write_text(render_html(plan), encoding="utf-8")
    if trace is not None:
        Path(trace).write_text(json.dumps(chrome_trace(plan)), encoding="utf-8")

"""``autopar diff a.json b.json``: what two saved plans chose differently, and what it costs.

Read from the two plans' JSON alone (nothing is re-planned):
    - parameters whose placements differ, grouped by layer pattern as ``autopar show`` does
      (``blocks.{0..31}.attn.q.weight``: ``S(0),R`` -> ``R,S(0)``), and parameters only one
      plan has;
    - when both plans are of the same graph (same fingerprint), the other nodes whose
      strategy differs (output or input placements), counted per module pattern;
    - the layers each plan checkpoints;
    - the estimated step time, part by part (compute, communication, each collective kind),
      and the step memory per rank at the peak, category by category: ``a``, ``b`` and
      ``b - a``;
    - the collectives per step by purpose, kind and axis: count and bytes in each plan.
"""

from __future__ import annotations

from collections import defaultdict

from rich import box
from rich.console import Console
from rich.table import Table

from .core.plan import LAYER_INDEX, Plan, name_pattern
from .show import collective_rows

__all__ = ["diff_plans", "render_diff"]


def _grouped(items: list[tuple[str, tuple]]) -> list[dict]:
    """``(name, key)`` pairs grouped by (name with layer indices masked, key)."""
    groups: dict[tuple, list[str]] = defaultdict(list)
    for name, key in items:
        groups[(LAYER_INDEX.sub("#", name), key)].append(name)
    return [{"names": name_pattern(members), "count": len(members), "key": key}
            for (_, key), members in groups.items()]  # fmt: skip


def _strategy(plan: Plan, node: str) -> tuple:
    c = plan.nodes[node]
    return (c.out, c.ins)


def _text(ps) -> str:
    return "-" if ps is None else ",".join(ps)


def diff_plans(a: Plan, b: Plan) -> dict:
    """The differences between plans ``a`` and ``b`` (module docstring), as plain data."""
    params = []
    for name, node in a.params.items():
        if name in b.params:
            pa, pb = a.nodes[node].placement(), b.nodes[b.params[name]].placement()
            if pa != pb:
                params.append((name, (pa, pb)))
    param_rows = [
        {"parameters": g["names"], "count": g["count"], "a": list(g["key"][0]),
         "b": list(g["key"][1])}
        for g in _grouped(params)
    ]  # fmt: skip
    same_graph = a.fingerprint == b.fingerprint
    node_rows = []
    if same_graph:
        changed = defaultdict(list)
        for name, choice in a.nodes.items():
            if choice.op == "placeholder" or name not in b.nodes:
                continue
            if _strategy(a, name) != _strategy(b, name):
                changed[LAYER_INDEX.sub("#", choice.module) or "(top level)"].append(name)
        for names in changed.values():
            first = names[0]
            modules = sorted({a.nodes[n].module for n in names})
            node_rows.append(
                {
                    "module": name_pattern(modules) if modules != [""] else "(top level)",
                    "count": len(names),
                    "example": first,
                    "op": a.nodes[first].op,
                    "a": _text(a.nodes[first].out[0] if a.nodes[first].out else None),
                    "b": _text(b.nodes[first].out[0] if b.nodes[first].out else None),
                }
            )

    def times(p: Plan) -> dict[str, float]:
        out = {"compute": p.cost.get("compute_s", 0.0), "communication": p.cost.get("comm_s", 0.0)}
        for kind, t in p.cost.get("comm_by_kind_s", {}).items():
            out[f"{kind} (not overlapped)"] = t
        if p.stats.get("recompute_s"):
            out["recompute (in compute)"] = p.stats["recompute_s"]
        out["total"] = p.cost.get("total_s", 0.0)
        return out

    def memory(p: Plan) -> dict[str, int]:
        step = p.memory.get("step") or {}
        out = dict(step.get("at_peak", {}))
        if step:
            out["peak"] = step["peak_bytes"]
        if p.memory_budget:
            out["budget"] = int(p.memory_budget)
        out["parameters (stored)"] = p.memory.get("param_bytes_per_rank", 0)
        return out

    def side_by_side(fa: dict, fb: dict) -> list[dict]:
        keys = list(fa) + [k for k in fb if k not in fa]
        keys.sort(key=lambda k: k in ("total", "peak", "budget", "parameters (stored)"))
        return [{"part": k, "a": fa.get(k, 0), "b": fb.get(k, 0),
                 "delta": fb.get(k, 0) - fa.get(k, 0)} for k in keys]  # fmt: skip

    ca = {(r["purpose"], r["kind"], r["axis"]): r for r in collective_rows(a)}
    cb = {(r["purpose"], r["kind"], r["axis"]): r for r in collective_rows(b)}
    colls = []
    for key in sorted(set(ca) | set(cb)):
        ra, rb = ca.get(key, {}), cb.get(key, {})
        colls.append(
            {
                "purpose": key[0], "kind": key[1], "axis": key[2],
                "count_a": ra.get("count", 0), "count_b": rb.get("count", 0),
                "bytes_a": ra.get("bytes", 0), "bytes_b": rb.get("bytes", 0),
            }
        )  # fmt: skip
    return {
        "a": {"mesh": str(a.mesh), "fingerprint": a.fingerprint},
        "b": {"mesh": str(b.mesh), "fingerprint": b.fingerprint},
        "same_graph": same_graph,
        "parameters": param_rows,
        "only_in_a": sorted(set(a.params) - set(b.params)),
        "only_in_b": sorted(set(b.params) - set(a.params)),
        "nodes": node_rows,
        "nodes_changed": sum(r["count"] for r in node_rows),
        "checkpointed": {"a": a.checkpointing_text(), "b": b.checkpointing_text()},
        "time_s": side_by_side(times(a), times(b)),
        "memory_bytes": side_by_side(memory(a), memory(b)),
        "collectives": colls,
        "identical": (
            same_graph
            and a.mesh == b.mesh
            and not param_rows
            and not node_rows
            and a.recompute == b.recompute
        ),
    }


def _ms(t: float) -> str:
    return f"{t * 1e3:,.4f}"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def render_diff(d: dict, console: Console, names: tuple[str, str] = ("a", "b")) -> None:
    """Print ``diff_plans``'s result as tables on ``console``."""
    na, nb = names
    console.print(f"[bold]a[/bold] = {na}: {d['a']['mesh']}, graph {d['a']['fingerprint']}")
    console.print(f"[bold]b[/bold] = {nb}: {d['b']['mesh']}, graph {d['b']['fingerprint']}")
    if not d["same_graph"]:
        console.print(
            "the plans are of different step graphs (another model, batch, precision or "
            "torch): parameters are compared by name, other nodes not at all"
        )
    if d["identical"]:
        console.print("the plans make the same choices")
    if d["parameters"]:
        t = Table(title="parameters placed differently", box=box.SIMPLE_HEAD)
        for col in ("parameter", "count", "a", "b"):
            t.add_column(col, justify="right" if col == "count" else "left")
        for r in d["parameters"]:
            t.add_row(r["parameters"], str(r["count"]), ",".join(r["a"]), ",".join(r["b"]))
        console.print(t)
    elif not d["identical"] and (d["same_graph"] or not d["only_in_a"]):
        console.print("every parameter is placed alike")
    for side in ("a", "b"):
        only = d[f"only_in_{side}"]
        if only:
            console.print(f"parameters only in {side}: {len(only)} (e.g. {', '.join(only[:3])})")
    if d["nodes"]:
        t = Table(
            title=f"other nodes with another strategy: {d['nodes_changed']}",
            box=box.SIMPLE_HEAD,
        )
        for col in ("module", "count", "example", "op", "output in a", "output in b"):
            t.add_column(col, justify="right" if col == "count" else "left")
        for r in d["nodes"]:
            t.add_row(r["module"], str(r["count"]), r["example"], r["op"], r["a"], r["b"])
        console.print(t)
    ck = d["checkpointed"]
    if ck["a"] != ck["b"]:
        console.print(f"checkpointed layers: a: {ck['a'] or 'none'}; b: {ck['b'] or 'none'}")

    t = Table(title="estimated step time (ms)", box=box.SIMPLE_HEAD)
    for col in ("part", "a", "b", "b - a", "b / a"):
        t.add_column(col, justify="left" if col == "part" else "right")
    for r in d["time_s"]:
        ratio = f"{r['b'] / r['a']:.3f}" if r["a"] else "-"
        t.add_row(r["part"], _ms(r["a"]), _ms(r["b"]), f"{r['delta'] * 1e3:+,.4f}", ratio)
    console.print(t)
    t = Table(title="step memory per rank at the peak (MiB)", box=box.SIMPLE_HEAD)
    for col in ("category", "a", "b", "b - a"):
        t.add_column(col, justify="left" if col == "category" else "right")
    for r in d["memory_bytes"]:
        t.add_row(
            r["part"].replace("_", " "), _mib(r["a"]), _mib(r["b"]),
            f"{r['delta'] / 2**20:+,.2f}",
        )  # fmt: skip
    console.print(t)
    t = Table(title="collectives per step", box=box.SIMPLE_HEAD)
    for col in ("purpose", "kind", "axis", "count a", "count b", "MiB a", "MiB b"):
        t.add_column(col, justify="left" if col in ("purpose", "kind", "axis") else "right")
    for r in d["collectives"]:
        t.add_row(
            r["purpose"], r["kind"], r["axis"], str(r["count_a"]), str(r["count_b"]),
            _mib(r["bytes_a"]), _mib(r["bytes_b"]),
        )  # fmt: skip
    if not d["collectives"]:
        t.add_row("none in either plan", "", "", "0", "0", "0.00", "0.00")
    console.print(t)

"""``autopar explain plan.json TARGET``: why the plan made a choice, by planning without it.

A target is a parameter (``blocks.0.attn.q.weight``), a module path (``blocks.0.attn``: its
parameters together) or a node of the step graph (``addmm_3``). Its *choice* is the
placement the plan gave it: per mesh axis for a parameter or a node, every parameter's for a
module. ``explain`` plans the same step again with that choice forbidden (passes/solve
``forbid``: at least one of its nodes takes another placement; the nodes of a folded layer
share their choice, so forbidding it for ``blocks.0`` forbids it for every layer of the
group) and compares the two plans:

    - the cost difference, total and by part: compute, recomputation, and communication per
      mesh axis and collective kind (the collectives' own times, before the cost model's
      overlap credit for gradient reductions; the totals are the model's);
    - what binds the choice: the memory budget, when no plan without it fits (the search
      says the smallest budget that would), or when the alternative is held at the budget;
      otherwise the part whose cost rises most, a mesh axis's communication or compute.

The step is rebuilt from what the plan records of its making (``plan.source``, written
by ``autopar plan``: the model, batch, precision and options), or from ``model=``; its
traced graph must be the plan's (same fingerprint).

``explain_all`` does the same for every parameter group (``autopar show``'s layer
patterns) and ranks the alternatives by how little more they cost (``--all``: the ten
closest): one search per group.
"""

from __future__ import annotations

import difflib
import logging
import math
from collections import defaultdict
from collections.abc import Callable

from rich import box
from rich.console import Console
from rich.table import Table

from .core import Plan
from .passes.solve import MIP_GAP, SolveError
from .show import parameter_groups

__all__ = [
    "explain",
    "explain_all",
    "render_all",
    "render_explained",
    "resolve_target",
    "source_of",
]

log = logging.getLogger("autopar")

TIE = MIP_GAP
"""Alternatives within this fraction of the plan's step time are ties: the solver stops
within this relative gap of the optimum, either plan could be the other's equal."""


def source_of(plan: Plan, model: str | None = None, batch: int | None = None) -> dict:
    """How to rebuild ``plan``'s step: its recorded source, ``model``/``batch`` overriding."""
    source = dict(plan.source)
    if model is not None:
        source["model"] = model
    if batch is not None:
        source["batch"] = batch
    if "model" not in source:
        raise ValueError(
            "the plan does not say which model it was made for (it was not made by "
            "`autopar plan`): give --model MODEL (and --batch N) as it was planned"
        )
    source.setdefault("batch", 8)
    return source


def resolve_target(plan: Plan, target: str) -> tuple[str, list[tuple[str, str]]]:
    """``(kind, members)`` of ``target``: kind is ``parameter``, ``module`` or ``node``;
    members are ``(node, placements text)`` pairs, the choice as the plan made it."""

    def chosen(node: str) -> str:
        return ",".join(plan.nodes[node].placement())

    if target in plan.params:
        node = plan.params[target]
        return "parameter", [(node, chosen(node))]
    prefix = target.rstrip(".") + "."
    inside = [n for name, n in plan.params.items() if name.startswith(prefix)]
    if inside:
        return "module", [(n, chosen(n)) for n in dict.fromkeys(inside)]
    if target in plan.nodes and plan.nodes[target].out and plan.nodes[target].out[0]:
        return "node", [(target, chosen(target))]
    names = list(plan.params) + sorted({c.module for c in plan.nodes.values() if c.module})
    close = difflib.get_close_matches(target, names, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise KeyError(
        f"{target!r} is not a parameter, a module with parameters or a node of the plan{hint}"
    )


def _parts(plan: Plan) -> dict[str, float]:
    """Seconds by part, summing to the plan's estimated step time (``total_s``): compute
    (recomputation included), each collective kind per mesh axis at its own time, and the
    rest (the overlap the step has: gradient buckets and reshards issued ahead beside the
    compute, a negative time; the host's fixed time per step; reshards that move no bytes
    between ranks)."""
    parts: dict[str, float] = defaultdict(float)
    parts["compute"] = plan.cost.get("compute_s", 0.0)
    for c in plan.collectives:
        parts[f"{c.kind} on {c.axis}"] += c.time_s
    listed = sum(parts.values())
    parts[_REST] = plan.cost.get("total_s", listed) - listed
    return dict(parts)


_REST = "overlap, host time and local reshards"


def _placements(plan: Plan, members: list[tuple[str, str]]) -> list[str]:
    return [",".join(plan.nodes[n].placement()) if n in plan.nodes else "?" for n, _ in members]


def _binds(plan: Plan, alt: Plan, deltas: dict[str, float]) -> str:
    """What makes the alternative cost more: the part whose cost rises most, and the memory
    budget where it holds the alternative at its limit."""
    rising = {k: d for k, d in deltas.items() if d > 0}
    total = plan.cost.get("total_s", 0.0)
    if alt.cost.get("total_s", 0.0) - total <= TIE * total or not rising:
        cost = "nothing: a plan without the choice costs as much (a tie)"
    else:
        part, worst = max(rising.items(), key=lambda kv: kv[1])
        if part in ("compute", _REST):
            cost = f"{part}: +{worst * 1e3:,.4f} ms per step without the choice"
        else:
            kind, axis = part.split(" on ")
            cost = f"communication on axis {axis}: +{worst * 1e3:,.4f} ms of {kind} per step"
    budget = alt.memory_budget
    step = alt.memory.get("step") or {}
    if budget and step and step["peak_bytes"] >= 0.99 * budget:
        cost += (
            f"; the memory budget holds the alternative at its limit (peak "
            f"{step['peak_bytes'] / 2**20:,.2f} of {budget / 2**20:,.2f} MiB at node "
            f"{step['peak_node']})"
        )
    return cost


def explain(
    plan: Plan,
    target: str,
    replan: Callable[..., Plan],
) -> dict:
    """Why ``plan`` chose what it did for ``target`` (module docstring).

    ``replan(forbid=...)`` plans the plan's step again with those choices forbidden
    (``autopar.plan``'s ``forbid``), and raises if the step it rebuilds is not the plan's
    (``autopar.plan``'s ``fingerprint``); the CLI builds it from ``source_of(plan)``."""
    kind, members = resolve_target(plan, target)
    result: dict = {
        "target": target,
        "kind": kind,
        "nodes": [n for n, _ in members],
        "chosen": [t for _, t in members],
        "cost_s": plan.cost.get("total_s", 0.0),
        "compute_s": sum(plan.nodes[n].cost_s for n, _ in members),
    }
    try:
        alt = replan(forbid=(tuple(members),))
    except SolveError as e:
        result.update(alternative=None, delta_s=math.inf, binds=f"memory: {e}")
        return result
    before, after = _parts(plan), _parts(alt)
    deltas = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(before) | set(after))}
    deltas = {k: d for k, d in deltas.items() if abs(d) > 1e-12}
    step_a, step_b = plan.memory.get("step") or {}, alt.memory.get("step") or {}
    result.update(
        alternative=_placements(alt, members),
        alternative_cost_s=alt.cost.get("total_s", 0.0),
        delta_s=alt.cost.get("total_s", 0.0) - plan.cost.get("total_s", 0.0),
        deltas_s=deltas,
        peak_bytes=step_a.get("peak_bytes"),
        alternative_peak_bytes=step_b.get("peak_bytes"),
        budget_bytes=plan.memory_budget,
        binds=_binds(plan, alt, deltas),
        alternative_plan=alt,
    )
    return result


def explain_all(
    plan: Plan,
    replan: Callable[..., Plan],
    *,
    top: int = 10,
    progress: Callable[[str], None] | None = None,
) -> list[dict]:
    """``explain`` for every parameter group, the ``top`` cheapest alternatives first."""
    results = []
    groups = parameter_groups(plan)
    for i, (pattern, names) in enumerate(groups):
        if progress:
            progress(f"[{i + 1}/{len(groups)}] {pattern}")
        r = explain(plan, names[0], replan)  # a folded group's layers share the choice
        r["target"] = pattern
        results.append(r)
    results.sort(key=lambda r: r["delta_s"])
    return results[:top]


def _ms(t: float) -> str:
    return "no plan" if math.isinf(t) else f"{t * 1e3:+,.4f} ms"


def render_explained(r: dict, plan: Plan, console: Console) -> None:
    """Print one ``explain`` result."""
    axes = ",".join(plan.mesh.axis_names)
    what = {"parameter": "parameter", "module": "module", "node": "node"}[r["kind"]]
    console.print(f"[bold]{what} {r['target']}[/bold] in a plan for {plan.mesh}")
    chosen = Table(box=box.SIMPLE_HEAD)
    chosen.add_column("node")
    chosen.add_column("op")
    chosen.add_column(f"chosen ({axes})")
    if r.get("alternative") is not None:
        chosen.add_column("without the choice")
    for i, (node, text) in enumerate(zip(r["nodes"], r["chosen"])):
        name = _param_name(plan, node)
        row = [name, plan.nodes[node].op, text]
        if r.get("alternative") is not None:
            row.append(r["alternative"][i])
        chosen.add_row(*row)
    console.print(chosen)
    console.print(f"step time of the plan: {r['cost_s'] * 1e3:,.4f} ms")
    if r.get("alternative") is None:
        console.print(f"without the choice: no plan. Binds: {r['binds']}")
        return
    console.print(
        f"the best plan without the choice: {r['alternative_cost_s'] * 1e3:,.4f} ms "
        f"({_ms(r['delta_s'])})"
    )
    if r["deltas_s"]:
        t = Table(title="what changes (ms per step)", box=box.SIMPLE_HEAD)
        t.add_column("part")
        t.add_column("without - with", justify="right")
        for part, d in sorted(r["deltas_s"].items(), key=lambda kv: -abs(kv[1])):
            t.add_row(part, f"{d * 1e3:+,.4f}")
        console.print(t)
    if r.get("peak_bytes") is not None:
        budget = r.get("budget_bytes")
        of = f" of a {budget / 2**20:,.2f} MiB budget" if budget else ""
        console.print(
            f"step memory peak per rank: {r['peak_bytes'] / 2**20:,.2f} MiB with the choice, "
            f"{r['alternative_peak_bytes'] / 2**20:,.2f} MiB without{of}"
        )
    console.print(f"binds: {r['binds']}")


def render_all(results: list[dict], plan: Plan, console: Console) -> None:
    """Print ``explain_all``'s results as one table."""
    axes = ",".join(plan.mesh.axis_names)
    t = Table(
        title=f"the choices whose alternative costs least more (plan: "
        f"{plan.cost.get('total_s', 0.0) * 1e3:,.4f} ms on {plan.mesh})",
        box=box.SIMPLE_HEAD,
    )
    for col in ("parameters", f"chosen ({axes})", "without it", "+ ms", "binds"):
        t.add_column(col, justify="right" if col == "+ ms" else "left")
    for r in results:
        alt = r.get("alternative")
        t.add_row(
            r["target"], r["chosen"][0], alt[0] if alt else "no plan", _ms(r["delta_s"]),
            r["binds"],
        )  # fmt: skip
    console.print(t)


def _param_name(plan: Plan, node: str) -> str:
    for name, n in plan.params.items():
        if n == node:
            return name
    return node

"""``autopar show plan.json``: a saved plan as terminal tables.

What it shows, all read from the plan's JSON (nothing is re-planned):
    - parameters grouped by layer pattern: names that differ only in their layer indices
      (``blocks.0.attn.q.weight``, ``blocks.1.attn.q.weight``) and take the same placements
      are one row, ``blocks.{0,1}.attn.q.weight``, with their count;
    - the step memory per rank at its peak, by category, against the budget, and the layers
      checkpointed;
    - the collectives of one step by kind and mesh axis, with their bytes and time, split
      into gradient reductions (at the step's outputs) and reshards (between operators);
    - the estimated step time: compute, then each kind of collective.
"""

from __future__ import annotations

import re
from collections import defaultdict

from rich import box
from rich.console import Console
from rich.table import Table

from .core.plan import Plan, index_ranges

__all__ = ["layer_groups", "render"]

_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")
_MIB = 2**20


def layer_groups(plan: Plan) -> list[tuple[str, int, tuple, tuple[str, ...]]]:
    """``(pattern, count, shape, placements per axis)`` per group of parameters, in the
    order of their first member. A pattern writes the layer indices its members differ in as
    ``{0..31}``; a parameter alone keeps its name."""
    shapes = plan.stats.get("param_shapes", {})
    groups: dict[tuple, list[tuple[str, list[int]]]] = defaultdict(list)
    for name, node in plan.params.items():
        ps = plan.nodes[node].placement()
        key = (_INDEX.sub("#", name), tuple(shapes.get(name, ())), tuple(ps))
        groups[key].append((name, [int(i) for i in _INDEX.findall(name)]))
    rows = []
    for (pattern, shape, ps), members in groups.items():
        if len(members) == 1:
            rows.append((members[0][0], 1, shape, ps))
            continue
        positions = list(zip(*(idx for _, idx in members)))
        parts = [
            str(vals[0]) if len(set(vals)) == 1 else "{" + index_ranges(list(set(vals))) + "}"
            for vals in positions
        ]
        name = pattern
        for part in parts:
            name = name.replace("#", part, 1)
        rows.append((name, len(members), shape, ps))
    return rows


def _mib(nbytes: float) -> str:
    return f"{nbytes / _MIB:,.2f}"


def render(plan: Plan, console: Console) -> None:
    """Print ``plan``'s tables (module docstring) on ``console``."""
    axes = plan.mesh.axis_names
    precision = plan.stats.get("mixed_precision", "the model's dtypes")
    console.print(
        f"[bold]autopar plan[/bold] for {plan.mesh} (graph {plan.fingerprint}); "
        f"precision: {precision}; made by autopar {plan.versions.get('autopar', '?')}, "
        f"torch {plan.versions.get('torch', '?')}"
    )

    params = Table(title="parameters, by layer pattern", box=box.SIMPLE_HEAD)
    params.add_column("parameter")
    params.add_column("count", justify="right")
    params.add_column("shape")
    for a in axes:
        params.add_column(a)
    for pattern, count, shape, ps in layer_groups(plan):
        params.add_row(pattern, str(count), "x".join(map(str, shape)) or "-", *ps)
    console.print(params)

    step = plan.memory.get("step")
    budget = plan.stats.get("memory_budget")
    if step:
        mem = Table(
            title=f"step memory per rank at its peak (after {step['peak_node']}; "
            f"{step['optimizer']} state)",
            box=box.SIMPLE_HEAD,
        )
        mem.add_column("category")
        mem.add_column("MiB", justify="right")
        mem.add_column("of the peak", justify="right")
        if budget:
            mem.add_column("of the budget", justify="right")
        peak = step["peak_bytes"]
        for cat, nbytes in step["at_peak"].items():
            if not nbytes:
                continue
            row = [cat.replace("_", " "), _mib(nbytes), f"{nbytes / peak:.1%}"]
            if budget:
                row.append(f"{nbytes / budget:.1%}")
            mem.add_row(*row)
        total = ["[bold]peak[/bold]", _mib(peak), "100.0%"]
        if budget:
            total.append(f"{peak / budget:.1%}")
        mem.add_row(*total)
        if budget:
            mem.add_row("budget", _mib(budget), "", "100.0%")
        console.print(mem)
    if plan.recompute:
        console.print(
            f"activation checkpointing: {len(plan.recompute)} layers recompute their "
            f"activations in the backward: {plan.checkpointing_text()}"
        )

    colls = Table(title="collectives per step", box=box.SIMPLE_HEAD)
    for name, justify in [("purpose", "left"), ("kind", "left"), ("axis", "left")] + [
        (c, "right") for c in ("count", "MiB", "ms")
    ]:
        colls.add_column(name, justify=justify)  # type: ignore[arg-type]
    by: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for c in plan.collectives:
        purpose = "gradient reduction" if "->output[" in c["edge"] else "reshard"
        acc = by[(purpose, c["kind"], c["axis"])]
        acc[0] += 1
        acc[1] += c["nbytes"]
        acc[2] += c.get("time_s", 0.0)
    for (purpose, kind, axis), (n, nbytes, t) in sorted(by.items()):
        colls.add_row(purpose, kind, axis, str(n), _mib(nbytes), f"{t * 1e3:.4f}")
    if not by:
        colls.add_row("none", "", "", "0", "0", "0")
    console.print(colls)

    cost = plan.cost
    total = cost.get("total_s", 0.0)
    times = Table(title="estimated step time", box=box.SIMPLE_HEAD)
    times.add_column("part")
    times.add_column("ms", justify="right")
    times.add_column("of the step", justify="right")

    def share(t: float) -> str:
        return f"{t / total:.1%}" if total > 0 else "-"

    for part, t in (
        ("compute", cost.get("compute_s", 0.0)),
        ("communication", cost.get("comm_s", 0.0)),
    ):
        times.add_row(part, f"{t * 1e3:.4f}", share(t))
    for kind, t in cost.get("comm_by_kind_s", {}).items():
        # NOTE: per kind before the overlap discount of gradient reductions (passes/solve)
        times.add_row(f"  {kind.replace('_', ' ')} (not overlapped)", f"{t * 1e3:.4f}", "")
    times.add_row("[bold]total[/bold]", f"{total * 1e3:.4f}", share(total))
    console.print(times)

"""``autopar show plan.json``: a saved plan as terminal tables.

What it shows, all read from the plan's JSON (nothing is re-planned):
    - parameters grouped by layer pattern: names that differ only in their layer indices
      (``blocks.0.attn.q.weight``, ``blocks.1.attn.q.weight``) and take the same placements
      are one row, ``blocks.{0,1}.attn.q.weight``, with their count;
    - the step memory per rank at its peak, by category, against the budget, and the layers
      checkpointed;
    - the collectives of one step by kind and mesh axis, with their bytes and time, split
      into gradient reductions (at the step's outputs), the loss's own (``output``) and
      reshards (between operators);
    - the estimated step time: compute, then each kind of collective.
"""

from __future__ import annotations

from collections import defaultdict

from rich import box
from rich.console import Console
from rich.table import Table

from .core.plan import LAYER_INDEX, Plan, name_pattern
from .core.schedule import purpose

__all__ = [
    "collective_rows",
    "layer_groups",
    "parameter_groups",
    "purpose",
    "render",
    "tables",
]

_MIB = 2**20


def layer_groups(plan: Plan) -> list[tuple[str, int, tuple, tuple[str, ...]]]:
    """``(pattern, count, shape, placements per axis)`` per group of parameters, in the
    order of their first member. A pattern writes the layer indices its members differ in as
    ``{0..31}``; a parameter alone keeps its name."""
    return [(name_pattern(names), len(names), shape, ps) for names, shape, ps in _groups(plan)]


def _groups(plan: Plan) -> list[tuple[list[str], tuple, tuple[str, ...]]]:
    shapes = plan.stats.get("param_shapes", {})
    groups: dict[tuple, list[str]] = defaultdict(list)
    for name, node in plan.params.items():
        ps = plan.nodes[node].placement()
        groups[(LAYER_INDEX.sub("#", name), tuple(shapes.get(name, ())), tuple(ps))].append(name)
    return [(members, shape, ps) for (_, shape, ps), members in groups.items()]


def parameter_groups(plan: Plan) -> list[tuple[str, list[str]]]:
    """``(pattern, member names)`` per group of ``layer_groups``."""
    return [(name_pattern(names), names) for names, _, _ in _groups(plan)]


def _mib(nbytes: float) -> str:
    return f"{nbytes / _MIB:,.2f}"


def collective_rows(plan: Plan) -> list[dict]:
    """The plan's collectives per step summed by purpose (core/schedule ``purpose``:
    ``gradient reduction``, ``output`` into the loss or another returned value, ``reshard``
    between operators), kind and mesh axis, sorted."""
    by: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for c in plan.collectives:
        acc = by[(purpose(c), c.kind, c.axis)]
        acc[0] += 1
        acc[1] += c.nbytes
        acc[2] += c.time_s
    return [
        {"purpose": p, "kind": k, "axis": a, "count": int(n), "bytes": int(b), "time_s": t}
        for (p, k, a), (n, b, t) in sorted(by.items())
    ]


def tables(plan: Plan) -> dict:
    """What ``render`` prints, as plain data (``autopar show --json``)."""
    step = plan.memory.get("step")
    memory = None
    if step:
        memory = {
            "peak_bytes": step["peak_bytes"],
            "peak_node": step["peak_node"],
            "optimizer": step["optimizer"],
            "budget_bytes": plan.memory_budget,
            "at_peak": {c: n for c, n in step["at_peak"].items() if n},
        }
    return {
        "mesh": {"shape": list(plan.mesh.shape), "axes": list(plan.mesh.axis_names)},
        "fingerprint": plan.fingerprint,
        "precision": plan.stats.get("mixed_precision", "the model's dtypes"),
        "versions": dict(plan.versions),
        "parameters": [
            {"pattern": pat, "count": n, "shape": list(shape), "placements": list(ps)}
            for pat, n, shape, ps in layer_groups(plan)
        ],
        "memory": memory,
        "checkpointed": plan.checkpointing_text() if plan.recompute else "",
        "collectives": collective_rows(plan),
        "time": {
            "compute_s": plan.cost.get("compute_s", 0.0),
            "comm_s": plan.cost.get("comm_s", 0.0),
            "comm_by_kind_s": dict(plan.cost.get("comm_by_kind_s", {})),
            "total_s": plan.cost.get("total_s", 0.0),
            "emitted_step_s": plan.emitted_step_s(),
        },
    }


def render(plan: Plan, console: Console) -> None:
    """Print ``plan``'s tables (module docstring) on ``console``."""
    t = tables(plan)
    axes = plan.mesh.axis_names
    console.print(
        f"[bold]autopar plan[/bold] for {plan.mesh} (graph {plan.fingerprint}); "
        f"precision: {t['precision']}; made by autopar {plan.versions.get('autopar', '?')}, "
        f"torch {plan.versions.get('torch', '?')}"
    )

    params = Table(title="parameters, by layer pattern", box=box.SIMPLE_HEAD)
    params.add_column("parameter")
    params.add_column("count", justify="right")
    params.add_column("shape")
    for a in axes:
        params.add_column(a)
    for row in t["parameters"]:
        shape = "x".join(map(str, row["shape"])) or "-"
        params.add_row(row["pattern"], str(row["count"]), shape, *row["placements"])
    console.print(params)

    memory = t["memory"]
    if memory:
        budget = memory["budget_bytes"]
        mem = Table(
            title=f"step memory per rank at its peak (after {memory['peak_node']}; "
            f"{memory['optimizer']} state)",
            box=box.SIMPLE_HEAD,
        )
        mem.add_column("category")
        mem.add_column("MiB", justify="right")
        mem.add_column("of the peak", justify="right")
        if budget:
            mem.add_column("of the budget", justify="right")
        peak = memory["peak_bytes"]
        for cat, nbytes in memory["at_peak"].items():
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
            f"activations in the backward: {t['checkpointed']}"
        )

    colls = Table(title="collectives per step", box=box.SIMPLE_HEAD)
    for name, justify in [("purpose", "left"), ("kind", "left"), ("axis", "left")] + [
        (c, "right") for c in ("count", "MiB", "ms")
    ]:
        colls.add_column(name, justify=justify)  # type: ignore[arg-type]
    for c in t["collectives"]:
        colls.add_row(
            c["purpose"], c["kind"], c["axis"], str(c["count"]), _mib(c["bytes"]),
            f"{c['time_s'] * 1e3:.4f}",
        )  # fmt: skip
    if not t["collectives"]:
        colls.add_row("none", "", "", "0", "0", "0")
    console.print(colls)

    time = t["time"]
    total_s = time["total_s"]
    times = Table(title="estimated step time", box=box.SIMPLE_HEAD)
    times.add_column("part")
    times.add_column("ms", justify="right")
    times.add_column("of the step", justify="right")

    def share(s: float) -> str:
        return f"{s / total_s:.1%}" if total_s > 0 else "-"

    for part, s in (("compute", time["compute_s"]), ("communication", time["comm_s"])):
        times.add_row(part, f"{s * 1e3:.4f}", share(s))
    for kind, s in time["comm_by_kind_s"].items():
        # NOTE: per kind before the overlap discount of gradient reductions (passes/solve)
        times.add_row(f"  {kind.replace('_', ' ')} (not overlapped)", f"{s * 1e3:.4f}", "")
    times.add_row("[bold]total[/bold]", f"{total_s * 1e3:.4f}", share(total_s))
    times.add_row(
        "the step as emitted, simulated", f"{time['emitted_step_s'] * 1e3:.4f}", ""
    )  # core/schedule: what codegen emits overlaps its gradient buckets and prefetches
    console.print(times)

"""Planning time against depth: folded and unfolded search on one mesh, same solver.

    python benchmarks/search_scaling.py [--depths 12,24,48,96] [--mesh 8x8]
        [--unfolded-depths 12,24,48] [--time-limit 600]

GPT-style models (autopar.models.GPT: hidden 2048, 16 heads, ffn 8192, seq 2048, vocab
50304, batch 8; only the depth changes) are built on the meta device and traced once per
depth; the same step graph is then planned with folding (passes/fold) and without. "search"
is everything after tracing up to the plan: folding, strategies, costs, ILP build and solve.
An unfolded search that reaches the solver's time limit is reported with ">=" (its ratio
is then a lower bound). Prints a markdown table with the machine and versions.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import time
import warnings

import torch

import autopar
from autopar.api import plan_step
from autopar.models import GPT, GPTConfig, cross_entropy_loss
from autopar.passes.solve import SolveError
from autopar.passes.trace import trace_step


def _trace(depth: int, stack):
    cfg = GPTConfig(vocab=50304, seq=2048, hidden=2048, heads=16, layers=depth, ffn=8192)
    with torch.device("meta"):
        model = GPT(cfg)
    tokens = torch.zeros(8, cfg.seq, dtype=torch.long, device="meta")
    return trace_step(
        model, (tokens,), loss_fn=cross_entropy_loss, example_targets=(tokens,), stack=stack
    )


def _search(step, mesh, fold: bool, time_limit_s: float):
    t0 = time.perf_counter()
    plan = plan_step(step, mesh, fold=fold, time_limit_s=time_limit_s)
    return plan, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="12,24,48,96")
    ap.add_argument("--unfolded-depths", default="12,24,48")
    ap.add_argument("--mesh", default="8x8")
    ap.add_argument("--device", default="h100")
    ap.add_argument("--time-limit", type=float, default=600.0)
    args = ap.parse_args()
    shape = tuple(int(s) for s in args.mesh.split("x"))
    mesh = autopar.Mesh(shape, ("dp", "tp")[: len(shape)], device=args.device)
    unfolded_depths = {int(d) for d in args.unfolded_depths.split(",") if d}
    print(
        f"machine: {platform.machine()}, {torch.get_num_threads()} threads; "
        f"torch {torch.__version__}; mesh {args.mesh}; profile {args.device}; "
        f"solver time limit {args.time_limit:.0f} s"
    )
    print()
    print(
        "| layers | nodes | trace s | folded: solver nodes | variables | constraints "
        "| search s | unfolded: variables | constraints | search s | unfolded / folded "
        "| est. step ms folded / unfolded |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    warnings.simplefilter("ignore")
    for depth in (int(d) for d in args.depths.split(",")):
        with contextlib.ExitStack() as stack:
            step = _trace(depth, stack)
            folded, t_f = _search(step, mesh, True, args.time_limit)
            sf = folded.stats
            row = (
                f"| {depth} | {sf['nodes']} | {step.trace_s:.1f} | {sf['solver_nodes']} "
                f"| {sf['variables']} | {sf['constraints']} | {t_f:.1f} "
            )
            plain = None
            if depth in unfolded_depths:
                try:
                    plain, t_u = _search(step, mesh, False, args.time_limit)
                except SolveError as e:  # no solution within the time limit
                    row += f"| - | - | >={args.time_limit:.0f} (no solution: {e}) | - | - |"
            if plain is not None:
                su = plain.stats
                capped = su["status"] != "optimal"
                ge = ">=" if capped else ""
                row += (
                    f"| {su['variables']} | {su['constraints']} | {ge}{t_u:.1f} "
                    f"| {ge}{t_u / t_f:.1f}x | {folded.cost['total_s'] * 1e3:.2f} / "
                    f"{plain.cost['total_s'] * 1e3:.2f} |"
                )
            elif depth not in unfolded_depths:
                row += f"| - | - | - | - | {folded.cost['total_s'] * 1e3:.2f} / - |"
        print(row, flush=True)


if __name__ == "__main__":
    main()

"""Plan every zoo model on a few meshes and print a markdown table of the planning runs.

    python benchmarks/plan_zoo.py [--device h100] [--memory-fraction 0.5]

Models are built on the meta device (no weights). Columns: problem size (graph nodes,
candidate strategies, ILP variables), seconds spent tracing and searching (everything after
tracing up to the plan), the estimated step time and the collectives per step.
"""

from __future__ import annotations

import argparse

from common import print_header

import autopar
from autopar.cli import plan_example

MESHES = [((2,), ("dp",)), ((4,), ("dp",)), ((2, 2), ("dp", "tp"))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="h100")
    ap.add_argument("--memory-fraction", type=float, default=None)
    ap.add_argument("--models", default="mlp,gpt,hf-gpt2,hf-llama")
    args = ap.parse_args()
    print_header(
        f"profile {args.device}; memory fraction {args.memory_fraction}",
        [
            "model",
            "mesh",
            "nodes",
            "strategies",
            "variables",
            "trace s",
            "search s",
            "est. step ms",
            "collectives/step",
        ],
    )
    for name in args.models.split(","):
        for shape, axes in MESHES:
            mesh = autopar.Mesh(shape, axes, device=args.device)
            plan = plan_example(name, mesh, memory_fraction=args.memory_fraction)
            st = plan.stats
            n_coll = sum(plan.collective_counts().values())
            print(
                f"| {name} | {'x'.join(map(str, shape))} | {st['nodes']} | {st['strategies']} "
                f"| {st['variables']} | {st['trace_s']:.2f} | {st['search_s']:.2f} "
                f"| {plan.cost['total_s'] * 1e3:.3f} | {n_coll} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

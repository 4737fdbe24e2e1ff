"""autopar's plan against the expert plans, costed by the same cost model and memory model.

    python benchmarks/plan_quality.py [--models llama3-8b,gpt3,llama3-1b]
        [--meshes 8,2x4,8x8,16x8] [--batch 16] [--precision bf16-mixed|fp32] [--check]

For each model and mesh: autopar's plan (``autopar.plan`` at the device profile's usable
memory), then each expert plan that applies to the mesh, as ``autopar/experts.py`` writes it
and ``autopar.evaluate`` costs it (the expert's placements of the parameters and the batch
pinned; the solver places the activations between at least cost; no memory bound, nothing
checkpointed):

    - on one axis: DP (every parameter replicated, the batch split; DDP), FSDP (ZeRO-3),
      and Megatron TP;
    - on two: Megatron TP over the last axis with DP over the first, and with FSDP over
      the first (torchtitan's 2-D plan).

Every plan, autopar's and the experts', is solved by the same ILP (passes/solve, with its
simplifications: following nodes merged into their producers, one mesh axis changed per
edge; an expert's without them where its pins need it, ``exact_ilp``): like for like, and
kinder to the experts than their own code, which leaves the activations where DTensor's
rules put them.

(DP or FSDP over both axes of an (8, 8) mesh would split the batch (``--batch``, 16
sequences) 64 ways: not a plan for this batch.)

"x autopar" is the expert's estimated step time over autopar's (above 1: autopar's plan is
faster); "fits" compares the expert's predicted peak per rank with the usable memory.
``--check`` exits non-zero when an expert plan that fits is estimated faster than
autopar's (autopar's own plan is bounded by the memory; a faster expert that does not fit
is no loss). These are the cost model's estimates, not measured step times.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch
from common import print_header

import autopar
from autopar import experts
from autopar.cost_models import get_profile
from autopar.models import EXAMPLES
from autopar.passes.solve import SolveError


def _experts(model, mesh: autopar.Mesh) -> list[tuple[str, dict]]:
    """The expert plans for ``mesh`` (module docstring), labelled with their axes."""
    axes = mesh.axis_names
    if len(axes) == 1:
        (a,) = axes
        return [
            (f"DP over {a}", experts.dp(mesh)),
            (f"FSDP over {a}", experts.fsdp(mesh)),
            (f"Megatron TP over {a}", experts.megatron(model, mesh, tp=a)),
        ]
    data, tp = axes[0], axes[-1]
    return [
        (f"Megatron TP over {tp} + DP over {data}", experts.megatron(model, mesh, tp=tp, dp=data)),
        (f"Megatron TP over {tp} + FSDP over {data}",
         experts.megatron(model, mesh, tp=tp, dp=data, fsdp=True)),
    ]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama3-8b,gpt3,llama3-1b")
    ap.add_argument("--meshes", default="8,2x4,8x8,16x8")
    ap.add_argument("--device", default="h100")
    ap.add_argument("--batch", type=int, default=16, help="sequences of 2048 tokens per step")
    ap.add_argument("--precision", choices=["bf16-mixed", "fp32"], default="bf16-mixed")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    print_header(
        f"profile {args.device}; AdamW; {args.precision}; batch {args.batch} x 2048 tokens; "
        "the cost model's estimates",
        ["model", "mesh", "plan", "est. step ms", "x autopar", "peak GiB/rank", "fits",
         "collectives/step", "wall s"],
    )  # fmt: skip
    warnings.simplefilter("ignore")
    policy = None
    if args.precision == "bf16-mixed":
        policy = autopar.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32)
    missed = []
    for name in args.models.split(","):
        for text in args.meshes.split(","):
            shape = tuple(int(s) for s in text.split("x"))
            axes = ("dp", "tp")[: len(shape)]
            mesh = autopar.Mesh(shape, axes, device=args.device)
            usable = get_profile(mesh.device).usable_memory
            model, inputs, loss_fn, targets = EXAMPLES[name](batch=args.batch)
            kw = dict(loss_fn=loss_fn, example_targets=targets, mp_policy=policy)
            t0 = time.perf_counter()
            rows = []
            try:
                rows.append(("autopar", autopar.plan(model, mesh, inputs, **kw),
                             time.perf_counter() - t0))  # fmt: skip
            except SolveError as e:  # no plan fits the device: said, and the experts costed
                print(f"| {name} | {text} | autopar | no plan: {e} | | | | | "
                      f"{time.perf_counter() - t0:.1f} |", flush=True)  # fmt: skip
            for label, cons in _experts(model, mesh):
                t0 = time.perf_counter()
                try:
                    rows.append((label, autopar.evaluate(model, mesh, inputs, cons, **kw),
                                 time.perf_counter() - t0))  # fmt: skip
                except (SolveError, ValueError) as e:
                    print(f"| {name} | {text} | {label} | no plan: {e} | | | | | |", flush=True)
            base = rows[0][1].cost["total_s"] if rows and rows[0][0] == "autopar" else None
            for label, plan, wall in rows:
                total = plan.cost["total_s"]
                peak = plan.memory["step"]["peak_bytes"]
                fits = peak <= usable
                if label != "autopar" and fits and (base is None or total < base * (1 - 1e-9)):
                    missed.append(f"{name} on {text}: {label} {total * 1e3:.1f} ms < autopar "
                                  + ("(no plan)" if base is None else f"{base * 1e3:.1f} ms"))  # fmt: skip
                ratio = "" if base is None else f"{total / base:.3f}"
                print(
                    f"| {name} | {text} | {label} | {total * 1e3:.1f} | {ratio} "
                    f"| {peak / 2**30:.1f} | {'yes' if fits else 'no'} "
                    f"| {len(plan.collectives)} | {wall:.1f} |",
                    flush=True,
                )
    if missed:
        print("\nexpert plans that fit and are estimated faster than autopar's:")
        for m in missed:
            print(f"  {m}")
    else:
        print("\nno expert plan that fits is estimated faster than autopar's")
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Predicted step memory per rank (passes/memory) against the emitted step, measured.

Each case compiles a zoo model on local gloo processes and runs AdamW steps. During the
third step (optimizer state exists from the first), every rank measures the bytes of live
storages: a ``TorchDispatchMode`` sees every tensor an op returns, and a storage counts as
live while any tensor on it is alive (weak references); the parameters, their gradients and
the optimizer state that exist when the step starts are counted from the start. Why this
method: on CPU there is no allocator statistic (``torch.cuda.max_memory_allocated`` is
CUDA's), the profiler's memory events need a trace per step, and storages are what a
caching allocator would hold, less its rounding. It sees what the compiled step keeps for
the backward (aot_autograd's partitioner may recompute instead of saving), collective
outputs, and the optimizer's temporaries.

    python benchmarks/memory_check.py [--check]      # --check: within 10% on every case
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch

from autopar.runtime import run_local
from autopar.verify import measured_step_peak

TARGET = 0.10
MIXED = "bf16-mixed"  # float32 parameters and AdamW state, bf16 compute, float32 reduction
CASES = [
    ("mlp", (2,), None, "fp32"),
    ("mlp", (2, 2), 0.5, "fp32"),
    ("gpt", (2,), None, "fp32"),
    ("gpt", (2, 2), 0.5, "fp32"),
    ("hf-llama", (2, 2), 0.5, "fp32"),
    ("gpt", (2, 2), 0.5, MIXED),
    ("hf-llama", (2, 2), 0.5, MIXED),
    # budgets that only a plan recomputing its layers meets (passes/remat)
    ("gpt", (2,), 0.45, "fp32"),
    ("hf-llama", (2,), 0.45, "fp32"),
    ("hf-llama", (2,), 0.45, MIXED),
]
CHECKPOINTED = {case for case in CASES if case[1] == (2,) and case[2] is not None}
"""The cases whose plan must checkpoint (--check fails if it does not)."""


def _measure(rank, world, example, mesh_shape, fraction, precision):
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    from autopar.models import EXAMPLES

    torch.manual_seed(0)
    model, inputs, loss_fn, targets = EXAMPLES[example]()
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp")[: len(mesh_shape)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(
            model,
            mesh,
            inputs,
            loss_fn=loss_fn,
            example_targets=targets,
            memory_fraction=fraction,
            mp_policy=autopar.MixedPrecision(torch.bfloat16, torch.float32)
            if precision == MIXED
            else None,
        )
    local = pm.shard_inputs(*inputs, *targets)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=False)

    def step():
        pm(*local).backward()
        opt.step()
        opt.zero_grad()  # torch's default: to None, so gradients live from the backward on

    for _ in range(2):
        step()
    peak = measured_step_peak(pm, opt, local, step)
    return peak, pm.plan.memory["step"], len(pm.plan.recompute)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help=f"fail if off by more than {TARGET:.0%}")
    args = ap.parse_args(argv)
    from common import print_header

    print_header(
        "gloo on this machine; AdamW; measured during the 3rd step, max over ranks",
        ["model", "mesh", "precision", "budget", "checkpointed layers", "predicted MiB",
         "measured MiB", "ratio", "peak at", "predicted breakdown at peak (MiB)"],
    )  # fmt: skip
    worst = 0.0
    missing = []
    for case in CASES:
        example, mesh_shape, fraction, precision = case
        world = 1
        for s in mesh_shape:
            world *= s
        results = run_local(_measure, world, example, mesh_shape, fraction, precision)
        measured = max(r[0] for r in results)
        step, checkpointed = results[0][1], results[0][2]
        if case in CHECKPOINTED and not checkpointed:
            missing.append(case)
        predicted = step["peak_bytes"]
        ratio = predicted / measured
        worst = max(worst, abs(ratio - 1))
        parts = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in step["at_peak"].items() if v)
        print(
            f"| {example} | {'x'.join(map(str, mesh_shape))} | {precision} | "
            f"{'none' if fraction is None else f'{fraction:.0%} of one device'} | "
            f"{checkpointed} | {predicted / 2**20:.3f} | {measured / 2**20:.3f} | {ratio:.3f} | "
            f"{step['peak_node']} | {parts} |",
            flush=True,
        )
    if args.check and worst > TARGET:
        print(f"\nFAIL: a prediction is off by {worst:.1%} > {TARGET:.0%}")
        return 1
    if args.check and missing:
        print(f"\nFAIL: these plans should checkpoint and do not: {missing}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

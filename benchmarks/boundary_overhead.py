"""What the DTensor boundary of ``ParallelModule`` costs a training step, on gloo.

The compiled step runs on local tensors; ``ParallelModule`` holds DTensor parameters and
hands the step their local tensors (``to_local``), and takes the gradients back as DTensors.
This measures, on the same compiled step, in the same processes, interleaved:

    dtensor:  loss = pm(*batch); loss.backward()           (parameters are DTensors)
    local:    loss = fn(*leaves, *buffers, *batch); loss.backward()
              (plain local leaf tensors, as the step ran before parameters became DTensors)

and the optimizer step (AdamW, foreach) on the DTensor parameters against plain local
tensors, which is torch's DTensor dispatch, not autopar's (reported, not checked).

Two processes or four share two cores, so the interleaved A/B difference of whole steps is
noise of a few percent either way; the boundary's own work (``to_local`` of every
parameter and the backward that wraps each local gradient as a DTensor) is also timed alone,
and that, over the local step, is what ``--check`` holds under 2%.

    python benchmarks/boundary_overhead.py [--check]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from autopar.runtime import run_local

from common import compile_quietly, print_header

TARGET = 0.02  # the forward+backward overhead the DTensor boundary may add


def _bench(rank, world, mesh_shape, layers, hidden, seq, batch, reps):
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.models import GPT, GPTConfig, cross_entropy_loss, lm_batch

    cfg = GPTConfig(vocab=512, seq=seq, hidden=hidden, heads=8, layers=layers, ffn=4 * hidden)
    torch.manual_seed(0)
    model = GPT(cfg)
    tokens, targets = lm_batch(cfg.vocab, batch, cfg.seq)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp")[: len(mesh_shape)])
    pm = compile_quietly(
        model,
        mesh,
        (tokens,),
        loss_fn=cross_entropy_loss,
        example_targets=(targets,),
        memory_fraction=0.5,
    )
    batch_local = pm.shard_inputs(tokens, targets)
    names = pm.compiled.param_names
    leaves = [pm.get_parameter(n).to_local().detach().clone().requires_grad_() for n in names]
    buffers = [pm.get_buffer(n).to_local() for n in pm.compiled.buffer_names]
    fn = pm.compiled.fn

    def dtensor_step():
        pm.zero_grad()
        pm(*batch_local).backward()

    def local_step():
        for leaf in leaves:
            leaf.grad = None
        fn(*leaves, *buffers, *batch_local).backward()

    opt_d = torch.optim.AdamW(pm.parameters(), lr=1e-4, foreach=True)
    opt_l = torch.optim.AdamW(leaves, lr=1e-4, foreach=True)

    def timed(f):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        f()
        torch.distributed.barrier()
        return time.perf_counter() - t0

    for _ in range(2):  # warm up both
        dtensor_step()
        local_step()
        opt_d.step()
        opt_l.step()
    times: dict[str, list[float]] = {"dtensor": [], "local": [], "opt_dtensor": [], "opt_local": []}
    for _ in range(reps):  # interleaved, so drift hits both alike
        times["dtensor"].append(timed(dtensor_step))
        times["local"].append(timed(local_step))
        times["opt_dtensor"].append(timed(opt_d.step))
        times["opt_local"].append(timed(opt_l.step))
    # the boundary alone: to_local of every parameter, and the backward that wraps each
    # local gradient as a DTensor gradient (what the DTensor path adds to the step)
    grads = [torch.ones_like(leaf) for leaf in leaves]

    def boundary():
        pm.zero_grad()
        locals_ = pm.local_tensors()[: len(grads)]
        torch.autograd.backward(locals_, grads)

    for _ in range(3):
        boundary()
    t0 = time.perf_counter()
    for _ in range(reps):
        boundary()
    times["boundary"] = [(time.perf_counter() - t0) / reps]
    n_params = sum(p.numel() for p in model.parameters())
    return {k: statistics.median(v) for k, v in times.items()}, n_params, len(names)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--check",
        action="store_true",
        help=f"fail if the boundary costs > {TARGET:.0%}% of the step",
    )
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)
    configs = [((2,), 4, 256, 128, 8), ((2, 2), 4, 256, 128, 8)]
    print_header(
        f"gloo on this machine; GPT float32, AdamW foreach; median of {args.reps} interleaved "
        "steps; each step between barriers",
        [
            "mesh",
            "layers x hidden",
            "params",
            "fwd+bwd local ms",
            "fwd+bwd DTensor ms",
            "A/B difference",
            "boundary alone ms",
            "boundary / step",
            "AdamW local ms",
            "AdamW DTensor ms",
            "ratio",
        ],
    )
    worst = 0.0
    for mesh_shape, layers, hidden, seq, batch in configs:
        world = 1
        for s in mesh_shape:
            world *= s
        results = run_local(_bench, world, mesh_shape, layers, hidden, seq, batch, args.reps)
        t, n_params, _ = results[0]
        diff = t["dtensor"] / t["local"] - 1
        over = t["boundary"] / t["local"]
        worst = max(worst, over)
        print(
            f"| {'x'.join(map(str, mesh_shape))} | {layers} x {hidden} | {n_params / 1e6:.2f} M "
            f"| {t['local'] * 1e3:.1f} | {t['dtensor'] * 1e3:.1f} | {diff:+.1%} "
            f"| {t['boundary'] * 1e3:.2f} | {over:.2%} "
            f"| {t['opt_local'] * 1e3:.1f} | {t['opt_dtensor'] * 1e3:.1f} "
            f"| {t['opt_dtensor'] / t['opt_local']:.2f}x |"
        )
    if args.check and worst > TARGET:
        print(f"\nFAIL: the boundary costs {worst:.2%} of the step > {TARGET:.0%}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

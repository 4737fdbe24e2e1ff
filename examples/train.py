"""A complete training loop with autopar, launched by torchrun, unchanged on CPU and on GPUs.

    torchrun --standalone --nproc-per-node 4 examples/train.py --mesh 2x2 --steps 20 \\
        --ckpt-dir /tmp/ckpt --ckpt-every 10
    # stop it, run the same command again: it resumes from the newest checkpoint

On CUDA it runs with NCCL, on CPU with gloo. What it does:

- builds the model on the meta device and lets ``autopar.compile`` plan it and make only
  this rank's shards, initialized as the single-device model would be for the seed;
- reads only this rank's part of the data (``pm.data_shard()``: the batch is split over
  the mesh axes the plan shards every input on; ranks that share a part read the same
  rows), and ``pm.shard_inputs`` cuts the rows this rank computes on from it;
- AdamW (fused on CUDA) and ``clip_grad_norm_`` on the DTensor parameters;
- saves model and optimizer with ``torch.distributed.checkpoint`` every ``--ckpt-every``
  steps and resumes from the newest one (on any mesh: DCP reshards).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import autopar
from autopar.models import GPT, GPTConfig, cross_entropy_loss


def synthetic_tokens(n: int, seq: int, vocab: int) -> TensorDataset:
    """``n`` sequences whose next token follows from the current one (learnable)."""
    g = torch.Generator().manual_seed(1234)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    tokens = (start + step * torch.arange(seq + 1)) % vocab
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def newest_checkpoint(root: Path) -> tuple[int, Path] | None:
    steps = [int(p.name.split("-")[1]) for p in root.glob("step-*") if (p / ".metadata").exists()]
    return (max(steps), root / f"step-{max(steps)}") if steps else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mesh", default="2x2", help="mesh shape, e.g. 2x2 or 4")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--ckpt-dir", type=Path, default=None)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument(
        "--memory-fraction",
        type=float,
        default=0.6,
        help="memory budget per rank, as a fraction of what one device holds for the step",
    )
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = "cuda" if cuda else "cpu"
    shape = tuple(int(s) for s in args.mesh.split("x"))
    names = ("dp", "tp")[: len(shape)]
    mesh = init_device_mesh(device, shape, mesh_dim_names=names)
    rank = dist.get_rank()

    cfg = GPTConfig(vocab=64, seq=32, hidden=64, heads=4, layers=2, ffn=256)
    with torch.device("meta"):
        model = GPT(cfg)
    tokens = torch.empty(args.batch, cfg.seq, dtype=torch.long, device="meta")
    torch.manual_seed(0)  # the same on every rank: every rank draws the same weights
    pm = autopar.compile(
        model,
        mesh,
        (tokens,),
        loss_fn=cross_entropy_loss,
        example_targets=(tokens,),
        memory_fraction=args.memory_fraction,
    )
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr, fused=cuda)

    start = 0
    found = newest_checkpoint(args.ckpt_dir) if args.ckpt_dir else None
    if found:
        start, path = found
        state = {"model": get_model_state_dict(pm), "optim": get_optimizer_state_dict(pm, opt)}
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(pm, state["model"])
        set_optimizer_state_dict(pm, opt, state["optim"])
        if rank == 0:
            print(f"resumed from {path}")

    # this rank's part of every global batch
    parts, part = pm.data_shard()
    data = synthetic_tokens(args.batch * 64, cfg.seq, cfg.vocab)
    sampler = DistributedSampler(data, num_replicas=parts, rank=part, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch // parts, sampler=sampler, drop_last=True)
    per_epoch = len(loader)

    step, loss = start, None
    while step < args.steps:
        sampler.set_epoch(step // per_epoch)
        for i, (x, y) in enumerate(loader):
            if i < step % per_epoch:  # resume mid-epoch: skip what was seen
                continue
            loss = pm(*pm.shard_inputs(x.to(device), y.to(device)))
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(pm.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            step += 1
            if rank == 0:
                norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
                print(f"step {step} loss {loss.item():.6f} grad_norm {norm.item():.4f}", flush=True)
            if args.ckpt_dir and step % args.ckpt_every == 0:
                state = {
                    "model": get_model_state_dict(pm),
                    "optim": get_optimizer_state_dict(pm, opt),
                }
                dcp.save(state, checkpoint_id=str(args.ckpt_dir / f"step-{step}"))
            if step >= args.steps:
                break
    if rank == 0 and loss is not None:
        print(f"done: {step} steps, loss {loss.item():.6f}, perplexity {math.exp(loss.item()):.2f}")
    # every rank past its last collective before the process group goes: on gloo, a worker
    # thread still letting go of the last one (DCP's broadcast) could otherwise need the GIL
    # after the interpreter has begun to shut down, which aborts the process
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

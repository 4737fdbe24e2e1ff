"""Long-context Llama-3-8B: does a plan split the sequence, does it fit, is it fastest?

    python benchmarks/long_context.py [--seqs 8192,32768,131072] [--meshes 8,8x8]
        [--device h100] [--memory-gib G] [--variants] [--check]

Llama-3-8B's shapes (``autopar.models.llama3_8b``, from the meta device), one sequence per
step (batch 1: no data parallelism to be had), bf16 mixed precision (float32 parameters and
AdamW state, bf16 compute, float32 gradient reductions), planned against the profile's
usable memory per rank (about 80 GB on an H100) unless ``--memory-gib``.

For each length and mesh it plans twice:
    autopar             the solver's free choice; "rows split over" names the mesh axes over
                        which attention's query rows are split (context parallelism), "-"
                        when none, and "variant" how those rows see every key: ``gather``
                        (keys and values all-gathered, passes/rules ``sequence``) or
                        ``ring`` (ring attention, passes/rules ``ring``); "split along the
                        sequence" says whether any activation is (context, Megatron or
                        Ulysses-style sequence parallelism);
    ring / gather       with ``--variants``: the solver's choice with the variant pinned
                        (``{"context": ...}``), each variant's best plan priced side by side;
    no sequence split   the best plan that splits no tensor along the sequence
                        (``{"sequence": "none"}``, passes/pins): data, tensor and parameter
                        sharding only; or "does not fit".

"est. step ms" is the plan's estimated step (cost model, the profile's curves), "peak GiB"
the predicted per-rank peak of the step (passes/memory), "ratio" the no-sequence-split plan's step over
autopar's (above 1: the sequence split pays). ``--check`` exits non-zero unless, at the
longest length on every mesh, autopar's plan fits, splits the sequence, and is faster than
the best plan without a sequence split (when one fits).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import warnings

import torch

import autopar
from autopar.models import hf_logits_loss, llama3_8b, lm_batch
from autopar.passes.solve import SolveError
from autopar.passes.trace import trace_step

from common import print_header


def _plan(seq: int, mesh: autopar.Mesh, budget, constraints=None):
    tokens, targets = lm_batch(128256, 1, seq, device="meta")
    t0 = time.perf_counter()
    try:
        plan = autopar.plan(
            llama3_8b(seq=seq),
            mesh,
            (tokens,),
            loss_fn=hf_logits_loss,
            example_targets=(targets,),
            mp_policy=autopar.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32),
            memory_budget=budget,
            constraints=constraints,
        )
    except SolveError:
        return None, time.perf_counter() - t0
    return plan, time.perf_counter() - t0


def _row_axes(plan, mesh: autopar.Mesh) -> str:
    """The mesh axes over which the plan splits attention's query rows."""
    outs = plan.nodes["sdpa"].out[0]
    axes = [mesh.axis_names[i] for i, p in enumerate(outs) if p == "S(2)"]
    return ",".join(axes) or "-"


def _variant(plan) -> str:
    """``ring`` or ``gather`` where attention's query rows are split, else "-"."""
    ins = plan.nodes["sdpa"].ins
    rows = [i for i, p in enumerate(ins[0]) if p == "S(2)"]
    if not rows:
        return "-"
    return "ring" if ins[1][rows[0]] == "S(2)" else "gather"


def _attention(plan) -> str:
    return "(" + ", ".join(plan.nodes["sdpa"].out[0]) + ")"


def _shapes(seq: int) -> dict[str, list]:
    """Each step node's output shapes (the graph every plan of this length places)."""
    tokens, targets = lm_batch(128256, 1, seq, device="meta")
    with contextlib.ExitStack() as stack:
        step = trace_step(
            llama3_8b(seq=seq),
            (tokens,),
            loss_fn=hf_logits_loss,
            example_targets=(targets,),
            stack=stack,
            mp_policy=autopar.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32),
        )
        out = {}
        for n in step.gm.graph.nodes:
            vals = n.meta.get("val")
            vals = vals if isinstance(vals, (tuple, list)) else [vals]
            out[n.name] = [tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in vals]
    return out


def _splits_sequence(plan, shapes: dict[str, list], seq: int) -> bool:
    """Some node's output is split along a dim of length ``seq``."""
    for name, choice in plan.nodes.items():
        for text, shape in zip(choice.out, shapes.get(name, ())):
            if text is None or shape is None:
                continue
            for p in text:
                if p.startswith("S(") and shape[int(p[2:-1])] == seq:
                    return True
    return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="8192,32768,131072")
    ap.add_argument("--meshes", default="8,8x8")
    ap.add_argument("--device", default="h100")
    ap.add_argument("--memory-gib", type=float, default=None)
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    budget = None if args.memory_gib is None else args.memory_gib * 2**30
    print_header(
        f"Llama-3-8B, batch 1, bf16 mixed precision, AdamW; profile {args.device}; budget "
        + ("the profile's usable memory" if budget is None else f"{args.memory_gib} GiB")
        + " per rank",
        [
            "tokens",
            "mesh",
            "plan",
            "attention",
            "rows split over",
            "variant",
            "split along the sequence",
            "fits",
            "est. step ms",
            "peak GiB",
            "plan s",
            "ratio (no split / autopar)",
        ],
    )
    warnings.simplefilter("ignore")
    seqs = [int(s) for s in args.seqs.split(",")]
    missed = []
    for seq in seqs:
        shapes = _shapes(seq)
        for text in args.meshes.split(","):
            shape = tuple(int(s) for s in text.split("x"))
            mesh = autopar.Mesh(shape, ("dp", "tp")[: len(shape)], device=args.device)
            mine, wall = _plan(seq, mesh, budget)
            base, base_wall = _plan(seq, mesh, budget, {"sequence": "none"})
            base_s = None if base is None else base.cost["total_s"]
            rows = [("autopar", mine, wall)]
            if args.variants:
                for v in ("ring", "gather"):
                    rows.append((v, *_plan(seq, mesh, budget, {"context": v})))
            rows.append(("no sequence split", base, base_wall))
            for label, plan, w in rows:
                if plan is None:
                    print(
                        f"| {seq} | {text} | {label} | - | - | - | - | does not fit | - | - "
                        f"| {w:.1f} | |"
                    )
                    continue
                ratio = ""
                if plan is mine:
                    ratio = f"{base_s / mine.cost['total_s']:.2f}" if base_s else "no other fits"
                print(
                    f"| {seq} | {text} | {label} | {_attention(plan)} | {_row_axes(plan, mesh)} "
                    f"| {_variant(plan)} "
                    f"| {'yes' if _splits_sequence(plan, shapes, seq) else 'no'} | yes "
                    f"| {plan.cost['total_s'] * 1e3:.0f} "
                    f"| {plan.memory['step']['peak_bytes'] / 2**30:.1f} | {w:.1f} | {ratio} |",
                    flush=True,
                )
            if seq == max(seqs):
                ok = (
                    mine is not None
                    and _splits_sequence(mine, shapes, seq)
                    and (base_s is None or mine.cost["total_s"] < base_s)
                )
                if not ok:
                    missed.append(text)
    if args.check and missed:
        print(f"\ntarget missed at {max(seqs)} tokens on meshes {', '.join(missed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

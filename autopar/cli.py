"""The autopar command: a thin layer over the Python API.

autopar plan MODEL --mesh 2x2 [--axes dp,tp] [--device h100] [--batch 8] [--out plan.json]
    MODEL is a built-in example (autopar.models.EXAMPLES) or path/to/file.py:factory,
    where factory(batch=...) returns (model, example_inputs, loss_fn, example_targets).
    Plans on the meta device (no weights) and prints the plan's table.

autopar demo [--mesh 2x2] [--steps 3] [--model gpt]
    Plans a small GPT, trains it a few steps on a local gloo mesh of 4 processes, and
    prints each step's loss beside the single-device model's loss.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch
from rich.console import Console

from . import api
from .core import Mesh, MixedPrecision, Plan, __version__
from .models import EXAMPLES
from .show import render
from .verify import build_example, log_stages, verify

__all__ = ["main", "plan_example"]


def _mesh_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"mesh must look like 8 or 2x4, got {text!r}") from None
    if not shape or any(s < 1 for s in shape):
        raise argparse.ArgumentTypeError(f"mesh sizes must be >= 1, got {text!r}")
    return shape


def _axes(shape, text: str | None) -> tuple[str, ...]:
    if text:
        names = tuple(text.split(","))
    else:
        names = ("dp",) if len(shape) == 1 else ("dp", "tp", "sp")[: len(shape)]
        if len(names) < len(shape):
            names = tuple(f"axis{i}" for i in range(len(shape)))
    if len(names) != len(shape):
        raise SystemExit(f"autopar: {len(shape)} mesh axes but {len(names)} names ({text})")
    return names


_PRECISIONS = {
    "model": None,
    "bf16-mixed": MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32),
}


def plan_example(
    name: str,
    mesh,
    *,
    batch: int = 8,
    memory_budget: float | None = None,
    memory_fraction: float | None = None,
    verbose: bool = False,
    fold: bool = True,
    mp_policy=None,
    checkpointing: bool = True,
):
    """Plan a zoo example (or ``file.py:factory``) on the meta device for ``mesh``.

    ``memory_fraction`` sets the memory budget to that fraction of what one device holds
    running the whole step.
    """
    model, inputs, loss_fn, targets = build_example(name, batch=batch)
    model = model.to("meta")
    inputs = tuple(t.to("meta") for t in inputs)
    targets = tuple(t.to("meta") for t in targets)
    with warnings.catch_warnings():
        warnings.simplefilter("default" if verbose else "ignore")
        return api.plan(
            model,
            mesh,
            inputs,
            loss_fn=loss_fn,
            example_targets=targets,
            memory_budget=memory_budget,
            memory_fraction=memory_fraction,
            fold=fold,
            mp_policy=mp_policy,
            checkpointing=checkpointing,
        )


def cmd_plan(args) -> int:
    log_stages()  # a line per pipeline stage as it ends: a long plan is not silent
    shape = args.mesh
    mesh = Mesh(shape, _axes(shape, args.axes), device=args.device)
    budget = None if args.memory_budget_mib is None else args.memory_budget_mib * 2**20
    plan = plan_example(
        args.model,
        mesh,
        batch=args.batch,
        memory_budget=budget,
        memory_fraction=args.memory_fraction,
        verbose=args.verbose,
        mp_policy=_PRECISIONS[args.precision],
        fold=not args.no_fold,
        checkpointing=not args.no_checkpointing,
    )
    print(plan.summary())
    if args.out:
        plan.save(args.out)
        print(f"\nplan written to {args.out}")
    return 0


def cmd_demo(args) -> int:
    shape = args.mesh
    names = _axes(shape, args.axes)
    print(
        f"autopar demo: planning '{args.model}' for mesh {'x'.join(map(str, shape))} "
        f"{names} and training {args.steps} AdamW steps on local gloo processes "
        f"({args.dtype}); memory budget per rank {args.memory_fraction:.0%} of what one device "
        "holds for the step",
        flush=True,
    )
    reports = verify(
        args.model,
        shape,
        names,
        steps=args.steps,
        dtype=args.dtype,
        memory_fraction=args.memory_fraction,
        progress=True,
    )
    r = reports[0]
    plan = Plan.from_json(r.plan_json)
    print(plan.summary())
    print()
    print(f"{'step':>4}  {'autopar loss':>20}  {'single-device loss':>20}  {'rel diff':>9}")
    worst = 0.0
    for i, (a, b) in enumerate(zip(r.losses, r.ref_losses)):
        rel = abs(a - b) / max(abs(b), 1e-30)
        worst = max(worst, rel)
        print(f"{i:>4}  {a:>20.12f}  {b:>20.12f}  {rel:>9.1e}")
    print(f"\nmax relative gradient error (step 0): {r.grad_rel_err:.1e}")
    print(f"max relative parameter error after {args.steps} steps: {r.param_rel_err:.1e}")
    print(f"collectives per step, planned: {r.predicted}")
    print(f"collectives per step, compiled: {r.ran}")
    tol = 1e-8 if args.dtype == "float64" else 1e-4
    ok = worst <= tol and r.param_rel_err <= tol
    print(
        "OK: matches the single-device model" if ok else "MISMATCH against the single-device model"
    )
    return 0 if ok else 1


def cmd_show(args) -> int:
    render(Plan.load(args.plan), Console(width=args.width, highlight=False))
    return 0


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="autopar",
        description="Plan a PyTorch training step over a device mesh, and run it.",
    )
    p.add_argument("--version", action="version", version=f"autopar {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    pp = sub.add_parser("plan", help="plan a model for a mesh and print the plan")
    pp.add_argument(
        "model",
        help=f"a built-in example ({', '.join(EXAMPLES)}) or path/to/file.py:factory, "
        "factory(batch=...) returning (model, example_inputs, loss_fn, example_targets)",
    )
    pp.add_argument("--mesh", type=_mesh_shape, default=(2, 2), help="e.g. 8, 2x4 (default 2x2)")
    pp.add_argument("--axes", default=None, help="axis names, e.g. dp,tp")
    pp.add_argument("--device", default="h100", help="device profile (default h100)")
    pp.add_argument("--batch", type=int, default=8, help="global batch size (default 8)")
    pp.add_argument(
        "--memory-budget-mib",
        type=_positive,
        default=None,
        help="the most MiB one rank may hold at any point of the step (default: the "
        "device profile's usable memory)",
    )
    pp.add_argument(
        "--memory-fraction",
        type=_positive,
        default=None,
        help="instead, a fraction of what one device holds running the whole step",
    )
    pp.add_argument(
        "--precision",
        choices=sorted(_PRECISIONS),
        default="model",
        help="model: the model's own dtype; bf16-mixed: float32 parameters and AdamW state, "
        "bf16 compute, gradients reduced in float32",
    )
    pp.add_argument(
        "--no-fold", action="store_true", help="plan every layer on its own (no folding)"
    )
    pp.add_argument(
        "--no-checkpointing",
        action="store_true",
        help="keep every activation (by default, where the budget binds, the plan may "
        "recompute layers' activations in the backward)",
    )
    pp.add_argument("--out", default=None, help="write the plan's JSON here")
    pp.add_argument("-v", "--verbose", action="store_true", help="show warnings")
    pp.set_defaults(fn=cmd_plan)

    ps = sub.add_parser("show", help="print a saved plan as tables")
    ps.add_argument("plan", help="a plan's JSON (autopar plan --out, Plan.save)")
    ps.add_argument("--width", type=int, default=None, help="columns (default: the terminal's)")
    ps.set_defaults(fn=cmd_show)

    pd = sub.add_parser("demo", help="plan a small GPT and train it on local gloo processes")
    pd.add_argument("--model", default="gpt", help="a built-in example (default gpt)")
    pd.add_argument(
        "--mesh", type=_mesh_shape, default=(2, 2), help="e.g. 2, 2x2 (default 2x2): 4 processes"
    )
    pd.add_argument("--axes", default=None, help="axis names, e.g. dp,tp")
    pd.add_argument("--steps", type=int, default=3, help="AdamW steps (default 3)")
    pd.add_argument(
        "--dtype",
        default="float64",
        choices=["float64", "float32"],
        help="dtype of the model and the batch (default float64: tight comparison)",
    )
    pd.add_argument(
        "--memory-fraction",
        type=_positive,
        default=0.5,
        help="memory budget per rank, as a fraction of what one device holds for the step",
    )
    pd.set_defaults(fn=cmd_demo)

    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, TypeError, KeyError, OSError, RuntimeError, ImportError) as e:
        if getattr(args, "verbose", False):
            raise
        print(f"autopar {args.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The autopar command: a thin layer over the Python API.

autopar plan MODEL --mesh 2x2 [--axes dp,tp] [--device h100] [--batch 8] [--out plan.json]
    MODEL is a built-in example (autopar.models.EXAMPLES) or path/to/file.py:factory,
    where factory(batch=...) returns (model, example_inputs, loss_fn, example_targets).
    Plans on the meta device (no weights) and prints the plan's table.
autopar show plan.json             a saved plan as tables (autopar/show.py)
autopar diff a.json b.json         what two plans chose differently (autopar/diff.py)
autopar explain plan.json TARGET   why a choice: the best plan without it (autopar/explain.py)
autopar report plan.json -o r.html one self-contained HTML report (autopar/report.py)
autopar verify MODEL --mesh 2x2    the parallel step beside one device, on local gloo ranks
autopar run script.py --nproc N    a training script on N local processes (torch's launcher)
autopar demo                       plan a small GPT, train it 3 steps on 4 gloo processes
autopar calibrate -o profile.json  measure this machine into a device profile (autopar/calibrate.py);
                                   plan and explain take it with --profile profile.json

Every command takes ``--quiet`` (only errors, on stderr; the exit status says the rest) and
``--json`` (one JSON document on stdout, nothing else there). Bad input is one line on
stderr and exit status 2; a mismatch or a failed run is exit status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import operator
import os
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from . import api
from .core import Mesh, MixedPrecision, Plan, __version__
from .diff import diff_plans, render_diff
from .explain import explain, explain_all, render_all, render_explained, source_of
from .models import EXAMPLES
from .show import render, tables
from .verify import build_example, log_stages, stage_progress, verify

__all__ = ["launch", "main", "plan_example"]


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


_RANDOM = re.compile(r"dropout|bernoulli|rand|normal|uniform|multinomial")

_PRECISIONS = {
    "model": None,
    "bf16-mixed": MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32),
}


def plan_example(
    name: str,
    mesh,
    *,
    batch: int = 8,
    verbose: bool = False,
    mp_policy=None,
    cache: bool = False,
    fingerprint: str | None = None,
    **knobs,
):
    """Plan a zoo example (or ``file.py:factory``) on the meta device for ``mesh``;
    ``knobs``: the planning options, as ``autopar.plan`` takes them (passes/options)."""
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
            mp_policy=mp_policy,
            cache=cache,
            fingerprint=fingerprint,
            **knobs,
        )


class Output:
    """Where a command's words go: the terminal (rich), nothing (``--quiet``), or one JSON
    document on stdout (``--json``)."""

    def __init__(self, args):
        self.quiet = bool(getattr(args, "quiet", False))
        self.as_json = bool(getattr(args, "json", False))
        width = getattr(args, "width", None)
        self.console = Console(width=width, highlight=False, soft_wrap=width is None)

    @property
    def text(self) -> bool:
        """Human-readable output is wanted."""
        return not (self.quiet or self.as_json)

    def print(self, *objects) -> None:
        if self.text:
            self.console.print(*objects)

    def json(self, obj) -> None:
        if self.as_json and not self.quiet:
            sys.stdout.write(json.dumps(obj, indent=1, default=str) + "\n")


def _device(args) -> str:
    """The profile name to plan with: ``--profile PATH`` loaded (and registered), else
    ``--device``."""
    if getattr(args, "profile", None):
        return api.load_profile(args.profile).name
    return args.device


def cmd_plan(args) -> int:
    out = Output(args)
    shape = args.mesh
    mesh = Mesh(shape, _axes(shape, args.axes), device=_device(args))
    knobs = _plan_knobs(args)
    with stage_progress(out.text):  # a long plan is not silent
        plan = plan_example(
            args.model,
            mesh,
            batch=args.batch,
            verbose=args.verbose,
            mp_policy=_PRECISIONS[args.precision],
            cache=not args.no_cache,
            **knobs,
        )
    # how to rebuild the step (autopar explain)
    source = {"model": args.model, "batch": args.batch, "precision": args.precision, **knobs}
    plan = dataclasses.replace(plan, stats={**plan.stats, "source": source}, source=source)
    if args.out:
        plan.save(args.out, timings=True)
    if out.as_json:
        out.json(plan.to_dict(timings=True))
        return 0
    if out.text:
        print(plan.summary())
        if args.out:
            print(f"\nplan written to {args.out}")
    return 0


def _load(path: str) -> Plan:
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such file")
    return Plan.load(path)


def cmd_show(args) -> int:
    out = Output(args)
    plan = _load(args.plan)
    out.json(tables(plan))
    if out.text:
        render(plan, out.console)
    return 0


def cmd_diff(args) -> int:
    out = Output(args)
    d = diff_plans(_load(args.a), _load(args.b))
    out.json(d)
    if out.text:
        render_diff(d, out.console, (args.a, args.b))
    return 0 if d["identical"] or not args.exit_code else 1


def _replanner(plan: Plan, args):
    """``replan(forbid=...)``: ``plan``'s step planned again (autopar explain)."""
    source = source_of(plan, args.model, args.batch)

    def replan(forbid) -> Plan:
        return plan_example(
            source["model"],
            plan.mesh,
            batch=source["batch"],
            mp_policy=_PRECISIONS[source.get("precision", "model")],
            forbid=forbid,
            cache=not args.no_cache,
            fingerprint=plan.fingerprint,
            **{f.knob: source[f.knob] for f in PLAN_FLAGS if f.knob in source},
        )

    return replan


def _explained(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "alternative_plan"}


def cmd_explain(args) -> int:
    out = Output(args)
    log_stages(False)
    if args.profile:
        api.load_profile(args.profile)
    plan = _load(args.plan)
    replan = _replanner(plan, args)
    if args.all:

        def progress(text: str) -> None:
            if out.text:
                print(f"  planning without the choice of {text}", file=sys.stderr, flush=True)

        results = explain_all(plan, replan, top=args.top, progress=progress)
        out.json([_explained(r) for r in results])
        if out.text:
            render_all(results, plan, out.console)
        return 0
    if args.target is None:
        raise ValueError("give a TARGET (a parameter, a module path or a node), or --all")
    r = explain(plan, args.target, replan)
    out.json(_explained(r))
    if out.text:
        render_explained(r, plan, out.console)
    return 0


def cmd_report(args) -> int:
    out = Output(args)
    plan = _load(args.plan)
    from .report import write_report  # the report's drawing is not needed elsewhere

    write_report(plan, args.output, trace=args.trace)
    out.json({"report": args.output, "trace": args.trace})
    out.print(
        f"report written to {args.output}" + (f", trace to {args.trace}" if args.trace else "")
    )
    return 0


def _verify_and_print(args, out: Output) -> int:
    """Run ``verify`` for ``args`` and print the step-by-step comparison; 0 if it matches."""
    shape = args.mesh
    names = _axes(shape, args.axes)
    plan_json = None
    if getattr(args, "plan", None):
        plan_json = _load(args.plan).to_json(timings=True)
    reports = verify(
        args.model,
        shape,
        names,
        steps=args.steps,
        dtype=args.dtype,
        batch=args.batch,
        memory_fraction=args.memory_fraction,
        plan_json=plan_json,
        progress=out.text,
    )
    r = reports[0]
    plan = Plan.from_json(r.plan_json)
    tol = 1e-8 if args.dtype == "float64" else 1e-4
    steps = []
    for a, b in zip(r.losses, r.ref_losses):
        steps.append({"loss": a, "single_device_loss": b, "rel": abs(a - b) / max(abs(b), 1e-30)})
    worst = max((s["rel"] for s in steps), default=0.0)
    ok = (
        worst <= tol
        and r.grad_rel_err <= tol
        and r.param_rel_err <= tol
        and all(x.losses == r.losses for x in reports)
    )
    out.json(
        {
            "model": args.model,
            "mesh": list(shape),
            "axes": list(names),
            "dtype": args.dtype,
            "tolerance": tol,
            "steps": steps,
            "grad_rel_err": r.grad_rel_err,
            "worst_grad": r.worst_grad,
            "param_rel_err": r.param_rel_err,
            "worst_param": r.worst_param,
            "collectives_planned": {f"{k}@{a}": n for (k, a), n in r.predicted.items()},
            "collectives_ran": {f"{k}@{a}": n for (k, a), n in r.ran.items()},
            "ok": ok,
        }
    )
    if not out.text:
        return 0 if ok else 1
    print(plan.summary())
    print()
    print(f"{'step':>4}  {'autopar loss':>20}  {'single-device loss':>20}  {'rel diff':>9}")
    for i, s in enumerate(steps):
        print(f"{i:>4}  {s['loss']:>20.12f}  {s['single_device_loss']:>20.12f}  {s['rel']:>9.1e}")
    worst_grad = f" ({r.worst_grad})" if r.worst_grad else ""
    worst_param = f" ({r.worst_param})" if r.worst_param else ""
    print(f"\nmax relative gradient error (step 0): {r.grad_rel_err:.1e}{worst_grad}")
    print(
        f"max relative parameter error after {args.steps} steps: {r.param_rel_err:.1e}{worst_param}"
    )
    print(f"collectives per step, planned: {r.predicted}")
    print(f"collectives per step, ran: {r.ran}")
    print(
        f"OK: matches the single-device model (tolerance {tol:.0e})"
        if ok
        else f"MISMATCH against the single-device model (tolerance {tol:.0e})"
    )
    random_ops = sorted(
        {c.op for c in plan.nodes.values() if _RANDOM.search(c.op) and "backward" not in c.op}
    )
    if not ok and random_ops:
        print(
            f"note: the step draws random numbers ({', '.join(random_ops)}): sharded, it "
            "draws other ones than one device does; verify with dropout off (p=0)"
        )
    return 0 if ok else 1


def cmd_verify(args) -> int:
    return _verify_and_print(args, Output(args))


def cmd_demo(args) -> int:
    out = Output(args)
    if out.text:
        shape = args.mesh
        print(
            f"autopar demo: planning '{args.model}' for mesh {'x'.join(map(str, shape))} "
            f"{_axes(shape, args.axes)} and training {args.steps} AdamW steps on local gloo "
            f"processes ({args.dtype}); memory budget per rank {args.memory_fraction:.0%} of "
            "what one device holds for the step",
            flush=True,
        )
    return _verify_and_print(args, out)


def cmd_run(args) -> int:
    # ``autopar run script.py --nproc 4 -- --lr 1e-3``: run's own options may follow the
    # script; the script's arguments follow ``--`` (or are any other words after it)
    rest = list(args.script_args)
    split = rest.index("--") if "--" in rest else len(rest)
    mine, script_args = rest[:split], rest[split + 1 :]
    kept = []
    while mine:
        word = mine.pop(0)
        if word == "--nproc" and mine:
            args.nproc = _count(mine.pop(0))
        elif word.startswith("--nproc="):
            args.nproc = _count(word.split("=", 1)[1])
        elif word in ("-q", "--quiet"):
            args.quiet = True
        elif word == "--json":
            args.json = True
        else:
            kept.append(word)
    out = Output(args)
    code = launch(args.script, args.nproc, kept + script_args, quiet=not out.text)
    out.json({"script": args.script, "nproc": args.nproc, "exit_code": code})
    return code


def launch(script: str, nproc: int, script_args=(), *, quiet: bool = False) -> int:
    """Run ``script`` on ``nproc`` local processes with torch's elastic launcher (what
    ``torchrun --standalone --nproc-per-node N`` does: a rendezvous on a free local port,
    ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set for each process); the exit
    status is 0 when every process succeeds, else the first failure's (after one line on
    stderr naming the rank)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as elastic_run

    if not Path(script).is_file():
        raise FileNotFoundError(f"{script}: no such file")
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    # the launcher sets 1 thread per process (with a warning) unless told: share the cores
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if quiet:  # the launcher logs a failure itself; the line below says it
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    targs = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={nproc}", script])
    # set after parsing: the launcher's parser would take the script's options for its own
    targs.training_script_args = list(script_args)
    try:
        elastic_run(targs)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(
            f"autopar run: rank {rank} of {nproc} failed with exit code {failure.exitcode} "
            "(its output is above)",
            file=sys.stderr,
        )
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


def cmd_calibrate(args) -> int:
    out = Output(args)
    from .calibrate import calibrate  # measuring is this command's alone

    def log(line: str) -> None:
        if out.text:
            print(f"  {line}", file=sys.stderr, flush=True)

    profile, measured = calibrate(
        base=args.base, name=args.name, nproc=args.nproc, quick=args.quick, log=log
    )
    Path(args.output).write_text(profile.to_json())
    out.json({"profile": json.loads(profile.to_json()), "measured": measured})
    if out.text:
        print(f"profile {profile.name!r} written to {args.output}")
        print(f"plan with it: autopar plan MODEL --profile {args.output}")
    return 0


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"--nproc must be a whole number, got {text!r}") from None
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


@dataclass(frozen=True)
class Flag:
    """One planning flag of ``autopar plan``: the argparse arguments that make it and the
    planning option it sets (passes/options ``PlanOptions.of``'s keyword ``knob``, from the
    parsed value by ``value``). A saved plan records the options its flags set
    (``plan.source``), and ``autopar explain`` plans its alternatives with them."""

    names: tuple[str, ...]
    knob: str
    value: Callable[[Any], Any]
    argparse: dict


def _mib(v: float | None) -> float | None:
    return None if v is None else v * 2**20


PLAN_FLAGS = (
    Flag(("--no-fold",), "fold", operator.not_, dict(
        action="store_true", help="plan every layer on its own (no folding)",
    )),
    Flag(("--no-checkpointing",), "checkpointing", operator.not_, dict(
        action="store_true",
        help="keep every activation (by default, where the budget binds, the plan may "
        "recompute layers' activations in the backward)",
    )),
    Flag(("--memory-budget-mib",), "memory_budget", _mib, dict(
        type=_positive, default=None,
        help="the most MiB one rank may hold at any point of the step (default: the "
        "device profile's usable memory)",
    )),
    Flag(("--memory-fraction",), "memory_fraction", lambda v: v, dict(
        type=_positive, default=None,
        help="instead, a fraction of what one device holds running the whole step",
    )),
)  # fmt: skip
"""The planning options ``autopar plan`` takes as flags: a new option is one entry here."""


def _dest(flag: Flag) -> str:
    return flag.names[0].lstrip("-").replace("-", "_")


def _plan_knobs(args) -> dict:
    """The planning options the parsed flags of ``PLAN_FLAGS`` set."""
    return {f.knob: f.value(getattr(args, _dest(f))) for f in PLAN_FLAGS}


def _model_args(p, *, default_mesh=(2, 2)) -> None:
    p.add_argument(
        "--mesh", type=_mesh_shape, default=default_mesh,
        help="mesh shape, e.g. 8, 2x4 (default " + "x".join(map(str, default_mesh)) + ")",
    )  # fmt: skip
    p.add_argument("--axes", default=None, help="axis names, e.g. dp,tp (default dp,tp,...)")
    p.add_argument("--batch", type=int, default=8, help="global batch size (default 8)")


def _run_args(p, *, steps: int) -> None:
    p.add_argument("--steps", type=int, default=steps, help=f"AdamW steps (default {steps})")
    p.add_argument(
        "--dtype",
        default="float64",
        choices=["float64", "float32"],
        help="dtype of the model and the batch (default float64: tight comparison; "
        "tolerance 1e-8, float32 1e-4)",
    )


def _plan_parser(sub, common) -> None:
    """``autopar plan``: the model, the mesh, the device, the planning options (``PLAN_FLAGS``)."""
    pp = sub.add_parser("plan", parents=[common], help="plan a model for a mesh; print the plan")
    pp.add_argument(
        "model",
        help=f"a built-in example ({', '.join(EXAMPLES)}) or path/to/file.py:factory, "
        "factory(batch=...) returning (model, example_inputs, loss_fn, example_targets)",
    )
    _model_args(pp)
    pp.add_argument("--device", default="h100", help="device profile (default h100)")
    pp.add_argument(
        "--profile",
        default=None,
        help="a device profile's JSON (autopar calibrate) to plan with, instead of --device",
    )
    pp.add_argument(
        "--precision",
        choices=sorted(_PRECISIONS),
        default="model",
        help="model: the model's own dtype; bf16-mixed: float32 parameters and AdamW state, "
        "bf16 compute, gradients reduced in float32",
    )
    for flag in PLAN_FLAGS:
        pp.add_argument(*flag.names, **flag.argparse)
    pp.add_argument(
        "--no-cache",
        action="store_true",
        help="plan even if the plan cache holds this plan (it is kept in $AUTOPAR_CACHE_DIR, "
        "else ~/.cache/autopar)",
    )
    pp.add_argument("--out", default=None, help="write the plan's JSON here")
    pp.add_argument("-v", "--verbose", action="store_true", help="show warnings")
    pp.set_defaults(fn=cmd_plan)


def _show_parser(sub, common) -> None:
    """``autopar show``."""
    ps = sub.add_parser("show", parents=[common], help="print a saved plan as tables")
    ps.add_argument("plan", help="a plan's JSON (autopar plan --out, Plan.save)")
    ps.add_argument("--width", type=int, default=None, help="columns (default: the terminal's)")
    ps.set_defaults(fn=cmd_show)


def _diff_parser(sub, common) -> None:
    """``autopar diff``."""
    pf = sub.add_parser(
        "diff", parents=[common], help="what two saved plans chose differently, and its cost"
    )
    pf.add_argument("a", help="a plan's JSON")
    pf.add_argument("b", help="another plan's JSON")
    pf.add_argument("--width", type=int, default=None, help="columns (default: the terminal's)")
    pf.add_argument(
        "--exit-code",
        action="store_true",
        help="exit with status 1 when the plans differ (as diff does)",
    )
    pf.set_defaults(fn=cmd_diff)


def _explain_parser(sub, common) -> None:
    """``autopar explain``."""
    pe = sub.add_parser(
        "explain",
        parents=[common],
        help="why the plan chose a placement: the best plan without it, and what binds",
    )
    pe.add_argument("plan", help="a plan's JSON (made by autopar plan)")
    pe.add_argument(
        "target",
        nargs="?",
        default=None,
        help="a parameter (blocks.0.attn.q.weight), a module path (blocks.0.attn) or a node",
    )
    pe.add_argument(
        "--all",
        action="store_true",
        help="every parameter group, the choices whose alternative costs least more first",
    )
    pe.add_argument("--top", type=int, default=10, help="with --all: how many (default 10)")
    pe.add_argument(
        "--model", default=None, help="the model the plan was made for (default: as recorded)"
    )
    pe.add_argument("--batch", type=int, default=None, help="its batch (default: as recorded)")
    pe.add_argument("--no-cache", action="store_true", help="plan the alternatives even if cached")
    pe.add_argument(
        "--profile", default=None, help="the device profile's JSON the plan was made with"
    )
    pe.add_argument("--width", type=int, default=None, help="columns (default: the terminal's)")
    pe.set_defaults(fn=cmd_explain)


def _report_parser(sub, common) -> None:
    """``autopar report``."""
    pr = sub.add_parser(
        "report", parents=[common], help="write a saved plan as one self-contained HTML report"
    )
    pr.add_argument("plan", help="a plan's JSON")
    pr.add_argument("-o", "--output", default="report.html", help="(default report.html)")
    pr.add_argument(
        "--trace",
        default=None,
        help="also write the simulated step as Chrome trace events (Perfetto, chrome://tracing)",
    )
    pr.set_defaults(fn=cmd_report)


def _verify_parser(sub, common) -> None:
    """``autopar verify``."""
    pv = sub.add_parser(
        "verify",
        parents=[common],
        help="run the parallel step beside the single-device model on local gloo processes",
    )
    pv.add_argument("model", help="a built-in example or path/to/file.py:factory (as for plan)")
    _model_args(pv)
    _run_args(pv, steps=1)
    pv.add_argument(
        "--memory-fraction",
        type=_positive,
        default=None,
        help="plan under a memory budget per rank: this fraction of what one device holds",
    )
    pv.add_argument(
        "--plan",
        default=None,
        help="run this saved plan instead of planning (it must be for this model, batch, "
        "dtype and mesh)",
    )
    pv.set_defaults(fn=cmd_verify)


def _run_parser(sub, common) -> None:
    """``autopar run``."""
    pn = sub.add_parser(
        "run",
        parents=[common],
        help="run a training script on N local processes (torch's elastic launcher)",
    )
    pn.add_argument("--nproc", type=_count, default=2, help="processes (default 2)")
    pn.add_argument("script", help="a Python script (it calls init_process_group itself)")
    pn.add_argument(
        "script_args",
        nargs=argparse.REMAINDER,
        help="the script's arguments (after --, or any words that are not run's options)",
    )
    pn.set_defaults(fn=cmd_run)


def _demo_parser(sub, common) -> None:
    """``autopar demo``."""
    pd = sub.add_parser(
        "demo",
        parents=[common],
        help="plan a small GPT and train it on local gloo processes, beside one device",
    )
    pd.add_argument("--model", default="gpt", help="a built-in example (default gpt)")
    _model_args(pd)
    _run_args(pd, steps=3)
    pd.add_argument(
        "--memory-fraction",
        type=_positive,
        default=0.5,
        help="memory budget per rank, as a fraction of what one device holds for the step "
        "(default 0.5)",
    )
    pd.set_defaults(fn=cmd_demo)


def _calibrate_parser(sub, common) -> None:
    """``autopar calibrate``."""
    pc = sub.add_parser(
        "calibrate",
        parents=[common],
        help="measure this machine's kernels and links into a device profile (JSON)",
    )
    pc.add_argument("-o", "--output", default="profile.json", help="(default profile.json)")
    pc.add_argument(
        "--base",
        default=None,
        help="the profile whose inter-node link and memory reserve it keeps (default: h100 "
        "on CUDA, cpu otherwise)",
    )
    pc.add_argument("--name", default=None, help="the profile's name (default: device-host)")
    pc.add_argument(
        "--nproc",
        type=_count,
        default=None,
        help="local processes for the collectives (default 2; on CUDA, 2 or the one GPU); "
        "1 measures no link and keeps the base profile's",
    )
    pc.add_argument("--quick", action="store_true", help="few small sizes (seconds, rough)")
    pc.set_defaults(fn=cmd_calibrate)


_PARSERS = (
    _plan_parser, _show_parser, _diff_parser, _explain_parser, _report_parser, _verify_parser,
    _run_parser, _demo_parser, _calibrate_parser,
)  # fmt: skip
"""Each command's parser, in the order ``autopar --help`` lists them."""


def parser() -> argparse.ArgumentParser:
    """The ``autopar`` command's parser: every command's (``_PARSERS``), each with the
    common ``--quiet`` / ``--json``."""
    common = argparse.ArgumentParser(add_help=False)
    quiet = common.add_mutually_exclusive_group()
    quiet.add_argument(
        "-q", "--quiet", action="store_true", help="print nothing but errors (exit status tells)"
    )
    quiet.add_argument(
        "--json", action="store_true", help="print one JSON document on stdout, nothing else"
    )
    p = argparse.ArgumentParser(
        prog="autopar",
        description="Plan a PyTorch training step over a device mesh, inspect the plan, and "
        "run it. Each command has --help.",
    )
    p.add_argument("--version", action="version", version=f"autopar {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for add in _PARSERS:
        add(sub, common)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, TypeError, KeyError, OSError, RuntimeError, ImportError) as e:
        if getattr(args, "verbose", False):
            raise
        print(f"autopar {args.cmd}: {_one_line(e)}", file=sys.stderr)
        return 2


def _one_line(e: BaseException) -> str:
    """An error as one line: a rank's failure (runtime/launch: a header, then the rank's
    traceback) keeps the header and the traceback's last line."""
    text = str(e).strip() or type(e).__name__
    if isinstance(e, KeyError) and text.startswith(("'", '"')):
        text = text[1:-1]
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if len(lines) <= 1:
        return text
    return f"{lines[0].rstrip(':')}: {lines[-1].strip()}"


if __name__ == "__main__":
    sys.exit(main())

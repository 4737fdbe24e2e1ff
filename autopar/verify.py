"""Run the parallel step beside the single-device model and compare.

``verify_rank`` is what each process of a local mesh runs (``runtime.run_local``): it builds
the same model on every rank (same seed), compiles it with autopar on the mesh, and steps
both the parallel module and an untouched copy of the model with AdamW, returning the
losses, the largest relative gradient error and the largest relative parameter error.
``verify`` launches it and returns rank 0's report.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
import math
import sys
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

# NOTE: torch documents TorchDispatchMode under this private module and has no public alias
# (tests/unit/test_torch_internals.py)
from torch.utils._python_dispatch import TorchDispatchMode

from . import api
from .core import Mesh, Plan
from .models import EXAMPLES
from .passes.codegen import collective_kind, group_axes
from .passes.strategies import NoRuleWarning
from .runtime import run_local

__all__ = [
    "CollectiveBytes",
    "VerifyReport",
    "build_example",
    "log_stages",
    "stage_progress",
    "resolve_example",
    "verify",
    "verify_rank",
]


@dataclass
class VerifyReport:
    """What one rank saw.

    Attributes:
        losses / ref_losses: the parallel and single-device loss of each step.
        grad_rel_err: max over parameters of ||g_par - g_ref|| / ||g_ref|| (first step;
            see ``_rel_errors`` for the floor under ||g_ref||).
        param_rel_err: the same for the parameters after the optimizer steps.
        predicted / ran: collective counts the plan predicts and that the compiled step ran,
            counted as its first step ran (``CollectiveBytes``: what the partitioned forward
            and backward run, not only what the local graph holds).
        predicted_bytes / ran_bytes: the bytes of those collectives, by kind and axis, as
            the plan prices them and as counted while the first step ran
            (``CollectiveBytes``).
        mismatches: ops that ran with another placement than planned.
        local_params / model_params: how many parameters the parallel module and the model
            hold (a tied weight is one parameter in both).
    """

    losses: list[float]
    ref_losses: list[float]
    grad_rel_err: float
    param_rel_err: float
    worst_grad: str = ""
    worst_param: str = ""
    predicted: dict = field(default_factory=dict)
    ran: dict = field(default_factory=dict)
    predicted_bytes: dict = field(default_factory=dict)
    ran_bytes: dict = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    local_params: int = 0
    model_params: int = 0
    plan_json: str = ""


def resolve_example(name: str):
    """A factory by built-in name (``autopar.models.EXAMPLES``) or ``path/to/file.py:fn``."""
    if name in EXAMPLES:
        return EXAMPLES[name]
    if ":" in name:
        path, fn = name.rsplit(":", 1)
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path}: no such file (MODEL is path/to/file.py:factory)")
        spec = importlib.util.spec_from_file_location("autopar_user_model", path)
        if spec is None or spec.loader is None:
            raise FileNotFoundError(f"cannot load {path} as a Python module")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        factory = getattr(mod, fn, None)
        if not callable(factory):
            functions = sorted(
                n for n, v in vars(mod).items() if callable(v) and not n.startswith("_")
            )
            raise ValueError(f"{path} has no function {fn!r}; its functions: {functions}")
        return factory
    raise KeyError(
        f"unknown model {name!r}: built-in names are {sorted(EXAMPLES)}, or give file.py:factory"
    )


def build_example(name: str, **kwargs):
    """``(model, example_inputs, loss_fn, example_targets)`` from the factory of ``name``
    (``resolve_example``), checked, with a clear error for what is missing."""
    try:
        built = resolve_example(name)(**kwargs)
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f"example {name!r} needs the {e.name!r} package: pip install 'autopar[hf]'"
            if e.name == "transformers"
            else f"example {name!r} needs the {e.name!r} package, which is not installed"
        ) from e
    if not isinstance(built, tuple) or len(built) != 4:
        got = f"{len(built)} values" if isinstance(built, tuple) else type(built).__name__
        raise ValueError(
            f"the factory of {name!r} returned {got}; it must return "
            "(model, example_inputs, loss_fn, example_targets)"
        )
    return built


def _rel_errors(got: dict, want: dict) -> tuple[float, str]:
    """Largest ||got - want|| / max(||want||, 1e-3 * the largest ||want||) over the tensors.

    The floor keeps tensors that are zero in exact arithmetic (the gradient of a key bias,
    to which softmax is invariant) from turning rounding noise into a huge relative error.
    """
    scale = max((w.norm().item() for w in want.values()), default=0.0)
    worst, name = 0.0, ""
    for k, w in want.items():
        denom = max(w.norm().item(), 1e-3 * scale, 1e-300)
        err = (got[k] - w).norm().item() / denom
        if err > worst:
            worst, name = err, k
    return worst, name


def _cast(t, dtype):
    return t.to(dtype) if t.is_floating_point() else t


class LiveStorages(TorchDispatchMode):
    """The peak bytes of storages alive while ops run, as a memory probe on any device.

    Every tensor an op returns is seen (a ``TorchDispatchMode``); a storage counts as live
    while any tensor on it is alive (weak references). ``add`` what exists before (the
    parameters, the optimizer state, the batch): it is held for the probe's life, because
    the tensor handed in may be a fresh view (``DTensor.to_local()``) that would die at
    once while its storage lives on. ``peak`` is the most seen at once. Wrapper subclasses
    (DTensor) have no storage of their own: their local tensors are counted."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, list] = {}
        self.sizes: dict[int, int] = {}
        self.held: list[torch.Tensor] = []
        self.peak = 0

    def add(self, t) -> None:
        """Count ``t``'s storage from now on, for as long as the probe lives."""
        if isinstance(t, torch.Tensor):
            self.held.append(t)
        self._see(t)

    def _see(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.is_meta:
            return
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
        except RuntimeError:  # a wrapper subclass (DTensor): its local tensor is counted
            return
        if ptr:
            self.sizes[ptr] = storage.nbytes()
            self.refs.setdefault(ptr, []).append(weakref.ref(t))

    def live(self) -> int:
        return sum(self.sizes[p] for p, rs in self.refs.items() if any(r() is not None for r in rs))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else [out]:
            self._see(o)
        self.peak = max(self.peak, self.live())
        return out


class CollectiveBytes(TorchDispatchMode):
    """The functional collectives a step runs, counted as they run: ``bytes`` and
    ``counts`` by ``(kind, mesh axis name)``, each collective's bytes as the cost model
    counts them (``Plan.collective_bytes``: the gathered output of an all-gather, the input
    of the others), so the two compare directly."""

    def __init__(self, dmesh):
        super().__init__()
        self.axes = group_axes(dmesh)
        self.bytes: dict[tuple[str, str], int] = {}
        self.counts: dict[tuple[str, str], int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = collective_kind(func)
        if kind is not None:
            group = kwargs.get("group_name", args[-1])
            key = (kind, self.axes.get(group, str(group)))
            nbytes = (out if kind == "all_gather" else args[0]).nbytes
            self.bytes[key] = self.bytes.get(key, 0) + nbytes
            self.counts[key] = self.counts.get(key, 0) + 1
        return out


class _Stderr(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is when a record comes (not when made); a stage's
    start (passes/pipeline) is left to ``stage_progress``'s live line."""

    def emit(self, record):
        if getattr(record, "stage_start", None):
            return
        self.stream = sys.stderr
        super().emit(record)


class _ProgressHandler(logging.Handler):
    """Shows the ``autopar`` logger's records on a rich ``Progress``: a stage's start and
    the solver's rounds on its live line, every other record printed above it."""

    def __init__(self, progress: Progress, task):
        super().__init__(logging.INFO)
        self.progress, self.task = progress, task
        self.stage = ""

    def emit(self, record):
        msg = record.getMessage()
        stage = getattr(record, "stage_start", None)
        if stage:
            self.stage = stage
            self.progress.reset(self.task, description=f"autopar: {stage} ...")
            return
        if msg.startswith("autopar: solve round"):
            self.progress.update(self.task, description=msg)
        self.progress.console.print(f"  {msg}", highlight=False, markup=False)


@contextlib.contextmanager
def stage_progress(enabled: bool = True, console: Console | None = None):
    """Progress while planning, on stderr: on a terminal, a live line (rich) with the
    running stage, its elapsed time and the solver's last round (its cost, best bound and
    peak memory against the budget), the lines of finished stages printed above it; else
    those lines only (``log_stages``). ``enabled=False`` shows nothing."""
    console = console or Console(stderr=True)
    if not enabled or not console.is_terminal:
        log_stages(enabled)
        yield
        return
    log = logging.getLogger("autopar")
    plain = [h for h in log.handlers if isinstance(h, _Stderr)]
    for h in plain:
        log.removeHandler(h)
    level = log.level
    log.setLevel(logging.INFO)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        handler = _ProgressHandler(progress, progress.add_task("autopar: starting", total=None))
        log.addHandler(handler)
        try:
            yield
        finally:
            log.removeHandler(handler)
            log.setLevel(level)
            for h in plain:
                log.addHandler(h)


def run_measured(gm: torch.fx.GraphModule, step, model, inputs, targets):
    """Run the one-device step graph ``gm`` (``step``'s, or a rewrite of it) on ``model``'s
    weights, freeing each value after its last use, under a ``LiveStorages`` probe.
    Returns the outputs and the peak bytes (the tangent counts only until it is used)."""
    params = [p.detach() for _, p in model.named_parameters(remove_duplicate=False)]
    own = dict(model.named_buffers(remove_duplicate=False))
    buffers = [own[n] if n in own else step.constants[n] for n in step.buffer_names]
    tangent = [torch.ones((), dtype=step.placeholders()[-1].meta["val"].dtype)]
    tangent = tangent if step.has_loss else []
    args = [*params, *buffers, *inputs, *targets, *tangent]
    assert len(args) == len(step.placeholders())
    seen = LiveStorages()
    for a in args[: len(args) - len(tangent)]:
        seen.add(a)
    with torch.no_grad(), seen:
        seen.peak = seen.live()
        out = torch.fx.Interpreter(gm, garbage_collect_values=True).run(*args)
    return out, seen.peak


def measured_step_peak(pm, opt, local, step) -> int:
    """The peak bytes of live storages while ``step()`` runs (a ``LiveStorages`` probe),
    counting from the start what exists before it: the parameters' local shards, their
    optimizer state in ``opt`` and the local batch ``local`` (benchmarks/memory_check.py's
    method)."""
    seen = LiveStorages()
    with torch.no_grad():  # to_local is then the DTensor's own local tensor, which lives on
        for p in pm.parameters():
            seen.add(p.to_local())
            for v in opt.state[p].values():
                seen.add(v.to_local() if hasattr(v, "to_local") else v)
    for t in local:
        seen.add(t)
    with seen:
        seen.peak = seen.live()
        step()
    return seen.peak


def log_stages(enabled: bool = True) -> None:
    """Send the ``autopar`` logger's stage lines to stderr, as they happen (``enabled``),
    or keep them to warnings (``--quiet``, ``--json``)."""
    log = logging.getLogger("autopar")
    if not enabled:
        log.setLevel(logging.WARNING)
        return
    if not any(isinstance(h, _Stderr) for h in log.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("  %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)


def verify_rank(
    rank: int,
    world_size: int,
    example: str,
    mesh_shape: tuple[int, ...],
    axis_names: tuple[str, ...],
    steps: int = 3,
    dtype: str = "float64",
    lr: float = 1e-2,
    plan_json: str | None = None,
    batch: int = 8,
    memory_fraction: float | None = None,
    ref_dtype: str | None = None,
    progress: bool = False,
) -> VerifyReport:
    """``ref_dtype``: the single-device model runs in this dtype (a float32 control for a
    bf16 run); default ``dtype``. ``progress``: rank 0 logs each pipeline stage as it ends
    (the ``autopar`` logger, to stderr)."""
    if progress and rank == 0:
        log_stages()
    # NOTE: DTensor warns, once per rank, that a Partial on two axes takes two sequential
    # all-reduces; the plan priced them so (flattened multi-axis collectives are not planned
    # yet), and four copies of the warning say nothing to the person running this.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    model, inputs, loss_fn, targets = build_example(example, batch=batch)
    ref_dt = getattr(torch, ref_dtype or dtype)
    ref = copy.deepcopy(model).to(ref_dt)
    ref_inputs = tuple(_cast(t, ref_dt) for t in inputs)
    ref_targets = tuple(_cast(t, ref_dt) for t in targets)
    model = model.to(dt)
    inputs = tuple(_cast(t, dt) for t in inputs)
    targets = tuple(_cast(t, dt) for t in targets)

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=axis_names)
    plan = Plan.from_json(plan_json) if plan_json else None
    with warnings.catch_warnings():
        # ops without a rule are listed in the plan's warnings; one copy per rank is noise
        warnings.simplefilter("ignore", NoRuleWarning)
        pm = api.compile(
            model,
            mesh,
            inputs,
            loss_fn=loss_fn,
            example_targets=targets,
            plan=plan,
            memory_fraction=memory_fraction,
        )
    local = pm.shard_inputs(*inputs, *targets)

    opt = torch.optim.AdamW(pm.parameters(), lr=lr)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    losses, ref_losses = [], []
    grad_err, worst_grad = 0.0, ""
    counted = CollectiveBytes(mesh)
    for i in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        with counted if i == 0 else contextlib.nullcontext():  # the first step's collectives
            loss = pm(*local)
            loss.backward()
        ref_loss = loss_fn(ref(*ref_inputs), *ref_targets)
        ref_loss.backward()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
        if i == 0:
            grads = pm.gather_grads()
            want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
            grad_err, worst_grad = _rel_errors(
                {n: None if g is None else g.to(ref_dt) for n, g in grads.items()}, want
            )
        opt.step()
        ref_opt.step()
    # torch's own helper, as a user gathers a full checkpoint
    full = get_model_state_dict(pm, options=StateDictOptions(full_state_dict=True))
    param_err, worst_param = _rel_errors(
        {n: t.to(ref_dt) for n, t in full.items() if isinstance(t, torch.Tensor)},
        {n: p.detach() for n, p in ref.named_parameters()},
    )
    dist.barrier()
    return VerifyReport(
        losses=losses,
        ref_losses=ref_losses,
        grad_rel_err=grad_err,
        param_rel_err=param_err,
        worst_grad=worst_grad,
        worst_param=worst_param,
        predicted=pm.plan.collective_counts(),
        ran=dict(sorted(counted.counts.items())),
        predicted_bytes=pm.plan.collective_bytes(),
        ran_bytes=counted.bytes,
        mismatches=pm.mismatches,
        local_params=len(list(pm.parameters())),
        model_params=len(list(ref.parameters())),
        plan_json=pm.plan.to_json(timings=True) if rank == 0 else "",
    )


def verify(example: str, mesh_shape, axis_names, **kwargs) -> list[VerifyReport]:
    """Run ``verify_rank`` on a local gloo mesh; returns every rank's report.

    Without ``plan_json``, the plan is made once, here, and every rank compiles it (as a
    launcher hands a saved plan to its ranks): every rank would solve the same ILP, and
    on a machine with fewer cores than ranks they would solve it one after another."""
    world = math.prod(mesh_shape)
    if kwargs.get("plan_json") is None:
        kwargs = {**kwargs, "plan_json": _plan_json(example, mesh_shape, axis_names, **kwargs)}
    return run_local(
        verify_rank, world, example, tuple(mesh_shape), tuple(axis_names), *_args(kwargs)
    )


def _plan_json(example, mesh_shape, axis_names, **kwargs) -> str:
    """The plan ``verify_rank`` would make on each rank, made in this process."""
    log_stages(bool(kwargs.get("progress")))
    dtype = getattr(torch, kwargs.get("dtype", "float64"))
    torch.manual_seed(0)
    model, inputs, loss_fn, targets = build_example(example, batch=kwargs.get("batch", 8))
    model = model.to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoRuleWarning)
        plan = api.plan(
            model,
            Mesh(tuple(mesh_shape), tuple(axis_names), device="cpu"),
            tuple(_cast(t, dtype) for t in inputs),
            loss_fn=loss_fn,
            example_targets=tuple(_cast(t, dtype) for t in targets),
            memory_fraction=kwargs.get("memory_fraction"),
        )
    return plan.to_json(timings=True)


def _args(kwargs):
    order = [
        "steps", "dtype", "lr", "plan_json", "batch", "memory_fraction", "ref_dtype", "progress",
    ]  # fmt: skip
    defaults = {
        "steps": 3,
        "dtype": "float64",
        "lr": 1e-2,
        "plan_json": None,
        "batch": 8,
        "memory_fraction": None,
        "ref_dtype": None,
        "progress": False,
    }
    return [kwargs.get(k, defaults[k]) for k in order]

"""The public entry points: ``plan`` (no processes, no weights) and ``compile``.

Both run the stages of passes/pipeline through its one driver (``run_stages``), which times
each stage and records its size in ``plan.stats``:

    plan:     TRACE -> PLAN_STAGES (fold, strategies, solve) -> Plan.from_solution
    compile:  TRACE -> rank 0 plans (PLAN_STAGES), every rank gets the Plan
                    -> COMPILE_STAGES (codegen) -> ParallelModule (runtime/)
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import itertools
import logging
import math
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from . import plan_cache
from .core import Mesh, MixedPrecision, Plan
from .cost_models import DeviceProfile, devices, register_profile
from .passes.pins import Pin
from .passes.pipeline import (
    COMPILE_STAGES,
    PLAN_STAGES,
    REPORT_STAGES,
    TRACE,
    PlanOptions,
    State,
    check_skip,
    run_stages,
)
from .passes.trace import StepGraph
from .runtime import ParallelModule, empty_local_shards, init_local_shards

__all__ = [
    "plan", "compile", "evaluate", "load_profile", "plan_options", "plan_step",
    "PlanMismatchError", "PlanOptions",
]  # fmt: skip

log = logging.getLogger("autopar")

_SEARCH_STAGES = tuple(s.name for s in PLAN_STAGES)


def load_profile(path: str | Path) -> DeviceProfile:
    """Read a device profile's JSON (``autopar calibrate``) and plan with it from now on:
    ``Mesh(shape, axes, device=autopar.load_profile("profile.json").name)``."""
    return register_profile(devices.load_profile(path))


class PlanMismatchError(ValueError):
    """A plan given to ``compile`` was made for another graph or mesh."""


def plan_options(options: PlanOptions | None = None, /, **knobs) -> PlanOptions:
    """The one ``PlanOptions`` of a call: ``options`` with ``knobs`` set (passes/options
    ``PlanOptions.of``: its fields by name, ``fold``, ``bucket_mb``), its ``skip`` checked
    against the pipeline's stages before anything runs."""
    made = PlanOptions.of(options, **knobs)
    check_skip(made.skip)
    return made


def plan_step(step: StepGraph, mesh: Mesh, options: PlanOptions | None = None, **knobs) -> Plan:
    """Plan an already traced step graph: ``PLAN_STAGES``, then ``REPORT_STAGES``. ``options``
    and ``knobs``: as ``plan`` takes them."""
    return _search(step, mesh, plan_options(options, **knobs))


def _search(step: StepGraph, mesh: Mesh, options: PlanOptions, stats: dict | None = None) -> Plan:
    """``PLAN_STAGES`` on ``step``, then ``REPORT_STAGES``; ``stats``: what earlier stages
    recorded (the trace's)."""
    with _gc_paused():
        state = searched(step, mesh, options, stats)
        plan = reported(state)
        # (what the stages made but the plan is freed before the collection, not walked by it)
        del state
    return plan


def searched(step: StepGraph, mesh: Mesh, options: PlanOptions, stats: dict | None = None) -> State:
    """The pipeline's state after ``PLAN_STAGES`` on ``step``: the solve stage's solution and
    its plan (``State.plan``), its statistics ``stats`` and the times of the search's stages
    (``search_s``)."""
    if stats is None:  # traced elsewhere: the trace stage's statistics from the step
        stats = {"trace_s": step.trace_s, **TRACE.stats(step)}
    stats = dict(stats)
    state = State(trace=step, mesh=mesh, options=options)
    run_stages(PLAN_STAGES, state, stats, skip=options.skip)
    stats["search_s"] = sum(stats.get(f"{name}_s", 0.0) for name in _SEARCH_STAGES)
    state.assemble(step.fingerprint(), stats)
    return state


def reported(state: State) -> Plan:
    """The plan of a ``searched`` state, made by ``REPORT_STAGES`` (the emitted step: the
    order, the buckets, the prefetches, the step memory), its cost the emitted step's."""
    assert state.plan is not None
    recorded = state.plan.stats
    run_stages(REPORT_STAGES, state, recorded, skip=state.options.skip)
    plan, report = state.plan, state.memory
    stats = plan.stats
    if stats is not recorded:  # a stage gave the plan stats of its own (the buckets', the
        # prefetches' copy): what the stages after it recorded, their times too, go with it
        stats = {**stats, **{k: v for k, v in recorded.items() if k not in stats}}
    memory = plan.memory if report is None else {**plan.memory, "step": report.to_dict()}
    # (the step is simulated in the order it runs: the memory timeline's)
    state.plan = plan = dataclasses.replace(plan, stats=stats, memory=memory)
    # the step as emitted; the solver's objective beside it
    cost = dict(plan.cost)
    cost.setdefault("objective_s", cost["total_s"])
    cost["total_s"] = state.emitted_length()
    state.plan = plan = dataclasses.replace(plan, cost=cost)
    return plan


@contextlib.contextmanager
def _gc_paused():
    """Keep Python's garbage collector off while planning, and collect what planning left.

    NOTE: a deep model's step graph is hundreds of thousands of Python objects, and planning
    makes as many again (each node's strategies, the overlap rounds' plans). Every full
    collection walks them all, a cost that grows with depth while the folded search does
    not: GPT-style, 96 layers on (8, 8), the collector took ~3.5 s of a ~17 s search with
    the step graph already out of its sight (``gc.freeze``). So the objects that exist
    before planning are frozen, the collector is off until planning ends, and then one
    collection of the youngest generation (what planning allocated) frees its cycles
    (~350k objects at 96 layers, a few MB). A process that froze objects or turned the
    collector off itself is left alone.
    """
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()
        gc.collect(0)


def _trace(
    model, example_inputs, loss_fn, example_targets, stack, stats, meta_device="cpu", mp=None
) -> StepGraph:
    state = State(
        meta_device=meta_device,
        mp_policy=mp,
        model=model,
        example_inputs=example_inputs,
        loss_fn=loss_fn,
        example_targets=example_targets,
        stack=stack,
    )
    step = run_stages([TRACE], state, stats).trace
    assert step is not None
    return step


def plan(
    model: nn.Module,
    mesh: Mesh,
    example_inputs,
    *,
    loss_fn=None,
    example_targets=None,
    options: PlanOptions | None = None,
    mp_policy: MixedPrecision | None = None,
    cache: bool = False,
    fingerprint: str | None = None,
    **knobs,
) -> Plan:
    """Plan ``model`` for ``mesh`` without processes or weights (a meta model works).

    The planning options are ``PlanOptions``' fields (passes/options: each documented
    there), given as ``options`` or as keywords (``knobs``) that set them, in the forms
    ``PlanOptions.of`` takes: ``memory_budget`` (bytes per rank; default the device
    profile's usable memory, ``math.inf`` for no bound) or ``memory_fraction``,
    ``time_limit_s``, ``optimizer`` (``adamw``, ``sgd_momentum``, ``sgd``, ``none``),
    ``checkpointing``, ``constraints`` (``{pattern: placements}``: passes/pins,
    ``autopar.experts``), ``forbid`` (``autopar explain``), ``skip`` (pipeline stages not to
    run), ``fold`` (False: ``skip={"fold"}``), ``bucket_mb`` (the gradient buckets' size in
    MiB; DDP's default 25). An unknown keyword is a ``TypeError``.

    ``mp_policy``: mixed precision (``autopar.MixedPrecision``, as FSDP2's policy): compute
    in ``param_dtype`` from float32 parameters, gradients reduced in ``reduce_dtype``;
    planned, priced and counted as the step runs it. ``cache``: read the plan from the plan
    cache when the same step was planned for the same mesh, profile, options and versions
    before, and keep it there otherwise (autopar/plan_cache.py; the CLI's default).
    ``fingerprint``: the step graph the plan must be for (a saved plan's):
    ``PlanMismatchError`` if the model traces to another, before any search.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"autopar.plan takes an autopar.Mesh, got {type(mesh).__name__}; "
            "for a torch DeviceMesh use autopar.Mesh.from_device_mesh(mesh)"
        )
    return _plan(model, mesh, example_inputs, loss_fn, example_targets,
                 plan_options(options, **knobs), mp_policy, cache=cache,
                 fingerprint=fingerprint)  # fmt: skip


def _plan(
    model, mesh, example_inputs, loss_fn, example_targets, options, mp_policy, *, cache=False,
    fingerprint=None,
) -> Plan:  # fmt: skip
    stats: dict = {}
    with contextlib.ExitStack() as stack:
        step = _trace(model, example_inputs, loss_fn, example_targets, stack, stats, mp=mp_policy)
        if fingerprint is not None and step.fingerprint() != fingerprint:
            raise PlanMismatchError(
                f"this model and these inputs trace to graph {step.fingerprint()}, not "
                f"{fingerprint}: give the model, batch and precision the plan was made with"
            )
        if not cache:
            return _search(step, mesh, options, stats)
        key = plan_cache.key(step.fingerprint(), mesh, options)
        cached = plan_cache.load(key)
        if cached is not None:
            return cached
        made = _search(step, mesh, options, stats)
        plan_cache.store(key, made)
        return made


def evaluate(
    model: nn.Module,
    mesh: Mesh,
    example_inputs,
    plan_or_constraints,
    *,
    loss_fn=None,
    example_targets=None,
    mp_policy: MixedPrecision | None = None,
    **knobs,
) -> Plan:
    """The cost and memory of a given plan, as a ``Plan`` with the breakdown of a found one.

    ``plan_or_constraints``: a ``Plan`` of this step and mesh (every node keeps its
    strategy; checkpointing and its memory budget as it was made), or constraints as
    ``plan(..., constraints=...)`` takes them (an expert's placements of the parameters and
    the batch, ``autopar.experts``; the solver places the rest at least cost, with no
    memory bound and nothing checkpointed, so that the peak says whether the expert plan
    fits: compare ``plan.memory["step"]["peak_bytes"]`` with the device's memory).
    ``knobs``: the other planning options, as ``plan`` takes them (``optimizer``,
    ``time_limit_s``, ...); the budget, the checkpointing and the placements are the
    given plan's or, for constraints, as said.
    """
    given_options = plan_options(**knobs)
    if isinstance(plan_or_constraints, Plan):
        given = plan_or_constraints
        if given.mesh != mesh:
            raise PlanMismatchError(f"the plan is for {given.mesh}, not {mesh}")
        pins = [
            Pin(node, ",".join(c.out[0]), tuple(None if i is None else ",".join(i) for i in c.ins))
            for node, c in given.nodes.items()
            if c.out and c.out[0] is not None
        ]
        options = plan_options(
            given_options,
            memory_budget=math.inf if given.memory_budget is None else given.memory_budget,
            fold=given.folded,
            checkpointing=bool(given.recompute),
            pins=pins,
        )
        fingerprint = given.fingerprint
    else:
        options = plan_options(
            given_options, memory_budget=math.inf, checkpointing=False,
            constraints=plan_or_constraints,
        )  # fmt: skip
        fingerprint = None
    return _plan(
        model, mesh, example_inputs, loss_fn, example_targets, options, mp_policy,
        fingerprint=fingerprint,
    )  # fmt: skip


def _check_world(device_mesh) -> None:
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(
            f"autopar.compile takes a torch DeviceMesh (init_device_mesh), got "
            f"{type(device_mesh).__name__}; to plan without processes use autopar.plan"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call init_process_group (or "
            "init_device_mesh) on every rank before autopar.compile"
        )
    world = dist.get_world_size()
    if device_mesh.size() != world:
        raise ValueError(
            f"the mesh has {device_mesh.size()} devices {tuple(device_mesh.shape)} but the world "
            f"size is {world}: use a mesh whose sizes multiply to {world}"
        )


_PLAN_KEYS = itertools.count()  # every rank compiles in the same order: same keys


def _plan_on_rank0(step: StepGraph, amesh: Mesh, options: PlanOptions, stats: dict) -> Plan:
    """Rank 0 plans, every rank receives the same plan (one solve, one answer).

    The plan travels through the process group's store: the other ranks block on a socket
    while rank 0 solves, instead of spinning in a collective and taking its CPU.
    NOTE: ``_get_default_store`` is private; torch has no public handle on the store the
    default process group was initialized with (tests/unit/test_torch_internals.py).
    """
    store = dist.distributed_c10d._get_default_store()
    key = f"autopar/plan/{step.fingerprint()}/{next(_PLAN_KEYS)}"
    if dist.get_rank() == 0:
        try:
            text = _search(step, amesh, options, stats).to_json(timings=True)
        except Exception as e:
            store.set(key, "error:" + f"{type(e).__name__}: {e}")
            raise
        store.set(key, "plan:" + text)
    else:
        store.wait([key], timedelta(seconds=max(600.0, 4 * options.time_limit_s)))
    value = store.get(key).decode()
    if value.startswith("error:"):
        raise RuntimeError(f"planning failed on rank 0: {value[len('error:') :]}")
    return Plan.from_json(value[len("plan:") :])


def _check_same_plan(plan: Plan) -> None:
    """Every rank must run the same plan: compare digests (a raise on every rank)."""
    digest = hashlib.sha256(plan.to_json().encode()).hexdigest()[:12]
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) > 1:
        groups: dict[str, list[int]] = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        which = "; ".join(f"ranks {rs}: plan {d}" for d, rs in groups.items())
        raise PlanMismatchError(
            f"the ranks were given different plans ({which}): give every rank the same plan"
        )


def compile(  # noqa: A001 - the documented name
    model: nn.Module,
    mesh,
    example_inputs,
    *,
    loss_fn=None,
    example_targets=None,
    plan: Plan | str | Path | None = None,
    device: str | None = None,
    options: PlanOptions | None = None,
    mp_policy: MixedPrecision | None = None,
    init_weights: Callable[[nn.Module], None] | None = None,
    checkpoint: str | Path | None = None,
    **knobs,
) -> ParallelModule:
    """Plan ``model`` for the torch ``DeviceMesh`` ``mesh`` and return a ``ParallelModule``.

    ``example_inputs`` (and ``example_targets``) are one global batch. With ``loss_fn``,
    ``pm(*local_inputs, *local_targets)`` returns the global loss on every rank; without it,
    ``pm(*local_inputs)`` returns the outputs of the local batch. ``plan`` (a ``Plan`` or the
    path of its JSON) skips planning. ``device`` names the cost profile (default: h100 on
    cuda, cpu otherwise). ``options`` and ``knobs`` (the planning options: ``memory_budget``,
    ``optimizer``, ``skip``, ...) and ``mp_policy``: as ``plan`` takes them (the parameters
    stay float32 DTensors; ``pm`` computes in ``mp_policy.param_dtype``). The codegen stage's time and size are
    in ``pm.stats``.

    A model on the meta device is materialized as this rank's shards only (runtime/init):
    by each module's ``reset_parameters()``, or ``init_weights(module)``, which gives the
    single-device model's values for the same seed; or, with ``checkpoint``, loaded from a
    ``torch.distributed.checkpoint`` directory (any mesh or plan saved it).
    """
    _check_world(mesh)
    rng = _rng_states(mesh.device_type)  # init draws from the generators as they are now
    meta = any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))
    if (init_weights is not None or checkpoint is not None) and not meta:
        raise ValueError(
            "init_weights and checkpoint initialize a model built on the meta device; this "
            "model has real weights (load a checkpoint into it with pm.load_state_dict or DCP)"
        )
    if init_weights is not None and checkpoint is not None:
        raise ValueError("pass init_weights or checkpoint, not both")
    amesh = Mesh.from_device_mesh(mesh, device)
    options = plan_options(options, **knobs)
    if isinstance(plan, (str, Path)):
        plan = Plan.load(plan)
    if plan is not None:
        _check_same_plan(plan)
    stats: dict = {}
    with contextlib.ExitStack() as stack:
        step = _trace(
            model, example_inputs, loss_fn, example_targets, stack, stats, mesh.device_type,
            mp_policy,
        )  # fmt: skip
        if plan is None:
            plan = _plan_on_rank0(step, amesh, options, stats)
        else:
            if plan.fingerprint != step.fingerprint():
                raise PlanMismatchError(
                    f"the plan was made for graph {plan.fingerprint}, but this model and these "
                    f"inputs trace to {step.fingerprint()}: re-plan, or pass the model and "
                    "inputs the plan was made with"
                )
            if plan.mesh.shape != amesh.shape:
                raise PlanMismatchError(
                    f"the plan is for mesh {plan.mesh.shape}, this mesh is {amesh.shape}"
                )
        state = State(trace=step, plan=plan, dmesh=mesh)
        compiled = run_stages(COMPILE_STAGES, state, stats, skip=options.skip).codegen
        assert compiled is not None
    local_values = None
    if meta:
        _set_rng_states(mesh.device_type, rng)
        local_values = _materialize(model, plan, mesh, init_weights, checkpoint, stats)
    if compiled.mismatches:
        log.warning(
            "autopar: %d ops ran with another placement than planned: %s",
            len(compiled.mismatches),
            "; ".join(compiled.mismatches[:5]),
        )
    pm = ParallelModule(model, plan, mesh, compiled, stats=stats, local_values=local_values)
    if checkpoint is not None:
        _load_checkpoint(pm, checkpoint)
    return pm


def _rng_states(device_type: str) -> list:
    states = [torch.random.get_rng_state()]
    if device_type != "cpu":
        states.append(torch.get_device_module(device_type).get_rng_state())
    return states


def _set_rng_states(device_type: str, states: list) -> None:
    torch.random.set_rng_state(states[0])
    if device_type != "cpu":
        torch.get_device_module(device_type).set_rng_state(states[1])


def _materialize(model, plan: Plan, mesh, init_weights, checkpoint, stats: dict) -> dict:
    """This rank's shards of a meta model: initialized, or empty for a checkpoint to fill."""
    placements = {**plan.param_placements, **plan.buffer_placements}
    device = mesh.device_type
    t0 = time.perf_counter()
    if checkpoint is not None:
        values = empty_local_shards(model, placements, mesh, device)
        peak = sum(
            v.numel() * v.element_size() for v in {id(v): v for v in values.values()}.values()
        )
    else:
        values, peak = init_local_shards(model, placements, mesh, init_weights, device)
    stats["init_s"] = time.perf_counter() - t0
    stats["init_peak_bytes"] = peak
    return values


def _load_checkpoint(pm: ParallelModule, checkpoint) -> None:
    """Fill ``pm``'s shards from a DCP checkpoint of the model's state dict (saved as
    ``pm.state_dict()``, or under the key ``"model"`` as torch's state_dict helpers are
    often saved with an optimizer beside it)."""
    state = pm.state_dict()
    reader = dcp.FileSystemReader(str(checkpoint))
    keys = set(reader.read_metadata().state_dict_metadata)
    nested = not (set(state) & keys) and any(k.startswith("model.") for k in keys)
    dcp.load({"model": state} if nested else state, storage_reader=reader)
    pm.load_state_dict(state)

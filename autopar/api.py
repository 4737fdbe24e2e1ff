"""The public entry points: ``plan`` (no processes, no weights) and ``compile``.

The driver runs the pipeline of DESIGN.md, one pass after another, and records each stage's
time in ``plan.stats``:

    trace (passes/trace) -> fold (passes/fold) -> strategies (passes/strategies)
        -> solve (passes/solve)
        -> Plan -> codegen (passes/codegen) -> ParallelModule (runtime/)
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

from .mesh import Mesh
from .plan import NodeChoice, Plan

__all__ = ["plan", "compile", "plan_step", "PlanMismatchError"]

log = logging.getLogger("autopar")


class PlanMismatchError(ValueError):
    """A plan given to ``compile`` was made for another graph or mesh."""


def _op_name(target) -> str:
    if target == "placeholder":
        return "placeholder"
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


def plan_step(
    step,
    mesh: Mesh,
    *,
    time_limit_s: float = 600.0,
    memory_budget: float | None = None,
    fold: bool = True,
) -> Plan:
    """Plan an already traced step graph (folding, strategies, then the ILP)."""
    with _gc_paused():
        return _plan_step(step, mesh, time_limit_s, memory_budget, fold)


@contextlib.contextmanager
def _gc_paused():
    """Keep Python's garbage collector off the objects that exist before planning.

    NOTE: a deep model's step graph is hundreds of thousands of Python objects; each full
    collection during the search walks all of them, a cost that grows with depth while the
    folded search does not (96 layers: ~0.8 s of ~7 s). ``gc.freeze`` moves them out of the
    collector's sight (not out of memory) until planning ends; what planning allocates is
    collected as usual. A process that froze objects itself is left alone.
    """
    import gc

    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _plan_step(step, mesh: Mesh, time_limit_s, memory_budget, fold) -> Plan:
    from .passes.fold import fold_regions
    from .passes.solve import solve
    from .passes.strategies import build_strategies, placement_str

    t0 = time.perf_counter()
    folded = fold_regions(step) if fold else None
    t_fold = time.perf_counter()
    if folded is not None:
        log.info("autopar: %s", folded.report())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        space = build_strategies(step, mesh, folded=folded)
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    t1 = time.perf_counter()
    sol = solve(space, time_limit_s=time_limit_s, memory_budget=memory_budget)
    t2 = time.perf_counter()

    def text(ps):
        return None if ps is None else tuple(placement_str(p) for p in ps)

    nodes = {}
    for name in space.order:
        s = space.strategies[name][sol.choice[name]]
        nodes[name] = NodeChoice(
            op=_op_name(space.targets[name]),
            module=space.modules[name],
            role=space.roles[name],
            out=tuple(text(o) for o in s.out),
            ins=tuple(text(i) for i in s.ins),
            cost_s=sol.node_cost_s[name],
        )
    gm = step.gm
    params, buffers, inputs = {}, {}, []
    pi = bi = 0
    param_shapes = {}
    for n in step.placeholders():
        role = n.meta["autopar_role"]
        if role == "param":
            params[step.param_names[pi]] = n.name
            param_shapes[step.param_names[pi]] = list(n.meta["val"].shape)
            pi += 1
        elif role == "buffer":
            buffers[step.buffer_names[bi]] = n.name
            bi += 1
        elif role in ("input", "target"):
            inputs.append(n.name)
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    outputs: list = [None] * len(out_node.args[0])
    rep = ("R",) * mesh.ndim
    for sink in space.sinks:
        outputs[sink.position] = rep if sink.like is None else nodes[sink.like].out[0]

    per_rank = total = 0
    for name, node in params.items():
        if name in step.alias_of:
            continue  # a tied parameter is stored once
        shape, dtype = space.shapes[node][0]
        nbytes = math.prod(shape) * dtype.itemsize
        shards = math.prod(
            size for size, p in zip(mesh.shape, nodes[node].out[0]) if p.startswith("S")
        )
        total += nbytes
        per_rank += nbytes // shards
    by_kind: dict[str, float] = {}
    colls = []
    for label, c, t in sol.collectives:
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + t
        colls.append(
            {
                "edge": label,
                "kind": c.kind,
                "axis": mesh.axis_names[c.axis],
                "nbytes": int(c.nbytes),
                "group_size": int(c.group_size),
                "time_s": t,
            }
        )
    stats = dict(sol.stats)
    stats.update(
        trace_s=step.trace_s,
        fold_s=t_fold - t0,
        strategies_s=t1 - t_fold,
        search_s=t2 - t0,
        param_shapes=param_shapes,
        fold=folded is not None,
        **(folded.stats() if folded else {"fold_regions": 0, "folded_nodes": 0, "fold_groups": []}),
    )
    import autopar

    return Plan(
        fingerprint=step.fingerprint(),
        mesh=mesh,
        nodes=nodes,
        params=params,
        buffers=buffers,
        inputs=tuple(inputs),
        has_loss=step.has_loss,
        outputs=tuple(outputs),
        fallback_nodes=tuple(sorted(space.fallbacks)),
        collectives=tuple(colls),
        cost={
            "compute_s": sol.compute_s,
            "comm_s": sol.comm_s,
            "total_s": sol.objective_s,
            "comm_by_kind_s": dict(sorted(by_kind.items())),
        },
        memory={"param_bytes_per_rank": int(per_rank), "param_bytes_total": int(total)},
        warnings=tuple(space.fallbacks[n] for n in sorted(space.fallbacks)),
        stats=stats,
        versions={"autopar": autopar.__version__, "torch": torch.__version__.split("+")[0]},
    )


def plan(
    model: nn.Module,
    mesh: Mesh,
    example_inputs,
    *,
    loss_fn=None,
    example_targets=None,
    time_limit_s: float = 600.0,
    memory_budget: float | None = None,
    fold: bool = True,
) -> Plan:
    """Plan ``model`` for ``mesh`` without processes or weights (a meta model works).

    ``memory_budget``: bytes per rank for parameters, gradients and AdamW state.
    ``fold``: give the instances of a repeated layer one set of choices (passes/fold);
    False plans every node on its own (slower, for comparison).
    """
    from .passes.trace import trace_step

    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"autopar.plan takes an autopar.Mesh, got {type(mesh).__name__}; "
            "for a torch DeviceMesh use autopar.Mesh.from_device_mesh(mesh)"
        )
    with contextlib.ExitStack() as stack:
        step = trace_step(
            model, example_inputs, loss_fn=loss_fn, example_targets=example_targets, stack=stack
        )
        return plan_step(
            step, mesh, time_limit_s=time_limit_s, memory_budget=memory_budget, fold=fold
        )


def _check_world(device_mesh) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

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


def _plan_on_rank0(step, amesh: Mesh, time_limit_s, memory_budget, fold) -> Plan:
    """Rank 0 plans, every rank receives the same plan (one solve, one answer).

    The plan travels through the process group's store: the other ranks block on a socket
    while rank 0 solves, instead of spinning in a collective and taking its CPU.
    """
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    key = f"autopar/plan/{step.fingerprint()}/{next(_PLAN_KEYS)}"
    if dist.get_rank() == 0:
        try:
            text = plan_step(
                step, amesh, time_limit_s=time_limit_s, memory_budget=memory_budget, fold=fold
            ).to_json(timings=True)
        except Exception as e:
            store.set(key, "error:" + f"{type(e).__name__}: {e}")
            raise
        store.set(key, "plan:" + text)
    else:
        store.wait([key], timedelta(seconds=max(600.0, 4 * time_limit_s)))
    value = store.get(key).decode()
    if value.startswith("error:"):
        raise RuntimeError(f"planning failed on rank 0: {value[len('error:') :]}")
    return Plan.from_json(value[len("plan:") :])


def compile(  # noqa: A001 - the documented name
    model: nn.Module,
    mesh,
    example_inputs,
    *,
    loss_fn=None,
    example_targets=None,
    plan: Plan | str | Path | None = None,
    device: str | None = None,
    time_limit_s: float = 600.0,
    memory_budget: float | None = None,
    fold: bool = True,
):
    """Plan ``model`` for the torch ``DeviceMesh`` ``mesh`` and return a ``ParallelModule``.

    ``example_inputs`` (and ``example_targets``) are one global batch. With ``loss_fn``,
    ``pm(*local_inputs, *local_targets)`` returns the global loss on every rank; without it,
    ``pm(*local_inputs)`` returns the outputs of the local batch. ``plan`` (a ``Plan`` or the
    path of its JSON) skips planning. ``device`` names the cost profile (default: h100 on
    cuda, cpu otherwise). ``memory_budget``: bytes per rank for parameters, gradients and
    AdamW state. ``fold``: as in ``plan``.
    """
    from .passes.codegen import build_local_graph, compile_local_step
    from .passes.trace import trace_step
    from .runtime import ParallelModule

    _check_world(mesh)
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(
            "autopar.compile needs the model's real weights (this one is on the meta device); "
            "use autopar.plan to plan a meta model"
        )
    amesh = Mesh.from_device_mesh(mesh, device)
    if isinstance(plan, (str, Path)):
        plan = Plan.load(plan)
    with contextlib.ExitStack() as stack:
        step = trace_step(
            model, example_inputs, loss_fn=loss_fn, example_targets=example_targets, stack=stack
        )
        if plan is None:
            plan = _plan_on_rank0(step, amesh, time_limit_s, memory_budget, fold)
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
        t0 = time.perf_counter()
        local = build_local_graph(step, plan, mesh)
        fn = compile_local_step(step, local)
        log.info("autopar: codegen + compile %.2f s", time.perf_counter() - t0)
        if local.mismatches:
            log.warning(
                "autopar: %d ops ran with another placement than planned: %s",
                len(local.mismatches),
                "; ".join(local.mismatches[:5]),
            )
    return ParallelModule(model, plan, mesh, fn, step, local)

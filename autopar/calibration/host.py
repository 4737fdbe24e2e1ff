"""The host's side of a device profile: the time a step's Python spends per op, per view,
per node of each op and per step, each after warm-up.

    host time           a chain of views run as the step runs its graph (``view_launch``),
                        and a chain of one-element adds (``measure_step_ops``: an fx graph
                        of adds run as its generated code), each the mean of passes spread
                        over the calibration (``HOST_PASSES``, ``pool_host``: an H200's host
                        runs at one of two speeds 1.45x apart, switching within seconds, and
                        a step pays their mix);
                        on CUDA, the host's clock apart from the device's (core/schedule):
                        the chain of adds' time per op (``host_launch``), and each op of a
                        small GPT's and (with transformers) a small Llama's training steps
                        (float32 and bf16 mixed precision) under torch's profiler, less an
                        add's time under it (the chain's, in the same profile), plus the
                        chain's, each the mean of its calls (``host_table``: a step pays
                        its slow calls too), in profiles ``HOST_GAP_S`` apart and averaged
                        (``pool_tables``) (``host_op_costs``, ``measure_host_ops``: a
                        matmul's call costs about two adds', an attention's twenty or
                        more); the table moves by 10-20% from one measurement to the next
                        on an H200's host, and a host-bound step's time by as much from
                        one run to the next; then two chains of
                        tiny layers compiled by autopar and timed as a training loop steps
                        them over the host's passes' seconds (on the CPU on N ranks side
                        by side, the mean step, as ``median_of_means``: ranks beside each
                        other take each other's cores now and then; on CUDA on one, the
                        plain mean over the host's two speeds), their nodes taken off at
                        those costs: the runtime's time per step and per parameter
                        (``measure_runtime``, ``step_overhead``, ``param_overhead``);
                        on the CPU a small GPT's step (every rank the whole of it) beside
                        them, less its plan's compute as the profile so far prices it and
                        less the chains' line: what is left, over the roofline part of
                        that compute, plus 1, is ``roofline_scale`` (~2-3 on a 2-core VM).
                        A real step's kernels run slower than the same kernels timed alone
                        in a loop: their tensors come cold from memory, freshly allocated;
                        without it a zoo step's compute came out at half its time once its
                        elementwise kernels were priced by size. (Put per node instead, on
                        ``kernel_launch``, it priced a zoo MLP's step of tiny kernels at
                        1.4-1.5 times its time)

The chains' per-op and per-view costs are medians of calls timed in rounds
(calibration/timing.py); the host's table per op and the runtime's steps are means, as a
step pays its slow calls.
"""

from __future__ import annotations

import bisect
import functools
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

# NOTE: torch.compile's aot_eager compiler: no public function compiles an fx graph to its
# boxed Python code (tests/unit/test_torch_internals.py)
from torch._dynamo.backends.debugging import boxed_nop
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile, record_function

from ..api import compile as compile_step
from ..api import plan as plan_model
from ..core import Mesh
from ..core.precision import MixedPrecision
from ..cost_models import (
    DeviceProfile,
    get_profile,
    profiler_name,
    register_profile,
    runs_kernel,
)
from ..models import GPT, GPTConfig, cross_entropy_loss, hf_llama, hf_logits_loss, lm_batch
from ..runtime.launch import run_local
from .timing import _spread_medians, _spread_times, _sync, median_of_means

__all__ = [
    "HOST_GAP_S",
    "HOST_PASSES",
    "host_table",
    "measure_host_ops",
    "measure_runtime",
    "measure_step_ops",
    "pool_host",
    "pool_tables",
    "runtime_terms",
]

HOST_PASSES = {"cpu": 3, "cuda": 4, "quick": 1}
"""Passes of the host's measurements a calibration takes and averages: the chains' time
per op and per view (``measure_step_ops``), read at points spread over the calibration;
on CUDA the host table's profiles (``_host_ops_rank``, ``HOST_GAP_S`` apart, the steps
running between them); and the seconds the runtime's steps are timed over, this many of
the calibration's spread (``measure_runtime``).

NOTE: an H200's host ran calibrate's chain of adds at about 8.5-9 us per op or at 12-15,
switching within seconds on the same core, pinned or not (40 readings 0.15 s apart were
at 11 us or more in 2 to 27 of the 40, by the window), or holding one speed for longer
(benchmarks/cost_fidelity). A host-bound step pays the mix of the two, so the host's
terms are the mean over readings spread over the calibration, not one reading, which
lands in either mode (one calibration read 14.05 us, where most of the readings beside
the steps were 8-9; one calibration's four passes read 13.33, 14.16, 13.56 and 9.21)."""
HOST_GAP_S = 2.0
"""Seconds between the host table's profiles (``_host_ops_rank``), the steps running."""


def pool_host(passes: Sequence[tuple[float, ...]]) -> tuple[float, ...]:
    """The mean of each term over the host's ``passes`` (``HOST_PASSES``): a step runs in
    whichever speed the host is in, and pays their mix."""
    if not passes:
        raise ValueError("no pass of the host's time to pool")
    return tuple(statistics.fmean(p[i] for p in passes) for i in range(len(passes[0])))


def measure_step_ops(
    device: torch.device, reps: int = 20, seconds: float = 0.0
) -> tuple[float, float]:
    """Seconds per op of a chain of one-element adds, and of a chain of views (which run no
    kernel), run as the emitted step runs its graph (passes/codegen: the Python code fx
    generates for the graph, boxed as aot_autograd calls it), so the cost of a graph's node
    beyond its kernel is in it; the two in rounds over at least ``seconds``."""
    op, view_op = _spread_medians(
        [_chain(device, False), _chain(device, True)], device, reps, seconds
    )
    return op / _CHAIN, view_op / _CHAIN


_CHAIN = 64  # nodes of ``_chain``'s graph


def _chain(device: torch.device, view: bool) -> Callable[[], object]:
    """A call of the generated code of an fx graph of ``_CHAIN`` one-element adds (or views
    of one element), boxed as aot_autograd calls a graph."""
    x0 = torch.ones(1, device=device)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = x
    for _ in range(_CHAIN):
        if view:
            y = graph.call_function(torch.ops.aten.view.default, (y, [1]))
        else:
            y = graph.call_function(torch.ops.aten.add.Tensor, (y, x))
    graph.output(y)
    run = boxed_nop(torch.fx.GraphModule(torch.nn.Module(), graph), [x0])
    return lambda: run([x0])  # a boxed call empties its list


def _training_step(pm, *batch: torch.Tensor) -> Callable[[], None]:
    """One step of ``pm`` on this rank's part of ``batch`` as a training loop runs it:
    forward, backward, the gradients let go."""
    local = pm.shard_inputs(*batch)
    params = list(pm.parameters())

    def step() -> None:
        pm(*local).backward()
        for p in params:
            p.grad = None

    return step


def _node_ops(pm) -> list[tuple[str, bool]]:
    """The op nodes of a compiled step's graphs: ``(profiler name, runs a kernel)`` each."""
    return [
        (profiler_name(n.target), runs_kernel(n.target))
        for g in pm.compiled.graphs.values()
        for n in g.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
    ]


def _profiled_ops(
    fns: Sequence[Callable[[], object]], names: set[str], device, reps: int
) -> list[dict[str, list[float]]]:
    """The host's seconds of each call of each op in ``names`` (``aten::mm``) as each of
    ``fns`` runs it, under torch's profiler (CPU activity alone), the calls that no other of
    ``names`` made (an op that calls another counts once, with what it calls); per fn,
    ``{name: [seconds, ...]}``. The fns run in turn, ``reps`` rounds in one profile, so
    that they share its drift; each call of a fn is marked by a range (``record_function``),
    and an op is that fn's when it starts inside the range, on whichever thread (CUDA's
    backward runs on autograd's own)."""
    marks = [f"autopar.calibrate.call{i}" for i in range(len(fns))]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            for mark, fn in zip(marks, fns):
                with record_function(mark):
                    fn()
            _sync(device)
    index = {mark: i for i, mark in enumerate(marks)}
    events = prof.events()
    ranges = sorted(
        (e.time_range.start, e.time_range.end, index[e.name]) for e in events if e.name in index
    )
    starts = [r[0] for r in ranges]
    times: list[dict[str, list[float]]] = [{} for _ in fns]
    for e in events:
        if e.name not in names:
            continue
        parent = e.cpu_parent
        while parent is not None and parent.name not in names:
            parent = parent.cpu_parent
        at = bisect.bisect_right(starts, e.time_range.start) - 1
        if parent is None and at >= 0 and e.time_range.start <= ranges[at][1]:
            times[ranges[at][2]].setdefault(e.name, []).append(e.time_range.elapsed_us() * 1e-6)
    return times


_Example = tuple[torch.nn.Module, tuple, Callable, tuple]


def _host_ops_models(device: torch.device) -> list[_Example]:
    """The steps whose ops ``_host_ops_rank`` times: a small GPT (autopar.models' ``gpt``,
    fused attention) and, where transformers is installed, a small Hugging Face Llama (the
    zoo's ``hf-llama``: RMSNorm, rotary embeddings, a gated MLP, whose multiplies, powers,
    means and slices a GPT step does not run; priced at an add's call, a Llama step's host
    time came out 17% short on an H200). ``(model, inputs, loss, targets)`` each."""
    cfg = GPTConfig(sdpa=True)
    tokens, targets = lm_batch(cfg.vocab, 8, cfg.seq, device=device)
    torch.manual_seed(0)
    with torch.device(device):
        models: list[_Example] = [(GPT(cfg), (tokens,), cross_entropy_loss, (targets,))]
    try:
        import transformers  # noqa: F401
    except ImportError:
        return models
    torch.manual_seed(0)
    tokens, targets = lm_batch(128, 8, 32, device=device)  # the zoo's hf-llama
    with torch.device(device):
        llama = hf_llama(vocab=128, seq=32)
    return models + [(llama, (tokens,), hf_logits_loss, (targets,))]


def _host_ops_rank(
    rank: int,
    world: int,
    step_op: float,
    view_op: float,
    reps: int,
    device_type: str,
    passes: int = 1,
) -> dict[str, float]:
    """On one rank: the host's seconds per node of each op of small training steps
    (``_host_ops_models``, float32 and bf16 mixed precision, compiled by autopar), as the
    emitted step calls it. Each op's time under the profiler less an add's (a view's, for
    an op that runs no kernel) under it too, plus ``step_op`` (``view_op``): the
    profiler's own cost per call, and the generated code's around the op, are an add's
    (``measure_step_ops``); at least half of that (``host_table``). Measured in
    ``passes`` profiles ``HOST_GAP_S`` apart, the steps running between them as a
    training loop runs them, and each op's mean over the passes (``pool_tables``: the
    host's speed moves between two modes within seconds, ``HOST_PASSES``)."""
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
    fns: list[Callable[[], object]] = []
    kernel_ops: set[str] = set()
    view_ops: set[str] = set()
    for policy in (None, MixedPrecision(torch.bfloat16, torch.float32)):
        for model, inputs, loss_fn, targets in _host_ops_models(device):  # fresh per policy
            pm = compile_step(
                model, mesh, inputs, loss_fn=loss_fn, example_targets=targets,
                mp_policy=policy, device="h100" if device_type == "cuda" else "cpu",
            )  # fmt: skip
            step = _training_step(pm, *inputs, *targets)
            step()
            fns.append(step)
            for name, kernel in _node_ops(pm):
                (kernel_ops if kernel else view_ops).add(name)
    add, view = "aten::add", "aten::view"
    chains = [_chain(device, False), _chain(device, True)]
    for fn in chains:
        fn()
    tables = []
    for i in range(passes):
        if i:  # the steps run between the profiles, as a training loop runs them
            end = time.perf_counter() + HOST_GAP_S
            while time.perf_counter() < end:
                for fn in fns:
                    fn()
            _sync(device)
        # the chains' adds and views apart from the steps' own, in one profile
        *steps, add_chain, view_chain = _profiled_ops(
            fns + chains, kernel_ops | view_ops | {add, view}, device, reps
        )
        tables.append(
            host_table(steps, add_chain[add], view_chain[view], kernel_ops, step_op, view_op)
        )
    return pool_tables(tables)


def pool_tables(tables: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each op's mean over the host tables of ``tables`` (passes of ``host_table``) that
    priced it."""
    seen: dict[str, list[float]] = {}
    for table in tables:
        for name, t in table.items():
            seen.setdefault(name, []).append(t)
    return {name: statistics.fmean(ts) for name, ts in sorted(seen.items())}


def host_table(
    steps: Sequence[dict[str, list[float]]],
    adds: Sequence[float],
    views: Sequence[float],
    kernel_ops: set[str],
    step_op: float,
    view_op: float,
) -> dict[str, float]:
    """The host's seconds per node of each op from its calls under the profiler in
    ``steps`` (``_profiled_ops``' lists, one per step): the calls' time less a chain's add
    under the profiler (``adds``; ``views`` for an op outside ``kernel_ops``, which runs no
    kernel), plus ``step_op`` (``view_op``), at least half of that. Each time is its calls'
    mean (``median_of_means``): a step pays its calls one after another, the slow ones
    included. (Their medians left out 8% of the calls' time in a zoo Llama's step on an
    H200: 9.33 ms a step against 10.15.)"""
    bases = {True: (step_op, median_of_means(adds)), False: (view_op, median_of_means(views))}
    measured: dict[str, list[float]] = {}
    for ops_of_step in steps:
        for name, ts in ops_of_step.items():
            measured.setdefault(name, []).extend(ts)
    out = {}
    for name, ts in measured.items():
        base, own = bases[name in kernel_ops]
        out[name] = max(base + median_of_means(ts) - own, base / 2)
    return dict(sorted(out.items()))


def measure_host_ops(
    step_op: float, view_op: float, reps: int = 10, device_type: str = "cuda", passes: int = 1
) -> dict[str, float]:
    """Host seconds per node by op (``_host_ops_rank``, on one rank of the local launcher, in
    ``passes`` profiles): ``DeviceProfile.host_op_costs``."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    return run_local(
        _host_ops_rank, 1, step_op, view_op, reps, device_type, passes, backend=backend
    )[0]


def _runtime_rank(
    rank: int,
    world: int,
    depths: Sequence[int],
    reps: int,
    seconds: float,
    device_type: str,
    priced: DeviceProfile | None = None,
    groups: int = 5,
) -> list[tuple]:
    """On one rank: a chain of ``depth`` tiny linear layers compiled by autopar on this
    rank's mesh (kernels of a few elements, each replicated: no collective), each step timed
    as a training loop runs it (forward, backward, gradients dropped), the depths in rounds
    over at least ``seconds``; per depth ``(parameters, nodes, seconds, 0, 0)``, the nodes those
    of the compiled graphs (``_node_ops``), the seconds the mean step (``median_of_means`` of
    ``groups`` runs: as the ranks run beside each other their threads take each other's
    cores now and then, a scheduler tick, which a loop's time per step holds at the rate it
    comes, and a rare stall is left out; with one group the plain mean, for a host whose
    speed moves between modes over seconds, ``HOST_PASSES``). With
    ``priced`` (the profile being calibrated, so far), a small GPT too (fused attention,
    every rank running the whole step), its row's last entries the compute its plan prices
    with ``priced`` (the nodes' roofline times and calls) and the roofline part of it
    (``_roofline_s``)."""
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
    steps, counts = [], []
    for depth in depths:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(depth))).to(device)
        x, y = torch.randn(8, 4, device=device), torch.randn(8, 4, device=device)
        pm = compile_step(model, mesh, (x,), loss_fn=torch.nn.functional.mse_loss,
                          example_targets=(y,),
                          device="h100" if device_type == "cuda" else "cpu")  # fmt: skip
        step = _training_step(pm, x, y)
        if pm.plan.collectives:
            raise RuntimeError(
                f"the runtime's chain of {depth} layers was planned with collectives; "
                "its time would not be the host's alone"
            )
        steps.append(step)
        counts.append((len(list(pm.parameters())), _node_ops(pm), 0.0, 0.0))
    if priced is not None:
        register_profile(priced)
        cfg = GPTConfig(sdpa=True)
        tokens, targets = lm_batch(cfg.vocab, 8, cfg.seq, device=device)
        torch.manual_seed(0)
        with torch.device(device):
            gpt = GPT(cfg)
        # every rank the whole step: nothing split, no collective, the gradients' and the
        # loss's included ("reshard:dp": whole; with "none", a profile whose collectives
        # are cheap against its compute split the backward and gathered its gradients)
        whole = plan_model(gpt, Mesh((world,), ("dp",), device=priced.name), (tokens,),
                           loss_fn=cross_entropy_loss, example_targets=(targets,),
                           constraints={"*": "R", "input:*": "R", "reshard:dp": "whole"})  # fmt: skip
        pm = compile_step(gpt, mesh, (tokens,), loss_fn=cross_entropy_loss,
                          example_targets=(targets,), plan=whole)  # fmt: skip
        if pm.plan.collectives:
            raise RuntimeError("the runtime's GPT was planned with collectives")
        steps.append(_training_step(pm, tokens, targets))
        compute = pm.plan.cost["compute_s"]
        counts.append((len(list(pm.parameters())), _node_ops(pm), compute, _roofline_s(pm.plan)))
    dist.barrier()  # every rank compiled: they step side by side
    times = _spread_times(steps, device, reps, seconds)
    return [(p, n, median_of_means(t, groups), c, r) for (p, n, c, r), t in zip(counts, times)]


def _roofline_s(plan) -> float:
    """The seconds of ``plan``'s nodes beyond their calls: each node's ``cost_s`` less the
    call its op pays (``kernel_launch`` for a kernel, ``view_launch`` for a view)."""
    profile = get_profile(plan.mesh.device)
    total = 0.0
    for node in plan.nodes.values():
        if node.cost_s <= 0 or node.op in ("placeholder", "output"):
            continue
        op = functools.reduce(getattr, node.op.split("."), torch.ops)
        call = profile.kernel_launch if runs_kernel(op) else profile.view_launch
        total += max(node.cost_s - call, 0.0)
    return total


def measure_runtime(
    step_op: float,
    view_op: float,
    reps: int,
    seconds: float = 0.0,
    nproc: int = 1,
    device_type: str = "cpu",
    host_ops: dict[str, float] | None = None,
    priced: DeviceProfile | None = None,
    groups: int = 5,
) -> tuple[float, float, float]:
    """``(step_overhead, param_overhead, roofline_scale)``: a step's host time outside its
    graph's nodes, fixed and per parameter, and how much slower its kernels run than the
    profile's curves say. Two chains of tiny layers are compiled and timed
    (``_runtime_rank``, on ``nproc`` ranks of the local launcher stepping side by side, the
    slowest rank's, the mean step as ``median_of_means`` of ``groups`` runs); their nodes
    priced at ``host_ops``' time of their op, else ``step_op`` (``view_op`` for a view),
    are taken off, and the line through the two rests by parameter count gives the first
    two terms (each at least 0), and 1 for the third.

    With ``priced`` (the CPU's profile so far), a small GPT's step is timed beside them,
    less the compute ``priced`` gives its plan and the line's two terms: what is left, over
    the roofline part of that compute (``_roofline_s``), is the third term less 1. A real
    step's kernels run slower than the curves' (their tensors cold, freshly allocated); the
    chains' kernels, of a few elements, are their calls alone. (Taken per node instead, as
    it was, the GPT's rest priced a zoo MLP's step of tiny kernels at 1.4-1.5 times its
    time.)"""
    backend = "nccl" if device_type == "cuda" else "gloo"
    per_rank = run_local(
        _runtime_rank, nproc, (1, 8), reps, seconds, device_type, priced, groups, backend=backend
    )
    rows = [max(model, key=lambda row: row[2]) for model in zip(*per_rank)]
    return runtime_terms(rows, step_op, view_op, host_ops or {})


def runtime_terms(
    rows: Sequence[tuple], step_op: float, view_op: float, host_ops: dict[str, float]
) -> tuple[float, float, float]:
    """``measure_runtime``'s three terms from ``_runtime_rank``'s rows, the slowest rank's:
    two chains, then (where timed) the GPT."""

    def rest(nodes, t, compute):
        if compute:  # priced by the profile: roofline and call per node
            return t - compute
        return t - sum(host_ops.get(n, step_op if k else view_op) for n, k in nodes)

    rests = [rest(n, t, c) for _, n, t, c, _ in rows]
    p1, p2 = rows[0][0], rows[1][0]
    r1, r2 = rests[:2]
    per_param = max((r2 - r1) / (p2 - p1), 0.0)
    line = (max(r1 - per_param * p1, 0.0), per_param, 1.0)
    if len(rows) < 3:
        return line
    p3, roof, r3 = rows[2][0], rows[2][4], rests[2]
    if roof <= 0:  # nothing priced beyond the calls: nothing to scale
        return line
    return line[0], line[1], 1.0 + max((r3 - line[0] - line[1] * p3) / roof, 0.0)

"""``autopar calibrate``: measure this machine's kernels and links into a device profile.

The cost model (cost_models) prices a plan with a ``DeviceProfile``. The built-in ones hold
datasheet peaks and published measurements; this module measures the machine it runs on
(the CPU with gloo, or CUDA devices with NCCL) and writes a profile JSON that ``autopar plan
--profile PATH`` and ``autopar.load_profile(PATH)`` take.

What is measured, each after warm-up:

    matmul curves       torch.mm of n x n by n x n, per dtype, for growing n: points
                        (2 n^3 FLOPs, FLOP/s) of ``kernel_rates["matmul"]``; the fastest rate
                        of each dtype is its ``peak_flops``
    attention curves    autopar's sdpa and sdpa_backward (the kernels the emitted step runs,
                        core/ops.py) for growing sequence lengths, causal, batch 1 (and on
                        CUDA a batch of 16384 tokens too): points of
                        ``kernel_rates["attention"]`` / ``["attention_backward"]``
    mem_bandwidth       a clone of a large tensor: bytes read + written over its time; on
                        CUDA, the elementwise curve below at a layer's size instead
                        (``ELEMENTWISE``), which reaches about three fifths of a clone's
    bandwidth_curve     the elementwise kernels a step runs most, by the bytes one call
                        moves (``measure_bandwidth_curve``): on the CPU float32 (an add, a
                        multiply by a broadcast row, a copy) on 4 KiB to 64 MiB tensors. A
                        small step's tensors stay in the caches: on a 2-core VM they ran at
                        ~150 GB/s at 256 KiB and ~4 GB/s at 64 MiB, where the clone above
                        gives ~4; priced at the clone's, a zoo step's adds and multiplies
                        came out six times their time. On CUDA bf16 (an add, a multiply by
                        a broadcast row, a cast from float32) on 8 KiB to 128 MiB: a small
                        kernel does not fill the device
    kernel_launch       on the CPU, a one-element add, as the emitted step runs one op of
                        its graph (``measure_step_ops``: an fx graph of adds run as its
                        generated code): the fixed cost of an op, the one clock's; on
                        CUDA, where the host runs ahead of the device, the device's own
                        time per kernel: one-element adds queued behind long matmuls
                        (``measure_kernel_floor``)
    the intra-node link N local processes run all_reduce, all_gather, reduce_scatter and
                        all_to_all at sizes from KiB to MiB, as the step runs them
                        (functional collectives, each waited for, each after a burst of
                        kernels whose time alone is taken off), the mean of the calls (a
                        step pays every call: on gloo over a VM's cores a sub-ms call
                        takes a scheduler tick, 4 ms, one time in five or so, and its mean
                        is 2-3x its median), as ``median_of_means``; on the CPU in three
                        passes spread over the calibration, each sample the median of
                        its passes (``LINK_PASSES``: a pass moves with the machine's
                        minute); the model of cost_models.comm,
                        ``t = o + steps(kind, n) a + factor(kind, n) S / bw``, is fitted to
                        them by least squares over relative errors with o, a, 1/bw >= 0
                        (``fit_link``), giving ``collective_overhead``,
                        ``intra_node_latency`` and ``intra_node_bandwidth`` (where the
                        times do not grow with size, a busy machine's noise, measured
                        again with messages ``LARGER`` times larger: ``measure_link``);
                        then per kind the geometric mean of measured over fitted
                        (``kind_scales``, ``collective_scale``: a library may run a kind by
                        another algorithm);
                        with one rank (a one-GPU machine) there is no link to measure, and
                        the base profile's stays
    host time           a chain of views run as the step runs its graph (``view_launch``),
                        and the chain of adds above, each the mean of passes spread over
                        the calibration (``HOST_PASSES``: an H200's host runs at one of two
                        speeds 1.45x apart, switching within seconds, and a step pays
                        their mix);
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

The kernel curves and the per-op and per-view costs (not the host's table per op, above)
are medians of calls timed in rounds
(each curve's points taken in turn, ``_spread_medians``) spread over a second or two: a
VM's speed drifts by 20-30% over seconds, and a curve timed point after point came out
shifted by it. The launch cost and the memory bandwidth are medians of calls timed one
after another. A kernel's rate is its FLOPs (bytes) over its time less what the cost model
adds back per op (``_rate``), so small kernels are not charged it twice. On the CPU that is
the call's cost (``kernel_launch``, one clock). On CUDA the curves are timed on the
device's clock (``_queued_times``: runs of calls queued behind long matmuls, the host
ahead as in a step, between two CUDA events), less the device's own time per kernel
(``measure_kernel_floor``); the host's call is on the host's clock (``host_op_costs``).
Timed by the host instead, each call a synchronize, mid-size points came out host-bound (a
2048 bf16 matmul at 110 TFLOP/s on an H200).
Compute runs on as many threads as a rank of the local launcher uses (one on the CPU,
runtime/launch), so a CPU profile prices what a gloo rank computes. What one machine
cannot show comes from the base profile (``--base``) and the source says so: the
inter-node link, the memory reserve, and ``all_reduce_algorithms``.
"""

from __future__ import annotations

import bisect
import dataclasses
import datetime
import functools
import itertools
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

# NOTE: torch.compile's aot_eager compiler: no public function compiles an fx graph to its
# boxed Python code (tests/unit/test_torch_internals.py)
from torch._dynamo.backends.debugging import boxed_nop
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile, record_function

from .api import compile as compile_step
from .api import plan as plan_model
from .core import Mesh, ops
from .core.precision import MixedPrecision
from .cost_models import (
    DeviceProfile,
    attention_flops,
    collective_time,
    get_profile,
    profiler_name,
    register_profile,
    runs_kernel,
)
from .models import GPT, GPTConfig, cross_entropy_loss, hf_llama, hf_logits_loss, lm_batch
from .runtime.launch import run_local

__all__ = ["Sample", "calibrate", "fit_link", "measure_collectives", "median_of_means"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
BURST, BURST_CALLS = 96, 50
"""The kernels before each timed collective: BURST_CALLS matmuls of BURST x BURST (about
0.9 ms on one CPU thread, as a zoo step runs between two collectives). On gloo the cost
of a small all-reduce depends on it: 0.55 ms after 0.02 ms of kernels, 0.7 ms after 0.2,
1.4 ms after 0.9 (measured on a 2-core VM with 2 ranks)."""
_DTYPES = ("float32", "float64", "bfloat16", "float16")

# (matmul sizes n, attention sequence lengths, collective bytes, repetitions, the seconds
# each curve's rounds spread over): full and quick
_PLANS = {
    "cpu": (
        (64, 128, 256, 512, 1024),
        (128, 256, 512, 1024),
        (2**12, 2**16, 2**20, 2**23),
        5,
        2.0,
    ),
    "cuda": (
        (256, 512, 1024, 2048, 4096, 8192),
        (512, 1024, 2048, 4096, 8192),
        (2**12, 2**16, 2**20, 2**24, 2**27),
        10,
        1.0,
    ),
    "quick": ((32, 64, 128), (64, 128), (2**12, 2**18, 2**22), 3, 0.0),
}

_BANDWIDTH_SIZES = {
    "cpu": (2**10, 2**12, 2**14, 2**16, 2**18, 2**20, 2**22, 2**24),
    "cuda": (2**12, 2**14, 2**16, 2**18, 2**20, 2**22, 2**24, 2**26),
    "quick": (2**10, 2**14, 2**18, 2**22),
}
"""Elements per tensor of the elementwise curve (``measure_bandwidth_curve``): on the CPU
float32, 4 KiB to 64 MiB, from the caches to memory; on CUDA bf16, 8 KiB to 128 MiB, from
kernels too small to fill the device to memory."""
ELEMENTWISE = 1 << 24
"""Elements of a layer's activation (a batch of 8192 tokens of 2048): on CUDA
``mem_bandwidth`` is the elementwise curve's rate there, the largest size at most this."""

ATTENTION_TOKENS = 16384
"""Tokens of the filling batch the CUDA attention curve also times (``measure_attention``)."""

Sample = tuple[str, int, float, float]
"""One collective measured: ``(kind, ranks, bytes as the cost model counts them, seconds)``."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _times(fn: Callable[[], object], device: torch.device, reps: int) -> list[float]:
    fn()  # warm-up (allocations, kernel selection)
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def median_of_means(samples: Sequence[float], groups: int = 5) -> float:
    """The median of the means of ``groups`` runs of consecutive ``samples``: the time a loop
    of the calls takes per call, its frequent slow calls included (a mean), that one rare
    stall (a page reclaim: 100 ms and more) cannot move (the median over the runs)."""
    runs = [r for r in np.array_split(np.asarray(samples, dtype=float), groups) if len(r)]
    return float(statistics.median(float(r.mean()) for r in runs))


def _median_time(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    return statistics.median(_times(fn, device, reps))


def _spread_times(
    fns: Sequence[Callable[[], object]], device: torch.device, reps: int, seconds: float
) -> list[list[float]]:
    """The seconds of each call of each of ``fns``, timed in rounds (each once a round,
    after an untimed call where it is short, so that it runs warm as a run of it does) until
    ``reps`` rounds and ``seconds`` have passed. A VM's speed drifts by 20-30% over seconds
    (its neighbours), and a curve timed at one go comes out shifted; rounds spread each
    point over the drift."""
    times: list[list[float]] = [[] for _ in fns]
    short = [True] * len(fns)
    start = time.perf_counter()
    while len(times[0]) < reps or time.perf_counter() - start < seconds:
        for i, fn in enumerate(fns):
            if short[i]:
                fn()  # the caches the round's other calls took
                _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[i].append(time.perf_counter() - t0)
            short[i] = times[i][-1] < 1e-3
    return times


def _spread_medians(
    fns: Sequence[Callable[[], object]], device: torch.device, reps: int, seconds: float
) -> list[float]:
    return [statistics.median(ts) for ts in _spread_times(fns, device, reps, seconds)]


def _kernel_times(
    fns: Sequence[Callable[[], object]],
    device: torch.device,
    reps: int,
    seconds: float,
    runs: Sequence[int] | None = None,
) -> list[float]:
    """Seconds per call of each of ``fns``, a kernel's time as a step pays it: on CUDA on the
    device's clock (``_queued_times``); on the CPU, where the host's call is the kernel's,
    the median of calls timed in rounds (``_spread_medians``), each a run of ``runs[i]``
    calls where given (a small kernel's run is long enough to time)."""
    if device.type == "cuda":
        return _queued_times(fns, device, reps, seconds)
    runs = runs or [1] * len(fns)
    repeated = [functools.partial(_repeat, fn, r) for fn, r in zip(fns, runs)]
    return [t / r for t, r in zip(_spread_medians(repeated, device, reps, seconds), runs)]


LEAD = 4096
"""The side of the bf16 matmuls ``_queued_times`` queues ahead of each timed run (about
0.2 ms each on an H100)."""
QUEUED_S = 2e-3
"""The device time ``_queued_times`` aims each timed run of calls at (at most 50 calls)."""


def _event():
    return torch.cuda.Event(enable_timing=True)


def _queued_times(
    fns: Sequence[Callable[[], object]], device: torch.device, reps: int, seconds: float
) -> list[float]:
    """CUDA: the device's seconds per call of each of ``fns`` as a step runs its kernels,
    the host ahead: a run of calls (about ``QUEUED_S`` of device time, 1 to 50 calls)
    queued behind enough ``LEAD`` matmuls that the host has queued the whole run before
    they end, timed between two CUDA events and divided by its calls; the median over
    rounds (each fn once a round) until ``reps`` rounds and ``seconds`` have passed.

    The host's call is not in it: on a GPU the cost model keeps that on the host's clock
    (core/schedule), and a curve timed by the host (each call then a synchronize) came out
    host-bound at mid sizes: a 2048 bf16 matmul at 110 TFLOP/s, where the step's run at
    several times that."""
    x = torch.randn(LEAD, LEAD, device=device).to(torch.bfloat16)
    lead_s = _median_time(lambda: torch.mm(x, x), device, 5)
    plans = []
    for fn in fns:
        fn()  # warm-up (allocations, kernel selection)
        _sync(device)
        t0 = time.perf_counter()
        fn()
        host = time.perf_counter() - t0  # the call returns once queued
        _sync(device)
        alone = time.perf_counter() - t0
        runs = max(1, min(50, math.ceil(QUEUED_S / alone)))
        plans.append((runs, math.ceil(1.5 * runs * host / lead_s) + 1))
    start, end = _event(), _event()
    times: list[list[float]] = [[] for _ in fns]
    began = time.perf_counter()
    while len(times[0]) < reps or time.perf_counter() - began < seconds:
        for fn, (runs, leads), out in zip(fns, plans, times):
            for _ in range(leads):
                torch.mm(x, x)
            start.record()
            for _ in range(runs):
                fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) * 1e-3 / runs)
    return [statistics.median(t) for t in times]


def measure_launch(device: torch.device, reps: int = 200) -> float:
    """Seconds of one one-element add (per op, over a run of them)."""
    x = torch.ones(1, device=device)
    runs = 50

    def many():
        for _ in range(runs):
            torch.add(x, 1.0)

    return _median_time(many, device, max(3, reps // runs)) / runs


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


def measure_kernel_floor(device: torch.device, reps: int = 10) -> float:
    """The device's seconds per one-element add queued behind a long matmul (the host
    ahead, as in a step of large kernels): a kernel's own start, run and gap to the next,
    without the host's call (``DeviceProfile.kernel_launch`` on a GPU)."""
    runs = 200
    x = torch.ones(1, device=device)
    big = torch.randn(4096, 4096, device=device)

    def queued(adds: int):
        def run():
            for _ in range(4):  # long enough that the host queues every add before it ends
                torch.mm(big, big)
            for _ in range(adds):
                torch.add(x, 1.0)

        return run

    alone, with_adds = _spread_medians([queued(0), queued(runs)], device, reps, 0.0)
    return max(with_adds - alone, 0.0) / runs


def measure_bandwidth_curve(
    device: torch.device, sizes: Sequence[int], reps: int, launch: float, seconds: float = 0.0
) -> tuple[tuple[float, float], ...]:
    """``((bytes one call moves, bytes/s), ...)`` of the elementwise kernels a step runs
    most, on tensors of each of ``sizes`` elements, timed in rounds over at least ``seconds``
    (``_kernel_times``): on the CPU float32 (``[n / 256, 256]``) an add, a multiply by a
    broadcast row (a norm's weight) and a copy; on CUDA those a bf16 mixed-precision step
    runs (``[n / 2048, 2048]``): an add, a multiply by a broadcast row, a cast from float32.
    Per size, the harmonic mean of their rates (a step pays each kernel's time), each its
    bytes over its time less ``launch`` (the cost model adds the op's call back, as for a
    matmul: ``_rate``), at the mean bytes of the three calls
    (``DeviceProfile.bandwidth_curve``)."""
    cuda = device.type == "cuda"
    width, dtype = (2048, torch.bfloat16) if cuda else (256, torch.float32)
    calls, moved, runs = [], [], []
    for n in sizes:
        rows = max(n // width, 1)
        a, b = (torch.randn(rows, width, device=device).to(dtype) for _ in range(2))
        w = torch.randn(width, device=device).to(dtype)
        third: tuple[Callable[[], object], int]
        if cuda:  # a cast of float32 (twice a's bytes) into bf16
            wide = torch.randn(rows, width, device=device)
            third = (functools.partial(wide.to, dtype), wide.nbytes + a.nbytes)
        else:
            third = (a.clone, 2 * a.nbytes)
        for fn, nbytes in (
            (functools.partial(torch.add, a, b), 3 * a.nbytes),
            (functools.partial(torch.mul, a, w), 2 * a.nbytes + w.nbytes),
            third,
        ):
            calls.append(fn)
            moved.append(nbytes)
            runs.append(max(1, min(64, (1 << 20) // n)))  # on the CPU, a run long enough to time
    times = _kernel_times(calls, device, reps, seconds, runs)
    curve = []
    for i in range(0, len(calls), 3):
        rates = [_rate(nbytes, t, launch) for nbytes, t in zip(moved[i : i + 3], times[i : i + 3])]
        curve.append((sum(moved[i : i + 3]) / 3, len(rates) / sum(1 / r for r in rates)))
    return tuple(curve)


def _repeat(fn: Callable[[], object], runs: int) -> None:
    for _ in range(runs):
        fn()


def measure_bandwidth(device: torch.device, numel: int, reps: int) -> float:
    """Bytes/s of cloning a float32 tensor of ``numel`` elements (read + write)."""
    x = torch.empty(numel, device=device).fill_(1.0)
    t = _median_time(lambda: x.clone(), device, reps)
    return 2 * numel * 4 / t


def _rate(flops: float, seconds: float, launch: float) -> float:
    # the fixed cost of the call is priced apart (kernel_launch): the rate is what remains
    return flops / max(seconds - launch, seconds / 2)


def measure_matmul(
    device: torch.device,
    dtype: torch.dtype,
    sizes: Sequence[int],
    reps: int,
    launch: float,
    seconds: float = 0.0,
) -> tuple[tuple[float, float], ...]:
    """``((2 n^3, FLOP/s), ...)`` of n x n matmuls in ``dtype``, timed in rounds over at
    least ``seconds`` (``_spread_medians``)."""
    calls = []
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        calls.append(functools.partial(torch.mm, a, b))
    times = _kernel_times(calls, device, reps, seconds)
    return tuple((2.0 * n**3, _rate(2.0 * n**3, t, launch)) for n, t in zip(sizes, times))


def measure_attention(
    device: torch.device,
    dtype: torch.dtype,
    seqs: Sequence[int],
    reps: int,
    launch: float,
    seconds: float = 0.0,
) -> tuple[tuple[tuple[float, float], ...], tuple[tuple[float, float], ...]]:
    """Forward and backward ``(FLOPs, FLOP/s)`` points of autopar's causal sdpa, 8 heads of
    64, timed in rounds over at least ``seconds`` (``_spread_medians``): batch 1 at each
    length, and on CUDA also the batch of ``ATTENTION_TOKENS`` tokens (a training batch
    fills the device; one sequence of 512 runs on a few of its multiprocessors)."""
    calls, flops = [], []
    shapes = [(1, s) for s in seqs]
    if device.type == "cuda":
        shapes += [(ATTENTION_TOKENS // s, s) for s in seqs if ATTENTION_TOKENS // s > 1]
    for batch, s in shapes:
        shape = (batch, 8, s, 64)
        q, k, v = (torch.randn(shape, device=device).to(dtype) for _ in range(3))
        scale = 1 / math.sqrt(64)
        out, lse = ops.sdpa(q, k, v, None, True, scale)
        calls.append(functools.partial(ops.sdpa, q, k, v, None, True, scale))
        calls.append(
            functools.partial(ops.sdpa_backward, out, q, k, v, out, lse, None, True, scale)
        )
        flops.append(attention_flops(shape, shape, shape, True, backward=False))
        flops.append(attention_flops(shape, shape, shape, True, backward=True))
    points = [
        (f, _rate(f, t, launch)) for f, t in zip(flops, _kernel_times(calls, device, reps, seconds))
    ]
    return curve(points[0::2]), curve(points[1::2])


def curve(points: Sequence[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """``(FLOPs, FLOP/s)`` points in order of FLOPs, those of equal FLOPs (one long sequence
    and a batch of shorter ones) as one, at the geometric mean of their rates."""
    merged: dict[float, list[float]] = {}
    for flops, rate in points:
        merged.setdefault(flops, []).append(rate)
    return tuple(
        (f, rs[0] if len(rs) == 1 else statistics.geometric_mean(rs))
        for f, rs in sorted(merged.items())
    )


def _collective_rank(rank: int, world: int, sizes: Sequence[int], reps: int, device_type: str):
    """On every rank: each kind at each size, as the emitted step runs it (a functional
    collective and its ``wait_tensor``, passes/codegen); ``(kind, bytes, seconds)`` medians."""
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    default = dist.group.WORLD
    assert default is not None, "run by runtime.run_local, which initializes the group"
    group = default.group_name
    c10d = torch.ops._c10d_functional
    square = torch.randn(BURST, BURST, device=device)

    def burst():  # the kernels a step runs between two collectives
        for _ in range(BURST_CALLS):
            torch.mm(square, square)
        _sync(device)

    alone = median_of_means(_times(burst, device, 3 * reps))
    cases = []
    for kind, nbytes in itertools.product(KINDS, sizes):
        numel = max(world, nbytes // 4 // world * world)
        full = torch.ones(numel, device=device)
        part = torch.ones(numel // world, device=device)
        splits = [numel // world] * world
        calls = {
            "all_reduce": functools.partial(c10d.all_reduce, full, "sum", group),
            "all_gather": functools.partial(c10d.all_gather_into_tensor, part, world, group),
            "reduce_scatter": functools.partial(
                c10d.reduce_scatter_tensor, full, "sum", world, group
            ),
            "all_to_all": functools.partial(c10d.all_to_all_single, full, splits, splits, group),
        }
        cases.append((kind, numel * 4, calls[kind]))
    # NOTE: as a step issues them, each after the kernels before it, the kinds and sizes
    # mixed: on gloo a collective that follows another costs 2-3x one that follows a
    # barrier, and one that follows a burst of compute more again, by 0.3 to 1.5 ms on a
    # 2-core VM (the peer's and gloo's threads wait for a core the kernels held, or for an
    # idle core to wake); measured one kind and size at a time, the runs fell into one of
    # those costs each. The burst's own time, measured alone, is taken off.
    times: list[list[float]] = [[] for _ in cases]
    dist.barrier()
    for i in range(reps + 1):
        for k, (_, _, issue) in enumerate(cases):
            t0 = time.perf_counter()
            burst()
            c10d.wait_tensor(issue())
            _sync(device)
            if i:  # the first round is the warm-up
                times[k].append(time.perf_counter() - t0 - alone)
    # (at least a microsecond: the fit weighs relative errors, and taking the burst off a
    # collective shorter than its noise could leave nothing)
    return [
        (kind, nbytes, max(median_of_means(ts), 1e-6))
        for (kind, nbytes, _), ts in zip(cases, times)
    ]


def measure_collectives(
    nproc: int, sizes: Sequence[int], reps: int, *, device_type: str = "cpu"
) -> list[Sample]:
    """Every kind at every size on ``nproc`` local processes (gloo on the CPU, NCCL on CUDA);
    a sample's time is the slowest rank's median."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    per_rank = run_local(_collective_rank, nproc, tuple(sizes), reps, device_type, backend=backend)
    return [
        (kind, nproc, float(nbytes), max(r[i][2] for r in per_rank))
        for i, (kind, nbytes, _) in enumerate(per_rank[0])
    ]


LARGER = 16
"""How many times larger the messages are when the first sizes' times do not grow with
size (``measure_link``)."""

LINK_PASSES = {"cpu": 3, "cuda": 1, "quick": 1}
"""Passes of ``measure_collectives`` a calibration pools (``pool_samples``), spread over it.

NOTE: on gloo over a 2-core VM a pass's samples move with the machine's minute: five
passes back to back gave a 4 KiB all-gather 0.86 to 1.93 ms (each sample the median of 30
calls' means), and the profile fitted to each priced a 9 KiB one 1.08 to 1.83 ms (1.69x
apart; the other kinds 1.40-1.43x). The fit is not what moves: fitted per kind (a fixed
cost and a bandwidth each), the same passes spread as much (1.37-1.99x). The median of
three passes, over the ten ways to draw three of the five, spread 1.10-1.24x. On CUDA one
pass: each is a launch of NCCL ranks, and its spread is not measured."""


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


def pool_samples(passes: Sequence[Sequence[Sample]]) -> list[Sample]:
    """Each sample's median time over ``passes`` of ``measure_collectives`` (of the same
    kinds, rank counts and sizes, in the same order)."""
    if not passes:
        raise ValueError("no pass of collective samples to pool")
    first = passes[0]
    for other in passes[1:]:
        if [s[:3] for s in other] != [s[:3] for s in first]:
            raise ValueError("the passes measured different collectives")
    return [
        (k, n, b, statistics.median(p[i][3] for p in passes))
        for i, (k, n, b, _) in enumerate(first)
    ]


def measure_link(
    nproc: int,
    sizes: Sequence[int],
    reps: int,
    *,
    device_type: str = "cpu",
    log: Callable[[str], None] = lambda _: None,
    measured: Sequence[Sequence[Sample]] = (),
) -> tuple[list[Sample], tuple[float, float, float]]:
    """``measure_collectives`` and ``fit_link`` of it: of the passes ``measured`` already
    (of ``sizes``) pooled (``pool_samples``), else of one measured here. Where the times do
    not grow with size (on a busy machine a few MB's transfer can sit inside the noise of a
    collective's fixed cost: a quick calibration beside a test run), measured again with
    messages ``LARGER`` times larger, as many passes back to back, and those samples are
    the ones fitted and returned."""
    passes = list(measured) or [measure_collectives(nproc, sizes, reps, device_type=device_type)]
    samples = pool_samples(passes)
    try:
        return samples, fit_link(samples)
    except ValueError as e:
        larger = [s * LARGER for s in sizes]
        log(f"{e}; measuring {larger[0]}..{larger[-1]} bytes")
    samples = pool_samples(
        [measure_collectives(nproc, larger, reps, device_type=device_type) for _ in passes]
    )
    return samples, fit_link(samples)


def _terms(kind: str, n: int, nbytes: float) -> tuple[float, float, float]:
    """Coefficients of (overhead, latency, seconds per byte) in the ring model."""
    steps = n - 1
    if kind == "all_reduce":
        return 1.0, 2.0 * steps, 2.0 * steps / n * nbytes
    return 1.0, float(steps), steps / n * nbytes


def fit_link(samples: Sequence[Sample]) -> tuple[float, float, float]:
    """``(overhead_s, latency_s, bandwidth_Bps)`` of the ring model that best fits
    ``samples`` in relative error, every term >= 0 (each subset of the terms is solved by
    least squares, the best non-negative solution kept)."""
    if not samples:
        raise ValueError("no collective samples to fit")
    a = np.array([_terms(k, n, b) for k, n, b, _ in samples], dtype=float)
    t = np.array([s[3] for s in samples], dtype=float)
    a_rel, ones = a / t[:, None], np.ones(len(t))
    best: tuple[float, np.ndarray] | None = None
    for cols in itertools.chain.from_iterable(
        itertools.combinations(range(3), r) for r in (1, 2, 3)
    ):
        if 2 not in cols:  # without a bandwidth the model cannot grow with size
            continue
        x, *_ = np.linalg.lstsq(a_rel[:, cols], ones, rcond=None)
        if (x < 0).any():
            continue
        full = np.zeros(3)
        full[list(cols)] = x
        err = float(np.sum((a_rel @ full - 1.0) ** 2))
        if best is None or err < best[0]:
            best = (err, full)
    # the bandwidth must explain a part of the largest message's time, else it is noise
    largest = int(np.argmax(a[:, 2]))
    if best is None or best[1][2] * a[largest, 2] < 0.05 * t[largest]:
        raise ValueError(
            "the collective times do not grow with size: cannot fit a bandwidth "
            "(measure larger messages)"
        )
    overhead, latency, inv_bw = best[1]
    return float(overhead), float(latency), float(1.0 / inv_bw)


def kind_scales(
    samples: Sequence[Sample], overhead: float, latency: float, bandwidth: float
) -> tuple[tuple[str, float], ...]:
    """Per kind, the geometric mean of measured over fitted time across its samples
    (``DeviceProfile.collective_scale``): the fit is one link for every kind, and a
    library may run a kind by another algorithm than the ring."""
    logs: dict[str, list[float]] = {}
    for k, n, b, t in samples:
        fitted = collective_time(k, b, n, latency, bandwidth, overhead=overhead)
        if fitted > 0 and t > 0:
            logs.setdefault(k, []).append(math.log(t / fitted))
    return tuple((k, float(math.exp(statistics.mean(v)))) for k, v in sorted(logs.items()))


def link_errors(
    samples: Sequence[Sample],
    overhead: float,
    latency: float,
    bandwidth: float,
    scale: Sequence[tuple[str, float]] = (),
) -> list[float]:
    """Relative error of the fitted model (times ``scale``'s factor for the kind) on each
    sample (predicted / measured - 1)."""
    factor = dict(scale)
    return [
        factor.get(k, 1.0) * collective_time(k, b, n, latency, bandwidth, overhead=overhead) / t
        - 1.0
        for k, n, b, t in samples
    ]


def _memory_capacity(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def calibrate(
    *,
    base: str | None = None,
    name: str | None = None,
    nproc: int | None = None,
    quick: bool = False,
    device: str | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> tuple[DeviceProfile, dict]:
    """Measure this machine (module docstring); returns the profile and what was measured
    (the samples, the fit and its errors) for a report."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    base_profile = get_profile(base or ("h100" if dev.type == "cuda" else "cpu"))
    local = torch.cuda.device_count() if dev.type == "cuda" else None
    if nproc is None:  # two ranks, or the one GPU there is
        nproc = 2 if local is None else min(2, local)
    if nproc < 1 or (local is not None and nproc > local):
        raise ValueError(
            f"nproc {nproc}: between 1 and {local or 'any number of'} local ranks "
            f"({'one per GPU' if local is not None else 'gloo processes'})"
        )
    sizes, seqs, coll_sizes, reps, spread = _PLANS["quick" if quick else dev.type]
    # the link's passes (``LINK_PASSES``): one first, one between the kernels' measurements,
    # the rest where the link is fitted, so that they see the machine at different minutes
    link_passes: list[list[Sample]] = []
    passes = LINK_PASSES["quick" if quick else dev.type] if nproc > 1 else 0

    def link_pass() -> None:
        if len(link_passes) < passes:
            link_passes.append(
                measure_collectives(nproc, coll_sizes, 6 * reps, device_type=dev.type)
            )

    # the host's passes (``HOST_PASSES``): the chains read first, between the kernels'
    # measurements and after them, so that they see the host in its different speeds
    host_passes: list[tuple[float, ...]] = []
    host_count = HOST_PASSES["quick" if quick else dev.type]

    def host_pass() -> None:
        if len(host_passes) < host_count:
            op, view = measure_step_ops(dev, seconds=spread)
            # an op of a step costs at least a bare add's call, read in the same pass
            host_passes.append((max(measure_launch(dev), op), view))

    link_pass()
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)  # as a rank of the local launcher computes
    try:
        launch = measure_launch(dev)
        host_pass()
        log(f"kernel launch {launch * 1e6:.2f} us")
        # a kernel's rate is its time less the time the cost model adds per op: on the CPU
        # the call's (one clock); on CUDA the device's own time per kernel, on its clock
        floor = launch if dev.type == "cpu" else measure_kernel_floor(dev)
        numel = (1 << 22 if quick else 1 << 25) if dev.type == "cpu" else 1 << 28
        bandwidth = measure_bandwidth(dev, numel, reps)
        log(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s (a clone)")
        sizes_by = _BANDWIDTH_SIZES["quick" if quick else dev.type]
        by_size = measure_bandwidth_curve(dev, sizes_by, reps, floor, spread)
        log(
            "elementwise "
            + ("bf16" if dev.type == "cuda" else "float32")
            + " by bytes moved: "
            + ", ".join(f"{n / 2**10:,.0f} KiB {r / 1e9:.0f}" for n, r in by_size)
            + " GB/s"
        )
        if dev.type == "cuda":  # what the step's elementwise kernels reach at a layer's size
            bandwidth = by_size[max(i for i, n in enumerate(sizes_by) if n <= ELEMENTWISE)][1]
            log(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s (elementwise, bf16)")
        link_pass()
        host_pass()
        rates, peaks = [], []
        for dtype_name in _DTYPES:
            dtype = getattr(torch, dtype_name)
            curve = measure_matmul(dev, dtype, sizes, reps, floor, spread)
            rates.append(("matmul", dtype_name, curve))
            peaks.append((dtype_name, max(r for _, r in curve)))
            log(f"matmul {dtype_name}: " + ", ".join(f"{r / 1e9:.0f}" for _, r in curve) + " GF/s")
        host_pass()
        attn_dtypes = ("float32",) if dev.type == "cpu" else ("bfloat16", "float16", "float32")
        for dtype_name in attn_dtypes:
            fwd, bwd = measure_attention(dev, getattr(torch, dtype_name), seqs, reps, floor, spread)
            rates += [("attention", dtype_name, fwd), ("attention_backward", dtype_name, bwd)]
            log(
                f"attention {dtype_name}: fwd {fwd[-1][1] / 1e9:.0f}, bwd {bwd[-1][1] / 1e9:.0f} GF/s"
            )
        while len(host_passes) < host_count:
            host_pass()
        step_op, view_op = pool_host(host_passes)
        log(
            f"{step_op * 1e6:.2f} us per op of a step, {view_op * 1e6:.2f} us per view (the "
            f"mean of {len(host_passes)} passes: "
            + ", ".join(f"{p[0] * 1e6:.2f}" for p in host_passes)
            + " us per op)"
        )
    finally:
        torch.set_num_threads(threads)
    host_ops: dict[str, float] = {}
    kernel_launch, host_launch = step_op, 0.0  # one clock (the CPU): the op's call in it
    if dev.type == "cuda":  # the host runs ahead of the device: two clocks (core/schedule)
        kernel_launch, host_launch = floor, step_op
        host_ops = measure_host_ops(step_op, view_op, reps, dev.type, host_count)
        log(
            f"device time per kernel {kernel_launch * 1e6:.2f} us; host per node of "
            + ", ".join(f"{k} {t * 1e6:.1f}" for k, t in host_ops.items())
            + " us"
        )
    samples: list[Sample] = []
    errors: list[float] = []
    overhead, latency, link_bw = (
        base_profile.collective_overhead,
        base_profile.intra_node_latency,
        base_profile.intra_node_bandwidth,
    )
    scale = base_profile.collective_scale
    if nproc > 1:  # one rank has no link to measure (a one-GPU machine): the base's
        # collectives vary most from call to call (a peer and threads sharing the cores)
        while len(link_passes) < passes:
            link_pass()
        samples, (overhead, latency, link_bw) = measure_link(
            nproc, coll_sizes, 6 * reps, device_type=dev.type, log=log, measured=link_passes
        )
        scale = kind_scales(samples, overhead, latency, link_bw)
        errors = link_errors(samples, overhead, latency, link_bw, scale)
        log(
            f"collectives on {nproc} ranks (the median of {len(link_passes)} passes): "
            f"overhead {overhead * 1e6:.1f} us, step latency {latency * 1e6:.1f} us, "
            f"bandwidth {link_bw / 1e9:.2f} GB/s, by kind x "
            + ", ".join(f"{k} {f:.2f}" for k, f in scale)
            + f" (fit error at most {max(abs(e) for e in errors):.0%})"
        )
    else:
        log(f"one rank: no link to measure; the intra-node link is {base_profile.name!r}'s")
    host = platform.node() or "this machine"
    capacity = _memory_capacity(dev)
    priced = dataclasses.replace(
        base_profile,
        name=name or f"{dev.type}-{host}",
        peak_flops=tuple(peaks),
        kernel_rates=tuple(rates),
        mem_bandwidth=bandwidth,
        bandwidth_curve=by_size,
        mem_capacity=capacity,
        mem_reserve=min(base_profile.mem_reserve, capacity / 4),
        kernel_launch=kernel_launch,
        view_launch=view_op,
        host_launch=host_launch,
        host_op_costs=tuple(host_ops.items()),
        intra_node_latency=latency,
        intra_node_bandwidth=link_bw,
        collective_overhead=overhead,
        collective_scale=scale,
    )
    step_overhead, param_overhead, roofline_scale = measure_runtime(
        step_op,
        view_op,
        10 * reps,
        host_count * spread,  # the host's passes' worth of seconds (``HOST_PASSES``)
        nproc if dev.type == "cpu" else 1,
        dev.type,
        host_ops,
        priced if dev.type == "cpu" else None,
        groups=1 if dev.type == "cuda" else 5,  # the mean over the host's two speeds
    )
    log(
        f"runtime per step {step_overhead * 1e6:.0f} us and {param_overhead * 1e6:.1f} us "
        f"per parameter; a step's kernels at {roofline_scale:.2f} times the curves' time"
    )
    what = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor()
    when = datetime.date.today().isoformat()
    profile = dataclasses.replace(
        priced,
        roofline_scale=roofline_scale,
        step_overhead=step_overhead,
        param_overhead=param_overhead,
        ranks_per_node=(
            torch.cuda.device_count() if dev.type == "cuda" else base_profile.ranks_per_node
        ),
        source=(
            f"autopar calibrate on {host} ({what or dev.type}), {when}, torch "
            f"{torch.__version__}{', quick' if quick else ''}: matmul and attention curves, "
            f"memory bandwidth{' (and by size)' if by_size else ''}, kernel launch, the "
            f"host time of views and of the runtime per step"
            f"{', and per op (the host runs ahead of the device)' if host_ops else ''}"
            f"{', and the step kernels against the curves' if roofline_scale != 1 else ''} "
            + (
                f"and the intra-node link ({'NCCL' if dev.type == 'cuda' else 'gloo'}, "
                f"{nproc} ranks) measured; the inter-node link"
                if nproc > 1
                else "measured (one rank); the intra-node and inter-node links"
            )
            + f", the memory reserve and the all-reduce algorithms are profile "
            f"{base_profile.name!r}'s"
        ),
    )
    report = {
        "device": str(dev),
        "threads": 1 if dev.type == "cpu" else None,
        "step_op": step_op,
        "view_op": view_op,
        "step_op_passes": [p[0] for p in host_passes],
        "roofline_scale": roofline_scale,
        "collectives": [
            {"kind": k, "ranks": n, "bytes": b, "seconds": t, "fit_error": e}
            for (k, n, b, t), e in zip(samples, errors)
        ],
    }
    return profile, report

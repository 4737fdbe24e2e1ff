"""How calibrate times a call: the harness every measurement of autopar/calibration uses.

The kernel curves and the per-op and per-view costs (not the host's table per op,
calibration/host.py) are medians of calls timed in rounds (each curve's points taken in
turn, ``_spread_medians``) spread over a second or two: a VM's speed drifts by 20-30% over
seconds, and a curve timed point after point came out shifted by it. The launch cost and
the memory bandwidth are medians of calls timed one after another (``_median_time``).

On CUDA the curves are timed on the device's clock (``_queued_times``: runs of calls queued
behind long matmuls, the host ahead as in a step, between two CUDA events); the host's call
is on the host's clock (calibration/host.py). Timed by the host instead, each call a
synchronize, mid-size points came out host-bound (a 2048 bf16 matmul at 110 TFLOP/s on an
H200).

A loop's time per call, its frequent slow calls included and a rare stall left out, is
``median_of_means``.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

__all__ = ["LEAD", "QUEUED_S", "median_of_means"]


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


def _repeat(fn: Callable[[], object], runs: int) -> None:
    for _ in range(runs):
        fn()


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

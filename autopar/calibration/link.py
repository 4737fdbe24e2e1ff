"""The intra-node link: collectives measured on local processes, as the step runs them.

    the intra-node link N local processes run all_reduce, all_gather, reduce_scatter and
                        all_to_all at sizes from KiB to MiB, as the step runs them
                        (functional collectives, each waited for, each after a burst of
                        kernels whose time alone is taken off), the mean of the calls (a
                        step pays every call: on gloo over a VM's cores a sub-ms call
                        takes a scheduler tick, 4 ms, one time in five or so, and its mean
                        is 2-3x its median), as ``median_of_means``; on the CPU in three
                        passes spread over the calibration, each sample the median of
                        its passes (``LINK_PASSES``, ``pool_samples``: a pass moves with
                        the machine's minute); the ring model is fitted to them
                        (calibration/fit.py), giving ``collective_overhead``,
                        ``intra_node_latency`` and ``intra_node_bandwidth`` (where the
                        times do not grow with size, a busy machine's noise, measured
                        again with messages ``LARGER`` times larger: ``measure_link``);
                        with one rank (a one-GPU machine) there is no link to measure, and
                        the base profile's stays

gloo runs the collectives on the CPU, NCCL on CUDA devices; a sample's time is the slowest
rank's.
"""

from __future__ import annotations

import functools
import itertools
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..runtime.launch import run_local
from .fit import Sample, fit_link
from .timing import _sync, _times, median_of_means

__all__ = [
    "BURST",
    "BURST_CALLS",
    "KINDS",
    "LARGER",
    "LINK_PASSES",
    "measure_collectives",
    "measure_link",
    "pool_samples",
]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
BURST, BURST_CALLS = 96, 50
"""The kernels before each timed collective: BURST_CALLS matmuls of BURST x BURST (about
0.9 ms on one CPU thread, as a zoo step runs between two collectives). On gloo the cost
of a small all-reduce depends on it: 0.55 ms after 0.02 ms of kernels, 0.7 ms after 0.2,
1.4 ms after 0.9 (measured on a 2-core VM with 2 ranks)."""


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

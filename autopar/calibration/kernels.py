"""The kernels' side of a device profile: the matmul and attention curves, the memory
bandwidth and the fixed cost of a kernel, each measured after warm-up.

    matmul curves       torch.mm of n x n by n x n, per dtype, for growing n: points
                        (2 n^3 FLOPs, FLOP/s) of ``kernel_rates["matmul"]``; the fastest rate
                        of each dtype is its ``peak_flops`` (``measure_matmul``)
    attention curves    autopar's sdpa and sdpa_backward (the kernels the emitted step runs,
                        core/ops.py) for growing sequence lengths, causal, batch 1 (and on
                        CUDA a batch of 16384 tokens too): points of
                        ``kernel_rates["attention"]`` / ``["attention_backward"]``
                        (``measure_attention``)
    mem_bandwidth       a clone of a large tensor: bytes read + written over its time
                        (``measure_bandwidth``); on CUDA, the elementwise curve below at a
                        layer's size instead (``ELEMENTWISE``), which reaches about three
                        fifths of a clone's
    bandwidth_curve     the elementwise kernels a step runs most, by the bytes one call
                        moves (``measure_bandwidth_curve``): on the CPU float32 (an add, a
                        multiply by a broadcast row, a copy) on 4 KiB to 64 MiB tensors. A
                        small step's tensors stay in the caches: on a 2-core VM they ran at
                        ~150 GB/s at 256 KiB and ~4 GB/s at 64 MiB, where the clone above
                        gives ~4; priced at the clone's, a zoo step's adds and multiplies
                        came out six times their time. On CUDA bf16 (an add, a multiply by
                        a broadcast row, a cast from float32) on 8 KiB to 128 MiB: a small
                        kernel does not fill the device
    kernel_launch       on the CPU, a one-element add (``measure_launch``), as the emitted
                        step runs one op of its graph (calibration/host.py's
                        ``measure_step_ops``): the fixed cost of an op, the one clock's; on
                        CUDA, where the host runs ahead of the device, the device's own
                        time per kernel: one-element adds queued behind long matmuls
                        (``measure_kernel_floor``)

Each is timed as calibration/timing.py says: the curves in rounds spread over a second or
two, on CUDA on the device's clock. A kernel's rate is its FLOPs (bytes) over its time less
what the cost model adds back per op (``_rate``), so small kernels are not charged it twice.
On the CPU that is the call's cost (``kernel_launch``, one clock); on CUDA the device's own
time per kernel (``measure_kernel_floor``).
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Sequence

import torch

from ..core import ops
from ..cost_models import attention_flops
from .timing import _kernel_times, _median_time, _spread_medians

__all__ = [
    "ATTENTION_TOKENS",
    "BANDWIDTH_SIZES",
    "ELEMENTWISE",
    "curve",
    "measure_attention",
    "measure_bandwidth",
    "measure_bandwidth_curve",
    "measure_kernel_floor",
    "measure_launch",
    "measure_matmul",
]

BANDWIDTH_SIZES = {
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


def measure_launch(device: torch.device, reps: int = 200) -> float:
    """Seconds of one one-element add (per op, over a run of them)."""
    x = torch.ones(1, device=device)
    runs = 50

    def many():
        for _ in range(runs):
            torch.add(x, 1.0)

    return _median_time(many, device, max(3, reps // runs)) / runs


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

"""``autopar calibrate``: measure this machine's kernels and links into a device profile.

The cost model (cost_models) prices a plan with a ``DeviceProfile``. The built-in ones hold
datasheet peaks and published measurements; this module measures the machine it runs on
(the CPU with gloo, or CUDA devices with NCCL) and writes a profile JSON that ``autopar plan
--profile PATH`` and ``autopar.load_profile(PATH)`` take.

What is measured, each after warm-up (each module's docstring says how, and why so):

    matmul and attention curves, mem_bandwidth, bandwidth_curve, kernel_launch
                        calibration/kernels.py
    the intra-node link (collective_overhead, intra_node_latency, intra_node_bandwidth,
    collective_scale)   calibration/link.py measures collectives on N local processes;
                        calibration/fit.py fits the cost model's ring model to them
    the host's time (view_launch, host_launch, host_op_costs, step_overhead,
    param_overhead, roofline_scale)
                        calibration/host.py
    how a call is timed calibration/timing.py: in rounds spread over seconds, on CUDA on
                        the device's clock
    the profile written calibration/profile.py

``calibrate`` runs them in this order: a link pass; the kernels (the launch, the memory,
the matmul curves, the attention curves) with the host's passes and a second link pass
between them (``_Spread``: each sees the machine at another minute); the host's terms
(``_host_terms``); the link's fit (``_link``); then the runtime's steps, priced by the
profile so far (``_runtime``).

Compute runs on as many threads as a rank of the local launcher uses (one on the CPU,
runtime/launch), so a CPU profile prices what a gloo rank computes. What one machine
cannot show comes from the base profile (``--base``) and the source says so: the
inter-node link, the memory reserve, and ``all_reduce_algorithms``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from .calibration.fit import Sample, fit_link, kind_scales, link_errors
from .calibration.host import (
    HOST_GAP_S,
    HOST_PASSES,
    host_table,
    measure_host_ops,
    measure_runtime,
    measure_step_ops,
    pool_host,
    pool_tables,
    runtime_terms,
)
from .calibration.kernels import (
    ATTENTION_TOKENS,
    BANDWIDTH_SIZES,
    ELEMENTWISE,
    curve,
    measure_attention,
    measure_bandwidth,
    measure_bandwidth_curve,
    measure_kernel_floor,
    measure_launch,
    measure_matmul,
)
from .calibration.link import (
    BURST,
    BURST_CALLS,
    KINDS,
    LARGER,
    LINK_PASSES,
    measure_collectives,
    measure_link,
    pool_samples,
)
from .calibration.profile import (
    HostMeasures,
    KernelMeasures,
    LinkMeasures,
    calibrated_profile,
    calibration_report,
    measured_profile,
)
from .calibration.timing import LEAD, QUEUED_S, median_of_means
from .cost_models import DeviceProfile, get_profile

__all__ = [
    "ATTENTION_TOKENS",
    "BURST",
    "BURST_CALLS",
    "ELEMENTWISE",
    "HOST_GAP_S",
    "HOST_PASSES",
    "KINDS",
    "LARGER",
    "LEAD",
    "LINK_PASSES",
    "QUEUED_S",
    "Sample",
    "calibrate",
    "curve",
    "fit_link",
    "host_table",
    "kind_scales",
    "link_errors",
    "measure_attention",
    "measure_bandwidth",
    "measure_bandwidth_curve",
    "measure_collectives",
    "measure_host_ops",
    "measure_kernel_floor",
    "measure_launch",
    "measure_link",
    "measure_matmul",
    "measure_runtime",
    "measure_step_ops",
    "median_of_means",
    "pool_host",
    "pool_samples",
    "pool_tables",
    "runtime_terms",
]

Log = Callable[[str], None]
"""Where calibrate writes a line of progress."""

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


@dataclasses.dataclass
class _Spread:
    """The passes a calibration spreads over its length, each call of ``link`` or ``host``
    one more until there are ``link_count`` (``host_count``): the link's
    (``LINK_PASSES``: one first, one between the kernels' measurements, the rest where the
    link is fitted, so that they see the machine at different minutes) and the host's
    chains (``HOST_PASSES``: first, between the kernels' measurements and after them, so
    that they see the host in its different speeds)."""

    device: torch.device
    nproc: int
    coll_sizes: tuple[int, ...]
    reps: int
    spread: float
    link_count: int
    host_count: int
    link_passes: list[list[Sample]] = dataclasses.field(default_factory=list)
    host_passes: list[tuple[float, float]] = dataclasses.field(default_factory=list)

    def link(self) -> None:
        if len(self.link_passes) < self.link_count:
            self.link_passes.append(
                measure_collectives(
                    self.nproc, self.coll_sizes, 6 * self.reps, device_type=self.device.type
                )
            )

    def host(self) -> None:
        if len(self.host_passes) < self.host_count:
            op, view = measure_step_ops(self.device, seconds=self.spread)
            # an op of a step costs at least a bare add's call, read in the same pass
            self.host_passes.append((max(measure_launch(self.device), op), view))


def _ranks(dev: torch.device, nproc: int | None) -> int:
    """The ranks the link is measured on: ``nproc``, else two (or the one GPU there is)."""
    local = torch.cuda.device_count() if dev.type == "cuda" else None
    if nproc is None:
        nproc = 2 if local is None else min(2, local)
    if nproc < 1 or (local is not None and nproc > local):
        raise ValueError(
            f"nproc {nproc}: between 1 and {local or 'any number of'} local ranks "
            f"({'one per GPU' if local is not None else 'gloo processes'})"
        )
    return nproc


def _memory(
    dev: torch.device, quick: bool, reps: int, floor: float, spread: float, log: Log
) -> tuple[float, tuple[tuple[float, float], ...]]:
    """``(mem_bandwidth, bandwidth_curve)``: a clone's bytes/s (on CUDA the elementwise
    curve's at a layer's size, ``ELEMENTWISE``) and the elementwise curve."""
    numel = (1 << 22 if quick else 1 << 25) if dev.type == "cpu" else 1 << 28
    bandwidth = measure_bandwidth(dev, numel, reps)
    log(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s (a clone)")
    sizes_by = BANDWIDTH_SIZES["quick" if quick else dev.type]
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
    return bandwidth, by_size


def _matmul_curves(
    dev: torch.device, sizes: Sequence[int], reps: int, floor: float, spread: float, log: Log
) -> tuple[list, list]:
    """``(kernel_rates, peak_flops)`` entries of the matmul curve of each dtype."""
    rates, peaks = [], []
    for dtype_name in _DTYPES:
        points = measure_matmul(dev, getattr(torch, dtype_name), sizes, reps, floor, spread)
        rates.append(("matmul", dtype_name, points))
        peaks.append((dtype_name, max(r for _, r in points)))
        log(f"matmul {dtype_name}: " + ", ".join(f"{r / 1e9:.0f}" for _, r in points) + " GF/s")
    return rates, peaks


def _attention_curves(
    dev: torch.device, seqs: Sequence[int], reps: int, floor: float, spread: float, log: Log
) -> list:
    """``kernel_rates`` entries of the attention curves: float32 on the CPU, the half
    types and float32 on CUDA."""
    rates = []
    attn_dtypes = ("float32",) if dev.type == "cpu" else ("bfloat16", "float16", "float32")
    for dtype_name in attn_dtypes:
        fwd, bwd = measure_attention(dev, getattr(torch, dtype_name), seqs, reps, floor, spread)
        rates += [("attention", dtype_name, fwd), ("attention_backward", dtype_name, bwd)]
        log(f"attention {dtype_name}: fwd {fwd[-1][1] / 1e9:.0f}, bwd {bwd[-1][1] / 1e9:.0f} GF/s")
    return rates


def _kernels(
    dev: torch.device,
    quick: bool,
    sizes: Sequence[int],
    seqs: Sequence[int],
    passes: _Spread,
    log: Log,
) -> KernelMeasures:
    """The kernels' terms, with a host pass after the launch, a link and a host pass after
    the memory's and a host pass after the matmuls'."""
    reps, spread = passes.reps, passes.spread
    launch = measure_launch(dev)
    passes.host()
    log(f"kernel launch {launch * 1e6:.2f} us")
    # a kernel's rate is its time less the time the cost model adds per op: on the CPU
    # the call's (one clock); on CUDA the device's own time per kernel, on its clock
    floor = launch if dev.type == "cpu" else measure_kernel_floor(dev)
    bandwidth, by_size = _memory(dev, quick, reps, floor, spread, log)
    passes.link()
    passes.host()
    rates, peaks = _matmul_curves(dev, sizes, reps, floor, spread, log)
    passes.host()
    rates += _attention_curves(dev, seqs, reps, floor, spread, log)
    return KernelMeasures(launch, floor, bandwidth, by_size, tuple(rates), tuple(peaks))


def _pooled_host(passes: _Spread, log: Log) -> tuple[float, float]:
    """The chains' ``(step_op, view_op)``: the mean of the host's passes, the last taken
    here (``pool_host``)."""
    while len(passes.host_passes) < passes.host_count:
        passes.host()
    step_op, view_op = pool_host(passes.host_passes)
    log(
        f"{step_op * 1e6:.2f} us per op of a step, {view_op * 1e6:.2f} us per view (the "
        f"mean of {len(passes.host_passes)} passes: "
        + ", ".join(f"{p[0] * 1e6:.2f}" for p in passes.host_passes)
        + " us per op)"
    )
    return step_op, view_op


def _host_terms(
    dev: torch.device, floor: float, step_op: float, view_op: float, passes: _Spread, log: Log
) -> HostMeasures:
    """The host's terms on the cost model's clocks: on the CPU one clock, the op's call in
    ``kernel_launch``; on CUDA the host runs ahead of the device (core/schedule), so
    ``kernel_launch`` is the device's time per kernel, ``host_launch`` the host's call, and
    the host's time per node of each op is measured (``measure_host_ops``)."""
    host_ops: dict[str, float] = {}
    kernel_launch, host_launch = step_op, 0.0
    if dev.type == "cuda":
        kernel_launch, host_launch = floor, step_op
        host_ops = measure_host_ops(step_op, view_op, passes.reps, dev.type, passes.host_count)
        log(
            f"device time per kernel {kernel_launch * 1e6:.2f} us; host per node of "
            + ", ".join(f"{k} {t * 1e6:.1f}" for k, t in host_ops.items())
            + " us"
        )
    step_op_passes = tuple(p[0] for p in passes.host_passes)
    return HostMeasures(
        step_op, view_op, step_op_passes, kernel_launch, host_launch, tuple(host_ops.items())
    )


def _link(base: DeviceProfile, passes: _Spread, log: Log) -> LinkMeasures:
    """The intra-node link fitted to the link's passes, the last taken here; with one rank
    (a one-GPU machine) there is no link to measure, and ``base``'s stays."""
    nproc = passes.nproc
    if nproc == 1:
        log(f"one rank: no link to measure; the intra-node link is {base.name!r}'s")
        return LinkMeasures(
            (),
            (),
            base.collective_overhead,
            base.intra_node_latency,
            base.intra_node_bandwidth,
            base.collective_scale,
        )
    # collectives vary most from call to call (a peer and threads sharing the cores)
    while len(passes.link_passes) < passes.link_count:
        passes.link()
    samples, (overhead, latency, link_bw) = measure_link(
        nproc,
        passes.coll_sizes,
        6 * passes.reps,
        device_type=passes.device.type,
        log=log,
        measured=passes.link_passes,
    )
    scale = kind_scales(samples, overhead, latency, link_bw)
    errors = link_errors(samples, overhead, latency, link_bw, scale)
    log(
        f"collectives on {nproc} ranks (the median of {len(passes.link_passes)} passes): "
        f"overhead {overhead * 1e6:.1f} us, step latency {latency * 1e6:.1f} us, "
        f"bandwidth {link_bw / 1e9:.2f} GB/s, by kind x "
        + ", ".join(f"{k} {f:.2f}" for k, f in scale)
        + f" (fit error at most {max(abs(e) for e in errors):.0%})"
    )
    return LinkMeasures(tuple(samples), tuple(errors), overhead, latency, link_bw, scale)


def _runtime(
    dev: torch.device, host: HostMeasures, priced: DeviceProfile, passes: _Spread, log: Log
) -> tuple[float, float, float]:
    """``(step_overhead, param_overhead, roofline_scale)`` (``measure_runtime``): timed over
    the host's passes' worth of seconds (``HOST_PASSES``); on the CPU on every rank, the
    GPT's compute priced by ``priced``; on CUDA on one rank, the plain mean over the host's
    two speeds."""
    cpu = dev.type == "cpu"
    step_overhead, param_overhead, roofline_scale = measure_runtime(
        host.step_op,
        host.view_op,
        10 * passes.reps,
        passes.host_count * passes.spread,
        passes.nproc if cpu else 1,
        dev.type,
        dict(host.host_ops),
        priced if cpu else None,
        groups=1 if dev.type == "cuda" else 5,  # the mean over the host's two speeds
    )
    log(
        f"runtime per step {step_overhead * 1e6:.0f} us and {param_overhead * 1e6:.1f} us "
        f"per parameter; a step's kernels at {roofline_scale:.2f} times the curves' time"
    )
    return step_overhead, param_overhead, roofline_scale


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
    nproc = _ranks(dev, nproc)
    mode = "quick" if quick else dev.type
    sizes, seqs, coll_sizes, reps, spread = _PLANS[mode]
    passes = _Spread(
        dev,
        nproc,
        coll_sizes,
        reps,
        spread,
        link_count=LINK_PASSES[mode] if nproc > 1 else 0,
        host_count=HOST_PASSES[mode],
    )
    passes.link()
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)  # as a rank of the local launcher computes
    try:
        kernels = _kernels(dev, quick, sizes, seqs, passes, log)
        step_op, view_op = _pooled_host(passes, log)
    finally:
        torch.set_num_threads(threads)
    host = _host_terms(dev, kernels.floor, step_op, view_op, passes, log)
    link = _link(base_profile, passes, log)
    priced = measured_profile(base_profile, name, dev, kernels, host, link)
    step_overhead, param_overhead, roofline_scale = _runtime(dev, host, priced, passes, log)
    profile = calibrated_profile(
        priced,
        base_profile,
        dev,
        step_overhead=step_overhead,
        param_overhead=param_overhead,
        roofline_scale=roofline_scale,
        nproc=nproc,
        quick=quick,
    )
    return profile, calibration_report(dev, host, link, roofline_scale)

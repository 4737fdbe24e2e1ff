"""The profile a calibration writes: its measurements laid over a base profile.

A ``DeviceProfile`` (cost_models) is built in two steps. ``measured_profile`` lays the
kernels' terms (calibration/kernels.py), the host's (calibration/host.py) and the link's
(calibration/link.py, calibration/fit.py) over the base profile; the runtime's terms are
measured with that profile pricing a step's compute (``measure_runtime``), and
``calibrated_profile`` adds them and the profile's ``source``. What one machine cannot show
stays the base profile's (``--base``) and the source says so: the inter-node link, the
memory reserve (at most a quarter of the measured capacity), ``all_reduce_algorithms``,
and with one rank the intra-node link too. ``calibration_report`` is what was measured
beside the profile, for ``autopar calibrate --json``.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform

import torch

from ..cost_models import DeviceProfile
from .fit import Sample

__all__ = [
    "HostMeasures",
    "KernelMeasures",
    "LinkMeasures",
    "calibrated_profile",
    "calibration_report",
    "measured_profile",
]

Curve = tuple[tuple[float, float], ...]
"""``((FLOPs or bytes, FLOP/s or bytes/s), ...)`` in increasing size."""


@dataclasses.dataclass(frozen=True, slots=True)
class KernelMeasures:
    """The kernels' terms of a profile (calibration/kernels.py)."""

    launch: float
    """Seconds of a one-element add's call (``measure_launch``)."""
    floor: float
    """Seconds the cost model adds back per kernel, taken off each curve's times: on the CPU
    ``launch`` (one clock), on CUDA the device's own time per kernel
    (``measure_kernel_floor``)."""
    mem_bandwidth: float
    """Bytes/s of the memory: a clone's, on CUDA the elementwise curve's at a layer's size."""
    bandwidth_curve: Curve
    """The elementwise kernels' bytes/s by the bytes one call moves."""
    kernel_rates: tuple[tuple[str, str, Curve], ...]
    """``(kind, dtype, curve)`` of the matmul and attention curves."""
    peak_flops: tuple[tuple[str, float], ...]
    """``(dtype, FLOP/s)``: the fastest rate of each dtype's matmul curve."""


@dataclasses.dataclass(frozen=True, slots=True)
class HostMeasures:
    """The host's terms of a profile (calibration/host.py), on the clock the cost model
    prices them on."""

    step_op: float
    """Seconds per op of the chain of adds run as the step runs its graph, the mean of the
    host's passes (``pool_host``)."""
    view_op: float
    """Seconds per view of the chain of views, likewise (``view_launch``)."""
    step_op_passes: tuple[float, ...]
    """``step_op`` of each pass, in the order taken."""
    kernel_launch: float
    """The profile's ``kernel_launch``: ``step_op`` on the CPU (one clock, the op's call in
    it); on CUDA the device's own time per kernel."""
    host_launch: float
    """The profile's ``host_launch``: 0 on the CPU; on CUDA ``step_op``, the host's call on
    its own clock."""
    host_ops: tuple[tuple[str, float], ...]
    """``(profiler name, seconds)``: the host's time per node of each op
    (``measure_host_ops``, CUDA only; empty on the CPU)."""


@dataclasses.dataclass(frozen=True, slots=True)
class LinkMeasures:
    """The intra-node link's terms of a profile (calibration/link.py, calibration/fit.py),
    or the base profile's where one rank has no link to measure."""

    samples: tuple[Sample, ...]
    """The collectives fitted (none with one rank)."""
    errors: tuple[float, ...]
    """Each sample's relative error under the fit and its kind's scale."""
    overhead: float
    """``collective_overhead``: seconds of a collective's fixed cost."""
    latency: float
    """``intra_node_latency``: seconds per ring step."""
    bandwidth: float
    """``intra_node_bandwidth``: bytes/s."""
    scale: tuple[tuple[str, float], ...]
    """``collective_scale``: per kind, measured over fitted time."""


def _host_name() -> str:
    return platform.node() or "this machine"


def _memory_capacity(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def measured_profile(
    base: DeviceProfile,
    name: str | None,
    device: torch.device,
    kernels: KernelMeasures,
    host: HostMeasures,
    link: LinkMeasures,
) -> DeviceProfile:
    """``base`` with the measured kernels', host's and link's terms and this machine's memory
    capacity, named ``name`` (else ``DEVICE-HOSTNAME``): the profile that prices the
    runtime's step, before the runtime's own terms are in it."""
    capacity = _memory_capacity(device)
    return dataclasses.replace(
        base,
        name=name or f"{device.type}-{_host_name()}",
        peak_flops=kernels.peak_flops,
        kernel_rates=kernels.kernel_rates,
        mem_bandwidth=kernels.mem_bandwidth,
        bandwidth_curve=kernels.bandwidth_curve,
        mem_capacity=capacity,
        mem_reserve=min(base.mem_reserve, capacity / 4),
        kernel_launch=host.kernel_launch,
        view_launch=host.view_op,
        host_launch=host.host_launch,
        host_op_costs=host.host_ops,
        intra_node_latency=link.latency,
        intra_node_bandwidth=link.bandwidth,
        collective_overhead=link.overhead,
        collective_scale=link.scale,
    )


def calibrated_profile(
    priced: DeviceProfile,
    base: DeviceProfile,
    device: torch.device,
    *,
    step_overhead: float,
    param_overhead: float,
    roofline_scale: float,
    nproc: int,
    quick: bool,
) -> DeviceProfile:
    """``priced`` (``measured_profile``) with the runtime's terms (``measure_runtime``), the
    ranks per node (the local GPUs; the base's on the CPU) and a ``source`` that says what
    was measured, where and when, and what is ``base``'s."""
    cuda = device.type == "cuda"
    what = torch.cuda.get_device_name(device) if cuda else platform.processor()
    when = datetime.date.today().isoformat()
    return dataclasses.replace(
        priced,
        roofline_scale=roofline_scale,
        step_overhead=step_overhead,
        param_overhead=param_overhead,
        ranks_per_node=torch.cuda.device_count() if cuda else base.ranks_per_node,
        source=(
            f"autopar calibrate on {_host_name()} ({what or device.type}), {when}, torch "
            f"{torch.__version__}{', quick' if quick else ''}: matmul and attention curves, "
            f"memory bandwidth{' (and by size)' if priced.bandwidth_curve else ''}, kernel "
            f"launch, the host time of views and of the runtime per step"
            f"{', and per op (the host runs ahead of the device)' if priced.host_op_costs else ''}"
            f"{', and the step kernels against the curves' if roofline_scale != 1 else ''} "
            + (
                f"and the intra-node link ({'NCCL' if cuda else 'gloo'}, "
                f"{nproc} ranks) measured; the inter-node link"
                if nproc > 1
                else "measured (one rank); the intra-node and inter-node links"
            )
            + f", the memory reserve and the all-reduce algorithms are profile "
            f"{base.name!r}'s"
        ),
    )


def calibration_report(
    device: torch.device, host: HostMeasures, link: LinkMeasures, roofline_scale: float
) -> dict:
    """What was measured beside the profile (the host's passes, the collectives fitted and
    each one's error), for a report; telemetry, which nothing reads back."""
    return {
        "device": str(device),
        "threads": 1 if device.type == "cpu" else None,
        "step_op": host.step_op,
        "view_op": host.view_op,
        "step_op_passes": list(host.step_op_passes),
        "roofline_scale": roofline_scale,
        "collectives": [
            {"kind": k, "ranks": n, "bytes": b, "seconds": t, "fit_error": e}
            for (k, n, b, t), e in zip(link.samples, link.errors)
        ],
    }

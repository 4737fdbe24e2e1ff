"""Device profiles: the hardware constants the cost models read, with their source.

A ``DeviceProfile`` holds what the roofline compute model (``cost_models.compute``) and the
alpha-beta communication model (``cost_models.comm``) need about one kind of accelerator and
its links. Nothing else in the cost models holds a hardware number: every constant lives in
``PROFILES`` beside the place it comes from (a datasheet, a published measurement, an
estimate said to be one, or ``autopar calibrate`` on the machine).

Units: seconds, bytes, bytes/s and FLOP/s everywhere.

Kernels whose speed depends on their size (``kernel_rates``): a GEMM reaches its peak only
when it is large (tile and wave quantization, the fixed cost of a launch), and a fused
attention kernel runs well below a GEMM's rate. A curve holds ``(FLOPs of one call,
sustained FLOP/s)`` points for one kind of kernel and dtype; ``kernel_rate`` interpolates it
linearly in log FLOPs and holds its end values outside it. A kind or dtype without a curve
runs at ``peak_flops``. The memory roof may have a curve the same way (``bandwidth_curve``,
by the bytes one call moves): where the caches hold a step's tensors (a CPU), its
elementwise kernels run many times faster than a copy of a large tensor.

Profiles:
    ``"h100"``: NVIDIA H100 SXM5 80GB in an 8-GPU HGX/DGX node, NVLink4 inside a node,
        one InfiniBand NDR NIC per GPU between nodes.
    ``"cpu"``: a rough profile of a small CPU box running gloo, for the CPU test setup only.
    A calibrated profile (``autopar calibrate``, a JSON file) joins them with
    ``register_profile(load_profile(path))``; the CLI's ``--profile PATH`` does that.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

__all__ = [
    "KERNEL_KINDS",
    "DeviceProfile",
    "PROFILES",
    "get_profile",
    "load_profile",
    "register_profile",
]

# Kernels priced by a size curve (``DeviceProfile.kernel_rates``); compute.kernel_kind maps
# ops to them.
KERNEL_KINDS = ("matmul", "attention", "attention_backward")
ALL_REDUCE_ALGORITHMS = ("ring", "tree")

Curve = tuple[tuple[float, float], ...]

# The dtypes every profile must price; others fall back to float32 (``flops_for``).
_REQUIRED_DTYPES = ("float64", "float32", "bfloat16", "float16")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """Hardware constants of one device kind and its links (see the module docstring)."""

    name: str
    """Profile name, the key in ``PROFILES`` and the value of ``Mesh.device``."""

    peak_flops: tuple[tuple[str, float], ...]
    """Peak FLOP/s per dtype as ``(dtype name, FLOP/s)`` pairs, dtype names as torch spells
    them without ``torch.`` (``"bfloat16"``). Dense (no sparsity) tensor-core numbers where
    the hardware has them. Must cover float64, float32, bfloat16 and float16."""

    mem_bandwidth: float
    """Device memory bandwidth in bytes/s (the roofline's memory roof; ``bandwidth_curve``
    by size where the profile has one)."""

    mem_capacity: float
    """Device memory capacity in bytes."""

    mem_reserve: float
    """Bytes of ``mem_capacity`` a plan may not count on: the CUDA context, the workspaces of
    NCCL and the GEMM libraries, and the caching allocator's rounding and fragmentation,
    none of which the step memory model (passes/memory) sees. ``usable_memory`` is the rest:
    the default memory budget per rank."""

    ranks_per_node: int
    """Ranks (devices) in one node; mesh axes whose ranks fit in one node use the intra-node
    link (``comm.axis_link``)."""

    intra_node_latency: float
    """Latency (alpha) of one step of a ring collective inside a node, in seconds."""

    intra_node_bandwidth: float
    """Per-device unidirectional bandwidth (beta^-1) of the intra-node link as seen by a ring
    collective, in bytes/s."""

    inter_node_latency: float
    """Latency (alpha) of one step of a ring collective between nodes, in seconds."""

    inter_node_bandwidth: float
    """Per-device unidirectional bandwidth of the inter-node link, in bytes/s."""

    kernel_launch: float
    """Fixed overhead added to every op that runs a kernel, in seconds: where the host runs
    ahead of the device (``host_launch`` > 0), the device's own time per kernel beyond its
    roofline (a kernel's start and tail, the gap to the next); else the host's call and the
    kernel's start together, on the one clock the step has (the CPU)."""

    source: str
    """Where the numbers come from (datasheet, measurement, estimate)."""

    kernel_rates: tuple[tuple[str, str, Curve], ...] = ()
    """Sustained FLOP/s by size, as ``(kind, dtype name, ((FLOPs of one call, FLOP/s), ...))``
    with ``kind`` in ``KERNEL_KINDS`` and the points in increasing FLOPs (module docstring).
    Without a curve a kernel runs at ``peak_flops``."""

    collective_overhead: float = 0.0
    """Fixed seconds of every collective call besides its ring or tree steps (the launch of
    its kernel and the handshake that starts it)."""

    all_reduce_algorithms: tuple[str, ...] = ("ring",)
    """Algorithms the collective library picks from for an all-reduce, the fastest for each
    size (NCCL: ring and tree; gloo: ring); see ``comm.collective_time``."""

    collective_scale: tuple[tuple[str, float], ...] = ()
    """Per collective kind, its measured time over the ring model's on this profile's link
    (``comm.collective_time``), where the library runs that kind by another algorithm than
    the ring (gloo's reduce_scatter costs about an all-reduce): ``(kind, factor)`` pairs,
    1 for a kind not listed (``collective_factor``)."""

    view_launch: float = 0.0
    """Host seconds of a graph node that runs no kernel (a view, ``getitem``) as the emitted
    step calls it: on the CPU on the step's one clock; where the host runs ahead of the
    device (``host_launch`` > 0), on the host's clock (core/schedule), taking none of the
    device's time."""

    step_overhead: float = 0.0
    """Host seconds of one step outside its graph's nodes (the runtime's boundary of local
    shards, aot_autograd's wrappers, the autograd engine), and ``param_overhead`` more per
    parameter (its local shard in, its gradient out as a DTensor and accumulated): on the
    CPU they are on the step's path; where the host runs ahead of the device, the host's
    clock starts at ``step_overhead`` and ends ``param_overhead`` per parameter after the
    last node is issued (the gradients come out of the backward graph together, each then
    wrapped and accumulated: core/schedule)."""

    param_overhead: float = 0.0
    """See ``step_overhead``."""

    host_launch: float = 0.0
    """Host seconds to issue one graph node that runs a kernel, where the host runs ahead
    of the device (CUDA: kernels are queued, the step's host and device are two clocks,
    core/schedule); ``host_op_costs`` per op where measured. 0: a profile with one clock
    (the CPU, where the host's call is in ``kernel_launch``), or one that does not price
    the host (the step is the device's alone)."""

    host_op_costs: tuple[tuple[str, float], ...] = ()
    """Host seconds per node of an op, by its name as torch's profiler spells it
    (``aten::mm``), where they differ from ``host_launch`` (a matmul's call costs about
    three of an add's, an attention kernel's ten or more): ``(name, seconds)`` pairs, used only
    where ``host_launch`` > 0."""

    bandwidth_curve: Curve = ()
    """The memory roof by size, where it depends on it: ``((bytes read + written by one
    call, bytes/s), ...)`` of the elementwise kernels a step runs, in increasing bytes
    (module docstring). A CPU's caches hold a small step's tensors: its adds reach ~150
    GB/s at 256 KiB and ~4 GB/s at 64 MiB (``autopar calibrate``). Without one, every size
    runs at ``mem_bandwidth``."""

    roofline_scale: float = 1.0
    """Each kernel's roofline time (``compute.compute_time``: FLOPs at the curve's rate, or
    bytes at the memory roof) times this. On the CPU a step's kernels run slower than the
    same kernels timed alone in a loop (the curves): their tensors come cold from memory
    and are freshly allocated; ``autopar calibrate`` measures the ratio on a small GPT's
    step (~2-3 on a 2-core VM). 1 where the curves are the step's (a GPU's, timed on its
    clock)."""

    overlaps_collectives: bool = True
    """Whether the emitted step can run a collective while kernels run (CUDA: NCCL on its
    own stream). passes/codegen overlaps a ring attention's shifts with its blocks only
    there; gloo on CPU is waited for at once, and passes/solve prices it so."""

    def __post_init__(self):
        names = [n for n, _ in self.peak_flops]
        if len(set(names)) != len(names):
            raise ValueError(f"profile {self.name!r}: peak_flops names a dtype twice: {names}")
        missing = [d for d in _REQUIRED_DTYPES if d not in names]
        if missing:
            raise ValueError(
                f"profile {self.name!r}: peak_flops has no entry for {missing}; "
                f"give FLOP/s for each of {_REQUIRED_DTYPES}"
            )
        positive = {
            "peak_flops": min(f for _, f in self.peak_flops),
            "mem_bandwidth": self.mem_bandwidth,
            "mem_capacity": self.mem_capacity,
            "usable_memory": self.usable_memory,
            "ranks_per_node": self.ranks_per_node,
            "intra_node_bandwidth": self.intra_node_bandwidth,
            "inter_node_bandwidth": self.inter_node_bandwidth,
            "roofline_scale": self.roofline_scale,
        }
        for field, value in positive.items():
            if not value > 0:
                raise ValueError(f"profile {self.name!r}: {field} must be > 0, got {value}")
        for field in (
            "intra_node_latency",
            "inter_node_latency",
            "kernel_launch",
            "view_launch",
            "step_overhead",
            "param_overhead",
            "host_launch",
        ):
            if getattr(self, field) < 0:
                raise ValueError(f"profile {self.name!r}: {field} must be >= 0")
        if self.collective_overhead < 0:
            raise ValueError(f"profile {self.name!r}: collective_overhead must be >= 0")
        ops = [k for k, _ in self.host_op_costs]
        if len(set(ops)) != len(ops) or any(not t >= 0 for _, t in self.host_op_costs):
            raise ValueError(
                f"profile {self.name!r}: host_op_costs needs each op once, with seconds >= 0"
            )
        kinds = [k for k, _ in self.collective_scale]
        if len(set(kinds)) != len(kinds) or any(not f > 0 for _, f in self.collective_scale):
            raise ValueError(
                f"profile {self.name!r}: collective_scale needs each kind once, with a "
                f"factor > 0; got {self.collective_scale}"
            )
        algos = self.all_reduce_algorithms
        if not algos or any(a not in ALL_REDUCE_ALGORITHMS for a in algos):
            raise ValueError(
                f"profile {self.name!r}: all_reduce_algorithms must be some of "
                f"{ALL_REDUCE_ALGORITHMS}, got {algos}"
            )
        seen = set()
        for kind, dtype_name, curve in self.kernel_rates:
            where = f"profile {self.name!r}: kernel_rates {kind}/{dtype_name}"
            if kind not in KERNEL_KINDS:
                raise ValueError(f"{where}: kind must be one of {KERNEL_KINDS}")
            if (kind, dtype_name) in seen:
                raise ValueError(f"{where}: given twice")
            seen.add((kind, dtype_name))
            works = [w for w, _ in curve]
            if not curve or any(not (w > 0 and r > 0) for w, r in curve):
                raise ValueError(f"{where}: needs points (FLOPs > 0, FLOP/s > 0)")
            if any(b <= a for a, b in zip(works, works[1:])):
                raise ValueError(f"{where}: FLOPs must increase from point to point")
        sizes = [n for n, _ in self.bandwidth_curve]
        if any(not (n > 0 and r > 0) for n, r in self.bandwidth_curve) or any(
            b <= a for a, b in zip(sizes, sizes[1:])
        ):
            raise ValueError(
                f"profile {self.name!r}: bandwidth_curve needs points (bytes > 0, bytes/s > 0) "
                "in increasing bytes"
            )

    @property
    def host_clock(self) -> bool:
        """Whether the step's host and device are two clocks (``host_launch`` > 0)."""
        return self.host_launch > 0

    def host_time(self, op_name: str, runs_kernel: bool) -> float:
        """Host seconds to issue one node of ``op_name`` (``aten::mm``) where the host runs
        ahead (``host_clock``): ``host_op_costs``' entry, else ``host_launch`` for a kernel
        and ``view_launch`` for a node that runs none; 0 on a profile of one clock."""
        if not self.host_clock:
            return 0.0
        for name, seconds in self.host_op_costs:
            if name == op_name:
                return seconds
        return self.host_launch if runs_kernel else self.view_launch

    def collective_factor(self, kind: str) -> float:
        """``collective_scale``'s factor for ``kind`` (1 where it names none)."""
        return next((f for k, f in self.collective_scale if k == kind), 1.0)

    @property
    def usable_memory(self) -> float:
        """``mem_capacity - mem_reserve``: the default memory budget per rank."""
        return self.mem_capacity - self.mem_reserve

    def flops_for(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s for ``dtype``; dtypes without an entry (ints, bool, ...) use float32's."""
        name = _dtype_name(dtype)
        fallback = 0.0
        for dtype_name, flops in self.peak_flops:
            if dtype_name == name:
                return flops
            if dtype_name == "float32":
                fallback = flops
        return fallback

    def kernel_rate(self, kind: str, dtype: torch.dtype, flops: float) -> float:
        """Sustained FLOP/s of a ``kind`` kernel of ``flops`` FLOPs in ``dtype``: its curve
        interpolated linearly in log FLOPs, held at the ends; ``flops_for(dtype)`` without
        a curve for that kind and dtype."""
        name = _dtype_name(dtype)
        curve = next((c for k, d, c in self.kernel_rates if k == kind and d == name), None)
        if curve is None:
            return self.flops_for(dtype)
        return _interpolate(curve, flops)

    def bandwidth(self, nbytes: float) -> float:
        """Bytes/s of a memory-bound kernel moving ``nbytes``: ``bandwidth_curve``
        interpolated linearly in log bytes, held at the ends; ``mem_bandwidth`` without
        one."""
        if not self.bandwidth_curve:
            return self.mem_bandwidth
        return _interpolate(self.bandwidth_curve, nbytes)

    def to_json(self) -> str:
        """The profile as JSON (``load_profile`` reads it back)."""
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def from_dict(cls, d: dict) -> DeviceProfile:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown profile fields {unknown}; a profile has {sorted(known)}")
        d = dict(d)
        d["peak_flops"] = tuple((str(n), float(f)) for n, f in d["peak_flops"])
        d["kernel_rates"] = tuple(
            (str(k), str(t), tuple((float(w), float(r)) for w, r in curve))
            for k, t, curve in d.get("kernel_rates", ())
        )
        d["bandwidth_curve"] = tuple((float(n), float(r)) for n, r in d.get("bandwidth_curve", ()))
        d["all_reduce_algorithms"] = tuple(d.get("all_reduce_algorithms", ("ring",)))
        d["collective_scale"] = tuple((str(k), float(f)) for k, f in d.get("collective_scale", ()))
        d["host_op_costs"] = tuple((str(k), float(t)) for k, t in d.get("host_op_costs", ()))
        # a profile written before the field: a CPU one (``autopar calibrate`` names it
        # ``cpu-<host>``) ran on gloo
        d.setdefault("overlaps_collectives", not str(d["name"]).startswith("cpu"))
        return cls(**d)


def _interpolate(curve: Curve, x: float) -> float:
    """``curve``'s value at ``x``: linear in log ``x`` between its points, its end values
    outside them."""
    if x <= curve[0][0]:
        return curve[0][1]
    if x >= curve[-1][0]:
        return curve[-1][1]
    lx = math.log(x)
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1:
            f = (lx - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + f * (y1 - y0)
    raise AssertionError("unreachable: x is inside the curve")


def load_profile(path: str | Path) -> DeviceProfile:
    """A profile from a JSON file (``DeviceProfile.to_json``, ``autopar calibrate``); errors
    name the file."""
    path = Path(path)
    try:
        return DeviceProfile.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        detail = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        raise ValueError(f"{path}: not a device profile: {detail}") from None


def register_profile(profile: DeviceProfile) -> DeviceProfile:
    """Make ``profile`` the one ``Mesh(..., device=profile.name)`` plans with (replacing a
    profile of that name); returns it."""
    PROFILES[profile.name] = profile
    return profile


_H100_SOURCE = (
    "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM5 80GB column (dense = half the "
    "'with sparsity' figures): FP64 tensor core 67 TF, FP32 67 TF, TF32 tensor core 494.5 TF, "
    "BF16/FP16 tensor core 989.5 TF, FP8 1979 TF, HBM3 3.35 TB/s, 80 GB, NVLink4 900 GB/s "
    "total bidirectional per GPU, 8 GPUs per HGX/DGX H100 node; InfiniBand NDR 400 Gb/s, one "
    "ConnectX-7 per GPU (DGX H100 user guide). What runs reaches less, and those numbers are "
    "published measurements or estimates, each marked at its field: the matmul curves are "
    "cuBLAS GEMMs measured on an H200 (the same GH100 chip), torch 2.11, 2026-11-28, square "
    "ones and a transformer's layer shapes, large bf16 GEMMs sustaining 650-685 TF; the "
    "attention curves are `autopar calibrate` measured on an H200 "
    "(the same GH100 chip, 132 SMs at up to 1980 MHz, with faster memory), torch 2.11, "
    "2026-11-26: flash attention reaches 231 TF forward; "
    "NCCL over NDR reaches 46-48 GB/s of bus bandwidth; the smallest all-reduce over 64 "
    "ranks (8 nodes) takes ~47 us. `autopar calibrate` on the machine measures them."
)

# measured on an H200 (the H100 SXM's GH100 chip, 132 SMs at up to 1980 MHz, the same 700 W:
# its compute-bound kernels run as an H100 SXM's), torch 2.11 (cuBLAS), 2026-11-28, random
# data: up to 2.1e9 FLOPs square GEMMs on the device's clock, queued behind long ones
# (``autopar calibrate``: n = 256, 512, 1024); above, the median rate of the forward, input-
# and weight-grad GEMMs of Llama-3-8B, GPT-3-like and Llama-3.2-1B layers (2048-16384
# tokens, TP 1-8) within a quarter decade of FLOPs, each the median of runs of calls over
# 20 ms (``benchmarks/gemm_fidelity.py``, ``benchmarks/data/gemm-h200.json``). Sustained,
# the large bf16 GEMMs reach 650-685 TF; the ~790 TF this curve topped at before, a published
# figure for the best GEMMs, priced them 14-17% short
_H100_MATMUL_BF16 = ((3.4e7, 13e12), (2.7e8, 81e12), (2.1e9, 364e12), (1e10, 520e12),
                     (3e10, 630e12), (1e11, 650e12), (1e12, 670e12),
                     (1e13, 680e12))  # fmt: skip
# float32 without TF32 (torch's default precision "highest") runs on the CUDA cores; the
# same measurements
_H100_MATMUL_F32 = ((3.4e7, 5e12), (2.7e8, 21e12), (2.1e9, 39e12), (1e10, 48e12),
                    (3e10, 51e12))  # fmt: skip
# measured: the kernels autopar::sdpa calls on CUDA (core/ops.py), by ``autopar calibrate``
# on an H200 (the H100 SXM's GH100 chip: 132 SMs at up to 1980 MHz, so its compute-bound
# kernels run as an H100 SXM's; only its memory is faster), torch 2.11, 2026-11-26: causal,
# 8 heads of 64, batch 1 and batches of 16384 tokens, the median call less the launch cost,
# timed in rounds: flash attention in 16 bits, the memory-efficient kernel in float32
_H100_ATTN_FWD = ((2.7e8, 5e12), (1.1e9, 20e12), (4.3e9, 67e12), (8.6e9, 96e12),
                  (1.7e10, 132e12), (3.4e10, 185e12), (6.9e10, 197e12),
                  (1.4e11, 231e12))  # fmt: skip
_H100_ATTN_BWD = ((6.7e8, 7e12), (2.7e9, 25e12), (1.1e10, 72e12), (2.1e10, 84e12),
                  (4.3e10, 127e12), (8.6e10, 165e12), (1.7e11, 200e12),
                  (3.4e11, 228e12))  # fmt: skip
_H100_ATTN_FWD_F32 = ((2.7e8, 3e12), (1.1e9, 8e12), (4.3e9, 14e12), (8.6e9, 23e12),
                      (1.7e10, 24e12), (3.4e10, 28e12), (6.9e10, 28e12),
                      (1.4e11, 30e12))  # fmt: skip
_H100_ATTN_BWD_F32 = ((6.7e8, 3e12), (2.7e9, 8e12), (1.1e10, 15e12), (2.1e10, 20e12),
                      (4.3e10, 23e12), (8.6e10, 29e12), (1.7e11, 30e12),
                      (3.4e11, 32e12))  # fmt: skip

_CPU_SOURCE = (
    "Rough estimate for a small CPU box running gloo, not a datasheet: FLOP/s measured "
    "roughly with 1024^3 torch matmuls on 2 threads of a 2-core Xeon dev container "
    "(fp32 ~270 GF, fp64 ~70 GF, bf16 ~1.1 TF via AMX), memory bandwidth and gloo link "
    "numbers are order-of-magnitude guesses (loopback TCP inside the box, 10 GbE between "
    "boxes). Good enough to rank plans in CPU tests, not to predict times."
)

PROFILES: dict[str, DeviceProfile] = {
    "h100": DeviceProfile(
        name="h100",
        peak_flops=(
            ("float64", 67e12),  # FP64 tensor core (FP64 vector: 34 TF)
            # NOTE: float32 is the non-tensor-core 67 TF, not TF32's 494.5 TF: torch's default
            # float32 matmul precision is "highest" (allow_tf32=False), so an fp32 matmul does
            # not use TF32 unless the user calls torch.set_float32_matmul_precision("high").
            ("float32", 67e12),
            ("bfloat16", 989.5e12),
            ("float16", 989.5e12),
            ("float8_e4m3fn", 1979e12),
            ("float8_e5m2", 1979e12),
        ),
        # estimate: ~90% of HBM3's 3.35 TB/s, what large copy kernels reach
        mem_bandwidth=3.0e12,
        # NOTE: the datasheet's 80 GB; nvidia-smi reports 81559 MiB (~85.5e9 bytes) total, of
        # which the CUDA context and allocator fragmentation take some, so 80e9 is a usable bound.
        mem_capacity=80e9,
        # estimate: CUDA context ~0.5 GB, NCCL and cuBLAS workspaces ~1.5 GB, allocator
        # fragmentation ~2 GB (5% of a full card): 76 GB (70.8 GiB) left to the step
        mem_reserve=4e9,
        ranks_per_node=8,  # HGX/DGX H100: 8 GPUs per node
        intra_node_latency=2e-6,  # estimate: one NCCL step over NVLink (LL protocol)
        # NVLink4: 900 GB/s bidirectional = 450 GB/s each way, about the bus bandwidth NCCL's
        # all-reduce reports on 8 H100 SXM
        intra_node_bandwidth=450e9,
        # estimate: one NCCL step over InfiniBand; with collective_overhead, the smallest
        # all-reduce over (8 nodes) x (8 GPUs) is charged 5 + 6*5 + 5 + 6*2 = 52 us (tree on
        # each axis) against the ~47 us measured
        inter_node_latency=5e-6,
        inter_node_bandwidth=47e9,  # measured: NCCL reaches 46-48 GB/s over NDR 400 Gb/s
        kernel_launch=4e-6,  # estimate: CUDA launch + eager dispatch, a few us per op
        source=_H100_SOURCE,
        kernel_rates=(
            ("matmul", "bfloat16", _H100_MATMUL_BF16),
            ("matmul", "float16", _H100_MATMUL_BF16),
            ("matmul", "float32", _H100_MATMUL_F32),
            ("attention", "bfloat16", _H100_ATTN_FWD),
            ("attention", "float16", _H100_ATTN_FWD),
            ("attention", "float32", _H100_ATTN_FWD_F32),
            ("attention_backward", "bfloat16", _H100_ATTN_BWD),
            ("attention_backward", "float16", _H100_ATTN_BWD),
            ("attention_backward", "float32", _H100_ATTN_BWD_F32),
        ),
        collective_overhead=5e-6,  # estimate: launching an NCCL kernel and its handshake
        all_reduce_algorithms=("ring", "tree"),  # NCCL picks per size
    ),
    "cpu": DeviceProfile(
        name="cpu",
        peak_flops=(
            ("float64", 7e10),
            ("float32", 2.5e11),
            ("bfloat16", 1e12),  # AMX; a CPU without AMX is ~10x slower in bf16/fp16
            ("float16", 1e12),
        ),
        mem_bandwidth=1e10,  # a few channels of DDR shared by the ranks of the box
        mem_capacity=16e9,
        mem_reserve=2e9,  # estimate: the interpreter, torch, gloo's buffers
        # NOTE: a CPU test runs all its gloo ranks on one box, so every axis is "intra-node".
        ranks_per_node=64,
        intra_node_latency=2e-5,  # gloo over loopback TCP, tens of us per message
        intra_node_bandwidth=2e9,
        inter_node_latency=1e-4,  # gloo over 10 GbE
        inter_node_bandwidth=1.25e9,  # 10 Gb/s
        kernel_launch=2e-6,  # eager dispatch of a tiny CPU op, measured ~1.3 us
        source=_CPU_SOURCE,
        overlaps_collectives=False,  # gloo: passes/codegen waits for each at once
    ),
}


def get_profile(name: str) -> DeviceProfile:
    """The profile called ``name`` (``Mesh.device``), with an error listing the known names."""
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(
            f"unknown device profile {name!r}; known profiles: {sorted(PROFILES)}. "
            "Add a DeviceProfile to cost_models.devices.PROFILES for a new device."
        ) from None

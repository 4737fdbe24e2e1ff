"""Device profiles: the hardware constants the cost models read, with their source.

A ``DeviceProfile`` holds what the roofline compute model (``cost_models.compute``) and the
alpha-beta communication model (``cost_models.comm``) need about one kind of accelerator and
its links. Nothing else in the cost models holds a hardware number: every constant lives in
``PROFILES`` beside the place it comes from (a datasheet, or a measurement).

Units: seconds, bytes, bytes/s and FLOP/s everywhere.

Profiles:
    ``"h100"``: NVIDIA H100 SXM5 80GB in an 8-GPU HGX/DGX node, NVLink4 inside a node,
        one InfiniBand NDR NIC per GPU between nodes.
    ``"cpu"``: a rough profile of a small CPU box running gloo, for the CPU test setup only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DeviceProfile", "PROFILES", "get_profile"]

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
    """Device memory bandwidth in bytes/s (the roofline's memory roof)."""

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
    """Fixed overhead added to every op that runs a kernel, in seconds."""

    source: str
    """Where the numbers come from (datasheet, measurement, estimate)."""

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
        }
        for field, value in positive.items():
            if not value > 0:
                raise ValueError(f"profile {self.name!r}: {field} must be > 0, got {value}")
        for field in ("intra_node_latency", "inter_node_latency", "kernel_launch"):
            if getattr(self, field) < 0:
                raise ValueError(f"profile {self.name!r}: {field} must be >= 0")

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


_H100_SOURCE = (
    "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM5 80GB column (dense = half the "
    "'with sparsity' figures): FP64 tensor core 67 TF, FP32 67 TF, TF32 tensor core 494.5 TF, "
    "BF16/FP16 tensor core 989.5 TF, FP8 1979 TF, HBM3 3.35 TB/s, 80 GB, NVLink4 900 GB/s "
    "total bidirectional per GPU, 8 GPUs per HGX/DGX H100 node; InfiniBand NDR 400 Gb/s, one "
    "ConnectX-7 per GPU (DGX H100 user guide). Latencies and kernel_launch are estimates, not "
    "datasheet values."
)

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
        mem_bandwidth=3.35e12,  # HBM3, 3.35 TB/s
        # NOTE: the datasheet's 80 GB; nvidia-smi reports 81559 MiB (~85.5e9 bytes) total, of
        # which the CUDA context and allocator fragmentation take some, so 80e9 is a usable bound.
        mem_capacity=80e9,
        # estimate: CUDA context ~0.5 GB, NCCL and cuBLAS workspaces ~1.5 GB, allocator
        # fragmentation ~2 GB (5% of a full card): 76 GB (70.8 GiB) left to the step
        mem_reserve=4e9,
        ranks_per_node=8,  # HGX/DGX H100: 8 GPUs per node
        intra_node_latency=3e-6,  # estimate: one NCCL ring step over NVLink, a few us
        intra_node_bandwidth=450e9,  # NVLink4: 900 GB/s bidirectional = 450 GB/s each way
        inter_node_latency=10e-6,  # estimate: one ring step over InfiniBand, ~10 us
        inter_node_bandwidth=50e9,  # InfiniBand NDR 400 Gb/s per GPU = 50 GB/s
        kernel_launch=4e-6,  # estimate: CUDA launch + eager dispatch, a few us per op
        source=_H100_SOURCE,
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

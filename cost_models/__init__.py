"""Cost models: what an op or a redistribution costs, in seconds, on a device profile.

``devices``: hardware constants (``DeviceProfile``, ``PROFILES``, ``get_profile``; a
calibrated profile's JSON with ``load_profile`` / ``register_profile``).
``compute``: roofline time of one ATen op on local shapes (``compute_time``), and the
host's time to issue it where the host runs ahead of the device (``host_time``).
``comm``: alpha-beta collective times per mesh axis and DTensor redistribution cost
(``redistribute_time``), or a hierarchical reduction's where it is faster
(``reshard_time``). Only the solver imports these (STYLE.md, 3).
"""

from .comm import (
    COLLECTIVE_KINDS,
    Collective,
    axis_link,
    collective_time,
    collectives_time,
    hierarchical_collectives,
    redistribute_collectives,
    redistribute_time,
    reshard_collectives,
    reshard_time,
    spans_nodes,
)
from .compute import (
    attention_flops,
    compute_time,
    host_time,
    is_view_op,
    kernel_kind,
    op_bytes,
    op_flops,
    profiler_name,
    runs_kernel,
)
from .devices import (
    KERNEL_KINDS,
    PROFILES,
    DeviceProfile,
    get_profile,
    load_profile,
    register_profile,
)

__all__ = [
    "COLLECTIVE_KINDS",
    "KERNEL_KINDS",
    "PROFILES",
    "Collective",
    "DeviceProfile",
    "attention_flops",
    "axis_link",
    "collective_time",
    "collectives_time",
    "compute_time",
    "get_profile",
    "host_time",
    "is_view_op",
    "kernel_kind",
    "load_profile",
    "op_bytes",
    "op_flops",
    "profiler_name",
    "runs_kernel",
    "hierarchical_collectives",
    "redistribute_collectives",
    "redistribute_time",
    "reshard_collectives",
    "reshard_time",
    "register_profile",
    "spans_nodes",
]

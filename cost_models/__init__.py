"""Cost models: what an op or a redistribution costs, in seconds, on a device profile.

``devices``: hardware constants (``DeviceProfile``, ``PROFILES``, ``get_profile``).
``compute``: roofline time of one ATen op on local shapes (``compute_time``).
``comm``: alpha-beta collective times per mesh axis and DTensor redistribution cost
(``redistribute_time``). Only the solver imports these (STYLE.md, 3).
"""

from .comm import (
    COLLECTIVE_KINDS,
    Collective,
    axis_link,
    collective_time,
    collectives_time,
    redistribute_collectives,
    redistribute_time,
)
from .compute import compute_time, is_view_op, op_bytes, op_flops
from .devices import PROFILES, DeviceProfile, get_profile

__all__ = [
    "COLLECTIVE_KINDS",
    "PROFILES",
    "Collective",
    "DeviceProfile",
    "axis_link",
    "collective_time",
    "collectives_time",
    "compute_time",
    "get_profile",
    "is_view_op",
    "op_bytes",
    "op_flops",
    "redistribute_collectives",
    "redistribute_time",
]

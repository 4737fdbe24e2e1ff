"""The core types of autopar: the bottom layer, which imports nothing else of the project.

Every other layer stands on these (docs/architecture.md):

    ``Mesh``                       core/mesh.py        a device mesh described for planning
    placements codec, local shape  core/placements.py  ``S(0)``/``R``/``P(sum)`` <-> torch
    node roles                     core/roles.py       what each node of a step graph is
    ``Strategy``, ``StrategySpace``,  core/space.py    what the solver chooses from, and
    ``Solution``, ``Collective``                       what it chose
    ``Plan``, ``NodeChoice``       core/plan.py        the plan, serializable
    ``PlannedCollective``          core/planned.py     one collective of the plan's step
    ``CompiledStep``               core/compiled.py    what codegen hands the runtime
    ``autopar::sdpa`` (+ backward) core/ops.py         one attention op on every device
    ``MixedPrecision``             core/precision.py   mixed precision policy, its casts
"""

from . import ops
from .compiled import CompiledStep
from .mesh import Mesh
from .placements import (
    Placements,
    contiguous_stride,
    divides,
    hierarchical_axes,
    is_planned,
    is_strided,
    local_offset,
    local_shape,
    parse_placement,
    parse_placements,
    placement_str,
    reduction,
    reductions,
)
from .plan import PLAN_FORMAT, STATS_ORDER, NodeChoice, Plan
from .planned import PlannedCollective
from .precision import MixedPrecision, cast_parameters
from .roles import op_name
from .space import (
    COLLECTIVE_KINDS,
    Collective,
    Edge,
    Recompute,
    Sink,
    Solution,
    Strategy,
    StrategySpace,
    TensorInput,
)
from .version import __version__

__all__ = [
    "COLLECTIVE_KINDS",
    "PLAN_FORMAT",
    "STATS_ORDER",
    "Collective",
    "CompiledStep",
    "Edge",
    "Recompute",
    "Mesh",
    "MixedPrecision",
    "NodeChoice",
    "Placements",
    "Plan",
    "PlannedCollective",
    "Sink",
    "Solution",
    "Strategy",
    "StrategySpace",
    "TensorInput",
    "__version__",
    "cast_parameters",
    "contiguous_stride",
    "divides",
    "hierarchical_axes",
    "is_planned",
    "is_strided",
    "local_offset",
    "local_shape",
    "op_name",
    "ops",
    "parse_placement",
    "parse_placements",
    "placement_str",
    "reduction",
    "reductions",
]

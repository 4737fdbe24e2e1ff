"""autopar: an auto-parallelization compiler for PyTorch training.

``autopar.compile(model, mesh, example_inputs, loss_fn=...)`` traces one training step,
plans per-operator sharding over the mesh with an ILP on a cost model, and returns a
``ParallelModule`` that runs the step with collectives. ``autopar.plan`` plans without
processes or weights.
"""

from .api import (
    PlanMismatchError,
    PlanOptions,
    compile,
    evaluate,
    load_profile,
    plan,
    plan_step,
)
from .core import Mesh, MixedPrecision, NodeChoice, Plan, __version__, cast_parameters
from .runtime import ParallelModule, PeerLostError

__all__ = [
    "Mesh",
    "MixedPrecision",
    "NodeChoice",
    "ParallelModule",
    "Plan",
    "PeerLostError",
    "PlanMismatchError",
    "PlanOptions",
    "compile",
    "evaluate",
    "load_profile",
    "plan",
    "plan_step",
    "__version__",
    "cast_parameters",
]

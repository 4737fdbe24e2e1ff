"""autopar: an auto-parallelization compiler for PyTorch training.

``autopar.compile(model, mesh, example_inputs, loss_fn=...)`` traces one training step,
plans per-operator sharding over the mesh with an ILP on a cost model, and returns a
``ParallelModule`` that runs the step with collectives. ``autopar.plan`` plans without
processes or weights.
"""

__version__ = "0.1.0"

from .api import PlanMismatchError, compile, plan, plan_step  # noqa: E402
from .mesh import Mesh  # noqa: E402
from .plan import NodeChoice, Plan  # noqa: E402

__all__ = [
    "Mesh",
    "NodeChoice",
    "Plan",
    "PlanMismatchError",
    "compile",
    "plan",
    "plan_step",
    "__version__",
]

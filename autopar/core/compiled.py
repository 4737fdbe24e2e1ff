"""``CompiledStep``: what codegen hands the runtime, and all the runtime needs besides a Plan.

The runtime (``ParallelModule``) never plans and never looks at the traced graph: it calls
``fn`` with this rank's parameter shards, buffers and local batch, in the order below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["CompiledStep"]


@dataclass
class CompiledStep:
    """One rank's compiled training step.

    Attributes:
        fn: ``fn(*params, *buffers, *inputs, *targets)`` runs the forward on local shards and
            returns the loss (or the local outputs); ``backward`` runs the planned backward.
        gm: the local joint graph ``fn`` was compiled from (for inspection).
        param_names: original parameter names, in the order ``fn`` takes them (a tied
            parameter appears under each of its names).
        buffer_names: original buffer names, in the order ``fn`` takes them.
        alias_of: for a tied parameter, each later name -> the first name.
        input_shapes: global shape of each user input, then each target.
        input_dtypes: dtype of each user input, then each target.
        collective_counts: ``{(kind, axis name): count}`` of the collectives in ``gm``.
        mismatches: ops that ran with another placement than planned (each redistributed).
        graphs: the forward and backward graphs ``fn`` runs (``"forward"``, ``"backward"``),
            as aot_autograd partitioned ``gm``.
        constants: the buffers among ``buffer_names`` that are not the model's, with their
            values (passes/trace ``StepGraph.constants``: a loss module's, a tensor the
            step closes over); the runtime holds them beside the model's.
    """

    fn: Callable
    gm: torch.fx.GraphModule
    param_names: list[str]
    buffer_names: list[str]
    alias_of: dict[str, str]
    input_shapes: list[tuple[int, ...]]
    input_dtypes: list[torch.dtype] = field(default_factory=list)
    collective_counts: dict[tuple[str, str], int] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    graphs: dict[str, torch.fx.GraphModule] = field(default_factory=dict)
    constants: dict[str, torch.Tensor] = field(default_factory=dict)

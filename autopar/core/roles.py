"""Node roles: what each node of a traced step graph is, as every pass reads it.

passes/trace writes two entries into every node's ``meta``:

    ``META_ROLE``   (``"autopar_role"``)  one of the roles below
    ``META_MODULE`` (``"autopar_module"``) the module path of the original model the node
                    came from ("" at top level; backward nodes inherit their forward node's)

Roles of graph inputs (placeholders), in the order the joint graph takes them:
    ``PARAM``  a parameter of the model          ``BUFFER``  a buffer of the model
    ``INPUT``  a user input (one global batch)   ``TARGET``  a target of the loss
    ``TANGENT`` the incoming gradient of a differentiable output
Roles of operators: ``FORWARD``, ``BACKWARD``.
"""

from __future__ import annotations

import torch

__all__ = [
    "BACKWARD",
    "BATCH_ROLES",
    "BUFFER",
    "FORWARD",
    "INPUT",
    "META_MODULE",
    "META_ROLE",
    "PARAM",
    "PLACEHOLDER_ROLES",
    "TANGENT",
    "TARGET",
    "op_name",
]

META_ROLE = "autopar_role"
META_MODULE = "autopar_module"

PARAM = "param"
BUFFER = "buffer"
INPUT = "input"
TARGET = "target"
TANGENT = "tangent"
FORWARD = "forward"
BACKWARD = "backward"

PLACEHOLDER_ROLES = (PARAM, BUFFER, INPUT, TARGET, TANGENT)
BATCH_ROLES = (INPUT, TARGET)
"""Graph inputs that carry the batch (each rank reads its part)."""


def op_name(target) -> str:
    """The text a plan records for a node's op: ``aten.mm.default``, ``getitem``, ``placeholder``."""
    if target == "placeholder":
        return "placeholder"
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))

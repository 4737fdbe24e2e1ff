"""Placements a user fixes before the search: constraints by parameter name, and whole plans.

Takes: a ``StrategySpace`` and the user's constraints, ``(pattern, placements text)`` pairs
(``autopar.plan(..., constraints=...)``; the text is one placement per mesh axis, ``"R,S(0)"``):
    - a pattern is an ``fnmatch`` pattern over parameter names (``layers.*.attention.wq.weight``,
      ``*.bias``) or ``input:N``, the N-th placeholder of the step's batch (the user inputs,
      then the targets; ``input:*`` all of them); every pattern must match something;
    - a name matched by several patterns takes the first's placement.
    - ``reshard:AXIS`` with ``none`` or ``params``: no collective on that mesh axis between
      two operators, or only where a parameter is used (its edges and those of the views and
      casts of it: an FSDP all-gather). Gradient reductions at the step's outputs stay
      free. Data parallelism as people write it is this: the batch stays sharded from the
      input to the loss, and the axis carries the gradients' reductions alone.
Returns: ``Pin``s, each a node with the placements its first output must take (and, for a
whole plan, its inputs'); passes/solve turns each into one constraint, ``sum x[v,k] = 1``
over the strategies that agree (``pin_node``); and the frozen axes, ``{axis: allowed
sources}``, whose collectives passes/solve leaves out of every other edge (``freeze_axes``).

A pinned choice is everybody's: the nodes of a fold group share their variables (passes/fold),
so pins that give two layers of one group different placements cannot hold together;
``check_folding`` says so before any search, and ``fold=False`` plans them apart.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

from autopar.core import StrategySpace

__all__ = ["Pin", "check_folding", "parameter_uses", "resolve"]


@dataclass(frozen=True, slots=True)
class Pin:
    """``node``'s first output takes ``out`` (placements text); ``ins``, when given, the
    placements text of each tensor input (a whole plan's choice, ``autopar.evaluate``)."""

    node: str
    out: str
    ins: tuple[str, ...] | None = None
    why: str = ""


def resolve(space: StrategySpace, constraints) -> tuple[list[Pin], dict[int, frozenset[str]]]:
    """The pins and frozen axes of ``constraints`` (module docstring) over ``space``."""
    pins: dict[str, Pin] = {}
    frozen: dict[int, frozenset[str]] = {}
    ndim = space.mesh.ndim
    for pattern, text in constraints:
        if pattern.startswith("reshard:"):
            axis = pattern.split(":", 1)[1]
            if axis not in space.mesh.axis_names:
                raise ValueError(
                    f"constraint {pattern!r}: the mesh axes are {space.mesh.axis_names}"
                )
            if text not in ("none", "params"):
                raise ValueError(f"constraint {pattern!r}: 'none' or 'params', got {text!r}")
            sources = parameter_uses(space) if text == "params" else frozenset()
            frozen[space.mesh.axis_names.index(axis)] = sources
            continue
        if len(text.split(",")) != ndim:
            raise ValueError(
                f"constraint {pattern!r}: {text!r} gives {len(text.split(','))} placements "
                f"for a mesh of {ndim} axes"
            )
        if pattern.startswith("input:"):
            which = pattern.split(":", 1)[1]
            if which == "*":
                matched = [(f"input:{i}", n) for i, n in enumerate(space.inputs)]
            else:
                index = int(which)
                if not 0 <= index < len(space.inputs):
                    raise ValueError(
                        f"constraint {pattern!r}: the step takes {len(space.inputs)} inputs "
                        "and targets"
                    )
                matched = [(pattern, space.inputs[index])]
        else:
            matched = [
                (name, node)
                for name, node in space.params.items()
                if fnmatch.fnmatchcase(name, pattern)
            ]
            if not matched:
                raise ValueError(
                    f"constraint {pattern!r} matches no parameter (e.g. "
                    f"{', '.join(list(space.params)[:3])})"
                )
        for name, node in matched:
            pins.setdefault(node, Pin(node, text, why=f"{name} ({pattern})"))
    return list(pins.values()), frozen


def parameter_uses(space: StrategySpace) -> frozenset[str]:
    """The parameters, and the nodes that are a view or a cast of one: a node of one tensor
    input, itself such a node, whose output has the same number of elements (the forward's
    ``t(w)`` and the backward's ``t(t(w))``)."""
    found = set(space.params.values())
    for name in space.order:
        if name in found or space.roles.get(name) not in ("forward", "backward"):
            continue
        sources = space.in_sources.get(name, ())
        if len(sources) != 1 or sources[0][0] not in found:
            continue
        (src, so) = sources[0]
        if math.prod(space.tensor(src, so)[0]) == math.prod(space.tensor(name)[0]):
            found.add(name)
    return frozenset(found)


def check_folding(space: StrategySpace, rep, pins: list[Pin]) -> None:
    """Raise if two pins of one fold group (``rep``: node -> its group's node) disagree."""
    seen: dict[str, Pin] = {}
    for pin in pins:
        other = seen.setdefault(rep(pin.node), pin)
        if (other.out, other.ins) != (pin.out, pin.ins):
            raise ValueError(
                f"pins {other.why or other.node} = {other.out} and {pin.why or pin.node} = "
                f"{pin.out} fall on two layers that are folded together (they share their "
                "choices): plan with fold=False to place them apart"
            )

"""Placements a user fixes before the search: constraints by parameter name, and whole plans.

Takes: a ``StrategySpace`` and the user's constraints, ``(pattern, placements text)`` pairs
(``autopar.plan(..., constraints=...)``; the text is one placement per mesh axis, ``"R,S(0)"``):
    - a pattern is an ``fnmatch`` pattern over parameter names (``layers.*.attention.wq.weight``,
      ``*.bias``) or ``input:N``, the N-th placeholder of the step's batch (the user inputs,
      then the targets; ``input:*`` all of them), or ``attention:*``, every fused attention
      node (``autopar::sdpa`` and its backward; the text is the placement of its output, or
      of dq: ``"S(2)"`` splits the query rows over an axis, context parallelism,
      ``"S(1)"`` the heads, ``"S(0)"`` the batch), or ``loss:*``, the log-softmax of
      every cross-entropy (``_log_softmax``; the text is its output's placement: ``"S(1)"``
      splits the classes of [N, C] logits over an axis, vocabulary-parallel, passes/vocab);
      every pattern must match something;
    - a name matched by several patterns takes the first's placement.
    - ``reshard:AXIS`` with ``none`` or ``params``: no collective on that mesh axis between
      two operators, or only where a parameter is used (its edges and those of the views and
      casts of it: an FSDP all-gather). Gradient reductions at the step's outputs stay
      free. Data parallelism as people write it is this: the batch stays sharded from the
      input to the loss, and the axis carries the gradients' reductions alone. With
      ``whole``, none at the outputs either: every rank runs the whole step on that axis
      (autopar/calibrate's step of the host; ``SEALED``).
    - ``output:PATTERN``, an ``fnmatch`` pattern over module paths (``*.input_layernorm``):
      the output of each matching module, the last forward op traced inside it whose first
      output is a tensor (``module_outputs``): Megatron's sequence parallelism pins the
      norms' outputs along the sequence (``experts.megatron(sequence_parallel=True)``);
    - ``sequence`` with ``none``: no tensor is split along a sequence dim, a dim as long as
      the step's sequence (dim 1 of its first input, the tokens): no context parallelism,
      no Megatron or Ulysses sequence parallelism, which leaves data and tensor parallelism
      (and the sharding of parameters). The strategies that split such a dim, of an output
      or an input, are dropped from the space (``drop_sequence_splits``; a dim of another
      tensor that happens to be as long is held whole too).
    - ``context`` with ``ring`` or ``gather``: attention that splits its query rows does so
      only that way (passes/rules: the keys passed around a ring, or all-gathered); the
      other variant's strategies are dropped (``keep_context_variant``). With
      ``attention:*`` pinned to a row split, this picks the context-parallel algorithm.
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
import operator
from dataclasses import dataclass

import torch

from autopar.core import StrategySpace

from . import rules

__all__ = [
    "SEALED",
    "Pin",
    "check_folding",
    "drop_sequence_splits",
    "keep_context_variant",
    "module_outputs",
    "parameter_uses",
    "resolve",
]


# among a frozen axis's allowed nodes: the step's outputs run no collective on it either
# (``reshard:AXIS`` ``whole``; passes/solve ``freeze_axes``)
SEALED = "<sealed>"


@dataclass(frozen=True, slots=True)
class Pin:
    """``node``'s first output takes ``out`` (placements text); ``ins``, when given, the
    placements text of each tensor input (a whole plan's choice, ``autopar.evaluate``)."""

    node: str
    out: str
    ins: tuple[str, ...] | None = None
    why: str = ""


# ``kind:*`` pins every node of these ops (module docstring)
_OP_PINS = {
    "attention": (rules.ATTENTION_Q, "fused attention"),
    "loss": ((torch.ops.aten._log_softmax.default,), "log-softmax"),
}


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
            if text not in ("none", "params", "whole"):
                raise ValueError(
                    f"constraint {pattern!r}: 'none', 'params' or 'whole', got {text!r}"
                )
            sources = parameter_uses(space) if text == "params" else frozenset()
            if text == "whole":
                sources = frozenset({SEALED})
            frozen[space.mesh.axis_names.index(axis)] = sources
            continue
        if pattern == "sequence":
            if text != "none":
                raise ValueError(f"constraint 'sequence': 'none', got {text!r}")
            drop_sequence_splits(space)
            continue
        if pattern == "context":
            keep_context_variant(space, text)
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
        elif pattern.startswith("output:"):
            paths = pattern.split(":", 1)[1]
            matched = [
                (f"{path} output ({name})", name)
                for path, name in module_outputs(space).items()
                if fnmatch.fnmatchcase(path, paths)
            ]
            if not matched:
                raise ValueError(f"constraint {pattern!r} matches no module path")
        elif pattern.partition(":")[0] in _OP_PINS:
            kind = pattern.partition(":")[0]
            ops, what = _OP_PINS[kind]
            if pattern != f"{kind}:*":
                raise ValueError(f"constraint {pattern!r}: '{kind}:*' pins every {kind}")
            matched = [
                (f"{name} ({space.targets[name]})", name)
                for name in space.order
                if space.targets.get(name) in ops
            ]
            if not matched:
                raise ValueError(f"constraint {pattern!r}: the step has no {what}")
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


def module_outputs(space: StrategySpace) -> dict[str, str]:
    """``{module path: its output node}``: the last forward op traced inside each module
    (its own ops, not a child's) whose first output is a tensor; an op, not the pick of one
    of its outputs (a layer norm's, not the getitem of its normalized tensor)."""
    out: dict[str, str] = {}
    for name in space.order:
        path = space.modules.get(name, "")
        if not path or space.roles.get(name) != "forward":
            continue
        shapes = space.shapes.get(name, ())
        if shapes and shapes[0] is not None and space.targets.get(name) is not operator.getitem:
            out[path] = name
    return out


def drop_sequence_splits(space: StrategySpace) -> None:
    """Drop every strategy that splits a dim as long as the sequence (module docstring)."""
    if not space.inputs:
        raise ValueError("constraint 'sequence': the step has no inputs")
    shape = space.tensor(space.inputs[0])[0]
    if len(shape) < 2:
        raise ValueError(
            f"constraint 'sequence': the first input is {list(shape)}, not [batch, sequence, ...]"
        )
    seq = shape[1]

    def splits(ps, sd) -> bool:
        return (
            ps is not None
            and sd is not None
            and any(getattr(p, "dim", None) is not None and sd[0][p.dim] == seq for p in ps)
        )

    for name in list(space.strategies):
        outs = space.shapes.get(name, ())
        ins = [space.tensor(src, so) for src, so in space.in_sources.get(name, ())]
        kept = [
            s
            for s in space.strategies[name]
            if not any(splits(ps, sd) for ps, sd in zip(s.out, outs))
            and not any(splits(ps, sd) for ps, sd in zip(s.ins, ins))
        ]
        if not kept:
            raise ValueError(f"constraint 'sequence': node {name} has no strategy left")
        space.strategies[name] = kept


def keep_context_variant(space: StrategySpace, variant: str) -> None:
    """Drop the attention strategies that split the query rows another way than
    ``variant`` (module docstring)."""
    if variant not in ("ring", "gather"):
        raise ValueError(f"constraint 'context': 'ring' or 'gather', got {variant!r}")
    found = False
    for name, strats in space.strategies.items():
        target = space.targets.get(name)
        if target not in rules.ATTENTION_Q:
            continue
        found = True
        kept = [s for s in strats if rules.context_variant(target, s.ins) in (None, variant)]
        space.strategies[name] = kept
    if not found:
        raise ValueError("constraint 'context': the step has no fused attention")


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

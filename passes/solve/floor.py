"""The state floor and the budget errors ("Memory" in passes/solve).

Takes: a ``StrategySpace``, the optimizer, the pins. Returns: the bytes per rank no plan
goes below (every parameter and its optimizer state split evenly over every rank, or as a
pin places it), and the ``SolveError`` that says what budget or mesh would fit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from autopar.core import Placements, StrategySpace, roles

from ..memory import MemoryReport, local_bytes, state_bytes_per_element
from ..pins import Pin
from .errors import SolveError
from .ilp import _text
from .settings import _MIB


def state_floor(space: StrategySpace, optimizer: str = "adamw", pins: Sequence[Pin] = ()) -> int:
    """Bytes per rank below which no plan's step memory goes, whatever its placements: the
    parameters and their optimizer state ("Memory", module docstring: passes/memory holds
    every parameter through the whole step and counts its state at every point), each
    tensor at the least a rank can hold of it, an equal share over every rank of the mesh
    (a placement holds at least ceil(numel / ranks) of its elements on some rank); a
    parameter ``pins`` place, at what its placement holds on a rank."""
    return _state_share(space, optimizer, math.prod(space.mesh.shape), _pinned(space, pins))


def _pinned(space: StrategySpace, pins: Sequence[Pin]) -> dict[str, Placements]:
    """The placements ``pins`` give the step's parameters (the first pin of each)."""
    out: dict[str, Placements] = {}
    for pin in pins:
        if pin.node in out or space.roles.get(pin.node) != roles.PARAM:
            continue
        for st in space.strategies.get(pin.node, ()):
            ps = st.out[0] if st.out else None
            if ps is not None and _text(ps) == pin.out:
                out[pin.node] = ps
                break
    return out


def _state_share(
    space: StrategySpace,
    optimizer: str,
    ranks: int,
    pinned: Mapping[str, Placements] | None = None,
) -> int:
    """The parameters and their optimizer state, each split evenly over ``ranks``, or as
    ``pinned`` places it."""
    per_element = state_bytes_per_element(optimizer)
    mesh_shape = tuple(space.mesh.shape)
    share = 0
    for node in dict.fromkeys(space.params.values()):
        if node in space.aliases or space.roles[node] != roles.PARAM:
            continue  # (a tied parameter is stored once)
        shape, dtype = space.tensor(node)
        if pinned and node in pinned:
            elements = local_bytes(shape, dtype, pinned[node], mesh_shape) // dtype.itemsize
        else:
            elements = -(-math.prod(shape) // ranks)
        share += elements * (dtype.itemsize + per_element)
    return share


def _floor_error(
    budget: float, floor: int, space: StrategySpace, optimizer: str, pins: Sequence[Pin] = ()
) -> SolveError:
    ranks = math.prod(space.mesh.shape)
    pinned = _pinned(space, pins)
    if pinned:
        held = _state_share(space, optimizer, ranks, pinned) - _state_share(space, optimizer, ranks)
        how = (
            f"the {len(pinned)} pinned parameters as pinned ({held / _MIB:.1f} MiB more than "
            f"split evenly) and the others split evenly over all {ranks} ranks of the mesh"
        )
        advice = "shard the pinned parameters over more of the mesh, or use a larger budget"
    else:
        # (n ranks hold at least the whole state / n each: fewer than this cannot fit)
        whole = _state_share(space, optimizer, 1)
        # (a budget is > 0: passes/options)
        more = f"a mesh of at least {math.ceil(whole / budget)} ranks, or "
        how = f"each split evenly over all {ranks} ranks of the mesh"
        advice = f"use {more}a larger budget"
    return SolveError(
        f"no plan fits the memory budget of {budget / _MIB:.1f} MiB per rank: the parameters "
        f"and their {optimizer} state alone take at least {floor / _MIB:.1f} MiB ({floor} "
        f"bytes) per rank, {how}, before any activation; {advice}",
        floor_bytes=floor,
    )


def _budget_error(
    budget: float, least: MemoryReport | None, time_limit_s: float, checkpointing: bool
) -> SolveError:
    if least is None:
        return SolveError(
            f"no plan fits the memory budget of {budget / _MIB:.1f} MiB per rank, and the "
            f"solver found none without it within {time_limit_s:.0f} s: raise time_limit_s, "
            "or the budget"
        )
    top = least.dominant()
    return SolveError(
        f"no plan fits the memory budget of {budget / _MIB:.1f} MiB per rank (the step's "
        f"peak, {least.optimizer} state included): the smallest budget that fits is "
        f"{least.peak_bytes / _MIB:.1f} MiB ({least.peak_bytes} bytes), whose largest part "
        f"is {top.replace('_', ' ')} ({least.at_peak[top] / _MIB:.1f} MiB at node "
        f"{least.peak_node}); raise the budget to at least that, "
        + (
            "or use a larger mesh" if checkpointing else "allow checkpointing, or use a larger mesh"
        ),
        least_bytes=least.peak_bytes,
    )

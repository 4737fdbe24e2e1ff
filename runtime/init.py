"""Materialize a meta-device model's parameters as this rank's shards only.

``init_local_shards(model, placements, device_mesh, init_weights, device)`` walks the
model's modules in ``named_modules()`` order. For each module holding tensors on the meta
device it makes that module's own tensors (not its children's) real and whole on
``device``, calls ``init_weights(module)`` (default: the module's own
``reset_parameters()``), cuts this rank's shard of each tensor, and lets the whole tensors
go before the next module. The model itself is left as it was (on meta).

Why whole tensors one module at a time, and not DTensor's random ops on the shards: a model
built on one device with a seed draws its random numbers module by module in construction
order; drawing them here in the same order, on the same generator, gives every rank the
same numbers, so the shards are bit for bit those of the single-device model built with
that seed (DTensor's random ops run only on CUDA-like devices, and their offsets do not
reproduce a single-device draw). The cost is the largest module's own tensors, once, on
top of the shards: an embedding or one layer's projection, never the model.

The single-device equality holds when the model initializes its tensors in its
constructor, module by module in the order it registers them (``nn.Linear``,
``nn.Embedding``, norms: ``reset_parameters``), which is what ``named_modules()`` walks.
A model that re-initializes afterwards (``self.apply(init_fn)``) passes that function as
``init_weights``; the draw order is then ``named_modules()``'s.

A parameter tied under two names is made once (its first name's module); a later module
holding it still runs its init on a scratch copy, so the random stream advances as it did
in the constructor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.distributed.tensor import Replicate, distribute_tensor

from autopar.core import local_shape

__all__ = ["empty_local_shards", "init_local_shards"]


def _reset(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        names = [n for n, _ in module.named_parameters(recurse=False)]
        names += [n for n, _ in module.named_buffers(recurse=False)]
        raise ValueError(
            f"{type(module).__name__} holds {names} on the meta device and has no "
            "reset_parameters(): pass init_weights=fn (called as fn(module) with the module's "
            "own tensors made real), or a checkpoint to load"
        )
    reset()


def _direct(module: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """The module's own (name, tensor, is_parameter), not its children's."""
    out: list[tuple[str, torch.Tensor, bool]] = [
        (n, p, True) for n, p in module.named_parameters(recurse=False, remove_duplicate=False)
    ]
    out += [(n, b, False) for n, b in module.named_buffers(recurse=False, remove_duplicate=False)]
    return out


def _placements(name: str, placements: Mapping, ndim: int):
    return placements.get(name, (Replicate(),) * ndim)


def init_local_shards(
    model: nn.Module,
    placements: Mapping[str, tuple],
    device_mesh,
    init_weights: Callable[[nn.Module], None] | None = None,
    device: torch.device | str = "cpu",
) -> tuple[dict[str, torch.Tensor], int]:
    """``({name: this rank's shard}, peak bytes held)`` for every parameter and buffer of
    ``model`` that is on the meta device (names as ``named_parameters(remove_duplicate=
    False)`` gives them: a tied parameter under each name, one tensor). The peak counts the
    shards made so far plus one module's whole tensors: what this function holds at most."""
    init = init_weights or _reset
    shards: dict[str, torch.Tensor] = {}
    made: dict[int, torch.Tensor] = {}  # id(model tensor) -> shard (ties share it)
    held = peak = 0
    for path, module in model.named_modules():
        own = [(n, t, is_p) for n, t, is_p in _direct(module) if t is not None and t.is_meta]
        if not own:
            continue
        prefix = f"{path}." if path else ""
        whole = 0
        try:
            for n, t, is_p in own:
                real = torch.empty(t.shape, dtype=t.dtype, device=device)
                whole += real.numel() * real.element_size()
                if is_p:
                    setattr(module, n, nn.Parameter(real, requires_grad=t.requires_grad))
                else:
                    setattr(module, n, real)  # a registered buffer's name: stays a buffer
            peak = max(peak, held + whole)
            with torch.no_grad():
                init(module)
            for n, t, _ in own:
                if id(t) in made:  # tied: made by an earlier module; this draw was scratch
                    shards[prefix + n] = made[id(t)]
                    continue
                full = getattr(module, n).detach()
                ps = _placements(prefix + n, placements, device_mesh.ndim)
                local = distribute_tensor(full, device_mesh, ps, src_data_rank=None).to_local()
                local = local.clone()  # its own storage: the whole tensor goes now
                made[id(t)] = shards[prefix + n] = local
                held += local.numel() * local.element_size()
        finally:
            for n, t, _ in own:
                setattr(module, n, t)
    # names under which a module shared by two paths holds the same tensors
    for name, t in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        if name not in shards and id(t) in made:
            shards[name] = made[id(t)]
    return shards, peak


def empty_local_shards(
    model: nn.Module, placements: Mapping[str, tuple], device_mesh, device="cpu"
) -> dict[str, torch.Tensor]:
    """Uninitialized local shards of every meta tensor of ``model`` (to load a checkpoint
    into)."""
    out: dict[str, torch.Tensor] = {}
    made: dict[int, torch.Tensor] = {}
    mesh_shape = tuple(device_mesh.shape)
    for name, t in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        if not t.is_meta:
            continue
        if id(t) not in made:
            ps = _placements(name, placements, device_mesh.ndim)
            shape = local_shape(tuple(t.shape), ps, mesh_shape)
            made[id(t)] = torch.empty(shape, dtype=t.dtype, device=device)
        out[name] = made[id(t)]
    return out

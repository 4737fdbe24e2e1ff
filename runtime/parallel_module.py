"""``ParallelModule``: the compiled local step, holding this rank's parameter shards.

Takes a ``Plan`` and a ``CompiledStep`` (core), and the model whose weights it shards; it
never re-plans and never reads the traced graph. The shards are ordinary ``nn.Parameter``s
(any torch optimizer works on them). Calling the module runs the compiled local joint graph
(forward now, backward when ``loss.backward()`` is called), with the collectives the plan
chose.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar.core import CompiledStep, Plan, contiguous_stride, local_shape

__all__ = ["ParallelModule"]


def _key(name: str) -> str:
    return name.replace(".", "__")


class ParallelModule(nn.Module):
    """One rank's part of a model planned and compiled by ``autopar.compile``.

    ``parameters()`` yields the local shards, ``named_parameters()`` names them like the
    original model with ``.`` written ``__`` (a tied parameter once, under its first name).
    ``gather_grads()`` and ``state_dict()`` return full tensors keyed by the original names
    (buffers too: a buffer the forward updates, such as BatchNorm's running statistics, holds
    its new value after each step, as in the model).
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        device_mesh,
        compiled: CompiledStep,
        *,
        stats: dict | None = None,
    ):
        super().__init__()
        self.plan = plan
        self.device_mesh = device_mesh
        self.compiled = compiled
        self.stats = dict(stats or {})
        self.mismatches = list(compiled.mismatches)
        self._fn = compiled.fn
        self._param_names = list(compiled.param_names)
        self._buffer_names = list(compiled.buffer_names)
        self._n_args = len(plan.inputs)
        self._global_shapes: dict[str, torch.Size] = {}
        self._placements = placements = plan.param_placements
        named = dict(model.named_parameters(remove_duplicate=False))
        named_buffers = dict(model.named_buffers(remove_duplicate=False))
        # the model's own state_dict keys, in its order (persistent buffers only)
        self._state_keys = list(model.state_dict(keep_vars=True))
        self._alias_of = dict(compiled.alias_of)
        for name in self._param_names:
            full = named[name].detach()
            self._global_shapes[name] = full.shape
            if name in self._alias_of:
                continue  # a tied parameter: the first name's shard serves both
            local = distribute_tensor(full, device_mesh, placements[name], src_data_rank=None)
            self.register_parameter(_key(name), nn.Parameter(local.to_local().clone()))
        self._buffer_placements = plan.buffer_placements
        for name in self._buffer_names:
            ps = self._buffer_placements[name]
            full = named_buffers[name].detach()
            self._global_shapes[name] = full.shape
            local = distribute_tensor(full, device_mesh, ps, src_data_rank=None)
            self.register_buffer(_key(name), local.to_local().clone())
        self._input_placements = plan.input_placements
        self._input_shapes = list(compiled.input_shapes)

    # -- running -------------------------------------------------------------------------

    def forward(self, *args):
        if len(args) != self._n_args:
            what = "inputs and targets" if self.plan.has_loss else "inputs"
            raise TypeError(
                f"this ParallelModule takes {self._n_args} local {what}, got {len(args)}"
            )
        for i, (a, ps) in enumerate(zip(args, self._input_placements)):
            want = self._local_input_shape(i)
            if tuple(a.shape) != want:
                raise ValueError(
                    f"argument {i} has shape {tuple(a.shape)}, but this rank's part is {want} "
                    f"(placements {ps}); pass pm.shard_inputs(*global_tensors)"
                )
        params = [self._shard(n) for n in self._param_names]
        buffers = [getattr(self, _key(n)) for n in self._buffer_names]
        return self._fn(*params, *buffers, *args)

    def _shard(self, name: str) -> nn.Parameter:
        """This rank's shard of parameter ``name`` (a tied name gives its first name's)."""
        return getattr(self, _key(self._alias_of.get(name, name)))

    def _local_input_shape(self, i: int) -> tuple[int, ...]:
        mesh_shape = tuple(self.device_mesh.shape)
        return local_shape(self._input_shapes[i], self._input_placements[i], mesh_shape)

    def shard_inputs(self, *global_tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's local part of each global input (then target), as the plan places it."""
        if len(global_tensors) != len(self._input_placements):
            raise TypeError(
                f"expected {len(self._input_placements)} global tensors, got {len(global_tensors)}"
            )
        return tuple(
            distribute_tensor(t, self.device_mesh, ps, src_data_rank=None).to_local()
            for t, ps in zip(global_tensors, self._input_placements)
        )

    # -- full tensors --------------------------------------------------------------------

    def _full(self, name: str, local: torch.Tensor, placements=None) -> torch.Tensor:
        shape = self._global_shapes[name]
        d = DTensor.from_local(
            local,
            self.device_mesh,
            self._placements[name] if placements is None else placements,
            run_check=False,
            shape=shape,
            stride=contiguous_stride(shape),
        )
        return d.full_tensor()

    def gather_grads(self) -> dict[str, torch.Tensor | None]:
        """``{original parameter name: full gradient}`` (None where there is no gradient)."""
        out = {}
        for name in self._param_names:
            p = self._shard(name)
            out[name] = None if p.grad is None else self._full(name, p.grad.detach())
        return out

    # NOTE: full tensors keyed by the model's names, not nn.Module's local-state protocol
    # (prefix, destination, keep_vars), hence the narrower signature.
    def state_dict(self, *args, **kwargs) -> OrderedDict:  # type: ignore[override]
        """Full parameters and persistent buffers: the model's ``state_dict`` keys, in its
        order (a tied parameter under each of its names)."""
        out = OrderedDict()
        for name in self._state_keys:
            if name in self._buffer_placements:
                local = getattr(self, _key(name)).detach()
                out[name] = self._full(name, local, self._buffer_placements[name]).clone()
            else:
                out[name] = self._full(name, self._shard(name).detach())
        return out

    def collective_counts(self) -> dict[tuple[str, str], int]:
        """``{(kind, axis name): count}`` of the collectives in the compiled step graph."""
        return dict(self.compiled.collective_counts)

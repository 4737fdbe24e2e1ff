"""``ParallelModule``: the compiled local step, holding the model's parameters as DTensors.

Takes a ``Plan`` and a ``CompiledStep`` (core), and the model whose weights it shards; it
never re-plans and never reads the traced graph.

The boundary, as torch's own parallelism (FSDP2, ``parallelize_module``) draws it:

- every parameter is an ``nn.Parameter`` wrapping a ``DTensor`` with the plan's placements
  on the device mesh, registered under the model's own name in a tree of empty modules
  that mirrors the model's (so ``named_parameters()``, ``state_dict()`` and
  ``load_state_dict()`` use the model's keys, and torch's checkpoint helpers find them);
  buffers are DTensors the same way; the step's own buffers, which are not the model's (a
  loss module's class weight, a tensor the step closes over: ``CompiledStep.constants``),
  are DTensors held apart, so that the module's names and state are the model's alone;
- a call hands the compiled step the local tensors (``local_tensors``: one autograd node
  for every parameter, differentiable):
  the step runs on local shards with the collectives the plan chose, and the gradient of
  each local shard, which the step already reduced to its parameter's placements, comes
  back as a DTensor gradient with those placements.

So torch's optimizers (foreach and fused) and ``clip_grad_norm_`` see DTensors and compute
global results (the norm over every shard, once), and DCP saves and reshards the state.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import SimpleNamespace

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from autopar.core import CompiledStep, Plan, local_shape

__all__ = ["ParallelModule", "PeerLostError"]

# what gloo and NCCL say when a collective's peer process is gone
_PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|"
    r"NCCL communicator was aborted|ProcessGroupNCCL.*(?:abort|timeout)",
    re.IGNORECASE,
)


class PeerLostError(RuntimeError):
    """A collective of the step failed because another rank is gone."""


# attributes of a ParallelModule itself; a model child of one of these names cannot be mirrored
_OWN = ("plan", "device_mesh", "compiled", "stats", "mismatches")


class _LocalShards(torch.autograd.Function):
    """Every parameter's local shard through one autograd node (``DTensor.to_local`` is one
    node per parameter; on a step of many small parameters the nodes were most of the
    boundary's cost, benchmarks/boundary_overhead.py). Backward: each local gradient as a
    DTensor with its parameter's placements, shape and stride."""

    @staticmethod
    def forward(ctx, mesh, *params):
        ctx.mesh = mesh
        # NOTE: private attribute: a DTensor's spec (mesh, placements, global shape, stride,
        # dtype) has no public getter; the backward wraps each gradient with it as FSDP2
        # does (``_from_local_no_grad``), which ``DTensor.from_local`` rebuilds per call at
        # ~25 us a parameter (tests/unit/test_torch_internals.py checks the two agree).
        ctx.specs = [p._spec for p in params]
        # a view, as to_local hands one: the output is a new tensor autograd can own
        out = tuple(t.view_as(t) for t in (p.to_local() for p in params))
        frozen = [t for t, p in zip(out, params) if not p.requires_grad]
        if frozen:  # a frozen parameter's shard takes no gradient, as with to_local
            ctx.mark_non_differentiable(*frozen)
        return out

    @staticmethod
    def backward(ctx, *grads):
        return (None, *(_as_grad(g, spec, ctx.mesh) for g, spec in zip(grads, ctx.specs)))


def _as_grad(g: torch.Tensor | None, spec, mesh) -> DTensor | None:
    """The local gradient ``g`` as a DTensor gradient of the parameter whose spec is
    ``spec``: what ``DTensor.from_local(g, mesh, placements, shape=, stride=)`` makes, a
    fresh tensor object sharing ``g``'s memory, without its per-call spec and autograd node
    (the backward runs without grad)."""
    if g is None:
        return None
    if g.dtype != spec.tensor_meta.dtype or torch.is_grad_enabled():  # a cast; double backward
        meta = spec.tensor_meta
        return DTensor.from_local(
            g, mesh, spec.placements, run_check=False, shape=meta.shape, stride=meta.stride
        )
    # NOTE: DTensor's own constructor is private (its docstring); FSDP2 builds its
    # gradients with it the same way (see the note in _LocalShards.forward)
    return DTensor(g.view_as(g), spec, requires_grad=False)


class ParallelModule(nn.Module):
    """One rank's part of a model planned and compiled by ``autopar.compile``.

    ``named_parameters()``, ``named_buffers()`` and ``state_dict()`` give the model's names,
    each a DTensor holding this rank's shard (a tied parameter once per name in
    ``state_dict``, once in ``parameters()``). ``load_state_dict`` takes DTensors of any
    placements on this mesh, or full tensors (a single-device state dict).
    ``gather_grads()`` returns full gradients (for checks; it gathers every tensor).
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        device_mesh,
        compiled: CompiledStep,
        *,
        stats: dict | None = None,
        local_values: Mapping[str, torch.Tensor] | None = None,
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
        self._input_placements = plan.input_placements
        self._input_shapes = list(compiled.input_shapes)
        self._mirror(model, local_values or {})
        # the step's own buffers (a loss module's, a tensor the step closes over), placed
        # as planned: held apart, so that the module's names and state are the model's
        placements = {**plan.param_placements, **plan.buffer_placements}
        self._constants = SimpleNamespace(
            **{
                f"c{i}": self._distribute(name, value, placements, {})
                for i, (name, value) in enumerate(compiled.constants.items())
            }
        )
        self._constant_slots = {
            n: (self._constants, f"c{i}") for i, n in enumerate(compiled.constants)
        }
        # where each name the step takes lives: (module of the mirror, attribute)
        self._param_slots = [self._slot(n) for n in self._param_names]
        self._buffer_slots = [self._slot(n) for n in self._buffer_names]

    def _slot(self, name: str) -> tuple[object, str]:
        if name in self._constant_slots:
            return self._constant_slots[name]
        path, _, attr = name.rpartition(".")
        return self.get_submodule(path), attr

    def _mirror(self, model: nn.Module, local_values: Mapping[str, torch.Tensor]) -> None:
        """Register the model's parameters and buffers as DTensors in a tree of empty
        modules with the model's paths, in the model's order (so ``state_dict`` keys and
        their order are the model's). ``local_values``: this rank's shards where the caller
        made them (meta-device initialization); others are cut from the model's tensors."""
        placements = {**self.plan.param_placements, **self.plan.buffer_placements}
        persistent = set(model.state_dict(keep_vars=True))
        for name, _ in model.named_children():
            if name in _OWN:
                raise ValueError(
                    f"the model has a child named {name!r}, an attribute ParallelModule "
                    "itself uses; rename it to compile this model"
                )
        mirrors: dict[int, nn.Module] = {}
        made: dict[int, nn.Parameter] = {}  # one DTensor parameter per model parameter (ties)
        for path, module in model.named_modules(remove_duplicate=False):
            if id(module) in mirrors:  # a module shared under two paths: shared here too
                self._container(path).add_module(path.rsplit(".", 1)[-1], mirrors[id(module)])
                continue
            mirror = self if path == "" else nn.Module()
            if path:
                self._container(path).add_module(path.rsplit(".", 1)[-1], mirror)
            mirrors[id(module)] = mirror
            prefix = f"{path}." if path else ""
            for pname, p in module.named_parameters(recurse=False, remove_duplicate=False):
                full_name = prefix + pname
                if id(p) not in made:
                    value = self._distribute(full_name, p, placements, local_values)
                    made[id(p)] = nn.Parameter(value, requires_grad=p.requires_grad)
                mirror.register_parameter(pname, made[id(p)])
            for bname, b in module.named_buffers(recurse=False, remove_duplicate=False):
                full_name = prefix + bname
                value = self._distribute(full_name, b, placements, local_values)
                mirror.register_buffer(bname, value, persistent=full_name in persistent)

    def _container(self, path: str) -> nn.Module:
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        return self.get_submodule(parent)

    def _distribute(self, name, t, placements, local_values) -> DTensor:
        ps = placements.get(name)
        if ps is None:  # not an input of the step (unused by it): kept whole, replicated
            ps = (Replicate(),) * self.device_mesh.ndim
        if name in local_values:
            return DTensor.from_local(
                local_values[name],
                self.device_mesh,
                ps,
                run_check=False,
                shape=t.shape,
                stride=t.stride(),
            )
        if t.is_meta:
            raise ValueError(f"{name} is on the meta device and nothing initialized it")
        d = distribute_tensor(t.detach(), self.device_mesh, ps, src_data_rank=None)
        # its own storage: a replicated local tensor would otherwise be the model's
        return DTensor.from_local(
            d.to_local().clone(),
            self.device_mesh,
            ps,
            run_check=False,
            shape=d.shape,
            stride=d.stride(),
        )

    # -- running -------------------------------------------------------------------------

    def forward(self, *args):
        if len(args) != self._n_args:
            what = "inputs and targets" if self.plan.has_loss else "inputs"
            raise TypeError(
                f"this ParallelModule takes {self._n_args} local {what}, got {len(args)}"
            )
        rank = torch.distributed.get_rank()
        for i, (a, ps) in enumerate(zip(args, self._input_placements)):
            want = self._local_input_shape(i)
            if tuple(a.shape) != want:
                raise ValueError(
                    f"rank {rank}: argument {i} has shape {tuple(a.shape)}, but this rank's "
                    f"part is {want} (placements {ps}); pass pm.shard_inputs(*global_tensors)"
                )
            dtypes = self.compiled.input_dtypes
            if dtypes and a.dtype != dtypes[i]:
                raise TypeError(
                    f"rank {rank}: argument {i} is {a.dtype}, the step was compiled for {dtypes[i]}"
                )
        try:
            return self._fn(*self.local_tensors(), *args)
        except RuntimeError as e:
            if not _PEER_LOST.search(str(e)):
                raise
            first = str(e).strip().splitlines()[0]
            raise PeerLostError(
                f"rank {rank}: another rank was lost during the step ({first}); its own "
                "error is in its log (torchrun's summary names it)"
            ) from None

    def local_tensors(self) -> list[torch.Tensor]:
        """The local shard of every parameter, then of every buffer, as the compiled step
        takes them: differentiable, each local gradient returning as its parameter's DTensor
        gradient with the parameter's placements (the step reduced it to them)."""
        params = [getattr(m, a) for m, a in self._param_slots]
        buffers = [getattr(m, a).to_local() for m, a in self._buffer_slots]
        if not torch.is_grad_enabled() or not any(p.requires_grad for p in params):
            return [p.to_local() for p in params] + buffers
        return [*_LocalShards.apply(params[0].device_mesh, *params), *buffers]

    def _local_input_shape(self, i: int) -> tuple[int, ...]:
        mesh_shape = tuple(self.device_mesh.shape)
        return local_shape(self._input_shapes[i], self._input_placements[i], mesh_shape)

    def shard_inputs(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's local part of each input (then target), as the plan places it, from
        the global batch or from this rank's ``data_shard()`` part of it."""
        if len(tensors) != len(self._input_placements):
            raise TypeError(f"expected {len(self._input_placements)} tensors, got {len(tensors)}")
        parts, _ = self.data_shard()
        out = []
        for i, (t, ps) in enumerate(zip(tensors, self._input_placements)):
            rows = self._input_shapes[i][0] if self._input_shapes[i] else None
            if parts > 1 and rows is not None and t.shape[0] * parts == rows:
                out.append(self._from_part(i, t))
            else:
                out.append(
                    distribute_tensor(t, self.device_mesh, ps, src_data_rank=None).to_local()
                )
        return tuple(out)

    def _batch_axes(self) -> list[tuple[int, ...]]:
        """For each input and target, the mesh axes it splits dim 0 over, in mesh order."""
        return [
            tuple(a for a, p in enumerate(ps) if p.is_shard(0)) for ps in self._input_placements
        ]

    def _part_axes(self) -> tuple[int, ...]:
        """The mesh axes of ``data_shard``: the longest run of axes that every input and
        target splits its batch over first (so each rank's rows lie inside its part)."""
        axes = self._batch_axes()
        common: tuple[int, ...] = ()
        for k in range(min((len(a) for a in axes), default=0)):
            if len({a[k] for a in axes}) != 1:
                break
            common += (axes[0][k],)
        return common

    def data_shard(self) -> tuple[int, int]:
        """``(parts, part)``: read only part ``part`` of ``parts`` of each global batch
        (a ``DistributedSampler(num_replicas=parts, rank=part)`` with a batch of global /
        ``parts`` rows) and pass it to ``shard_inputs``, which cuts this rank's rows from it.
        Ranks that share a part read the same rows."""
        coord = self.device_mesh.get_coordinate()
        parts, part = 1, 0
        for a in self._part_axes():
            size = self.device_mesh.size(a)
            parts, part = parts * size, part * size + coord[a]
        return parts, part

    def _from_part(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of input ``i`` from this rank's ``data_shard`` part."""
        ps = self._input_placements[i]
        if any(p.is_shard() and not p.is_shard(0) for p in ps):
            raise ValueError(
                f"the plan shards argument {i} along another dim than the batch ({ps}): "
                "pass the global batch to shard_inputs"
            )
        coord = self.device_mesh.get_coordinate()
        common = self._part_axes()
        chunks, index = 1, 0
        for a in self._batch_axes()[i][len(common) :]:
            size = self.device_mesh.size(a)
            chunks, index = chunks * size, index * size + coord[a]
        return t.tensor_split(chunks)[index] if chunks > 1 else t

    # -- state ---------------------------------------------------------------------------

    def gather_grads(self) -> dict[str, torch.Tensor | None]:
        """``{parameter name: full gradient}`` (None where there is no gradient); every
        name of a tied parameter."""
        out = {}
        for name in self._param_names:
            g = self.get_parameter(name).grad
            out[name] = g.full_tensor() if isinstance(g, DTensor) else g
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load DTensors of any placements on this mesh, or full tensors (as a single-device
        model's ``state_dict`` holds them): each is laid out as the plan places it first.
        To load onto another mesh, use ``torch.distributed.checkpoint``."""
        own = self.state_dict(keep_vars=True)
        laid = {}
        for key, value in state_dict.items():
            mine = own.get(key)
            if not isinstance(mine, DTensor) or not isinstance(value, torch.Tensor):
                laid[key] = value
            elif isinstance(value, DTensor):
                if value.device_mesh != self.device_mesh:
                    raise ValueError(
                        f"{key} is a DTensor on another device mesh ({value.device_mesh}); "
                        "load it with torch.distributed.checkpoint, which reshards"
                    )
                laid[key] = value.redistribute(self.device_mesh, mine.placements)
            else:
                if tuple(value.shape) != tuple(mine.shape):
                    raise ValueError(
                        f"{key} has shape {tuple(value.shape)}, the model's is {tuple(mine.shape)}"
                    )
                laid[key] = distribute_tensor(
                    value.detach().to(mine.device),
                    self.device_mesh,
                    mine.placements,
                    src_data_rank=None,
                )
        return super().load_state_dict(laid, strict=strict, assign=assign)

    def collective_counts(self) -> dict[tuple[str, str], int]:
        """``{(kind, axis name): count}`` of the collectives in the compiled step graph."""
        return dict(self.compiled.collective_counts)

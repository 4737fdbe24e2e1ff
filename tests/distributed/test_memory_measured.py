"""The memory simulator's peak (passes/memory) against the emitted step's, on gloo meshes.

Each rank runs AdamW steps of a plan and, during the third, counts the bytes of live
storages (``autopar.verify.measured_step_peak``: every op's outputs, live while any tensor
on them is). The cases are benchmarks/memory_check.py's smallest that redistribute into a
view (the view then holds the collective's result, and what it views is freed). And
codegen's gather of a transposed shard, by the bytes it holds."""

from __future__ import annotations

import pytest
import torch

from autopar.runtime import run_local
from autopar.verify import measured_step_peak

from helpers import compile_quietly

VIEWS = ("aten.t.default", "aten.view.default", "aten._unsafe_view.default")


def _peaks(rank, world, example, mesh_shape, fraction):
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.models import EXAMPLES

    torch.manual_seed(0)
    model, inputs, loss_fn, targets = EXAMPLES[example]()
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp")[: len(mesh_shape)])
    pm = compile_quietly(
        model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, memory_fraction=fraction
    )
    local = pm.shard_inputs(*inputs, *targets)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=False)

    def step():
        pm(*local).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()
    plan = pm.plan
    into_views = [c.edge for c in plan.collectives if plan.nodes[c.edge.split("->")[1]].op in VIEWS]
    return measured_step_peak(pm, opt, local, step), plan.memory["step"], into_views


@pytest.mark.parametrize(
    "example, mesh_shape, fraction",
    [("mlp", (2, 2), 0.5), ("gpt", (2,), None)],
    ids=["mlp-2x2-half-a-device", "gpt-2"],
)
def test_the_predicted_peak_of_a_sharded_step_is_the_measured_one(example, mesh_shape, fraction):
    world = 4 if len(mesh_shape) == 2 else 2
    for measured, predicted, into_views in run_local(_peaks, world, example, mesh_shape, fraction):
        assert into_views  # (the case's point: a reshard into a view)
        assert predicted["peak_bytes"] == pytest.approx(measured, rel=0.002), predicted["at_peak"]


def _transposed(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from autopar.passes.codegen import redistribute_local
    from autopar.verify import LiveStorages

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    weight = torch.randn(8, 6)
    found = {}
    for dim in (0, 1):  # (of the transposed: 1 is outermost in memory)
        val = weight.t()
        # (a shard of its own, laid out as the whole: the transposed shard a rank holds)
        local = val.chunk(world, dim)[rank].clone(memory_format=torch.preserve_format)
        assert local.stride()[0] == 1
        seen = LiveStorages()
        seen.add(local)
        with seen:
            seen.peak = start = seen.live()
            out = redistribute_local(local, (Shard(dim),), (Replicate(),), val, mesh)
        found[dim] = (torch.equal(out, val), out.stride() == val.stride(), seen.peak - start)
    return found


def test_a_transposed_shard_is_gathered_in_its_memory_order():
    """codegen's redistribution of a transposed tensor: the gather reads the shard as it
    lies and returns the whole in the source's layout, holding the result alone (along
    the dim outermost in memory) or the result and its copy along the dim (along the
    other): what passes/memory's ``reshard_bytes`` counts for a transposed tensor."""
    whole = 8 * 6 * 4
    for found in run_local(_transposed, 2):
        assert found[1] == (True, True, whole)
        assert found[0] == (True, True, 2 * whole)

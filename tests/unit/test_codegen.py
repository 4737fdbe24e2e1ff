"""Codegen on a two-matmul model: the collectives the local graph emits, and their count.

One process: a fake process group (torch's testing backend, which records collectives and
moves no data) stands behind a 2-rank ``tp`` mesh; codegen only traces the local graph.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

# NOTE: private testing module: torch has no public fake process group. It registers the
# "fake" backend on import.
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from autopar.passes.codegen import build_local_graph, count_collectives
from autopar.passes.trace import trace_step

HIDDEN, FFN = 256, 1024


@pytest.fixture(scope="module")
def tp_mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def _dot_loss(y, t):
    return (y * t).sum()


def test_megatron_pair_emits_one_all_reduce_of_the_loss(tp_mesh):
    model = nn.Sequential(nn.Linear(HIDDEN, FFN, bias=False), nn.Linear(FFN, HIDDEN, bias=False))
    x, t = torch.randn(1, HIDDEN), torch.randn(1, HIDDEN)  # batch 1: nothing to split
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(
            model,
            autopar.Mesh((2,), ("tp",)),
            (x,),
            loss_fn=_dot_loss,
            example_targets=(t,),
            memory_fraction=0.6,  # both weights must be halved
        )
    # column-parallel then row-parallel: the second matmul's output is a partial sum, which
    # stays partial through the (linear) product with the target and the sum
    assert plan.param_placements == {"0.weight": (Shard(0),), "1.weight": (Shard(1),)}
    with contextlib.ExitStack() as stack:
        step = trace_step(model, (x,), loss_fn=_dot_loss, example_targets=(t,), stack=stack)
        local = build_local_graph(step, plan, tp_mesh)
    assert local.mismatches == []
    counts = count_collectives(local.gm, tp_mesh)
    assert counts == {("all_reduce", "tp"): 1} == plan.collective_counts()
    (ar,) = [n for n in local.gm.graph.nodes if "all_reduce" in str(n.target)]
    assert tuple(ar.args[0].meta["val"].shape) == ()  # the scalar loss, nothing bigger
    # the matmuls run on local shards: the forward's weights are [HIDDEN, FFN / 2] views
    mms = [n for n in local.gm.graph.nodes if n.target == torch.ops.aten.mm.default]
    assert len(mms) == 5  # 2 forward, 3 backward (no gradient for the input)
    assert all(FFN // 2 in n.meta["val"].shape or n.meta["val"].shape == (1, HIDDEN) for n in mms)
    assert {tuple(n.meta["val"].shape) for n in mms[:2]} == {(1, FFN // 2), (1, HIDDEN)}

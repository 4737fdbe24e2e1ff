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


def _first(graph: torch.fx.Graph, pred) -> int:
    return next(i for i, n in enumerate(graph.nodes) if pred(n))


@pytest.mark.parametrize("expert", ["dp", "fsdp"])
def test_gradient_reductions_run_while_the_backward_computes(tp_mesh, expert):
    """DP's all-reduces and FSDP's reduce-scatters of the gradients are issued in the
    compiled backward as soon as each gradient exists, and waited for at its end."""
    from autopar import experts
    from autopar.passes.codegen import codegen

    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    x, t = torch.randn(8, 64), torch.randn(8, 64)
    mesh = autopar.Mesh((2,), ("tp",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(
            model, mesh, (x,), loss_fn=_dot_loss, example_targets=(t,),
            constraints=getattr(experts, expert)(mesh),
        )  # fmt: skip
        with contextlib.ExitStack() as stack:
            step = trace_step(model, (x,), loss_fn=_dot_loss, example_targets=(t,), stack=stack)
            compiled = codegen(step, plan, tp_mesh)
    kind = "all_reduce" if expert == "dp" else "reduce_scatter"
    grads = [c for c in plan.collectives if "param" in c and c["kind"] == kind]
    assert len(grads) == 8  # a weight and a bias per layer
    bw = compiled.graphs["backward"].graph
    nodes = list(bw.nodes)
    mms = [i for i, n in enumerate(nodes) if n.target == torch.ops.aten.mm.default]
    issued = [i for i, n in enumerate(nodes) if kind in str(n.target)]
    waits = [
        i for i, n in enumerate(nodes)
        if "wait_tensor" in str(n.target) and kind in str(n.args[0].target)
    ]  # fmt: skip
    assert len(issued) == len(waits) == 8
    # the first layers' reductions go out while later layers' gradients are computed ...
    assert sum(i < mms[-1] for i in issued) >= 6
    # ... each right after the node that makes its input, and all are waited for at the end
    for i in issued:
        assert nodes[i].args[0] is nodes[i - 1]
    assert min(waits) > mms[-1]

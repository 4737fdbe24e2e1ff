"""Buffers the forward updates (BatchNorm's running statistics) on a (2, 2) gloo mesh.

The traced step returns each updated buffer as an output, the plan places it as its buffer,
and the compiled step writes it back, so after every step the buffers hold what the
single-device model's hold. BatchNorm's statistics are over the global batch (as
SyncBatchNorm computes them): DTensor's rule shards BatchNorm by channel or not at all.
``state_dict()`` returns the model's own keys, DTensors with the plan's placements.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from autopar.runtime import run_local

from helpers import compile_quietly, train_beside

STEPS = 3


class ConvNet(nn.Module):
    """Two conv + BatchNorm + ReLU blocks, global average pooling, a linear head."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x_BCHW):
        x_BCHW = torch.relu(self.bn1(self.conv1(x_BCHW)))
        x_BCHW = torch.relu(self.bn2(self.conv2(x_BCHW)))
        return self.fc(x_BCHW.mean((2, 3)))


def _cross_entropy(logits, labels):
    return nn.functional.cross_entropy(logits, labels)


def _train(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = ConvNet().double()
    ref = copy.deepcopy(model)
    x = torch.randn(8, 3, 8, 8, dtype=torch.float64)
    labels = torch.randint(0, 10, (8,))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pm = compile_quietly(
        model,
        mesh,
        (x,),
        loss_fn=_cross_entropy,
        example_targets=(labels,),
        memory_fraction=0.5,
    )
    local = pm.shard_inputs(x, labels)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = list(
        train_beside(pm, local, opt, lambda: _cross_entropy(ref(x), labels), ref_opt, STEPS)
    )
    sd, want = pm.state_dict(), ref.state_dict()
    placed = {k: tuple(v.placements) for k, v in sd.items() if isinstance(v, DTensor)}
    got = {k: v.full_tensor() for k, v in sd.items()}
    errors = {
        k: ((got[k].double() - v.double()).norm() / max(v.double().norm(), 1e-30)).item()
        for k, v in want.items()
    }
    return {
        "losses": losses,
        "keys": (list(got), list(want)),
        "shapes_equal": all(got[k].shape == v.shape for k, v in want.items()),
        "errors": errors,
        "buffer_placements": pm.plan.buffer_placements,
        "param_placements": pm.plan.param_placements,
        "placed": placed,
        "warnings": pm.plan.warnings,
    }


@pytest.mark.distributed
def test_batchnorm_running_statistics_match_single_device():
    from torch.distributed.tensor import Shard

    for r in run_local(_train, 4):
        for got, want in r["losses"]:
            assert got == pytest.approx(want, rel=1e-12)
        keys, want_keys = r["keys"]
        assert keys == want_keys  # the model's names, in its order
        assert r["shapes_equal"]
        # every parameter and buffer, running statistics and step counts included
        assert max(r["errors"].values()) < 1e-12, r["errors"]
        assert r["errors"]["bn1.num_batches_tracked"] == 0.0
        assert r["warnings"] == ()
        # the budget shards something the buffers follow: the stored buffer is a shard, and
        # state_dict() holds it as a DTensor of the global shape
        assert any(Shard(0) in ps for ps in r["buffer_placements"].values()), r["buffer_placements"]
        # every entry is a DTensor placed as the plan says
        assert r["placed"] == {**r["param_placements"], **r["buffer_placements"]}

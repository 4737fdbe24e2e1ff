"""A weight-dominated Llama on a (2, 2) H100 mesh gets a Megatron-style plan.

Llama with hidden 4096 and 2 layers (537M parameters) on a batch of 8 x 512 tokens: the
weights outweigh the activations, so one mesh axis runs tensor parallel (column-parallel
q/k/v/gate/up, row-parallel o/down: activations are all-reduced instead of gradients) and
the other shards the batch. On one node both axes have the same NVLink links, so which
axis takes which role is a tie of the cost model; the test asserts the structure on
whichever axis carries it. Planned from the meta device: no weights are allocated.
"""

import warnings

import pytest
import torch
from torch.distributed.tensor import Shard

import autopar
from autopar.models import hf_llama, hf_logits_loss

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def _plan(mesh):
    with torch.device("meta"):
        model = hf_llama(
            layers=2, hidden=4096, heads=32, kv_heads=32, ffn=16384, vocab=512, seq=512
        ).to(torch.bfloat16)
    tokens = torch.zeros(8, 512, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(
            model, mesh, (tokens,), loss_fn=hf_logits_loss, example_targets=(tokens,)
        )


@pytest.fixture(scope="module")
def llama_plan():
    return _plan(autopar.Mesh((2, 2), ("dp", "tp"), device="h100"))


def _megatron_axes(plan) -> list[int]:
    """Mesh axes on which every projection is column- or row-parallel as in Megatron."""
    placements = plan.param_placements
    axes = []
    for axis in range(plan.mesh.ndim):
        ok = True
        for layer in range(2):
            for proj in COLUMN + ROW:
                group = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                p = placements[f"model.layers.{layer}.{group}.{proj}.weight"][axis]
                ok &= p == (Shard(0) if proj in COLUMN else Shard(1))
        if ok:
            axes.append(axis)
    return axes


def test_projections_are_column_then_row_parallel_and_batch_on_the_other_axis(llama_plan):
    axes = _megatron_axes(llama_plan)
    assert axes, llama_plan.summary()
    tokens = llama_plan.input_placements[0]
    # ... and the batch is sharded over the other axis
    assert any(tokens[a] == Shard(0) for a in range(2) if a != axes[0]), tokens


def test_plan_is_faster_than_one_device_and_runs_tp_all_reduces(llama_plan):
    one = _plan(autopar.Mesh((1, 1), ("dp", "tp"), device="h100"))
    assert one.collectives == ()
    assert llama_plan.cost["total_s"] < 0.5 * one.cost["total_s"]
    # row-parallel outputs are partial sums, all-reduced over tp
    assert llama_plan.collective_counts()[("all_reduce", "tp")] > 0

"""A weight-dominated Llama on a (2, 2) H100 mesh gets a Megatron-style plan.

Llama with hidden 4096 and 2 layers (537M parameters) on a batch of 8 x 512 tokens: the
weights outweigh the activations, so all-reducing activations (tensor parallel) is cheaper
than all-reducing gradients on the "tp" axis, and sharding the batch pays on "dp". Planned
from the meta device: no weights are allocated.
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


def test_projections_are_column_then_row_parallel_over_tp(llama_plan):
    tp = llama_plan.mesh.axis("tp")
    placements = llama_plan.param_placements
    for layer in range(2):
        for proj in COLUMN:
            group = "self_attn" if proj in ("q_proj", "k_proj", "v_proj") else "mlp"
            name = f"model.layers.{layer}.{group}.{proj}.weight"
            assert placements[name][tp] == Shard(0), (name, placements[name])
        for proj in ROW:
            group = "self_attn" if proj == "o_proj" else "mlp"
            name = f"model.layers.{layer}.{group}.{proj}.weight"
            assert placements[name][tp] == Shard(1), (name, placements[name])


def test_batch_is_sharded_over_dp(llama_plan):
    dp = llama_plan.mesh.axis("dp")
    tokens_placement = llama_plan.input_placements[0]
    assert tokens_placement[dp] == Shard(0)


def test_plan_is_faster_than_one_device_and_runs_tp_all_reduces(llama_plan):
    one = _plan(autopar.Mesh((1, 1), ("dp", "tp"), device="h100"))
    assert one.collectives == ()
    assert llama_plan.cost["total_s"] < 0.5 * one.cost["total_s"]
    # row-parallel outputs are partial sums, all-reduced over tp
    assert llama_plan.collective_counts()[("all_reduce", "tp")] > 0

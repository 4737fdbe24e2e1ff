"""Llama-3-8B on a (8, 8) H100 mesh in bf16 mixed precision, planned from the meta device.

32 layers fold into one group, so the solver sees one layer; every projection is sharded,
the layers run on a share of the batch, the loss on a share of the vocabulary, the step's
memory fits an H100, and the plan is at least as fast as Megatron's layout over one axis
with the batch over the other (by the cost model; benchmarks/plan_quality.py has the
numbers, at its batch). How long it takes is measured by benchmarks/plan_at_scale.py, not
here.
"""

import pytest
import torch
from torch.distributed.tensor import Shard

import autopar
from autopar import experts
from autopar.models import EXAMPLES

from helpers import evaluate_quietly, plan_quietly

pytestmark = pytest.mark.pinned_torch_only

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
BF16 = autopar.MixedPrecision(torch.bfloat16, torch.float32)  # as Llama 3 is trained


@pytest.fixture(scope="module")
def llama3_plan():
    model, inputs, loss_fn, targets = EXAMPLES["llama3-8b"]()
    mesh = autopar.Mesh((8, 8), ("dp", "tp"), device="h100")
    return plan_quietly(
        model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, mp_policy=BF16
    )


def test_llama3_8b_layers_fold_into_one_group(llama3_plan):
    plan = llama3_plan
    (group,) = plan.stats["fold_groups"]
    assert group["instances"] == 32 and group["regions"] == "model.layers.{0..31}"
    assert plan.stats["fold_regions"] == 32
    # the solver sees one layer and what lies outside the layers
    assert plan.stats["solver_nodes"] < plan.stats["nodes"] / 20


def test_llama3_8b_plan_beats_megatron_with_data_parallel_and_fits_an_h100(llama3_plan):
    plan = llama3_plan
    pp = plan.param_placements
    # every projection of every layer is sharded on some axis: none replicated everywhere
    for i in range(32):
        for p in COLUMN + ROW:
            group = "self_attn" if p in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            assert any(isinstance(a, Shard) for a in pp[f"model.layers.{i}.{group}.{p}.weight"])
    # the layers run on a share of the batch: every forward matmul of a layer takes its
    # rows (the tokens of [B S, H]) split over dp
    mms = [
        c for c in plan.nodes.values()
        if c.op == "aten.mm.default" and c.role == "forward" and c.module.startswith("model.layers.")
    ]  # fmt: skip
    assert len(mms) == 32 * 7 and all(c.ins[0][0] == "S(0)" for c in mms)
    # the loss reads the logits split over the vocabulary (passes/vocab), as the LM head
    # makes them: no gather of [B S, V] values
    assert "S(1)" in plan.nodes["_log_softmax"].ins[0]
    # the step (parameters, gradients, AdamW state, activations, ...) fits an H100's budget
    assert plan.stats["memory_budget"] == 76e9  # the profile's 80 GB less its reserve
    assert 0 < plan.memory["step"]["peak_bytes"] <= plan.stats["memory_budget"]
    # and it is at least as fast as Megatron's layout over tp with the batch over dp,
    # costed by the same model (benchmarks/plan_quality.py has the other experts)
    model, inputs, loss_fn, targets = EXAMPLES["llama3-8b"]()
    expert = evaluate_quietly(
        model, plan.mesh, inputs, experts.megatron(model, plan.mesh, tp="tp", dp="dp"),
        loss_fn=loss_fn, example_targets=targets, mp_policy=BF16,
    )  # fmt: skip
    assert plan.cost["total_s"] <= expert.cost["total_s"], (plan.summary(), expert.summary())

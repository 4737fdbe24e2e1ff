"""Llama-3-8B on a (8, 8) H100 mesh in bf16 mixed precision, planned from the meta device.

32 layers fold into one group, so the solver sees one layer; the plan is Megatron's on one
axis (column-parallel q/k/v/gate/up, row-parallel o/down) with the batch on the other,
and the step's memory fits an H100. How long it takes is measured by
benchmarks/plan_at_scale.py, not here.
"""

import warnings

import pytest
import torch
from torch.distributed.tensor import Shard

import autopar
from autopar.models import EXAMPLES

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
BF16 = autopar.MixedPrecision(torch.bfloat16, torch.float32)  # as Llama 3 is trained


@pytest.fixture(scope="module")
def llama3_plan():
    model, inputs, loss_fn, targets = EXAMPLES["llama3-8b"]()
    mesh = autopar.Mesh((8, 8), ("dp", "tp"), device="h100")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(
            model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, mp_policy=BF16
        )


def test_llama3_8b_layers_fold_into_one_group(llama3_plan):
    plan = llama3_plan
    (group,) = plan.stats["fold_groups"]
    assert group["instances"] == 32 and group["regions"] == "model.layers.{0..31}"
    assert plan.stats["fold_regions"] == 32
    # the solver sees one layer and what lies outside the layers
    assert plan.stats["solver_nodes"] < plan.stats["nodes"] / 20


def test_llama3_8b_plan_is_megatron_on_one_axis_and_fits_an_h100(llama3_plan):
    plan = llama3_plan
    pp = plan.param_placements
    tp = [
        axis
        for axis in range(2)
        if all(
            pp[f"model.layers.{i}.{g}.{p}.weight"][axis] == (Shard(0) if p in COLUMN else Shard(1))
            for i in range(32)
            for g, ps in (
                ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                ("mlp", ("gate_proj", "up_proj", "down_proj")),
            )
            for p in ps
        )
    ]
    assert tp, plan.summary()
    dp = 1 - tp[0]
    # the batch is split over the other axis from the embedding on (reading the tokens is
    # priced at their bytes only, so where the split starts is a near tie)
    (embed,) = [c for c in plan.nodes.values() if c.op == "aten.embedding.default"]
    assert embed.out[0][dp] == "S(0)", embed
    # the step (parameters, gradients, AdamW state, activations, ...) fits an H100's budget
    assert plan.stats["memory_budget"] == 76e9  # the profile's 80 GB less its reserve
    assert 0 < plan.memory["step"]["peak_bytes"] <= plan.stats["memory_budget"]
    # each layer's attention and MLP outputs are partial sums reduced over the tp axis
    on_tp = {
        k: n for (k, a), n in plan.collective_counts().items() if a == plan.mesh.axis_names[tp[0]]
    }
    assert on_tp.get("all_reduce", 0) + on_tp.get("reduce_scatter", 0) >= 2 * 32, on_tp

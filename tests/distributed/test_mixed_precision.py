"""Mixed precision (``autopar.MixedPrecision``, as FSDP2's policy) on gloo, against one device.

A GPT trains three AdamW steps in bf16 compute from float32 parameters, planned on (2, 2)
under a memory budget that makes the plan shard. The single-device reference runs the same
policy eagerly (``autopar.cast_parameters``); a float32 control runs without it. The
parallel run must stay as close to the reference as bf16 lets two orders of summation be:
within a small multiple of how far bf16 itself moves the reference from float32.
"""

from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.models import GPT, GPTConfig, cross_entropy_loss, lm_batch
from autopar.runtime import run_local

from helpers import compile_quietly

CFG = GPTConfig(vocab=64, seq=16, hidden=32, heads=4, layers=2, ffn=64)
BATCH = 8
STEPS = 3


def _train_one_device(model, tokens, targets, policy):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(STEPS):
        with autopar.cast_parameters(model, policy):
            loss = cross_entropy_loss(model(tokens), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _rank(rank, world, reduce_dtype):
    from torch.distributed.device_mesh import init_device_mesh

    # the logits leave the model in float32, as LLM recipes compute the loss
    policy = autopar.MixedPrecision(torch.bfloat16, reduce_dtype, output_dtype=torch.float32)
    torch.manual_seed(0)
    model = GPT(CFG)
    tokens, targets = lm_batch(CFG.vocab, BATCH, CFG.seq)
    ref_mp = _train_one_device(copy.deepcopy(model), tokens, targets, policy)
    ref_fp32 = _train_one_device(copy.deepcopy(model), tokens, targets, None)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pm = compile_quietly(
        model,
        mesh,
        (tokens,),
        loss_fn=cross_entropy_loss,
        example_targets=(targets,),
        mp_policy=policy,
        memory_fraction=0.5,
    )
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    local = pm.shard_inputs(tokens, targets)
    losses = []
    for _ in range(STEPS):
        loss = pm(*local)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    ref_params, fp32_params = ref_mp[1], ref_fp32[1]
    # per parameter (L2): how far the parallel run is from the reference, and how far bf16
    # moved the reference from float32 (numbers: tensors do not cross process boundaries)
    errors = {
        n: (
            (p.full_tensor().detach() - ref_params[n]).norm().item(),
            (ref_params[n] - fp32_params[n]).norm().item(),
        )
        for n, p in pm.named_parameters()
    }
    dtypes = {p.dtype for p in pm.parameters()}
    mm = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    matmul_dtypes = {n.meta["val"].dtype for n in pm.compiled.gm.graph.nodes if n.target in mm}
    sharded = [n for n, ps in pm.plan.param_placements.items() if any(p.is_shard() for p in ps)]
    return {
        "losses": losses,
        "errors": errors,
        "ref_mp": ref_mp[0],
        "ref_fp32": ref_fp32[0],
        "dtypes": dtypes,
        "matmul_dtypes": matmul_dtypes,
        "sharded": sharded,
        "stats": dict(pm.plan.stats),
        "casts": [
            (c.ins, c.out)
            for c in pm.plan.nodes.values()
            if c.op == "aten._to_copy.default" and c.role == "backward"
        ],
    }


@pytest.mark.distributed
@pytest.mark.parametrize(
    "reduce_dtype",
    [torch.float32, torch.bfloat16],
)
def test_bf16_compute_from_float32_parameters_matches_one_device(reduce_dtype):
    r = run_local(_rank, 4, reduce_dtype)[0]
    assert r["dtypes"] == {torch.float32}  # master weights stay float32 (and AdamW's state)
    assert r["matmul_dtypes"] == {torch.bfloat16}  # the emitted step computes in bf16
    assert r["sharded"], "the budget must shard some parameter for this test to mean anything"
    assert r["stats"]["mixed_precision"].startswith("param bfloat16, reduce ")
    # a gradient cast never takes a partial sum in and gives a reduced one out: the
    # reduction is on the side of the cast that reduce_dtype names
    for ins, out in r["casts"]:
        partial_in = any(p.startswith("P") for p in ins[0])
        partial_out = any(p.startswith("P") for p in out[0])
        assert partial_in == partial_out
        if reduce_dtype == torch.bfloat16:
            assert not partial_in
    ref_losses, fp32_losses = r["ref_mp"], r["ref_fp32"]
    bf16_effect = max(abs(a - b) for a, b in zip(ref_losses, fp32_losses))
    assert bf16_effect > 1e-4  # the policy does compute in bf16
    for got, want in zip(r["losses"], ref_losses):
        assert abs(got - want) <= max(bf16_effect, 2e-3), (r["losses"], ref_losses, fp32_losses)
    assert len(r["errors"]) == len(list(GPT(CFG).parameters()))
    # over all parameters: AdamW turns a tiny gradient's sign into a whole step, so one
    # weight's error says little; the whole model's distance does
    got = sum(e * e for e, _ in r["errors"].values()) ** 0.5
    drift = sum(d * d for _, d in r["errors"].values()) ** 0.5
    assert got <= 1.5 * drift, (got, drift)

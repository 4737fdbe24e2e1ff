"""Activation checkpointing (passes/remat) chosen by the solver, run on gloo.

A GPT on (2,) under a budget that the plan meets only by recomputing its layers: the
solver checkpoints them, codegen emits the copies in the backward, and the step computes
what the same placements compute without checkpointing, to the bit, and what one device
computes, to float32 rounding.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import autopar
from autopar.models import GPT, GPTConfig, cross_entropy_loss, lm_batch
from autopar.passes.solve import SolveError
from autopar.runtime import run_local

from helpers import quiet

CFG = GPTConfig(vocab=64, seq=16, hidden=32, heads=4, layers=2, ffn=64)
BATCH = 8
FRACTION = 0.45  # on (2,): no plan fits it without checkpointing (test below)


def _step(pm, local):
    loss = pm(*local)
    loss.backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in pm.named_parameters()}
    pm.zero_grad()
    return loss.item(), grads


def _rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = GPT(CFG)
    tokens, targets = lm_batch(CFG.vocab, BATCH, CFG.seq)
    ref = copy.deepcopy(model)
    ref_loss = cross_entropy_loss(ref(tokens), targets)
    ref_loss.backward()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    kwargs = dict(loss_fn=cross_entropy_loss, example_targets=(targets,))
    with quiet():
        pm = autopar.compile(model, mesh, (tokens,), memory_fraction=FRACTION, **kwargs)
        kept = dataclasses.replace(pm.plan, recompute=())
        pm_kept = autopar.compile(copy.deepcopy(model), mesh, (tokens,), plan=kept, **kwargs)
    local = pm.shard_inputs(tokens, targets)
    loss, grads = _step(pm, local)
    loss_kept, grads_kept = _step(pm_kept, local)
    mm = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    return {
        "recompute": [r.region for r in pm.plan.recompute],
        "loss": (loss, loss_kept, ref_loss.item()),
        "same_as_kept": all(torch.equal(grads[n], grads_kept[n]) for n in grads),
        "vs_one_device": max(
            (grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters()
        ),
        "matmuls": (
            sum(n.target in mm for n in pm.compiled.gm.graph.nodes),
            sum(n.target in mm for n in pm_kept.compiled.gm.graph.nodes),
        ),
        "peak": pm.plan.memory["step"]["peak_bytes"],
        "budget": pm.plan.stats["memory_budget"],
    }


@pytest.mark.distributed
def test_checkpointed_step_computes_what_the_kept_step_computes():
    r = run_local(_rank, 2)[0]
    assert r["recompute"] == ["blocks.0", "blocks.1"]
    loss, loss_kept, ref = r["loss"]
    assert loss == loss_kept
    assert abs(loss - ref) < 1e-5
    assert r["same_as_kept"]
    assert r["vs_one_device"] < 1e-5
    # the emitted step recomputes: the copies' matmuls run in the backward too
    with_copies, without = r["matmuls"]
    assert with_copies > without
    assert r["peak"] <= r["budget"]


def test_the_budget_needs_checkpointing():
    """The budget of the test above has no plan that keeps every activation, and the plan
    that recomputes is priced: it costs more step time than the plan without a budget."""
    torch.manual_seed(0)
    model = GPT(CFG)
    tokens, targets = lm_batch(CFG.vocab, BATCH, CFG.seq)
    mesh = autopar.Mesh((2,), ("dp",))
    kwargs = dict(loss_fn=cross_entropy_loss, example_targets=(targets,))
    with quiet():
        with pytest.raises(SolveError, match="smallest budget that fits"):
            autopar.plan(
                model, mesh, (tokens,), memory_fraction=FRACTION, checkpointing=False, **kwargs
            )
        plan = autopar.plan(model, mesh, (tokens,), memory_fraction=FRACTION, **kwargs)
        free = autopar.plan(model, mesh, (tokens,), memory_budget=float("inf"), **kwargs)
    assert [r.region for r in plan.recompute] == ["blocks.0", "blocks.1"]
    assert plan.stats["recomputed_layers"] == 2
    assert plan.stats["recompute_s"] > 0
    assert plan.cost["total_s"] > free.cost["total_s"]
    assert not free.recompute
    # the plan round-trips with its checkpointing
    assert autopar.Plan.from_json(plan.to_json()).recompute == plan.recompute

"""Gradient buckets (passes/buckets) as the compiled step runs them, on a gloo mesh, against
one device: the plan's buckets are the all-reduces the step runs, the backward issues each
one after its last gradient, and the result is the single-device one in float64."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar import experts
from autopar.models import GPT, GPTConfig, cross_entropy_loss, lm_batch
from autopar.runtime import run_local
from autopar.verify import CollectiveBytes

CFG = GPTConfig(vocab=64, seq=16, hidden=32, heads=4, layers=2, ffn=64)
BATCH = 8
BUCKET_MB = 0.02  # ~20 KiB: this model's 0.1 MiB of gradients in several buckets


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG).double()


def _plan(skip=()) -> autopar.Plan:
    tokens, targets = lm_batch(CFG.vocab, BATCH, CFG.seq)
    mesh = autopar.Mesh((2,), ("dp",), device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(
            _gpt(), mesh, (tokens,), loss_fn=cross_entropy_loss, example_targets=(targets,),
            constraints=experts.dp(mesh), bucket_mb=BUCKET_MB, skip=skip,
        )  # fmt: skip


def _bucket_reduces(gm: torch.fx.GraphModule) -> list[int]:
    """Positions of the all-reduces of a flattened bucket (of a ``cat``) in ``gm``."""
    return [
        i
        for i, n in enumerate(gm.graph.nodes)
        if n.op == "call_function"
        and n.target is torch.ops._c10d_functional.all_reduce.default
        and n.args[0].target is torch.ops.aten.cat.default
    ]


def _train(rank, world, plan_json: str, overlap: bool):
    from autopar.passes import codegen

    model = _gpt()
    ref = copy.deepcopy(model)
    tokens, targets = lm_batch(CFG.vocab, BATCH, CFG.seq)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    plan = autopar.Plan.from_json(plan_json)
    # NOTE: the CUDA emission (each bucket waited for at the backward's end) forced on gloo;
    # this plan has no other collective on the axis in the backward, so one bucket at a
    # time is in flight beside the kernels, not two
    init = codegen._Localizer.__init__

    def forced(self, *a, **k):
        init(self, *a, **k)
        self.overlap = overlap

    codegen._Localizer.__init__ = forced
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = autopar.compile(model, mesh, (tokens,), loss_fn=cross_entropy_loss,
                                 example_targets=(targets,), plan=plan)  # fmt: skip
    finally:
        codegen._Localizer.__init__ = init
    local = pm.shard_inputs(tokens, targets)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses = []
    counted = CollectiveBytes(mesh)
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        if step == 0:
            with counted:
                loss = pm(*local)
                loss.backward()
        else:
            loss = pm(*local)
            loss.backward()
        ref_loss = cross_entropy_loss(ref(tokens), targets)
        ref_loss.backward()
        losses.append((loss.item(), ref_loss.item()))
        refs = dict(ref.named_parameters())
        # against the largest gradient: the keys' bias has a gradient of 0 up to rounding
        # (softmax ignores a shift of every key alike)
        scale = max(r.grad.abs().max().item() for r in refs.values())
        grad_err = max(
            (p.grad.full_tensor() - refs[n].grad).abs().max().item() / scale
            for n, p in pm.named_parameters()
        )
        opt.step()
        ref_opt.step()
    refs = dict(ref.named_parameters())
    param_err = max(
        ((p.full_tensor() - refs[n]).abs().max() / refs[n].abs().max()).item()
        for n, p in pm.named_parameters()
    )
    backward = pm.compiled.graphs["backward"]
    nodes = list(backward.graph.nodes)
    reduces = _bucket_reduces(backward)
    waits = [
        i
        for i, n in enumerate(nodes)
        if n.op == "call_function" and n.target is torch.ops._c10d_functional.wait_tensor.default
    ]
    # the backward's last kernel (not a view, a wait, or the output)
    kernels = [
        i
        for i, n in enumerate(nodes)
        if n.op == "call_function"
        and "_c10d_functional" not in str(n.target)
        and n.target not in (torch.ops.aten.view.default, torch.ops.aten.slice.Tensor)
    ]
    return {
        "losses": losses,
        "grad_err": grad_err,
        "param_err": param_err,
        "counts": counted.counts,
        "reduces": reduces,
        "waits": waits,
        "first_kernel_after_reduce": min((k for k in kernels if k > reduces[0]), default=None),
        "last_kernel": max(kernels),
    }


def test_bucketed_plan_groups_the_gradient_all_reduces():
    bucketed, alone = _plan(), _plan(skip={"buckets"})
    n_params = len(bucketed.params)
    ar = ("all_reduce", "dp")
    # one all-reduce per gradient without buckets, and the loss's (its value and its
    # backward's); far fewer with them
    loss = [c for c in alone.collectives if "param" not in c]
    assert len(loss) == 2
    assert alone.collective_counts()[ar] == n_params + len(loss)
    buckets = [c for c in bucketed.collectives if "bucket" in c]
    assert 2 <= len(buckets) < n_params // 2
    assert bucketed.collective_counts()[ar] == len(buckets) + len(loss)
    # the same bytes move, each bucket over its cap only by its last gradient
    assert bucketed.collective_bytes() == alone.collective_bytes()
    assert sum(len(c["params"]) for c in buckets) == n_params
    for c in buckets[:-1]:
        assert c["nbytes"] >= BUCKET_MB * 2**20
    # priced as one call each: cheaper than the reductions they replace (one overhead each)
    bucketed_s = sum(c["time_s"] for c in buckets)
    alone_s = sum(c["time_s"] for c in alone.collectives if "param" in c)
    assert bucketed_s < alone_s
    # the plan's step time is the emitted step's, the solver's objective kept beside it
    assert bucketed.cost["total_s"] == pytest.approx(bucketed.emitted_step_s())
    assert "objective_s" in bucketed.cost
    # the memory model frees each bucket's gradients where it is issued: at the step's
    # return each gradient is held once (reduced), not twice (as made, and reduced)
    grads_at_end = bucketed.memory["step"]["timeline"]["gradients"][-1]
    alone_end = alone.memory["step"]["timeline"]["gradients"][-1]
    assert grads_at_end * 2 == alone_end


@pytest.mark.distributed
@pytest.mark.parametrize("overlap", [False, True], ids=["gloo", "waited-at-end"])
def test_buckets_run_as_planned_and_match_one_device(overlap):
    plan = _plan()
    buckets = [c for c in plan.collectives if "bucket" in c]
    results = run_local(_train, 2, plan.to_json(), overlap)
    for r in results:
        for a, b in r["losses"]:
            assert a == pytest.approx(b, rel=1e-12)
        assert r["grad_err"] < 1e-10
        assert r["param_err"] < 1e-8  # (AdamW scales the keys' bias rounding up)
    r0 = results[0]
    # the step runs the plan's all-reduces: one per bucket and the loss's
    assert r0["counts"][("all_reduce", "dp")] == plan.collective_counts()[("all_reduce", "dp")]
    assert len(r0["reduces"]) == len(buckets)
    # the first bucket is issued before the backward's kernels end
    assert r0["first_kernel_after_reduce"] is not None
    assert r0["reduces"][0] < r0["last_kernel"]
    if overlap:  # each waited for after the backward's last kernel
        assert all(w > r0["last_kernel"] for w in r0["waits"][-len(buckets) :])

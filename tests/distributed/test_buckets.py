"""Gradient buckets (passes/buckets) as the compiled step runs them, on a gloo mesh, against
one device: the plan's buckets are the collectives the step runs (all-reduces under data
parallelism, reduce-scatters into sharded parameters under FSDP), the backward issues each
one after its last gradient, and the result is the single-device one in float64."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar import experts
from autopar.core import parse_placements, reduction
from autopar.models import GPT, GPTConfig, cross_entropy_loss, lm_batch
from autopar.runtime import run_local
from autopar.verify import CollectiveBytes, _cast, build_example, verify

from helpers import compile_quietly, plan_quietly, train_beside

CFG = GPTConfig(vocab=64, seq=16, hidden=32, heads=4, layers=2, ffn=64)
BATCH = 8
BUCKET_MB = 0.02  # ~20 KiB: this model's 0.1 MiB of gradients in several buckets


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG).double()


# (strategy, the kind of its gradient reductions, the bytes a gradient is made with over
# the bytes its parameter holds: 1, or the 2 ranks' shards)
STRATEGIES = {
    "dp": ("all_reduce", 1),
    "fsdp": ("reduce_scatter", 2),
    # FSDP with attention's weights sharded along dim 1: buckets that mix members scattered
    # along dim 0 and along dim 1
    "fsdp-dim1": ("reduce_scatter", 2),
}


def _constraints(strategy: str, mesh: autopar.Mesh) -> dict[str, str]:
    if strategy == "fsdp-dim1":
        return {"*.attn.*.weight": "S(1)", **experts.fsdp(mesh)}
    return getattr(experts, strategy)(mesh)


def _plan(strategy: str = "dp", skip=()) -> autopar.Plan:
    tokens, targets = lm_batch(CFG.vocab, BATCH, CFG.seq)
    mesh = autopar.Mesh((2,), ("dp",), device="cpu")
    return plan_quietly(
        _gpt(), mesh, (tokens,), loss_fn=cross_entropy_loss, example_targets=(targets,),
        constraints=_constraints(strategy, mesh), bucket_mb=BUCKET_MB, skip=skip,
    )  # fmt: skip


def _bucket_reduces(gm: torch.fx.GraphModule, kind: str) -> list[int]:
    """Positions of the reductions (``kind``) of a flattened bucket (of a ``cat``) in
    ``gm``."""
    target = {
        "all_reduce": torch.ops._c10d_functional.all_reduce.default,
        "reduce_scatter": torch.ops._c10d_functional.reduce_scatter_tensor.default,
    }[kind]
    return [
        i
        for i, n in enumerate(gm.graph.nodes)
        if n.op == "call_function"
        and n.target is target
        and n.args[0].target is torch.ops.aten.cat.default
    ]


def _train(rank, world, plan_json: str, overlap: bool, kind: str):
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
        pm = compile_quietly(model, mesh, (tokens,), loss_fn=cross_entropy_loss,
                             example_targets=(targets,), plan=plan)  # fmt: skip
    finally:
        codegen._Localizer.__init__ = init
    local = pm.shard_inputs(tokens, targets)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses = []
    counted = CollectiveBytes(mesh)
    for loss, ref_loss in train_beside(
        pm, local, opt, lambda: cross_entropy_loss(ref(tokens), targets), ref_opt, 3,
        first_step=counted,
    ):  # fmt: skip
        losses.append((loss, ref_loss))
        refs = dict(ref.named_parameters())
        # against the largest gradient: the keys' bias has a gradient of 0 up to rounding
        # (softmax ignores a shift of every key alike)
        scale = max(r.grad.abs().max().item() for r in refs.values())
        grad_err = max(
            (p.grad.full_tensor() - refs[n].grad).abs().max().item() / scale
            for n, p in pm.named_parameters()
        )
    refs = dict(ref.named_parameters())
    param_err = max(
        ((p.full_tensor() - refs[n]).abs().max() / refs[n].abs().max()).item()
        for n, p in pm.named_parameters()
    )
    backward = pm.compiled.graphs["backward"]
    nodes = list(backward.graph.nodes)
    reduces = _bucket_reduces(backward, kind)
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
        "bytes": counted.bytes,
        "reduces": reduces,
        "waits": waits,
        "first_kernel_after_reduce": min((k for k in kernels if k > reduces[0]), default=None),
        "last_kernel": max(kernels),
    }


@pytest.mark.parametrize(
    "src, dst, want",
    [
        ("P(sum);R", "R;R", (0, None)),  # an all-reduce
        ("R;P(avg)", "R;R", (1, None)),
        ("P(sum);S(0)", "R;S(0)", (0, None)),  # the other axis as it was
        ("P(sum);R", "S(1);R", (0, 1)),  # a reduce-scatter along dim 1
        ("P(sum);P(sum)", "R;R", None),  # two axes
        ("P(sum);R", "R;S(0)", None),  # and a chunk on the other
        ("S(0);R", "R;R", None),  # an all-gather
        ("P(sum);R", "SS(0,2);R", None),  # no plain scatter
        ("R;R", "R;R", None),
    ],
)
def test_reduction_is_one_collective_on_one_axis(src, dst, want):
    assert reduction(parse_placements(src.split(";")), parse_placements(dst.split(";"))) == want


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bucketed_plan_groups_the_gradient_reductions(strategy):
    kind, made_over_held = STRATEGIES[strategy]
    bucketed, alone = _plan(strategy), _plan(strategy, skip={"buckets"})
    n_params = len(bucketed.params)
    # the loss's all-reduces (its value and its backward's), never bucketed
    loss = [c for c in alone.collectives if c.param is None and c.kind == "all_reduce"]
    assert len(loss) == 2
    # one reduction per gradient without buckets; far fewer with them
    alone_counts, counts = alone.collective_counts(), bucketed.collective_counts()
    loss_n = len(loss) if kind == "all_reduce" else 0
    assert alone_counts[(kind, "dp")] == n_params + loss_n
    buckets = [c for c in bucketed.collectives if c.bucket is not None]
    assert {c.kind for c in buckets} == {kind}
    if strategy == "fsdp-dim1":  # a bucket mixes the dims its members scatter along
        dims = {n: ps[0].dim for n, ps in bucketed.param_placements.items()}
        assert any({dims[n] for n in c.params} == {0, 1} for c in buckets), [
            c.params for c in buckets
        ]
    assert 2 <= len(buckets) < n_params // 2
    assert counts[(kind, "dp")] == len(buckets) + loss_n
    # nothing else changes: FSDP's all-gathers stay as they were
    others = {k: v for k, v in alone_counts.items() if k != (kind, "dp")}
    assert {k: v for k, v in counts.items() if k != (kind, "dp")} == others
    # the same bytes move, each bucket over its cap only by its last gradient
    assert bucketed.collective_bytes() == alone.collective_bytes()
    assert sum(len(c.params) for c in buckets) == n_params
    for c in buckets[:-1]:
        assert c.nbytes >= BUCKET_MB * 2**20
    # priced as one call each: cheaper than the reductions they replace (one overhead each)
    bucketed_s = sum(c.time_s for c in buckets)
    alone_s = sum(c.time_s for c in alone.collectives if c.param is not None)
    assert bucketed_s < alone_s
    # the plan's step time is the emitted step's, the solver's objective kept beside it
    assert bucketed.cost["total_s"] == pytest.approx(bucketed.emitted_step_s())
    assert "objective_s" in bucketed.cost
    # the memory model frees each bucket's gradients where it is issued: at the step's
    # return each gradient is held once (reduced, as its parameter is placed), not also as
    # made (the ranks' shards of it under FSDP)
    grads_at_end = bucketed.memory["step"]["timeline"]["gradients"][-1]
    alone_end = alone.memory["step"]["timeline"]["gradients"][-1]
    assert grads_at_end * (1 + made_over_held) == alone_end


@pytest.mark.distributed
@pytest.mark.parametrize(
    "strategy, overlap",
    [("dp", False), ("dp", True), ("fsdp", False), ("fsdp-dim1", False)],
    ids=["dp-gloo", "dp-waited-at-end", "fsdp-gloo", "fsdp-dim1-gloo"],
)  # (FSDP's backward all-gathers on the axis: its buckets are not left in flight on gloo)
def test_buckets_run_as_planned_and_match_one_device(strategy, overlap):
    kind = STRATEGIES[strategy][0]
    plan = _plan(strategy)
    buckets = [c for c in plan.collectives if c.bucket is not None]
    results = run_local(_train, 2, plan.to_json(), overlap, kind)
    for r in results:
        for a, b in r["losses"]:
            assert a == pytest.approx(b, rel=1e-12)
        assert r["grad_err"] < 1e-10
        assert r["param_err"] < 1e-8  # (AdamW scales the keys' bias rounding up)
    r0 = results[0]
    # the step runs the plan's collectives: one reduction per bucket, the loss's, and
    # (FSDP) the all-gathers, with the plan's bytes
    assert r0["counts"] == plan.collective_counts()
    assert r0["bytes"] == plan.collective_bytes()
    assert len(r0["reduces"]) == len(buckets)
    # the first bucket is issued before the backward's kernels end
    assert r0["first_kernel_after_reduce"] is not None
    assert r0["reduces"][0] < r0["last_kernel"]
    if overlap:  # each waited for after the backward's last kernel
        assert all(w > r0["last_kernel"] for w in r0["waits"][-len(buckets) :])


# (constraints, the steps of its buckets over two axes): data parallelism over both axes,
# each gradient summed over both and reduced hierarchically where the cost model prices it
# faster (cost_models/comm): reduce-scattered over tp, the half all-reduced over dp, then
# all-gathered over tp; and FSDP over dp with Megatron's sequence parallelism over tp, a
# norm's weight reduce-scattered over dp and then all-reduced over tp
TWO_AXES = {
    "dp-both": lambda model, mesh: experts.dp(mesh, ["dp", "tp"]),
    "fsdp-sp": lambda model, mesh: experts.megatron(
        model, mesh, tp="tp", dp="dp", fsdp=True, sequence_parallel=True
    ),
}
TWO_AXES_STEPS = {
    "dp-both": [("reduce_scatter", "tp"), ("all_reduce", "dp"), ("all_gather", "tp")],
    "fsdp-sp": [("reduce_scatter", "dp"), ("all_reduce", "tp")],
}


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", sorted(TWO_AXES))
def test_gradients_reduced_over_two_axes_run_in_buckets(strategy):
    # each bucket of gradients reduced over both axes of a (2, 2) mesh runs its steps on one
    # flat tensor (passes/buckets), and the step runs exactly the plan's collectives, with
    # the single-device result
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
    torch.manual_seed(0)
    model, inputs, loss_fn, targets = build_example("gpt", batch=8)
    model = model.to(torch.float64)
    plan = autopar.plan(
        model,
        mesh,
        tuple(_cast(t, torch.float64) for t in inputs),
        loss_fn=loss_fn,
        example_targets=targets,
        constraints=TWO_AXES[strategy](model, mesh),
        bucket_mb=BUCKET_MB,
    )
    steps: dict[int, list[tuple[str, str]]] = {}
    for c in plan.collectives:
        if c.bucket is not None:
            steps.setdefault(c.bucket, []).append((c.kind, c.axis))
    chained = [k for k, s in steps.items() if s == TWO_AXES_STEPS[strategy]]
    assert len(chained) >= (2 if strategy == "dp-both" else 1), steps
    if strategy == "dp-both":  # every gradient, none left to the graph's end
        assert not [c for c in plan.collectives if c.param is not None and c.bucket is None]
        assert plan.stats["bucketed_reductions"] == len(plan.params)
    reports = verify("gpt", (2, 2), ("dp", "tp"), plan_json=plan.to_json(timings=True), batch=8)
    for r in reports:
        assert r.grad_rel_err <= 1e-10, (r.grad_rel_err, r.worst_grad)
        assert r.param_rel_err <= 1e-8, (r.param_rel_err, r.worst_param)
        for got, want in zip(r.losses, r.ref_losses):
            assert got == pytest.approx(want, rel=1e-12)
    assert reports[0].ran == plan.collective_counts()

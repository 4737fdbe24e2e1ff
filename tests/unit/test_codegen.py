"""Codegen on a two-matmul model: the collectives the local graph emits, and their count;
on a small GPT planned as FSDP for a GPU, where the CUDA emission places its gradient
buckets' waits and its reshards issued ahead; and on a small GPT planned as Megatron, no
view to a tensor's own shape left in the local graph;
and the step's own buffers (a class weight the loss holds or closes over, a model's plain
tensor attribute), fed by the runtime beside the model's.

One process: a fake process group (torch's testing backend, which records collectives and
moves no data) stands behind a 2-rank mesh; codegen only traces the local graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from autopar import experts
from autopar.core import roles
from autopar.core.schedule import COMM, COMPUTE, purpose, schedule
from autopar.models import GPT, GPTConfig, cross_entropy_loss, lm_batch
from autopar.passes import codegen
from autopar.passes.codegen import build_local_graph, count_collectives
from autopar.passes.memory import simulate
from autopar.passes.prefetch import prefetch_reshards
from autopar.passes.strategies import build_strategies
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


def _small_gpt() -> tuple[GPT, torch.Tensor, torch.Tensor]:
    cfg = GPTConfig(vocab=64, seq=16, hidden=32, heads=4, layers=2, ffn=64)
    torch.manual_seed(0)
    tokens, targets = lm_batch(cfg.vocab, 8, cfg.seq)
    return GPT(cfg), tokens, targets


def _as_on_cuda(monkeypatch):
    """A 2-rank ``dp`` mesh on the fake group, and codegen's CUDA emission on it (buckets and
    prefetched reshards left in flight, ``_Localizer.overlap``)."""
    init = codegen._Localizer.__init__

    def as_on_cuda(self, *a, **k):
        init(self, *a, **k)
        self.overlap = True

    monkeypatch.setattr(codegen._Localizer, "__init__", as_on_cuda)
    return init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))


@pytest.mark.pinned_torch_only
def test_cuda_reduce_scatter_buckets_hold_one_input_per_axis(tp_mesh, monkeypatch):
    """FSDP's gradient reduce-scatters on a GPU profile: each bucket is waited for where the
    next is issued (the process group holds a collective's input, G times its output,
    until its wait), in the plan, in its memory and schedule, and in the compiled
    backward the step runs."""

    model, tokens, targets = _small_gpt()
    mesh = autopar.Mesh((2,), ("dp",), device="h100")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(
            model, mesh, (tokens,), loss_fn=cross_entropy_loss, example_targets=(targets,),
            constraints=experts.fsdp(mesh), bucket_mb=0.02,
        )  # fmt: skip
    buckets = [c for c in plan.collectives if c.bucket is not None]
    assert len(buckets) >= 3 and {c.kind for c in buckets} == {"reduce_scatter"}
    sites = [c.edge.partition("->")[0] for c in buckets]
    # each waited for where the next is issued, the last at the backward's end
    assert [c.wait_after for c in buckets] == sites[1:] + [None]

    # memory: a bucket's flat input held from its issue to the next one's
    timeline = plan.memory["step"]["timeline"]
    at = {n: i for i, n in enumerate(timeline["nodes"])}
    held = timeline["collective_buffers"]
    for c, nxt in zip(buckets, sites[1:]):
        i, j = at[c.edge.partition("->")[0]], at[nxt]
        assert min(held[i : j + 1]) >= c.nbytes
    # schedule: the compute after a wait starts once the bucket waited for has ended (the
    # buckets alone, each taken as 10 ms, longer than the backward between two: each wait
    # binds, and nothing else on the axis queues behind them)
    slow = dataclasses.replace(
        plan, collectives=tuple(dataclasses.replace(c, time_s=0.01) for c in buckets)
    )
    spans = schedule(slow)
    end = {s.name: s.end_s for s in spans if s.stream == COMM}
    start = {s.name: s.start_s for s in spans if s.stream == COMPUTE}
    order = timeline["nodes"]
    checked = 0
    for c in buckets[:-1]:
        after = [n for n in order[at[c.wait_after] + 1 :] if n in start]
        if after:  # (a wait after the backward's last node: nothing runs after it)
            assert start[after[0]] >= end[c.edge] - 1e-12
            checked += 1
    assert checked >= 1

    # the compiled backward: bucket k's wait before bucket k+1's reduce-scatter
    dmesh = _as_on_cuda(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(
            model, dmesh, (tokens,), loss_fn=cross_entropy_loss, example_targets=(targets,),
            plan=plan,
        )  # fmt: skip
    nodes = list(pm.compiled.graphs["backward"].graph.nodes)
    scatter = torch.ops._c10d_functional.reduce_scatter_tensor.default
    wait = torch.ops._c10d_functional.wait_tensor.default
    issued = [i for i, n in enumerate(nodes) if n.target is scatter]
    waited = {
        nodes[i].args[0]: i for i, n in enumerate(nodes) if n.target is wait
    }  # collective node -> its wait's position
    assert len(issued) == len(buckets)
    for k, i in enumerate(issued[:-1]):
        assert i < waited[nodes[i]] < issued[k + 1]


@pytest.mark.pinned_torch_only
def test_cuda_reshards_are_issued_ahead_of_their_consumers(tp_mesh, monkeypatch):
    """FSDP's all-gathers on a GPU profile (passes/prefetch): each issued before the
    consumer of the one before it on its axis, held from there (memory), run beside the
    nodes between (schedule), and so in the compiled step; where they would break the memory
    budget, those held at the peak issued at their consumers."""

    model, tokens, targets = _small_gpt()
    mesh = autopar.Mesh((2,), ("dp",), device="h100")

    def planned(skip=()):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return autopar.plan(
                model, mesh, (tokens,), loss_fn=cross_entropy_loss,
                example_targets=(targets,), constraints=experts.fsdp(mesh), skip=skip,
            )  # fmt: skip

    plan, plain = planned(), planned(skip={"prefetch"})
    early = [c for c in plan.collectives if c.issue_after is not None]
    assert plan.stats["prefetched"] == len(early) >= 10 and plain.stats["prefetched"] == 0
    nodes = plan.memory["step"]["timeline"]["nodes"]
    at = {n: i for i, n in enumerate(nodes)}

    def ends(c):
        return c.edge.split("->")

    # each ahead of its consumer; the next on its axis not before this one's consumer
    reshards = sorted(
        (c for c in plan.collectives if purpose(c) == "reshard" and " " not in c.edge),
        key=lambda c: at[ends(c)[1]],
    )
    for c in early:
        assert at[c.issue_after] < at[ends(c)[1]] - 1
    for a, b in zip(reshards, reshards[1:]):
        if b.issue_after is not None and a.axis == b.axis:
            assert at[b.issue_after] >= at[ends(a)[1]] - 1
    # memory: a gathered weight held from its issue to its consumer
    held = plan.memory["step"]["timeline"]["collective_buffers"]
    for c in early:
        first, last = at[c.issue_after] + 1, at[ends(c)[1]]
        assert min(held[first : last + 1]) >= c.nbytes
    # the emitted step runs them beside the compute: shorter than waiting at each consumer
    assert plan.cost["total_s"] < plain.cost["total_s"]

    # the budget
    with contextlib.ExitStack() as stack:
        step = trace_step(
            model, (tokens,), loss_fn=cross_entropy_loss, example_targets=(targets,), stack=stack
        )
    space = build_strategies(step, mesh)
    tight = dataclasses.replace(plain, memory_budget=plain.memory["step"]["peak_bytes"])
    low, high = plain.memory["step"]["peak_bytes"], plan.memory["step"]["peak_bytes"]
    assert high > low
    loose = dataclasses.replace(tight, memory_budget=2**40)
    assert prefetch_reshards(space, loose).stats["prefetched"] == len(early)
    # those held at the peak go back to their consumers until the step fits: at the
    # unprefetched peak and halfway to the prefetched one, fewer but some prefetched
    for budget in (low, (low + high) / 2):
        bound = dataclasses.replace(tight, memory_budget=budget)
        fewer = prefetch_reshards(space, bound)
        assert 0 < fewer.stats["prefetched"] < len(early)
        assert simulate(space, fewer).peak_bytes <= budget

    # the compiled forward: the collective ahead, its wait at the consumer, ops between
    dmesh = _as_on_cuda(monkeypatch)

    # each wait right after its collective without prefetch; most far ahead with it
    assert max(_gathered_ahead(model, dmesh, tokens, targets, plain)) == 1
    spans = _gathered_ahead(model, dmesh, tokens, targets, plan)
    assert sum(1 for s in spans if s > 2) >= len(spans) // 2 > 0


def _gathered_ahead(model, dmesh, tokens, targets, plan, mp_policy=None) -> list[int]:
    """Per all-gather of ``plan``'s compiled forward: the nodes from it to its wait."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(
            model, dmesh, (tokens,), loss_fn=cross_entropy_loss, example_targets=(targets,),
            plan=plan, mp_policy=mp_policy,
        )  # fmt: skip
    forward = list(pm.compiled.graphs["forward"].graph.nodes)
    where = {n: i for i, n in enumerate(forward)}
    gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    wait = torch.ops._c10d_functional.wait_tensor.default
    return [
        where[next(u for u in g.users if u.target is wait)] - where[g]
        for g in forward
        if g.target is gather
    ]


@pytest.mark.pinned_torch_only
def test_cuda_weights_cast_ahead_of_their_gathers(tp_mesh, monkeypatch):
    """FSDP in bf16 mixed precision on a GPU profile: a weight's cast to bf16, which the
    chosen order runs right before the node that reads it, moves ahead with its
    all-gather (passes/prefetch, "The model's state"), in the plan's order, its memory and
    the compiled forward; without the move no such gather could be issued early."""

    model, tokens, targets = _small_gpt()
    mesh = autopar.Mesh((2,), ("dp",), device="h100")
    policy = autopar.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32)

    def planned(skip=()):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return autopar.plan(
                model, mesh, (tokens,), loss_fn=cross_entropy_loss,
                example_targets=(targets,), constraints=experts.fsdp(mesh),
                mp_policy=policy, skip=skip,
            )  # fmt: skip

    plan, plain = planned(), planned(skip={"prefetch"})

    def casts(p):
        """Per gather of a weight's cast into the forward: (its entry, the cast's point, the
        point of the consumer of the reshard before it on its axis)."""
        at = {n: i for i, n in enumerate(p.memory["step"]["timeline"]["nodes"])}
        reshards = sorted(
            (c for c in p.collectives if purpose(c) == "reshard" and " " not in c.edge),
            key=lambda c: at[c.edge.partition("->")[2]],
        )
        found, previous = [], None
        for c in reshards:
            src, _, dst = c.edge.partition("->")
            if p.nodes[src].op == "aten._to_copy.default" and p.nodes[dst].role == roles.FORWARD:
                if previous is not None:
                    found.append((c, at[src], previous))
            previous = at[dst]
        return found, at

    # as the order put them: most casts after the consumer of the reshard before, where
    # the gather that reads them cannot be issued
    before, _ = casts(plain)
    assert len(before) >= 6
    assert sum(cast > previous for _, cast, previous in before) >= len(before) / 2
    # moved ahead: each cast, and the issue of its gather, before that consumer
    after, at = casts(plan)
    assert len(after) == len(before)
    assert plan.stats["prefetch_moved"] >= len(before) / 2
    for c, cast, previous in after:
        assert cast <= at[c.issue_after] <= previous - 1
    # the bf16 copies and the gathers held from there cost memory; the step is shorter
    assert plan.memory["step"]["peak_bytes"] >= plain.memory["step"]["peak_bytes"]
    assert plan.cost["total_s"] < plain.cost["total_s"]
    # the compiled forward: most gathers far ahead of their waits
    dmesh = _as_on_cuda(monkeypatch)
    spans = _gathered_ahead(model, dmesh, tokens, targets, plan, policy)
    assert sum(1 for s in spans if s > 2) >= len(spans) - 2 > 0


def _identity_views(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Views to the shape and strides their input already has."""
    out = []
    for n in gm.graph.nodes:
        if n.target in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default):
            before, after = n.args[0].meta["val"], n.meta["val"]
            if before.shape == after.shape and before.stride() == after.stride():
                out.append(n)
    return out


def test_split_layers_emit_no_view_to_a_tensors_own_shape(tp_mesh, monkeypatch):
    """The local graph runs no view to the shape a tensor already has (each is a call of
    the generated code that the plan does not have): ``_run_op`` wraps and unwraps the
    local shards without the views ``DTensor.from_local`` and ``to_local`` make (91 of
    this trace's 639 ops with them, 13 left in the emitted graph where it outputs them),
    and ``drop_identity_views`` drops what a redistribution leaves."""
    model, tokens, targets = _small_gpt()
    mesh = autopar.Mesh((2,), ("tp",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(
            model, mesh, (tokens,), loss_fn=cross_entropy_loss, example_targets=(targets,),
            constraints=experts.megatron(model, mesh),
        )  # fmt: skip
    graphs = {}
    for drop in (True, False):
        if not drop:  # as traced
            monkeypatch.setattr(codegen, "drop_identity_views", lambda gm: 0)
        with contextlib.ExitStack() as stack:
            step = trace_step(
                model, (tokens,), loss_fn=cross_entropy_loss, example_targets=(targets,),
                stack=stack,
            )  # fmt: skip
            graphs[drop] = build_local_graph(step, plan, tp_mesh).gm
    traced, emitted = graphs[False], graphs[True]
    made = len(_identity_views(traced))
    assert made < 10, made
    kept = _identity_views(emitted)
    assert all(any(u.op == "output" for u in n.users) for n in kept)
    ops = [n for n in traced.graph.nodes if n.op == "call_function"]
    assert sum(n.op == "call_function" for n in emitted.graph.nodes) == len(ops) - made + len(kept)
    assert count_collectives(emitted, tp_mesh) == count_collectives(traced, tp_mesh)


def test_an_identity_view_is_kept_where_the_graph_outputs_it_or_an_op_writes_it():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4, 3)
    aten = torch.ops.aten

    def call(target, *args, like):
        n = graph.call_function(target, args)
        n.meta["val"] = like
        return n

    same = call(aten.view.default, x, [4, 3], like=torch.empty(4, 3))
    reshaped = call(aten.view.default, x, [12], like=torch.empty(12))
    read = call(aten.add.Tensor, same, 1.0, like=torch.empty(4, 3))
    written = call(aten.view.default, x, [4, 3], like=torch.empty(4, 3))
    call(aten.add_.Tensor, written, 1.0, like=torch.empty(4, 3))
    out = call(aten.view.default, read, [4, 3], like=torch.empty(4, 3))
    graph.output((out, reshaped))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert codegen.drop_identity_views(gm) == 1
    names = {n.name for n in gm.graph.nodes}
    assert same.name not in names and {reshaped.name, written.name, out.name} <= names
    assert read.args[0] is x


class _Scaled(nn.Module):
    """A linear layer times a plain tensor attribute: neither a parameter nor a buffer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 6)
        self.scale = torch.arange(6.0) + 1

    def forward(self, x):
        return self.lin(x) * self.scale


def test_the_steps_own_buffers_are_fed_beside_the_models_and_kept_out_of_its_state(tp_mesh):
    """A model's plain tensor attribute, a class weight the loss closes over, and one a
    loss module holds (passes/trace: the step's own buffers) are fed by the runtime as the
    model's buffers are: the compiled step's loss and gradients are the model's, and the
    module's names and state are the model's alone."""
    weight = torch.rand(6, generator=torch.Generator().manual_seed(0)) + 0.5
    x, y = torch.randn(4, 8), torch.randint(0, 6, (4,))

    def closed_over(out, t):
        return nn.functional.cross_entropy(out, t, weight=weight)

    for loss_fn in (closed_over, nn.CrossEntropyLoss(weight=weight)):
        torch.manual_seed(0)
        model = _Scaled()
        want = loss_fn(model(x), y)
        want.backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kw = dict(loss_fn=loss_fn, example_targets=(y,))
            mesh = autopar.Mesh((2,), ("tp",), device="cpu")
            plan = autopar.plan(model, mesh, (x,), constraints={"*": "R", "input:*": "R"}, **kw)
            pm = autopar.compile(model, tp_mesh, (x,), plan=plan, **kw)
        assert set(pm.compiled.constants) >= {"scale"} and len(pm.compiled.constants) == 2
        assert set(pm.state_dict()) == set(model.state_dict())
        assert [n for n, _ in pm.named_buffers()] == [n for n, _ in model.named_buffers()]
        loss = pm(*pm.shard_inputs(x, y))  # replicated: no collective, the whole step here
        torch.testing.assert_close(loss, want)
        loss.backward()
        for name, p in pm.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), model.get_parameter(name).grad)

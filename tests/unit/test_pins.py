"""Pin part of a plan (``autopar.plan(..., constraints=...)``), cost a given plan
(``autopar.evaluate``), and the expert plans as constraint sets (autopar/experts.py)."""

import dataclasses
import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar import Mesh, experts
from autopar.api import PlanMismatchError
from autopar.core.schedule import inside_op
from autopar.cost_models import get_profile, register_profile
from autopar.passes import solve as solve_pass
from autopar.passes.solve import SolveError
from autopar.show import collective_rows, purpose
from autopar.verify import build_example

pytestmark = pytest.mark.pinned_torch_only

MESH_4 = Mesh((4,), ("dp",), device="h100")
MESH_2x2 = Mesh((2, 2), ("dp", "tp"), device="h100")


def _gpt(name: str = "gpt"):
    model, inputs, loss_fn, targets = build_example(name, batch=8)
    meta = lambda ts: tuple(t.to("meta") for t in ts)  # noqa: E731
    return model.to("meta"), meta(inputs), dict(loss_fn=loss_fn, example_targets=meta(targets))


@pytest.fixture(scope="module")
def gpt():
    return _gpt()


@pytest.fixture(scope="module")
def found_2x2(gpt):
    model, inputs, kw = gpt
    return autopar.plan(model, MESH_2x2, inputs, **kw)


def test_constraints_pin_parameters_and_the_solver_places_the_rest(gpt, found_2x2):
    model, inputs, kw = gpt
    pinned = {
        "blocks.*.fc1.weight": (Replicate(), Shard(1)),  # torch placements
        "blocks.*.fc2.weight": "S(0),R",  # or their text
        "input:0": ["S(0)", "R"],
    }
    plan = autopar.plan(model, MESH_2x2, inputs, constraints=pinned, **kw)
    got = plan.param_placements
    for i in (0, 1):
        assert got[f"blocks.{i}.fc1.weight"] == (Replicate(), Shard(1))
        assert got[f"blocks.{i}.fc2.weight"] == (Shard(0), Replicate())
    assert plan.input_placements[0] == (Shard(0), Replicate())
    # the free plan chose otherwise, so the pinned one can only cost as much or more
    free = found_2x2.param_placements
    assert free["blocks.0.fc1.weight"] != (Replicate(), Shard(1))
    assert plan.cost["total_s"] >= found_2x2.cost["total_s"] * (1 - 1e-6)


def test_evaluate_a_found_plan_gives_back_its_cost_and_memory(gpt, found_2x2):
    model, inputs, kw = gpt
    again = autopar.evaluate(model, MESH_2x2, inputs, found_2x2, **kw)
    assert again.cost["total_s"] == pytest.approx(found_2x2.cost["total_s"], rel=1e-9)
    assert again.memory["step"]["peak_bytes"] == found_2x2.memory["step"]["peak_bytes"]
    assert {n: c.out for n, c in again.nodes.items()} == {
        n: c.out for n, c in found_2x2.nodes.items()
    }
    with pytest.raises(PlanMismatchError, match="is for"):
        autopar.evaluate(model, MESH_4, inputs, found_2x2, **kw)


def test_dp_expert_plan_reduces_gradients_and_nothing_else_on_its_axis(gpt):
    model, inputs, kw = gpt
    plan = autopar.evaluate(model, MESH_4, inputs, experts.dp(MESH_4), **kw)
    assert all(ps == (Replicate(),) for ps in plan.param_placements.values())
    assert all(ps == (Shard(0),) for ps in plan.input_placements)
    # besides the gradients, only the mean loss's token count (a scalar) is reduced
    tensors = [c for c in plan.collectives if c.nbytes > 8]
    assert tensors and {purpose(c) for c in tensors} == {"gradient reduction"}
    assert {c.kind for c in plan.collectives} == {"all_reduce"}
    # the loss itself, all-reduced into the one value every rank returns, is not a gradient's
    (loss,) = [c for c in plan.collectives if purpose(c) == "output"]
    assert loss.edge.endswith("->output[0]") and loss.nbytes == 4
    assert ("output", "all_reduce", "dp") in {
        (r["purpose"], r["kind"], r["axis"]) for r in collective_rows(plan)
    }
    # every gradient once, in DDP's buckets of 25 MiB (this model's fit in one)
    assert sum(len(c.params) for c in tensors) == len(plan.params)
    assert len(tensors) == plan.stats["buckets"] == 1
    assert not plan.recompute and "memory_budget" not in plan.stats  # unbounded, as given


def test_fsdp_expert_plan_shards_every_parameter_and_gathers_only_parameters(gpt):
    model, inputs, kw = gpt
    dp = autopar.evaluate(model, MESH_4, inputs, experts.dp(MESH_4), **kw)
    plan = autopar.evaluate(model, MESH_4, inputs, experts.fsdp(MESH_4), **kw)
    assert all(ps == (Shard(0),) for ps in plan.param_placements.values())
    kinds = {
        (purpose(c), c.kind) for c in plan.collectives if c.nbytes > 4 and not inside_op(c.edge)
    }
    # parameters all-gathered before use, gradients reduce-scattered (ZeRO-3); the loss
    # all-reduces its count of targets inside its op (passes/vocab, "Rows")
    assert kinds == {("reshard", "all_gather"), ("gradient reduction", "reduce_scatter")}
    gathered = {c.edge.split("->")[0] for c in plan.collectives if c.kind == "all_gather"}
    params = set(plan.params.values())
    views = {n for n, c in plan.nodes.items() if c.op in ("aten.t.default", "aten.view.default")}
    assert gathered <= params | views
    assert plan.memory["step"]["peak_bytes"] < dp.memory["step"]["peak_bytes"]
    assert plan.memory["param_bytes_per_rank"] * 4 == pytest.approx(
        dp.memory["param_bytes_per_rank"], rel=0.01
    )


def test_megatron_expert_plan_splits_columns_then_rows(gpt):
    model, inputs, kw = gpt
    cons = experts.megatron(model, MESH_2x2, dp="dp")
    assert cons["blocks.0.attn.q.weight"] == "R,S(0)" and cons["blocks.0.fc2.weight"] == "R,S(1)"
    assert cons["tok.weight"] == "R,S(0)" and cons["input:*"] == "S(0),R"
    plan = autopar.evaluate(model, MESH_2x2, inputs, cons, **kw)
    got = plan.param_placements
    assert got["blocks.1.fc1.weight"] == (Replicate(), Shard(0))
    assert got["blocks.1.attn.o.weight"] == (Replicate(), Shard(1))
    assert got["blocks.1.ln1.weight"] == (Replicate(), Replicate())
    on_dp = [c for c in plan.collectives if c.axis == "dp" and c.nbytes > 8]
    assert on_dp and all(purpose(c) == "gradient reduction" for c in on_dp)
    assert any(c.axis == "tp" for c in plan.collectives)


def test_fsdp_with_megatron_shards_each_weight_over_both_axes(gpt, monkeypatch):
    model, inputs, kw = gpt
    cons = experts.megatron(model, MESH_2x2, dp="dp", fsdp=True)
    assert cons["blocks.0.fc1.weight"] == "S(1),S(0)" and cons["blocks.0.fc2.weight"] == "S(0),S(1)"
    plan = autopar.evaluate(model, MESH_2x2, inputs, cons, **kw)
    got = plan.param_placements
    assert got["blocks.0.fc1.weight"] == (Shard(1), Shard(0))
    assert got["blocks.1.ln2.weight"] == (Shard(0), Replicate())
    # the layout needs reshards the simplified ILP leaves out: solved without merging and
    # with every pair out of a parameter (passes/solve ``SIMPLIFICATIONS``), and said so
    assert plan.stats["unsimplified"] == ["merge"]
    assert any(
        "out of a parameter on several axes: solved without that" in w for w in plan.warnings
    )
    # in bf16 mixed precision too (a cast more between each weight and its matmul), and
    # the ILP with every pair on every edge, over half as big again, costs the plan the same
    mp = autopar.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32)
    bf16 = autopar.evaluate(model, MESH_2x2, inputs, cons, mp_policy=mp, **kw)
    assert bf16.param_placements["blocks.0.fc1.weight"] == (Shard(1), Shard(0))
    assert bf16.stats["unsimplified"] == ["merge"]
    everywhere = (("exact", "anywhere", lambda space: {"merge": False, "reshard_axes": 2}),)
    monkeypatch.setattr(solve_pass.driver, "SIMPLIFICATIONS", everywhere)
    exact = autopar.evaluate(model, MESH_2x2, inputs, cons, mp_policy=mp, **kw)
    assert exact.stats["unsimplified"] == ["exact"]
    assert exact.stats["variables"] > 1.5 * bf16.stats["variables"]
    assert bf16.cost["total_s"] == pytest.approx(exact.cost["total_s"], rel=1e-4)
    gathered = {
        c.edge.split("->")[0]
        for c in plan.collectives
        if c.axis == "dp" and purpose(c) == "reshard" and c.nbytes > 8
    }
    assert gathered and all(
        plan.nodes[n].role in ("param", "forward", "backward") for n in gathered
    )
    with pytest.raises(ValueError, match="name the dp axis"):
        experts.megatron(model, MESH_2x2, fsdp=True)


def test_megatron_reads_hf_conv1d_weights_as_in_by_out():
    pytest.importorskip("transformers")
    model, _, _, _ = build_example("hf-gpt2", batch=2)
    cons = experts.megatron(model, MESH_2x2)
    attn = next(k for k in cons if k.endswith("attn.c_attn.weight"))
    proj = next(k for k in cons if k.endswith("attn.c_proj.weight"))
    assert cons[attn] == "R,S(1)" and cons[proj] == "R,S(0)"  # Conv1D: [in, out]
    # the head is the token embedding under a second name: both split the vocabulary alike
    assert cons["lm_head.weight"] == cons["transformer.wte.weight"] == "R,S(0)"
    with pytest.raises(ValueError, match="column=... and row="):
        experts.megatron(torch.nn.Sequential(torch.nn.Linear(4, 4)), MESH_2x2)
    with pytest.raises(ValueError, match="no mesh axis 'cp'"):
        experts.megatron(model, MESH_2x2, tp="cp")


@pytest.mark.parametrize(
    "constraints, message",
    [
        ({"no.such.*": "R"}, "matches no parameter"),
        ({"*.bias": "R,R"}, "gives 2 placements for a mesh of 1 axes"),
        ({"input:7": "S(0)"}, "the step takes 2 inputs and targets"),
        ({"reshard:tp": "none"}, "the mesh axes are"),
        ({"reshard:dp": "all"}, "'none', 'params' or 'whole'"),
        ({"output:no.such.*": "R"}, "matches no module path"),
        ({"attention:0": "S(0)"}, "'attention:\\*' pins every attention"),
        ({"*": "Q"}, "is not placements"),
        # two layers folded together cannot be placed apart
        ({"blocks.0.fc1.weight": "S(0)", "blocks.1.fc1.weight": "S(1)"}, "folded together"),
        # the embedding's rule offers no sharding of a batch it gathers from: no plan
        ({"input:*": "S(0)", "tok.weight": "S(1)", "reshard:dp": "none"}, "no plan keeps"),
    ],
)
def test_constraints_that_cannot_hold_say_why(gpt, constraints, message):
    model, inputs, kw = gpt
    with pytest.raises((ValueError, SolveError), match=message):
        autopar.plan(model, MESH_4, inputs, constraints=constraints, memory_budget=math.inf, **kw)


def test_an_axis_kept_whole_runs_no_collective_not_even_at_the_outputs(gpt):
    """``reshard:dp`` ``none`` leaves the step's outputs free: where collectives are cheap
    against the compute, the solver splits the backward of a replicated model and gathers
    its gradients at the outputs (autopar calibrate's step of the host was so planned with
    collectives, under load). ``whole`` runs none anywhere: every rank the whole step."""
    model, inputs, kw = gpt
    cpu = get_profile("cpu")
    fast = dataclasses.replace(
        cpu, name="cpu-free-link", intra_node_latency=1e-9, intra_node_bandwidth=1e15,
        inter_node_latency=1e-9, inter_node_bandwidth=1e15, collective_overhead=0.0,
    )  # fmt: skip
    register_profile(fast)
    mesh = Mesh((2,), ("dp",), device=fast.name)
    pinned = {"*": "R", "input:*": "R"}
    free = autopar.plan(model, mesh, inputs, constraints=pinned | {"reshard:dp": "none"}, **kw)
    assert any(purpose(c) != "reshard" for c in free.collectives)  # at the outputs
    whole = autopar.plan(model, mesh, inputs, constraints=pinned | {"reshard:dp": "whole"}, **kw)
    assert whole.collectives == ()


@pytest.mark.parametrize(
    "text,context", [("S(2)", "gather"), ("S(2)", "ring"), ("S(1)", None)], ids=str
)
def test_attention_pin_fixes_every_attention_node_forward_and_backward(text, context):
    # "S(2)": the query rows split over the axis (context parallelism), the keys gathered or
    # passed around a ring; "S(1)": the heads
    model, inputs, kw = _gpt("hf-llama")
    constraints = {"attention:*": text} | ({"context": context} if context else {})
    plan = autopar.plan(
        model, Mesh((2,), ("cp",), device="h100"), inputs, constraints=constraints, **kw
    )
    nodes = [n for n in plan.nodes if n.startswith("sdpa")]
    assert len(nodes) == 4  # two layers, forward and backward
    for n in nodes:
        assert plan.nodes[n].out[0] == (text,)
    fwd, bwd = plan.nodes["sdpa"], plan.nodes["sdpa_backward"]
    if context == "gather":  # every key gathered, each rank's share of their gradients summed
        assert fwd.ins[1] == fwd.ins[2] == ("R",)
        assert bwd.out[1] == bwd.out[2] == ("P(sum)",)
    if context == "ring":  # the keys split as the rows; their gradients come home split
        assert fwd.ins[1] == fwd.ins[2] == ("S(2)",)
        assert bwd.out[1] == bwd.out[2] == ("S(2)",)
    inner = [
        c for c in plan.collectives if c.edge in ("sdpa->sdpa", "sdpa_backward->sdpa_backward")
    ]
    # causal rows split: three load-balancing exchanges forward and three backward (passes/
    # rules); the ring adds its shifts: one of k and v forward, and backward one of k and v
    # and two of their gradients (one in flight, the last one home)
    assert len(inner) == {"gather": 6, "ring": 10, None: 0}[context], inner


@pytest.mark.parametrize("value,message", [("zigzag", "'ring' or 'gather'")])
def test_context_constraint_names_its_variants(value, message):
    model, inputs, kw = _gpt("hf-llama")
    with pytest.raises(ValueError, match=message):
        autopar.plan(model, Mesh((2,), ("cp",)), inputs, constraints={"context": value}, **kw)


def test_context_constraint_needs_a_fused_attention(gpt):
    model, inputs, kw = gpt
    with pytest.raises(ValueError, match="no fused attention"):
        autopar.plan(model, MESH_4, inputs, constraints={"context": "ring"}, **kw)


def test_attention_pin_needs_a_fused_attention(gpt):
    model, inputs, kw = gpt
    with pytest.raises(ValueError, match="no fused attention"):
        autopar.plan(model, MESH_4, inputs, constraints={"attention:*": "R"}, **kw)


def test_the_loss_pin_splits_the_classes_where_the_solver_would_gather():
    # on the CPU profile a 128-class head's log-probabilities (64 KiB) gather for less than
    # a scalar all-reduce costs: unpinned, the log-softmax reads them whole; ``loss:*``
    # pins its classes split over the axis (passes/vocab)
    model, inputs, loss_fn, targets = build_example("hf-llama", batch=2)
    mesh = Mesh((2,), ("tp",), device="cpu")
    kw = dict(loss_fn=loss_fn, example_targets=targets)

    def log_softmax(plan):
        return plan.nodes["_log_softmax"].out[0]

    assert log_softmax(autopar.plan(model, mesh, inputs, **kw)) == ("R",)
    pinned = autopar.plan(model, mesh, inputs, constraints={"loss:*": "S(1)"}, **kw)
    assert log_softmax(pinned) == ("S(1)",)
    with pytest.raises(ValueError, match="'loss:\\*' pins every loss"):
        autopar.plan(model, mesh, inputs, constraints={"loss:0": "S(1)"}, **kw)


def test_loss_pin_needs_a_log_softmax():
    model, inputs, loss_fn, targets = build_example("mlp", batch=8)
    kw = dict(loss_fn=loss_fn, example_targets=targets)
    with pytest.raises(ValueError, match="no log-softmax"):
        autopar.plan(model, MESH_4, inputs, constraints={"loss:*": "R"}, **kw)


def _splits_sequence(space, seq: int) -> list[str]:
    """Nodes of ``space`` with a strategy that splits a dim of length ``seq``."""
    out = []
    for name, strats in space.strategies.items():
        outs = space.shapes.get(name, ())
        ins = [space.tensor(src, so) for src, so in space.in_sources.get(name, ())]
        for st in strats:
            pairs = list(zip(st.out, outs)) + list(zip(st.ins, ins))
            if any(
                ps is not None
                and sd is not None
                and any(getattr(p, "dim", None) is not None and sd[0][p.dim] == seq for p in ps)
                for ps, sd in pairs
            ):
                out.append(name)
                break
    return out


def test_sequence_none_drops_every_split_along_the_sequence():
    import contextlib

    from autopar.passes.pins import drop_sequence_splits
    from autopar.passes.strategies import build_strategies
    from autopar.passes.trace import trace_step

    model, inputs, kw = _gpt("hf-llama")
    with contextlib.ExitStack() as stack:
        step = trace_step(model, inputs, stack=stack, **kw)
        space = build_strategies(step, Mesh((2,), ("cp",)))
    seq = inputs[0].shape[1]
    before = _splits_sequence(space, seq)
    assert "sdpa" in before and len(before) > 50  # rows of attention, norms, MLPs, the loss
    drop_sequence_splits(space)
    assert _splits_sequence(space, seq) == []
    assert all(space.strategies.values())  # every node keeps a strategy


def test_sequence_none_plans_and_refuses_a_row_split_attention():
    model, inputs, kw = _gpt("hf-llama")
    mesh = Mesh((2,), ("cp",), device="h100")
    plan = autopar.plan(model, mesh, inputs, constraints={"sequence": "none"}, **kw)
    assert all(c.out[0] != ("S(2)",) for n, c in plan.nodes.items() if n.startswith("sdpa"))
    assert plan.input_placements[0] != (Shard(1),)
    with pytest.raises(ValueError, match="no strategy places it S\\(2\\)"):
        autopar.plan(
            model, mesh, inputs, constraints={"sequence": "none", "attention:*": "S(2)"}, **kw
        )


def test_megatron_sequence_parallel_pins_every_norm_output_along_the_sequence():
    model, _, _, _ = build_example("hf-llama", batch=2)
    cons = experts.megatron(model, MESH_2x2, dp="dp", sequence_parallel=True)
    norms = {k: v for k, v in cons.items() if k.startswith("output:")}
    # two layers' input and post-attention norms, and the final norm
    assert set(norms) == {
        "output:model.norm",
        *(
            f"output:model.layers.{i}.{n}"
            for i in range(2)
            for n in ("input_layernorm", "post_attention_layernorm")
        ),
    }
    assert set(norms.values()) == {"S(0),S(1)"}  # batch over dp, tokens over tp

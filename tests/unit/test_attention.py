"""Attention as the GPU runs it: one ``autopar::sdpa`` node, exact, sharded by batch and heads.

Hugging Face models call ``F.scaled_dot_product_attention`` by default (SDPA). The trace puts
autopar's device-neutral op in its place (core/ops.py, passes/trace.py); these tests check
the op against torch's own attention, the trace, the sharding rule, and that a model with
the library's default attention plans as its eager twin does.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import autopar
from autopar.core import ops
from autopar.models import hf_llama, hf_logits_loss
from autopar.passes.strategies import build_strategies
from autopar.passes.trace import AttentionNotLoweredWarning, _lower_sdpa, trace_step

SDPA = torch.ops.autopar.sdpa.default
SDPA_BACKWARD = torch.ops.autopar.sdpa_backward.default


def _qkv(b=2, h=4, kv=4, s=8, t=8, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(b, kv, t, d, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(b, kv, t, d, generator=g, dtype=dtype, requires_grad=True)
    return q, k, v


CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "causal-gqa": dict(is_causal=True, enable_gqa=True),
    "float-mask": dict(mask="float"),
    "bool-mask": dict(mask="bool"),
    "bool-mask-gqa": dict(mask="bool", enable_gqa=True),
    "scale": dict(scale=0.3, is_causal=True),
}


@pytest.mark.parametrize("case", CASES)
def test_autopar_sdpa_equals_torch_attention_forward_and_backward(case):
    kw = dict(CASES[case])
    q, k, v = _qkv(kv=2 if kw.get("enable_gqa") else 4)
    mask = kw.pop("mask", None)
    if mask == "float":
        kw["attn_mask"] = torch.randn(2, 1, 8, 8, dtype=torch.float64)
    elif mask == "bool":
        kw["attn_mask"] = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(1)) > 0.3
        kw["attn_mask"][..., 0] = True  # every row sees a key
    want = F.scaled_dot_product_attention(q, k, v, **kw)
    got, why = _lower_sdpa(q, k, v, **kw)
    assert why == ""
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_autopar_sdpa_passes_gradcheck():
    q, k, v = _qkv(b=1, h=2, kv=1, s=4, t=5, d=3)

    def f(q, k, v):
        return ops.sdpa(q, k, v, None, True, 1 / math.sqrt(3))[0]

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_calls_it_cannot_express_stay_atens_op_and_say_why():
    q, k, v = _qkv()
    assert _lower_sdpa(q, k, v, dropout_p=0.1)[0] is None
    bias = torch.randn(1, 4, 8, 8, dtype=torch.float64, requires_grad=True)
    out, why = _lower_sdpa(q, k, v, attn_mask=bias)
    assert out is None and "gradient" in why


def _llama(attn: str, **kw):
    with torch.device("meta"):
        model = hf_llama(**kw)
    model.config._attn_implementation = attn
    return model


def test_llama_with_default_attention_traces_the_autopar_op():
    model = _llama("sdpa")  # the library's default
    assert model.config._attn_implementation == "sdpa"
    tokens = torch.zeros(2, 32, dtype=torch.long, device="meta")
    with contextlib.ExitStack() as stack:
        step = trace_step(
            model, (tokens,), loss_fn=hf_logits_loss, example_targets=(tokens,), stack=stack
        )
        targets = [n.target for n in step.gm.graph.nodes if n.op == "call_function"]
    assert targets.count(SDPA) == 2 and targets.count(SDPA_BACKWARD) == 2
    assert not [t for t in targets if "scaled_dot_product" in str(t)]


def test_sdpa_rule_offers_batch_and_heads():
    model = _llama("sdpa")
    tokens = torch.zeros(4, 32, dtype=torch.long, device="meta")
    with contextlib.ExitStack() as stack:
        step = trace_step(
            model, (tokens,), loss_fn=hf_logits_loss, example_targets=(tokens,), stack=stack
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no op is left without a rule
            space = build_strategies(step, autopar.Mesh((2, 2), ("dp", "tp")))
    (name,) = [n for n, t in space.targets.items() if t == SDPA][:1]
    outs = {s.out[0] for s in space.strategies[name]}
    # batch on one axis, heads on the other, and both ways round
    assert (Shard(0), Shard(1)) in outs and (Shard(1), Shard(0)) in outs
    for s in space.strategies[name]:
        # q, k, v always split alike: each rank keeps whole grouped-query groups
        assert s.ins[0] == s.ins[1] == s.ins[2]


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _plan_llama(attn: str):
    # two Llama-3-8B layers (grouped-query attention, 32 heads over 8 key/value heads), a
    # batch small enough that the weights are worth sharding
    model = _llama(
        attn, layers=2, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=512, seq=512
    ).to(torch.bfloat16)
    tokens = torch.zeros(8, 512, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(
            model,
            autopar.Mesh((2, 2), ("dp", "tp"), device="h100"),
            (tokens,),
            loss_fn=hf_logits_loss,
            example_targets=(tokens,),
        )


def test_sdpa_model_plans_attention_as_its_eager_twin():
    sdpa, eager = _plan_llama("sdpa"), _plan_llama("eager")
    assert not [w for w in sdpa.warnings if "attention" in w or "scaled_dot" in w], sdpa.warnings
    for layer in range(2):
        for proj in PROJECTIONS:
            group = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            name = f"model.layers.{layer}.{group}.{proj}.weight"
            assert sdpa.param_placements[name] == eager.param_placements[name], name
    # and the attention projections are column / row parallel, not replicated
    pp = sdpa.param_placements
    assert Shard(0) in pp["model.layers.0.self_attn.q_proj.weight"], sdpa.summary()
    assert Shard(1) in pp["model.layers.0.self_attn.o_proj.weight"], sdpa.summary()


def test_attention_dropout_warns_and_plans():
    q, k, v = _qkv()
    with pytest.warns(AttentionNotLoweredWarning, match="dropout"):
        from autopar.passes.trace import _TargetAttention

        with _TargetAttention():
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)


class _BiasedAttention(torch.nn.Module):
    """Attention with a learned additive bias, as T5's relative position bias."""

    def __init__(self, hidden=32, heads=4, seq=16):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.bias = torch.nn.Parameter(torch.zeros(1, heads, seq, seq))

    def forward(self, x_BSH):
        b, s, h = x_BSH.shape
        q, k, v = self.qkv(x_BSH).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=self.bias
        )
        return out.transpose(1, 2).reshape(b, s, h)


def test_attention_left_as_torchs_is_said_in_the_plan():
    x = torch.randn(4, 16, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(
            _BiasedAttention(),
            autopar.Mesh((2,), ("dp",)),
            (x,),
            loss_fn=lambda y, t: ((y - t) ** 2).mean(),
            example_targets=(x,),
        )
    (note,) = [w for w in plan.warnings if "scaled_dot_product_attention" in w]
    assert "mask needs a gradient" in note
    assert plan.fallback_nodes == ()  # torch's math attention: ops with rules
    assert "bias" in " ".join(plan.params)

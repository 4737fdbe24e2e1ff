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
from torch.distributed.tensor import Replicate, Shard

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
    # the sequence split: query rows on one axis, every key gathered there (all-gather
    # K/V) or the keys split as the rows and passed around the ring
    assert (Shard(2), Shard(0)) in outs and (Shard(1), Shard(2)) in outs
    kv_on_rows = set()
    for s in space.strategies[name]:
        for q, k, v in zip(s.ins[0], s.ins[1], s.ins[2]):
            if q == Shard(2):
                assert k == v and k in (Replicate(), Shard(2))
                kv_on_rows.add(k)
            else:
                # q, k, v split alike: each rank keeps whole grouped-query groups
                assert q == k == v
    assert kv_on_rows == {Replicate(), Shard(2)}


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


@pytest.mark.pinned_torch_only
def test_sdpa_model_plans_attention_sharded_and_no_slower_than_its_eager_twin():
    sdpa, eager = _plan_llama("sdpa"), _plan_llama("eager")
    assert not [w for w in sdpa.warnings if "attention" in w or "scaled_dot" in w], sdpa.warnings
    # attention split on every axis (by batch, heads or rows), never replicated
    nodes = [n for n in sdpa.nodes if n.startswith("sdpa")]
    assert len(nodes) == 4, nodes
    for n in nodes:
        assert "R" not in sdpa.nodes[n].out[0], (n, sdpa.nodes[n].out)
    # the fused kernel and no [S, T] mask: never worse than the same model's eager attention
    assert sdpa.cost["total_s"] <= eager.cost["total_s"], (sdpa.summary(), eager.summary())


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


@pytest.mark.parametrize(
    "causal,kv,mask", [(False, 4, False), (True, 4, False), (True, 2, False), (False, 2, True)]
)
@pytest.mark.parametrize("ranks", [2, 4])
def test_sdpa_rows_on_each_ranks_rows_adds_up_to_the_whole_attention(causal, kv, mask, ranks):
    # context parallelism: each rank's query rows against every key (core/ops.py)
    q, k, v = (t.detach() for t in _qkv(h=4, kv=kv, s=16, t=16))
    m = torch.randn(2, 1, 16, 16, dtype=torch.float64) if mask else None
    out, lse = ops.sdpa(q, k, v, m, causal, 0.3)
    grad = torch.randn_like(out)
    dq, dk, dv = ops.sdpa_backward(grad, q, k, v, out, lse, m, causal, 0.3)
    rows = 16 // ranks
    dk_sum, dv_sum = torch.zeros_like(k), torch.zeros_like(v)
    for r in range(ranks):
        at = slice(r * rows, (r + 1) * rows)
        m_r = None if m is None else m[:, :, at]
        o, lse_r = ops.sdpa_rows(q[:, :, at], k, v, m_r, causal, 0.3, r * rows)
        torch.testing.assert_close(o, out[:, :, at], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse_r, lse[:, :, at], rtol=1e-12, atol=1e-12)
        dq_r, dk_r, dv_r = ops.sdpa_rows_backward(
            grad[:, :, at], q[:, :, at], k, v, o, lse_r, m_r, causal, 0.3, r * rows
        )
        torch.testing.assert_close(dq_r, dq[:, :, at], rtol=1e-10, atol=1e-12)
        if causal:  # keys after a rank's rows get nothing from it
            assert not dk_r[:, :, (r + 1) * rows :].any()
        dk_sum += dk_r
        dv_sum += dv_r
    torch.testing.assert_close(dk_sum, dk, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dv_sum, dv, rtol=1e-10, atol=1e-12)


def test_local_offset_follows_dtensor_chunks_axis_by_axis():
    from autopar.core import local_offset

    # dim 2 split over both axes of a (2, 4) mesh: axis 0 halves it, axis 1 quarters each half
    ps = (Shard(2), Shard(2))
    assert local_offset((1, 8, 64, 4), ps, (2, 4), (1, 3))[2] == 32 + 3 * 8
    assert local_offset((1, 8, 64, 4), (Shard(0), Shard(2)), (2, 4), (1, 2)) == (0, 0, 32, 0)


def test_hf_causal_model_traces_is_causal_attention_without_a_mask():
    # the library skips the [S, T] mask in eager runs and under export would build it;
    # passes/trace makes it skip as in eager (the names it swaps must exist)
    import transformers.masking_utils as masking

    # the names _masks_as_eager swaps: the packed-sequence finder, and what asks whether a
    # mask may be skipped (is_torchdynamo_exporting in most releases, is_tracing in 5.17)
    assert hasattr(masking, "find_packed_sequence_indices")
    assert hasattr(masking, "is_torchdynamo_exporting") or hasattr(masking, "is_tracing")
    model = _llama("sdpa")
    tokens = torch.zeros(2, 32, dtype=torch.long, device="meta")
    with contextlib.ExitStack() as stack:
        step = trace_step(
            model, (tokens,), loss_fn=hf_logits_loss, example_targets=(tokens,), stack=stack
        )
        calls = [n for n in step.gm.graph.nodes if n.target == SDPA]
    assert len(calls) == 2
    for n in calls:
        mask, is_causal = n.args[3], n.args[4]
        assert mask is None and is_causal is True
    # and the library's own export path is untouched afterwards
    assert masking.find_packed_sequence_indices.__module__ == "transformers.masking_utils"
    for name in ("is_torchdynamo_exporting", "is_tracing"):
        if hasattr(masking, name):
            assert getattr(masking, name).__module__ == "transformers.utils.import_utils"


def test_a_release_that_asks_is_tracing_of_no_mask_skips_it_as_eager(monkeypatch):
    # transformers 5.17 asks is_tracing(padding_mask) before skipping a causal mask, which
    # export makes true even with no padding mask: the SDPA models were traced with a
    # [B, 1, S, T] mask, which the CUDA kernel then refused
    import sys
    import types

    from autopar.passes.trace import _masks_as_eager

    seen = []
    fake = types.SimpleNamespace(
        is_tracing=lambda tensor=None: seen.append(tensor) or True,
        find_packed_sequence_indices=lambda ids: ids,
    )
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", fake)
    real = fake.is_tracing
    padding = torch.ones(2, 8, dtype=torch.bool)
    with _masks_as_eager(types.SimpleNamespace(inputs=())):
        assert fake.is_tracing(None) is False and fake.is_tracing() is False
        assert fake.is_tracing(padding) is True  # a given mask is still traced
        assert fake.find_packed_sequence_indices(torch.arange(8)[None]) is None
    assert seen == [padding]
    assert fake.is_tracing is real


def test_position_ids_given_by_the_user_keep_the_packed_sequence_mask():
    from autopar.models import KeywordInputs

    model = KeywordInputs(_llama("sdpa"), ("input_ids", "position_ids"))
    tokens = torch.zeros(2, 32, dtype=torch.long, device="meta")
    positions = torch.zeros(2, 32, dtype=torch.long, device="meta")
    with contextlib.ExitStack() as stack:
        step = trace_step(
            model,
            (tokens, positions),
            loss_fn=hf_logits_loss,
            example_targets=(tokens,),
            stack=stack,
        )
        calls = [n for n in step.gm.graph.nodes if n.target == SDPA]
    # packed sequences cannot be told from traced ids: the library's mask stays
    assert calls and all(n.args[3] is not None for n in calls)


@pytest.mark.parametrize("t", [8, 20])
@pytest.mark.parametrize(
    "mask_shape", [(2, 1, 8, None), (1, 1, 8, None), (8, None), (2, 1, 1, None)]
)
def test_the_mask_reaches_the_cuda_kernel_as_its_bias(mask_shape, t):
    # the memory-efficient kernel reads [B, H, S, T] in the query's dtype, each row 16-aligned
    # (it refused HF's [B, 1, S, T] float mask: "attn_bias: wrong shape (head dimension)")
    q = torch.randn(2, 4, 8, 16, dtype=torch.bfloat16)
    k = torch.randn(2, 2, t, 16, dtype=torch.bfloat16)
    mask = torch.randn(*(t if d is None else d for d in mask_shape))
    bias = ops.efficient_bias(mask, q, k)
    assert bias is not None
    assert bias.shape == (2, 4, 8, t) and bias.dtype == torch.bfloat16
    assert bias.stride(-1) == 1 and bias.stride(-2) % ops.BIAS_ALIGN == 0
    assert bias.stride(0) % ops.BIAS_ALIGN == 0 and bias.stride(1) % ops.BIAS_ALIGN == 0
    torch.testing.assert_close(bias, mask.to(torch.bfloat16).expand(2, 4, 8, t))
    if t % ops.BIAS_ALIGN == 0 and mask_shape[0] != 8:
        assert bias.untyped_storage().nbytes() == mask.numel() * 2  # broadcast, not copied
    assert ops.efficient_bias(None, q, k) is None


@pytest.mark.pinned_torch_only
def test_cuda_attention_takes_flash_only_where_torch_would():
    q16 = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    mask = torch.zeros(8, 8)

    def kernel(q, k=None, v=None, mask=None, causal=False):
        k = q if k is None else k
        return ops.cuda_kernel(q, k, k if v is None else v, mask, causal)

    assert kernel(q16, mask=mask) == "efficient"  # flash takes no mask
    assert kernel(q16.float()) == "efficient"  # 16-bit only
    assert kernel(torch.randn(1, 2, 8, 12, dtype=torch.bfloat16)) == "efficient"  # 8 | d
    assert kernel(q16, v=torch.randn(1, 2, 8, 32, dtype=torch.bfloat16)) == "efficient"
    # a causal block with other than one key per row: flash would align it bottom-right
    # (sdpa_rows' and the ring's diagonal blocks are top-left)
    fewer = torch.randn(1, 2, 4, 64, dtype=torch.bfloat16)
    assert kernel(q16, k=fewer, causal=True) == "efficient"
    enabled = torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(False)  # the user's switch is torch's own
    try:
        assert kernel(q16) == "efficient"
    finally:
        torch.backends.cuda.enable_flash_sdp(enabled)
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8:
        assert kernel(q16.cuda()) == "flash"
        assert kernel(q16.cuda(), k=fewer.cuda()) == "flash"  # not causal: any keys
        assert kernel(q16.cuda(), k=fewer.cuda(), causal=True) == "efficient"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA kernels")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv,d", [(4, 64), (2, 128)])
@pytest.mark.parametrize("s,t", [(72, 72), (40, 72)])  # a block of rows: causal is top-left
def test_autopar_sdpa_without_a_mask_equals_torch_attention_on_cuda(dtype, causal, kv, d, s, t):
    q, k, v = (x.detach().cuda().to(dtype).requires_grad_() for x in _qkv(kv=kv, s=s, t=t, d=d))
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]  # the reference
    want = F.scaled_dot_product_attention(*exact, is_causal=causal, enable_gqa=kv != 4)
    got, _ = _lower_sdpa(q, k, v, is_causal=causal, enable_gqa=kv != 4)
    _near(got, want)
    grad = torch.randn_like(want)
    for a, b in zip(
        torch.autograd.grad(got, (q, k, v), grad.to(dtype)), torch.autograd.grad(want, exact, grad)
    ):
        _near(a, b)


def _near(got, want, rel=2e-2):
    """Within ``rel`` of ``want`` in norm: 16-bit rounding passes, a wrong layout does not."""
    err = (got.double() - want).norm() / want.norm()
    assert err < rel, f"relative error {err:.3g}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autopar_sdpa_with_a_mask_equals_torch_attention_on_cuda(dtype):
    q, k, v = (x.detach().cuda().to(dtype).requires_grad_() for x in _qkv(kv=2, s=40, t=40))
    mask = torch.randn(2, 1, 40, 40, device="cuda")  # 40 keys: rows padded to 48
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(
        *exact, attn_mask=mask.to(dtype).double(), enable_gqa=True
    )
    got, _ = _lower_sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    _near(got, want)
    grad = torch.randn_like(want)
    for a, b in zip(
        torch.autograd.grad(got, (q, k, v), grad.to(dtype)), torch.autograd.grad(want, exact, grad)
    ):
        _near(a, b)


@pytest.mark.parametrize(
    "q_at,k_at,causal,blocks",
    [
        (8, 0, False, [(0, 4, False)]),  # not causal: the whole block
        (8, 0, True, [(0, 4, False)]),  # keys before the rows: every row sees them all
        (8, 8, True, [(0, 4, True)]),  # the rows' own keys: the diagonal
        (8, 12, True, []),  # keys after the rows: never read
        (8, 6, True, [(0, 2, False), (2, 4, True)]),  # a prefix, then the diagonal's start
    ],
)
def test_key_blocks_split_a_run_of_keys_at_the_diagonal(q_at, k_at, causal, blocks):
    # rows [q_at, q_at + 4) against keys [k_at, k_at + 4), in the block's own indices
    assert ops.key_blocks(q_at, 4, k_at, 4, causal) == blocks


def test_key_blocks_refuse_a_block_that_cuts_the_diagonal_after_its_first_row():
    # keys [10, 14) against rows [8, 12): the kernel's causal mask starts at the block's
    # first key, which is not the rows' first
    with pytest.raises(ValueError, match="cut the causal diagonal"):
        ops.key_blocks(8, 4, 10, 4, True)


@pytest.mark.parametrize("causal,kv", [(False, 4), (True, 4), (True, 2)])
@pytest.mark.parametrize("ranks", [2, 4])
def test_ring_blocks_merged_online_equal_the_whole_attention(causal, kv, ranks):
    # ring attention's arithmetic on one process (passes/codegen._Ring): each rank's rows
    # against the key blocks in ring order, merged by log-sum-exp; the backward's per-block
    # dk, dv summed into the block's owner
    q, k, v = (t.detach() for t in _qkv(h=4, kv=kv, s=16, t=16))
    out, lse = ops.sdpa(q, k, v, None, causal, 0.3)
    grad = torch.randn_like(out)
    dq, dk, dv = ops.sdpa_backward(grad, q, k, v, out, lse, None, causal, 0.3)
    n = 16 // ranks
    dk_ring, dv_ring = torch.zeros_like(k), torch.zeros_like(v)
    for c in range(ranks):
        rows = slice(c * n, (c + 1) * n)
        acc = None
        parts = []
        for i in range(ranks):
            j = (c - i) % ranks  # the block rank c holds at step i
            for start, end, blk_causal in ops.key_blocks(c * n, n, j * n, n, causal):
                keys = slice(j * n + start, j * n + end)
                part = ops.sdpa(q[:, :, rows], k[:, :, keys], v[:, :, keys], None, blk_causal, 0.3)
                acc = ops.merge_partial(acc, *part)
                parts.append((keys, blk_causal))
        assert acc is not None
        o_c, lse_c = acc
        torch.testing.assert_close(o_c, out[:, :, rows], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse_c, lse[:, :, rows], rtol=1e-12, atol=1e-12)
        dq_c = torch.zeros_like(q[:, :, rows])
        for keys, blk_causal in parts:
            dq_b, dk_b, dv_b = ops.sdpa_backward(
                grad[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], o_c, lse_c,
                None, blk_causal, 0.3,
            )  # fmt: skip
            dq_c += dq_b
            dk_ring[:, :, keys] += dk_b
            dv_ring[:, :, keys] += dv_b
        torch.testing.assert_close(dq_c, dq[:, :, rows], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dk_ring, dk, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dv_ring, dv, rtol=1e-10, atol=1e-12)


def test_merge_partial_accumulates_16_bit_blocks_in_the_lse_dtype():
    q, k, v = (t.detach().to(torch.bfloat16) for t in _qkv(s=8, t=16))
    a = ops.sdpa(q, k[:, :, :8], v[:, :, :8], None, False, 0.35)
    b = ops.sdpa(q, k[:, :, 8:], v[:, :, 8:], None, False, 0.35)
    acc_out, acc_lse = ops.merge_partial(ops.merge_partial(None, *a), *b)
    assert acc_out.dtype == acc_lse.dtype == torch.float32
    want, want_lse = ops.sdpa(q, k, v, None, False, 0.35)
    torch.testing.assert_close(acc_out.to(torch.bfloat16), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(acc_lse, want_lse, rtol=1e-3, atol=1e-3)


def test_after_is_a_copy_that_a_graph_keeps_with_its_held_input():
    t, held = torch.randn(3), torch.randn(2)
    out = ops.after(t, held)
    assert torch.equal(out, t) and out.data_ptr() != t.data_ptr()
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda a, h: ops.after(a, h) * 2)(t, held)
    (node,) = [n for n in gm.graph.nodes if n.target == torch.ops.autopar.after.default]
    assert [a.name for a in node.args] == [p.name for p in gm.graph.nodes if p.op == "placeholder"]


def test_ring_steps_shift_keys_forward_and_gradients_backward():
    from autopar.passes import rules

    kv = (1, 2, 8, 4)  # local k: 8 positions, 2 heads of 4; v of 4 too
    steps, tail = rules.ring_steps(SDPA, kv, 4, torch.bfloat16, axis=0, ranks=4)
    # forward: n - 1 shifts of k and v (bf16), each priced as the buffer over the link
    assert [len(s) for s in steps] == [1, 1, 1, 0] and tail == []
    assert steps[0][0].nbytes == int(1 * 2 * 8 * 8 * 2 * 4 / 3)
    steps, tail = rules.ring_steps(SDPA_BACKWARD, kv, 4, torch.bfloat16, axis=0, ranks=4)
    # backward: k and v again, and the gradients' accumulator (float32) one step behind
    assert [len(s) for s in steps] == [1, 2, 2, 1] and len(tail) == 1
    assert tail[0].nbytes == 2 * steps[0][0].nbytes


def test_context_variant_tells_ring_from_gather_by_the_keys():
    from autopar.passes import rules

    rows, whole, heads = (Shard(2),), (Replicate(),), (Shard(1),)
    assert rules.context_variant(SDPA, (rows, whole, whole)) == "gather"
    assert rules.context_variant(SDPA, (rows, rows, rows)) == "ring"
    assert rules.context_variant(SDPA, (heads, heads, heads)) is None
    # the ring's kernels are priced on every key, as the gathered ones
    assert rules.keys_gathered(SDPA, (rows, rows, rows)) == (rows, whole, whole)


def test_ring_time_hides_shifts_under_the_blocks_and_pays_the_tail():
    from autopar.cost_models import collectives_time, get_profile
    from autopar.passes import rules
    from autopar.passes.pricing import ring_time

    mesh, profile = autopar.Mesh((4,), ("cp",), device="h100"), get_profile("h100")
    steps, tail = rules.ring_steps(SDPA_BACKWARD, (1, 8, 4096, 128), 128, torch.bfloat16, 0, 4)
    shift = sum(collectives_time(s, mesh, profile) for s in steps)
    last = collectives_time(tail, mesh, profile)
    # kernels long enough: the shifts hide, the last one (home) does not
    assert ring_time(1.0, steps, tail, mesh, profile) == pytest.approx(1.0 + last)
    # no compute: every shift is paid
    assert ring_time(0.0, steps, tail, mesh, profile) == pytest.approx(shift + last)
    # gloo waits for each shift at once (passes/codegen): nothing hides
    cpu = autopar.Mesh((4,), ("cp",), device="cpu")
    serial = sum(collectives_time(s, cpu, get_profile("cpu")) for s in [*steps, tail])
    got = ring_time(1.0, steps, tail, cpu, get_profile("cpu"))
    assert got == pytest.approx(1.0 + serial)

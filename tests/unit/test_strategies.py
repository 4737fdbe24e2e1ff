import contextlib
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar import Mesh
from autopar.core import parse_placement, placement_str
from autopar.models import GPT, MLP, GPTConfig, cross_entropy_loss, lm_batch, mse_loss
from autopar.passes.strategies import NoRuleWarning, build_strategies
from autopar.passes.trace import trace_step


def _space(model, inputs, loss_fn, targets, mesh):
    with contextlib.ExitStack() as stack:
        step = trace_step(model, inputs, loss_fn=loss_fn, example_targets=targets, stack=stack)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            space = build_strategies(step, mesh)
        return step, space, caught


def test_every_node_has_a_strategy_and_only_divisible_shards():
    cfg = GPTConfig(layers=1, hidden=64, heads=4, ffn=96, vocab=100, seq=12)
    tokens, targets = lm_batch(cfg.vocab, 6, cfg.seq)
    step, space, _ = _space(
        GPT(cfg), (tokens,), cross_entropy_loss, (targets,), Mesh((4,), ("dp",))
    )
    assert set(space.strategies) == {n.name for n in step.gm.graph.nodes if n.op != "output"}
    for name, strats in space.strategies.items():
        assert strats, name
        for s in strats:
            for ps, shape_dtype in zip(s.out, space.shapes[name]):
                if ps is None:
                    continue
                for p in ps:
                    if isinstance(p, Shard):
                        # batch 6, vocab 100, seq 12 do not divide by 4: never offered sharded
                        assert shape_dtype[0][p.dim] % 4 == 0, (name, s.text())
    # placeholders (stored tensors) are never Partial
    for name, role in space.roles.items():
        if role in ("param", "input", "target"):
            for s in space.strategies[name]:
                assert not any(isinstance(p, Partial) for p in s.out[0])


def test_matmul_offers_megatron_column_and_row_strategies():
    model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False))
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    _, space, _ = _space(model, (x,), mse_loss, (y,), Mesh((2,), ("tp",)))
    mms = [n for n, t in space.targets.items() if str(t) == "aten.mm.default"]
    texts = {s.text() for n in mms for s in space.strategies[n]}
    assert "(R) (S(1)) -> (S(1))" in texts  # column parallel
    assert "(S(1)) (S(0)) -> (P(sum))" in texts  # row parallel, partial sums
    assert "(S(0)) (R) -> (S(0))" in texts  # data parallel


@torch.library.custom_op("autopar_test::scaled_tanh", mutates_args=())
def _scaled_tanh(x: torch.Tensor) -> torch.Tensor:
    """An op autopar has never seen: no sharding rule, no decomposition."""
    return torch.tanh(x) * 2


@_scaled_tanh.register_fake
def _(x):
    return torch.empty_like(x)


_scaled_tanh.register_autograd(
    lambda ctx, g: g * 2 * (1 - torch.tanh(ctx.saved_tensors[0]) ** 2),
    setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]),
)


class _Unseen(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(16, 8)

    def forward(self, x):
        return _scaled_tanh(self.inner(x))


def test_op_without_rule_is_replicated_with_a_warning_naming_it():
    model = nn.Sequential(nn.Linear(16, 16), _Unseen())
    _, space, caught = _space(
        model, (torch.randn(8, 16),), mse_loss, (torch.randn(8, 8),), Mesh((2,))
    )
    msgs = [str(w.message) for w in caught if issubclass(w.category, NoRuleWarning)]
    # the op and the module path it came from (the module whose forward called it)
    assert any(m.startswith("autopar_test.scaled_tanh.default (1, node") for m in msgs), msgs
    assert all("passes/rules.py" in m for m in msgs)
    (name,) = [n for n, t in space.targets.items() if str(t) == "autopar_test.scaled_tanh.default"]
    assert name in space.fallbacks
    assert [s.text() for s in space.strategies[name]] == ["(R) -> (R)"]


def test_an_op_without_rule_but_with_a_decomposition_is_decomposed():
    # mse_loss has no DTensor rule; torch decomposes it into ops that have one
    _, space, caught = _space(
        MLP(), (torch.randn(8, 16),), mse_loss, (torch.randn(8, 8),), Mesh((2,))
    )
    assert not [w for w in caught if issubclass(w.category, NoRuleWarning)]
    assert not space.fallbacks
    assert not [t for t in space.targets.values() if "mse_loss" in str(t)]


@pytest.mark.parametrize("text", ["R", "S(0)", "S(2)", "P(sum)", "P(avg)", "SS(0,4)"])
def test_placement_text_round_trips(text):
    assert placement_str(parse_placement(text)) == text


def test_cross_entropy_backward_shards_the_batch():
    # nll_loss_backward's rule reads one candidate list per argument; it is asked per candidate
    cfg = GPTConfig(layers=1, hidden=64, heads=4, ffn=96, vocab=100, seq=12)
    tokens, targets = lm_batch(cfg.vocab, 8, cfg.seq)
    step, space, caught = _space(
        GPT(cfg), (tokens,), cross_entropy_loss, (targets,), Mesh((2, 2), ("dp", "tp"))
    )
    (name,) = [n for n, t in space.targets.items() if "nll_loss_backward" in str(t)]
    assert name not in space.fallbacks
    assert not [w for w in caught if "nll_loss_backward" in str(w.message)]
    outs = {s.out[0] for s in space.strategies[name]}
    assert (Shard(0), Shard(0)) in outs or (Shard(0), Replicate()) in outs, outs


def test_every_node_may_replicate_so_the_ilp_always_has_a_plan():
    cfg = GPTConfig(layers=1, hidden=64, heads=4, ffn=96, vocab=100, seq=12)
    tokens, targets = lm_batch(cfg.vocab, 8, cfg.seq)
    _, space, _ = _space(
        GPT(cfg), (tokens,), cross_entropy_loss, (targets,), Mesh((2, 2), ("dp", "tp"))
    )
    rep = (Replicate(), Replicate())
    for name, strats in space.strategies.items():
        if space.roles[name] == "tangent":
            continue
        assert any(
            all(o is None or o == rep for o in s.out) and all(i == rep for i in s.ins)
            for s in strats
        ), (name, [s.text() for s in strats])

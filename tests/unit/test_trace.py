import contextlib

import pytest
import torch
from torch import nn

from autopar.models import GPT, MLP, GPTConfig, cross_entropy_loss, lm_batch, mse_loss
from autopar.passes.trace import TraceError, trace_step


def _trace(model, inputs, loss_fn=None, targets=None):
    stack = contextlib.ExitStack()
    with stack:
        return trace_step(model, inputs, loss_fn=loss_fn, example_targets=targets, stack=stack)


def test_gpt_joint_graph_roles_and_module_paths():
    cfg = GPTConfig(layers=2)
    model = GPT(cfg)
    tokens, targets = lm_batch(cfg.vocab, 4, cfg.seq)
    step = _trace(model, (tokens,), cross_entropy_loss, (targets,))
    roles = [n.meta["autopar_role"] for n in step.placeholders()]
    n_params = len(list(model.parameters()))
    assert roles == ["param"] * n_params + ["input", "target", "tangent"]
    assert step.param_names == [n for n, _ in model.named_parameters()]
    # every parameter's gradient is an output of the joint graph
    assert sorted(step.grad_of.values()) == sorted(step.param_names)
    ops = [n for n in step.gm.graph.nodes if n.op == "call_function"]
    assert {n.meta["autopar_role"] for n in ops} == {"forward", "backward"}
    # forward and backward matmuls of a layer carry its module path
    q_nodes = [n for n in ops if n.meta["autopar_module"] == "blocks.1.attn.q"]
    assert {n.meta["autopar_role"] for n in q_nodes} == {"forward", "backward"}
    assert any(str(n.target) == "aten.addmm.default" for n in q_nodes)


def test_meta_model_traces_forward_and_backward():
    with torch.device("meta"):
        model = MLP()
    x = torch.empty(8, 16, device="meta")
    y = torch.empty(8, 8, device="meta")
    step = _trace(model, (x,), mse_loss, (y,))
    assert len(step.grad_of) == len(list(model.parameters()))
    assert any(n.meta.get("autopar_role") == "backward" for n in step.gm.graph.nodes)


@pytest.mark.parametrize("meta", [False, True])
def test_a_class_weight_the_loss_holds_or_closes_over_is_a_buffer_of_the_step(meta):
    """``nn.CrossEntropyLoss(weight=w)`` as the loss (its buffer), or a loss function that
    closes over ``w`` (a constant torch.export lifts, which aot_autograd's fake trace could
    not take: "convert all Tensors to FakeTensors"): either way the weight is a buffer
    placeholder after the model's, read by the loss, its value in ``StepGraph.constants``
    (the runtime feeds it); on a meta model too."""
    weight = torch.rand(8) + 0.5

    def closed_over(out, y):
        return nn.functional.cross_entropy(out, y, weight=weight)

    for loss_fn, name in ((nn.CrossEntropyLoss(weight=weight), "loss_fn.weight"),
                          (closed_over, "lifted_tensor_0")):  # fmt: skip
        with torch.device("meta" if meta else "cpu"):
            model = MLP()
        x, y = torch.randn(8, 16), torch.randint(0, 8, (8,))
        if meta:
            x = x.to("meta")
        step = _trace(model, (x,), loss_fn, (y,))
        assert step.buffer_names == [name], step.buffer_names
        assert list(step.constants) == [name]
        torch.testing.assert_close(step.constants[name], weight)
        (buffer,) = [n for n in step.placeholders() if n.meta["autopar_role"] == "buffer"]
        nll = [u for u in buffer.users if "nll_loss" in str(u.target)]
        assert {str(u.target) for u in nll} == {
            "aten.nll_loss_forward.default",
            "aten.nll_loss_backward.default",
        }


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # data-dependent control flow: torch.export cannot trace it
            return y * 2
        return y


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.branchy = _DataDependent()

    def forward(self, x):
        return self.branchy(self.pre(x))


def test_untraceable_model_names_the_module():
    with pytest.raises(TraceError) as e:
        _trace(_Outer(), (torch.randn(2, 4),), mse_loss, (torch.randn(2, 4),))
    msg = str(e.value)
    assert "torch.export could not trace _Outer" in msg
    assert "in module 'branchy'" in msg


@pytest.mark.parametrize("inputs", [None, ()])
def test_missing_example_inputs_is_a_clear_error(inputs):
    with pytest.raises(ValueError, match="example_inputs are missing"):
        _trace(MLP(), inputs, mse_loss, (torch.randn(2, 8),))


def test_non_scalar_loss_is_a_clear_error():
    with pytest.raises(TraceError, match="loss_fn must return a scalar"):
        _trace(MLP(), (torch.randn(2, 16),), lambda y, t: y - t, (torch.randn(2, 8),))


class _BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x)).mean((1, 2, 3))


def test_buffers_updated_in_forward_are_outputs_and_the_loss_is_the_loss():
    x, y = torch.randn(2, 3, 6, 6), torch.randn(2)
    step = _trace(_BatchNormNet(), (x,), mse_loss, (y,))
    assert sorted(step.mutated_buffers.values()) == [
        "bn.num_batches_tracked",
        "bn.running_mean",
        "bn.running_var",
    ]
    assert step.n_outputs == 1  # the loss, not a running statistic
    outputs = step.output_node().args[0]
    plain = [i for i in range(len(outputs)) if i not in step.grad_of]
    plain = [i for i in plain if i not in step.mutated_buffers and outputs[i] is not None]
    assert [tuple(outputs[i].meta["val"].shape) for i in plain] == [()]


class _ParamUpdater(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, x):
        self.w.add_(1.0)
        return x * self.w


def test_a_parameter_updated_in_place_is_a_clear_error():
    with pytest.raises(TraceError, match="in place"):
        _trace(_ParamUpdater(), (torch.randn(2, 4),), mse_loss, (torch.randn(2, 4),))


def test_gpt_with_fused_attention_traces_one_attention_node_and_equals_written_out():
    cfg = GPTConfig(layers=1, hidden=32, heads=2, ffn=64, vocab=64, seq=8)
    torch.manual_seed(0)
    written = GPT(cfg).double()
    fused = GPT(GPTConfig(**{**cfg.__dict__, "sdpa": True})).double()
    fused.load_state_dict(written.state_dict())
    tokens, targets = lm_batch(cfg.vocab, 2, cfg.seq)
    # the same model: the fused kernel is the written-out attention, causal mask included
    torch.testing.assert_close(fused(tokens), written(tokens), rtol=1e-12, atol=1e-12)
    step = _trace(fused, (tokens,), cross_entropy_loss, (targets,))
    targets_seen = [n.target for n in step.gm.graph.nodes if n.op == "call_function"]
    assert targets_seen.count(torch.ops.autopar.sdpa.default) == 1
    assert torch.ops.aten._softmax.default not in targets_seen

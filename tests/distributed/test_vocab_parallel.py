"""Vocabulary-parallel cross-entropy on gloo equals the single-device model in float64.

The logits of a language model split along the vocabulary: the log-softmax all-reduces each
row's max and sum over the classes' axis, the NLL picks each target on the rank that holds
its class, its backward writes the gradient there, and the log-softmax's backward
all-reduces each row's gradient sum (passes/vocab). Every loss, gradient and parameter after
3 AdamW steps matches the single-device model, with targets the loss ignores
(``ignore_index``) among them; every reduction the plan prices is one the step ran.
"""

import warnings

import pytest
import torch

from autopar import Mesh, Plan, api
from autopar.models import _lm_example, hf_llama
from autopar.passes.strategies import NoRuleWarning
from autopar.verify import _cast, build_example, verify

F64 = 1e-8
VOCAB = 4096  # the gather of B S V log-probabilities dearer than the reductions of B S rows
SPLIT = ("_log_softmax", "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward")


def wide_head(batch: int = 2):
    """A 2-layer Llama with a vocabulary of 4096, the last 3 targets of each sequence
    ignored (``ignore_index``, as a padded batch has them)."""
    model, inputs, loss_fn, (targets,) = _lm_example(hf_llama, batch, vocab=VOCAB)
    targets[:, -3:] = -100
    return model, inputs, loss_fn, (targets,)


EXAMPLE = f"{__file__}:wide_head"


def _plan(mesh_shape, axes, constraints=None) -> Plan:
    torch.manual_seed(0)
    model, inputs, loss_fn, targets = build_example(EXAMPLE, batch=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoRuleWarning)
        return api.plan(
            model.to(torch.float64),
            Mesh(mesh_shape, axes, device="cpu"),
            tuple(_cast(t, torch.float64) for t in inputs),
            loss_fn=loss_fn,
            example_targets=targets,
            constraints=constraints,
        )


def _split_over(plan: Plan, axis: int) -> dict[str, bool]:
    """For each cross-entropy op of the plan, whether its classes are split over ``axis``
    (dim 1 of the [N, V] log-probabilities)."""
    out = {}
    for name, c in plan.nodes.items():
        if name in SPLIT:
            ins = c.ins[1] if name == "nll_loss_backward" else c.ins[0]
            out[name] = ins[axis] == "S(1)"
    return out


@pytest.mark.parametrize(
    ("mesh_shape", "axes"),
    [
        ((2,), ("tp",)),
        # the batch over dp beside the classes over tp: the loss averaged over dp (DTensor's
        # rule for a batch-split mean) is averaged over tp too, each rank's share doubled
        # NOTE: slow for CI's half-hour (4 processes, 30 s); tests/unit/test_vocab.py
        # checks the doubled shares against torch's loss
        pytest.param((2, 2), ("dp", "tp"), marks=pytest.mark.slow),
    ],
)
def test_vocab_parallel_loss_equals_single_device(mesh_shape, axes):
    constraints = {"input:*": ",".join("S(0)" if a == "dp" else "R" for a in axes)}
    plan = _plan(mesh_shape, axes, constraints)
    tp = axes.index("tp")
    # the solver splits the classes of every op of the loss: 2 B S float64 values reduced
    # forward and B S backward, where the log-probabilities' gather moves B S V of them
    assert _split_over(plan, tp) == dict.fromkeys(SPLIT, True), _split_over(plan, tp)
    if "dp" in axes:  # the batch split over dp, the loss averaged over both axes
        assert plan.nodes["nll_loss_forward"].out[0] == ("P(avg)", "P(avg)")
    inner = [c for c in plan.collectives if c["edge"].partition("->")[0] in SPLIT]
    assert [c["edge"] for c in inner] == [
        "_log_softmax->_log_softmax",
        "_log_softmax->_log_softmax",
        "_log_softmax_backward_data->_log_softmax_backward_data",
    ], inner
    assert all(c["kind"] == "all_reduce" and c["axis"] == "tp" for c in inner), inner
    reports = verify(EXAMPLE, mesh_shape, axes, plan_json=plan.to_json(timings=True), batch=2)
    for r in reports:
        for got, want in zip(r.losses, r.ref_losses):
            assert abs(got - want) <= F64 * abs(want), (r.losses, r.ref_losses)
        assert r.grad_rel_err <= F64, (r.grad_rel_err, r.worst_grad)
        assert r.param_rel_err <= F64, (r.param_rel_err, r.worst_param)
        assert not r.mismatches, r.mismatches
    # every all-reduce the plan prices ran (gloo runs a reshard's all_to_all as an
    # all_gather, so the other kinds are not compared)
    all_reduce = ("all_reduce", "tp")
    assert reports[0].ran[all_reduce] == plan.collective_counts()[all_reduce]

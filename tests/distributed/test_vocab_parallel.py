"""Cross-entropy split across ranks on gloo equals the single-device model in float64.

The logits of a language model split along the vocabulary: the log-softmax all-reduces each
row's max and sum over the classes' axis, the NLL picks each target on the rank that holds
its class, its backward writes the gradient there, and the log-softmax's backward
all-reduces each row's gradient sum (passes/vocab). The batch split: the mean loss divides
each rank's sum by the count of targets over every rank (passes/vocab, "Rows"), not the
ranks' means averaged, which differ where the ranks ignore different counts of targets.
Every loss, gradient and parameter after 3 AdamW steps matches the single-device model, with
targets the loss ignores (``ignore_index``) among them, more in one sequence than in the
other; every reduction the plan prices is one the step ran.
"""

import pytest
import torch

from autopar import Mesh, Plan, api
from autopar.models import _lm_example, hf_llama
from autopar.passes.strategies import NoRuleWarning
from autopar.verify import _cast, build_example, verify

from helpers import assert_matches_one_device, quiet

F64 = 1e-8
VOCAB = 4096  # the gather of B S V log-probabilities dearer than the reductions of B S rows
SPLIT = ("_log_softmax", "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward")


def wide_head(batch: int = 2):
    """A 2-layer Llama with a vocabulary of 4096, the last 3 targets of each sequence
    ignored (``ignore_index``, as a padded batch has them), and half of the first's."""
    model, inputs, loss_fn, (targets,) = _lm_example(hf_llama, batch, vocab=VOCAB)
    targets[:, -3:] = -100
    targets[0, : targets.shape[1] // 2] = -100
    return model, inputs, loss_fn, (targets,)


EXAMPLE = f"{__file__}:wide_head"


def odd_head(batch: int = 2):
    """``wide_head`` with a vocabulary of 4095, which 2 ranks do not split: the loss of a
    data-parallel plan splits its rows, where the alternative gathers the logits."""
    model, inputs, loss_fn, (targets,) = _lm_example(hf_llama, batch, vocab=VOCAB - 1)
    targets[:, -3:] = -100
    targets[0, : targets.shape[1] // 2] = -100
    return model, inputs, loss_fn, (targets,)


CLASS_WEIGHT = 0.5 + torch.rand(VOCAB - 1, generator=torch.Generator().manual_seed(5))


def _class_weighted(out, targets):
    """A class-weighted cross entropy on a Hugging Face model's logits, its weight a tensor
    it closes over (no module's buffer: the step's own, passes/trace)."""
    logits = out.logits.flatten(0, 1)
    weight = CLASS_WEIGHT.to(logits.dtype)
    return torch.nn.functional.cross_entropy(logits, targets.flatten(), weight=weight)


def weighted_head(batch: int = 2):
    """``odd_head`` with a class-weighted loss: the rows' weights, not their count, divide
    the mean, and they differ from one sequence to the other."""
    model, inputs, _, targets = odd_head(batch)
    return model, inputs, _class_weighted, targets


def _plan(mesh_shape, axes, constraints=None, example=EXAMPLE) -> Plan:
    torch.manual_seed(0)
    model, inputs, loss_fn, targets = build_example(example, batch=2)
    with quiet(NoRuleWarning):
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
        # the batch over dp beside the classes over tp: the loss a sum over both, each
        # rank's over the count of both sequences' targets
        # NOTE: slow for CI's half-hour (4 processes, 30 s); tests/unit/test_vocab.py
        # checks the rows' and the classes' shares against torch's loss
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
    inner = [c for c in plan.collectives if c.edge.partition("->")[0] in SPLIT]
    want = [
        ("_log_softmax->_log_softmax", "tp"),
        ("_log_softmax->_log_softmax", "tp"),
        ("_log_softmax_backward_data->_log_softmax_backward_data", "tp"),
    ]
    if "dp" in axes:  # the batch split over dp: the loss a sum over both axes
        assert plan.nodes["nll_loss_forward"].out[0] == ("P(sum)", "P(sum)")
        want.append(("nll_loss_forward->nll_loss_forward", "dp"))  # the targets' count
    assert sorted((c.edge, c.axis) for c in inner) == sorted(want), inner
    assert all(c.kind == "all_reduce" for c in inner), inner
    _check(plan, verify(EXAMPLE, mesh_shape, axes, plan_json=plan.to_json(timings=True), batch=2))


def test_batch_split_mean_loss_counts_every_ranks_targets():
    """Data parallel: each rank's sum over both sequences' count of targets (the first
    sequence has 19 ignored, the second 3), all-reduced inside the NLL."""
    example = f"{__file__}:odd_head"
    plan = _plan((2,), ("dp",), {"input:*": "S(0)", "*": "R"}, example)
    nll = plan.nodes["nll_loss_forward"]
    assert (nll.ins[0], nll.out[0], nll.out[1]) == (("S(0)",), ("P(sum)",), ("R",)), nll
    count = [c for c in plan.collectives if c.edge == "nll_loss_forward->nll_loss_forward"]
    assert [(c.kind, c.nbytes) for c in count] == [("all_reduce", 8)], count
    _check(plan, verify(example, (2,), ("dp",), plan_json=plan.to_json(timings=True), batch=2))


def test_a_class_weighted_mean_loss_splits_its_rows_over_the_batch():
    """Data parallel with a class weight: each rank's weighted sum over both sequences'
    summed weights (all-reduced in float64 inside the NLL), the weight whole on each rank;
    without it the plan gathered the logits (a weighted mean had no exact split)."""
    example = f"{__file__}:weighted_head"
    plan = _plan((2,), ("dp",), {"input:*": "S(0)", "*": "R"}, example)
    nll = plan.nodes["nll_loss_forward"]
    assert (nll.ins[0], nll.ins[2], nll.out[0]) == (("S(0)",), ("R",), ("P(sum)",)), nll
    assert plan.nodes["nll_loss_backward"].ins[1] == ("S(0)",)
    count = [c for c in plan.collectives if c.edge == "nll_loss_forward->nll_loss_forward"]
    assert [(c.kind, c.nbytes) for c in count] == [("all_reduce", 8)], count
    assert "lifted_tensor_0" in plan.buffers  # the weight: the step's own buffer
    _check(plan, verify(example, (2,), ("dp",), plan_json=plan.to_json(timings=True), batch=2))


def _check(plan: Plan, reports) -> None:
    """Every rank's losses, gradients and parameters are the single-device model's, and
    every all-reduce the plan prices ran (gloo runs a reshard's all_to_all as an
    all_gather, so the other kinds are not compared)."""
    assert_matches_one_device(reports, F64)
    for axis in plan.mesh.axis_names:
        key = ("all_reduce", axis)
        assert reports[0].ran[key] == plan.collective_counts()[key], (key, reports[0].ran)

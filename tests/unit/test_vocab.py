"""The class-split cross-entropy ops (passes/vocab) against torch's, rank by rank in one
process: each rank's share of the NLL and of its backward, summed over the ranks (or
concatenated along the classes), equals the op on the whole classes; the split softmax, its
reductions standing in for the all-reduce, equals torch's. The ops on a real process group
are tests/distributed/test_vocab_parallel.py."""

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.core import Strategy
from autopar.passes import vocab

aten = torch.ops.aten
RANKS = 4
N, C = 6, 8
IGNORE = -100


def _targets():
    t = torch.randint(0, C, (N,), generator=torch.Generator().manual_seed(1))
    t[2] = IGNORE
    return t


def _shares(x: torch.Tensor, dim: int) -> list[tuple[int, torch.Tensor]]:
    """(first class, local classes) of each rank."""
    size = x.shape[dim] // RANKS
    return [(r * size, x.narrow(dim, r * size, size)) for r in range(RANKS)]


@pytest.mark.parametrize("reduction", [0, 1, 2])  # none, mean, sum
def test_nll_forward_shares_sum_to_the_whole_loss(reduction):
    lp = torch.randn(N, C, dtype=torch.float64).log_softmax(1)
    t = _targets()
    want, want_total = aten.nll_loss_forward(lp, t, None, reduction, IGNORE)
    got = [
        vocab.run_local(aten.nll_loss_forward.default, (x, t, None, reduction, IGNORE), o,
                        "", RANKS, Partial())
        for o, x in _shares(lp, 1)
    ]  # fmt: skip
    torch.testing.assert_close(sum(g[0] for g in got), want)
    for _, total in got:  # every rank counts the same targets, as the whole op does
        torch.testing.assert_close(total, want_total)
    # averaged over the axis (another axis averages the loss): each share times the ranks
    avg = [
        vocab.run_local(aten.nll_loss_forward.default, (x, t, None, reduction, IGNORE), o,
                        "", RANKS, Partial("avg"))[0]
        for o, x in _shares(lp, 1)
    ]  # fmt: skip
    torch.testing.assert_close(sum(avg) / RANKS, want)


@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_nll_backward_shares_are_the_gradient_split_by_class(reduction):
    lp = torch.randn(N, C, dtype=torch.float64).log_softmax(1)
    t = _targets()
    total = (t != IGNORE).sum().to(lp)
    g = torch.randn(N if reduction == 0 else (), dtype=torch.float64)
    want = aten.nll_loss_backward(g, lp, t, None, reduction, IGNORE, total)
    op = aten.nll_loss_backward.default
    got = [
        vocab.run_local(op, (g, x, t, None, reduction, IGNORE, total), o, "", RANKS, Shard(1))
        for o, x in _shares(lp, 1)
    ]
    torch.testing.assert_close(torch.cat(got, 1), want)


def test_one_rank_softmax_and_its_backward_are_torch_s(monkeypatch):
    # one rank holding every class: the all-reduces return their input
    monkeypatch.setattr(vocab, "_all_reduce", lambda t, op, group: t)
    x = torch.randn(N, C, dtype=torch.bfloat16)
    out = vocab.run_local(aten._log_softmax.default, (x, 1, False), 0, "", 1, Shard(1))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, aten._log_softmax(x, 1, False))
    g = torch.randn(N, C, dtype=torch.float64)
    lp = torch.randn(N, C, dtype=torch.float64).log_softmax(1)
    op = aten._log_softmax_backward_data.default
    got = vocab.run_local(op, (g, lp, 1, torch.float64), 0, "", 1, Shard(1))
    torch.testing.assert_close(got, aten._log_softmax_backward_data(g, lp, 1, torch.float64))


def test_class_split_adds_a_strategy_per_replicated_axis():
    r, s0 = Replicate(), Shard(0)
    base = [
        Strategy(out=((r, r), (r, r)), ins=((r, r), (r, r))),
        Strategy(out=((Partial("avg"), r), (Partial(), r)), ins=((s0, r), (s0, r))),
    ]
    got = vocab.class_split(
        aten.nll_loss_forward.default, (None, None, None, 1, IGNORE), [(N, C), (N,)], base,
        (2, 2),
    )  # fmt: skip
    texts = sorted(s.text() for s in got)
    assert texts == sorted(
        [
            "(S(1),R) (R,R) -> (P(sum),R) (R,R)",
            "(R,S(1)) (R,R) -> (R,P(sum)) (R,R)",
            # the batch averaged over the first axis: averaged over the classes' too
            "(S(0),S(1)) (S(0),R) -> (P(avg),P(avg)) (P(sum),R)",
        ]
    ), texts
    # a class weight is not split; classes the axis does not divide are not split
    weighted = (None, None, object(), 1, IGNORE)
    assert not vocab.class_split(
        aten.nll_loss_forward.default, weighted, [(N, C), (N,)], base, (2, 2)
    )
    assert not vocab.class_split(
        aten._log_softmax.default, (None, 1, False), [(N, 7)], base[:1], (2, 2)
    )


def test_reductions_count_the_rows_in_float32():
    rows = vocab.reductions(aten._log_softmax.default, (N, C // 2), 1, torch.bfloat16, 1, 2)
    assert [(c.kind, c.axis, c.nbytes) for c in rows] == [("all_reduce", 1, N * 4)] * 2
    back = vocab.reductions(
        aten._log_softmax_backward_data.default, (N, C // 2), 1, torch.float64, 0, 2
    )
    assert [(c.kind, c.nbytes) for c in back] == [("all_reduce", N * 8)]
    assert (
        vocab.reductions(aten.nll_loss_forward.default, (N, C // 2), 1, torch.float32, 0, 2) == []
    )

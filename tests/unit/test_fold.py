"""Folding: repeated layers are found, grouped only when isomorphic, and planned as the
unfolded graph would be."""

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar import PlanOptions
from autopar.models import GPT, MLP, GPTConfig, cross_entropy_loss, mse_loss
from autopar.models import CausalSelfAttention as Attention
from autopar.passes.fold import FoldGroup, fold_regions, region_of_path
from autopar.passes.solve import solve
from autopar.passes.strategies import build_strategies
from autopar.passes.trace import trace_step

pytestmark = pytest.mark.pinned_torch_only


def _trace(model, inputs, loss_fn, targets, stack):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace_step(model, inputs, loss_fn=loss_fn, example_targets=targets, stack=stack)


def _gpt(layers, *, hidden=64, heads=4, ffn=256, seq=32, vocab=128, batch=8):
    cfg = GPTConfig(vocab=vocab, seq=seq, hidden=hidden, heads=heads, layers=layers, ffn=ffn)
    with torch.device("meta"):
        model = GPT(cfg)
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, (tokens,), cross_entropy_loss, (tokens,)


class MlpBlock(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x_BSH):
        return x_BSH + self.down(F.gelu(self.up(self.norm(x_BSH))))


class AttnBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)

    def forward(self, x_BSH):
        return x_BSH + self.attn(self.norm(x_BSH))


class Alternating(nn.Module):
    """Attention and MLP blocks alternate in one ModuleList (two kinds of layer)."""

    def __init__(self, cfg: GPTConfig, pairs: int):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        kinds = [
            AttnBlock(cfg) if i % 2 == 0 else MlpBlock(cfg.hidden, cfg.ffn)
            for i in range(2 * pairs)
        ]
        self.layers = nn.ModuleList(kinds)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens_BS):
        x_BSH = self.tok(tokens_BS)
        for layer in self.layers:
            x_BSH = layer(x_BSH)
        return self.head(x_BSH)


class NoRepeat(nn.Module):
    """Named layers, no numbered children: nothing to fold."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.mid = nn.Linear(64, 64)
        self.out = nn.Linear(64, 8)

    def forward(self, x_BD):
        return self.out(F.gelu(self.mid(F.gelu(self.inp(x_BD)))))


def _shapes(v):
    return [tuple(t.shape) for t in (v if isinstance(v, (tuple, list)) else [v])]


def test_group_names_read_as_ranges():
    g = FoldGroup(instances=tuple(f"model.layers.{i}" for i in range(32)), nodes=9, signature="x")
    assert g.name() == "model.layers.{0..31}"
    g = FoldGroup(instances=("h.4", "h.0", "h.2"), nodes=9, signature="x")
    assert g.name() == "h.{0,2,4}"
    g = FoldGroup(instances=("h.0", "h.1", "h.5", "h.6", "h.7"), nodes=9, signature="x")
    assert g.name() == "h.{0,1,5..7}"
    with pytest.raises(ValueError):
        FoldGroup(instances=("h.0",), nodes=9, signature="x")


def test_region_of_path_takes_the_outermost_numbered_child():
    assert region_of_path("model.layers.3.mlp.up_proj") == "model.layers.3"
    assert region_of_path("blocks.12.attn") == "blocks.12"
    assert region_of_path("0.fc") == "0"
    assert region_of_path("lm_head") == ""
    assert region_of_path("") == ""


def test_gpt_layers_fold_into_one_group_forward_and_backward():
    with contextlib.ExitStack() as stack:
        step = _trace(*_gpt(4), stack)
        folded = fold_regions(step)
    assert len(folded.groups) == 1
    (group,) = folded.groups
    assert sorted(group.instances) == [f"blocks.{i}" for i in range(4)]
    assert folded.unfolded == ()
    nodes = {n.name: n for n in step.gm.graph.nodes}
    roles = set()
    for name, rep in folded.rep.items():
        if name == rep:
            continue
        a, b = nodes[name], nodes[rep]
        # an instance maps onto a node of the same op, role and shape in another layer
        assert a.op == b.op and (a.op == "placeholder" or a.target == b.target)
        assert a.meta["autopar_role"] == b.meta["autopar_role"]
        assert _shapes(a.meta["val"]) == _shapes(b.meta["val"])
        assert folded.region[name] != folded.region[rep]
        roles.add(a.meta["autopar_role"])
    assert {"param", "forward", "backward"} <= roles
    # three of the four layers are folded away
    assert folded.n_nodes - folded.n_representatives >= 3 * (group.nodes - 4)
    assert "folded 4 x" in folded.report() and "blocks.{0..3}" in folded.report()


class _Squares(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        h = self.fc(x)
        return h * h + x  # (mul reads h twice)


def test_a_folded_instance_reads_its_inputs_as_its_own_call_numbers_them():
    # an instance's inputs are read without recording its call (passes/strategies): its
    # edges must be those of the unfolded space, each tensor input at its own position,
    # a repeated one (h * h) once per position
    model = nn.Sequential(*[_Squares(16) for _ in range(3)])
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    mesh = autopar.Mesh((2,), ("dp",))
    with contextlib.ExitStack() as stack:
        step = _trace(model, (x,), mse_loss, (y,), stack)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            folded = build_strategies(step, mesh, folded=fold_regions(step))
            plain = build_strategies(step, mesh)
    assert folded.rep, "nothing folded"
    assert folded.edges == plain.edges
    nodes = {n.name: n for n in step.gm.graph.nodes}
    repeated = [n for n in folded.rep if len(nodes[n].all_input_nodes) < len(plain.in_sources[n])]
    assert repeated, "no folded instance reads one input twice"


def test_layers_of_different_widths_never_fold():
    model = MLP(d_in=16, d_hidden=64, n_layers=3)  # layers.0 is 16 -> 64, the rest 64 -> 64
    with contextlib.ExitStack() as stack:
        step = _trace(model, (torch.randn(8, 16),), mse_loss, (torch.randn(8, 8),), stack)
        folded = fold_regions(step)
    assert [sorted(g.instances) for g in folded.groups] == [["layers.1", "layers.2"]]
    assert folded.unfolded == ("layers.0",)
    assert "not folded (no isomorphic peer): layers.0" in folded.report()


def _plan(example, mesh, **kw):
    model, inputs, loss_fn, targets = example
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, **kw)


def test_model_without_repetition_folds_nothing_and_plans_as_unfolded():
    with torch.device("meta"):
        model = NoRepeat()
    x = torch.zeros(8, 16, device="meta")
    y = torch.zeros(8, 8, device="meta")
    mesh = autopar.Mesh((2, 2), ("dp", "tp"))
    folded = _plan((model, (x,), mse_loss, (y,)), mesh, memory_fraction=0.5)
    plain = _plan((model, (x,), mse_loss, (y,)), mesh, memory_fraction=0.5, fold=False)
    assert (
        folded.stats["fold_groups"] == [] and folded.stats["solver_nodes"] == folded.stats["nodes"]
    )
    assert "no repeated regions" in folded.summary()
    assert folded.nodes == plain.nodes
    assert folded.cost == plain.cost


def _solve_both(step, mesh, options=None, *, same_plan=True):
    """The folded and the unfolded ILP of one traced step, each solved to optimality.

    ``same_plan``: the unfolded optimum treats every layer alike, so folding must find it;
    otherwise folding, a restriction, may only cost more."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        folded_space = build_strategies(step, mesh, folded=fold_regions(step))
        plain_space = build_strategies(step, mesh)
    folded = solve(folded_space, options, mip_gap=0.0)
    plain = solve(plain_space, options, mip_gap=0.0)
    assert folded.stats["solver_nodes"] < plain.stats["solver_nodes"]
    assert folded.stats["variables"] < plain.stats["variables"]
    if not same_plan:
        assert plain.objective_s <= folded.objective_s * (1 + 1e-9)
        return folded, plain
    # (within 1e-6: each solve re-prices the gradient buckets at its own plan's overlap,
    # passes/solve "Overlap", so the two stop at plans within the re-pricing's rounding)
    assert folded.objective_s == pytest.approx(plain.objective_s, rel=1e-6)
    # the same choice at every node, not only the same cost
    chosen = {n: folded.chosen(folded_space, n) for n in folded_space.order}
    assert chosen == {n: plain.chosen(plain_space, n) for n in plain_space.order}
    return folded, plain


def test_two_alternating_kinds_of_layer_fold_into_two_groups():
    cfg = GPTConfig(vocab=128, seq=32, hidden=64, heads=4, ffn=256)
    with torch.device("meta"):
        model = Alternating(cfg, pairs=2)
    tokens = torch.zeros(8, 32, dtype=torch.long, device="meta")
    example = (model, (tokens,), cross_entropy_loss, (tokens,))
    mesh = autopar.Mesh((4,), ("dp",))
    with contextlib.ExitStack() as stack:
        step = _trace(*example, stack)
        folded = fold_regions(step)
        # a budget may make the unfolded optimum shard two layers of one kind differently
        # (one sharded more to make room for the other): folding gives that up. Without
        # checkpointing, which the unfolded ILP may also give one layer of a kind alone
        # (measured: folded 0.644 ms against 0.636 ms with it), and without the overlap's
        # rounds (passes/solve, "Overlap"): a search over re-priced shares, whose rounds
        # take the two ILPs down different paths (the unfolded one's last round shards one
        # layer of a kind and not the other: 0.598 against 0.618 ms), which is the rounds'
        # doing, not folding's
        folded_sol, plain_sol = _solve_both(
            step,
            mesh,
            # (no bucket, no prefetch: nothing hides, passes/solve ``hidden_kinds``)
            PlanOptions(memory_fraction=0.5, checkpointing=False, skip={"buckets", "prefetch"}),
            same_plan=False,
        )
    # (measured: 0.6275 against 0.6260 ms since passes/memory counts what a gather into a
    # view holds, and the budget binds on both)
    assert folded_sol.objective_s <= plain_sol.objective_s * (1 + 5e-3)
    assert sorted(sorted(g.instances) for g in folded.groups) == [
        ["layers.0", "layers.2"],
        ["layers.1", "layers.3"],
    ]
    assert folded_sol.stats["solver_nodes"] < 0.6 * plain_sol.stats["solver_nodes"]
    a = _plan(example, mesh, memory_fraction=0.5)
    assert [g["instances"] for g in a.stats["fold_groups"]] == [2, 2]
    assert a.stats["folded_nodes"] == a.stats["nodes"] - a.stats["solver_nodes"]
    assert a.stats["fold_regions"] == 4
    # every instance takes its representative's placements
    pp = a.param_placements
    assert pp["layers.2.attn.q.weight"] == pp["layers.0.attn.q.weight"]
    assert pp["layers.3.up.weight"] == pp["layers.1.up.weight"]
    assert a.memory["step"]["peak_bytes"] <= a.stats["memory_budget"]
    assert a.collectives, "the budget forces sharding"


# depths 4 (39 s here) and 8 (80 s) are marked slow: `python -m pytest -q -m slow tests`
@pytest.mark.parametrize(
    "depth", [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)]
)
def test_folded_plan_equals_unfolded_plan(depth):
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="h100")
    with contextlib.ExitStack() as stack:
        step = _trace(*_gpt(depth, hidden=256, heads=4, ffn=1024, seq=128, vocab=512), stack)
        folded, _ = _solve_both(step, mesh)
    assert folded.collectives, "a plan with no collective tests nothing here"


def test_merging_following_nodes_keeps_the_optimum():
    with contextlib.ExitStack() as stack:
        step = _trace(*_gpt(2), stack)
        mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="h100")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            space = build_strategies(step, mesh, folded=fold_regions(step))
    merged = solve(space, mip_gap=0.0)
    exact = solve(space, merge=False, mip_gap=0.0)
    assert merged.stats["merged_nodes"] > 0 and exact.stats["merged_nodes"] == 0
    assert merged.stats["variables"] < exact.stats["variables"]
    assert merged.objective_s == pytest.approx(exact.objective_s, rel=1e-9)

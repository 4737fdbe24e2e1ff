"""A training loop as torch's own parallelism runs it, on gloo meshes, against one device.

Parameters and gradients are DTensors, so torch's optimizers and ``clip_grad_norm_`` work
unchanged and give the global result; ``state_dict`` / ``load_state_dict`` and
``torch.distributed.checkpoint`` (with its ``state_dict`` helpers) save, load and reshard
the model and the optimizer.
"""

from __future__ import annotations

import copy
import hashlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

import autopar
from autopar.models import GPT, GPTConfig, cross_entropy_loss, lm_batch
from autopar.runtime import run_local

from helpers import compile_quietly, train_beside

CFG = GPTConfig(vocab=64, seq=16, hidden=32, heads=4, layers=2, ffn=64)
BATCH = 8
FULL = StateDictOptions(full_state_dict=True)


def _gpt(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG).double()


def _compile(model, mesh, tokens, targets, fraction: float):
    """Compile with a budget of ``fraction`` of what one device holds for the step, so that
    the plan shards parameters (each rank then holds different parts)."""
    return compile_quietly(
        model,
        mesh,
        (tokens,),
        loss_fn=cross_entropy_loss,
        example_targets=(targets,),
        memory_fraction=fraction,
    )


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def _clipped_training(rank, world, steps, max_norm):
    model = _gpt(0)
    ref = copy.deepcopy(model)
    tokens, targets = lm_batch(CFG.vocab, BATCH, CFG.seq)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pm = _compile(model, mesh, tokens, targets, 0.5)
    local = pm.shard_inputs(tokens, targets)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
    norms, losses = [], []
    for loss, ref_loss in train_beside(
        pm, local, opt, lambda: cross_entropy_loss(ref(tokens), targets), ref_opt, steps
    ):
        grads = [p.grad for p in pm.parameters()]
        # the norm without foreach too (another DTensor path), before clipping changes it
        plain = torch.nn.utils.get_total_norm(grads, foreach=False)
        norm = torch.nn.utils.clip_grad_norm_(pm.parameters(), max_norm, foreach=True)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, foreach=True)
        norm, plain = (t.full_tensor() if isinstance(t, DTensor) else t for t in (norm, plain))
        norms.append((norm.item(), plain.item(), ref_norm.item()))
        losses.append((loss, ref_loss))
    kinds = {
        n: (isinstance(p, torch.nn.Parameter), isinstance(p, DTensor), isinstance(p.grad, DTensor))
        for n, p in pm.named_parameters()
    }
    # the copies one rank holds of each parameter: the coordinate on the axes it is sharded
    # over names the part; ranks with the same part must hold the same bits
    coord = mesh.get_coordinate()
    parts = {}
    for n, p in pm.named_parameters():
        sharded = tuple(c for c, ps in zip(coord, p.placements) if not isinstance(ps, Replicate))
        parts[n] = (sharded, _digest(p.to_local()))
    want = dict(ref.named_parameters())
    param_err = max(
        ((p.full_tensor() - want[n]).norm() / want[n].norm()).item()
        for n, p in pm.named_parameters()
    )
    return {
        "norms": norms,
        "losses": losses,
        "kinds": kinds,
        "parts": parts,
        "param_err": param_err,
        "sharded": sorted(
            n for n, p in pm.named_parameters() if not all(x.is_replicate() for x in p.placements)
        ),
    }


@pytest.mark.distributed
def test_clip_grad_norm_is_global_and_replicas_stay_identical():
    results = run_local(_clipped_training, 4, 20, 0.1)
    r0 = results[0]
    assert r0["sharded"], "the budget must shard some parameter for this test to mean anything"
    for r in results:
        # parameters, their values and their gradients are DTensors
        assert set(r["kinds"].values()) == {(True, True, True)}, r["kinds"]
        for norm, plain, ref_norm in r["norms"]:
            # the norm over every shard, once: the single-device model's
            assert norm == pytest.approx(ref_norm, rel=1e-12)
            assert plain == pytest.approx(ref_norm, rel=1e-12)
        assert r0["norms"][0][2] > 0.1  # clipping was active
        for loss, ref_loss in r["losses"]:
            assert loss == pytest.approx(ref_loss, rel=1e-11)
        assert r["param_err"] < 1e-9
    # every copy of a part is the same bits on every rank that holds it, after 20 steps
    for name in r0["parts"]:
        copies: dict[tuple, set[str]] = {}
        for r in results:
            part, digest = r["parts"][name]
            copies.setdefault(part, set()).add(digest)
        assert all(len(d) == 1 for d in copies.values()), (name, copies)


def _state_dicts(rank, world):
    model = _gpt(0)
    tokens, targets = lm_batch(CFG.vocab, BATCH, CFG.seq)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pm = _compile(model, mesh, tokens, targets, 0.5)
    local = pm.shard_inputs(tokens, targets)
    out = {}
    sd = pm.state_dict()
    out["keys"] = list(sd) == list(model.state_dict())
    out["all_dtensors"] = all(isinstance(v, DTensor) for v in sd.values())
    result = pm.load_state_dict(sd)
    out["roundtrip"] = (list(result.missing_keys), list(result.unexpected_keys))
    # a single-device state dict (full tensors) loads into the parallel module...
    other = _gpt(1)
    pm.load_state_dict(other.state_dict())
    out["loss_after_full_load"] = (
        pm(*local).item(),
        cross_entropy_loss(other(tokens), targets).item(),
    )
    # ...and torch's helper gathers it back to full tensors a single-device model loads
    fresh = _gpt(2)
    fresh.load_state_dict(get_model_state_dict(pm, options=FULL))
    out["back_equal"] = all(
        torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), other.state_dict().values())
    )
    # torch's helper loads a full state dict too
    third = _gpt(3)
    set_model_state_dict(pm, third.state_dict(), options=FULL)
    out["set_full_equal"] = all(
        torch.equal(v.full_tensor(), third.state_dict()[k]) for k, v in pm.state_dict().items()
    )
    # a missing key is an error, as in torch
    partial = dict(third.state_dict())
    partial.pop("head.weight")
    try:
        pm.load_state_dict(partial)
        out["missing"] = "no error"
    except RuntimeError as e:
        out["missing"] = str(e)
    return out


@pytest.mark.distributed
def test_state_dict_is_dtensors_and_loads_full_and_sharded():
    for r in run_local(_state_dicts, 4):
        assert r["keys"] and r["all_dtensors"]
        assert r["roundtrip"] == ([], [])
        loss, want = r["loss_after_full_load"]
        assert loss == pytest.approx(want, rel=1e-12)
        assert r["back_equal"] and r["set_full_equal"]
        assert "head.weight" in r["missing"]


def _train_steps(pm, opt, local, steps):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = pm(*local)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(pm.parameters(), 0.5)
        opt.step()
        losses.append(loss.item())
    return losses


def _save_run(rank, world, path):
    """(2, 2): train 2 steps, save model and AdamW state with DCP, then 2 steps more."""
    model = _gpt(0)
    tokens, targets = lm_batch(CFG.vocab, BATCH, CFG.seq)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pm = _compile(model, mesh, tokens, targets, 0.5)
    local = pm.shard_inputs(tokens, targets)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    _train_steps(pm, opt, local, 2)
    state = {"model": get_model_state_dict(pm), "optim": get_optimizer_state_dict(pm, opt)}
    dcp.save(state, checkpoint_id=path)
    return {
        "after": _train_steps(pm, opt, local, 2),
        "placements": {n: tuple(map(repr, p.placements)) for n, p in pm.named_parameters()},
    }


def _load_run(rank, world, path):
    """(4,), another plan: load the checkpoint (resharded), continue 2 steps."""
    model = _gpt(7)  # other weights: all of them must come from the checkpoint
    tokens, targets = lm_batch(CFG.vocab, BATCH, CFG.seq)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    pm = _compile(model, mesh, tokens, targets, 0.4)
    local = pm.shard_inputs(tokens, targets)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    state = {"model": get_model_state_dict(pm), "optim": get_optimizer_state_dict(pm, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(pm, state["model"])
    set_optimizer_state_dict(pm, opt, state["optim"])
    return {
        "after": _train_steps(pm, opt, local, 2),
        "placements": {n: tuple(map(repr, p.placements)) for n, p in pm.named_parameters()},
    }


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    """A DCP checkpoint of model and AdamW after 2 steps on (2, 2), and the saving run's
    results (what the next 2 steps gave)."""
    path = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    return path, run_local(_save_run, 4, path)


@pytest.mark.distributed
def test_dcp_checkpoint_reshards_onto_another_mesh_and_training_continues(saved_checkpoint):
    path, saved = saved_checkpoint
    loaded = run_local(_load_run, 4, path)
    # a different layout: the load had to reshard
    assert saved[0]["placements"] != loaded[0]["placements"]
    assert any("Shard" in str(ps) for ps in loaded[0]["placements"].values()), loaded[0]
    want = saved[0]["after"]
    for r in loaded:
        # the model and AdamW's moments and step counts came through: the same losses
        assert r["after"] == pytest.approx(want, rel=1e-12)


def _meta_run(rank, world, path):
    """A model built on the meta device, compiled: initialized as shards (from the seed as
    compile finds it), or loaded from a checkpoint."""
    tokens, targets = lm_batch(CFG.vocab, BATCH, CFG.seq)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        meta = GPT(CFG)  # float32: the reference draws its numbers in float32 too
    out = {}
    torch.manual_seed(0)
    pm = _compile(meta, mesh, tokens, targets, 0.5)  # most weights are sharded
    torch.manual_seed(0)
    ref = GPT(CFG)
    full = get_model_state_dict(pm, options=FULL)
    out["equal"] = sorted(k for k, v in ref.state_dict().items() if not torch.equal(full[k], v))
    out["loss"] = (
        pm(*pm.shard_inputs(tokens, targets)).item(),
        cross_entropy_loss(ref(tokens), targets).item(),
    )
    out["meta_left"] = any(p.is_meta for p in meta.parameters())  # the model is left as it was
    out["init_peak"] = pm.stats["init_peak_bytes"]
    out["shard_bytes"] = sum(
        p.to_local().numel() * p.to_local().element_size() for p in pm.parameters()
    )
    out["model_bytes"] = sum(p.numel() * p.element_size() for p in ref.parameters())
    out["largest_module"] = max(
        sum(t.numel() * t.element_size() for t in m.parameters(recurse=False))
        for m in ref.modules()
    )
    # a meta model loads a checkpoint that a (2, 2) run saved, as its shards
    with torch.device("meta"):
        meta64 = GPT(CFG).double()
    pm64 = autopar.compile(
        meta64,
        mesh,
        (tokens,),
        loss_fn=cross_entropy_loss,
        example_targets=(targets,),
        checkpoint=path,
    )
    out["ckpt_loss"] = pm64(*pm64.shard_inputs(tokens, targets)).item()
    return out


@pytest.mark.distributed
def test_meta_model_initializes_as_shards_equal_to_single_device(saved_checkpoint):
    path, saved = saved_checkpoint
    for r in run_local(_meta_run, 4, path):
        assert r["equal"] == [], f"differ from the single-device init: {r['equal']}"
        loss, want = r["loss"]
        assert loss == pytest.approx(want, rel=1e-5)  # float32, another summation order
        assert r["meta_left"]
        # what init held at most: the shards plus one module's whole tensors, not the model
        assert r["shard_bytes"] <= r["init_peak"] <= r["shard_bytes"] + r["largest_module"]
        assert r["init_peak"] < 0.7 * r["model_bytes"]
        # the checkpoint's weights: the first loss after the save
        assert r["ckpt_loss"] == pytest.approx(saved[0]["after"][0], rel=1e-12)

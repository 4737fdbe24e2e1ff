"""compile() on real gloo process groups: errors, saved plans, models without a loss."""

import pytest
import torch

from autopar.runtime import run_local

from helpers import compile_quietly, plan_quietly


def _mesh_size_mismatch(rank, world):
    from torch.distributed.device_mesh import DeviceMesh

    import autopar
    from autopar.models import MLP, mse_loss

    mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), _init_backend=False, _rank=rank)
    try:
        autopar.compile(
            MLP(),
            mesh,
            (torch.randn(4, 16),),
            loss_fn=mse_loss,
            example_targets=(torch.randn(4, 8),),
        )
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.distributed
def test_mesh_size_must_equal_world_size():
    msgs = run_local(_mesh_size_mismatch, 2)
    for msg in msgs:
        assert "the mesh has 4 devices (2, 2) but the world size is 2" in msg


def _outputs_without_loss(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from autopar.models import GPT, GPTConfig, lm_batch

    torch.manual_seed(0)
    cfg = GPTConfig(layers=1)
    model = GPT(cfg).double()
    tokens, _ = lm_batch(cfg.vocab, 8, cfg.seq)
    ref = model(tokens)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    pm = compile_quietly(model, mesh, (tokens,), memory_fraction=0.6)
    (local,) = pm.shard_inputs(tokens)
    out = pm(local)
    out.sum().backward()
    # the local batch in, the local batch out: gathered, the global output
    placements = pm.plan.placements_of(pm.plan.inputs[0])
    whole = DTensor.from_local(
        out.detach(), mesh, placements, shape=ref.shape, stride=ref.stride()
    ).full_tensor()
    return (whole - ref).abs().max().item(), tuple(whole.shape), tuple(out.shape), placements


@pytest.mark.distributed
def test_model_without_loss_returns_local_outputs():
    from torch.distributed.tensor import Shard

    results = run_local(_outputs_without_loss, 2)
    for err, shape, local_shape, placements in results:
        assert err < 1e-10
        assert shape == (8, 32, 128)
        # the batch was split: each rank returned its half
        assert placements == (Shard(0),) and local_shape == (4, 32, 128)


def _saved_plan(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.models import EXAMPLES

    torch.manual_seed(0)
    model, inputs, loss_fn, targets = EXAMPLES["gpt"]()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    pm = compile_quietly(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, plan=path)
    loss = pm(*pm.shard_inputs(*inputs, *targets))
    return loss.item(), loss_fn(model(*inputs), *targets).item(), pm.plan.to_json()


@pytest.mark.distributed
def test_compile_runs_a_saved_plan(tmp_path):
    import autopar
    from autopar.models import EXAMPLES

    torch.manual_seed(0)
    model, inputs, loss_fn, targets = EXAMPLES["gpt"]()
    plan = plan_quietly(
        model,
        autopar.Mesh((2,), ("dp",), device="cpu"),
        inputs,
        loss_fn=loss_fn,
        example_targets=targets,
        memory_fraction=0.6,
    )
    path = tmp_path / "plan.json"
    plan.save(path)
    results = run_local(_saved_plan, 2, str(path))
    for loss, ref, used in results:
        assert loss == pytest.approx(ref, rel=1e-5)
        assert used == plan.to_json()


def _dies_on_rank_1(rank, world):
    import os
    import time

    if rank == 1:
        os._exit(3)  # no exception, no report: the process is simply gone
    time.sleep(30)
    return rank


@pytest.mark.distributed
def test_a_rank_that_dies_without_a_word_is_an_error_at_once():
    import time

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed:\nprocess exited with code 3"):
        run_local(_dies_on_rank_1, 2)
    assert time.monotonic() - t0 < 25  # not the sleeping rank's 30 s, nor the 900 s timeout


def _what_a_rank_sees(rank, world):
    import os

    return os.getppid(), os.environ.get("AUTOPAR_LAUNCH_TEST")


@pytest.mark.distributed
def test_ranks_fork_from_one_server_and_see_the_callers_environment(monkeypatch):
    import os

    monkeypatch.setenv("AUTOPAR_LAUNCH_TEST", "first")
    first = run_local(_what_a_rank_sees, 2)
    # a variable set after the fork server started reaches the ranks of the next call
    monkeypatch.setenv("AUTOPAR_LAUNCH_TEST", "second")
    second = run_local(_what_a_rank_sees, 2)
    assert [v for _, v in first] == ["first"] * 2
    assert [v for _, v in second] == ["second"] * 2
    # every rank is a child of one server, which outlives a call, not of this process (as
    # a spawned rank is)
    servers = {ppid for ppid, _ in first + second}
    assert len(servers) == 1 and os.getpid() not in servers


def test_nccl_ranks_are_spawned_not_forked():
    # a module that touches CUDA when imported would leave the server's forks without it
    from autopar.runtime.launch import _context

    assert _context(_what_a_rank_sees, "nccl").get_start_method() == "spawn"
    assert _context(_what_a_rank_sees, "gloo").get_start_method() == "forkserver"

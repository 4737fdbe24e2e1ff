"""Failures are errors, never hangs: on gloo, each one is a clear error, fast.

- inputs of the wrong shape or dtype on one rank: that rank says which argument and what it
  should be; the launcher stops the others;
- ranks given different plans: every rank raises, naming which ranks hold which plan;
- a rank that dies in the middle of training: the others' step fails at once with one line
  (``PeerLostError``), and the launcher names the rank that died.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.models import EXAMPLES
from autopar.runtime import run_local

from helpers import compile_quietly, plan_quietly


def _compiled_mlp(plan=None, fraction=None):
    torch.manual_seed(0)
    model, inputs, loss_fn, targets = EXAMPLES["mlp"]()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = compile_quietly(
        model,
        mesh,
        inputs,
        loss_fn=loss_fn,
        example_targets=targets,
        plan=plan,
        memory_fraction=fraction,
    )
    return pm, inputs, targets


def _bad_input_on_rank_1(rank, world, kind):
    pm, inputs, targets = _compiled_mlp()
    local = list(pm.shard_inputs(*inputs, *targets))
    if rank == 1:
        local[0] = local[0][:-1] if kind == "shape" else local[0].double()
    pm(*local).backward()
    time.sleep(60)  # rank 0 would wait here; the launcher must stop it at once
    return "no error"


@pytest.mark.distributed
@pytest.mark.parametrize(
    "kind, says",
    [("shape", "rank 1: argument 0 has shape"), ("dtype", "rank 1: argument 0 is torch.float64")],
)
def test_a_bad_input_on_one_rank_is_an_error_at_once(kind, says):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed") as err:
        run_local(_bad_input_on_rank_1, 2, kind)
    assert says in str(err.value)
    assert time.monotonic() - t0 < 45  # not rank 0's 60 s


def _different_plans(rank, world, paths):
    try:
        _compiled_mlp(plan=paths[rank])
    except autopar.PlanMismatchError as e:
        return str(e)
    return "no error"


@pytest.mark.distributed
def test_ranks_given_different_plans_all_raise(tmp_path):
    model, inputs, loss_fn, targets = EXAMPLES["mlp"]()
    mesh = autopar.Mesh((2,), ("dp",), device="cpu")
    paths = []
    for i, fraction in enumerate([None, 0.6]):
        plan = plan_quietly(
            model,
            mesh,
            inputs,
            loss_fn=loss_fn,
            example_targets=targets,
            memory_fraction=fraction,
        )
        paths.append(str(tmp_path / f"plan{i}.json"))
        plan.save(paths[-1])
    assert Path(paths[0]).read_text() != Path(paths[1]).read_text()
    for message in run_local(_different_plans, 2, paths):
        assert "different plans" in message and "ranks [0]" in message and "ranks [1]" in message


def _dies_mid_training(rank, world, out_dir):
    # near the least that fits (0.51 of one device): the weights are sharded, and the
    # forward all-gathers them
    pm, inputs, targets = _compiled_mlp(fraction=0.55)
    assert pm.collective_counts()
    local = pm.shard_inputs(*inputs, *targets)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    for step in range(4):
        if rank == 1 and step == 2:
            os._exit(7)  # gone, without a word, between two steps
        try:
            loss = pm(*local)
        except autopar.PeerLostError as e:
            Path(out_dir, f"rank{rank}.txt").write_text(str(e))
            raise
        loss.backward()
        opt.step()
    return "finished"


@pytest.mark.distributed
def test_a_rank_that_dies_mid_training_fails_the_others_at_once(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed:\nprocess exited with code 7"):
        run_local(_dies_mid_training, 2, str(tmp_path))
    assert time.monotonic() - t0 < 60
    said = (tmp_path / "rank0.txt").read_text()
    assert said.startswith("rank 0: another rank was lost during the step")
    assert "\n" not in said  # one line

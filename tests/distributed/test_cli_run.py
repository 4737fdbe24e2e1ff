"""The commands that run processes: ``autopar verify`` (the parallel step beside one
device on local gloo ranks) and ``autopar run`` (a script under torch's elastic launcher)."""

from __future__ import annotations

import json
import textwrap

import pytest

from autopar.cli import main

pytestmark = pytest.mark.distributed

DROPOUT_FACTORY = """
import torch
from torch import nn

def factory(batch=8, p=0.5):
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(p), nn.Linear(64, 8))
    x, y = torch.randn(batch, 16), torch.randn(batch, 8)
    return model, (x,), nn.functional.mse_loss, (y,)

def no_dropout(batch=8):
    return factory(batch, p=0.0)
"""


def test_verify_passes_an_exact_plan_and_fails_a_random_step(capsys, tmp_path):
    src = tmp_path / "models.py"
    src.write_text(DROPOUT_FACTORY)
    # the budget makes the plan shard over dp (collectives in the step)
    args = ["--mesh", "2", "--memory-fraction", "0.6", "--json"]
    assert main(["verify", f"{src}:no_dropout", *args]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["collectives_ran"] == report["collectives_planned"]
    assert report["collectives_ran"] and report["grad_rel_err"] <= 1e-8
    # with dropout on, the sharded batch draws other masks than one device: caught
    assert main(["verify", f"{src}:factory", *args[:-1]]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH against the single-device model" in out
    assert "the step draws random numbers (aten.native_dropout.default)" in out


def test_verify_of_a_plan_for_another_model_is_one_line(capsys, tmp_path):
    plan = tmp_path / "gpt.json"
    assert main(["plan", "gpt", "--mesh", "2", "-q", "--out", str(plan)]) == 0
    assert main(["verify", "mlp", "--mesh", "2", "--plan", str(plan), "-q"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert "PlanMismatchError: the plan was made for graph" in line


def test_run_launches_a_script_on_local_processes(capfd, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        t = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {t.item():.0f} {sys.argv[1:]}")
        code = 3 if "--fail" in sys.argv and dist.get_rank() == 1 else 0
        dist.destroy_process_group()
        sys.exit(code)
    """)
    )
    # run's own options may follow the script; the script's follow --
    assert main(["run", str(script), "--nproc", "3", "--", "--lr", "1", "--nproc", "9"]) == 0
    out = capfd.readouterr().out
    for rank in range(3):
        assert f"rank {rank} of 3: 6 ['--lr', '1', '--nproc', '9']" in out
    assert main(["run", "-q", str(script), "--nproc", "2", "--fail"]) == 3
    err = capfd.readouterr().err
    assert "autopar run: rank 1 of 2 failed with exit code 3" in err

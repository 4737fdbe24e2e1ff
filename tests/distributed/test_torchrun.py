"""examples/train.py under torchrun (and `autopar run`) on gloo: the README's training loop trains, saves DCP
checkpoints, and resumes from one (on another mesh too) with the same losses."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.runtime import free_port

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train.py"


def _train(
    ckpt: Path, mesh: str, nproc: int, steps: int, *, autopar_run: bool = False
) -> tuple[list[str], str]:
    script = [
        str(EXAMPLE), "--mesh", mesh, "--steps", str(steps), "--batch", "8",
        "--ckpt-dir", str(ckpt), "--ckpt-every", "2",
    ]  # fmt: skip
    if autopar_run:  # the CLI's launcher: rendezvous on a free port of its own
        cmd = [sys.executable, "-m", "autopar.cli", "run", "--nproc", str(nproc), "--", *script]
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", *script,
        ]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return re.findall(r"^step \d+ loss \S+", out.stdout, re.M), out.stdout


@pytest.mark.distributed
def test_train_example_checkpoints_and_resumes_under_torchrun(tmp_path):
    ckpt = tmp_path / "ckpt"
    first, _ = _train(ckpt, "2", 2, 4)
    assert len(first) == 4 and sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-4"]
    loss = [float(line.split()[-1]) for line in first]
    assert loss[-1] < loss[0]  # it learns
    shutil.rmtree(ckpt / "step-4")
    again, out = _train(ckpt, "2", 2, 4)
    assert "resumed from" in out and again == first[2:]  # the same steps, the same losses
    # on a (2, 1) mesh, another layout: DCP reshards; losses equal to float32 rounding
    # (launched by `autopar run` this time)
    shutil.rmtree(ckpt / "step-4")
    other, out = _train(ckpt, "2x1", 2, 4, autopar_run=True)
    assert "resumed from" in out
    got = [float(line.split()[-1]) for line in other]
    assert got == pytest.approx(loss[2:], rel=1e-5)

"""What every benchmark prints first (the machine and versions, then the table's head), and
what several share: the GPU-sized models, the mixed precision, a failed case's line,
planning and compiling with the warnings quiet, and the training step whose memory
memory_check and memory_order measure."""

from __future__ import annotations

import contextlib
import platform
import warnings
from collections.abc import Callable, Iterator

import torch

import autopar
from autopar.verify import measured_step_peak


def print_header(settings: str, columns: list[str]) -> None:
    """The machine line (with ``settings``), a blank line, a markdown table's head."""
    print(
        f"machine: {platform.machine()}, {torch.get_num_threads()} threads; "
        f"torch {torch.__version__}; {settings}"
    )
    print()
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))


MIXED = "bf16-mixed"
"""float32 parameters and AdamW state, bf16 compute, float32 reduction (``mp_policy``)."""

GPU_MODELS = {
    "hf-llama 4x1024, seq 1024, batch 8": (
        "hf-llama",
        dict(layers=4, hidden=1024, heads=16, kv_heads=4, ffn=4096, vocab=32000, seq=1024, batch=8),
    ),
    "gpt 4x1024 (sdpa), seq 1024, batch 8": (
        "gpt",
        dict(layers=4, hidden=1024, heads=16, ffn=4096, vocab=32000, seq=1024, sdpa=True, batch=8),
    ),
    "Llama-3.2-1B shapes, 8 layers, seq 2048, batch 4": (
        "hf-llama",
        dict(
            layers=8, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, seq=2048, batch=4
        ),
    ),
}
"""Zoo models sized for a GPU, by label: ``(example, its size)`` (the CUDA tables of
cost_fidelity and memory_check)."""


def mp_policy(precision: str):
    """``autopar.MixedPrecision`` for ``MIXED``, None for fp32."""
    return autopar.MixedPrecision(torch.bfloat16, torch.float32) if precision == MIXED else None


def last_line(e: BaseException) -> str:
    """A failed case's error in one line (a process's traceback ends with it)."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Every warning ignored inside the block: a zoo model replicates the ops it has no rule
    for (NoRuleWarning), which a benchmark does not measure."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def plan_quietly(*args, **kwargs) -> autopar.Plan:
    """``autopar.plan(*args, **kwargs)`` with its warnings ignored."""
    with quiet():
        return autopar.plan(*args, **kwargs)


def compile_quietly(*args, **kwargs):
    """``autopar.compile(*args, **kwargs)`` with its warnings ignored."""
    with quiet():
        return autopar.compile(*args, **kwargs)


def training_step(pm, local: tuple, opt) -> Callable[[], None]:
    """One training step of the parallel module ``pm`` on its local batch: forward and
    backward, ``opt.step()``, then torch's default ``zero_grad`` (to None, so the gradients
    live from the backward on)."""

    def step() -> None:
        pm(*local).backward()
        opt.step()
        opt.zero_grad()

    return step


def third_step_peak(pm, local: tuple, opt) -> int:
    """The bytes of live storages at the peak of the third training step
    (``autopar.verify.measured_step_peak``): the optimizer state exists from the first."""
    step = training_step(pm, local, opt)
    for _ in range(2):
        step()
    return measured_step_peak(pm, opt, local, step)

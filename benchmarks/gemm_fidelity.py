"""The matmuls a transformer's training step runs, priced by a profile's matmul curves,
against the same matmuls timed on this GPU.

    python benchmarks/gemm_fidelity.py [--profile h100] [--save FILE] [--load FILE] [--check]

A profile prices a matmul by its FLOPs alone (``DeviceProfile.kernel_rates``, a curve of
square GEMMs). The step runs other shapes: each linear layer of ``MODELS`` (the models of
``plan_quality.py``) on ``TOKENS`` tokens a rank, its weight split ``TP`` ways (column-
parallel layers by their outputs, row-parallel ones by their inputs, the head by the
vocab), as three GEMMs, in the layouts the traced step calls them:

    forward     x [T, in] @ W.t()            (W [out, in], a transposed view)
    input grad  dy [T, out] @ W
    weight grad dy.t() @ x                    ([out, T] @ [T, in], a transposed view)

in bf16 for every model and float32 for the smallest. Each GEMM is timed on the device's
clock: a run of calls between two CUDA events, the call's time the run's over its calls
(calls enough to fill ``RUN_S``), the median of ``ROUNDS`` runs. Square GEMMs from 256 to
16384 are timed too: the points a profile's curve holds. The host issues each call in about
10 us (an H200's host), so a GEMM shorter than that is timed at the host's pace: a call
under ``HOST_S`` is counted in the table (an upper bound of its device time; ``autopar
calibrate`` times small GEMMs queued behind long ones instead, for the curve's low end).

Predicted: ``cost_models.compute.compute_time`` of ``aten.mm`` on those shapes with the
profile, the device's time (the curve's rate, the memory roof, the per-kernel floor).

The table gives, for each model, dtype, tokens and TP degree, one layer's GEMMs summed
(what a step pays per layer) and the head's, predicted against measured, and the worst
single GEMM. ``--check`` fails where a sum is off by more than ``TARGET``. ``--save`` writes the
measurements as JSON; ``--load`` judges saved measurements (made on a GPU) on a machine
without one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from autopar.cost_models.compute import compute_time
from autopar.cost_models.devices import get_profile, load_profile

from common import print_header

TARGET = 0.15
ROUNDS = 5
RUN_S = 20e-3
HOST_S = 15e-6

# name: (hidden, kv width, ffn, vocab); Llama's attention is q, k, v and o, GPT's a fused qkv
MODELS = {
    "Llama-3-8B": (4096, 1024, 14336, 128256),
    "GPT-3-like": (12288, 12288, 49152, 50304),
    "Llama-3.2-1B": (2048, 512, 8192, 128256),
}
TOKENS = (2048, 4096, 16384)
TP = (1, 2, 4, 8)
SQUARE = (256, 512, 1024, 2048, 4096, 8192, 16384)
FP32_MODELS = ("Llama-3.2-1B",)


def linears(model: str, tp: int) -> list[tuple[str, int, int]]:
    """``(name, in, out)`` of one layer's linears on one rank of ``tp``, and the head."""
    h, kv, f, v = MODELS[model]
    gated = model.startswith("Llama")
    out = [("q", h, h // tp), ("kv", h, 2 * kv // tp)] if gated else [("qkv", h, 3 * h // tp)]
    out.append(("o", h // tp, h))
    out += [("gate+up", h, 2 * f // tp)] if gated else [("fc1", h, f // tp)]
    out.append(("down", f // tp, h))
    out.append(("head", h, v // tp))
    return out


def gemms(tokens: int, fan_in: int, fan_out: int) -> list[tuple[str, int, int, int]]:
    """``(role, m, k, n)`` of a linear's three GEMMs: ``[m, k] @ [k, n]``."""
    return [
        ("forward", tokens, fan_in, fan_out),
        ("input grad", tokens, fan_out, fan_in),
        ("weight grad", fan_out, tokens, fan_in),
    ]


def _operands(role: str, m: int, k: int, n: int, dtype: torch.dtype):
    """The two operands in the layout the traced step calls ``mm`` with (module docstring)."""
    kw = dict(device="cuda", dtype=dtype)
    if role == "forward":  # x @ W.t(), W [n, k]
        return torch.randn(m, k, **kw), torch.randn(n, k, **kw).t()
    if role == "weight grad":  # dy.t() @ x, dy [k, m]
        return torch.randn(k, m, **kw).t(), torch.randn(k, n, **kw)
    return torch.randn(m, k, **kw), torch.randn(k, n, **kw)  # dy @ W, and square ones


def time_mm(a: torch.Tensor, b: torch.Tensor) -> float:
    """Seconds of one ``a @ b`` on the device's clock (the module docstring's runs)."""
    out = torch.mm(a, b)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.mm(a, b, out=out)
    end.record()
    torch.cuda.synchronize()
    calls = max(3, min(200, int(RUN_S / max(start.elapsed_time(end) * 1e-3, 1e-7))))
    runs = []
    for _ in range(ROUNDS):
        start.record()
        for _ in range(calls):
            torch.mm(a, b, out=out)
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) * 1e-3 / calls)
    return statistics.median(runs)


def cases() -> list[dict]:
    """Every GEMM to time, once each (layers share shapes), and the layers that run them."""
    out = []
    for dtype in ("bfloat16", "float32"):
        for n in SQUARE:
            out.append({"dtype": dtype, "role": "square", "m": n, "k": n, "n": n})
        for model in MODELS:
            if dtype == "float32" and model not in FP32_MODELS:
                continue
            for tokens in TOKENS:
                for tp in TP:
                    for name, fan_in, fan_out in linears(model, tp):
                        for role, m, k, n in gemms(tokens, fan_in, fan_out):
                            out.append(
                                {"dtype": dtype, "model": model, "tokens": tokens, "tp": tp,
                                 "linear": name, "role": role, "m": m, "k": k, "n": n}
                            )  # fmt: skip
    return out


def measure(todo: list[dict], machine: str, save: str | None) -> list[dict]:
    """``todo`` with each GEMM's measured seconds (``"s"``), each shape timed once; those
    measured so far written to ``save`` as they come (a run cut short keeps them)."""
    seen: dict[tuple, float] = {}
    for i, c in enumerate(todo):
        if save and i % 100 == 99:
            Path(save).write_text(json.dumps({"machine": machine, "rows": todo[:i]}))
        key = (c["dtype"], c["role"], c["m"], c["k"], c["n"])
        if key not in seen:
            a, b = _operands(c["role"], c["m"], c["k"], c["n"], getattr(torch, c["dtype"]))
            seen[key] = time_mm(a, b)
            del a, b
        c["s"] = seen[key]
    return todo


def predicted(profile, c: dict) -> float:
    """Seconds the profile prices GEMM ``c`` at (``compute_time`` of ``aten.mm``)."""
    m, k, n = c["m"], c["k"], c["n"]
    size = torch.Size
    return compute_time(
        profile,
        torch.ops.aten.mm.default,
        (size([m, k]), size([k, n])),
        {},
        size([m, n]),
        getattr(torch, c["dtype"]),
    )


def table(rows: list[dict], profile) -> list:
    """Print the square GEMMs' table and the layers' and heads'; the sums off by more than
    ``TARGET``."""
    print("\nSquare GEMMs (the points a profile's curve holds):\n")
    print("| dtype | n | measured TFLOP/s | predicted TFLOP/s | predicted / measured |")
    print("|---|---|---|---|---|")
    for c in rows:
        if c["role"] == "square":
            flops = 2.0 * c["m"] * c["k"] * c["n"]
            p = predicted(profile, c)
            print(
                f"| {c['dtype']} | {c['m']} | {flops / c['s'] / 1e12:.0f} | "
                f"{flops / p / 1e12:.0f} | {p / c['s']:.2f} |"
            )
    layers: dict[tuple, list[dict]] = {}
    for c in rows:
        if c["role"] != "square":
            part = "head" if c["linear"] == "head" else "layer"
            key = (c["model"], c["dtype"], c["tokens"], c["tp"], part)
            layers.setdefault(key, []).append(c)
    print(
        "\nOne layer's GEMMs, and the head's, each summed (forward, input grad, weight grad "
        "of each linear):\n"
    )
    print(
        "| model | dtype | tokens | tp | part | GEMMs | under 15 us | measured ms | predicted ms | predicted / "
        "measured | measured TFLOP/s | worst GEMM (m x k x n, role): predicted / measured |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    misses = []
    for (model, dtype, tokens, tp, part), cs in layers.items():
        measured = sum(c["s"] for c in cs)
        pred = [predicted(profile, c) for c in cs]
        flops = sum(2.0 * c["m"] * c["k"] * c["n"] for c in cs)
        ratio = sum(pred) / measured
        worst_c, worst = max(zip(cs, pred), key=lambda x: abs(x[1] / x[0]["s"] - 1))
        if abs(ratio - 1) > TARGET:
            misses.append((model, dtype, tokens, tp, part, round(ratio, 3)))
        print(
            f"| {model} | {dtype} | {tokens} | {tp} | {part} | {len(cs)} | "
            f"{sum(c['s'] < HOST_S for c in cs)} | {measured * 1e3:.3f} | "
            f"{sum(pred) * 1e3:.3f} | {ratio:.2f} | {flops / measured / 1e12:.0f} | "
            f"{worst_c['m']}x{worst_c['k']}x{worst_c['n']} {worst_c['linear']} "
            f"{worst_c['role']}: {worst / worst_c['s']:.2f} |"
        )
    return misses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="h100", help="a profile's name or JSON file")
    ap.add_argument("--save", help="write the measurements to this JSON file")
    ap.add_argument("--load", help="judge the measurements in this JSON file (no GPU needed)")
    ap.add_argument(
        "--check",
        action="store_true",
        help=f"fail where a layer's or head's sum is off by >{TARGET:.0%}%",
    )
    args = ap.parse_args(argv)
    profile = (
        load_profile(args.profile) if args.profile.endswith(".json") else get_profile(args.profile)
    )
    if args.load:
        saved = json.loads(Path(args.load).read_text())
        machine, rows = saved["machine"], saved["rows"]
    elif torch.cuda.is_available():
        machine = f"{torch.cuda.get_device_name()}; torch {torch.__version__}"
        rows = measure(cases(), machine, args.save)
        if args.save:
            Path(args.save).write_text(json.dumps({"machine": machine, "rows": rows}))
    else:
        raise SystemExit("no CUDA device here: measure on a GPU, or --load saved measurements")
    print_header(
        f"measured on {machine}; profile {profile.name}; the median of {ROUNDS} runs of "
        f"calls between CUDA events",
        ["what", "value"],
    )
    print(
        f"| GEMMs timed | {len({(c['dtype'], c['role'], c['m'], c['k'], c['n']) for c in rows})} |"
    )
    misses = table(rows, profile)
    if args.check and misses:
        print(
            f"\nFAIL: a layer's or head's GEMMs predicted off by more than {TARGET:.0%}: {misses}"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

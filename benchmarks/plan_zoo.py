"""How autopar plans each family of the zoo at a moderate size: a markdown table.

    python benchmarks/plan_zoo.py [--models qwen2,t5] [--device h100] [--check]

Every zoo example (``autopar.models.EXAMPLES``, less the at-scale ``llama3-8b`` and
``gpt3``) is built on the meta device (no weights) at the size ``MODERATE`` gives it (for
the language models hidden 1024, 4 layers, vocab 32000, sequence 1024, the LSTM's sequence
32; ViT and ResNet on 224x224 images; batch 8) and
planned with ``autopar.cli.plan_example`` on mesh 2x4, axes (dp, tp), with the device
profile ``--device``. One row per model:

- plan: ``ok``, or the first line of the error (a model that fails is reported, the others
  still run);
- % weights S over tp / dp: the weight bytes of the parameters whose placement on that axis
  is a Shard, over all weight bytes (a tied parameter counted once);
- no-rule ops: how many nodes are replicated for lack of a sharding rule
  (``plan.fallback_nodes``), and their distinct op names;
- solver: the solver's status (``plan.solver_status``);
- plan s: wall seconds of ``plan_example`` (build on meta, trace, search).

Under the table, per model, the module paths of the no-rule ops (layer numbers as ``*``)
and the other warnings planning raised (first line, deduplicated).

``--check`` exits 1 when a transformer family (every model but ``NOT_TRANSFORMERS``) fails
to plan or has a no-rule op: the design's target is none there.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
import time
import warnings
from collections import Counter

import autopar
from autopar.cli import plan_example
from autopar.models import EXAMPLES

from common import print_header

MESH = ((2, 4), ("dp", "tp"))
BATCH = 8

_LM = {"layers": 4, "hidden": 1024, "vocab": 32000, "seq": 1024}
_GQA = {**_LM, "heads": 16, "kv_heads": 8, "ffn": 4096}
MODERATE: dict[str, dict] = {
    "mlp": {"d_in": 1024, "d_hidden": 1024, "d_out": 1024, "n_layers": 4},
    "gpt": {**_LM, "heads": 16, "ffn": 4096},
    "gpt-tied": {**_LM, "heads": 16, "ffn": 4096},
    "hf-gpt2": {**_LM, "heads": 16},
    "hf-llama": _GQA,
    "llama-bf16": _GQA,
    "qwen2": _GQA,
    "mistral": _GQA,  # sliding window 512
    "gemma2": _GQA,  # sliding window 512 on alternate layers
    "mixtral": {**_GQA, "ffn": 2048, "experts": 4, "top_k": 2},
    "qwen2-moe": {**_GQA, "ffn": 2048, "experts": 4, "top_k": 2, "expert_ffn": 1024},
    "bert": {**_LM, "heads": 16, "ffn": 4096},
    "t5": {**_LM, "heads": 16, "ffn": 4096},
    "vit": {
        "layers": 4,
        "hidden": 1024,
        "heads": 16,
        "ffn": 4096,
        "image": 224,
        "patch": 16,
        "classes": 1000,
    },
    "resnet": {"widths": (64, 128, 256, 512), "image": 224, "classes": 1000},
    # the trace unrolls the LSTM over time (about 120 nodes per step, none folded): 3,900
    # nodes and a minute at sequence 32; at 1024 planning would not fit in 24 GiB
    "lstm": {"layers": 2, "hidden": 1024, "vocab": 32000, "seq": 32},
}
"""Per example, the factory's size arguments for the moderate size."""

NOT_TRANSFORMERS = {"mlp", "resnet", "lstm"}
"""The families ``--check`` leaves out."""


def moderate(name: str) -> str:
    """Registers ``name``'s factory at its moderate size on the meta device, for
    ``plan_example``; returns the name it is registered under."""
    key = f"{name}@moderate"
    EXAMPLES[key] = functools.partial(EXAMPLES[name], device="meta", **MODERATE[name])
    return key


def weight_bytes(name: str) -> dict[str, int]:
    """``{parameter name: bytes}`` of the moderate model, a tied parameter under its first
    name only."""
    model = EXAMPLES[moderate(name)](batch=BATCH)[0]
    return {n: p.numel() * p.element_size() for n, p in model.named_parameters()}


def sharded_share(plan, nbytes: dict[str, int]) -> list[float]:
    """Per mesh axis, the share of ``nbytes`` whose placement on that axis is a Shard."""
    total = sum(nbytes.values())
    shares = []
    for axis in range(plan.mesh.ndim):
        sharded = sum(
            b
            for n, b in nbytes.items()
            if plan.nodes[plan.params[n]].placement()[axis].startswith("S")
        )
        shares.append(sharded / total if total else 0.0)
    return shares


def first_line(text: str, limit: int = 160) -> str:
    line = (text.strip().splitlines() or [""])[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


def plan_one(name: str, mesh) -> tuple[list[str], list[str], bool]:
    """The table row of ``name``, its notes, and whether it meets the check's target."""
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            nbytes = weight_bytes(name)
            plan = plan_example(moderate(name), mesh, batch=BATCH, verbose=True)
        except Exception as exc:  # one model's failure is a row, not the end of the run
            seconds = time.perf_counter() - t0
            err = f"{type(exc).__name__}: {first_line(str(exc))}"
            row = [name, f"error: {err.replace('|', '/')}", "", "", "", "", "", f"{seconds:.1f}"]
            head = "\n  ".join(str(exc).strip().splitlines()[:4])
            return row, [f"{name}: {type(exc).__name__}: {head}"], False
    seconds = time.perf_counter() - t0
    tp, dp = (sharded_share(plan, nbytes)[plan.mesh.axis_names.index(a)] for a in ("tp", "dp"))
    ops = Counter(plan.nodes[n].op for n in plan.fallback_nodes)
    row = [
        name,
        "ok",
        f"{100 * tp:.1f}",
        f"{100 * dp:.1f}",
        str(len(plan.fallback_nodes)),
        ", ".join(f"{op} x{k}" for op, k in sorted(ops.items())) or "-",
        plan.solver_status or "?",
        f"{seconds:.1f}",
    ]
    notes = []
    where = Counter(
        (plan.nodes[n].op, re.sub(r"\.\d+(?=\.|$)", ".*", plan.nodes[n].module))
        for n in plan.fallback_nodes
    )
    for (op, module), k in sorted(where.items()):
        notes.append(f"{name}: no rule for {op} x{k} at {module or '<top level>'}")
    seen = Counter(
        f"{w.category.__name__}: {first_line(str(w.message))}"
        for w in caught
        if w.category.__name__ != "NoRuleWarning"
    )
    notes += [f"{name}: {msg}" + (f" (x{k})" if k > 1 else "") for msg, k in seen.items()]
    return row, notes, not plan.fallback_nodes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="h100", help="device profile")
    ap.add_argument("--models", default=",".join(MODERATE), help="comma list of zoo names")
    ap.add_argument(
        "--check",
        action="store_true",
        help="exit 1 if a transformer family fails to plan or has an op without a rule",
    )
    args = ap.parse_args()
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODERATE]
    if unknown:
        ap.error(f"no moderate size for {unknown}; known: {', '.join(MODERATE)}")
    shape, axes = MESH
    mesh = autopar.Mesh(shape, axes, device=args.device)
    print_header(
        f"profile {args.device}; mesh {'x'.join(map(str, shape))} {axes}; batch {BATCH}; "
        "moderate sizes, on the meta device",
        [
            "model",
            "plan",
            "% weights S over tp",
            "% weights S over dp",
            "no-rule ops",
            "no-rule op names",
            "solver",
            "plan s",
        ],
    )
    all_notes, failed = [], []
    for name in names:
        row, notes, good = plan_one(name, mesh)
        print("| " + " | ".join(row) + " |", flush=True)
        all_notes += notes
        if not good and name not in NOT_TRANSFORMERS:
            failed.append(name)
    if all_notes:
        print()
        for note in all_notes:
            print(f"- {note}")
    if args.check:
        print()
        if failed:
            print(f"check failed: no-rule ops or no plan on {', '.join(failed)}")
            return 1
        print("check passed: every transformer family planned with no no-rule op")
    return 0


if __name__ == "__main__":
    sys.exit(main())

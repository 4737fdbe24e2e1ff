"""The zoo against one device on gloo: the worst relative error per case, a markdown table.

    python benchmarks/zoo_numerics.py [--models qwen2,t5] [--meshes 2x2] [--check]

The cases are the zoo test's (``tests/distributed/test_zoo_numerics.py``: mesh, dtype,
memory budget as a fraction of one device, the reference dtype of a bf16 run), slow ones
included; each runs ``autopar.verify.verify`` for 3 AdamW steps. One row per case:

- plan: ``ok`` or the first line of the error;
- % weights S over each axis: the weight bytes whose placement on that axis is a Shard;
- no-rule ops: nodes replicated for lack of a sharding rule (``plan.fallback_nodes``);
- loss / grad / param: the worst relative error over ranks and steps of the loss, of the
  first step's gradients and of the parameters after 3 steps (``VerifyReport``);
- tolerance: the test's (loss, grad, param) bound for the case's dtype.

``--check`` exits 1 when a case errs, has a no-rule op, or misses its test's tolerance.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

from autopar import Plan
from autopar.verify import build_example, verify

from common import print_header

_TEST = Path(__file__).resolve().parent.parent / "tests/distributed/test_zoo_numerics.py"


def zoo_cases() -> list[tuple]:
    """The zoo test's cases (its module read by path: the tests are not a package)."""
    spec = importlib.util.spec_from_file_location("zoo_numerics_cases", _TEST)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return list(mod.CASES)


def shard_share(example: str, plan: Plan) -> list[float]:
    """Per mesh axis, the % of weight bytes whose placement there is a Shard (a tied
    weight counted once)."""
    model = build_example(example)[0]
    sizes = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        sizes.setdefault(id(p), (name, p.numel()))
    total = sum(n for _, n in sizes.values())
    sharded = [0] * len(plan.mesh.shape)
    for name, n in sizes.values():
        for axis, p in enumerate(plan.param_placements[name]):
            if str(p).startswith("S"):
                sharded[axis] += n
    return [100.0 * s / max(total, 1) for s in sharded]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="", help="comma list of zoo names (default: all)")
    ap.add_argument("--meshes", default="", help="comma list such as 2,2x2 (default: all)")
    ap.add_argument("--check", action="store_true", help="exit 1 on a case off its tolerance")
    args = ap.parse_args()
    models = set(filter(None, args.models.split(",")))
    meshes = {tuple(int(x) for x in m.split("x")) for m in filter(None, args.meshes.split(","))}
    cases = [
        c
        for c in zoo_cases()
        if (not models or c[0] in models) and (not meshes or tuple(c[1]) in meshes)
    ]
    print_header(
        "gloo, 3 AdamW steps against one device",
        [
            "model",
            "mesh",
            "dtype",
            "plan",
            "% S per axis",
            "no-rule ops",
            "loss",
            "grad",
            "param",
            "tolerance",
            "s",
        ],  # fmt: skip
    )
    failed = []
    for example, mesh, axes, dtype, fraction, tol, ref_dtype in cases:
        label = f"{example} {'x'.join(map(str, mesh))}"
        t0 = time.perf_counter()
        try:
            reports = verify(
                example, mesh, axes, steps=3, dtype=dtype, memory_fraction=fraction,
                ref_dtype=ref_dtype,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a failing case is a row, the others run
            line = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
            print(f"| {example} | {'x'.join(map(str, mesh))} | {dtype} | error: {line} |"
                  " | | | | | | |")  # fmt: skip
            failed.append(label)
            continue
        seconds = time.perf_counter() - t0
        plan = Plan.from_json(reports[0].plan_json)
        loss = max(rel(a, b) for r in reports for a, b in zip(r.losses, r.ref_losses))
        grad = max(r.grad_rel_err for r in reports)
        param = max(r.param_rel_err for r in reports)
        share = " / ".join(f"{a} {s:.0f}" for a, s in zip(axes, shard_share(example, plan)))
        norule = len(plan.fallback_nodes)
        print(
            f"| {example} | {'x'.join(map(str, mesh))} | {dtype}"
            f"{'' if ref_dtype is None else ' vs ' + ref_dtype} | ok | {share} | {norule} "
            f"| {loss:.1e} | {grad:.1e} | {param:.1e} | {' / '.join(f'{t:.0e}' for t in tol)} "
            f"| {seconds:.0f} |",
            flush=True,
        )
        if norule or loss > tol[0] or grad > tol[1] or param > tol[2]:
            failed.append(label)
    if failed:
        print(f"\noff tolerance, failed or replicated for want of a rule: {', '.join(failed)}")
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Plans of the zoo, byte for byte: a change of structure must not change a plan.

Each case plans a zoo example from the meta device and compares the plan's JSON (timings
left out, as ``Plan.to_json`` does) with the file committed under ``tests/golden/``. A
change that is meant to change plans (a new rule, a new cost term) regenerates them, and
says so in its commit:

    python tests/unit/test_golden_plans.py --regenerate

The files are gzipped. They are made with the pinned torch (``versions`` in each) and, for
the ``hf-*`` examples, the ``transformers`` named in ``tests/golden/VERSIONS.json`` (the
package is not pinned: users take the newest, and a release may build a model's masks with
other ops). On another torch, or another transformers for its models, the placements and
the estimated cost (within 5%) must match, and the whole plan where the traced graph is the
same.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

import autopar
from autopar.cli import plan_example

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
# the versions of what the zoo's models come from, beside the plans' own ``versions``
LIBRARIES = GOLDEN / "VERSIONS.json"

# (example, mesh shape, axis names, device profile, memory fraction, fold)
CASES = [
    ("mlp", (2,), ("dp",), "h100", None, True),
    ("mlp", (2, 2), ("dp", "tp"), "h100", 0.5, True),
    ("gpt", (2,), ("dp",), "h100", None, True),
    ("gpt", (2, 2), ("dp", "tp"), "h100", None, True),
    ("gpt", (2, 2), ("dp", "tp"), "cpu", 0.5, True),
    ("gpt", (4,), ("dp",), "h100", 0.25, False),
    ("hf-gpt2", (2, 2), ("dp", "tp"), "h100", 0.5, True),
    ("hf-llama", (2, 2), ("dp", "tp"), "h100", None, True),
]


def _name(case) -> str:
    example, shape, _, device, fraction, fold = case
    mesh = "x".join(map(str, shape))
    budget = "" if fraction is None else f"-mem{fraction}"
    return f"{example}-{mesh}-{device}{budget}{'' if fold else '-nofold'}.json.gz"


def _libraries() -> dict[str, str]:
    import transformers

    return {"transformers": transformers.__version__}


def _drift(case, plan: dict, golden: dict) -> str | None:
    """What differs from the golden's making that may change the trace, or None."""
    if plan["versions"]["torch"] != golden["versions"]["torch"]:
        return f"torch {plan['versions']['torch']} (golden: {golden['versions']['torch']})"
    if case[0].startswith("hf-"):
        want = json.loads(LIBRARIES.read_text())["transformers"]
        have = _libraries()["transformers"]
        if have != want:
            return f"transformers {have} (golden: {want})"
    return None


def _plan_json(case) -> str:
    example, shape, axes, device, fraction, fold = case
    mesh = autopar.Mesh(shape, axes, device=device)
    return plan_example(example, mesh, memory_fraction=fraction, fold=fold).to_json()


def _param(case):
    # the budget-bound cases: the newer torch's CI run leaves them to the pinned run, for
    # its time (the other cases check there that both versions give the same plans)
    fraction = case[4]
    marks = [pytest.mark.pinned_torch_only] if fraction is not None else []
    return pytest.param(case, id=_name(case), marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_plan_equals_the_committed_plan(case):
    path = GOLDEN / _name(case)
    want = gzip.decompress(path.read_bytes()).decode()
    got = _plan_json(case)
    a, b = json.loads(got), json.loads(want)
    drift = _drift(case, a, b)
    if drift is not None:
        # another torch (CI also runs the newest): its DTensor rules offer other candidate
        # sets and its trace may differ by a few nodes; another transformers may build the
        # same model with other ops (its masks). The solver's statistics, the graph and the
        # memory timeline's order may change; the decisions a user sees must not
        for key in ("params", "buffers", "inputs"):
            assert a[key] == b[key], f"{path.name}: {key} placements changed on {drift}"
        assert a["cost"]["total_s"] == pytest.approx(b["cost"]["total_s"], rel=0.05)
        if a["fingerprint"] == b["fingerprint"]:  # the same graph: the same plan
            for key in set(a) - {"stats", "versions", "cost"}:
                assert a[key] == b[key], f"{path.name}: {key} changed on {drift}"
            # the same terms, summed in another order (2.14.1: a difference of 1e-17 s)
            for term, value in a["cost"].items():
                assert value == pytest.approx(b["cost"][term], rel=1e-9), f"{path.name}: {term}"
        return
    if got != want:
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        pytest.fail(f"{path.name}: the plan changed in {diff}")


def _regenerate() -> None:
    GOLDEN.mkdir(exist_ok=True)
    for case in CASES:
        path = GOLDEN / _name(case)
        # mtime=0: the same plan gives the same bytes
        path.write_bytes(gzip.compress(_plan_json(case).encode(), mtime=0))
        print(f"wrote {path}")
    LIBRARIES.write_text(json.dumps(_libraries(), indent=1) + "\n")
    print(f"wrote {LIBRARIES}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit("usage: python tests/unit/test_golden_plans.py --regenerate")
    _regenerate()

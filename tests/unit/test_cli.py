import textwrap

import pytest

from autopar.cli import main

pytestmark = pytest.mark.pinned_torch_only


def test_plan_builtin_example_prints_the_table(capsys, tmp_path):
    out_path = tmp_path / "plan.json"
    assert main(["plan", "mlp", "--mesh", "2", "--out", str(out_path)]) == 0
    out = capsys.readouterr().out
    assert "autopar plan for Mesh(dp=2; h100)" in out
    assert "layers.0.weight" in out and "estimated step time" in out
    from autopar import Plan

    assert Plan.load(out_path).mesh.shape == (2,)


def test_plan_model_from_a_file(capsys, tmp_path):
    src = tmp_path / "my_model.py"
    src.write_text(
        textwrap.dedent("""
        import torch
        from torch import nn

        def factory(batch=8):
            model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
            x, y = torch.randn(batch, 8), torch.randn(batch, 4)
            return model, (x,), nn.functional.mse_loss, (y,)
    """)
    )
    assert main(["plan", f"{src}:factory", "--mesh", "2x2", "--axes", "dp,tp"]) == 0
    out = capsys.readouterr().out
    assert "Mesh(dp=2, tp=2; h100)" in out and "0.weight" in out


def test_unknown_model_is_a_clear_error(capsys):
    assert main(["plan", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and "gpt" in err


def test_plan_reports_what_was_folded_and_no_fold_turns_it_off(capsys):
    assert main(["plan", "gpt", "--mesh", "2"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    # each stage says so as it ends (stderr): a long plan is not silent
    for stage in ("trace", "fold", "strategies", "solve"):
        assert f"autopar: {stage}" in captured.err, captured.err
    assert "folded: " in out and "2 x " in out and "blocks.{0,1}" in out
    assert main(["plan", "gpt", "--mesh", "2", "--no-fold"]) == 0
    assert "folded: " not in capsys.readouterr().out


def test_version(capsys):
    import autopar

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"autopar {autopar.__version__}"


def test_plan_help_lists_the_built_in_models(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "qwen2" in out and "llama3-8b" in out and "file.py:factory" in out


def test_bad_input_is_a_one_line_error(capsys, tmp_path):
    src = tmp_path / "models.py"
    src.write_text(
        "def other(batch=8):\n    return 1, 2\n\n"
        "def needs_hf(batch=8):\n    raise ModuleNotFoundError(name='transformers')\n"
    )
    cases = [
        ([f"{src}:factory"], "has no function 'factory'; its functions: ['needs_hf', 'other']"),
        ([f"{src}:needs_hf"], "needs the 'transformers' package: pip install 'autopar[hf]'"),
        ([f"{src}:other"], "returned 2 values; it must return (model, example_inputs"),
        ([f"{tmp_path / 'missing.py'}:f"], "missing.py: no such file"),
    ]
    for args, message in cases:
        assert main(["plan", *args, "--mesh", "2"]) == 2
        err = capsys.readouterr().err
        assert message in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_memory_budget_must_be_positive(capsys):
    for budget in ("0", "-5"):
        with pytest.raises(SystemExit) as e:
            main(["plan", "mlp", "--memory-budget-mib", budget])
        assert e.value.code == 2
        assert "must be > 0" in capsys.readouterr().err


def test_a_corrupt_plan_file_names_the_file(tmp_path):
    from autopar import Plan

    path = tmp_path / "corrupt.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="corrupt.json does not hold an autopar plan"):
        Plan.load(path)


def test_show_prints_a_saved_plan_as_tables(capsys, tmp_path):
    import gzip
    import re
    from pathlib import Path

    from autopar import Plan
    from autopar.show import layer_groups

    golden = Path(__file__).resolve().parent.parent / "golden" / "gpt-2x2-cpu-mem0.5.json.gz"
    path = tmp_path / "plan.json"
    path.write_bytes(gzip.decompress(golden.read_bytes()))
    plan = Plan.load(path)
    assert main(["show", str(path), "--width", "200"]) == 0
    out = capsys.readouterr().out
    # the two layers' parameters are one row each, with their count and placements
    groups = layer_groups(plan)
    assert sum(count for _, count, _, _ in groups) == len(plan.params)
    (q,) = [g for g in groups if g[0] == "blocks.{0..1}.attn.q.weight"]
    assert q[1] == 2 and q[3] == plan.nodes[plan.params["blocks.0.attn.q.weight"]].placement()
    assert re.search(
        r"blocks\.\{0\.\.1\}\.attn\.q\.weight\s+2\s+64x64\s+"
        + r"\s+".join(re.escape(p) for p in q[3]),
        out,
    )
    # the memory table's peak and budget are the plan's
    step = plan.memory["step"]
    assert re.search(rf"peak\s+{step['peak_bytes'] / 2**20:,.2f}\s+100.0%", out)
    assert re.search(rf"budget\s+{plan.stats['memory_budget'] / 2**20:,.2f}", out)
    # every predicted collective is counted once
    counts = [
        int(m) for m in re.findall(r"(?:gradient reduction|reshard)\s+\w+\s+\w+\s+(\d+)", out)
    ]
    assert sum(counts) == len(plan.collectives)
    assert f"{plan.cost['total_s'] * 1e3:.4f}" in out


def test_layer_patterns_keep_apart_layers_placed_differently():
    import dataclasses
    import gzip
    from pathlib import Path

    from autopar import Plan
    from autopar.core.plan import index_ranges
    from autopar.show import layer_groups

    golden = Path(__file__).resolve().parent.parent / "golden" / "gpt-2x2-cpu-mem0.5.json.gz"
    plan = Plan.from_json(gzip.decompress(golden.read_bytes()).decode())
    node = plan.params["blocks.1.attn.q.weight"]
    other = next(p for p in (("R", "S(0)"), ("S(0)", "R")) if p != plan.nodes[node].out[0])
    plan.nodes[node] = dataclasses.replace(plan.nodes[node], out=(other,))
    names = [g[0] for g in layer_groups(plan)]
    assert "blocks.0.attn.q.weight" in names and "blocks.1.attn.q.weight" in names
    assert "blocks.{0..1}.attn.k.weight" in names
    assert index_ranges([0, 1, 2, 5, 7, 8]) == "0..2,5,7..8"
    assert index_ranges([3]) == "3"


def _golden(tmp_path, name: str):
    import gzip
    from pathlib import Path

    golden = Path(__file__).resolve().parent.parent / "golden" / f"{name}.json.gz"
    path = tmp_path / f"{name}.json"
    path.write_bytes(gzip.decompress(golden.read_bytes()))
    return path


def test_diff_names_the_choices_that_differ_and_their_cost(capsys, tmp_path):
    import json

    from autopar import Plan
    from autopar.diff import diff_plans

    a_path = _golden(tmp_path, "gpt-2x2-h100")
    b_path = _golden(tmp_path, "gpt-2x2-cpu-mem0.5")
    a, b = Plan.load(a_path), Plan.load(b_path)
    d = diff_plans(a, b)
    assert d["same_graph"] and not d["identical"]
    # every parameter placed differently is in exactly one row, with both placements
    differing = {
        n for n, node in a.params.items() if a.placements_of(node) != b.placements_of(node)
    }
    assert differing and sum(r["count"] for r in d["parameters"]) == len(differing)
    name = sorted(differing)[0]
    row = next(
        r
        for r in d["parameters"]
        if r["a"] == list(a.nodes[a.params[name]].placement())
        and r["b"] == list(b.nodes[b.params[name]].placement())
    )
    assert row["count"] >= 1
    # the time and memory deltas are the plans' own numbers
    total = next(r for r in d["time_s"] if r["part"] == "total")
    assert total["a"] == a.cost["total_s"] and total["b"] == b.cost["total_s"]
    assert total["delta"] == b.cost["total_s"] - a.cost["total_s"]
    peak = next(r for r in d["memory_bytes"] if r["part"] == "peak")
    assert peak["b"] == b.memory["step"]["peak_bytes"]
    assert sum(r["count_b"] for r in d["collectives"]) == len(b.collectives)
    changed = sum(
        1
        for n, c in a.nodes.items()
        if c.op != "placeholder" and (c.out, c.ins) != (b.nodes[n].out, b.nodes[n].ins)
    )
    assert d["nodes_changed"] == changed > 0

    assert main(["diff", str(a_path), str(b_path), "--width", "200"]) == 0
    out = capsys.readouterr().out
    assert "parameters placed differently" in out and "estimated step time" in out
    assert f"{total['delta'] * 1e3:+,.4f}" in out
    assert main(["diff", str(a_path), str(b_path), "--exit-code", "-q"]) == 1
    assert capsys.readouterr().out == ""
    assert main(["diff", str(a_path), str(a_path), "--exit-code"]) == 0
    assert "the plans make the same choices" in capsys.readouterr().out
    assert main(["diff", str(a_path), str(b_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(d))


def test_diff_of_plans_for_other_models_compares_parameters_by_name(capsys, tmp_path):
    a_path = _golden(tmp_path, "mlp-2-h100")
    b_path = _golden(tmp_path, "gpt-2-h100")
    assert main(["diff", str(a_path), str(b_path), "--width", "200"]) == 0
    out = capsys.readouterr().out
    assert "different step graphs" in out and "parameters only in a: " in out


def test_every_command_takes_quiet_and_json(capsys, tmp_path):
    import json

    from autopar import Plan

    path = _golden(tmp_path, "gpt-2x2-cpu-mem0.5")
    assert main(["show", str(path), "-q"]) == 0
    assert capsys.readouterr() == ("", "")
    assert main(["show", str(path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert sum(r["count"] for r in shown["parameters"]) == len(Plan.load(path).params)
    assert main(["plan", "mlp", "--mesh", "2", "-q", "--out", str(tmp_path / "p.json")]) == 0
    assert capsys.readouterr() == ("", "")  # not even the stage lines
    assert Plan.load(tmp_path / "p.json").mesh.shape == (2,)
    assert main(["plan", "mlp", "--mesh", "2", "--json"]) == 0
    captured = capsys.readouterr()
    assert Plan.from_json(captured.out).mesh.shape == (2,)  # the plan itself
    assert "autopar: trace" not in captured.err
    with pytest.raises(SystemExit):
        main(["show", str(path), "-q", "--json"])  # one or the other
    capsys.readouterr()


def test_bad_plan_files_are_one_line_errors(capsys, tmp_path):
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    good = _golden(tmp_path, "mlp-2-h100")
    cases = [
        (["show", str(tmp_path / "missing.json")], "missing.json: no such file"),
        (["show", str(corrupt)], "corrupt.json does not hold an autopar plan"),
        (["diff", str(good), str(corrupt)], "corrupt.json does not hold an autopar plan"),
        (["diff", str(good), str(tmp_path / "nope.json")], "nope.json: no such file"),
        (["report", str(corrupt), "-o", str(tmp_path / "r.html")], "corrupt.json"),
        (["run", str(tmp_path / "no_script.py")], "no_script.py: no such file"),
        (["run", str(good), "--nproc", "two"], "--nproc must be a whole number"),
    ]
    for args, message in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert message in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_data_dependent_branch_is_one_line_naming_the_users_code(capsys, tmp_path):
    src = tmp_path / "branchy.py"
    src.write_text(
        textwrap.dedent("""
        import torch
        from torch import nn

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 8)

            def forward(self, x):
                y = self.lin(x)
                if y.sum() > 0:
                    y = y * 2
                return y

        def factory(batch=8):
            x, y = torch.randn(batch, 8), torch.randn(batch, 8)
            return M(), (x,), nn.functional.mse_loss, (y,)
    """)
    )
    assert main(["plan", f"{src}:factory", "--mesh", "2"]) == 2
    err = capsys.readouterr().err
    assert "def forward" not in err  # torch.export's partial graph is not printed
    (line,) = [ln for ln in err.splitlines() if ln.startswith("autopar plan:")]
    assert f"could not trace M at {src}:12 (if y.sum() > 0:)" in line


def test_progress_on_a_terminal_shows_stages_and_solver_rounds():
    import io

    from rich.console import Console

    from autopar import Mesh
    from autopar.cli import plan_example
    from autopar.verify import stage_progress

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=200)
    with stage_progress(True, console=console):
        plan_example("mlp", Mesh((2,), ("dp",)), memory_fraction=0.6)
    text = buf.getvalue()
    # the live line names the running stage; finished stages and solver rounds print above
    for stage in ("trace", "strategies", "solve"):
        assert f"autopar: {stage} ..." in text and f"autopar: {stage} " in text
    assert "autopar: solve round 1: " in text and "MiB per rank" in text
    with stage_progress(False, console=console):  # --quiet: nothing
        plan_example("mlp", Mesh((2,), ("dp",)))
    assert buf.getvalue() == text

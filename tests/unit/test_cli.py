import textwrap

from autopar.cli import main


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
    out = capsys.readouterr().out
    assert "folded: " in out and "2 x " in out and "blocks.{0,1}" in out
    assert main(["plan", "gpt", "--mesh", "2", "--no-fold"]) == 0
    assert "folded: " not in capsys.readouterr().out

"""The planning options: one ``PlanOptions`` made from the public API's keywords and the command
line's flags (passes/options), checked before anything runs."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar import PlanOptions, cli
from autopar.models import MLP, mse_loss
from autopar.passes.pipeline import check_skip


def test_the_keywords_of_the_api_make_the_options_fields():
    opts = PlanOptions.of(
        fold=False,
        bucket_mb=10,
        constraints={"fc1.weight": (Replicate(), Shard(0)), "input:0": "S(0), R"},
        skip=["order"],
        forbid=[[("mm", "R,S(1)")]],
        memory_budget=2**30,
    )
    assert opts.skip == frozenset({"order", "fold"}) and not opts.fold
    assert opts.bucket_bytes == 10 * 2**20
    assert opts.constraints == (("fc1.weight", "R,S(0)"), ("input:0", "S(0),R"))
    assert opts.forbid == ((("mm", "R,S(1)"),),)
    assert opts.memory_budget == 2**30
    # set on given options: the rest kept
    again = PlanOptions.of(opts, optimizer="sgd")
    assert again.optimizer == "sgd" and again.constraints == opts.constraints
    assert PlanOptions.of() == PlanOptions() and PlanOptions().fold


@pytest.mark.parametrize(
    "knobs, error, said",
    [
        (dict(memry_budget=1), TypeError, "unknown planning option(s) ['memry_budget']"),
        (dict(bucket_mb=1, bucket_bytes=1), TypeError, "not both"),
        (dict(memory_budget=0), ValueError, "positive number of bytes"),
        (dict(memory_budget=1, memory_fraction=0.5), ValueError, "not both"),
        (dict(optimizer="lion"), ValueError, "optimizer 'lion'"),
        (dict(time_limit_s=0), ValueError, "time_limit_s must be > 0"),
        (dict(constraints={"w": "S(x)"}), ValueError, "is not placements"),
    ],
)
def test_bad_options_are_refused_with_what_is_wrong(knobs, error, said):
    with pytest.raises(error) as e:
        PlanOptions.of(**knobs)
    assert said in str(e.value)


def test_skip_names_only_skippable_stages():
    check_skip({"fold", "order", "buckets", "prefetch", "memory"})
    with pytest.raises(ValueError, match=r"unknown stage\(s\) \['folding'\]"):
        check_skip({"folding"})
    with pytest.raises(ValueError, match=r"stage\(s\) \['solve'\] cannot be skipped"):
        check_skip({"solve"})


def test_the_api_refuses_a_bad_option_before_tracing():
    model = MLP(8, 16, 4)
    x, y = torch.zeros(2, 8), torch.zeros(2, 4)
    traced = []

    def loss_fn(out, target):  # (the trace calls it: it must not be reached)
        traced.append(True)
        return mse_loss(out, target)

    mesh = autopar.Mesh((2,), ("dp",))
    with pytest.raises(TypeError, match="memry_budget"):
        autopar.plan(model, mesh, (x,), loss_fn=loss_fn, example_targets=(y,), memry_budget=1)
    with pytest.raises(ValueError, match="cannot be skipped"):
        autopar.plan(model, mesh, (x,), loss_fn=loss_fn, example_targets=(y,), skip={"trace"})
    assert not traced


def test_each_planning_flag_sets_its_option():
    """A planning option on the command line is one entry of ``cli.PLAN_FLAGS``: each sets
    a keyword ``PlanOptions.of`` takes, and the flags parse into the options they name."""
    names = {f.name for f in PlanOptions.__dataclass_fields__.values()} | {"fold", "bucket_mb"}
    assert {f.knob for f in cli.PLAN_FLAGS} <= names
    args = cli.parser().parse_args(
        ["plan", "gpt", "--no-fold", "--no-checkpointing", "--memory-budget-mib", "100"]
    )
    opts = PlanOptions.of(**cli._plan_knobs(args))
    assert opts == PlanOptions(
        skip=frozenset({"fold"}), checkpointing=False, memory_budget=100 * 2**20
    )
    default = PlanOptions.of(**cli._plan_knobs(cli.parser().parse_args(["plan", "gpt"])))
    assert default == PlanOptions()
    fraction = cli.parser().parse_args(["plan", "gpt", "--memory-fraction", "0.5"])
    assert PlanOptions.of(**cli._plan_knobs(fraction)).memory_fraction == 0.5

"""autopar calibrate: the link fit recovers a known link, and the command measures this
machine into a profile that plan takes."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

import autopar
from autopar.calibrate import (
    KINDS,
    fit_link,
    host_table,
    kind_scales,
    link_errors,
    measure_host_ops,
    median_of_means,
)
from autopar.calibration.host import _profiled_ops
from autopar.cli import main
from autopar.core import Collective, Mesh
from autopar.cost_models import (
    KERNEL_KINDS,
    PROFILES,
    collective_time,
    collectives_time,
    load_profile,
    register_profile,
)
from autopar.models import EXAMPLES


def _samples(overhead, latency, bandwidth, ranks=(2, 4)):
    return [
        (
            kind,
            n,
            float(nbytes),
            collective_time(kind, nbytes, n, latency, bandwidth, overhead=overhead),
        )
        for kind in KINDS
        for n in ranks
        for nbytes in (2**10, 2**14, 2**18, 2**22)
    ]


def test_a_call_costs_its_frequent_ticks_but_not_a_rare_stall():
    # gloo on a VM: a 0.5 ms collective takes a 4 ms scheduler tick one call in four, and
    # one call in the whole run waits 150 ms on a page reclaim
    calls = [4e-3 if i % 4 == 3 else 0.5e-3 for i in range(100)]
    calls[37] = 0.15
    per_call = median_of_means(calls)
    assert per_call == pytest.approx((3 * 0.5e-3 + 4e-3) / 4, rel=0.01)  # the ticks' mean
    assert per_call > 2 * sorted(calls)[50]  # a median would leave the ticks out
    assert per_call < sum(calls) / len(calls) / 1.5  # a mean would hold the stall


@pytest.mark.parametrize("overhead, latency, bandwidth", [(30e-6, 8e-6, 2e9), (0.0, 20e-6, 5e8)])
def test_fit_recovers_the_link_that_made_the_samples(overhead, latency, bandwidth):
    o, a, bw = fit_link(_samples(overhead, latency, bandwidth))
    assert o == pytest.approx(overhead, abs=1e-9)
    assert a == pytest.approx(latency, rel=1e-6)
    assert bw == pytest.approx(bandwidth, rel=1e-6)
    assert max(abs(e) for e in link_errors(_samples(o, a, bw), o, a, bw)) < 1e-9


def test_fit_keeps_every_term_non_negative():
    # times that fall with the number of ranks would need a negative step latency
    samples = [(k, n, b, t * (1.5 if n == 2 else 1.0)) for k, n, b, t in _samples(5e-6, 1e-6, 1e9)]
    o, a, bw = fit_link(samples)
    assert o >= 0 and a >= 0 and bw > 0


def test_a_kind_run_by_another_algorithm_gets_its_own_factor():
    # a library whose reduce_scatter costs twice the ring's (gloo's costs about an all-reduce)
    made = [(k, n, b, t * (2.0 if k == "reduce_scatter" else 1.0))
            for k, n, b, t in _samples(30e-6, 8e-6, 2e9)]  # fmt: skip
    o, a, bw = fit_link(made)
    scale = dict(kind_scales(made, o, a, bw))
    assert scale["reduce_scatter"] > 1.5 * max(f for k, f in scale.items() if k != "reduce_scatter")
    assert max(abs(e) for e in link_errors(made, o, a, bw, tuple(scale.items()))) < max(
        abs(e) for e in link_errors(made, o, a, bw)
    )
    # and the cost model prices each kind with its factor
    cpu = dataclasses.replace(PROFILES["cpu"], collective_scale=(("reduce_scatter", 2.0),))
    mesh = Mesh((2,), ("dp",), device="cpu")
    rs, ag = (Collective(k, 0, 2**20, 2) for k in ("reduce_scatter", "all_gather"))
    assert collectives_time([rs], mesh, cpu) == pytest.approx(
        2.0 * collectives_time([rs], mesh, PROFILES["cpu"]), rel=1e-12
    )
    assert collectives_time([ag], mesh, cpu) == collectives_time([ag], mesh, PROFILES["cpu"])


def test_fit_refuses_times_that_do_not_grow_with_size():
    with pytest.raises(ValueError, match="bandwidth"):
        fit_link([(k, 2, float(b), 1e-3) for k in KINDS for b in (2**10, 2**20)])


def test_a_link_whose_times_do_not_grow_is_measured_again_with_larger_messages(monkeypatch):
    # a busy machine: the small messages' times sit in the noise of the fixed cost
    from autopar import calibrate
    from autopar.calibration import link as link_module

    link = (30e-6, 8e-6, 2e9)
    asked = []

    def measured(nproc, sizes, reps, *, device_type="cpu"):
        asked.append(list(sizes))
        if sizes[-1] <= 2**14:
            return [(k, nproc, float(b), 1e-3) for k in KINDS for b in sizes]
        return [s for s in _samples(*link, ranks=(nproc,)) if s[2] in sizes]

    monkeypatch.setattr(link_module, "measure_collectives", measured)
    logged = []
    samples, fit = calibrate.measure_link(2, [2**10, 2**14], 3, log=logged.append)
    assert asked == [[2**10, 2**14], [2**14, 2**18]]  # LARGER (16) times larger, once
    assert {s[2] for s in samples} == {2**14, 2**18}  # the larger ones fitted
    assert "measuring 16384..262144 bytes" in logged[0]
    assert fit == pytest.approx(link, rel=1e-6)
    # where the first sizes' times grow, they are all that is measured
    asked.clear()
    assert calibrate.measure_link(2, [2**14, 2**18], 3)[1] == pytest.approx(link, rel=1e-6)
    assert asked == [[2**14, 2**18]]


def test_the_link_is_fitted_to_each_samples_median_over_the_passes(monkeypatch):
    # a pass moves with the machine's minute (``LINK_PASSES``): one slow pass and one fast
    # one beside a true one give the true link, where either alone gives another
    from autopar import calibrate
    from autopar.calibration import link as link_module

    link = (300e-6, 40e-6, 2e9)
    true = _samples(*link, ranks=(2,))
    slow = [(k, n, b, 1.6 * t) for k, n, b, t in true]
    fast = [(k, n, b, 0.7 * t) for k, n, b, t in true]
    assert calibrate.pool_samples([slow, true, fast]) == true
    assert calibrate.fit_link(slow)[0] == pytest.approx(1.6 * link[0], rel=1e-6)
    monkeypatch.setattr(link_module, "measure_collectives", pytest.fail)  # nothing measured
    samples, fit = calibrate.measure_link(
        2, sorted({s[2] for s in true}), 3, measured=[slow, fast, true]
    )
    assert samples == true and fit == pytest.approx(link, rel=1e-6)
    with pytest.raises(ValueError, match="different collectives"):
        calibrate.pool_samples([true, true[1:] + true[:1]])


class _Device:
    """A stand-in GPU: a queue of kernels, each of known device seconds, on the host's
    clock (``time.perf_counter``); a kernel starts when the one before it ends or when the
    host queues it, whichever is later."""

    def __init__(self):
        self.done = 0.0  # when the last queued kernel ends

    def queue(self, seconds):
        self.done = max(self.done, time.perf_counter()) + seconds

    def sync(self, _device=None):
        while time.perf_counter() < self.done:
            pass

    def event(self):
        gpu = self

        class Event:
            def record(self):  # reached once the kernels queued before it end
                self.at = max(gpu.done, time.perf_counter())
                gpu.done = self.at

            def synchronize(self):
                gpu.sync()

            def elapsed_time(self, end):
                return (end.at - self.at) * 1e3

        return Event()


def _busy(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_curve_on_the_device_clock_leaves_out_the_hosts_call(monkeypatch):
    # each call costs the host 60 us to queue; its kernel runs 20 us (or 300 us) on the
    # device. Timed by the host (each call then a synchronize) the small one is 80 us;
    # queued behind enough lead work, its runs take 20 us a call on the device's clock.
    from autopar.calibration import timing

    gpu = _Device()
    monkeypatch.setattr(timing, "_sync", gpu.sync)
    monkeypatch.setattr(timing, "_event", gpu.event)
    monkeypatch.setattr(timing, "LEAD", 8)
    # a lead of 5 ms: the leads queued ahead of a run (at least two) outlast the host's
    # queueing of it by several ms, so a scheduler tick that takes the host away mid-run
    # (a CI machine's other processes) leaves the run on the device's clock; at 0.5 ms a
    # loaded 2-core machine spoiled most rounds (the small call came out at 53 us)
    monkeypatch.setattr(torch, "mm", lambda a, b: gpu.queue(5e-3))

    def call(device_s):
        def fn():
            _busy(60e-6)
            gpu.queue(device_s)

        return fn

    small, large = timing._queued_times(
        [call(20e-6), call(300e-6)], torch.device("cpu"), reps=9, seconds=0.0
    )  # (the median of 9 rounds: a round the scheduler takes the host from is one of them)
    assert small == pytest.approx(20e-6, rel=0.25)
    assert large == pytest.approx(300e-6, rel=0.1)
    # with no lead the host sets the pace: what the leads are there to prevent
    monkeypatch.setattr(torch, "mm", lambda a, b: None)
    (hostbound,) = timing._queued_times([call(20e-6)], torch.device("cpu"), 5, 0.0)
    assert hostbound > 50e-6


def test_calibrate_writes_a_profile_that_plan_takes(tmp_path, capsys):
    path = tmp_path / "profile.json"
    rc = main(["calibrate", "--quick", "--name", "here", "-o", str(path), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    measured = out["measured"]["collectives"]
    assert {c["kind"] for c in measured} == set(KINDS)
    profile = load_profile(path)
    assert profile.name == "here" and "autopar calibrate" in profile.source
    assert profile.source.count("measured") >= 1 and "'cpu'" in profile.source
    kinds = {(k, d) for k, d, _ in profile.kernel_rates}
    assert {k for k, _ in kinds} == set(KERNEL_KINDS)
    assert {d for k, d in kinds if k == "matmul"} == {"float32", "float64", "bfloat16", "float16"}
    for _, _, curve in profile.kernel_rates:
        assert all(r > 0 for _, r in curve)
    # what one machine cannot show is the base profile's
    cpu = PROFILES["cpu"]
    assert profile.inter_node_bandwidth == cpu.inter_node_bandwidth
    assert profile.all_reduce_algorithms == cpu.all_reduce_algorithms
    assert profile.mem_bandwidth != cpu.mem_bandwidth  # measured, not copied
    # the host's time: a view's call, and the runtime's per step and per parameter, on the
    # step's one clock (on the CPU the host does not run ahead of its kernels)
    assert profile.view_launch > 0 and profile.step_overhead > 0 and profile.param_overhead >= 0
    assert not profile.host_clock and profile.host_op_costs == ()
    # the memory roof by size: in increasing bytes, from the caches (fast) to memory
    sizes = [n for n, _ in profile.bandwidth_curve]
    assert len(sizes) == 4 and sizes == sorted(sizes)
    assert max(r for _, r in profile.bandwidth_curve) > profile.bandwidth_curve[-1][1]
    # each node of a step: the chain's op; a step's kernels at their scale over the curves
    m = out["measured"]
    assert profile.kernel_launch == m["step_op"] and profile.view_launch == m["view_op"]
    assert profile.roofline_scale == m["roofline_scale"] >= 1

    rc = main(["plan", "mlp", "--mesh", "2", "--profile", str(path), "--no-cache", "--json"])
    assert rc == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["mesh"]["device"] == "here"
    # the plan prices the runtime's host time, and the step it predicts starts after it
    runtime = profile.step_overhead + profile.param_overhead * len(plan["params"])
    assert plan["cost"]["runtime_s"] == pytest.approx(runtime, rel=1e-9)
    assert plan["cost"]["total_s"] >= plan["cost"]["compute_s"] + runtime * (1 - 1e-9)
    emitted = autopar.Plan.from_json(json.dumps(plan)).emitted_step_s()
    assert emitted >= plan["cost"]["compute_s"] + runtime * (1 - 1e-9)
    model, inputs, loss_fn, targets = EXAMPLES["mlp"]()
    mesh = autopar.Mesh((2,), ("dp",), device="cpu")
    # the built-in profile prices the same step otherwise
    on_cpu = autopar.plan(
        model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, cache=False
    )
    assert plan["cost"]["total_s"] != pytest.approx(on_cpu.cost["total_s"], rel=1e-3)


def test_a_bad_profile_is_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text('{"name": "x"}')
    assert main(["plan", "mlp", "--mesh", "2", "--profile", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.json" in err and "not a device profile" in err


def test_a_curve_is_in_order_of_flops_with_equal_flops_as_one_point():
    from autopar.calibrate import curve

    # batch 1 at 4096 and batch 16 at 1024 do the same FLOPs at different rates (CUDA)
    points = [(4.0, 10.0), (1.0, 2.0), (2.0, 4.0), (2.0, 9.0)]
    assert curve(points) == ((1.0, 2.0), (2.0, pytest.approx(6.0)), (4.0, 10.0))


def test_calibrate_refuses_a_rank_count_it_cannot_run():
    from autopar.calibrate import calibrate

    with pytest.raises(ValueError, match="nproc 0"):
        calibrate(nproc=0, quick=True, device="cpu")


def test_an_op_called_inside_another_is_counted_once_in_the_outer_call():
    x, w, b = torch.randn(8, 4), torch.randn(4, 4), torch.randn(4)
    names = {"aten::linear", "aten::addmm", "aten::t"}
    (times,) = _profiled_ops(
        [lambda: torch.nn.functional.linear(x, w, b)], names, torch.device("cpu"), 20
    )
    assert set(times) == {"aten::linear"} and len(times["aten::linear"]) == 20
    assert min(times["aten::linear"]) > 0


def test_an_op_is_the_calls_that_ran_it_in_one_profile_of_the_calls_in_turn():
    # an add of a chain apart from a step's add: each fn's calls counted as its own
    a = torch.randn(16, 16)

    def step():
        torch.mm(a, a)
        torch.add(a, a)

    first, second = _profiled_ops(
        [step, lambda: torch.add(a, a)], {"aten::mm", "aten::add"}, torch.device("cpu"), 5
    )
    assert {k: len(v) for k, v in first.items()} == {"aten::mm": 5, "aten::add": 5}
    assert {k: len(v) for k, v in second.items()} == {"aten::add": 5}


def test_the_host_table_prices_an_op_at_its_calls_mean_slow_calls_included():
    us = 1e-6
    # an mm whose every fourth call is slow (an allocation): a step pays 20 us a call, not
    # the 10 of most calls; the chain's add under the profiler, 4 us, is taken off each
    mm = [10 * us, 10 * us, 10 * us, 50 * us] * 5
    steps = [{"aten::mm": mm[:10], "aten::t": [3 * us] * 10}, {"aten::mm": mm[10:]}]
    adds, views = [4 * us] * 20, [2 * us] * 20
    table = host_table(steps, adds, views, {"aten::mm"}, step_op=8 * us, view_op=1 * us)
    assert table["aten::mm"] == pytest.approx((8 + 20 - 4) * us)
    assert table["aten::t"] == pytest.approx((1 + 3 - 2) * us)  # a view: a view's base
    # never under half the call of its kind
    table = host_table([{"aten::mm": [1 * us] * 5}], adds, views, {"aten::mm"}, 4 * us, 1 * us)
    assert table["aten::mm"] == pytest.approx(2 * us)


def test_the_host_time_of_each_op_of_a_step_is_measured_apart_from_an_add():
    step_op, view_op = 20e-6, 5e-6
    # in two passes, ``HOST_GAP_S`` apart, averaged
    table = measure_host_ops(step_op, view_op, reps=3, device_type="cpu", passes=2)
    # the ops a GPT's step runs, by the profiler's names, and a Llama's (transformers is a
    # test dependency): its RMSNorm's power, mean and reciprocal root, its gated MLP's silu
    gpt = {"aten::mm", "aten::addmm", "aten::native_layer_norm", "autopar::sdpa"}
    llama = {"aten::pow", "aten::mean", "aten::rsqrt", "aten::silu", "aten::mul"}
    assert gpt | llama <= set(table)
    # an add and a view are the bases, timed in chains apart: a step's own cost more
    assert table["aten::add"] > step_op and table["aten::view"] >= view_op / 2
    assert all(t >= view_op / 2 for t in table.values())
    assert table["autopar::sdpa_backward"] > table["aten::t"]  # a kernel's call, a view's


def test_the_hosts_terms_are_the_mean_of_passes_spread_over_the_calibration(monkeypatch):
    # a host at one of two speeds (``HOST_PASSES``): read four times, between the kernels'
    # measurements, its chains price an op at the mean of the readings, not at one
    from autopar import calibrate

    us = 1e-6
    readings = iter(
        [(100 * us, 2 * us), (200 * us, 4 * us), (120 * us, 2 * us), (180 * us, 4 * us)]
    )
    order: list[str] = []

    def spy(name, fn):
        def call(*args, **kwargs):
            order.append(name)
            return fn(*args, **kwargs)

        return call

    monkeypatch.setitem(calibrate.HOST_PASSES, "quick", 4)
    monkeypatch.setattr(calibrate, "measure_step_ops", spy("host", lambda *a, **k: next(readings)))
    for name in ("measure_bandwidth_curve", "measure_matmul", "measure_attention"):
        monkeypatch.setattr(calibrate, name, spy(name, getattr(calibrate, name)))
    given = {}

    def runtime(step_op, view_op, reps, seconds, nproc, device_type, host_ops, priced, groups):
        given.update(step_op=step_op, view_op=view_op, groups=groups)
        return 1e-3, 1e-5, 1.0

    monkeypatch.setattr(calibrate, "measure_runtime", runtime)
    profile, report = calibrate.calibrate(quick=True, nproc=1, device="cpu")
    assert profile.kernel_launch == pytest.approx(150 * us) and profile.view_launch == 3 * us
    assert given == {"step_op": profile.kernel_launch, "view_op": 3 * us, "groups": 5}
    assert report["step_op_passes"] == pytest.approx([100 * us, 200 * us, 120 * us, 180 * us])
    # first, after the elementwise curve, after the matmuls (four dtypes) and at the end
    matmuls = ["measure_matmul"] * 4
    assert order == [
        "host", "measure_bandwidth_curve", "host", *matmuls, "host", "measure_attention", "host"
    ]  # fmt: skip
    # a table of ops is averaged likewise over its passes
    tables = [{"aten::mm": 10 * us, "aten::t": 1 * us}, {"aten::mm": 20 * us}]
    assert calibrate.pool_tables(tables) == {
        "aten::mm": pytest.approx(15 * us),
        "aten::t": 1 * us,
    }


def test_a_profile_with_a_host_clock_prices_the_host_apart_from_the_device():
    host = dataclasses.replace(
        PROFILES["h100"],
        name="h100-slow-host",
        host_launch=50e-6,
        view_launch=5e-6,
        step_overhead=1e-3,
        param_overhead=1e-4,
        host_op_costs=(("aten::addmm", 2e-4),),
    )
    register_profile(host)
    model, inputs, loss_fn, targets = EXAMPLES["mlp"]()
    keywords = dict(loss_fn=loss_fn, example_targets=targets, cache=False)
    plan = autopar.plan(model, Mesh((2,), ("dp",), device=host.name), inputs, **keywords)
    device = autopar.plan(model, Mesh((2,), ("dp",), device="h100"), inputs, **keywords)
    assert "runtime_s" not in plan.cost
    assert plan.cost["host_start_s"] == 1e-3
    assert plan.cost["host_end_s"] == pytest.approx(1e-4 * len(plan.params))
    by_op = {c.op: c.host_s for c in plan.nodes.values() if c.op != "placeholder"}
    assert by_op["aten.addmm.default"] == 2e-4 and by_op["aten.t.default"] == 5e-6
    assert by_op["aten.mm.default"] == 50e-6
    # the device's time per node is the same; the step is the host's, far behind it
    for name, c in plan.nodes.items():
        assert c.cost_s == pytest.approx(device.nodes[name].cost_s, rel=1e-9)
    host_s = 1e-3 + sum(c.host_s for c in plan.nodes.values()) + plan.cost["host_end_s"]
    assert plan.cost["total_s"] >= host_s * (1 - 1e-9) > 10 * device.cost["total_s"]
    assert plan.host_s() == pytest.approx(plan.cost["total_s"], rel=1e-9)
    assert "the step is the host's" in plan.summary() and device.host_s() == 0.0
    assert "the host, apart" not in device.summary()


def test_the_runtime_per_step_parameter_and_the_step_kernels_scale_come_apart():
    from autopar.calibrate import runtime_terms

    step, param, scale, add, view = 300e-6, 20e-6, 2.5, 3e-6, 2e-6
    chain = lambda p, kernels, views: (  # noqa: E731
        p,
        [("aten::addmm", True)] * kernels + [("aten::t", False)] * views,
        step + param * p + add * kernels + view * views,
        0.0,
        0.0,
    )
    rows = [chain(2, 9, 5), chain(16, 37, 47)]
    # the chains alone: a step's time outside its nodes, fixed and per parameter; their
    # kernels of a few elements are their calls alone, so the kernels' scale is 1
    s, p, k = runtime_terms(rows, add, view, {})
    assert (s, p, k) == (pytest.approx(step), pytest.approx(param), 1.0)
    # a GPT whose kernels run 2.5 times their roofline as priced: its compute priced (the
    # nodes' calls and 2 ms of roofline), timed at its scaled roofline, calls and line
    nodes = [("aten::mm", True)] * 200 + [("aten::view", False)] * 69
    calls, roof = 200 * add + 69 * view, 2e-3
    gpt = (37, nodes, step + param * 37 + calls + scale * roof, calls + roof, roof)
    s2, p2, k2 = runtime_terms([*rows, gpt], add, view, {})
    assert (s2, p2) == (s, p) and k2 == pytest.approx(scale)
    # a step that costs less than its priced compute and the line: the curves', not less
    cheap = (37, nodes, calls + roof, calls + roof, roof)
    assert runtime_terms([*rows, cheap], add, view, {})[2] == 1.0
    # a step priced at its calls alone has no roofline to scale
    calls_only = (37, nodes, step + param * 37 + 2 * calls, calls, 0.0)
    assert runtime_terms([*rows, calls_only], add, view, {})[2] == 1.0

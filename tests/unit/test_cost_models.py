"""Unit tests of autopar.cost_models: devices, roofline compute, alpha-beta comm, redistribution.

Expected values are derived by hand in each test (shapes chosen so the arithmetic is exact);
the redistribution planner is also checked against DTensor's own planner on a fake process
group.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import operator
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.core import Mesh
from autopar.cost_models import (
    PROFILES,
    Collective,
    DeviceProfile,
    axis_link,
    collective_time,
    collectives_time,
    compute_time,
    get_profile,
    hierarchical_collectives,
    host_time,
    is_view_op,
    op_bytes,
    op_flops,
    redistribute_collectives,
    redistribute_time,
    reshard_collectives,
    reshard_time,
)

aten = torch.ops.aten
S = torch.Size
H100 = PROFILES["h100"]
F32 = torch.float32


# ---------------------------------------------------------------- devices


def test_h100_profile_peaks_from_the_datasheet_rates_from_measurements():
    assert H100.flops_for(torch.bfloat16) == pytest.approx(989.5e12)
    assert H100.flops_for(torch.float16) == pytest.approx(989.5e12)
    assert H100.flops_for(torch.float32) == pytest.approx(67e12)
    # what runs: ~90% of HBM3's 3.35 TB/s, NCCL's 47 GB/s over NDR, large bf16 GEMMs
    # sustaining ~680 TF (measured on an H200, benchmarks/data/gemm-h200.json)
    assert H100.mem_bandwidth == pytest.approx(3.0e12)
    assert H100.intra_node_bandwidth == pytest.approx(450e9)
    assert H100.inter_node_bandwidth == pytest.approx(47e9)
    assert H100.kernel_rate("matmul", torch.bfloat16, 1e15) == pytest.approx(680e12)
    assert H100.ranks_per_node == 8
    assert "datasheet" in H100.source and "calibrate" in H100.source


def test_kernel_rate_interpolates_in_log_flops_and_holds_its_ends():
    curve = ((1e9, 100e12), (1e11, 300e12))
    p = dataclasses.replace(H100, kernel_rates=(("matmul", "bfloat16", curve),))
    bf16 = torch.bfloat16
    assert p.kernel_rate("matmul", bf16, 1e10) == pytest.approx(200e12)  # halfway in log
    assert p.kernel_rate("matmul", bf16, 1e6) == pytest.approx(100e12)
    assert p.kernel_rate("matmul", bf16, 1e14) == pytest.approx(300e12)
    # no curve for the kind or the dtype: the peak
    assert p.kernel_rate("attention", bf16, 1e10) == p.flops_for(bf16)
    assert p.kernel_rate("matmul", torch.float64, 1e10) == p.flops_for(torch.float64)


def test_a_bandwidth_curve_prices_memory_bound_ops_by_their_size():
    curve = ((1e4, 10e9), (1e6, 100e9), (1e8, 5e9))  # a CPU: caches, then memory
    p = dataclasses.replace(H100, bandwidth_curve=curve)
    assert p.bandwidth(1e5) == pytest.approx(55e9)  # halfway in log bytes
    assert p.bandwidth(10.0) == 10e9 and p.bandwidth(1e12) == 5e9  # held at the ends
    assert H100.bandwidth(1e6) == H100.mem_bandwidth  # without a curve: one roof
    f32 = torch.float32

    def add(numel):
        return compute_time(p, aten.add.Tensor, (S([numel]),) * 2, {}, S([numel]), f32)

    # an add of 1e6 / 12 elements moves 1e6 bytes: at the curve's fastest point
    assert add(10**6 // 12) == pytest.approx(10**6 // 12 * 12 / 100e9 + p.kernel_launch)
    assert add(10**8 // 12) == pytest.approx(10**8 // 12 * 12 / 5e9 + p.kernel_launch)
    again = DeviceProfile.from_dict(json.loads(p.to_json()))
    assert again.bandwidth_curve == curve
    for bad in (((1e6, 1e9), (1e4, 1e9)), ((1e4, 0.0),)):
        with pytest.raises(ValueError, match="bandwidth_curve"):
            dataclasses.replace(H100, bandwidth_curve=bad)


def test_a_step_kernels_scale_multiplies_the_roofline_not_the_call():
    # a CPU step's kernels run slower than the curves timed alone (roofline_scale); the
    # op's call (kernel_launch) and a view's (view_launch) are the step's calls, unscaled
    cpu = PROFILES["cpu"]
    slow = dataclasses.replace(cpu, roofline_scale=2.5)
    f32 = torch.float32
    mm = (aten.mm.default, (S([256, 256]), S([256, 256])), {}, S([256, 256]), f32)
    view = (aten.view.default, (S([256, 256]), [65536]), {}, S([65536]), f32)
    roof = compute_time(cpu, *mm) - cpu.kernel_launch
    assert roof > 0
    assert compute_time(slow, *mm) == pytest.approx(2.5 * roof + cpu.kernel_launch)
    assert compute_time(slow, *view) == compute_time(cpu, *view) == cpu.view_launch
    assert DeviceProfile.from_dict(json.loads(slow.to_json())).roofline_scale == 2.5
    with pytest.raises(ValueError, match="roofline_scale"):
        dataclasses.replace(cpu, roofline_scale=0.0)


def test_small_gemms_run_below_large_ones_on_h100():
    def rate(n):
        args = (S([n, n]), S([n, n]))
        t = compute_time(H100, aten.mm.default, args, {}, S([n, n]), torch.bfloat16)
        return 2 * n**3 / (t - H100.kernel_launch)

    rates = [rate(n) for n in (512, 1024, 2048, 4096, 8192)]
    assert rates == sorted(rates)
    assert rates[0] < 0.15 * 989.5e12 and rates[-1] == pytest.approx(670e12, rel=0.01)


def test_the_h100_matmul_curves_price_the_gemms_measured_on_an_h200():
    """A transformer layer's GEMMs and its head's, timed on an H200 (the same chip) and saved
    (benchmarks/data/gemm-h200.json): the h100 profile prices each sum within 15%."""
    root = Path(__file__).resolve().parents[2] / "benchmarks"
    run = subprocess.run(
        [sys.executable, "gemm_fidelity.py", "--load", "data/gemm-h200.json", "--check"],
        cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    layers = [line for line in run.stdout.splitlines() if "| bfloat16 |" in line]
    assert len(layers) > 70  # the square GEMMs, and 72 layers and heads


def test_attention_is_priced_as_its_kernel_not_as_a_gemm():
    q = S([8, 32, 2048, 128])
    args = (q, q, q, None, True, 0.088)
    out = (q, S([8, 32, 2048]))
    t = compute_time(H100, torch.ops.autopar.sdpa.default, args, {}, out, torch.bfloat16)
    flops = op_flops(torch.ops.autopar.sdpa.default, args, {}, out)
    rate = flops / (t - H100.kernel_launch)
    assert rate == pytest.approx(H100.kernel_rate("attention", torch.bfloat16, flops))
    assert rate < 0.5 * H100.kernel_rate("matmul", torch.bfloat16, flops)
    bwd = (q, q, q, q, q, S([8, 32, 2048]), None, True, 0.088)
    t_bwd = compute_time(
        H100, torch.ops.autopar.sdpa_backward.default, bwd, {}, (q, q, q), torch.bfloat16
    )
    assert t_bwd > 2.5 * t  # 2.5x the FLOPs at a lower rate


def test_profile_round_trips_through_json(tmp_path):
    from autopar.cost_models import load_profile

    for profile in PROFILES.values():
        path = tmp_path / f"{profile.name}.json"
        path.write_text(profile.to_json())
        assert load_profile(path) == profile
    path.write_text('{"name": "x"}')
    with pytest.raises(ValueError, match=r"x\.json|cpu\.json|not a device profile"):
        load_profile(path)
    path.write_text(H100.to_json().replace('"source"', '"sauce"'))
    with pytest.raises(ValueError, match="unknown profile fields"):
        load_profile(path)


@pytest.mark.parametrize(
    "rates, match",
    [
        ((("gemm", "bfloat16", ((1e9, 1e12),)),), "kind"),
        ((("matmul", "bfloat16", ((1e9, 1e12), (1e8, 2e12))),), "increase"),
        ((("matmul", "bfloat16", ()),), "points"),
        ((("matmul", "bfloat16", ((1e9, 0.0),)),), "points"),
    ],
)
def test_bad_kernel_curves_are_rejected(rates, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(H100, kernel_rates=rates)


def test_unknown_dtype_uses_float32_flops():
    for profile in PROFILES.values():
        assert profile.flops_for(torch.int64) == profile.flops_for(torch.float32)
        assert profile.flops_for(torch.bool) == profile.flops_for(torch.float32)


def test_profiles_are_frozen_and_hashable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        H100.mem_bandwidth = 1.0
    assert hash(H100) == hash(dataclasses.replace(H100))


def test_profile_without_bfloat16_flops_is_rejected():
    with pytest.raises(ValueError, match="bfloat16"):
        dataclasses.replace(H100, peak_flops=(("float32", 1e12), ("float64", 1e12)))


def test_get_profile_unknown_name_lists_known_profiles():
    assert get_profile("h100") is H100
    with pytest.raises(KeyError, match="h100"):
        get_profile("nope")


# ---------------------------------------------------------------- compute


def test_mm_flops_are_2mnk():
    m, k, n = 64, 32, 48
    assert op_flops(aten.mm.default, (S([m, k]), S([k, n])), {}, S([m, n])) == 2 * m * n * k


def test_addmm_and_bmm_flops():
    b, m, k, n = 3, 8, 16, 4
    addmm = op_flops(aten.addmm.default, (S([n]), S([m, k]), S([k, n])), {}, S([m, n]))
    assert addmm == 2 * m * n * k
    bmm = op_flops(aten.bmm.default, (S([b, m, k]), S([b, k, n])), {}, S([b, m, n]))
    assert bmm == 2 * b * m * n * k


def test_convolution_flops_use_the_output_shape():
    # conv2d 3->4 channels, 3x3 kernel, no padding: 8x8 -> 6x6; 2 FLOPs per MAC.
    args = (S([2, 3, 8, 8]), S([4, 3, 3, 3]), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    expected = 2 * (2 * 4 * 6 * 6) * (3 * 3 * 3)
    assert op_flops(aten.convolution.default, args, {}, S([2, 4, 6, 6])) == expected


def test_sdpa_flops_including_cpu_and_raw_registry_variants():
    b, h, s, d = 2, 4, 128, 64
    q = S([b, h, s, d])
    expected = 4 * b * h * s * s * d  # QK^T and PV, 2 FLOPs per MAC each
    cuda_out = (q, S([b, h, s]), None, None, s, s, S([]), S([]), None)
    assert op_flops(aten._scaled_dot_product_flash_attention.default, (q, q, q), {}, cuda_out) == (
        expected
    )
    cpu = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert op_flops(cpu, (q, q, q), {}, (q, S([b, h, s]))) == expected
    # _flash_attention_forward's formula is "raw" (reads .shape itself). Its inputs are
    # (batch, seq, heads, dim); torch 2.13's formula read them as (batch, heads, seq, dim),
    # 2.14 as documented: heads == seq here, so both readings count the same FLOPs.
    raw = aten._flash_attention_forward.default
    n = 16
    qr = S([b, n, n, d])
    raw_args = (qr, qr, qr, None, None, n, n, 0.0, False, False)
    out = (qr, S([b, n, n]), S([]), S([]), S([]))
    assert op_flops(raw, raw_args, {}, out) == 4 * b * n * n * n * d


def test_pointwise_op_counts_one_flop_per_output_element():
    assert op_flops(aten.add.Tensor, (S([6, 7]), S([7])), {}, S([6, 7])) == 42
    # an in-place foreach op returns nothing: count the mutated tensors it writes.
    foreach_args = ([S([3, 4]), S([5])], [S([3, 4]), S([5])])
    assert op_flops(aten._foreach_add_.List, foreach_args, {}, None) == 17


def test_op_bytes_counts_every_tensor_at_its_element_size():
    nbytes = op_bytes([(S([10, 10]), torch.bfloat16), (S([10]), torch.int64)], [(S([5]), F32)])
    assert nbytes == 100 * 2 + 10 * 8 + 5 * 4


def test_large_bf16_mm_is_compute_bound_on_h100():
    n = 8192
    flops = 2 * n**3
    nbytes = 3 * n * n * 2
    assert flops / H100.flops_for(torch.bfloat16) > nbytes / H100.mem_bandwidth
    t = compute_time(H100, aten.mm.default, (S([n, n]), S([n, n])), {}, S([n, n]), torch.bfloat16)
    rate = H100.kernel_rate("matmul", torch.bfloat16, flops)
    assert t == pytest.approx(flops / rate + H100.kernel_launch, rel=1e-12)


def test_large_elementwise_add_is_memory_bound_on_h100():
    n = 1 << 26
    t = compute_time(H100, aten.add.Tensor, (S([n]), S([n])), {}, S([n]), torch.bfloat16)
    assert t == pytest.approx(3 * n * 2 / 3.0e12 + H100.kernel_launch, rel=1e-12)
    # explicit byte count (e.g. mixed dtypes) replaces the default
    t_f32 = compute_time(
        H100, aten.add.Tensor, (S([n]), S([n])), {}, S([n]), torch.bfloat16, nbytes=3 * n * 4
    )
    assert t_f32 == pytest.approx(3 * n * 4 / 3.0e12 + H100.kernel_launch, rel=1e-12)


@pytest.mark.parametrize(
    "op, args",
    [
        (aten.view.default, (S([4096, 4096]), [4096 * 4096])),
        (aten._unsafe_view.default, (S([4096, 4096]), [4096 * 4096])),
        (aten.t.default, (S([4096, 4096]),)),
        (aten.transpose.int, (S([4096, 4096]), 0, 1)),
        (aten.permute.default, (S([64, 64, 64]), [2, 0, 1])),
        (aten.expand.default, (S([1, 4096]), [4096, 4096])),
        (aten.unsqueeze.default, (S([4096]), 0)),
        (aten.slice.Tensor, (S([4096, 4096]), 0, 0, 1024)),
        (aten.select.int, (S([4096, 4096]), 0, 3)),
        (aten.detach.default, (S([4096, 4096]),)),
        (aten.alias.default, (S([4096, 4096]),)),
        (aten.as_strided.default, (S([4096, 4096]), [4096, 4096], [4096, 1])),
    ],
)
def test_view_ops_cost_zero(op, args):
    assert is_view_op(op)
    assert compute_time(H100, op, args, {}, S([4096, 4096]), F32) == 0.0
    assert op_flops(op, args, {}, S([4096, 4096])) == 0.0
    # where the host's call is on the step's path (a calibrated CPU), the call alone
    host = dataclasses.replace(H100, view_launch=2e-6)
    assert compute_time(host, op, args, {}, S([4096, 4096]), F32) == 2e-6


def test_where_the_host_runs_ahead_the_device_takes_kernels_and_the_host_every_call():
    two = dataclasses.replace(
        H100, host_launch=10e-6, view_launch=3e-6, host_op_costs=(("aten::mm", 25e-6),)
    )
    assert two.host_clock and not H100.host_clock
    mm = (aten.mm.default, (S([64, 64]), S([64, 64])), {}, S([64, 64]), F32)
    view = (aten.view.default, (S([64, 64]), [4096]), {}, S([4096]), F32)
    # the device: a kernel's roofline and its own time per kernel, as on one clock; a view
    # none of it (its call is the host's)
    assert compute_time(two, *mm) == compute_time(H100, *mm) > H100.kernel_launch
    assert compute_time(two, *view) == 0.0
    # the host: the op's measured call, else a kernel's or a view's
    assert host_time(two, aten.mm.default) == 25e-6
    assert host_time(two, aten.add.Tensor) == 10e-6
    assert host_time(two, aten.view.default) == 3e-6
    # one clock: no host time apart (the call is in kernel_launch, a view's in view_launch)
    one = dataclasses.replace(H100, view_launch=3e-6)
    assert host_time(one, aten.mm.default) == host_time(one, aten.view.default) == 0.0
    assert compute_time(one, *view) == 3e-6
    assert DeviceProfile.from_dict(json.loads(two.to_json())) == two
    with pytest.raises(ValueError, match="host_op_costs"):
        dataclasses.replace(two, host_op_costs=(("aten::mm", 1e-6), ("aten::mm", 2e-6)))
    with pytest.raises(ValueError, match="host_launch"):
        dataclasses.replace(two, host_launch=-1e-6)


def test_getitem_costs_zero_and_copies_do_not():
    assert is_view_op(operator.getitem)
    assert compute_time(H100, operator.getitem, ((S([8]), S([8])), 0), {}, S([8]), F32) == 0.0
    assert not is_view_op(aten.clone.default)
    assert not is_view_op(aten.add_.Tensor)
    assert compute_time(H100, aten.clone.default, (S([8]),), {}, S([8]), F32) > 0.0


# ---------------------------------------------------------------- collectives


def test_collective_formulas():
    a, bw, nbytes, n = 1e-5, 1e11, 1e9, 8
    ring = 7 * a + 7 / 8 * nbytes / bw
    assert collective_time("all_gather", nbytes, n, a, bw) == pytest.approx(ring)
    assert collective_time("reduce_scatter", nbytes, n, a, bw) == pytest.approx(ring)
    assert collective_time("all_to_all", nbytes, n, a, bw) == pytest.approx(ring)
    assert collective_time("all_reduce", nbytes, n, a, bw) == pytest.approx(2 * ring)


def test_all_reduce_costs_twice_all_gather_for_large_messages():
    lat, bw = axis_link(Mesh((8,)), 0, H100)
    ag = collective_time("all_gather", 2**30, 8, lat, bw)
    ar = collective_time("all_reduce", 2**30, 8, lat, bw, algorithms=("ring", "tree"))
    assert ar == pytest.approx(2 * ag)  # the ring: the tree moves 8/7 as many bytes
    assert ag == pytest.approx(7 / 8 * 2**30 / 450e9, rel=0.02)  # latency is ~1% of it


def test_small_all_reduce_over_many_ranks_runs_as_a_tree():
    a, bw, o, n = 5e-6, 47e9, 5e-6, 64
    ring = collective_time("all_reduce", 4, n, a, bw, overhead=o)
    both = collective_time("all_reduce", 4, n, a, bw, overhead=o, algorithms=("ring", "tree"))
    assert ring == pytest.approx(o + 2 * 63 * a + 2 * 63 / 64 * 4 / bw)
    assert both == pytest.approx(o + 2 * 6 * a + 2 * 4 / bw)
    tree = collective_time("all_reduce", 4, n, a, bw, overhead=o, algorithms=("tree",))
    assert both == tree < ring / 5
    with pytest.raises(ValueError, match="ring or tree"):
        collective_time("all_reduce", 4, n, a, bw, algorithms=())


def test_smallest_all_reduce_over_64_h100s_is_about_what_nccl_takes():
    mesh = Mesh((8, 8), ("dp", "tp"))
    colls = [Collective("all_reduce", axis, 4, 8) for axis in (0, 1)]
    # measured: ~47 us for the smallest all-reduce over 64 ranks on 8 nodes
    assert collectives_time(colls, mesh, H100) == pytest.approx(47e-6, rel=0.15)


def test_group_of_one_costs_zero():
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert collective_time(kind, 2**30, 1, 1e-5, 1e9) == 0.0


def test_unknown_collective_kind_is_rejected():
    with pytest.raises(ValueError, match="all_gather"):
        collective_time("broadcast", 1, 2, 1e-6, 1e9)


def test_inner_axis_is_intra_node_outer_axis_is_inter_node():
    mesh = Mesh((16, 8), ("dp", "tp"))
    assert axis_link(mesh, 1, H100) == (H100.intra_node_latency, H100.intra_node_bandwidth)
    assert axis_link(mesh, 0, H100) == (H100.inter_node_latency, H100.inter_node_bandwidth)
    # (2, 4): 8 ranks fit in one node, both axes intra-node.
    small = Mesh((2, 4))
    assert axis_link(small, 0, H100) == (H100.intra_node_latency, H100.intra_node_bandwidth)
    # (4, 2, 2) on 8-GPU nodes: axis 1 spans 4 ranks (intra), axis 0 spans 16 (inter).
    deep = Mesh((4, 2, 2))
    assert axis_link(deep, 1, H100)[1] == H100.intra_node_bandwidth
    assert axis_link(deep, 0, H100)[1] == H100.inter_node_bandwidth


# ---------------------------------------------------------------- redistribution

SHAPE = (1024, 512)
FULL = 1024 * 512 * 4  # float32 bytes of SHAPE


@pytest.mark.parametrize(
    "src, dst, expected",
    [
        ((Shard(0),), (Replicate(),), [Collective("all_gather", 0, FULL, 8)]),
        ((Partial(),), (Replicate(),), [Collective("all_reduce", 0, FULL, 8)]),
        ((Partial("avg"),), (Replicate(),), [Collective("all_reduce", 0, FULL, 8)]),
        ((Partial(),), (Shard(0),), [Collective("reduce_scatter", 0, FULL, 8)]),
        ((Shard(0),), (Shard(1),), [Collective("all_to_all", 0, FULL // 8, 8)]),
        (
            (_StridedShard(0, split_factor=2),),
            (Replicate(),),
            [Collective("all_gather", 0, FULL, 8)],
        ),
        ((Replicate(),), (Shard(0),), []),
        ((Replicate(),), (Partial(),), []),
        ((Shard(1),), (Shard(1),), []),
        ((Shard(-1),), (Shard(1),), []),
    ],
)
def test_redistribute_collectives_1d(src, dst, expected):
    assert redistribute_collectives(src, dst, SHAPE, F32, (8,)) == expected


def test_nested_shard_gathers_inner_axis_first_with_smaller_bytes():
    # (S0, S0) on a (2, 4) mesh: axis 1 gathers the (1024/2, 512) block first, then axis 0
    # gathers the full (1024, 512) tensor.
    got = redistribute_collectives(
        (Shard(0), Shard(0)), (Replicate(), Replicate()), SHAPE, F32, (2, 4)
    )
    assert got == [
        Collective("all_gather", 1, 512 * 512 * 4, 4),
        Collective("all_gather", 0, 1024 * 512 * 4, 2),
    ]


def test_bytes_shrink_by_shards_on_other_axes():
    # gather dim 0 over axis 0 while axis 1 keeps dim 1 sharded 4 ways: full along axis 0 is
    # (1024, 512/4).
    got = redistribute_collectives(
        (Shard(0), Shard(1)), (Replicate(), Shard(1)), SHAPE, F32, (2, 4)
    )
    assert got == [Collective("all_gather", 0, 1024 * 128 * 4, 2)]
    # all-reduce both axes of a partial sum: outer axis first, full bytes each
    got = redistribute_collectives(
        (Partial(), Partial()), (Replicate(), Replicate()), SHAPE, F32, (2, 4)
    )
    assert got == [Collective("all_reduce", 0, FULL, 2), Collective("all_reduce", 1, FULL, 4)]


def test_misaligned_nested_shard_goes_through_replicate_like_dtensor():
    # (S0, R) -> (R, S0): DTensor gathers axis 0 (full bytes) and re-chunks on axis 1 locally.
    got = redistribute_collectives(
        (Shard(0), Replicate()), (Replicate(), Shard(0)), SHAPE, F32, (2, 4)
    )
    assert got == [Collective("all_gather", 0, FULL, 2)]


def test_axis_of_size_one_runs_no_collective():
    got = redistribute_collectives(
        (Shard(0), Partial()), (Replicate(), Shard(0)), SHAPE, F32, (1, 4)
    )
    assert got == [Collective("reduce_scatter", 1, FULL, 4)]


def test_unsupported_redistributions_raise():
    with pytest.raises(ValueError, match="Replicate"):
        redistribute_collectives((Shard(0),), (Partial(),), SHAPE, F32, (8,))
    with pytest.raises(ValueError):
        redistribute_collectives((Partial("sum"),), (Partial("avg"),), SHAPE, F32, (8,))
    with pytest.raises(ValueError, match="one placement per mesh axis"):
        redistribute_collectives((Shard(0),), (Replicate(),), SHAPE, F32, (2, 4))


def test_redistribute_time_sums_collectives_on_their_links():
    mesh = Mesh((16, 8), ("dp", "tp"))
    src, dst = (Partial(), Partial()), (Replicate(), Replicate())
    kw = dict(overhead=H100.collective_overhead, algorithms=H100.all_reduce_algorithms)
    inter = (H100.inter_node_latency, H100.inter_node_bandwidth)
    intra = (H100.intra_node_latency, H100.intra_node_bandwidth)
    expected = collective_time("all_reduce", FULL, 16, *inter, **kw) + collective_time(
        "all_reduce", FULL, 8, *intra, **kw
    )
    assert redistribute_time(src, dst, SHAPE, F32, mesh, H100) == pytest.approx(expected)
    # profile defaults to the mesh's device
    assert redistribute_time(src, dst, SHAPE, F32, mesh) == pytest.approx(expected)
    assert redistribute_time((Replicate(),) * 2, (Shard(0),) * 2, SHAPE, F32, mesh) == 0.0


def test_hierarchical_reduction_scatters_inside_the_node_and_reduces_a_shard_across():
    mesh = Mesh((16, 8), ("dp", "tp"))
    src, dst = (Partial(), Partial()), (Replicate(), Replicate())
    # 2**24 float32 values: reduce-scattered over tp, the eighth all-reduced over dp
    tiered = hierarchical_collectives(src, dst, (2**24,), F32, mesh.shape)
    assert tiered == [
        Collective("reduce_scatter", 1, 2**26, 8),
        Collective("all_reduce", 0, 2**23, 16),
        Collective("all_gather", 1, 2**26, 8),
    ]
    # flat and padded to a multiple of the inner axis: 9 values as 2 per rank
    assert hierarchical_collectives(src, dst, (3, 3), F32, mesh.shape)[0].nbytes == 16 * 4
    # the bytes of the tensor as each rank holds it: a third axis's shard
    three = (Partial(), Shard(0), Partial())
    got = hierarchical_collectives(three, (Replicate(), Shard(0), Replicate()), (8, 64), F32,
                                   (2, 2, 4))  # fmt: skip
    assert [c.nbytes for c in got] == [4 * 64 * 4, 64 * 4, 4 * 64 * 4]
    # a Partial over one axis, or another axis changing too: not a hierarchical reduction
    assert hierarchical_collectives((Partial(), Replicate()), dst, SHAPE, F32, (16, 8)) is None
    assert hierarchical_collectives(src, (Replicate(), Shard(0)), SHAPE, F32, (16, 8)) is None
    # across nodes, a large gradient's is the faster: 1/8 of it crosses the slow links
    big = reshard_collectives(src, dst, (2**24,), F32, mesh, H100)
    assert big == tiered
    greedy = redistribute_time(src, dst, (2**24,), F32, mesh, H100)
    assert reshard_time(src, dst, (2**24,), F32, mesh, H100) < 0.5 * greedy
    # a scalar's is latency alone: DTensor's two all-reduces, one call fewer
    assert reshard_collectives(src, dst, (), F32, mesh, H100) == redistribute_collectives(
        src, dst, (), F32, mesh.shape
    )


def test_collectives_time_rejects_a_collective_from_another_mesh():
    with pytest.raises(ValueError, match="does not fit"):
        collectives_time([Collective("all_gather", 0, 8, 4)], Mesh((8,)), H100)


# -------------------------------------------- cross-check against DTensor's own planner


@pytest.fixture(scope="module")
def fake_world():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this pytest process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    yield
    _MESHES.clear()
    dist.destroy_process_group()


_MESHES: dict = {}


def _dtensor_plan(mesh_shape, src, dst, shape):
    """(kind, axis) of each collective DTensor's greedy planner emits, None for local steps."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached

    if mesh_shape not in _MESHES:
        _MESHES[mesh_shape] = DeviceMesh(
            "cpu", torch.arange(math.prod(mesh_shape)).reshape(mesh_shape)
        )
    mesh = _MESHES[mesh_shape]
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    meta = TensorMeta(torch.Size(shape), stride, F32)
    infos = _gen_transform_infos_non_cached(
        DTensorSpec(mesh, src, tensor_meta=meta),
        DTensorSpec(mesh, dst, tensor_meta=meta),
        use_graph_based_transform=False,
    )
    return [
        (info._comm_type_key(), info.mesh_dim, info.src_dst_placements)
        for info in infos
        if mesh_shape[info.mesh_dim] > 1
    ]


@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4), (1, 8), (2, 2, 2)])
def test_redistribute_order_matches_dtensor_planner(fake_world, mesh_shape):
    """Every pair of placements from {R, S0, S1, P} per axis: same collectives, same order."""
    choices = [Replicate(), Shard(0), Shard(1), Partial()]
    shape = (16, 8)
    for src in itertools.product(choices, repeat=len(mesh_shape)):
        for dst in itertools.product(choices, repeat=len(mesh_shape)):
            theirs = _dtensor_plan(mesh_shape, src, dst, shape)
            try:
                ours = redistribute_collectives(src, dst, shape, F32, mesh_shape)
            except ValueError:
                # we refuse exactly what DTensor fails on when it runs the plan
                assert any(s.is_shard() and d.is_partial() for _, _, (s, d) in theirs), (src, dst)
                continue
            assert [(c.kind, c.axis) for c in ours] == [
                (kind, axis) for kind, axis, _ in theirs if kind is not None
            ], (src, dst)

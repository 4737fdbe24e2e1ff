"""Predicted step time (the cost model) against the emitted step, measured; and the bytes of
every collective, predicted against counted as the step runs.

    python benchmarks/cost_fidelity.py [--profile PATH] [--steps 20] [--seconds 2]
                                       [--rounds 3] [--gpu-seconds 6] [--gpu-rounds 3]
                                       [--check]

The profile is this machine's: ``autopar calibrate`` runs first (``autopar.calibrate``:
kernel curves, memory bandwidth, launch cost, the gloo link on 2 ranks), unless
``--profile`` names one it wrote. Each case compiles a zoo model with that profile on a
local gloo mesh of 2 processes (one thread each, as the calibration measured; 2 cores, so
no rank waits for a core) and times the forward and backward of the emitted step:

    predicted   the step as emitted (autopar/report ``schedule``): every node's compute
                time in order, each collective waited for where the step runs it; the
                plan's ``cost["total_s"]`` credits overlap the gloo step does not have
    measured    the mean step, as a training loop's throughput counts it (median of the
                means of five runs of steps, ``autopar.calibrate.median_of_means``: one
                rare stall of 100 ms cannot move it), over the steps that fill
                ``--seconds`` (at least ``--steps``) after warm-up, of one
                rank's ``pm(*batch).backward()``; the ranks start together (a barrier)
                and then step back to back as a training loop does; the slowest rank's;
                then the median of ``--rounds`` launches of the case, the cases launched
                in turn (a case, then the next, then the first again), so that a slow
                minute of a shared VM falls on one launch of each case rather than on
                every launch of one (the same plan's step measured 18 ms in one 2 s
                window and 23 ms in one ten minutes later); the least and the most
                beside it
    bytes       ``Plan.collective_bytes`` against ``autopar.verify.CollectiveBytes``
                (a dispatch mode counting the functional collectives as they run) during
                one step, by kind and axis; gloo runs an all-to-all as an all-gather

Targets (``--check`` exits non-zero when one is missed): predicted within 30% of measured
on every case; collective bytes within 2% for every kind and axis.

Where a GPU is present, a second table times ``GPU_CASES`` on CUDA: models sized for a GPU,
in bf16 mixed precision as they are trained (and one in fp32), on one GPU (a mesh of one:
no collectives) or two (NCCL, a mesh of two). Each is planned with the profile calibrated
on that GPU (``--gpu-profile``, else ``autopar calibrate`` runs there first) and, for the
comparison, with the built-in ``h100`` profile. Target: predicted within 15% of measured
with the calibrated profile. The measured step is the mean over ``--gpu-seconds`` (6) of
steps, the least and the most of its ``GPU_WINDOWS`` windows' means beside it: a host-bound
step's time moves with the host, whose speed has two modes 1.45x apart
(``autopar.calibrate.HOST_PASSES``), so a step pays their mix; the same plan measured 12.1
ms in one 2 s window and 10.8 ms in the next run's. A slow spell of an H200's host can
outlast the 6 s: a bf16 GPT's step measured 23.6 ms over one launch's 6 s (every window
23.0-24.3) and 18.6 ms over the next run's. So a host-bound case (the GPU idle for
``HOST_BOUND_IDLE`` of its step or more, measured) is launched ``--gpu-rounds`` (3) times,
in turn with the other host-bound cases, and judged by the launch of median step
(``judged``); the table lists each launch's step. Beside the
totals, the step's time by kind of kernel, predicted (the schedule's compute spans by op)
against measured (``torch.profiler``'s CUDA kernels by name, over a few steps): matmul,
attention, and the rest; the time the GPU sat idle (measured), and the host's time the
plan predicts (the runtime's at the step's start and end, and each node's call:
core/schedule's host clock, where the calibrated profile runs the host apart from the
device). ``--gpu-only`` skips the gloo table.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from autopar.runtime import run_local

from common import GPU_MODELS, MIXED, compile_quietly, last_line, mp_policy, print_header, quiet

TIME_TARGET = 0.30
GPU_TIME_TARGET = 0.15
BYTES_TARGET = 0.02
CASES = [
    # (example, mesh, memory fraction: None = the device's memory, so maybe no sharding)
    ("mlp", (2,), None),
    ("mlp", (2,), 0.6),
    ("gpt", (2,), 0.6),
    ("hf-gpt2", (2,), 0.6),
    ("hf-llama", (2,), 0.6),
    ("hf-llama", (2,), 0.45),  # only a plan that checkpoints its layers meets it
]


def _on_gloo(plan) -> dict:
    out: dict = {}
    for c in plan.collectives:
        kind, nbytes = c.kind, c.nbytes
        if kind == "all_to_all":  # gloo has none: DTensor gathers the whole buffer
            kind, nbytes = "all_gather", nbytes * c.group_size
        out[(kind, c.axis)] = out.get((kind, c.axis), 0) + nbytes
    return out


def _backward_step(pm, local):
    """One forward and backward of ``pm`` on the local batch, the gradients let go after."""

    def step():
        pm(*local).backward()
        for p in pm.parameters():
            p.grad = None

    return step


def _measure(rank, world, profile_path, example, mesh_shape, fraction, steps, seconds, backend):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    from autopar.calibrate import median_of_means
    from autopar.models import EXAMPLES
    from autopar.report import schedule, step_length
    from autopar.verify import CollectiveBytes

    device = "cuda" if backend == "nccl" else "cpu"
    name = autopar.load_profile(profile_path).name if profile_path else "h100"
    torch.manual_seed(0)
    model, inputs, loss_fn, targets = EXAMPLES[example]()
    mesh = init_device_mesh(device, mesh_shape, mesh_dim_names=("dp", "tp")[: len(mesh_shape)])
    model = model.to(device)
    inputs = tuple(t.to(device) for t in inputs)
    targets = tuple(t.to(device) for t in targets)
    pm = compile_quietly(
        model,
        mesh,
        inputs,
        loss_fn=loss_fn,
        example_targets=targets,
        device=name,
        memory_fraction=fraction,
    )
    step = _backward_step(pm, pm.shard_inputs(*inputs, *targets))
    for _ in range(3):
        step()
    counted = CollectiveBytes(mesh)
    with counted:
        step()
    # as many steps as fill ``seconds`` (rank 0's count, so every rank runs the same
    # collectives), at least ``steps``: a sub-ms collective on gloo costs 4 ms now and then
    # (a scheduler tick), and a step's mean holds those at the rate they come
    t0 = time.perf_counter()
    step()
    count = [max(steps, int(seconds / max(time.perf_counter() - t0, 1e-6)))]
    dist.broadcast_object_list(count, src=0)
    times = []
    # the ranks start together once, then run steps back to back as a training loop does (a
    # barrier before each step would add gloo's barrier to the step: ~0.14 ms on the mlp)
    dist.barrier()
    for _ in range(count[0]):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    plan = pm.plan
    return {
        "measured": median_of_means(times),
        "steps": len(times),
        "counted": counted.bytes,
        "predicted": step_length(schedule(plan)),
        "compute": plan.cost["compute_s"],
        "bytes": _on_gloo(plan) if backend == "gloo" else plan.collective_bytes(),
        "collectives": len(plan.collectives),
        "recompute": len(plan.recompute),
    }


GPU_WINDOWS = 3
"""Windows of a CUDA case's timed steps whose means are shown beside their mean."""

LLAMA, GPT, LLAMA_1B = GPU_MODELS
GPU_CASES = [
    # (label, example, its size, precision)
    ("hf-llama, zoo size (launch-bound)", "hf-llama", {}, "fp32"),
    (LLAMA, *GPU_MODELS[LLAMA], MIXED),
    (GPT, *GPU_MODELS[GPT], MIXED),
    (GPT, *GPU_MODELS[GPT], "fp32"),
    (LLAMA_1B, *GPU_MODELS[LLAMA_1B], MIXED),
]


def _kernel_kind(name: str) -> str:
    """A CUDA kernel's or an fx op's kind: matmul, attention, or other."""
    low = name.lower()
    if any(k in low for k in ("flash", "fmha", "attention", "sdpa", "cudnn")):
        return "attention"
    if any(k in low for k in ("gemm", "nvjet", "xmma", "cutlass", "mm", "matmul", "linear")):
        return "matmul"
    return "other"


def _measure_gpu(rank, world, profile_path, example, size, precision, seconds):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    import autopar
    from autopar.core.mesh import Mesh
    from autopar.core.schedule import COMPUTE
    from autopar.models import EXAMPLES
    from autopar.report import schedule, step_length

    torch.manual_seed(0)
    model, inputs, loss_fn, targets = EXAMPLES[example](device="cuda", **size)
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("dp",))
    keywords = dict(loss_fn=loss_fn, example_targets=targets, mp_policy=mp_policy(precision))
    predicted = {}
    with quiet():
        t0 = time.perf_counter()
        name = autopar.load_profile(profile_path).name
        pm = autopar.compile(model, mesh, inputs, device=name, **keywords)
        plan_s = time.perf_counter() - t0
        builtin = autopar.plan(model, Mesh.from_device_mesh(mesh, "h100"), inputs, **keywords)
    for name, plan in (("calibrated", pm.plan), ("h100", builtin)):
        spans = schedule(plan)
        kinds = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
        for s in spans:
            if s.stream == COMPUTE:
                kinds[_kernel_kind(s.what)] += s.dur_s
        predicted[name] = (step_length(spans), kinds, plan.host_s())
    step = _backward_step(pm, pm.shard_inputs(*inputs, *targets))
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    count = [max(3 * GPU_WINDOWS, int(seconds / max(time.perf_counter() - t0, 1e-6)))]
    dist.broadcast_object_list(count, src=0)
    times = []
    dist.barrier()
    for _ in range(count[0]):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    windows = [float(w.mean()) for w in np.array_split(np.asarray(times), GPU_WINDOWS)]
    # the kernels of a few steps, by kind (the profiler's own time is not in ``times``)
    traced = 3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(traced):
            step()
        torch.cuda.synchronize()
    measured_kinds = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for event in prof.key_averages():
        measured_kinds[_kernel_kind(event.key)] += event.self_device_time_total * 1e-6 / traced
    return {
        "measured": statistics.fmean(times),
        "windows": (min(windows), max(windows)),
        "steps": len(times),
        "predicted": predicted,
        "kinds": measured_kinds,
        "plan_s": plan_s,
    }


HOST_BOUND_IDLE = 0.25
"""A CUDA case is host-bound where the GPU sat idle for this share of its measured step or
more: the host's speed then sets the step, and it moves from one launch to the next."""


def _gpu_launch(profile_path: str, world: int, case: tuple, seconds: float) -> dict:
    _, example, size, precision = case
    return run_local(
        _measure_gpu, world, profile_path, example, size, precision, seconds, backend="nccl"
    )[0]


def host_bound(r: dict) -> bool:
    """Whether a CUDA launch's step was host-bound (``HOST_BOUND_IDLE``)."""
    return r["measured"] - sum(r["kinds"].values()) >= HOST_BOUND_IDLE * r["measured"]


def judged(launches: list[dict]) -> dict:
    """The launch a CUDA case is judged by: the one of median step time (the upper median
    of an even count), so its kinds and windows are one launch's."""
    ranked = sorted(launches, key=lambda r: r["measured"])
    return ranked[len(ranked) // 2]


def _gpu_table(profile_path: str, source: str, seconds: float, rounds: int) -> list:
    world = min(2, torch.cuda.device_count())
    # NOTE: a host-bound case launched once is judged by the host's minute: an H200's host
    # ran a bf16 GPT's step at 23.6 ms over one launch's 6 s and 18.6 ms over the next
    # run's. Every case is launched once; the host-bound ones ``rounds - 1`` more times,
    # in turn, and judged by the launch of median time.
    launches: list[list] = []
    for case in GPU_CASES:
        try:
            launches.append([_gpu_launch(profile_path, world, case, seconds)])
        except RuntimeError as e:  # one case's failure is a row of the table, not its end
            launches.append([e])
    again = [i for i, rs in enumerate(launches) if isinstance(rs[0], dict) and host_bound(rs[0])]
    for _ in range(rounds - 1):
        for i in again:
            try:
                launches[i].append(_gpu_launch(profile_path, world, GPU_CASES[i], seconds))
            except RuntimeError:  # judged by the launches that ran
                pass
    print()
    print_header(
        f"{torch.cuda.get_device_name()} x {world} (NCCL); {source}; forward + backward; the "
        f"mean step over {seconds:g} s (the least and the most of its {GPU_WINDOWS} windows' "
        "means beside it); a host-bound case (the GPU idle for "
        f"{HOST_BOUND_IDLE:.0%} of its step or more) launched {rounds} times in turn and "
        "judged by the launch of median step, its launches' steps listed; kinds: the step's "
        "time by kernel kind, predicted (calibrated profile) / measured (torch.profiler, 3 "
        "steps)",
        ["model", "precision", "mesh", "plan s", "steps timed", "measured ms", "windows ms",
         "launches ms", "predicted ms (calibrated)", "ratio", "predicted ms (built-in h100)",
         "ratio", "matmul ms", "attention ms", "other kernels ms", "GPU idle ms (measured)",
         "host ms (predicted)"],
    )  # fmt: skip
    misses = []
    for (label, _, _, precision), rs in zip(GPU_CASES, launches):
        if not isinstance(rs[0], dict):
            print(f"| {label} | {precision} | {world} | failed: {last_line(rs[0])} |")
            misses.append((label, precision, "failed"))
            continue
        r = judged(rs)
        measured = r["measured"]
        cal, cal_kinds, host = r["predicted"]["calibrated"]
        h100, _, _ = r["predicted"]["h100"]
        ratio = cal / measured
        if abs(ratio - 1) > GPU_TIME_TARGET:
            misses.append((label, precision, round(ratio, 3)))
        kinds = " | ".join(
            f"{cal_kinds[k] * 1e3:.2f} / {r['kinds'][k] * 1e3:.2f}"
            for k in ("matmul", "attention", "other")
        )
        each = ", ".join(f"{x['measured'] * 1e3:.2f}" for x in rs) if len(rs) > 1 else "one"
        idle = measured - sum(r["kinds"].values())
        print(
            f"| {label} | {precision} | {world} | {r['plan_s']:.1f} | {r['steps']} | "
            f"{measured * 1e3:.3f} | {r['windows'][0] * 1e3:.3f}-{r['windows'][1] * 1e3:.3f} | "
            f"{each} | {cal * 1e3:.3f} | {ratio:.2f} | {h100 * 1e3:.3f} | "
            f"{h100 / measured:.2f} | {kinds} | {idle * 1e3:.2f} | {host * 1e3:.2f} |",
            flush=True,
        )
    return misses


def _profile(path: str | None, quick: bool, device: str = "cpu") -> tuple[str, str]:
    """The profile's path and a line saying where it came from (calibrated on ``device``
    unless ``path`` names one)."""
    if path:
        return path, f"profile {path}"
    from autopar.calibrate import calibrate

    t0 = time.perf_counter()
    profile, _ = calibrate(name=f"calibrated-here-{device}", quick=quick, device=device)
    out = Path(tempfile.mkdtemp()) / "profile.json"
    out.write_text(profile.to_json())
    return str(out), f"profile calibrated here first ({time.perf_counter() - t0:.0f} s)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", help="a profile JSON (autopar calibrate); default: calibrate now")
    ap.add_argument("--quick", action="store_true", help="calibrate with fewer, smaller samples")
    ap.add_argument("--steps", type=int, default=20, help="the fewest steps timed")
    ap.add_argument("--seconds", type=float, default=2.0, help="time steps for this long")
    ap.add_argument(
        "--gpu-seconds", type=float, default=6.0, help="time each CUDA case's steps this long"
    )
    ap.add_argument(
        "--rounds", type=int, default=3, help="launches of each gloo case (the cases in turn)"
    )
    ap.add_argument("--check", action="store_true", help="fail when a target is missed")
    ap.add_argument("--gpu-profile", help="a profile JSON calibrated on this GPU")
    ap.add_argument(
        "--gpu-rounds", type=int, default=3, help="launches of each host-bound CUDA case"
    )
    ap.add_argument("--gpu-only", action="store_true", help="only the CUDA table")
    args = ap.parse_args(argv)
    gpu_misses: list = []
    if torch.cuda.is_available():
        path, source = _profile(args.gpu_profile, args.quick, "cuda")
        gpu_misses = _gpu_table(path, source, args.gpu_seconds, args.gpu_rounds)
        if args.check and gpu_misses:
            print(f"\nFAIL: predicted CUDA step time off by more than 15%: {gpu_misses}")
        if args.gpu_only:
            return 1 if args.check and gpu_misses else 0
        print()
    elif args.gpu_only:
        raise SystemExit("--gpu-only: no CUDA device here")
    path, source = _profile(args.profile, args.quick)
    print_header(
        f"{source}; fp32; forward + backward; the mean step (median of 5 runs' means) over "
        f"{args.seconds:g} s and at least {args.steps} steps, slowest rank, in each of "
        f"{args.rounds} launches of every case (the cases in turn): their median, and the "
        "least and most",
        ["backend", "model", "mesh", "budget", "collectives", "checkpointed layers",
         "predicted compute ms", "predicted step ms", "steps timed", "measured ms",
         "measured ms: least / most", "predicted / measured",
         "collective bytes predicted", "counted", "bytes ratio"],
    )  # fmt: skip
    # NOTE: the cases in turn, each launched ``--rounds`` times: on a shared VM the same
    # plan's step took 18 ms in one 2 s window and 23 ms in another ten minutes later, and
    # one launch per case judged the case by its minute
    launches: dict[tuple, list[list[dict]]] = {case: [] for case in CASES}
    for _ in range(args.rounds):
        for case in CASES:
            example, mesh_shape, fraction = case
            launches[case].append(
                run_local(
                    _measure,
                    math.prod(mesh_shape),
                    path,
                    example,
                    mesh_shape,
                    fraction,
                    args.steps,
                    args.seconds,
                    "gloo",
                    backend="gloo",
                )
            )
    time_misses, bytes_misses = [], []
    for case, rounds in launches.items():
        example, mesh_shape, fraction = case
        r0 = rounds[0][0]
        measured_each = [max(r["measured"] for r in results) for results in rounds]
        measured = statistics.median(measured_each)
        predicted = {results[0]["predicted"] for results in rounds}
        if len(predicted) > 1:  # one profile, one step: the same plan each launch
            raise RuntimeError(f"{case}: the launches planned different steps: {predicted}")
        ratio = r0["predicted"] / measured
        if abs(ratio - 1) > TIME_TARGET:
            time_misses.append((case, round(ratio, 3)))
        predicted_bytes, counted = r0["bytes"], r0["counted"]
        worst = 1.0
        for key in predicted_bytes.keys() | counted.keys():
            b_ratio = (predicted_bytes.get(key, 0) + 1) / (counted.get(key, 0) + 1)
            worst = b_ratio if abs(b_ratio - 1) > abs(worst - 1) else worst
        if abs(worst - 1) > BYTES_TARGET:
            bytes_misses.append((case, predicted_bytes, counted))
        steps = sum(results[0]["steps"] for results in rounds)
        print(
            f"| gloo | {example} | {'x'.join(map(str, mesh_shape))} | "
            f"{'device' if fraction is None else f'{fraction:.0%} of one device'} | "
            f"{r0['collectives']} | {r0['recompute']} | {r0['compute'] * 1e3:.3f} | "
            f"{r0['predicted'] * 1e3:.3f} | {steps} | {measured * 1e3:.3f} | "
            f"{min(measured_each) * 1e3:.3f} / {max(measured_each) * 1e3:.3f} | {ratio:.2f} | "
            f"{sum(predicted_bytes.values()):,} | {sum(counted.values()):,} | {worst:.4f} |",
            flush=True,
        )
    if args.check and gpu_misses:
        return 1
    if args.check and time_misses:
        print(f"\nFAIL: predicted step time off by more than the target: {time_misses}")
        return 1
    if args.check and bytes_misses:
        print(f"\nFAIL: collective bytes off by more than {BYTES_TARGET:.0%}: {bytes_misses}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

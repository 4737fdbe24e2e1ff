"""Run a function on N local processes joined in a gloo process group.

``run_local(fn, world_size, *args)`` starts ``world_size`` processes on this machine, each
initialises ``torch.distributed`` with gloo (or ``backend="nccl"``: rank r on CUDA device r)
on 127.0.0.1 at a free port, calls
``fn(rank, world_size, *args)``, and sends its return value back; the parent returns the
list of results in rank order, or raises with the failing rank's traceback (or, for a
process that died without reporting, its exit code, within ``_POLL_S``). A rank that died
without a word is named before the ranks that then failed (they lost their peer), and the
other processes are terminated: a failure never waits for a timeout.

The gloo processes are forked from multiprocessing's fork server (where the platform has
one), which imports autopar and the module that defines ``fn`` once, when the first
``run_local`` starts it. A spawned process imports torch and autopar on its own (~3.5 s
of CPU each), and ends with the interpreter's teardown (~1 s more, and the gloo race
where a group's threads outlive it). On a 2-core machine, 4 ranks that return at once
took 7.8-9.8 s from spawn to exit, against 0.11-0.13 s forked (3.4 s for the first call,
which starts the server); tests/distributed took 455 s against 850 s (with
passes/codegen's wrapping of local shards without views, measured beside it). NCCL
ranks are spawned: a module that touches CUDA when it is imported would leave the
server's forks unable to use it.

A forked process runs ``fn`` with the caller's environment as it is at this call (the
server's is the one the first call had); variables that torch reads when it is imported
take the server's values. It ends with ``os._exit``, as multiprocessing's forked
processes do: no teardown.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_local"]

_POLL_S = 0.5  # how often the parent looks for a process that died without reporting


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context(fn, backend: str):
    """The fork server's context, preloading autopar and ``fn``'s module; spawn for NCCL
    ranks, and where the platform has no fork server."""
    if backend == "nccl" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # (read when the server starts, at the first call; a later call's module is imported
    # by each process it forks)
    ctx.set_forkserver_preload(["autopar", fn.__module__])
    return ctx


def _worker(rank, world_size, port, fn, args, queue, backend, env):
    # the caller's environment, not the one the fork server started with
    os.environ.clear()
    os.environ.update(env)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local(fn, world_size: int, *args, timeout_s: float = 900.0, backend: str = "gloo"):
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo (or nccl) processes."""
    ctx = _context(fn, backend)
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, fn, args, queue, backend, env),
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world_size and not errors:
            try:
                rank, ok, value = queue.get(timeout=_POLL_S)
            except Empty:
                # a process that died without a word (killed, crashed, failed to start)
                for r, p in enumerate(procs):
                    if r not in results and p.exitcode not in (None, 0):
                        errors[r] = f"process exited with code {p.exitcode} before reporting"
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(results))
                    errors[missing[0]] = f"no result within {timeout_s:.0f} s"
                continue
            (results if ok else errors)[rank] = value
        if errors:  # a peer's error can arrive before its dead cause is seen: look again
            grace = time.monotonic() + 4 * _POLL_S
            while time.monotonic() < grace:
                for r, p in enumerate(procs):
                    if r not in results and r not in errors and p.exitcode not in (None, 0):
                        errors[r] = f"process exited with code {p.exitcode} before reporting"
                time.sleep(_POLL_S / 5)
    finally:
        for p in procs:
            if errors:
                p.terminate()
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if errors:
        # a rank that died without a word is the cause; the others' errors (a peer lost in
        # a collective) follow from it
        silent = [r for r, e in errors.items() if e.startswith("process exited")]
        rank = min(silent or errors)
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{errors[rank]}")
    return [results[r] for r in range(world_size)]

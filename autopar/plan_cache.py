"""The plan cache: planning the same step for the same mesh again reads the plan back.

A plan is a deterministic function of what the key holds (``key``):
    - the traced step graph's fingerprint (its ops, shapes, dtypes and edges: the model,
      the batch's shapes and the precision policy as traced);
    - the mesh (shape, axis names, device, ranks per node) and the device profile's
      constants (``repr`` of the ``DeviceProfile``: a changed constant is another key);
    - the planning options (``PlanOptions``: budget, fraction, skipped stages, optimizer,
      checkpointing, the solver's time limit);
    - the versions of autopar and torch, and a digest of the planner's own source (every
      ``.py`` file of ``autopar``, ``autopar.passes`` and ``autopar.cost_models``): a
      change to the code that plans is another key, whatever the version says.

So a hit is the plan the search would make, byte for byte (``Plan.to_json()``); the stage
timings it keeps are those of the run that made it, and ``stats["cache_s"]`` says it was
read from the cache. A solve stopped by its time limit is not stored (another run may find
a better plan).

Where: ``$AUTOPAR_CACHE_DIR``, else ``$XDG_CACHE_HOME/autopar``, else
``~/.cache/autopar``; one file per key, ``plans/<key>.json``. A file that does not read
back as a plan is a miss (and is replaced).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from . import core, cost_models, passes
from .core import Mesh, Plan, __version__
from .cost_models import get_profile
from .passes.pipeline import PlanOptions

__all__ = ["cache_dir", "key", "load", "store"]

log = logging.getLogger("autopar")


def cache_dir() -> Path:
    """The directory the plans are kept in (module docstring)."""
    if os.environ.get("AUTOPAR_CACHE_DIR"):
        return Path(os.environ["AUTOPAR_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "autopar"


def key(fingerprint: str, mesh: Mesh, options: PlanOptions) -> str:
    """The cache key of a plan (module docstring)."""
    opts = dataclasses.asdict(options)
    opts["skip"] = sorted(opts["skip"])
    parts = {
        "graph": fingerprint,
        "mesh": [list(mesh.shape), list(mesh.axis_names), mesh.device, mesh.ranks_per_node],
        "profile": repr(get_profile(mesh.device)),
        "options": opts,
        "versions": [__version__, torch.__version__],
        "code": _code_digest(),
    }
    text = json.dumps(parts, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@functools.cache
def _code_digest() -> str:
    """sha256 of the planner's source files, read once per process (module docstring)."""
    digest = hashlib.sha256()
    for package in (core, cost_models, passes):
        root = Path(str(package.__file__)).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    root = Path(__file__).parent
    for path in sorted(root.glob("*.py")):  # autopar's own modules (api, experts, ...)
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _path(k: str) -> Path:
    return cache_dir() / "plans" / f"{k}.json"


def load(k: str) -> Plan | None:
    """The cached plan of key ``k``, or None."""
    path = _path(k)
    if not path.is_file():
        return None
    t0 = time.perf_counter()
    try:
        plan = Plan.load(path)
    except (ValueError, KeyError, TypeError, OSError):
        log.info("autopar: plan cache: %s does not read back; planning again", path)
        return None
    stats = {**plan.stats, "cache_s": time.perf_counter() - t0}
    log.info("autopar: plan cache hit (%s)", path)
    return dataclasses.replace(plan, stats=stats)


def store(k: str, plan: Plan) -> None:
    """Keep ``plan`` under key ``k`` (not a plan the solver's time limit stopped)."""
    if plan.solver_status == "time_limit":
        return
    path = _path(k)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(plan.to_json(timings=True))
        tmp.replace(path)  # atomic: a reader sees the old file or the new one
    except OSError as e:  # a read-only home is no reason to fail a plan
        log.warning("autopar: plan cache: cannot write %s (%s)", path, e)

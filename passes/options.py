"""The planning options: one ``PlanOptions``, built once from the caller's keywords and passed
whole down the pipeline to the solver.

Takes: the keywords of ``autopar.plan`` / ``compile`` / ``evaluate`` and of the command line's
planning flags (``PlanOptions.of``: each field by its name, and two conveniences, ``fold`` and
``bucket_mb``). Returns: a frozen, validated ``PlanOptions``; its fields in the text form the
plan cache hashes (autopar/plan_cache: ``dataclasses.asdict``) and the solver reads.

A new knob is one field here (its docstring is its documentation) and, for the command line,
one flag (autopar/cli ``PLAN_FLAGS``): ``plan``, ``compile`` and ``evaluate`` pass their
keywords through ``of``, and the pipeline hands the whole object on (passes/pipeline
``State.options``, passes/solve ``solve``). The stage names ``skip`` may hold are checked by
the pipeline, which owns its stages (passes/pipeline ``check_skip``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autopar.core import parse_placements, placement_str

from .buckets import DEFAULT_BUCKET_BYTES
from .memory_sizes import OPTIMIZERS
from .pins import Pin

__all__ = ["PlanOptions"]


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """What the planning stages take besides the model and the mesh."""

    time_limit_s: float = 600.0
    """The solver's time limit in seconds."""

    memory_budget: float | None = None
    """The most bytes one rank may hold at any point of the step (its parameters, gradients,
    optimizer state, saved activations, temporaries, collective buffers and batch;
    passes/memory). None: the device profile's usable memory (``mem_capacity -
    mem_reserve``); ``math.inf``: no bound."""

    memory_fraction: float | None = None
    """Instead of ``memory_budget``: this fraction of what one device holds running the
    whole step."""

    skip: frozenset[str] = frozenset()
    """Names of pipeline stages not to run (the skippable ones: ``fold``, ``order``,
    ``buckets``, ``prefetch``, ``memory``; passes/pipeline). ``fold=False`` is
    ``skip={"fold"}``: every node planned on its own (slower, for comparison);
    ``{"buckets"}`` reduces each gradient alone at the backward's end."""

    optimizer: str = "adamw"
    """Whose state the step memory counts (passes/memory ``OPTIMIZERS``: ``adamw``,
    ``sgd_momentum``, ``sgd``, ``none``)."""

    checkpointing: bool = True
    """Where the budget binds, the solver may recompute layers' activations in the backward
    instead of keeping them (priced in step time; passes/remat); False keeps every
    activation."""

    constraints: tuple[tuple[str, str], ...] = ()
    """Placements fixed before the search: ``(pattern, placements text)`` pairs, an
    ``fnmatch`` pattern over parameter names (or ``"input:N"``, the N-th input, then the
    targets) and one placement per mesh axis (passes/pins; ``autopar.experts`` has the usual
    ones). ``of`` takes ``{pattern: placements}`` with torch ``Placement``s or their text
    (``{"layers.*.wq.weight": (Replicate(), Shard(0)), "input:0": "S(0),R"}``)."""

    pins: tuple[Pin, ...] = ()
    """Nodes fixed to strategies before the search (a whole plan: ``autopar.evaluate``)."""

    bucket_bytes: float = DEFAULT_BUCKET_BYTES
    """The gradients reduced over one axis or several (all-reduced, or reduce-scattered into
    sharded parameters) go in buckets of about this many bytes, each issued once its last
    gradient is made (passes/buckets; DDP's default 25 MiB). ``of`` takes ``bucket_mb``."""

    forbid: tuple[tuple[tuple[str, str], ...], ...] = ()
    """Choices the plan may not make: each a tuple of ``(node, placements text)``, at least
    one of which the plan changes (passes/solve ``forbid_choice``; ``autopar explain``)."""

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r}: one of {sorted(OPTIMIZERS)}")
        if not self.time_limit_s > 0:
            raise ValueError(f"time_limit_s must be > 0, got {self.time_limit_s}")
        if not self.bucket_bytes > 0:
            raise ValueError(f"bucket_bytes must be > 0, got {self.bucket_bytes}")
        if self.memory_budget is not None and not self.memory_budget > 0:
            raise ValueError(
                f"memory_budget must be a positive number of bytes, got {self.memory_budget}"
            )
        if self.memory_fraction is not None:
            if self.memory_budget is not None:
                raise ValueError("give memory_budget or memory_fraction, not both")
            if not self.memory_fraction > 0:
                raise ValueError(f"memory_fraction must be > 0, got {self.memory_fraction}")

    @classmethod
    def of(cls, options: PlanOptions | None = None, /, **knobs) -> PlanOptions:
        """``options`` (default: the defaults) with ``knobs`` set: each a field by its name,
        in the forms the public API takes (module docstring), or ``fold`` (False: ``"fold"``
        added to ``skip``) and ``bucket_mb`` (``bucket_bytes`` in MiB). An unknown name is a
        ``TypeError`` that lists the known ones."""
        fold = knobs.pop("fold", True)
        if "bucket_mb" in knobs:
            if "bucket_bytes" in knobs:
                raise TypeError("give bucket_mb or bucket_bytes, not both")
            knobs["bucket_bytes"] = knobs.pop("bucket_mb") * 2**20
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(knobs) - names)
        if unknown:
            known = ", ".join(sorted(names | {"fold", "bucket_mb"}))
            raise TypeError(f"unknown planning option(s) {unknown}; the options are: {known}")
        base = options if options is not None else cls()
        if "skip" in knobs:
            knobs["skip"] = frozenset(knobs["skip"])
        if not fold:
            knobs["skip"] = frozenset(knobs.get("skip", base.skip)) | {"fold"}
        if "constraints" in knobs:
            knobs["constraints"] = constraint_texts(knobs["constraints"])
        if "pins" in knobs:
            knobs["pins"] = tuple(knobs["pins"])
        if "forbid" in knobs:
            knobs["forbid"] = tuple(
                tuple((str(n), str(t)) for n, t in choice) for choice in knobs["forbid"]
            )
        return dataclasses.replace(base, **knobs)

    @property
    def fold(self) -> bool:
        """Whether the instances of a repeated layer share one set of choices (passes/fold)."""
        return "fold" not in self.skip


def constraint_texts(constraints) -> tuple[tuple[str, str], ...]:
    """``{pattern: placements}`` (or its pairs) as ``(pattern, "R,S(0)")`` pairs: the
    placements are torch ``Placement``s (one per mesh axis) or their text (``"R,S(0)"``,
    ``["R", "S(0)"]``); the rules' entries (``reshard:*``, ``sequence``, ``context``; passes/pins)
    keep their text."""
    if not constraints:
        return ()
    out = []
    for pattern, value in dict(constraints).items():
        if str(pattern).startswith("reshard:") or pattern in ("sequence", "context"):  # rules
            out.append((str(pattern), str(value)))
            continue
        if isinstance(value, str):
            texts = [t.strip() for t in value.split(",")]
        else:
            texts = [v.strip() if isinstance(v, str) else placement_str(v) for v in value]
        try:
            parse_placements(texts)
        except (ValueError, KeyError) as e:
            raise ValueError(f"constraint {pattern!r}: {value!r} is not placements: {e}") from None
        out.append((str(pattern), ",".join(texts)))
    return tuple(out)

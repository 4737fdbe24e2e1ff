"""The link's fit: the cost model's collective time fitted to measured collectives.

The model of cost_models.comm, for a collective of ``kind`` on ``n`` ranks moving ``S``
bytes (as the cost model counts them),

    t = o + steps(kind, n) a + factor(kind, n) S / bw

    steps     2 (n - 1) for an all-reduce, n - 1 for the other kinds (a ring's steps)
    factor    2 (n - 1) / n for an all-reduce, (n - 1) / n for the other kinds

is linear in (o, a, 1/bw) (``_terms``). ``fit_link`` solves it by least squares over
relative errors (each row divided by its measured time, so that a 4 KiB call weighs as much
as a 4 MiB one) with o, a, 1/bw >= 0: every subset of the terms that holds the bandwidth is
solved, and the non-negative solution of least error kept. That gives the profile's
``collective_overhead``, ``intra_node_latency`` and ``intra_node_bandwidth``. Where the
bandwidth explains under 5% of the largest message's time the times do not grow with size
and the fit refuses (calibration/link.py then measures larger messages).

Then per kind the geometric mean of measured over fitted time (``kind_scales``,
``collective_scale``): the fit is one link for every kind, and a library may run a kind by
another algorithm than the ring. ``link_errors`` is each sample's relative error.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence

import numpy as np

from ..cost_models import collective_time

__all__ = ["Sample", "fit_link", "kind_scales", "link_errors"]

Sample = tuple[str, int, float, float]
"""One collective measured: ``(kind, ranks, bytes as the cost model counts them, seconds)``."""


def _terms(kind: str, n: int, nbytes: float) -> tuple[float, float, float]:
    """Coefficients of (overhead, latency, seconds per byte) in the ring model."""
    steps = n - 1
    if kind == "all_reduce":
        return 1.0, 2.0 * steps, 2.0 * steps / n * nbytes
    return 1.0, float(steps), steps / n * nbytes


def fit_link(samples: Sequence[Sample]) -> tuple[float, float, float]:
    """``(overhead_s, latency_s, bandwidth_Bps)`` of the ring model that best fits
    ``samples`` in relative error, every term >= 0 (each subset of the terms is solved by
    least squares, the best non-negative solution kept)."""
    if not samples:
        raise ValueError("no collective samples to fit")
    a = np.array([_terms(k, n, b) for k, n, b, _ in samples], dtype=float)
    t = np.array([s[3] for s in samples], dtype=float)
    a_rel, ones = a / t[:, None], np.ones(len(t))
    best: tuple[float, np.ndarray] | None = None
    for cols in itertools.chain.from_iterable(
        itertools.combinations(range(3), r) for r in (1, 2, 3)
    ):
        if 2 not in cols:  # without a bandwidth the model cannot grow with size
            continue
        x, *_ = np.linalg.lstsq(a_rel[:, cols], ones, rcond=None)
        if (x < 0).any():
            continue
        full = np.zeros(3)
        full[list(cols)] = x
        err = float(np.sum((a_rel @ full - 1.0) ** 2))
        if best is None or err < best[0]:
            best = (err, full)
    # the bandwidth must explain a part of the largest message's time, else it is noise
    largest = int(np.argmax(a[:, 2]))
    if best is None or best[1][2] * a[largest, 2] < 0.05 * t[largest]:
        raise ValueError(
            "the collective times do not grow with size: cannot fit a bandwidth "
            "(measure larger messages)"
        )
    overhead, latency, inv_bw = best[1]
    return float(overhead), float(latency), float(1.0 / inv_bw)


def kind_scales(
    samples: Sequence[Sample], overhead: float, latency: float, bandwidth: float
) -> tuple[tuple[str, float], ...]:
    """Per kind, the geometric mean of measured over fitted time across its samples
    (``DeviceProfile.collective_scale``): the fit is one link for every kind, and a
    library may run a kind by another algorithm than the ring."""
    logs: dict[str, list[float]] = {}
    for k, n, b, t in samples:
        fitted = collective_time(k, b, n, latency, bandwidth, overhead=overhead)
        if fitted > 0 and t > 0:
            logs.setdefault(k, []).append(math.log(t / fitted))
    return tuple((k, float(math.exp(statistics.mean(v)))) for k, v in sorted(logs.items()))


def link_errors(
    samples: Sequence[Sample],
    overhead: float,
    latency: float,
    bandwidth: float,
    scale: Sequence[tuple[str, float]] = (),
) -> list[float]:
    """Relative error of the fitted model (times ``scale``'s factor for the kind) on each
    sample (predicted / measured - 1)."""
    factor = dict(scale)
    return [
        factor.get(k, 1.0) * collective_time(k, b, n, latency, bandwidth, overhead=overhead) / t
        - 1.0
        for k, n, b, t in samples
    ]

"""Statistics over a sweep's seeds: per-point summaries, paired differences, the Pareto front.

Pure functions over numbers (no runs, no files), so the sweep's table, its ``summary.json`` and
its plots say the same thing and each piece of math is testable on a hand-made sample.

**Why a t-interval.** A sweep point has few seeds (2 to 5 is typical): too few for a bootstrap,
whose percentiles over 3 values are the values themselves. The Student t-interval
``mean ± t(1 − α/2, n − 1) · s / √n`` is the standard interval for the mean of a small sample
assumed roughly normal, and it is exact for normal data at any n ≥ 2. The t quantile comes from
``scipy.stats.t`` (scipy is installed with every geoloco: ``dp-accounting``, a required
dependency, requires it), not from a table of our own.

**Why paired differences.** Two points run with the same seed share their data order and initial
weights, so most of the seed-to-seed noise cancels in the per-seed difference. The interval of
the mean difference over the shared seeds is then much narrower than comparing two independent
intervals, and says whether a point beats the baseline on these seeds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = [
    "CONFIDENCE",
    "PairedDifference",
    "SeedStats",
    "paired_difference",
    "pareto_front",
    "seed_stats",
    "t_quantile",
]

CONFIDENCE = 0.95
"""Two-sided confidence level of every interval the sweep reports."""


def t_quantile(df: int, confidence: float = CONFIDENCE) -> float:
    """The two-sided Student t quantile ``t(1 − α/2, df)`` (``df = 1``: 12.706 at 95 %)."""
    from scipy import stats

    if df < 1:
        raise ValueError(f"a t quantile needs df >= 1, got {df}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return float(stats.t.ppf(0.5 + confidence / 2.0, df))


@dataclass(frozen=True, slots=True)
class SeedStats:
    """One metric of one point over its seeds (or one paired difference over the shared seeds)."""

    n: int
    """Values the statistics are over (seeds with a finished run and a value)."""
    mean: float
    std: float | None
    """Sample standard deviation (``ddof = 1``); ``None`` for one value."""
    ci_low: float | None
    """Lower end of the ``confidence`` t-interval of the mean; ``None`` for one value."""
    ci_high: float | None
    """Upper end of the t-interval; ``None`` for one value."""
    min: float
    max: float
    confidence: float = CONFIDENCE

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def seed_stats(values: Sequence[float], confidence: float = CONFIDENCE) -> SeedStats | None:
    """``n``, mean, sample std and the t-interval of the mean of ``values``; ``None`` without
    values. With one value the spread is unknown: ``std`` and the interval are ``None``."""
    data = np.asarray(values, dtype=np.float64)
    n = int(data.size)
    if n == 0:
        return None
    mean = float(data.mean())
    if n == 1:
        return SeedStats(n=1, mean=mean, std=None, ci_low=None, ci_high=None, min=mean, max=mean,
                         confidence=confidence)
    std = float(data.std(ddof=1))
    half = t_quantile(n - 1, confidence) * std / math.sqrt(n)
    return SeedStats(
        n=n, mean=mean, std=std, ci_low=mean - half, ci_high=mean + half,
        min=float(data.min()), max=float(data.max()), confidence=confidence,
    )


@dataclass(frozen=True, slots=True)
class PairedDifference:
    """One metric of a point minus the baseline's, seed by seed (same seed paired)."""

    seeds: tuple[int, ...]
    """The seeds paired: every seed with a value at the baseline."""
    stats: SeedStats | None
    """Of the per-seed differences ``point − baseline``; ``None`` when unpaired."""
    unpaired: str | None = None
    """Why the point could not be paired (a seed of the baseline without a value here)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "seeds": list(self.seeds),
            "unpaired": self.unpaired,
            **({} if self.stats is None else {"difference": self.stats.to_dict()}),
        }


def paired_difference(
    point: Mapping[int, float], baseline: Mapping[int, float], confidence: float = CONFIDENCE
) -> PairedDifference:
    """The mean of ``point[s] − baseline[s]`` over every seed ``s`` of the baseline, with its
    t-interval. ``point`` and ``baseline`` map seeds to values (seeds without a value left out).
    A point that lacks one of the baseline's seeds is unpaired, with the seeds it lacks: pairing
    over fewer seeds would compare the point with a different baseline than the other points."""
    seeds = tuple(sorted(baseline))
    if not seeds:
        return PairedDifference(seeds=(), stats=None, unpaired="the baseline has no value for any seed")
    missing = [s for s in seeds if s not in point]
    if missing:
        listed = ", ".join(str(s) for s in missing)
        plural = "s" if len(missing) > 1 else ""
        return PairedDifference(seeds=seeds, stats=None, unpaired=f"no value for seed{plural} {listed} of the baseline")
    return PairedDifference(
        seeds=seeds, stats=seed_stats([point[s] - baseline[s] for s in seeds], confidence)
    )


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the non-dominated ``(x, y)`` points, both minimized, in increasing ``x``.

    A point is dominated when another is no worse in both and better in one; equal points
    dominate neither other, so both stay on the front. Points with a non-finite coordinate are
    never on it. Quadratic in the points, which a sweep counts in tens."""
    finite = [i for i, (x, y) in enumerate(points) if math.isfinite(x) and math.isfinite(y)]
    front = [
        i for i in finite
        if not any(
            points[j][0] <= points[i][0] and points[j][1] <= points[i][1] and points[j] != points[i]
            for j in finite
        )
    ]
    return sorted(front, key=lambda i: (points[i][0], points[i][1], i))

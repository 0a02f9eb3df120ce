"""Magnitude bounds on what enters a round and on what leaves it: the coordinator's safety net.

A finite value can still be absurd: an update near the float32 maximum passes ``isfinite``
and overflows the aggregate, and a finite ``sample_weight`` of 1e38 overflows the buffer it
scales. One site must not be able to take the run down that way, so:

* each update's L2 norm must stay within ``max(norm_floor, norm_factor * median)``, the median
  of the norms of the updates aggregated in the last ``norm_window`` rounds (only the floor
  applies before any round was aggregated); its ``sample_weight`` and its weight under the
  run's weighting within ``max_sample_weight``. An update outside is rejected for its round
  (INVALID_ARGUMENT with the reason);
* the round's mean update must be finite before the outer step uses it, and the new weights
  finite and within ``max_abs_weight`` before they are checkpointed or broadcast; otherwise the
  round is aborted with the model unchanged (``RoundAbortedError``).

This is a sanity check on absurd inputs, not robust aggregation: updates within the bounds are
averaged as the run's aggregation says. Pure checks plus the norm history; no I/O, no locks
(the intake and the round phases call it under the round context's lock).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from geoloco.algorithms.aggregation import Aggregation
from geoloco.algorithms.config import require
from geoloco.compression import Encoded

__all__ = ["GuardedAggregation", "RoundAbortedError", "UpdateGuard", "UpdateGuardConfig", "value_range"]


@dataclass(kw_only=True, slots=True)
class UpdateGuardConfig:
    """``[update_guard]``: how large an update, a weight and the global weights may be."""

    norm_factor: float = 100.0
    """An update's L2 norm may be at most this many times the median norm of the updates
    aggregated in the last ``norm_window`` rounds (or ``norm_floor``, whichever is larger)."""
    norm_floor: float = 1e4
    """Norm every update may have whatever the history (the only bound before the first round
    is aggregated): far above any real pseudo-gradient, far below float32 overflow."""
    norm_window: int = 10
    """Rounds whose aggregated updates' norms make the median."""
    max_sample_weight: float = 1e12
    """Largest ``sample_weight`` (samples or tokens of one round) and largest weight under the
    run's weighting (``steps``: inner steps) an update may carry."""
    max_abs_weight: float = 1e6
    """Largest absolute value of a global weight after a round; a round whose outer step goes
    beyond it is aborted with the model unchanged."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for key in ("norm_factor", "norm_floor", "max_sample_weight", "max_abs_weight"):
            value = getattr(self, key)
            require(
                math.isfinite(value) and value > 0,
                key,
                f"must be a finite number > 0, got {value}",
            )
        require(self.norm_factor >= 1, "norm_factor", f"must be >= 1, got {self.norm_factor}")
        require(self.norm_window >= 1, "norm_window", f"must be >= 1 round, got {self.norm_window}")


class RoundAbortedError(Exception):
    """The round's arithmetic went out of bounds: abort it with the model unchanged."""


def value_range(values: torch.Tensor) -> tuple[float, float]:
    """(min, max) of ``values`` in one reduction, no temporary of its size; NaN propagates."""
    low, high = torch.aminmax(values.detach().reshape(-1))
    return float(low), float(high)


def _out_of_range(values: torch.Tensor, limit: float) -> str | None:
    """Why ``values`` is not finite or not within ``[-limit, limit]``; None when it is."""
    if values.numel() == 0:
        return None
    low, high = value_range(values)
    if not (math.isfinite(low) and math.isfinite(high)):
        return "are not finite (NaN, Inf or float32 overflow)"
    largest = max(-low, high)
    if largest > limit:
        return f"reach |value| {largest:.4g}, beyond max_abs_weight {limit:.4g}"
    return None


def update_norm(update: torch.Tensor) -> float:
    """L2 norm of a finite update; computed again in float64 where float32 squares overflow, so
    a large-but-finite update gets its true norm rather than inf."""
    norm = float(torch.linalg.vector_norm(update))
    if not math.isfinite(norm):
        norm = float(torch.linalg.vector_norm(update, dtype=torch.float64))
    return norm


@dataclass(slots=True)
class UpdateGuard:
    """The bounds of ``UpdateGuardConfig`` and the recent rounds' update norms they use."""

    config: UpdateGuardConfig
    _rounds: deque[list[float]] = field(init=False)
    """Norms of the updates aggregated in each of the last ``norm_window`` rounds."""
    _pending: dict[int, dict[str, float]] = field(default_factory=dict, init=False)
    """round -> site -> norm of an update accepted into that open round."""

    def __post_init__(self) -> None:
        self._rounds = deque(maxlen=self.config.norm_window)

    # -- intake --

    def norm_bound(self) -> float:
        norms = [n for r in self._rounds for n in r]
        relative = self.config.norm_factor * statistics.median(norms) if norms else 0.0
        return max(self.config.norm_floor, relative)

    def check_norm(self, norm: float) -> str | None:
        """Why an update of L2 norm ``norm`` is refused, or None. The norm comes from
        ``update_norm`` of a decoded update or, without one, ``geoloco.compression.decoded_norm``."""
        bound = self.norm_bound()
        if not norm <= bound:
            c = self.config
            return (
                f"its L2 norm {norm:.4g} exceeds the bound {bound:.4g} (update_guard: the larger "
                f"of norm_floor {c.norm_floor:.4g} and norm_factor {c.norm_factor:g} x the median "
                f"norm of the last {c.norm_window} rounds' updates)"
            )
        return None

    def check_weight(self, what: str, value: float) -> str | None:
        """Why ``what`` (``sample_weight``, or the weight under the run's weighting) is refused."""
        limit = self.config.max_sample_weight
        if not value <= limit:
            return (
                f"{what} {value:.4g} exceeds update_guard.max_sample_weight {limit:.4g}; send the "
                "samples (or tokens) trained on this round"
            )
        return None

    def accepted(self, round_number: int, site: str, norm: float) -> None:
        """``site``'s update of norm ``norm`` entered the open round ``round_number``."""
        self._pending.setdefault(round_number, {})[site] = norm

    def round_done(self, round_number: int, contributors: Iterable[str] | None) -> None:
        """Round ``round_number`` was aggregated by ``contributors`` (None: it was aborted,
        its norms do not count)."""
        norms = self._pending.pop(round_number, {})
        for stale in [r for r in self._pending if r < round_number]:
            del self._pending[stale]
        if contributors is not None:
            kept = [norms[site] for site in contributors if site in norms]
            if kept:
                self._rounds.append(kept)

    # -- aggregation --

    def check_mean(self, mean: torch.Tensor) -> None:
        """Raise ``RoundAbortedError`` unless the round's mean update is finite."""
        low, high = value_range(mean) if mean.numel() else (0.0, 0.0)
        if not (math.isfinite(low) and math.isfinite(high)):
            raise RoundAbortedError(
                "the round's mean update is not finite (the accepted updates overflowed float32 "
                "when summed)"
            )

    def check_weights(self, weights: torch.Tensor) -> None:
        """Raise ``RoundAbortedError`` unless the new global weights are finite and within
        ``max_abs_weight`` (checked before they are checkpointed or broadcast)."""
        why = _out_of_range(weights, self.config.max_abs_weight)
        if why is not None:
            raise RoundAbortedError(f"the new global weights {why}")

    # -- checkpoints --

    def state(self) -> list[list[float]]:
        return [list(r) for r in self._rounds]

    def load_state(self, rounds: Sequence[Sequence[float]]) -> None:
        self._rounds.clear()
        for norms in rounds:
            kept = [float(n) for n in norms if math.isfinite(float(n)) and float(n) >= 0]
            if kept:
                self._rounds.append(kept)


class GuardedAggregation:
    """A round's aggregation whose mean is checked (``UpdateGuard.check_mean``) as it is
    handed to the outer step: an overflowed sum aborts the round before the outer optimizer's
    state or the weights see it."""

    def __init__(self, inner: Aggregation, guard: UpdateGuard) -> None:
        self.inner = inner
        self.guard = guard

    @property
    def sites(self) -> list[str]:
        return self.inner.sites

    def add(self, update: Encoded | torch.Tensor, weight: float = 1.0, *, site: str, stale: bool = False) -> None:
        self.inner.add(update, weight, site=site, stale=stale)

    def take_result(self) -> torch.Tensor:
        mean = self.inner.take_result()
        self.guard.check_mean(mean)
        return mean

"""The adaptive round deadline: learnt from the arrival times of recent rounds.

A fixed ``round_deadline_s`` is either too long (a fast fleet waits for nothing at the end of
every round a site fails) or too short (a slow link is cut off every round). The adaptive policy
sets round ``t``'s deadline (seconds after the round started) from what it saw::

    D_t = clamp(margin · quantile_q(durations of the last `window` rounds), min_s, max_s)

where a duration is ``arrival − round start`` of one upload. A site that did not arrive by the
close is counted at the round's length (a *censored* observation: it needed at least that
long), so a deadline that cuts a site off grows by ``margin`` each round until the site fits or
``max_s`` is reached, and shrinks back once nobody is late. Before the first observation the
deadline is the configured ``round_deadline_s`` if any, else ``max_s`` (nobody is cut off while
nothing is known). The quantile is linear-interpolated (numpy's default), so it is well defined
for a handful of samples. Pure: the coordinator and the simulator feed it durations and read
``current_s``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from geoloco.algorithms.config import config_to_dict, require

__all__ = ["AdaptiveDeadlineConfig", "RoundDeadline", "quantile"]


@dataclass(kw_only=True, slots=True)
class AdaptiveDeadlineConfig:
    """``[adaptive_deadline]``: derive each round's deadline from observed arrival times."""

    enabled: bool = False
    """Off: the fixed ``round_deadline_s`` (or none) applies to every round."""
    quantile: float = 0.9
    """Which arrival to plan for: 0.9 = the 90th percentile of recent upload durations (1.0 =
    the slowest; lower values deliberately leave the slowest site out)."""
    margin: float = 1.5
    """Factor on that quantile (>= 1), room for jitter; also how fast the deadline grows while a
    site keeps missing it."""
    window: int = 5
    """Rounds of arrival times remembered."""
    min_s: float = 1.0
    """Lower bound of the deadline in seconds."""
    max_s: float = 600.0
    """Upper bound of the deadline in seconds, and the deadline before anything was observed
    (unless ``round_deadline_s`` is set)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        require(0 < self.quantile <= 1, "quantile", f"must be in (0, 1], got {self.quantile}")
        require(
            math.isfinite(self.margin) and self.margin >= 1,
            "margin",
            f"must be >= 1 (a deadline below the observed arrivals cuts sites off), got {self.margin}",
        )
        require(self.window >= 1, "window", f"must be >= 1 rounds, got {self.window}")
        require(
            math.isfinite(self.min_s) and self.min_s > 0,
            "min_s",
            f"must be > 0 seconds, got {self.min_s}",
        )
        require(
            math.isfinite(self.max_s) and self.max_s >= self.min_s,
            "max_s",
            f"must be a finite number of seconds >= min_s ({self.min_s}), got {self.max_s}",
        )

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile of ``values`` with linear interpolation between order statistics."""
    if not values:
        raise ValueError("quantile of no values")
    if not 0 <= q <= 1:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


class RoundDeadline:
    """The deadline in force for the next round: fixed, none, or adaptive (module docstring)."""

    def __init__(self, fixed_s: float | None, adaptive: AdaptiveDeadlineConfig | None = None) -> None:
        if fixed_s is not None and not (math.isfinite(fixed_s) and fixed_s > 0):
            raise ValueError(f"round deadline must be > 0 seconds or None, got {fixed_s}")
        self.fixed_s = fixed_s
        self.adaptive = adaptive if adaptive is not None and adaptive.enabled else None
        self._rounds: deque[list[float]] = deque(
            maxlen=self.adaptive.window if self.adaptive is not None else 1
        )

    @property
    def is_adaptive(self) -> bool:
        return self.adaptive is not None

    @property
    def observed(self) -> list[float]:
        """The durations the next deadline is computed from (oldest round first)."""
        return [d for durations in self._rounds for d in durations]

    def current_s(self) -> float | None:
        """Seconds after the round's start at which its uploads close (None: no deadline)."""
        policy = self.adaptive
        if policy is None:
            return self.fixed_s
        durations = self.observed
        if not durations:
            return self.fixed_s if self.fixed_s is not None else policy.max_s
        planned = policy.margin * quantile(durations, policy.quantile)
        return min(policy.max_s, max(policy.min_s, planned))

    def state(self) -> list[list[float]]:
        """The observed rounds, for a checkpoint (a restarted coordinator keeps its deadline)."""
        return [list(durations) for durations in self._rounds]

    def load_state(self, rounds: Sequence[Sequence[float]]) -> None:
        self._rounds.clear()
        if self.adaptive is not None:
            for durations in rounds:
                self._rounds.append([float(d) for d in durations])

    def observe(self, arrivals_s: Sequence[float], missed_s: Sequence[float] = ()) -> None:
        """Record one round: ``arrivals_s`` are uploads' ``arrival − start``; ``missed_s`` one
        entry per site that had not arrived when the round closed (its ``close − start``)."""
        durations = [max(0.0, float(d)) for d in (*arrivals_s, *missed_s)]
        if durations and self.adaptive is not None:
            self._rounds.append(durations)

"""Chaos for the simulator: failures, repairs and slowdowns of every site, drawn from one seed,
and the two numbers that say what they cost: goodput and global downtime.

Decoupled DiLoCo (Douillard et al. 2026) borrows "chaos engineering" to show that training on
many independent learners survives hardware that keeps failing; this module is that failure
model, for the event-driven simulator (``geoloco.algorithms.simulation.async_sim``), so the synchronous and
the asynchronous rule can be run on *the same* failures and compared.

The schedule (``ChaosSchedule``) is a fact about the hardware, not about the training: site
``k`` alternates up and down periods whatever it is doing, up periods exponential with mean
``mtbf_s`` (mean time between failures), down periods exponential with mean ``repair_s``; apart
from that it has slowdown episodes (gaps exponential with mean ``slowdown_every_s``, durations
with mean ``slowdown_s``) during which its steps take ``slowdown_factor`` times longer. Each
site's failures and slowdowns come from their own generators seeded by ``derive_seed(seed,
purpose, k)``, drawn lazily in time order, so the schedule of a site does not depend on how far
the run has looked at other sites, nor on whether slowdowns are on, nor on the training rule: a
synchronous and an asynchronous run with the same ``[simulation.chaos]`` see the same failures.

The metrics (``StepLedger``, ``global_downtime``):

- **goodput**: the share of the inner steps that were computed whose update reached the global
  model. A step is lost when its site failed before the update arrived (the steps done up to the
  failure), when the update was dropped as too stale or refused by the update guard, when the
  merge it was in was aborted, or when a lock-step restart voided its round. Steps of phases still
  running when the run ends are counted in neither.
- **global downtime**: virtual seconds of the run during which no site was computing steps that
  reached (or, still running at the end, may yet reach) the global model: every site down,
  waiting at a barrier or for a transfer, or computing work that was then thrown away.

Pure: no clock is read and nothing is written; the simulator feeds the ledger and asks.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from geoloco.algorithms.config import config_to_dict, require
from geoloco.algorithms.params import derive_seed

__all__ = [
    "LOST_REASONS",
    "ChaosConfig",
    "ChaosSchedule",
    "SiteTimeline",
    "StepLedger",
    "global_downtime",
]

INFINITY = math.inf

LOST_REASONS = ("failed", "upload_lost", "stale", "rejected", "aborted", "restarted", "late", "non_finite")
"""Why computed steps did not reach the global model (``StepLedger.lost_by_reason`` keys):
the site failed mid-phase; its upload was cut by its failure; the update was more than
``max_staleness`` versions behind; the update guard refused it; its merge was aborted and no
error-feedback residual kept it; a lock-step restart voided its round; a synchronous round
closed without it and no error-feedback residual kept it; its pseudo-gradient had NaN/Inf values
(not sent)."""


@dataclass(kw_only=True, slots=True)
class ChaosConfig:
    """``[simulation.chaos]``: failures, repairs and slowdowns of every site, drawn from a seed."""

    enabled: bool = False
    """Run the event-driven simulator on this schedule (synchronous rounds unless
    ``[algorithm.asynchronous]`` is enabled too); off: no failures, no slowdowns."""
    seed: int = 0
    """Seed of the schedule alone: the same seed gives the same failures and slowdowns whatever
    the training rule, so a synchronous and an asynchronous run can be compared on them."""
    mtbf_s: float | None = None
    """Mean virtual seconds a site stays up between failures (exponential); unset = no failures."""
    repair_s: float = 60.0
    """Mean virtual seconds a failed site stays down (exponential); it then fetches the newest
    model and trains again, with a fresh inner optimizer (its memory was lost)."""
    slowdown_every_s: float | None = None
    """Mean virtual seconds between the end of one slowdown episode of a site and the start of
    its next (exponential); unset = no slowdowns."""
    slowdown_s: float = 30.0
    """Mean length of a slowdown episode in virtual seconds (exponential)."""
    slowdown_factor: float = 2.0
    """During an episode a step takes this many times longer (> 1)."""
    sync_on_failure: Literal["exclude", "restart"] = "exclude"
    """What a synchronous round does when one of its sites fails before its update arrived:
    ``"exclude"`` (the coordinator's rule: the site leaves the round's members and the round
    closes with the others; it rejoins the open round once repaired) or ``"restart"`` (the
    lock-step contract of all-reduce DiLoCo, e.g. torchft's commit: the round is void for every
    site and restarts from the same weights with the sites that are up). The asynchronous rule
    has no round to void: only the failed site's work is lost."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for key in ("mtbf_s", "slowdown_every_s"):
            value = getattr(self, key)
            require(
                value is None or (math.isfinite(value) and value > 0), key, f"must be > 0 seconds or unset, got {value}"
            )
        for key in ("repair_s", "slowdown_s"):
            value = getattr(self, key)
            require(math.isfinite(value) and value > 0, key, f"must be > 0 seconds, got {value}")
        require(
            math.isfinite(self.slowdown_factor) and self.slowdown_factor > 1,
            "slowdown_factor",
            f"must be > 1 (a slowed step takes this many times longer), got {self.slowdown_factor}",
        )

    @property
    def failures(self) -> bool:
        """Sites fail (``mtbf_s`` is set)."""
        return self.enabled and self.mtbf_s is not None

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


@dataclass(slots=True)
class SiteTimeline:
    """One site's hardware: its down periods ``[failed, repaired)`` and slowdown episodes
    ``[start, end)`` with their factor, sorted, drawn lazily as far as the run asks."""

    downs: list[tuple[float, float]] = field(default_factory=list)
    slows: list[tuple[float, float, float]] = field(default_factory=list)
    _failure_rng: random.Random | None = None
    _slowdown_rng: random.Random | None = None
    _config: ChaosConfig | None = None
    _downs_until: float = 0.0
    """The end of the last down period drawn (where the next up period starts)."""
    _slows_until: float = 0.0

    @classmethod
    def drawn(cls, config: ChaosConfig, site: int) -> SiteTimeline:
        """Site ``site``'s timeline under ``config`` (lazily drawn from its own generators)."""
        timeline = cls(_config=config)
        if config.mtbf_s is not None:
            timeline._failure_rng = random.Random(derive_seed(config.seed, "chaos-failures", site))
        if config.slowdown_every_s is not None:
            timeline._slowdown_rng = random.Random(derive_seed(config.seed, "chaos-slowdowns", site))
        return timeline

    def _draw_downs(self, until: float) -> None:
        """Draw down periods until one starts after ``until`` (so every period that starts at
        or before ``until``, and the first after it, are known)."""
        rng, config = self._failure_rng, self._config
        if rng is None or config is None or config.mtbf_s is None:
            return
        while not self.downs or self.downs[-1][0] <= until:
            failed = self._downs_until + rng.expovariate(1.0 / config.mtbf_s)
            repaired = failed + rng.expovariate(1.0 / config.repair_s)
            self.downs.append((failed, repaired))
            self._downs_until = repaired

    def _draw_slows(self, until: float) -> None:
        """Draw slowdown episodes until one starts after ``until``."""
        rng, config = self._slowdown_rng, self._config
        if rng is None or config is None or config.slowdown_every_s is None:
            return
        while not self.slows or self.slows[-1][0] <= until:
            start = self._slows_until + rng.expovariate(1.0 / config.slowdown_every_s)
            end = start + rng.expovariate(1.0 / config.slowdown_s)
            self.slows.append((start, end, config.slowdown_factor))
            self._slows_until = end

    def next_failure(self, t: float) -> tuple[float, float]:
        """The first down period that starts at or after ``t``: ``(failed, repaired)``, or
        ``(inf, inf)`` when there is none."""
        self._draw_downs(t)
        k = bisect.bisect_left(self.downs, (t, -INFINITY))
        return self.downs[k] if k < len(self.downs) else (INFINITY, INFINITY)

    def down_at(self, t: float) -> tuple[float, float] | None:
        """The down period containing ``t``, or None when the site is up at ``t``."""
        self._draw_downs(t)
        k = bisect.bisect_right(self.downs, (t, INFINITY)) - 1
        if k >= 0 and self.downs[k][0] <= t < self.downs[k][1]:
            return self.downs[k]
        return None

    def finish_time(self, start: float, work_s: float) -> float:
        """When ``work_s`` seconds of full-speed compute started at ``start`` are done, slowdown
        episodes stretching it (failures are not considered here). Without an episode in the way
        the result is exactly ``start + work_s``."""
        t, left = start, work_s
        self._draw_slows(start + work_s)
        k = bisect.bisect_right(self.slows, (start, INFINITY, INFINITY)) - 1
        k = max(k, 0)
        while left > 0 and k < len(self.slows):
            begin, end, factor = self.slows[k]
            if end <= t:
                k += 1
                continue
            if begin > t:  # full speed until the episode starts
                if t + left <= begin:
                    break
                left -= begin - t
                t = begin
            slowed = (end - t) / factor  # work the episode's remaining span holds
            if left <= slowed:
                return t + left * factor
            left -= slowed
            t = end
            k += 1
            self._draw_slows(t + left)
        return t + left

    def work_between(self, start: float, until: float) -> float:
        """Full-speed seconds of compute done between ``start`` and ``until``."""
        if until <= start:
            return 0.0
        self._draw_slows(until)
        done = until - start
        for begin, end, factor in self.slows:
            if end <= start or begin >= until:
                continue
            overlap = min(end, until) - max(begin, start)
            done -= overlap * (1.0 - 1.0 / factor)
        return done


class ChaosSchedule:
    """Every site's timeline, drawn from ``config`` on first use, or given (``fixed``)."""

    def __init__(self, config: ChaosConfig, timelines: Mapping[int, SiteTimeline] | None = None) -> None:
        self.config = config
        self._timelines: dict[int, SiteTimeline] = dict(timelines or {})
        self._fixed = timelines is not None

    @classmethod
    def fixed(
        cls,
        downs: Mapping[int, Sequence[tuple[float, float]]] | None = None,
        slows: Mapping[int, Sequence[tuple[float, float, float]]] | None = None,
        *,
        config: ChaosConfig | None = None,
    ) -> ChaosSchedule:
        """A hand-made schedule: site -> its down periods ``(failed, repaired)`` and slowdown
        episodes ``(start, end, factor)``; sites not named never fail nor slow down."""
        sites = set(downs or {}) | set(slows or {})
        timelines = {
            k: SiteTimeline(
                downs=sorted((downs or {}).get(k, ())), slows=sorted((slows or {}).get(k, ()))
            )
            for k in sites
        }
        return cls(config or ChaosConfig(enabled=True), timelines)

    def site(self, k: int) -> SiteTimeline:
        timeline = self._timelines.get(k)
        if timeline is None:
            timeline = SiteTimeline() if self._fixed else SiteTimeline.drawn(self.config, k)
            self._timelines[k] = timeline
        return timeline


def global_downtime(intervals: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of ``[start, end]`` covered by none of ``intervals`` (``(begin, end)`` pairs, in
    any order, overlapping or not)."""
    covered = 0.0
    reach = start
    for begin, finish in sorted(intervals):
        begin, finish = max(begin, reach), min(finish, end)
        if finish > begin:
            covered += finish - begin
            reach = finish
    return max(0.0, (end - start) - covered)


@dataclass(slots=True)
class StepLedger:
    """Where the computed inner steps went: into the global model, or lost and why; with the
    compute spans of the useful ones, for the global downtime."""

    useful_steps: int = 0
    lost_by_reason: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOST_REASONS, 0))
    useful_spans: list[tuple[float, float]] = field(default_factory=list)

    def useful(self, steps: int, start: float, finish: float) -> None:
        """A phase of ``steps`` computed over ``[start, finish]`` whose update entered the model."""
        self.useful_steps += steps
        self.useful_spans.append((start, finish))

    def lost(self, steps: int, reason: str) -> None:
        if reason not in self.lost_by_reason:
            raise ValueError(f"unknown reason {reason!r}; valid reasons: {', '.join(LOST_REASONS)}")
        self.lost_by_reason[reason] += steps

    @property
    def lost_steps(self) -> int:
        return sum(self.lost_by_reason.values())

    @property
    def goodput(self) -> float:
        """``useful / (useful + lost)``; 1.0 before anything was computed."""
        computed = self.useful_steps + self.lost_steps
        return self.useful_steps / computed if computed else 1.0

    def downtime(self, start: float, end: float, running: Iterable[tuple[float, float]] = ()) -> float:
        """Global downtime of ``[start, end]``; ``running``: spans of phases still computing at
        ``end`` that nothing has thrown away (they may yet reach the model)."""
        return global_downtime([*self.useful_spans, *running], start, end)

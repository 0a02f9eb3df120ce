"""Decoupled (asynchronous) DiLoCo's rules, shared by every host that runs it.

A merge is a round of the round engine (``geoloco.algorithms.engine``) whose close rule is
``AsyncMerge`` (a ``ClosePolicy``) and whose updates may be computed from an older global model
than the one they are merged into. What is decided here, once, for the event-driven simulator
(``geoloco.algorithms.simulation.async_sim``) and the coordinator alike:

* ``AsyncConfig`` — ``[algorithm.asynchronous]``: quorum, grace window, staleness bound and
  discount, Dynamic Local Updates;
* ``AsyncMerge`` — when a merge closes;
* ``stale_admission`` — whether an update computed from version ``base`` enters merge ``into``,
  and with which weight;
* ``dynamic_local_steps`` — Liu et al.'s DyLU: how many inner steps a site of a given speed runs.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from geoloco.algorithms.config import config_to_dict, require
from geoloco.algorithms.round import CloseDecision, Round
from geoloco.algorithms.weighting import stale_weight

__all__ = ["AsyncConfig", "AsyncMerge", "StaleAdmission", "dynamic_local_steps", "stale_admission"]

_EMA = 0.2
"""Weight of the newest gap in the adaptive grace window's average of arrival gaps."""


@dataclass(kw_only=True, slots=True)
class AsyncConfig:
    """``[algorithm.asynchronous]``: decoupled (asynchronous) DiLoCo. Sites never wait at a
    round barrier: each uploads when its inner steps are done and goes on at once from the
    newest global model it has received; the synchronizer merges what has arrived. The
    event-driven simulator (``geoloco.algorithms.simulation.async_sim``) and the coordinator
    (``geoloco.coordinator``, with ``geoloco.site_agent.async_rounds`` on the sites) run it."""

    enabled: bool = False
    """Merge asynchronously (off: synchronous rounds; the event-driven simulator still runs them
    when ``[simulation.chaos]`` is enabled)."""
    min_quorum: int = 1
    """A merge needs at least this many updates (one per site); with every site it is the
    synchronous round's quorum."""
    grace_window_s: float = 0.0
    """Once the quorum is in, wait this many seconds (virtual ones in the simulator) for more
    updates before merging (0: merge at once); with ``adaptive_grace`` the window before any
    arrival was seen. A merge never waits once every site that is up has sent its update."""
    adaptive_grace: bool = False
    """Learn the window from the arrivals: ``grace_arrivals`` times the mean gap between
    consecutive arrivals at the synchronizer (an average over the recent ones), capped by
    ``max_grace_s``: wait about as long as that many more updates usually take."""
    grace_arrivals: float = 1.0
    """Adaptive window: how many more arrivals' worth of time to wait after the quorum."""
    max_grace_s: float | None = None
    """Upper bound of the adaptive window in seconds (virtual ones in the simulator); unset = none."""
    max_staleness: int | None = None
    """Drop an update computed from a model more than this many merges behind the one it would
    be merged into (its steps count as lost); unset = no bound."""
    discount_per_version: float = 1.0
    """An admitted update computed ``s`` merges behind enters with weight ``w · discount^s``
    (``geoloco.algorithms.weighting.stale_weight``); 1 = no discount."""
    dynamic_local_updates: bool = False
    """Dynamic Local Updates (Liu et al. 2024): each site runs ``H · v_k / v_max`` inner steps
    (at least 1), ``v`` its steps per second measured over its last phase and ``v_max`` the
    fastest site's, so every site's phase takes about the fastest one's time; off: ``H``. On the
    real system each update reports its inner-step time and every broadcast carries the fastest
    site's (``RoundInfo.fastest_step_s``).
    Asynchronous merges only (like every key of this table, unread while ``enabled`` is off)."""
    rebase: bool = False
    """When a merge's broadcast arrives while a site is training, add its change into the running
    local model (``geoloco.algorithms.diloco.rebase_local``) and measure the site's update from
    the merged model. Off, a site's update is measured from the model it started from, so on
    links with any latency every update is at least one merge stale; on, only the steps before
    the broadcast arrived are computed from an older model, and the update's staleness counts
    from the newest model it took in."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        require(
            not isinstance(self.min_quorum, bool) and self.min_quorum >= 1,
            "min_quorum", f"must be an integer >= 1, got {self.min_quorum!r}",
        )
        require(
            math.isfinite(self.grace_window_s) and self.grace_window_s >= 0,
            "grace_window_s", f"must be >= 0 seconds, got {self.grace_window_s}",
        )
        require(
            math.isfinite(self.grace_arrivals) and self.grace_arrivals >= 0,
            "grace_arrivals", f"must be >= 0, got {self.grace_arrivals}",
        )
        require(
            self.max_grace_s is None or (math.isfinite(self.max_grace_s) and self.max_grace_s >= 0),
            "max_grace_s", f"must be >= 0 seconds or unset, got {self.max_grace_s}",
        )
        require(
            self.max_staleness is None or (not isinstance(self.max_staleness, bool) and self.max_staleness >= 0),
            "max_staleness", f"must be an integer >= 0 or unset, got {self.max_staleness!r}",
        )
        require(
            0 < self.discount_per_version <= 1,
            "discount_per_version", f"must be in (0, 1], got {self.discount_per_version}",
        )

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


def dynamic_local_steps(inner_steps: int, step_s: float | None, fastest_step_s: float | None) -> int:
    """Dynamic Local Updates (Liu et al. 2024): ``H · v / v_max`` steps, at least 1, for a site
    whose last phase took ``step_s`` seconds per step when the fastest site's took
    ``fastest_step_s`` (``v = 1 / step_s``); ``H`` before anything was measured."""
    if step_s is None or fastest_step_s is None or step_s <= 0:
        return inner_steps
    # At most H: on the real system the fastest speed is the others' latest, not this phase's.
    return min(inner_steps, max(1, math.floor(inner_steps * fastest_step_s / step_s + 1e-9)))


class AsyncMerge:
    """The asynchronous close rule (a ``ClosePolicy`` of the round engine): a merge closes once
    ``min_quorum`` updates are in and either it holds as many updates as there are sites up
    (one per site: nobody else can add to it) or the grace window after the quorum's arrival has
    passed.

    The window is ``grace_window_s``, or with ``adaptive_grace`` ``grace_arrivals`` times the
    average gap between consecutive arrivals at the synchronizer (an exponential average,
    weight 0.2 on the newest gap), capped by ``max_grace_s``: it waits about as long as that many
    more updates usually take, short when updates stream in and long when they are rare. This is
    our reading of Decoupled DiLoCo's adaptive grace window, whose exact rule the paper's
    summary does not give."""

    def __init__(self, config: AsyncConfig, sites_up: int) -> None:
        self.config = config
        self.sites_up = sites_up
        """Sites that are up now (the host updates it): a merge holding one update of each
        waits for nobody."""
        self._gap_s: float | None = None
        self._last_arrival_s: float | None = None
        self._close_by: dict[int, float] = {}

    def observe_arrival(self, now: float) -> None:
        """An update arrived at ``now`` (admitted or not): the adaptive window learns its gap."""
        if self._last_arrival_s is not None:
            gap = now - self._last_arrival_s
            self._gap_s = gap if self._gap_s is None else (1 - _EMA) * self._gap_s + _EMA * gap
        self._last_arrival_s = now

    def grace_s(self) -> float:
        """The window the next merge waits after its quorum."""
        config = self.config
        if not config.adaptive_grace or self._gap_s is None:
            return config.grace_window_s
        window = config.grace_arrivals * self._gap_s
        return window if config.max_grace_s is None else min(window, config.max_grace_s)

    def close_by(self, round_: Round) -> float | None:
        """When ``round_``'s grace window ends: fixed when it was first asked about with its
        quorum in (None before), so a host can set a timer for it."""
        return self._close_by.get(round_.number)

    def may_start(self, members: int) -> bool:
        return True

    def decide_round(self, round_: Round, *, now: float, expected: Collection[str]) -> CloseDecision:
        """``expected`` is not read: an asynchronous merge waits for no particular site."""
        counted = len(round_.contributed)
        if counted < self.config.min_quorum:
            return CloseDecision(close=False)
        close_by = self._close_by.setdefault(round_.number, now + self.grace_s())
        if counted >= self.sites_up:
            return CloseDecision(close=True)
        if now >= close_by:
            return CloseDecision(close=True, deadline_hit=True)
        return CloseDecision(close=False)

    def closed(self, round_: Round) -> None:
        self._close_by.pop(round_.number, None)


@dataclass(frozen=True, slots=True)
class StaleAdmission:
    """What becomes of an update computed from version ``base`` offered to merge ``into``."""

    staleness: int
    """Merges between the update's base version and the merge it enters."""
    weight: float
    """The weight it enters with (``w · discount^staleness``); 0 when refused."""
    refused: str | None = None
    """Why it may not enter (too stale, or from a version that does not exist yet)."""


def stale_admission(config: AsyncConfig, *, base: int, into: int, weight: float) -> StaleAdmission:
    """Whether an update computed from version ``base`` enters merge ``into`` and with which
    weight: the one rule the simulator and the coordinator apply."""
    staleness = into - base
    if staleness < 0:
        return StaleAdmission(staleness, 0.0, f"version {base} does not exist yet (the newest is {into})")
    bound = config.max_staleness
    if bound is not None and staleness > bound:
        return StaleAdmission(
            staleness, 0.0,
            f"stale: computed from version {base}, {staleness} merges behind (max_staleness {bound})",
        )
    if staleness == 0:
        return StaleAdmission(0, weight)
    return StaleAdmission(staleness, stale_weight(weight, discount=config.discount_per_version, staleness=staleness))

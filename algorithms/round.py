"""A round's data and the plain close rule, which the round engine (``geoloco.algorithms.engine``)
drives for every host: the coordinator (real clock), the simulator and the planner (virtual
clock), the relay. So a rule such as "close at the adaptive deadline once the quorum has
reported" cannot mean one thing in the emulator and another in its prediction.

- ``RoundPolicy`` is the plain ``ClosePolicy``: *when* a round starts and closes (quorum, fixed
  or adaptive deadline, a quorum rejections made unreachable) and what happens to an update that
  misses its round (``late_updates``: drop it back into the site's residual, or fold it into the
  next round with a staleness discount). It learns the adaptive deadline from the rounds it has
  seen.
- ``Round`` owns one round's bookkeeping: the aggregation buffer, contributors (with weights and
  arrival times), rejected sites with their reasons, folded late updates and the abort reason.
  ``add``/``fold`` put an update in (the engine decides whether), ``close`` returns the
  ``RoundOutcome``: who counted, who was excluded or rejected, the deadline in force and whether
  it was hit.

Times are seconds on whichever clock drives the round; the round never reads a clock itself.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from geoloco.algorithms.aggregation import Aggregation
from geoloco.algorithms.deadline import AdaptiveDeadlineConfig, RoundDeadline
from geoloco.algorithms.weighting import stale_weight
from geoloco.compression import Encoded, decode

__all__ = ["CloseDecision", "Round", "RoundOutcome", "RoundPolicy"]


@dataclass(frozen=True, slots=True)
class CloseDecision:
    """Whether a round closes now, and whether its deadline is what closed it."""

    close: bool
    deadline_hit: bool = False


_KEEP_OPEN = CloseDecision(close=False)


class RoundPolicy:
    """Quorum, deadline (fixed or adaptive) and the late-update rule of a run."""

    def __init__(
        self,
        *,
        min_sites: int = 1,
        round_deadline_s: float | None = None,
        adaptive_deadline: AdaptiveDeadlineConfig | None = None,
        late_updates: Literal["drop", "fold"] = "drop",
        staleness_discount: float = 0.5,
    ) -> None:
        if min_sites < 1:
            raise ValueError(f"min_sites must be >= 1, got {min_sites}")
        self.min_sites = min_sites
        self.deadline = RoundDeadline(round_deadline_s, adaptive_deadline)
        self.late_updates = late_updates
        self.staleness_discount = staleness_discount

    @property
    def folds_late_updates(self) -> bool:
        return self.late_updates == "fold"

    def deadline_s(self) -> float | None:
        """The deadline (seconds after a round's start) the next round runs under."""
        return self.deadline.current_s()

    def decide(
        self,
        *,
        now: float,
        started: bool,
        deadline_at: float | None,
        contributed: int,
        pending: int,
        rejected: int = 0,
    ) -> CloseDecision:
        """Close once the quorum has reported and either nobody is pending or the deadline has
        passed; with fewer than ``min_sites`` updates keep waiting, past the deadline if need be,
        unless rejected updates (``rejected``: sites whose update was refused and who cannot send
        another this round) leave too few sites to reach it: then close at once (the engine
        aborts such a round) instead of waiting for updates that cannot come.

        ``started``: the round's clock runs (enough members joined). A round that never started
        still closes when the quorum's updates are in (members left after uploading).
        """
        if contributed < self.min_sites:
            if started and rejected and contributed + pending < self.min_sites:
                return CloseDecision(close=True)
            return _KEEP_OPEN
        if not started or pending == 0:
            return CloseDecision(close=True)
        if deadline_at is not None and now >= deadline_at:
            return CloseDecision(close=True, deadline_hit=True)
        return _KEEP_OPEN

    def may_start(self, members: int) -> bool:
        """A round's clock starts once ``min_sites`` sites are members (``ClosePolicy``)."""
        return members >= self.min_sites

    def decide_round(self, round_: Round, *, now: float, expected: Collection[str]) -> CloseDecision:
        """``decide`` for ``round_`` waiting for ``expected`` (``ClosePolicy``)."""
        return self.decide(
            now=now, started=round_.started, deadline_at=round_.deadline_at,
            contributed=len(round_.contributed), pending=len(round_.pending(expected)),
            rejected=len(round_.rejected),
        )

    def close_time(
        self,
        arrivals: Sequence[float],
        *,
        start_s: float,
        deadline_s: float | None,
        rejected: Sequence[bool] = (),
    ) -> float:
        """When a round whose updates arrive at ``arrivals`` (absolute times) closes: the first
        arrival or the deadline at which ``decide`` says close. ``rejected``: which of them are
        refused on arrival (they do not count for the quorum). The coordinator asks ``decide``
        as events happen; a virtual clock knows every arrival up front and asks this."""
        if not arrivals:
            raise ValueError("a round needs at least one site")
        refused = list(rejected) or [False] * len(arrivals)
        deadline_at = None if deadline_s is None else start_s + deadline_s
        events = sorted({*arrivals, *(() if deadline_at is None else (deadline_at,))})
        for now in events:
            contributed = sum(1 for a, r in zip(arrivals, refused, strict=True) if a <= now and not r)
            rejected_now = sum(1 for a, r in zip(arrivals, refused, strict=True) if a <= now and r)
            decision = self.decide(
                now=now, started=True, deadline_at=deadline_at, contributed=contributed,
                pending=len(arrivals) - contributed - rejected_now, rejected=rejected_now,
            )
            if decision.close:
                return now
        return max(arrivals)  # unreachable: with every arrival in, nobody is pending

    def stale_weight(self, weight: float) -> float:
        """Weight of an update folded in one round late."""
        return stale_weight(weight, discount=self.staleness_discount, staleness=1)

    def observe(self, outcome: RoundOutcome) -> None:
        """Learn from a closed round: its arrivals, and the close time for every site that had
        not arrived (the adaptive deadline must cover them next time)."""
        self.deadline.observe(
            list(outcome.arrivals_s.values()), [outcome.closed_after_s] * len(outcome.excluded)
        )

    def state(self) -> list[list[float]]:
        return self.deadline.state()

    def load_state(self, rounds: Sequence[Sequence[float]]) -> None:
        self.deadline.load_state(rounds)


@dataclass(frozen=True, slots=True)
class RoundOutcome:
    """How a round closed."""

    round: int
    contributors: tuple[str, ...]
    """Sites whose update entered the aggregate, in arrival order."""
    weights: dict[str, float]
    """site -> aggregation weight."""
    excluded: tuple[str, ...]
    """Expected sites without an update at the close (stragglers), sorted."""
    folded: dict[str, float]
    """site -> discounted weight of its previous round's late update folded into this round."""
    rejected: dict[str, str]
    """site -> why its update was refused (bad values, out of the guard's bounds), by site."""
    deadline_s: float | None
    """The deadline in force (seconds after the start); None: none."""
    deadline_hit: bool
    arrivals_s: dict[str, float]
    """site -> seconds from the round's start until its update was in."""
    closed_after_s: float
    """Seconds from the round's start to its close."""


@dataclass(slots=True)
class Round:
    """The bookkeeping of one round; ``aggregation`` holds the running sum of its updates."""

    number: int
    aggregation: Aggregation
    opened_s: float
    """When the round opened (the previous one closed, or the run started)."""
    started_s: float | None = None
    """When its clock started (quorum of members present); None while waiting."""
    deadline_s: float | None = None
    """The deadline in force, seconds after ``started_s`` (fixed when the round starts)."""
    contributed: dict[str, float] = field(default_factory=dict)
    """site -> aggregation weight, in arrival order."""
    arrivals_s: dict[str, float] = field(default_factory=dict)
    folded: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    """site -> why its update was refused; a rejected site counts as done for the close."""
    aborted: str = ""
    """Non-empty: adding an update failed midway, so the aggregate cannot be trusted and the round
    is aborted at its close with the model unchanged (the reason)."""

    def start(self, now: float, policy: RoundPolicy) -> None:
        """Start the round's clock under the policy's current deadline."""
        self.started_s = now
        self.deadline_s = policy.deadline_s()

    @property
    def started(self) -> bool:
        return self.started_s is not None

    @property
    def deadline_at(self) -> float | None:
        """Absolute time of the deadline, once started."""
        if self.started_s is None or self.deadline_s is None:
            return None
        return self.started_s + self.deadline_s

    def add(self, update: Encoded | torch.Tensor, weight: float, *, site: str, now: float) -> None:
        """A site's verified update for this round, arriving at ``now``."""
        self.aggregation.add(update, weight, site=site)
        self._arrived(site, weight, now)

    def add_rows(
        self, rows: list[tuple[int, Encoded | torch.Tensor]], weight: float, *, numel: int, site: str, now: float
    ) -> None:
        """A site's verified update given as pieces ``(offset, values)`` tiling the vector (a
        sharded site): added piece by piece where the aggregation can (``RunningSum``),
        assembled into one vector for aggregations that keep or clip whole updates."""
        add_rows = getattr(self.aggregation, "add_rows", None)
        if add_rows is not None:
            add_rows(rows, weight, site=site)
        else:
            dense = torch.zeros(numel, dtype=torch.float32)
            for offset, values in rows:
                piece = values if isinstance(values, torch.Tensor) else decode(values)
                dense[offset : offset + piece.numel()].copy_(piece.reshape(-1))
            self.aggregation.add(dense, weight, site=site)
        self._arrived(site, weight, now)

    def _arrived(self, site: str, weight: float, now: float) -> None:
        self.contributed[site] = weight
        # An update in before the round's clock started took no time of the deadline's.
        start = self.started_s if self.started_s is not None else now
        self.arrivals_s[site] = max(0.0, now - start)

    def count(self, site: str, weight: float, *, now: float) -> None:
        """A site whose update entered a sum kept outside ``aggregation`` (secure aggregation's
        masked sum): it counts towards the quorum and the outcome exactly like ``add``."""
        self._arrived(site, weight, now)

    def fold(self, update: Encoded | torch.Tensor, weight: float, *, site: str, policy: RoundPolicy) -> float:
        """A site's previous-round update that missed its deadline, folded in with the
        policy's staleness discount; returns the weight it entered with."""
        discounted = policy.stale_weight(weight)
        self.aggregation.add(update, discounted, site=site, stale=True)
        self.folded[site] = discounted
        return discounted

    def reject(self, site: str, why: str) -> None:
        self.rejected[site] = why

    def retry(self, site: str) -> None:
        """``site`` sends another update after its last one was rejected: an asynchronous merge
        waits for a quorum of admitted updates, and a rejected one is none (held for the next
        merge, the new one would wait for a merge that, short of its quorum, never closes)."""
        self.rejected.pop(site, None)

    def abort(self, why: str) -> None:
        """The round's aggregate cannot be trusted: it closes with the model unchanged (the
        first reason is kept)."""
        self.aborted = self.aborted or why

    def pending(self, expected: Iterable[str]) -> set[str]:
        """Expected sites that neither contributed nor were rejected."""
        return set(expected) - set(self.contributed) - set(self.rejected)

    def close(self, *, now: float, expected: Iterable[str]) -> RoundOutcome:
        """The outcome at ``now``; ``expected`` are the sites the round waited for."""
        start = self.started_s if self.started_s is not None else self.opened_s
        deadline_at = self.deadline_at
        return RoundOutcome(
            round=self.number,
            contributors=tuple(self.contributed),
            weights=dict(self.contributed),
            excluded=tuple(sorted(self.pending(expected))),
            folded=dict(self.folded),
            rejected=dict(sorted(self.rejected.items())),
            deadline_s=self.deadline_s,
            deadline_hit=deadline_at is not None and now >= deadline_at and bool(self.pending(expected)),
            arrivals_s=dict(self.arrivals_s),
            closed_after_s=now - start,
        )

"""The state one coordinator session's parts share: members, the open round, its phase, history.

``RoundStateMachine`` owns one ``RoundContext`` and hands it to membership, upload intake and
round phases; they read and change it only while holding ``cond`` (except where a docstring says
otherwise). It knows no protobuf and does no I/O.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from geoloco.algorithms.aggregation import new_aggregation
from geoloco.algorithms.async_merge import AsyncMerge
from geoloco.algorithms.engine import RoundEngine
from geoloco.algorithms.link_codec import CodecPlans
from geoloco.algorithms.round import RoundPolicy
from geoloco.algorithms.strategy import Strategy
from geoloco.compression import parse_codec
from geoloco.coordinator import events as ev
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.domain import CoordinatorRound, RoundInfo, RoundPhase
from geoloco.protos.errors import RunFinishedError, UpdateRejectedError, WrongRoundError
from geoloco.protos.protocol_version import COUNTED_HISTORY_ROUNDS

__all__ = ["CONTRIBUTOR_HISTORY", "Member", "RoundContext"]

CONTRIBUTOR_HISTORY = COUNTED_HISTORY_ROUNDS
"""Rounds whose contributor sets are kept, so a late site learns whether its update counted."""


@dataclass(slots=True)
class Member:
    name: str
    joined_s: float
    last_seen_s: float
    reported_round: int = 0
    reported_phase: str = ""
    inner_steps_done: int = 0
    instance: str = ""
    """The site process holding the name (``JoinRequest.instance_id`` of the latest Join);
    empty for a site older than that field, whose processes cannot be told apart."""
    peer: str = ""
    """Where that Join came from (gRPC peer address), for the messages about a replacement."""
    joined_unix_s: float = 0.0
    """Wall-clock time of that Join (``joined_s`` is on the coordinator's monotonic clock)."""
    via: str = ""
    """The relay its calls arrive through ("" when the site calls the coordinator itself), as
    of its last Join or Heartbeat: a change is a failover, which the coordinator logs."""


class RoundContext:
    """Shared, lock-guarded state of a coordinator session (see module doc)."""

    def __init__(
        self,
        config: CoordinatorConfig,
        strategy: Strategy,
        engine: RoundEngine,
        *,
        session_id: str,
        clock: Callable[[], float],
        events: ev.EventHub,
    ) -> None:
        self.config = config
        self.strategy = strategy
        self.engine = engine
        """The round's lifecycle (``geoloco.algorithms.engine``): admission, close, guard, step."""
        self.session_id = session_id
        self.clock = clock
        self.events = events
        self.cond = threading.Condition(threading.RLock())
        self.closing = False
        self.members: dict[str, Member] = {}
        self.phase = RoundPhase.WAITING_FOR_QUORUM
        self._round = self.new_round(0, clock())
        self.contributor_history: dict[int, frozenset[str]] = {}
        """round t -> sites whose update counted in round t."""
        self.folded_history: dict[int, frozenset[str]] = {}
        """round t -> sites whose round-t update was folded into round t + 1."""
        self.refused_history: dict[int, frozenset[str]] = {}
        """round t -> sites whose round-t update the round refused (its record's ``rejected``):
        they drop it instead of keeping it in their error-feedback residual."""
        self.bytes_up_total = 0
        self.bytes_down_total = 0
        self.base_uplink_codec = parse_codec(config.algorithm.uplink_codec).spec
        adaptive = config.algorithm.adaptive_uplink
        self.link_codecs = CodecPlans(adaptive, config.algorithm.uplink_codec) if adaptive.enabled else None
        """Per-site uplink codecs (``[algorithm.adaptive_uplink]``); None: one codec for all."""
        merge = config.algorithm.asynchronous
        self.merge_rule: AsyncMerge | None = AsyncMerge(merge, 0) if merge.enabled else None
        """Asynchronous merges (``[algorithm.asynchronous]``): the engine's close rule, and the
        one the intake tells of each arrival; None for synchronous rounds."""
        self.held_updates: dict[str, Any] = {}
        """Asynchronous merges: site -> its verified update held for the next merge
        (``geoloco.coordinator.intake.HeldUpdate``)."""
        self.step_s: dict[str, float] = {}
        """Dynamic Local Updates: site -> seconds per inner step over its latest phase."""
        self._fastest: tuple[int, float] = (-1, 0.0)
        """(merge, the fastest step time then): computed once per merge, not per header."""
        self.merged_updates: dict[str, tuple[int, tuple[int, str], int]] = {}
        """Asynchronous merges: site -> (base version, checksum, merge) of its latest update that
        entered a merge, kept in the durable state, so a resend after a lost answer or a restart
        is recognised and never counted twice."""

    def observe_speed(self, site: str, inner_steps: int, inner_time_s: float) -> None:
        """Asynchronous merges with Dynamic Local Updates: ``site``'s latest phase ran
        ``inner_steps`` in ``inner_time_s`` (its update's manifest); the fastest member's speed
        goes out in every ``RoundInfo`` (``fastest_step_s``)."""
        if self.config.algorithm.asynchronous.dynamic_local_updates and inner_steps >= 1 and inner_time_s > 0:
            self.step_s[site] = inner_time_s / inner_steps

    def fastest_step_s(self) -> float:
        """The fewest seconds per inner step among the members' latest phases, as of the open
        merge's first question (every site's header asks: once per merge keeps it linear in the
        sites); 0: none known."""
        number = self._round.number
        if self._fastest[0] != number:
            fastest = min((s for site, s in self.step_s.items() if site in self.members), default=0.0)
            self._fastest = (number, fastest)
        return self._fastest[1]

    def expected(self) -> list[str]:
        """The sites the open round waits for: every member; for an asynchronous merge only the
        sites in it (a member that has not sent an update is not late, and not excluded)."""
        if self.merge_rule is not None:
            return list(self._round.contributed)
        return list(self.members)

    @property
    def round(self) -> CoordinatorRound:
        """The open round (the next one, once the run finished)."""
        return self._round

    @round.setter
    def round(self, new: CoordinatorRound) -> None:
        """Open ``new``: the replaced round has ended, which wakes its AwaitBroadcast calls."""
        old, self._round = self._round, new
        if old is not new:
            old.ended.set()

    def close(self) -> None:
        """The session closes: wake every call waiting for a round to end (lock held)."""
        self.closing = True
        self._round.ended.set()

    def new_round(self, number: int, now: float) -> CoordinatorRound:
        """Round ``number``, opened at ``now`` (its buffer allocates on the first add, sized for
        its Streaming DiLoCo fragment; a robust rule holds the round's updates instead)."""
        aggregation = new_aggregation(
            self.strategy.update_numel(number),
            central_dp=self.config.privacy.unmasked_central_dp,
            robust=self.config.algorithm.robust_rule,
            device=self.strategy.device,
            partial=self.strategy.partial,
        )
        return CoordinatorRound(core=self.engine.open(number, aggregation, now))

    @property
    def policy(self) -> RoundPolicy:
        """Quorum, deadline in force and the late-update rule (the engine's)."""
        return self.engine.policy

    # -- the strategy's view of rounds --

    def fragment_of(self, round_number: int) -> int:
        """Fragment round ``round_number`` synchronises (0 without streaming)."""
        return self.strategy.fragment_for_round(round_number)

    def update_numel(self, round_number: int) -> int:
        """Elements of round ``round_number``'s uploads (its fragment's, or the model's)."""
        return self.strategy.update_numel(round_number)

    def round_seed(self, round_number: int) -> int:
        """Seed shared by every site for round ``round_number``."""
        return self.strategy.configure_round(round_number, ()).seed

    def round_info(self, now: float, site: str = "") -> RoundInfo:
        """The open round: its seed, the time left before its deadline (the deadline the
        next round will run under while this one waits for its quorum) and, with adaptive
        uplink codecs, ``site``'s codec for it."""
        r = self.round.core
        if (deadline_at := r.deadline_at) is not None:
            remaining = max(0.0, deadline_at - now)
        elif (upcoming := self.policy.deadline_s()) is not None:
            remaining = upcoming
        else:
            remaining = 0.0
        codec = self.uplink_codec_for(site, r.number) if site and self.link_codecs is not None else ""
        try:
            numel = self.strategy.upload_numel(r.number, site) if site else self.update_numel(r.number)
        except ValueError:  # a site name partial updates cannot place (refused at its upload)
            numel = 0
        return RoundInfo(
            round=r.number, round_seed=self.round_seed(r.number), deadline_remaining_s=remaining,
            uplink_codec=codec, fastest_step_s=self.fastest_step_s(), upload_numel=numel,
            fragment=self.fragment_of(r.number),
        )

    def uplink_codec_for(self, site: str, round_number: int) -> str:
        """The canonical codec ``site``'s upload of ``round_number`` must use."""
        if self.link_codecs is None:
            return self.base_uplink_codec
        return self.link_codecs.codec_for(site, round_number, self.update_numel(round_number))

    def observe_upload(self, site: str, nbytes: int, seconds: float) -> None:
        """An upload received whole in one stream: a measurement of ``site``'s uplink."""
        if self.link_codecs is not None:
            self.link_codecs.observe_upload(site, nbytes, seconds)

    # -- checks shared by several calls --

    def check_upload_round(self, round_number: int) -> None:
        """Refuse an upload (or stage call) for a round that is not the open one."""
        current = self.round.number
        if self.phase is RoundPhase.FINISHED:
            raise RunFinishedError(
                f"the run finished after round {current - 1}; no more uploads are accepted"
            )
        if round_number < current or (
            round_number == current and self.phase is RoundPhase.AGGREGATING
        ):
            raise WrongRoundError(
                f"round {round_number} is closed (the coordinator is at round {current}"
                f"{', aggregating' if self.phase is RoundPhase.AGGREGATING else ''}); this update "
                "is not applied: keep it in the error-feedback residual and apply the round's "
                "broadcast (AwaitBroadcast)"
            )
        if round_number > current:
            raise WrongRoundError(
                f"round {round_number} is not open yet; the coordinator is at round {current}"
            )

    def check_not_rejected(self, site: str) -> None:
        """Refuse another upload (or shard) from a site whose update this round was rejected."""
        r = self.round
        why = r.rejected.get(site)
        if why is not None:
            raise UpdateRejectedError(
                f"site {site!r}'s update for round {r.number} was rejected ({why}) "
                "and is dropped for this round; wait for the broadcast (AwaitBroadcast)"
            )

    # -- byte accounting --

    def count_up(self, site: str, nbytes: int) -> None:
        d = self.round.bytes_up
        d[site] = d.get(site, 0) + nbytes
        self.bytes_up_total += nbytes
        self.events.emit(ev.BYTES_RECEIVED, site=site, nbytes=nbytes)

    def count_down(self, site: str, nbytes: int) -> None:
        d = self.round.bytes_down
        d[site] = d.get(site, 0) + nbytes
        self.bytes_down_total += nbytes
        self.events.emit(ev.BYTES_SENT, site=site, nbytes=nbytes)

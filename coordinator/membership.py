"""Who is in the run: join, leave, heartbeats, and dropping sites that fell silent.

Every method runs with the context's lock held (``RoundStateMachine`` takes it). A site that
leaves or is dropped keeps an upload it completed (it was verified and is in the aggregate); a
partial one is discarded. Quorum and weighting adapt because they only count what was
aggregated.
"""

from __future__ import annotations

import logging
import math

from geoloco.coordinator import events as ev
from geoloco.coordinator.context import Member, RoundContext
from geoloco.coordinator.errors import (
    NotAMemberError,
    ProtocolVersionError,
    SiteNotAllowedError,
    StaleSessionError,
)
from geoloco.protos.protocol_version import PROTOCOL_VERSION

__all__ = ["Membership"]

logger = logging.getLogger(__name__)


class Membership:
    """The members of one coordinator session (``RoundContext.members``)."""

    def __init__(self, ctx: RoundContext) -> None:
        self.ctx = ctx
        self.join_grace_s = ctx.config.admission_limits.silent_join_grace_s
        """How long a member may stay silent after its join before it is dropped."""
        self._heard: set[str] = set()
        """Members that made a call since they joined (a heartbeat, a fetch, an upload)."""
        allowed = ctx.config.allowed_sites
        self._allowed = None if allowed is None else frozenset(allowed)
        self._next_silence_s = math.inf
        """No member can fall silent before this time: ``drop_silent`` scans the members only
        from then on. The driver polls at every upload and join; a scan per poll would cost the
        square of the sites per round. Signs of life only move a member's limit later, so the
        earliest limit seen at the last scan stays a safe lower bound; a join lowers it."""

    def check_allowed(self, site: str) -> None:
        if self._allowed is not None and site not in self._allowed:
            raise SiteNotAllowedError(
                f"site {site!r} is not in this run's allowed_sites ({', '.join(sorted(self._allowed))}); add it "
                "to the coordinator's config"
            )

    def check_session(self, session_id: str) -> None:
        if session_id != self.ctx.session_id:
            raise StaleSessionError(
                f"session {session_id!r} is not the coordinator's current session "
                f"{self.ctx.session_id!r} (it restarted); call Join again"
            )

    @staticmethod
    def check_protocol(protocol_version: int) -> None:
        if protocol_version != PROTOCOL_VERSION:
            raise ProtocolVersionError(
                f"site speaks protocol version {protocol_version}, this coordinator speaks "
                f"{PROTOCOL_VERSION}; install the same geoloco version on both sides"
            )

    def member(self, site: str, session_id: str) -> Member:
        """Check session and membership, and count the call as a sign of life."""
        self.check_allowed(site)
        self.check_session(session_id)
        member = self.ctx.members.get(site)
        if member is None:
            raise NotAMemberError(
                f"site {site!r} is not a member of the run (never joined, left, or dropped after "
                f"{self.ctx.config.heartbeat_timeout_s:g} s without a heartbeat); call Join again"
            )
        member.last_seen_s = self.ctx.clock()
        self._heard.add(site)
        return member

    def join(self, site: str, now: float, *, software_version: str = "") -> None:
        """Register (or re-register) ``site``."""
        ctx = self.ctx
        member = ctx.members.get(site)
        if member is None:
            ctx.members[site] = Member(name=site, joined_s=now, last_seen_s=now)
            self._next_silence_s = min(self._next_silence_s, now + self._limit(site))
            logger.info(
                "site %s joined at round %d (%d members)%s",
                site, ctx.round.number, len(ctx.members),
                f", software {software_version}" if software_version else "",
            )
        else:
            member.last_seen_s = now
            logger.info("site %s re-joined at round %d", site, ctx.round.number)
        ctx.events.emit(ev.SITE_JOINED, site=site, round=ctx.round.number, rejoin=member is not None)

    def leave(self, site: str, session_id: str, reason: str) -> None:
        self.member(site, session_id)
        self.ctx.events.emit(ev.SITE_LEFT, site=site, round=self.ctx.round.number, reason=reason)
        self.remove(site, f"left ({reason})" if reason else "left")

    def heartbeat(
        self, site: str, session_id: str, now: float, *, round_number: int, phase: str, inner_steps_done: int
    ) -> bool:
        """Record a sign of life; returns whether the site must join again (a stale session
        or a dropped site)."""
        member = self.ctx.members.get(site)
        rejoin = session_id != self.ctx.session_id or member is None
        if member is not None and not rejoin:
            member.last_seen_s = now
            self._heard.add(site)
            member.reported_round = round_number
            member.reported_phase = phase
            member.inner_steps_done = inner_steps_done
            self.ctx.events.emit(
                ev.HEARTBEAT, site=site, round=round_number, phase=phase, inner_steps_done=inner_steps_done
            )
        return rejoin

    def drop_silent(self, now: float) -> None:
        """Drop members silent longer than ``heartbeat_timeout_s``, and those that never made a
        call after joining for longer than ``admission.silent_join_grace_s`` (a join with a
        made-up name must not hold the round open until the heartbeat timeout)."""
        ctx = self.ctx
        if now < self._next_silence_s:
            return
        earliest = math.inf
        for name, member in list(ctx.members.items()):
            limit = self._limit(name)
            if now - member.last_seen_s > limit:
                ctx.events.emit(
                    ev.SITE_DROPPED, site=name, round=ctx.round.number, silent_s=now - member.last_seen_s
                )
                self.remove(name, f"dropped after {now - member.last_seen_s:.1f} s of silence")
            else:
                earliest = min(earliest, member.last_seen_s + limit)
        self._next_silence_s = earliest

    def _limit(self, site: str) -> float:
        """Seconds of silence after which ``site`` is dropped."""
        timeout = self.ctx.config.heartbeat_timeout_s
        return timeout if site in self._heard else min(timeout, self.join_grace_s)

    def remove(self, site: str, why: str) -> None:
        ctx = self.ctx
        ctx.members.pop(site, None)
        self._heard.discard(site)
        r = ctx.round
        if site not in r.contributed:
            r.uploads.pop(site, None)
            r.departed.add(site)
        logger.info("site %s %s at round %d (%d members left)", site, why, r.number, len(ctx.members))

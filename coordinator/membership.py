"""Who is in the run: join, leave, heartbeats, and dropping sites that fell silent.

Every method runs with the context's lock held (``RoundStateMachine`` takes it). A site that
leaves or is dropped keeps an upload it completed (it was verified and is in the aggregate); a
partial one is discarded. Quorum and weighting adapt because they only count what was
aggregated.

A site name is a lease held by one process (``JoinRequest.instance_id``, random per process
start). A Join with another instance than the member's takes the name over at once -- a site
restarted after ``kill -9`` must not wait for its dead process's heartbeat timeout -- and says so
at WARNING, naming both processes; from then on every request of the replaced process (its Join
too) is refused with ``SiteReplacedError``, so it stops instead of uploading, counting rounds or
leaving in the new process's name. Requests without an instance (sites older than the field)
are not told apart, as before.

The newest replaced processes of each name outlive a coordinator restart: they go into the
session's durable state (``state``, written by ``RoundPhases`` with every checkpoint and round-log
entry, so as of the last durable round) and a resumed coordinator refuses them too
(``load_state``). Without that, a replaced process still running would join the resumed
coordinator as a fresh site and, joining after its successor, take the name back from it.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import grpc

from geoloco.coordinator import events as ev
from geoloco.coordinator.context import Member, RoundContext
from geoloco.coordinator.errors import SiteNotAllowedError
from geoloco.protos.errors import (
    NotAMemberError,
    ProtocolVersionError,
    SiteReplacedError,
    StaleSessionError,
    StatusError,
    clip,
)
from geoloco.protos.identity import validate_instance_id
from geoloco.protos.protocol_version import PROTOCOL_VERSION

__all__ = ["DURABLE_REPLACED_PER_SITE", "REPLACED_INSTANCES", "Membership", "Replacement"]

logger = logging.getLogger(__name__)

REPLACED_INSTANCES = 1024
"""Replaced site processes remembered per coordinator session (their requests, Join included,
are refused): far more than the restarts of a run; the oldest is forgotten first, so a run
with made-up names in plain-text mode cannot grow this without bound."""

DURABLE_REPLACED_PER_SITE = 4
"""Replaced processes per site name kept in the session's durable state (``Membership.state``):
one still running after a coordinator restart is one of the last of its name (a site restarted
in a loop leaves dead ones behind), and every round's log entry carries them."""

_SHORT_INSTANCE = 8
"""Characters of an instance id in messages (a random hex id: 8 tell processes apart)."""


def _short(instance: str) -> str:
    return clip(instance[:_SHORT_INSTANCE]) if instance else "without an instance id"


@dataclass(frozen=True, slots=True)
class Replacement:
    """The process that took a site's name over: its instance, where it joined from, when."""

    instance: str
    peer: str
    at_unix_s: float

    def message(self, site: str, replaced: str) -> str:
        """What the replaced process (instance ``replaced``) is told, in one line."""
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.at_unix_s))
        return (
            f"another process joined as site {site!r} at {when} from {self.peer or 'an unknown peer'} "
            f"(instance {_short(self.instance)}); this one (instance {_short(replaced)}) was replaced "
            "and stops. Run one process per site name; a site restarted after a crash replaces its "
            "old process this way"
        )


class Membership:
    """The members of one coordinator session (``RoundContext.members``)."""

    def __init__(self, ctx: RoundContext) -> None:
        self.ctx = ctx
        self.join_grace_s = ctx.config.admission_limits.silent_join_grace_s
        """How long a member may stay silent after its join before it is dropped."""
        self._heard: set[str] = set()
        """Members that made a call since they joined (a heartbeat, a fetch, an upload)."""
        self._replaced: OrderedDict[tuple[str, str], Replacement] = OrderedDict()
        """(site, replaced instance) -> who replaced it (at most ``REPLACED_INSTANCES``)."""
        allowed = ctx.config.allowed_sites
        self._allowed = None if allowed is None else frozenset(allowed)
        self._next_silence_s = math.inf
        """No member can fall silent before this time: ``drop_silent`` scans the members only
        from then on. The driver polls at every upload and join; a scan per poll would cost the
        square of the sites per round. Signs of life only move a member's limit later, so the
        earliest limit seen at the last scan stays a safe lower bound; a join lowers it."""
        self._arrivals: dict[tuple[str, str, str], float] = {}
        """When heartbeats still waiting to be recorded arrived (``note_arrival``), by (site,
        session, instance): a replaced process or a stale session cannot overwrite or clear
        the note of the member's own call."""

    def note_arrival(self, site: str, session_id: str, instance: str, at_s: float) -> None:
        """Note a heartbeat when it arrives, before it waits for the round's lock.

        The lock is held for whole secure stages and aggregations: with hundreds of sites on a
        loaded machine a heartbeat can wait for it longer than the heartbeat timeout, and a
        scan that runs first would drop a site whose sign of life is already here. The note
        needs no lock (one dict store); ``drop_silent`` counts only the note of the member's
        session and process, and ``heartbeat`` clears the caller's own note once it is
        recorded, so a note lives only while its call waits.
        """
        self._arrivals[site, session_id, instance] = at_s

    def _noted_s(self, site: str, member: Member) -> float | None:
        """When ``member``'s heartbeat that is waiting for the lock arrived (None: none is)."""
        return self._arrivals.get((site, self.ctx.session_id, member.instance))

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

    def member(self, site: str, session_id: str, instance: str = "") -> Member:
        """Check session, membership and the calling process (``instance``), and count the
        call as a sign of life."""
        self.check_allowed(site)
        self.check_session(session_id)
        member = self.ctx.members.get(site)
        if member is None:
            self.check_instance(site, instance)
            raise NotAMemberError(
                f"site {site!r} is not a member of the run (never joined, left, or dropped after "
                f"{self.ctx.config.heartbeat_timeout_s:g} s without a heartbeat); call Join again"
            )
        self.check_instance(site, instance)
        member.last_seen_s = self.ctx.clock()
        self._heard.add(site)
        return member

    def check_instance(self, site: str, instance: str) -> None:
        """Refuse a request of a process of ``site`` that another process replaced: one that a
        Join of another instance took the name from, or any instance but the member's."""
        if not instance:
            return
        replacement = self._replaced.get((site, instance))
        if replacement is None:
            member = self.ctx.members.get(site)
            if member is None or not member.instance or member.instance == instance:
                return
            replacement = Replacement(member.instance, member.peer, member.joined_unix_s)
        raise SiteReplacedError(replacement.message(site, instance))

    def join(
        self, site: str, now: float, *, software_version: str = "", instance: str = "", peer: str = "", via: str = ""
    ) -> None:
        """Register (or re-register) ``site`` for the process ``instance`` (from ``peer``); a
        process that another one replaced is refused (module doc)."""
        ctx = self.ctx
        try:
            validate_instance_id(instance)
        except ValueError as err:
            raise StatusError(str(err), code=grpc.StatusCode.INVALID_ARGUMENT) from None
        if instance and (replacement := self._replaced.get((site, instance))) is not None:
            raise SiteReplacedError(replacement.message(site, instance))
        member = ctx.members.get(site)
        wall = time.time()
        if member is None:
            ctx.members[site] = Member(
                name=site, joined_s=now, last_seen_s=now, instance=instance, peer=peer, joined_unix_s=wall, via=via
            )
            self._next_silence_s = min(self._next_silence_s, now + self._limit(site))
            logger.info(
                "site %s joined at round %d (%d members)%s",
                site, ctx.round.number, len(ctx.members),
                f", software {software_version}" if software_version else "",
            )
        else:
            if member.instance and member.instance != instance:
                self._replace(member, Replacement(instance, peer, wall), now)
            elif instance and member.instance == instance and site not in self._heard:
                # The same process joining again before any other call: `geoloco site` joins once
                # to read the run's config, then its agent joins; not worth an operator's line.
                logger.debug("site %s joined again at round %d (same process)", site, ctx.round.number)
            else:
                logger.info("site %s re-joined at round %d", site, ctx.round.number)
            member.last_seen_s = now
            member.instance, member.peer, member.joined_unix_s = instance, peer, wall
            self._route(member, via)
        ctx.events.emit(ev.SITE_JOINED, site=site, round=ctx.round.number, rejoin=member is not None)

    def _replace(self, member: Member, by: Replacement, now: float) -> None:
        """``by`` takes ``member``'s name over from the process that held it."""
        self._replaced[(member.name, member.instance)] = by
        while len(self._replaced) > REPLACED_INSTANCES:
            self._replaced.popitem(last=False)
        logger.warning(
            "site %s: process %s from %s joined while process %s from %s held the name (last heard "
            "%.1f s ago) at round %d; the new process takes the name, the old one is refused from "
            "its next request on and stops. Two live processes with one site name are a mistake; "
            "after a crash and restart of the site this is expected",
            member.name, _short(by.instance), by.peer or "an unknown peer", _short(member.instance),
            member.peer or "an unknown peer", now - member.last_seen_s, self.ctx.round.number,
        )

    def leave(self, site: str, session_id: str, reason: str, instance: str = "") -> None:
        self.member(site, session_id, instance)
        self.ctx.events.emit(ev.SITE_LEFT, site=site, round=self.ctx.round.number, reason=reason)
        self.remove(site, f"left ({reason})" if reason else "left")

    def state(self) -> list[dict[str, Any]]:
        """The replaced processes a resumed coordinator still refuses (module doc), oldest
        first, as plain JSON values: the newest ``DURABLE_REPLACED_PER_SITE`` of each name."""
        kept: dict[str, int] = {}
        newest_first: list[dict[str, Any]] = []
        for (site, instance), by in reversed(self._replaced.items()):
            if kept.get(site, 0) < DURABLE_REPLACED_PER_SITE:
                kept[site] = kept.get(site, 0) + 1
                newest_first.append(
                    {"site": site, "instance": instance, "by": by.instance, "peer": by.peer, "at_unix_s": by.at_unix_s}
                )
        return newest_first[::-1]

    def load_state(self, state: list[dict[str, Any]]) -> None:
        """Refuse the replaced processes of ``state`` (``state()`` of the session resumed from;
        an empty list for a checkpoint written before they were kept)."""
        self._replaced.clear()
        for entry in state[-REPLACED_INSTANCES:]:
            self._replaced[(str(entry["site"]), str(entry["instance"]))] = Replacement(
                str(entry["by"]), str(entry["peer"]), float(entry["at_unix_s"])
            )

    def heartbeat(
        self,
        site: str,
        session_id: str,
        now: float,
        *,
        round_number: int,
        phase: str,
        inner_steps_done: int,
        instance: str = "",
        via: str = "",
    ) -> bool:
        """Record a sign of life; returns whether the site must join again (a stale session
        or a dropped site). A replaced process is refused (``SiteReplacedError``). ``via``: the
        relay the call came through ("" for a direct call)."""
        member = self.ctx.members.get(site)
        self._arrivals.pop((site, session_id, instance), None)  # recorded now (or refused)
        rejoin = session_id != self.ctx.session_id or member is None
        if session_id == self.ctx.session_id:
            self.check_instance(site, instance)
        if member is not None and not rejoin:
            member.last_seen_s = now
            self._heard.add(site)
            member.reported_round = round_number
            member.reported_phase = phase
            member.inner_steps_done = inner_steps_done
            self._route(member, via)
            self.ctx.events.emit(
                ev.HEARTBEAT, site=site, round=round_number, phase=phase, inner_steps_done=inner_steps_done
            )
        return rejoin

    def _route(self, member: Member, via: str) -> None:
        """Note the way ``member``'s calls arrive; a change is a failover (a relay died and its
        sites dial the coordinator directly, or the other way back), said once when it shows."""
        if via == member.via:
            return
        site, round_number = member.name, self.ctx.round.number
        if via:
            was = f"through relay {member.via}" if member.via else "directly"
            logger.info("site %s reaches the coordinator through relay %s at round %d (was %s)",
                        site, via, round_number, was)
        else:
            logger.warning(
                "site %s reaches the coordinator directly at round %d (was through relay %s): failed "
                "over, the relay is down or unreachable from it", site, round_number, member.via,
            )
        member.via = via

    def drop_silent(self, now: float) -> None:
        """Drop members silent longer than ``heartbeat_timeout_s``, and those that never made a
        call after joining for longer than ``admission.silent_join_grace_s`` (a join with a
        made-up name must not hold the round open until the heartbeat timeout)."""
        ctx = self.ctx
        if now < self._next_silence_s:
            return
        earliest = math.inf
        for name, member in list(ctx.members.items()):
            noted = self._noted_s(name, member)
            limit = self._limit(name, heard=noted is not None)
            seen = member.last_seen_s if noted is None else max(member.last_seen_s, noted)
            if now - seen > limit:
                ctx.events.emit(ev.SITE_DROPPED, site=name, round=ctx.round.number, silent_s=now - seen)
                self.remove(name, f"dropped after {now - seen:.1f} s of silence")
            else:
                earliest = min(earliest, seen + limit)
        self._next_silence_s = earliest

    def _limit(self, site: str, *, heard: bool = False) -> float:
        """Seconds of silence after which ``site`` is dropped (``heard``: a call of it is noted)."""
        timeout = self.ctx.config.heartbeat_timeout_s
        return timeout if heard or site in self._heard else min(timeout, self.join_grace_s)

    def remove(self, site: str, why: str) -> None:
        ctx = self.ctx
        ctx.members.pop(site, None)
        self._heard.discard(site)
        r = ctx.round
        if site not in r.contributed:
            r.uploads.pop(site, None)
            r.departed.add(site)
        logger.info("site %s %s at round %d (%d members left)", site, why, r.number, len(ctx.members))

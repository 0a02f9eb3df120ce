"""What the status page shows: the live state of sites and rounds, fed by coordinator events.

``StatusBoard`` listens to the state machine's ``EventHub`` and answers ``/api/status``
(``geoloco.coordinator.http_status`` serves it); ``config_summary`` is the run card.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from geoloco.coordinator import events as ev
from geoloco.coordinator.domain import SITE_PHASES
from geoloco.protos.errors import clip

if TYPE_CHECKING:
    from geoloco.coordinator.config import CoordinatorConfig
    from geoloco.coordinator.rounds import RoundStateMachine

__all__ = [
    "DEFAULT_SITE_PAGE",
    "MAX_SITE_PAGE",
    "STATE_DONE",
    "STATE_DOWN",
    "STATE_JOINED",
    "STATE_LEFT",
    "StatusBoard",
    "StatusQuery",
    "config_summary",
    "natural_key",
]

STATE_DOWN = "down"
"""A member silent for ``DOWN_AFTER_HEARTBEATS`` heartbeat intervals (after its first
heartbeat), or dropped."""
STATE_LEFT = "left"
STATE_DONE = "done"
STATE_JOINED = "joined"
PHASE_STATES = frozenset(SITE_PHASES)
"""Site states shown for what a member reports doing in its heartbeats."""
SITE_STATES = PHASE_STATES | {STATE_DOWN, STATE_LEFT, STATE_DONE, STATE_JOINED}
"""Every state a site row can show (``StatusQuery.site_state`` filters by one)."""
DOWN_AFTER_HEARTBEATS = 3.0
"""A member is shown down after this many heartbeat intervals without a sign of life: it is
still in the run (its upload may still count) until ``heartbeat_timeout_s`` drops it."""
RATE_WINDOW_S = 5.0
"""Link rates are bytes over the last this many seconds."""
MAX_EVENTS = 200
MAX_ROUNDS = 5000
MAX_EVENT_TEXT = 400
"""Characters of one event's text: it may quote what a request carried."""
RELAY_LINK_PREFIX = "relay:"
"""Bytes a relay moved are counted under ``relay:NAME`` (``coordinator.relayed.relay_link``)."""
DEFAULT_SITE_PAGE = 100
"""Site rows in one ``/api/status`` answer unless it asks for another page size: with a thousand
sites the whole table every second was megabytes of JSON built under the board's lock."""
MAX_SITE_PAGE = 1000
"""Most site rows one answer may ask for."""


@dataclass(frozen=True, slots=True)
class StatusQuery:
    """What one ``/api/status`` answer carries: the sites whose name holds ``site_name`` and,
    when ``site_state`` is set, are in that state, in natural name order (``s2`` before
    ``s10``), ``site_limit`` of them from ``site_offset``; and the rounds after
    ``rounds_after`` (all kept rounds when None), so a page that polls every second asks only
    for what it has not seen."""

    site_offset: int = 0
    site_limit: int = DEFAULT_SITE_PAGE
    site_name: str = ""
    site_state: str = ""
    rounds_after: int | None = None

    def __post_init__(self) -> None:
        if self.site_offset < 0:
            raise ValueError(f"site_offset must be >= 0, got {self.site_offset}")
        if not 1 <= self.site_limit <= MAX_SITE_PAGE:
            raise ValueError(f"site_limit must be between 1 and {MAX_SITE_PAGE}, got {self.site_limit}")
        if self.site_state and self.site_state not in SITE_STATES:
            raise ValueError(
                f"site_state {clip(self.site_state, 40)!r} is not a state; one of {', '.join(sorted(SITE_STATES))}"
            )

    @classmethod
    def from_params(cls, params: Mapping[str, Sequence[str]]) -> StatusQuery:
        """From a parsed query string (``urllib.parse.parse_qs``); ``ValueError`` names the
        parameter that is wrong and what it allows."""
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            raise ValueError(f"unknown parameter(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
        values: dict[str, Any] = {}
        for key, given in params.items():
            if len(given) != 1:
                raise ValueError(f"{key} given {len(given)} times; give it once")
            values[key] = given[0]
        for key in ("site_offset", "site_limit", "rounds_after"):
            if key in values:
                try:
                    values[key] = int(values[key])
                except ValueError:
                    raise ValueError(f"{key} must be a whole number, got {clip(values[key], 40)!r}") from None
        return cls(**values)


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that orders the digit runs in a name by value: ``s2`` before ``s10``."""
    return tuple((0, int(part)) if part.isdecimal() else (1, part) for part in re.split(r"(\d+)", name) if part)


def _phase_table(phases: Any) -> dict[str, float]:
    """A round's seconds per phase (``geoloco.protos.round_phases``), finite values only."""
    if not isinstance(phases, dict):
        return {}
    table = {str(name): _finite(seconds) for name, seconds in phases.items()}
    return {name: seconds for name, seconds in table.items() if seconds is not None}


def _finite(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


@dataclass(slots=True)
class _Site:
    name: str
    first_seen_s: float
    last_seen_s: float
    member: bool = True
    state: str = STATE_JOINED
    down_reported: bool = False
    heard: bool = False
    """A heartbeat arrived since the last join. Silence only counts after one: the site CLI
    joins once to learn the run's settings and again when its model is built."""
    rounds_joined: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    joins: int = 0
    recent: deque[tuple[float, int, int]] = field(default_factory=deque)
    """(time, bytes up, bytes down) transfers within ``RATE_WINDOW_S``."""


class StatusBoard:
    """The live state behind ``/api/status``: an ``EventHub`` listener (``on_event``)."""

    def __init__(
        self,
        config_summary: dict[str, Any],
        *,
        heartbeat_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config_summary = config_summary
        self.down_after_s = DOWN_AFTER_HEARTBEATS * heartbeat_interval_s
        self.clock = clock
        self.wall_clock = wall_clock
        self._lock = threading.Lock()
        self._sites: dict[str, _Site] = {}
        self._events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self._rounds: deque[dict[str, Any]] = deque(maxlen=MAX_ROUNDS)
        self._site_phases: tuple[int, dict[str, dict[str, float]]] | None = None
        """(round, site -> seconds per phase) of the latest round whose record had them."""
        self._run_finished = False
        self._started_wall = wall_clock()
        self._rejected_total = 0
        self._repeats: dict[tuple[str, ...], dict[str, Any]] = {}
        """Key of a kind of refusal -> its entry in ``_events`` (counted, not stored again)."""

    def _event(self, kind: str, text: str, site: str | None = None) -> dict[str, Any]:
        entry = {"time": self.wall_clock(), "kind": kind, "site": site, "text": clip(text, MAX_EVENT_TEXT), "count": 1}
        self._events.append(entry)
        return entry

    def _repeated_event(self, key: tuple[str, ...], kind: str, text: str) -> None:
        """An event that may repeat without end (refused requests): while the entry of the same
        ``key`` is still in the list, it is moved to the top with its count raised and the
        latest text; the list keeps one entry per key however many arrive."""
        entry = self._repeats.get(key)
        if entry is not None:
            try:
                self._events.remove(entry)
            except ValueError:
                entry = None
        if entry is None:
            self._repeats = {k: e for k, e in self._repeats.items() if any(e is x for x in self._events)}
            self._repeats[key] = self._event(kind, text)
            return
        entry.update(time=self.wall_clock(), text=clip(text, MAX_EVENT_TEXT), count=entry["count"] + 1)
        self._events.append(entry)

    def _site(self, name: str, now: float) -> _Site:
        site = self._sites.get(name)
        if site is None:
            site = self._sites[name] = _Site(name=name, first_seen_s=now, last_seen_s=now)
        return site

    def on_event(self, event: ev.RoundEvent) -> None:
        with self._lock:
            self._apply(event)

    def _apply(self, event: ev.RoundEvent) -> None:
        kind, name, data, now = event.kind, event.site, event.data, event.time_s
        if kind == ev.ROUND_AGGREGATED:
            self._on_round(data)
            return
        if kind == ev.REQUEST_REJECTED:
            self._rejected_total += 1
            who = f" from {name}" if name else ""
            method, code, reason = (clip(str(data[k]), 64) for k in ("method", "code", "reason"))
            self._repeated_event(
                ("rejected", method, code, reason, name or ""),
                "rejected",
                f"{method}{who} refused: {code} ({reason}): {data['message']}",
            )
            return
        if kind in (ev.ROUND_STARTED, ev.CHECKPOINT_SAVED) or name is None:
            # Round starts are in the round chart; the event list keeps what needs attention.
            return
        site = self._site(name, now)
        site.last_seen_s = max(site.last_seen_s, now)
        if kind == ev.SITE_JOINED:
            was_down = site.state == STATE_DOWN or site.down_reported or not site.member
            site.joins += 1
            site.member, site.state, site.down_reported, site.heard = True, STATE_JOINED, False, False
            if site.joins == 1:
                self._event("join", f"{name} joined at round {event.round}", name)
            elif was_down:
                self._event("recovery", f"{name} is back (re-joined at round {event.round})", name)
            else:
                self._event("join", f"{name} re-joined at round {event.round}", name)
        elif kind == ev.SITE_LEFT:
            site.member = False
            site.state = STATE_DONE if self._run_finished else STATE_LEFT
            self._event("leave", f"{name} left ({data.get('reason') or 'no reason given'})", name)
        elif kind == ev.SITE_DROPPED:
            site.member, site.state = False, STATE_DOWN
            if not site.down_reported:
                site.down_reported = True
            self._event("fault", f"{name} dropped after {data['silent_s']:.1f} s without a heartbeat", name)
        elif kind == ev.HEARTBEAT:
            site.heard = True
            if site.down_reported and site.member:
                site.down_reported = False
                self._event("recovery", f"{name} is heard from again", name)
            phase = data.get("phase", "")
            if phase in PHASE_STATES:
                site.state = phase
        elif kind in (ev.BYTES_RECEIVED, ev.BYTES_SENT):
            up = data["nbytes"] if kind == ev.BYTES_RECEIVED else 0
            down = data["nbytes"] if kind == ev.BYTES_SENT else 0
            site.bytes_up += up
            site.bytes_down += down
            site.recent.append((now, up, down))
            self._prune(site, now)
        elif kind == ev.UPDATE_AGGREGATED:
            site.rounds_joined += 1
        elif kind == ev.UPDATE_REJECTED:
            self._event("rejected", f"{name}'s update for round {event.round} was rejected: {data['why']}", name)

    @staticmethod
    def _prune(site: _Site, now: float) -> None:
        while site.recent and site.recent[0][0] < now - RATE_WINDOW_S:
            site.recent.popleft()

    def _on_round(self, record: Any) -> None:
        # Only the losses of updates that went into the aggregate: a refused site's claims are
        # not the round's.
        site_metrics = record.get("site_metrics") or {}
        reported = [site_metrics.get(site) or {} for site in record["participants"]]
        losses = [m["train_loss"] for m in reported if _finite(m.get("train_loss")) is not None]
        self._rounds.append(
            {
                "round": record["round"],
                "eval_loss": _finite(record.get("eval_loss")),
                "train_loss": sum(losses) / len(losses) if losses else None,
                "bytes_up": int(sum(record.get("bytes_up", {}).values())),
                "bytes_down": int(sum(record.get("bytes_down", {}).values())),
                "participants": len(record["participants"]),
                "excluded": list(record["excluded"]),
                "round_time_s": _finite(record.get("round_time_s")),
                "deadline_s": _finite(record.get("deadline_s")),
                "update_norm": _finite(record.get("update_norm")),
                "epsilon": _finite(record.get("epsilon")),
                "fragment": record.get("fragment"),
                "aborted": bool(record.get("aborted")),
                "phases_s": _phase_table(record.get("phases_s")),
                "round_wall_s": _finite(record.get("round_wall_s")),
                "time": self.wall_clock(),
            }
        )
        site_phases = record.get("site_phases_s") or {}
        if site_phases:
            # The latest round's only: one table per round per site grew without bound (a
            # thousand sites, thousands of rounds) and the page shows the latest one.
            self._site_phases = (
                int(record["round"]),
                {str(site): _phase_table(phases) for site, phases in site_phases.items()},
            )
        if record.get("aborted"):
            self._event(
                "fault", f"round {record['round']} aborted, the model is unchanged: {record['aborted']}"
            )
        if record["excluded"]:
            self._event(
                "fault",
                f"round {record['round']} closed without {', '.join(record['excluded'])} (stragglers)",
            )
        if record.get("run_finished"):
            self._run_finished = True
            self._event("round", f"run finished after round {record['round']}")

    def snapshot(
        self, *, round_number: int, phase: str, session_id: str, query: StatusQuery | None = None
    ) -> dict[str, Any]:
        """The JSON document of ``/api/status``, with the page of the site table ``query`` asks
        for (the first ``DEFAULT_SITE_PAGE`` rows by default), every site counted by state
        (``site_states``) and the rounds it has not seen: its cost and size grow with the page
        and the new rounds, not with the sites or the run's length."""
        query = query or StatusQuery()
        with self._lock:
            now = self.clock()
            states: dict[str, str] = {}
            links: dict[str, dict[str, Any]] = {}
            for site in self._sites.values():
                if site.name.startswith(RELAY_LINK_PREFIX):
                    links[site.name] = self._link(site, now)
                    continue
                states[site.name] = self._state(site, now)
            matched = sorted(
                (
                    name for name, state in states.items()
                    if query.site_name in name and (not query.site_state or state == query.site_state)
                ),
                key=natural_key,
            )
            page = matched[query.site_offset : query.site_offset + query.site_limit]
            after = query.rounds_after
            rounds = list(self._rounds) if after is None else self._new_rounds(after)
            rows = [self._row(self._sites[name], states[name], now) for name in page]
            phases_round, phases = self._site_phases if self._site_phases is not None else (None, {})
            return {
                "session_id": session_id,
                "time": self.wall_clock(),
                "started": self._started_wall,
                "round": round_number,
                "phase": phase,
                "run_finished": self._run_finished,
                "config": self.config_summary,
                "sites": rows,
                "site_page": {
                    "offset": query.site_offset,
                    "limit": query.site_limit,
                    "name": query.site_name,
                    "state": query.site_state,
                    "matched": len(matched),
                    "total": len(states),
                },
                "site_states": dict(sorted(Counter(states.values()).items())),
                "site_phases": {
                    "round": phases_round,
                    "sites": {name: phases[name] for name in page if name in phases},
                },
                "rounds": rounds,
                "rounds_after": after,
                "events": list(self._events)[::-1],
                "rejected_total": self._rejected_total,
                "tree": self._tree(links, states),
            }

    def _new_rounds(self, after: int) -> list[dict[str, Any]]:
        """The kept rounds numbered above ``after``: the newest are at the end, so the walk
        stops at the first one already seen."""
        new: list[dict[str, Any]] = []
        for record in reversed(self._rounds):
            if record["round"] <= after:
                break
            new.append(record)
        return new[::-1]

    def _state(self, site: _Site, now: float) -> str:
        """What the site's row shows now; a member silent for too long shows down, and the
        first time it does the event list says so."""
        state = site.state
        if site.member and site.heard and now - site.last_seen_s > self.down_after_s and not self._run_finished:
            state = STATE_DOWN
            if not site.down_reported:
                site.down_reported = True
                self._event("fault", f"{site.name} silent for {now - site.last_seen_s:.1f} s", site.name)
        return state

    def _row(self, site: _Site, state: str, now: float) -> dict[str, Any]:
        self._prune(site, now)
        window = min(RATE_WINDOW_S, max(now - site.first_seen_s, 1e-3))
        return {
            "name": site.name,
            "state": state,
            "member": site.member,
            "last_seen_s": round(max(0.0, now - site.last_seen_s), 3),
            "rounds_joined": site.rounds_joined,
            "bytes_up": site.bytes_up,
            "bytes_down": site.bytes_down,
            "rate_up_bps": 8 * sum(x[1] for x in site.recent) / window,
            "rate_down_bps": 8 * sum(x[2] for x in site.recent) / window,
        }

    def _link(self, site: _Site, now: float) -> dict[str, Any]:
        """Bytes and rates of one coordinator <-> relay link."""
        self._prune(site, now)
        window = min(RATE_WINDOW_S, max(now - site.first_seen_s, 1e-3))
        return {
            "bytes_up": site.bytes_up,
            "bytes_down": site.bytes_down,
            "rate_up_bps": 8 * sum(x[1] for x in site.recent) / window,
            "rate_down_bps": 8 * sum(x[2] for x in site.recent) / window,
        }

    def _tree(self, links: dict[str, dict[str, Any]], states: dict[str, str]) -> dict[str, Any]:
        """coordinator -> relays -> sites: each relay of the ``[relays]`` table with the bytes on
        its link to the coordinator and its sites, then the sites that talk to the coordinator
        directly, with every named site's state (``states``; the site table is paged, the tree
        is not). The bytes between a site and its relay are the relay's to count (its metrics
        file); the coordinator sees only its own links."""
        relays = self.config_summary.get("relays") or {}
        behind = {site for names in relays.values() for site in names}
        idle = {"bytes_up": 0, "bytes_down": 0, "rate_up_bps": 0.0, "rate_down_bps": 0.0}
        direct = sorted((name for name in states if name not in behind), key=natural_key)
        return {
            "relays": [
                {"name": name, "link": RELAY_LINK_PREFIX + name, **links.get(RELAY_LINK_PREFIX + name, idle),
                 "sites": list(names)}
                for name, names in sorted(relays.items())
            ],
            "direct": direct,
            "states": {name: states[name] for name in (*sorted(behind), *direct) if name in states} if relays else {},
        }


def config_summary(config: CoordinatorConfig, rounds: RoundStateMachine) -> dict[str, Any]:
    """What the page shows about the run: the headline settings plus the whole config."""
    algorithm = config.algorithm
    return {
        "algorithm": algorithm.name,
        "inner_steps": rounds.strategy.inner_steps,
        "uplink_codec": rounds.uplink_codec,
        "downlink_codec": algorithm.downlink_codec,
        "outer_optimizer": config.outer_optimizer.to_dict(),
        "total_rounds": config.total_rounds,
        "min_sites": config.min_sites,
        "round_deadline_s": config.round_deadline_s,
        "adaptive_deadline": (
            {"min_s": config.adaptive_deadline.min_s, "max_s": config.adaptive_deadline.max_s}
            if config.adaptive_deadline.enabled else None
        ),
        "round_time_budget_s": algorithm.round_time_budget_s,
        "weighting": algorithm.weighting,
        "late_updates": algorithm.late_updates,
        "asynchronous": (
            {
                "min_quorum": algorithm.asynchronous.min_quorum,
                "grace": "adaptive" if algorithm.asynchronous.adaptive_grace
                else f"{algorithm.asynchronous.grace_window_s:g} s",
                "max_staleness": algorithm.asynchronous.max_staleness,
                "discount_per_version": algorithm.asynchronous.discount_per_version,
                "dynamic_local_updates": algorithm.asynchronous.dynamic_local_updates,
            }
            if algorithm.asynchronous.enabled else None
        ),
        "streaming": (
            {
                "fragments": algorithm.streaming.fragments,
                "overlap_steps": algorithm.streaming.overlap_steps,
                "mix": algorithm.streaming.mix,
            }
            if algorithm.streaming.enabled else None
        ),
        "privacy": (
            {
                "secure_aggregation": config.privacy.secure_aggregation,
                "dp": config.privacy.dp,
                "noise_multiplier": config.privacy.noise_multiplier,
                "delta": config.privacy.delta,
                "epsilon_budget": config.privacy.epsilon_budget,
            }
            if config.privacy.enabled else None
        ),
        "heartbeat_interval_s": config.heartbeat_interval_s,
        "heartbeat_timeout_s": config.heartbeat_timeout_s,
        "parameters": rounds.numel,
        "transport": "insecure (plain text)" if config.insecure else "mutual TLS",
        "allowed_sites": config.allowed_sites,
        "relays": {name: list(sites) for name, sites in config.relays.items()},
        "workload": config.workload,
        "full": config.to_dict(),
    }

"""Reconnecting promptly when the path to the coordinator comes back.

A link cut for a few seconds used to cost a site many rounds: its retry delays doubled up to
``backoff_max_s`` (10 s) on top of gRPC's own reconnect backoff (up to 10 s), so the site slept
through the link's return and the rounds after it. Two things fix that:

* ``ConnectivityWatch`` follows the channel's connectivity (``channel.subscribe`` with
  ``try_to_connect``: gRPC keeps dialling in the background, at most ``reconnect_max_s`` apart)
  and wakes a retry sleep the moment the channel is READY again, so the retry goes out then,
  not when the sleep would have ended.
* ``backoff_cap`` bounds the delay between retries by a fraction of the round time the site has
  seen (``backoff_round_fraction``): a site whose rounds take 2 s waits at most 0.5 s between
  retries, a site whose rounds take an hour may wait ``backoff_max_s``. Jitter stays, so many
  sites do not reconnect in lockstep after a coordinator restart.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import grpc

from geoloco.site_agent.config import SiteAgentConfig

__all__ = ["ConnectivityWatch", "RoundTimer", "backoff_cap", "reconnect_options"]

logger = logging.getLogger(__name__)

_STOP_POLL_S = 0.05
"""How often a sleep looks at the stop event (``SiteAgent.stop`` sets it)."""


def backoff_cap(config: SiteAgentConfig, round_time_s: float | None) -> float:
    """Longest pause between two retries: ``backoff_max_s``, and at most
    ``backoff_round_fraction`` of the round time once one was seen (never below
    ``backoff_initial_s``)."""
    cap = config.backoff_max_s
    if round_time_s is not None and round_time_s > 0:
        cap = min(cap, max(config.backoff_initial_s, config.backoff_round_fraction * round_time_s))
    return cap


def reconnect_options(config: SiteAgentConfig) -> list[tuple[str, Any]]:
    """gRPC channel options that keep its own reconnect attempts at most ``reconnect_max_s``
    apart (``transport_endpoints.channel_options`` puts them in place of the transport's defaults)."""
    max_ms = max(1, int(config.reconnect_max_s * 1000))
    return [
        ("grpc.initial_reconnect_backoff_ms", min(max_ms, 200)),
        ("grpc.min_reconnect_backoff_ms", min(max_ms, 200)),
        ("grpc.max_reconnect_backoff_ms", max_ms),
    ]


class RoundTimer:
    """The round time a site sees: the time between two broadcasts it received (smoothed)."""

    def __init__(self) -> None:
        self._last: float | None = None
        self.round_time_s: float | None = None

    def broadcast_received(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._last is not None:
            interval = now - self._last
            self.round_time_s = interval if self.round_time_s is None else 0.5 * (self.round_time_s + interval)
        self._last = now


class ConnectivityWatch:
    """Follows a channel's connectivity and wakes retry sleeps when it becomes READY."""

    def __init__(self, channel: grpc.Channel, stop: threading.Event, *, nudge_s: float = 0.5) -> None:
        self._channel = channel
        self._stop = stop
        self._nudge_s = nudge_s
        """How often a sleep asks a channel that is not READY to dial again."""
        self._cond = threading.Condition()
        self._state: grpc.ChannelConnectivity | None = None
        self._ready_count = 0
        self.wakeups = 0
        """Retry sleeps cut short because the channel became READY (for tests and logs)."""
        channel.subscribe(self._changed, try_to_connect=True)

    @property
    def state(self) -> grpc.ChannelConnectivity | None:
        return self._state

    @property
    def ready_count(self) -> int:
        """How often the channel became READY so far (a mark for ``sleep``'s ``since``)."""
        with self._cond:
            return self._ready_count

    def _changed(self, state: grpc.ChannelConnectivity) -> None:
        with self._cond:
            if state is grpc.ChannelConnectivity.READY and self._state is not state:
                self._ready_count += 1
            self._state = state
            self._cond.notify_all()

    def sleep(self, seconds: float, *, since: int | None = None) -> bool:
        """Sleep up to ``seconds``; True when cut short by the channel becoming READY after the
        mark ``since`` (a ``ready_count`` taken before the failed call; default: now), so a
        path that came back while the call failed is retried at once. Returns False when
        ``stop`` is set (the caller checks)."""
        now = time.monotonic()
        deadline = now + seconds
        nudge: grpc.Future | None = None
        nudged_s = -float("inf")
        try:
            with self._cond:
                seen = self._ready_count if since is None else since
                while not self._stop.is_set():
                    if self._ready_count != seen:
                        self.wakeups += 1
                        logger.info("the channel to the coordinator is ready again: retrying now")
                        return True
                    now = time.monotonic()
                    remaining = deadline - now
                    if remaining <= 0:
                        return False
                    if self._state is not grpc.ChannelConnectivity.READY and now - nudged_s >= self._nudge_s:
                        # A channel left IDLE by a dropped connection dials again only when
                        # asked; a ready future asks once (gRPC's own reconnect backoff, capped
                        # by ``reconnect_options``, covers failures in between).
                        if nudge is not None:
                            nudge.cancel()
                        nudge, nudged_s = grpc.channel_ready_future(self._channel), now
                    self._cond.wait(min(remaining, _STOP_POLL_S))
            return False
        finally:
            if nudge is not None:
                nudge.cancel()

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop watching; call before closing the channel. gRPC's polling thread looks at its
        subscribers every 0.2 s and fails noisily ("Channel closed!") when the channel closes
        under it, so this waits (bounded) for that thread to stop."""
        self._channel.unsubscribe(self._changed)
        state = getattr(self._channel, "_connectivity_state", None)
        deadline = time.monotonic() + timeout_s
        while state is not None and getattr(state, "polling", False) and time.monotonic() < deadline:
            time.sleep(_STOP_POLL_S)

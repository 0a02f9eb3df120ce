"""Exponential backoff with jitter for one logical operation of the coordinator client.

Pauses double from ``backoff_initial_s`` up to a cap (``backoff_max_s``, and a fraction of the
round time once one was seen: ``geoloco.site_agent.connectivity.backoff_cap``), each drawn from
``[cap/2, cap]`` so that many sites do not retry in lockstep; a sleep ends early when the
channel became READY after the failed call went out (the path is back). The give-up clock raises
``CoordinatorUnreachableError`` after ``give_up_after_s`` without an answer.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

import grpc

from geoloco.site_agent.config import SiteAgentConfig
from geoloco.site_agent.errors import CoordinatorUnreachableError

__all__ = ["Backoff", "describe_error"]

logger = logging.getLogger(__name__)


def describe_error(error: grpc.RpcError) -> str:
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    return f"{code.name if code else 'UNKNOWN'}: {details}"


class Backoff:
    """Exponential backoff with jitter for one logical operation, and its give-up clock."""

    def __init__(
        self,
        what: str,
        *,
        config: SiteAgentConfig,
        target: str,
        classify: Callable[[grpc.RpcError], Exception | None],
        sleep: Callable[[float, int | None], None],
        cap: Callable[[], float] | None = None,
        ready_mark: Callable[[], int] | None = None,
    ) -> None:
        self.what = what
        self.config = config
        self.target = target
        self._classify = classify
        """The exception for an error retrying cannot fix, or None."""
        self._sleep = sleep
        """Sleep (cut short when the channel became READY after the mark it is given), or
        raise ``AgentStopped`` when the agent is asked to stop meanwhile."""
        self._cap = cap or (lambda: config.backoff_max_s)
        """The longest pause now (a fraction of the round time, ``backoff_cap``)."""
        self._ready_mark = ready_mark
        self._mark: int | None = None
        self.started = time.monotonic()
        self.delay = config.backoff_initial_s
        self.failures = 0

    def attempting(self, since: int | None = None) -> None:
        """A call is about to go out (or went out when the channel's ready count was
        ``since``): a connection made after that means the path is up, so a failed call is
        retried at once instead of after its pause."""
        if since is not None:
            self._mark = since
        else:
            self._mark = None if self._ready_mark is None else self._ready_mark()

    def alive(self) -> None:
        """The coordinator answered: restart the give-up clock and the backoff delay."""
        self.started = time.monotonic()
        self.delay = self.config.backoff_initial_s

    def failed(self, error: grpc.RpcError) -> None:
        """Raise what retrying cannot fix (or when it is time to give up); else sleep."""
        classified = self._classify(error)
        if classified is not None:
            raise classified from None
        self.failures += 1
        elapsed = time.monotonic() - self.started
        give_up = self.config.give_up_after_s
        if elapsed >= give_up:
            raise CoordinatorUnreachableError(
                f"{self.what}: no successful answer from the coordinator at {self.target} for "
                f"{elapsed:.0f} s ({self.failures} attempts, last error {describe_error(error)}); check "
                "that it is running and reachable from here, or wait longer before giving up: "
                "--give-up-after SECONDS (give_up_after_s in SiteAgentConfig)"
            ) from None
        pause = min(self.delay, self._cap()) * random.uniform(0.5, 1.0)
        logger.log(
            logging.INFO if self.failures in (1, 5, 20) else logging.DEBUG,
            "%s failed (%s); retry %d in %.2f s", self.what, describe_error(error), self.failures, pause,
        )
        self._sleep(min(pause, give_up - elapsed + 0.01), self._mark)
        self.delay = min(self.delay * 2, self.config.backoff_max_s)

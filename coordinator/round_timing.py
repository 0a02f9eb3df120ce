"""Where one round's time goes on the coordinator: its phases, disjoint in time.

Each ``CoordinatorRound`` carries a ``RoundTimings``; the upload intake and the round phases
mark what they do on it, and the round's metrics record gets ``table()`` as ``phases_s``
(names in ``geoloco.protos.round_phases.COORDINATOR_PHASES``) beside ``round_wall_s``.

Verification and addition run on one verifier thread, one upload at a time, so their intervals
never overlap each other; upload streams do overlap them (one site's bytes arrive while another
site's update is verified). ``receive`` is therefore the time in which some upload of the round
was streaming in and the verifier was idle: the phases stay disjoint, and their sum is at most
the round's wall time (``round_wall_s``, from the round's opening to its broadcast). What is
left is time in which the coordinator waited for sites (their training, their links).
Durations come from ``time.monotonic`` (real time even when a test injects a clock).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from geoloco.protos.round_phases import COORDINATOR_PHASES

__all__ = ["RoundTimings"]

_SERIAL_PHASES = frozenset({"verify", "add"})
"""Phases run one at a time on the verifier thread (subtracted from ``receive``)."""


@dataclass(slots=True)
class RoundTimings:
    """One round's phase times (module doc); thread-safe."""

    opened_s: float = field(default_factory=time.monotonic)
    first_upload_s: float | None = None
    """When the first upload stream of the round began."""
    last_received_s: float | None = None
    """When the last complete upload's final byte arrived."""
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COORDINATOR_PHASES, 0.0))
    serial: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) of every verify/add interval (disjoint: one verifier thread)."""
    published_s: float | None = None
    """When the round's broadcast was published (the end of its wall time)."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def upload_started(self, at: float) -> None:
        with self._lock:
            if self.first_upload_s is None or at < self.first_upload_s:
                self.first_upload_s = at

    def upload_received(self, at: float) -> None:
        with self._lock:
            if self.last_received_s is None or at > self.last_received_s:
                self.last_received_s = at

    def spent(self, phase: str, start: float, end: float) -> None:
        """``phase`` ran from ``start`` to ``end`` (``time.monotonic``)."""
        if phase not in self.seconds:
            raise ValueError(f"unknown coordinator phase {phase!r}; phases are {', '.join(COORDINATOR_PHASES)}")
        with self._lock:
            self.seconds[phase] += max(0.0, end - start)
            if phase in _SERIAL_PHASES:
                self.serial.append((start, end))

    def record(self, phase: str, seconds: float) -> None:
        """``phase`` ran for ``seconds`` (a phase that never overlaps uploads: after the close)."""
        if phase in _SERIAL_PHASES or phase not in self.seconds:
            raise ValueError(f"record() takes the phases run after the close, not {phase!r}")
        with self._lock:
            self.seconds[phase] += max(0.0, seconds)

    def published(self, at: float) -> None:
        with self._lock:
            self.published_s = at

    def wall_s(self) -> float | None:
        """From the round's opening to its broadcast's publication (None before that)."""
        return None if self.published_s is None else self.published_s - self.opened_s

    def table(self) -> dict[str, float]:
        """Seconds per phase, every phase present (0 for one that did not run)."""
        with self._lock:
            table = dict(self.seconds)
            start, end = self.first_upload_s, self.last_received_s
            if start is not None and end is not None and end > start:
                busy = sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.serial)
                table["receive"] = max(0.0, end - start - busy)
            return table

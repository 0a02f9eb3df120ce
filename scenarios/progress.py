"""Live progress of an emulation in the terminal.

On a TTY a block of lines (one header, one line per site) is redrawn in place about twice a
second; otherwise (a log file, CI) a plain line is printed when a round completes, a fault fires,
or a site changes state — never carriage returns or escape codes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TextIO

__all__ = ["Progress", "SiteStatus", "Snapshot", "human_bytes", "human_seconds"]

# Site states shown to the user (the emulator infers them from processes and link traffic).
STATE_STARTING = "starting"
STATE_TRAINING = "training"
STATE_UPLOADING = "uploading"
STATE_WAITING = "waiting"
STATE_DOWNLOADING = "downloading"
STATE_DOWN = "down"
STATE_CUT = "link cut"
STATE_DONE = "done"


BYTE_UNITS = ("B", "kB", "MB", "GB", "TB")
"""Decimal units (powers of 1000), as links and disks are sold."""


def human_bytes(n: float) -> str:
    """A byte count to read at a glance, three significant digits in decimal units: ``512 B``,
    ``1.50 kB``, ``12.3 MB``, ``456 GB``, ``2.00 TB`` (whole bytes below 1 kB; TB above). The
    one byte formatter of every command, report and benchmark."""
    for unit in BYTE_UNITS:
        # 999.5 and up would print as "1000": that is already the next unit's "1.00".
        if abs(n) < 999.5 or unit == BYTE_UNITS[-1]:
            break
        n /= 1000
    if unit == "B":
        return f"{n:.0f} B"
    digits = 2 if abs(n) < 9.995 else 1 if abs(n) < 99.95 else 0
    return f"{n:.{digits}f} {unit}"


def human_seconds(s: float | None) -> str:
    if s is None:
        return "?"
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


@dataclass(slots=True)
class SiteStatus:
    name: str
    state: str
    bytes_up: int
    bytes_down: int
    train_loss: float | None = None


@dataclass(slots=True)
class Snapshot:
    """What the emulator knows at one instant."""

    elapsed_s: float
    round: int
    """Rounds completed (aggregated) so far."""
    total_rounds: int
    """0 when the run is bounded by a time budget only."""
    sites: list[SiteStatus]
    eval_loss: float | None = None
    train_loss: float | None = None
    eta_s: float | None = None
    events: list[str] = field(default_factory=list)
    """Messages since the previous snapshot (faults, restarts)."""


class Progress:
    """Renders snapshots to ``stream`` (a TTY gets an in-place block, anything else plain lines)."""

    def __init__(self, stream: TextIO | None = None, *, tty: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self._drawn_lines = 0
        self._last_round = -1
        self._last_states: dict[str, str] = {}

    def update(self, snap: Snapshot) -> None:
        if self.tty:
            self._redraw(snap)
        else:
            self._plain(snap)

    def message(self, text: str) -> None:
        """A line that stays (above the live block on a TTY)."""
        if self.tty:
            self._clear()
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        self._drawn_lines = 0

    # -- rendering ------------------------------------------------------------------------------

    @staticmethod
    def header(snap: Snapshot) -> str:
        total = f"/{snap.total_rounds}" if snap.total_rounds else ""
        loss = []
        if snap.train_loss is not None:
            loss.append(f"train loss {snap.train_loss:.4f}")
        if snap.eval_loss is not None:
            loss.append(f"eval loss {snap.eval_loss:.4f}")
        up = sum(s.bytes_up for s in snap.sites)
        down = sum(s.bytes_down for s in snap.sites)
        parts = [
            f"[{human_seconds(snap.elapsed_s)}] round {snap.round}{total}",
            *loss,
            f"up {human_bytes(up)} down {human_bytes(down)}",
            f"ETA {human_seconds(snap.eta_s)}",
        ]
        return " | ".join(parts)

    @staticmethod
    def site_line(site: SiteStatus, width: int) -> str:
        loss = "" if site.train_loss is None else f"  loss {site.train_loss:.4f}"
        return (
            f"  {site.name.ljust(width)}  {site.state:<11}  up {human_bytes(site.bytes_up):>9}"
            f"  down {human_bytes(site.bytes_down):>9}{loss}"
        )

    def _clear(self) -> None:
        if self._drawn_lines:
            self.stream.write(f"\x1b[{self._drawn_lines}F\x1b[J")
            self._drawn_lines = 0

    def _redraw(self, snap: Snapshot) -> None:
        self._clear()
        for event in snap.events:
            self.stream.write(event + "\n")
        width = max((len(s.name) for s in snap.sites), default=4)
        lines = [self.header(snap), *(self.site_line(s, width) for s in snap.sites)]
        self.stream.write("\n".join(lines) + "\n")
        self.stream.flush()
        self._drawn_lines = len(lines)

    def _plain(self, snap: Snapshot) -> None:
        for event in snap.events:
            self.stream.write(event + "\n")
        states = {s.name: s.state for s in snap.sites}
        changed = [
            f"{name}: {state}"
            for name, state in states.items()
            if self._last_states.get(name) != state
            and state in (STATE_DOWN, STATE_CUT, STATE_DONE)
        ]
        if snap.round != self._last_round or changed:
            line = self.header(snap)
            if changed:
                line += " | " + ", ".join(changed)
            self.stream.write(line + "\n")
        self._last_round = snap.round
        self._last_states = states
        self.stream.flush()

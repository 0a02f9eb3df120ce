"""When a scenario's faults fire and when what they broke comes back: timing only, no processes.

``FaultSchedule`` holds the scenario's ``[[faults]]`` in firing order and the restorations they
scheduled (a killed site or coordinator restarted, a cut link restored); the emulator asks it
what is due at each poll and does the killing and restarting itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from geoloco.scenarios.scenario import Fault

__all__ = ["RESTORE_COORDINATOR", "RESTORE_LINK", "RESTORE_SITE", "FaultEvent", "FaultSchedule", "Restore"]

Restore = Literal["site", "coordinator", "link"]
"""What a restoration brings back: a site process, the coordinator process, a site's link."""
RESTORE_SITE: Final = "site"
RESTORE_COORDINATOR: Final = "coordinator"
RESTORE_LINK: Final = "link"


@dataclass(slots=True)
class FaultEvent:
    """A fault as it happened (times in seconds since the run started)."""

    fault: Fault
    fired_s: float
    fired_round: int
    """Rounds completed when it fired."""
    restored_s: float | None = None
    """When the process was restarted / the link restored."""
    notes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Restoration:
    due_s: float
    what: Restore
    site: str | None
    event: FaultEvent


class FaultSchedule:
    """The pending faults and the scheduled restorations of one run."""

    def __init__(self, faults: Sequence[Fault]) -> None:
        self._pending = sorted(faults, key=lambda f: (f.at_round, f.after_s))
        self._restorations: list[_Restoration] = []

    def due_faults(
        self,
        now: float,
        round_started_s: Mapping[int, float],
        upload_seen_s: Callable[[int, str], float | None],
    ) -> list[Fault]:
        """Faults to fire now, in order (each returned once): a fault is due ``after_s`` after
        its round started, or, with ``after_upload``, after its site's upload for that round
        completed."""
        due: list[Fault] = []
        while self._pending:
            fault = self._pending[0]
            began = (
                upload_seen_s(fault.at_round, fault.site or "")
                if fault.after_upload
                else round_started_s.get(fault.at_round)
            )
            if began is None or now < began + fault.after_s:
                break
            due.append(self._pending.pop(0))
        return due

    def restore_at(self, due_s: float, what: Restore, event: FaultEvent, site: str | None = None) -> None:
        self._restorations.append(_Restoration(due_s, what, site, event))

    def due_restorations(self, now: float) -> list[tuple[Restore, str | None, FaultEvent]]:
        """Restorations due by ``now`` as ``(what, site, event)``, each returned once."""
        due = [r for r in self._restorations if r.due_s <= now]
        self._restorations = [r for r in self._restorations if r.due_s > now]
        return [(r.what, r.site, r.event) for r in due]

    @property
    def coordinator_down(self) -> bool:
        """The coordinator is dead on purpose (a fault) and waits for its restart."""
        return any(r.what == RESTORE_COORDINATOR for r in self._restorations)

"""What one emulated run produced (``Emulation.run()``), for ``geoloco.scenarios.report``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geoloco.scenarios.fault_schedule import FaultEvent
from geoloco.scenarios.scenario import Scenario

__all__ = ["EmulationResult"]

STATUS_COMPLETED = "completed"
STATUS_TIME_BUDGET = "time budget reached"
STATUS_INTERRUPTED = "interrupted"
STATUS_FAILED = "failed"


@dataclass(slots=True)
class EmulationResult:
    scenario: Scenario
    out: Path
    status: str
    """completed, time budget reached, interrupted or failed."""
    reason: str
    wall_s: float
    records: list[dict[str, Any]]
    """Coordinator metrics records, each with ``observed_s`` (seconds since start) added."""
    bursts: dict[str, list[dict[str, Any]]]
    """Per site, its link bursts (``direction``, ``start_s``, ``end_s``, ``bytes``), run time."""
    wire_bytes: dict[str, tuple[int, int]]
    """Per site, (bytes up, bytes down) through its link, TLS and gRPC framing included."""
    site_starts: dict[str, list[float]]
    """Per site, when its process was (re)started."""
    site_stops: dict[str, list[float]]
    """Per site, when its process was killed by a fault or exited."""
    faults: list[FaultEvent]
    coordinator_starts: list[float]
    shaping: str = ""
    """How the links were shaped (``ShapingPlan.description``), for the summary."""
    tier_bytes: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per tier link (``coordinator``, ``relay:NAME``), (bytes up, bytes down) on the wire."""
    tier_bursts: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    relay_records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Per region, its relay's metrics records (sites in each partial, bytes per link)."""

    @property
    def ok(self) -> bool:
        return self.status in (STATUS_COMPLETED, STATUS_TIME_BUDGET)

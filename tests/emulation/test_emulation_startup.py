"""The steady-state utilization's start-up ends with the weights fetch, not with the TLS handshake
or the join's small replies that come before it (they are start-up too)."""

from __future__ import annotations

from pathlib import Path

import pytest

from geoloco.scenarios.emulation import EmulationResult
from geoloco.scenarios.report import site_reports
from geoloco.scenarios.scenario import load_scenario

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"


def _burst(direction: str, start: float, end: float, nbytes: int) -> dict[str, float | str]:
    return {"direction": direction, "start_s": start, "end_s": end, "bytes": nbytes}


def test_start_up_lasts_until_the_weights_arrived(tmp_path: Path) -> None:
    scenario = load_scenario(SCENARIOS / "streaming.toml")
    near, far = (site.name for site in scenario.sites)
    # Handshake reply at 2-3 (2 kB), join reply at 6-7 (3 kB), the weights (1.9 MB) 9-10, then a
    # fragment broadcast (137 kB) per round.
    bursts = [
        _burst("down", 2, 3, 2_000), _burst("down", 6, 7, 3_000), _burst("down", 9, 10, 1_947_549),
        _burst("up", 20, 21, 137_880), _burst("down", 22, 23, 137_525),
    ]
    result = EmulationResult(
        scenario=scenario, out=tmp_path, status="completed", reason="test", wall_s=33.0,
        records=[], bursts={near: bursts, far: []}, wire_bytes={},
        site_starts={near: [0.0], far: [0.0]}, site_stops={near: [33.0], far: [33.0]},
        faults=[], coordinator_starts=[0.0],
    )
    report = {r.name: r for r in site_reports(result)}[near]
    assert report.startup_s == pytest.approx(10.0)
    assert report.steady_utilization == pytest.approx(report.compute_s / 23.0)

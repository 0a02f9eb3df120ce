"""The report's per-site time split, from a hand-made run: start-up is kept out of the
steady-state utilization, but not out of the plain one."""

from __future__ import annotations

from pathlib import Path

import pytest

from geoloco.scenarios.emulation import EmulationResult
from geoloco.scenarios.report import site_reports
from geoloco.scenarios.scenario import load_scenario

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"


def _burst(direction: str, start: float, end: float) -> dict[str, float | str]:
    return {"direction": direction, "start_s": start, "end_s": end, "bytes": 100_000}


def test_start_up_is_left_out_of_the_steady_state_utilization(tmp_path: Path) -> None:
    scenario = load_scenario(SCENARIOS / "transatlantic.toml")
    near, far = (site.name for site in scenario.sites)
    # near: joins and fetches until t=10, computes 10-20, uploads 20-21, waits 21-22, downloads
    # 22-23 and computes until it exits at 33.
    bursts = [_burst("down", 9, 10), _burst("up", 20, 21), _burst("down", 22, 23)]
    result = EmulationResult(
        scenario=scenario, out=tmp_path, status="completed", reason="test", wall_s=33.0,
        records=[], bursts={near: bursts, far: []}, wire_bytes={},
        site_starts={near: [0.0], far: [0.0]}, site_stops={near: [33.0], far: [33.0]},
        faults=[], coordinator_starts=[0.0],
    )
    report = {r.name: r for r in site_reports(result)}[near]
    assert report.startup_s == pytest.approx(10.0)
    assert (report.compute_s, report.communication_s, report.idle_s) == pytest.approx((20.0, 3.0, 10.0))
    assert report.utilization == pytest.approx(20 / 33)
    assert report.steady_utilization == pytest.approx(20 / 23)
    # A site that never got the weights spent its whole life starting up.
    assert {r.name: r for r in site_reports(result)}[far].steady_utilization == 0.0

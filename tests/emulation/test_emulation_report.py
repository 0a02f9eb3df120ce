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


def test_asynchronous_compute_is_the_running_total_and_the_wind_down_is_left_out(tmp_path: Path) -> None:
    """Asynchronous merges: compute is the running total the site's merged updates report
    (summed over its process restarts), and the time it lived after the run's last merge is
    left out of the steady state like start-up."""
    scenario = load_scenario(SCENARIOS / "async.toml")
    fast = scenario.sites[0].name
    # fast: fetches until t=2, trains until the run's last merge at t=12, exits at t=14; its
    # process restarted once at t=6 (3.5 s computed before, 5.5 s after).
    records = [
        {"round": 0, "observed_s": 4.0, "participants": [fast], "site_metrics": {fast: {"compute_s_total": 2.0}}},
        {"round": 1, "observed_s": 6.0, "participants": [fast], "site_metrics": {fast: {"compute_s_total": 3.5}}},
        {"round": 2, "observed_s": 9.0, "participants": [fast], "site_metrics": {fast: {"compute_s_total": 2.5}}},
        {"round": 3, "observed_s": 12.0, "participants": [fast], "run_finished": True,
         "site_metrics": {fast: {"compute_s_total": 5.5}}},
    ]
    names = [site.name for site in scenario.sites]
    result = EmulationResult(
        scenario=scenario, out=tmp_path, status="completed", reason="test", wall_s=14.0,
        records=records, bursts={fast: [_burst("down", 1, 2)]}, wire_bytes={},
        site_starts={name: [0.0] for name in names}, site_stops={name: [14.0] for name in names},
        faults=[], coordinator_starts=[0.0],
    )
    report = {r.name: r for r in site_reports(result)}[fast]
    assert report.compute_s == pytest.approx(9.0)
    assert (report.startup_s, report.wind_down_s) == pytest.approx((2.0, 2.0))
    assert report.utilization == pytest.approx(9 / 14)
    assert report.steady_utilization == pytest.approx(9 / 10)

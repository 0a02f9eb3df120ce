"""``geoloco plan --step-time measure``: an emulate scenario's steps are timed the way the
emulator runs its sites (one process each, all at once, each at its speed factor); any other
file's steps alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from geoloco.scenarios.cli import main
from geoloco.scenarios.plan_cmd import load_run_file
from geoloco.scenarios.step_timing import time_steps_together

SCENARIO = """
[workload]
name = "mlp"

[algorithm]
name = "diloco"
inner_steps = 4

[run]
rounds = 2

[[sites]]
name = "full"
uplink_bps = 1e8
downlink_bps = 1e8
latency_s = 0.01

[[sites]]
name = "quarter"
uplink_bps = 1e8
downlink_bps = 1e8
latency_s = 0.01
speed_factor = 0.25
"""


@pytest.fixture
def scenario(tmp_path: Path) -> Path:
    path = tmp_path / "two_speeds.toml"
    path.write_text(SCENARIO)
    return path


def test_the_steps_of_every_site_are_timed_at_once_without_the_throttles_sleep(scenario: Path) -> None:
    run_file = load_run_file(scenario)
    timing = time_steps_together(run_file.workload, run_file.training, [1.0, 0.25], steps=6)
    full, quarter = timing.per_site_s
    assert full > 0 and quarter > 0
    # The quarter-speed site sleeps three times its compute after each step: counted, its time
    # would be about four times the other's.
    assert quarter < 2.5 * full
    assert timing.seconds == pytest.approx((full + quarter) / 2)
    assert "2 processes at once" in timing.how


def test_plan_measures_an_emulate_scenario_as_the_emulator_runs_it(
    scenario: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", str(scenario), "--step-time", "measure", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["step_time_s"] > 0
    assert data["step_time_source"].startswith("timed here as the emulator runs the sites: 2 processes")
    assert main(["plan", str(scenario), "--step-time", "0.25"]) == 0
    assert "0.25 s per inner step at speed 1 (given;" in capsys.readouterr().out

"""``geoloco plan --step-time measure``: an emulate scenario's steps are timed the way the
emulator runs its sites (one process each, all at once, each at its speed factor); any other
file's steps alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from geoloco.scenarios import step_timing
from geoloco.scenarios.cli import main
from geoloco.scenarios.plan_cmd import load_run_file
from geoloco.scenarios.step_timing import time_steps_together
from geoloco.scenarios.throttle import ComputeThrottle

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


class _FakeClock:
    """``time`` for the step timer and the throttle: a step's compute is what the loss adds."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_slowed_sites_time_leaves_out_the_throttles_sleep(
    scenario: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At speed 0.25 the throttle sleeps three times each step's compute, inside the step's
    timer: the result is the compute (1 ms a step here), not the 4 ms the timer spans."""
    clock = _FakeClock()
    monkeypatch.setattr(step_timing, "time", clock)
    built = load_run_file(scenario).workload.build()
    model = built.build_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sleep = step_timing._SleepMeter(clock=clock.perf_counter, sleep=clock.sleep)
    throttle = ComputeThrottle(0.25, clock=clock.perf_counter, sleep=sleep)
    throttle.attach(optimizer)

    def loss(m: torch.nn.Module, batch: object) -> torch.Tensor:
        clock.now += 0.001
        return built.loss(m, batch)

    site = step_timing._Site(model, optimizer, built.site_batches(0, 2, 0), throttle.wrap_loss(loss), sleep)
    assert step_timing._time_steps(site, 5) == pytest.approx(0.001)
    assert throttle.steps == 5 + step_timing.WARMUP_STEPS
    # With a minimum span the timer goes on past the steps asked for: 4 ms of wall clock a step
    # (1 ms compute, 3 ms asleep), 2 asked, 30 ms at least: 8 timed steps, still 1 ms each.
    assert step_timing._time_steps(site, 2, min_s=0.03) == pytest.approx(0.001)
    assert throttle.steps == 5 + 8 + 2 * step_timing.WARMUP_STEPS


def test_every_site_is_timed_at_once_in_its_own_process(scenario: Path) -> None:
    run_file = load_run_file(scenario)
    timing = time_steps_together(run_file.workload, run_file.training, [1.0, 0.25], steps=4)
    assert len(timing.per_site_s) == 2 and all(t > 0 for t in timing.per_site_s)
    assert timing.seconds == pytest.approx(sum(timing.per_site_s) / 2)
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

"""Scenario keys of heterogeneous sites: time-budget rounds, adaptive deadline, late updates."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from geoloco.coordinator.config import CoordinatorConfig
from geoloco.scenarios.config_file import toml_text
from geoloco.scenarios.emulation import Emulation
from geoloco.scenarios.scenario import ScenarioError, load_scenario

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"

BASE = """
[workload]
name = "mlp"
[algorithm]
inner_steps = 5
[run]
rounds = 3
[[sites]]
name = "a"
[[sites]]
name = "b"
"""


def test_budget_scenario_reaches_the_coordinator_config(tmp_path: Path) -> None:
    scenario = load_scenario(SCENARIOS / "heterogeneous_budget.toml")
    assert "What it shows" in (SCENARIOS / "heterogeneous_budget.toml").read_text()
    assert scenario.algorithm.round_time_budget_s == 3.0
    assert scenario.algorithm.weighting == "steps" and scenario.algorithm.late_updates == "fold"
    assert scenario.run.adaptive_deadline.enabled
    assert [s.speed_factor for s in scenario.sites] == [1.0, 0.5, 0.25]
    # What the emulator writes for `geoloco coordinator --config` parses back to the same keys.
    table = Emulation(scenario, tmp_path).coordinator_config()
    config = CoordinatorConfig.from_dict(tomllib.loads(toml_text(table)))
    assert config.adaptive_deadline == scenario.run.adaptive_deadline
    assert config.algorithm.round_time_budget_s == 3.0 and config.algorithm.weighting == "steps"


@pytest.mark.parametrize(
    ("text", "key", "allowed"),
    [
        (BASE.replace("inner_steps = 5", 'inner_steps = 5\nweighting = "work"'),
         "algorithm.weighting", "'uniform' | 'steps' | 'samples'"),
        (BASE.replace("inner_steps = 5", "inner_steps = 5\nround_time_budget_s = -1"),
         "algorithm.round_time_budget_s", "> 0 seconds"),
        (BASE.replace("inner_steps = 5", 'inner_steps = 5\nlate_updates = "later"'),
         "algorithm.late_updates", "'drop' | 'fold'"),
        (BASE + "[run.adaptive_deadline]\nquantile = 1.5\n", "run.adaptive_deadline.quantile", "(0, 1]"),
        (BASE + "[run.adaptive_deadline]\nmin_s = 9.0\nmax_s = 3.0\n", "run.adaptive_deadline.max_s", ">= min_s"),
        (BASE + "[run.adaptive_deadline]\nenable = true\n", "run.adaptive_deadline.enable", "allowed keys"),
    ],
)
def test_errors_name_the_key_and_what_is_allowed(tmp_path: Path, text: str, key: str, allowed: str) -> None:
    path = tmp_path / "scenario.toml"
    path.write_text(text)
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert info.value.key == key, str(info.value)
    assert allowed in info.value.message, str(info.value)


def test_async_scenarios_reach_the_coordinator_config(tmp_path: Path) -> None:
    for name in ("async.toml", "async_faults.toml"):
        scenario = load_scenario(SCENARIOS / name)
        assert "What it shows" in (SCENARIOS / name).read_text()
        merge = scenario.algorithm.asynchronous
        assert merge.enabled and merge.max_staleness == 6
        table = Emulation(scenario, tmp_path / name).coordinator_config()
        config = CoordinatorConfig.from_dict(tomllib.loads(toml_text(table)))
        assert config.algorithm.asynchronous == merge
    assert load_scenario(SCENARIOS / "async.toml").algorithm.asynchronous.dynamic_local_updates


def test_an_async_scenario_with_secure_aggregation_is_refused_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "scenario.toml"
    path.write_text(
        BASE + "[algorithm.asynchronous]\nenabled = true\n[privacy]\nsecure_aggregation = true\nclip_norm = 1.0\n"
    )
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert info.value.key == "algorithm.asynchronous.enabled", str(info.value)
    assert "cohort" in info.value.message

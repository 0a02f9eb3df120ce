"""Cross-section rules are checked once, in ``TrainingConfig.validate``, so a simulate file, a
scenario and a coordinator file refuse the same combination with the same message, when the file
is read (not when a process the emulator started meets it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.simulation.simulator import SimulatorConfig
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.scenarios.config_file import ConfigFileError
from geoloco.scenarios.scenario import parse_scenario

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"
PARTIAL_WITH_PRIVACY = {
    "algorithm": {"partial_updates": {"enabled": True, "groups": 2}},
    "privacy": {"secure_aggregation": True, "clip_norm": 1.0},
}


def test_partial_updates_with_privacy_are_refused_alike_by_every_file_kind() -> None:
    scenario = tomllib.loads((SCENARIOS / "quickstart.toml").read_text())
    messages = []
    for build in (
        lambda: SimulatorConfig.from_dict({"sites": {"count": 3}, **PARTIAL_WITH_PRIVACY}),
        lambda: CoordinatorConfig.from_dict({"insecure": True, **PARTIAL_WITH_PRIVACY}),
        lambda: parse_scenario({**scenario, **PARTIAL_WITH_PRIVACY}),
    ):
        with pytest.raises((ConfigError, ConfigFileError)) as caught:
            build()
        messages.append(str(caught.value))
    assert all("partial updates are not combined with [privacy]" in m for m in messages), messages
    assert all("algorithm.partial_updates.enabled" in m for m in messages), messages


def test_an_infinite_round_deadline_is_refused_in_a_simulate_file() -> None:
    with pytest.raises(ConfigError, match=r"simulation\.round_deadline_s.*must be > 0 seconds"):
        SimulatorConfig.from_dict({"simulation": {"round_deadline_s": float("inf")}})

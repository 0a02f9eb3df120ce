"""The ``[privacy]`` table from the CLI: ``geoloco coordinator`` configs and emulation scenarios.

The shipped ``secure.toml`` loads; configurations secure aggregation cannot serve (top-k, a quorum
below 3, per-site weights, folded late updates, round deadlines) are refused before anything
starts, naming the key and what to use instead; ``after_upload`` is only for ``kill_site``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from geoloco.scenarios.cli import main
from geoloco.scenarios.scenario import ScenarioError, load_scenario, parse_scenario

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"


def _scenario(sites: int = 4, privacy: str = "", algorithm: str = "", run: str = "", faults: str = "") -> dict:
    import tomllib

    text = f"""
[workload]
name = "mlp"
[algorithm]
inner_steps = 2
{algorithm}
[run]
rounds = 3
{run}
[privacy]
secure_aggregation = true
clip_norm = 1.0
{privacy}
""" + "".join(f'[[sites]]\nname = "s{i}"\n' for i in range(sites)) + faults
    return tomllib.loads(text)


def test_shipped_secure_scenario_loads() -> None:
    path = SCENARIOS / "secure.toml"
    scenario = load_scenario(path)
    assert scenario.privacy.secure_aggregation and scenario.privacy.dp == "distributed"
    assert len(scenario.sites) == 4 and scenario.quorum >= 3
    (fault,) = scenario.faults
    assert fault.kind == "kill_site" and fault.after_upload
    assert path.read_text().startswith("# Secure")


@pytest.mark.parametrize(
    ("kwargs", "key", "match"),
    [
        ({"sites": 2}, "privacy.secure_aggregation", "with 2 the sum reveals"),
        ({"run": "min_sites = 2"}, "run.min_sites", "at least 3 sites"),
        ({"algorithm": 'uplink_codec = "topk:0.1"'}, "algorithm.uplink_codec", "use 'randk:F'"),
        ({"algorithm": 'weighting = "samples"'}, "algorithm.weighting", "uniform"),
        ({"algorithm": 'late_updates = "fold"'}, "algorithm.late_updates", "drop"),
        ({"run": "round_deadline_s = 5.0"}, "run.round_deadline_s", "must not close at a deadline"),
        (
            {"run": "[run.adaptive_deadline]\nenabled = true\n"},
            "run.adaptive_deadline.enabled",
            "cannot be taken out again",
        ),
        ({"privacy": 'dp = "laplace"'}, "privacy.dp", "allowed"),
        (
            {"faults": '[[faults]]\nkind = "cut_link"\nsite = "s1"\nat_round = 1\nafter_upload = true\n'},
            "faults[0].after_upload",
            "only kill_site",
        ),
    ],
)
def test_scenario_privacy_errors_name_the_key(kwargs: dict, key: str, match: str) -> None:
    with pytest.raises(ScenarioError, match=match) as info:
        parse_scenario(_scenario(**kwargs), "s.toml")
    assert info.value.key == key


def test_coordinator_cli_refuses_secure_aggregation_with_a_quorum_below_three(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GEOLOCO_NO_MALLOC_REEXEC", "1")  # re-executing would replace pytest
    config = tmp_path / "coordinator.toml"
    config.write_text(
        'insecure = true\nmin_sites = 2\n[workload]\nname = "mlp"\n'
        "[privacy]\nsecure_aggregation = true\nclip_norm = 1.0\n"
    )
    assert main(["coordinator", "--config", str(config), "--insecure"]) == 2
    err = capsys.readouterr().err
    assert "min_sites" in err and "reveals each site's update" in err


def test_coordinator_config_refuses_a_deadline_under_secure_aggregation() -> None:
    from geoloco.algorithms.config import ConfigError
    from geoloco.algorithms.deadline import AdaptiveDeadlineConfig
    from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
    from geoloco.coordinator.config import CoordinatorConfig

    privacy = PrivacyConfig(secure_aggregation=True, clip_norm=1.0)
    with pytest.raises(ConfigError) as info:
        CoordinatorConfig(insecure=True, min_sites=3, privacy=privacy, round_deadline_s=30.0)
    assert info.value.key == "run.round_deadline_s"  # named as a file writes it
    with pytest.raises(ConfigError) as info:
        CoordinatorConfig(
            insecure=True, min_sites=3, privacy=privacy,
            adaptive_deadline=AdaptiveDeadlineConfig(enabled=True),
        )
    assert info.value.key == "run.adaptive_deadline.enabled"
    # Central DP without secure aggregation keeps deadlines: updates arrive whole.
    CoordinatorConfig(
        insecure=True, min_sites=3, privacy=PrivacyConfig(dp="central", clip_norm=1.0),
        round_deadline_s=30.0,
    )

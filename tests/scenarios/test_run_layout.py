"""One layout for the run's knobs: ``[run]`` in simulate, coordinator and emulate files alike.

Each file kind keeps its run length, seed, quorum, deadline and evaluation under ``[run]`` with
the same names; the old layouts (``[simulation] rounds``, a coordinator's top-level
``total_rounds``) are read for one release with a warning that names the new place, a key set in
both places is refused, and a command-line value wins over either layout.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import tomllib

from geoloco.algorithms import training
from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.simulation.sim_config import SimulatorConfig
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.scenarios.cli import main
from geoloco.scenarios.config_file import toml_text
from geoloco.scenarios.config_kinds import COORDINATOR, SCENARIO, SIMULATE, detect_config_kind
from geoloco.scenarios.research import prepare_run

RUN = {"rounds": 7, "seed": 3, "min_sites": 2, "round_deadline_s": 9.5, "eval_every": 2,
       "adaptive_deadline": {"enabled": True, "margin": 2.0}}


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each old-layout message is logged once per process; every test here looks for it.
    monkeypatch.setattr(training, "_warned", set())


def test_a_coordinator_file_reads_run_and_its_old_layout_alike(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        new = CoordinatorConfig.from_dict({"insecure": True, "run": {**RUN, "heartbeat_interval_s": 0.5}})
    assert not caplog.records
    old_table = {"total_rounds": 7, **{k: v for k, v in RUN.items() if k != "rounds"}, "heartbeat_interval_s": 0.5}
    with caplog.at_level(logging.WARNING):
        old = CoordinatorConfig.from_dict({"insecure": True, **old_table})
    assert old == new
    assert (new.total_rounds, new.seed, new.min_sites, new.round_deadline_s, new.eval_every) == (7, 3, 2, 9.5, 2)
    assert new.adaptive_deadline.enabled and new.adaptive_deadline.margin == 2.0
    [message] = [r.getMessage() for r in caplog.records]
    assert "total_rounds -> [run] rounds" in message and "seed -> [run] seed" in message


def test_a_simulate_file_reads_run_and_its_old_layout_alike(caplog: pytest.LogCaptureFixture) -> None:
    new = SimulatorConfig.from_dict({"run": RUN, "simulation": {"step_time_s": 0.2}})
    with caplog.at_level(logging.WARNING):
        old = SimulatorConfig.from_dict({"simulation": {**RUN, "step_time_s": 0.2}})
    assert old == new and new.simulation.rounds == 7 and new.simulation.step_time_s == 0.2
    assert any("simulation.rounds -> [run] rounds" in r.getMessage() for r in caplog.records)
    # The file form round-trips: what is written is read back to the same config, silently.
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again = SimulatorConfig.from_dict(tomllib.loads(toml_text(new.to_file_dict())))
    assert again == new and not caplog.records


def test_a_key_in_both_places_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError, match=r"^run\.rounds: is set twice: also as total_rounds"):
        CoordinatorConfig.from_dict({"insecure": True, "total_rounds": 3, "run": {"rounds": 4}})
    with pytest.raises(ConfigError, match=r"^run\.seed: is set twice: also as simulation\.seed"):
        SimulatorConfig.from_dict({"simulation": {"seed": 1}, "run": {"seed": 1}})
    with pytest.raises(ConfigError, match=r"^run\.round: unknown key; allowed keys: .*rounds"):
        SimulatorConfig.from_dict({"run": {"round": 3}})


def test_a_bad_value_is_named_where_the_file_put_it() -> None:
    with pytest.raises(ConfigError, match=r"^run\.min_sites: must be >= 1"):
        CoordinatorConfig.from_dict({"insecure": True, "run": {"min_sites": 0}})
    with pytest.raises(ConfigError, match=r"^min_sites: must be >= 1"):
        CoordinatorConfig.from_dict({"insecure": True, "min_sites": 0})
    with pytest.raises(ConfigError, match=r"^run\.eval_every: must be >= 1"):
        SimulatorConfig.from_dict({"run": {"eval_every": 0}})
    with pytest.raises(ConfigError, match=r"^run\.rounds: .*expected an integer"):
        CoordinatorConfig.from_dict({"insecure": True, "run": {"rounds": "ten"}})


def test_the_command_line_wins_over_either_layout(caplog: pytest.LogCaptureFixture) -> None:
    new_file = {"run": {"rounds": 6, "seed": 0}, "sites": {"count": 2}}
    old_file = {"simulation": {"rounds": 6, "seed": 0}, "sites": {"count": 2}}
    with caplog.at_level(logging.WARNING):
        # An old key on the command line against a file of the new layout, and the reverse.
        a = prepare_run(new_file, ["simulation.rounds=3"], "test").simulator
        b = prepare_run(old_file, ["run.rounds=3"], "test").simulator
        c = prepare_run(new_file, ["run.total_inner_steps=40"], "test").simulator
    assert a.simulation.rounds == b.simulation.rounds == 3
    assert c.simulation.total_inner_steps == 40 and c.simulation.rounds is None
    assert any("--set simulation.rounds: the key is [run] rounds now" in r.getMessage() for r in caplog.records)


def test_each_kind_is_told_apart_by_its_own_run_keys() -> None:
    assert detect_config_kind({"run": {"rounds": 3, "timeout_s": 60.0}, "sites": []}) == SCENARIO
    assert detect_config_kind({"run": {"total_inner_steps": 300}}) == SIMULATE
    assert detect_config_kind({"run": {"rounds": 3}, "allowed_sites": ["a"]}) == COORDINATOR
    assert detect_config_kind({"total_rounds": 3}) == COORDINATOR  # the old layout too
    assert detect_config_kind({"run": {"rounds": 3}}) is None  # shared keys only: the command's own kind


def test_geoloco_simulate_flags_and_print_config_use_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "old.toml"
    config.write_text('[workload]\nname = "mlp"\n[sites]\ncount = 2\n[simulation]\nrounds = 5\nseed = 1\n')
    assert main(["simulate", "--config", str(config), "--rounds", "2", "--seed", "4", "--print-config"]) == 0
    printed = capsys.readouterr().out
    table = tomllib.loads(printed)
    assert table["run"]["rounds"] == 2 and table["run"]["seed"] == 4
    assert "rounds" not in table["simulation"] and "seed" not in table["simulation"]
    again = tmp_path / "printed.toml"
    again.write_text(printed)
    assert main(["simulate", "--config", str(again), "--print-config"]) == 0
    assert tomllib.loads(capsys.readouterr().out) == table


def test_the_emulators_coordinator_file_is_in_the_new_layout(tmp_path: Path) -> None:
    from geoloco.scenarios.child_commands import coordinator_table
    from geoloco.scenarios.scenario import load_scenario

    scenario = load_scenario(Path(__file__).resolve().parents[2] / "scenarios" / "quickstart.toml")
    table = coordinator_table(scenario, certs_dir=tmp_path, checkpoint_dir=tmp_path, metrics_path=tmp_path / "m")
    assert "total_rounds" not in table and table["run"]["rounds"] == scenario.run.rounds
    text = toml_text(table)
    config = CoordinatorConfig.from_dict(tomllib.loads(text))
    assert config.total_rounds == scenario.run.rounds and config.eval_every == scenario.run.eval_every
    assert config.heartbeat_timeout_s == scenario.run.heartbeat_timeout_s


def test_a_coordinator_file_with_run_is_refused_by_simulate_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "coordinator.toml"
    config.write_text('allowed_sites = ["a"]\n[run]\nrounds = 3\n')
    assert main(["simulate", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "is a coordinator config" in err and "geoloco coordinator --config" in err

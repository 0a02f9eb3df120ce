"""``--set key=value`` on the commands that take a config, ``--print-config``, and the ``[sites]``
table with ``count`` accepted by every way of building a simulator config."""

from __future__ import annotations

from pathlib import Path

import pytest

from geoloco.algorithms.config import ConfigError, config_from_dict
from geoloco.algorithms.simulation.sim_config import SimulatorConfig
from geoloco.scenarios.cli import build_parser, main
from geoloco.scenarios.config_file import ConfigFileError, tomllib
from geoloco.scenarios.overrides import apply_overrides
from geoloco.scenarios.scenario import Scenario

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"


def test_config_from_dict_accepts_a_sites_table_with_count() -> None:
    config = config_from_dict(SimulatorConfig, {"sites": {"count": 3, "speed_factor": 0.5}})
    assert len(config.sites) == 3 and all(s.speed_factor == 0.5 for s in config.sites)
    assert config == SimulatorConfig.from_dict({"sites": {"count": 3, "speed_factor": 0.5}})
    with pytest.raises(ConfigError, match=r"sites.count: must be an integer >= 1"):
        config_from_dict(SimulatorConfig, {"sites": {"count": 0}})


def test_values_are_typed_by_the_schema() -> None:
    raw: dict = {"sites": [{"name": "a"}, {"name": "b"}]}
    apply_overrides(
        raw,
        [
            "algorithm.inner_steps=50",
            "algorithm.uplink_codec=topk:0.01|int4",
            "inner_optimizer.betas=[0.9, 0.99]",
            "sites.1.name=007",
            "sites.0.speed_factor=0.5",
            "simulation.round_deadline_s=2.5",
        ],
        "test",
        SimulatorConfig,
    )
    config = SimulatorConfig.from_dict(raw)
    assert config.algorithm.inner_steps == 50
    assert config.algorithm.uplink_codec == "topk:0.01|int4"
    assert config.inner_optimizer.betas == (0.9, 0.99)
    assert [s.name for s in config.sites] == ["a", "007"]  # text where the schema says text
    assert config.sites[0].speed_factor == 0.5
    assert config.simulation.round_deadline_s == 2.5


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("noequals", "expected KEY=VALUE"),
        ("=3", "expected KEY=VALUE"),
        ("sites.5.name=x", r"sites.5.name: index out of range: the list has 2 entries, so index it with 0..1"),
        ("sites.0.name.deep=x", "is a value, not a table"),
    ],
)
def test_malformed_overrides_name_what_is_wrong(override: str, message: str) -> None:
    with pytest.raises(ConfigFileError, match=message):
        apply_overrides({"sites": [{"name": "a"}, {"name": "b"}]}, [override], "test", SimulatorConfig)


def test_a_sites_table_with_count_is_indexed_like_the_list_it_stands_for() -> None:
    """``[sites] count = 4``: ``sites.2.x`` sets site 2 alone; ``sites.7.x`` is out of range
    (it used to read as an unknown key ``sites.7``)."""
    raw = apply_overrides(
        {"sites": {"count": 4, "latency_s": 0.1}}, ["sites.2.speed_factor=0.5"], "test", SimulatorConfig
    )
    config = SimulatorConfig.from_dict(raw)
    assert [s.speed_factor for s in config.sites] == [1.0, 1.0, 0.5, 1.0]
    assert all(s.latency_s == 0.1 for s in config.sites)
    with pytest.raises(ConfigFileError) as info:
        apply_overrides({"sites": {"count": 4}}, ["sites.7.speed_factor=0.5"], "test", SimulatorConfig)
    assert "index out of range" in str(info.value) and "0..3" in str(info.value)
    assert "unknown key" not in str(info.value)


def test_simulate_print_config_shows_overrides_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "simulate", "--print-config", "--set", "workload.name=mlp", "--set", "sites.count=3",
            "--set", "algorithm.inner_steps=7", "--set", "outer_optimizer.lr=0.3", "--device", "cpu",
        ]
    )
    assert code == 0
    resolved = tomllib.loads(capsys.readouterr().out)
    assert resolved["algorithm"]["inner_steps"] == 7 and len(resolved["sites"]) == 3
    assert resolved["outer_optimizer"]["lr"] == 0.3 and resolved["workload"]["name"] == "mlp"
    # Defaults are filled in: the resolved outer optimizer names its momentum.
    assert "momentum" in resolved["outer_optimizer"]


def test_a_badly_typed_override_exits_2_naming_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--print-config", "--set", "algorithm.inner_steps=many"]) == 2
    err = capsys.readouterr().err
    assert "algorithm.inner_steps" in err and "expected an integer" in err


def test_emulate_check_applies_overrides_to_the_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["emulate", str(SCENARIOS / "quickstart.toml"), "--check", "--set", "algorithm.inner_steps=3"]) == 0
    assert "H=3" in capsys.readouterr().out
    assert main(["emulate", str(SCENARIOS / "quickstart.toml"), "--check", "--set", "sites.0.latency_ms=5"]) == 2
    assert "sites[0].latency_ms: unknown key" in capsys.readouterr().err


def test_scenario_schema_types_site_names_as_text() -> None:
    raw: dict = {"sites": [{"name": "a"}]}
    apply_overrides(raw, ["sites.0.name=12"], "test", Scenario)
    assert raw["sites"][0]["name"] == "12"


def test_coordinator_config_override_is_checked(tmp_path: Path) -> None:
    # Through the parser and the loader, not main(): the coordinator command re-executes itself
    # to set malloc tunables, which would replace the test process.
    from geoloco.scenarios.coordinator_cmd import load_config

    config = tmp_path / "c.toml"
    config.write_text((SCENARIOS / "coordinator.toml").read_text())
    args = build_parser().parse_args(["coordinator", "--config", str(config), "--set", "run.rounds=7"])
    assert load_config(args)[0].total_rounds == 7
    # The old layout's name still works, set where the file keeps it now ([run] rounds).
    args = build_parser().parse_args(["coordinator", "--config", str(config), "--set", "total_rounds=8"])
    assert load_config(args)[0].total_rounds == 8
    args = build_parser().parse_args(["coordinator", "--config", str(config), "--set", "run.rounds=abc"])
    with pytest.raises(ConfigFileError, match="run.rounds: got 'abc'; expected an integer"):
        load_config(args)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("50", 50), ("0.5", 0.5), ("true", True), ('"007"', "007"), ("[0.9, 0.99]", [0.9, 0.99]),
        ("topk:0.01|int4", "topk:0.01|int4"), ("small", "small"), ("1\nw = 2", "1\nw = 2"),
    ],
)
def test_one_reader_of_values_for_set_grid_and_workload_options(text: str, value: object) -> None:
    """``--set``, ``--grid`` and the site's ``--workload-option`` read a value alike."""
    from geoloco.scenarios.overrides import parse_value
    from geoloco.scenarios.site_cmd import _option
    from geoloco.scenarios.sweep import parse_grid

    assert parse_value(text) == value
    assert apply_overrides({}, [f"algorithm.x={text}"], "f.toml")["algorithm"]["x"] == value
    assert _option(f"x={text}") == ("x", value)
    if isinstance(value, list):
        assert parse_grid(f"k={text}").values == tuple(str(v) for v in value)


def test_a_strict_read_says_why_text_is_not_a_value() -> None:
    from geoloco.scenarios.overrides import parse_value

    for text in ("[1, 2", "1\nw = 2", "small"):
        with pytest.raises(ValueError):
            parse_value(text, strict=True)


def test_the_coordinators_set_examples_are_keys_its_file_accepts(tmp_path: Path) -> None:
    """``geoloco coordinator --help`` used to offer ``--set sites.count=8``, which the coordinator
    refuses (its file has no [sites] table): each example its help gives now loads."""
    import argparse
    import re

    from geoloco.scenarios import coordinator_cmd

    parser = argparse.ArgumentParser()
    coordinator_cmd.register(parser.add_subparsers())
    subparser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["coordinator"]
    help_text = " ".join(subparser.format_help().split())
    examples = re.search(r"dotted as in the file \(([^)]*)\)", help_text)
    assert examples is not None, help_text
    pairs = [e.strip() for e in examples.group(1).split(",")]
    assert pairs and not any(p.startswith("sites.") for p in pairs), pairs
    config = tmp_path / "coordinator.toml"
    config.write_text("insecure = true\n")
    args = subparser.parse_args(["--config", str(config), "--insecure", *[f"--set={p}" for p in pairs]])
    loaded, _ = coordinator_cmd.load_config(args)
    assert loaded.algorithm.inner_steps == 50 and loaded.min_sites == 3

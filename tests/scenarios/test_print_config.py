"""``geoloco simulate --print-config`` prints a TOML file that ``--config`` reads back to the same
config. ``simulate`` is the one command with the flag (coordinator, site and emulate have none)."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Union

import pytest

from geoloco.algorithms.algorithm_config import DEFAULT_OUTER_OPTIMIZERS
from geoloco.algorithms.simulation.sim_config import SimulatorConfig
from geoloco.scenarios.cli import build_parser, main
from geoloco.scenarios.config_file import toml_text, tomllib
from geoloco.scenarios.config_kinds import SIMULATE, detect_config_kind
from geoloco.scenarios.research import ResearchConfig
from geoloco.scenarios.simulate_cmd import load_config
from geoloco.scenarios.workloads import WORKLOADS

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"
SHIPPED_SIMULATE = sorted(
    p.name for p in SCENARIOS.glob("*.toml") if detect_config_kind(tomllib.loads(p.read_text())) == SIMULATE
)


def print_config(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    assert main(["simulate", "--print-config", *args]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["--workload", "mlp", "--device", "cpu"], id="defaults"),
        pytest.param(
            ["--set", "workload.name=mlp", "--set", "algorithm.name=sparseloco", "--set", "sites.count=3",
             "--set", "sites.1.name=far", "--set", "simulation.total_inner_steps=40",
             "--set", "simulation.eval_every_steps=20", "--set", "research.threads=2", "--device", "cpu"],
            id="preset-and-overrides",
        ),
        *[pytest.param(["--config", str(SCENARIOS / name), "--workload", "mlp"], id=name) for name in SHIPPED_SIMULATE],
    ],
)
def test_the_printed_file_reads_back_to_the_same_config(
    args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = print_config(capsys, args)
    printed = tmp_path / "printed.toml"
    printed.write_text(text)

    spec, config = load_config(build_parser().parse_args(["simulate", *args]))
    again_spec, again = load_config(build_parser().parse_args(["simulate", "--config", str(printed)]))
    # The print names the outer optimizer the algorithm defaults to, filled in.
    default_outer = DEFAULT_OUTER_OPTIMIZERS.get(config.algorithm.name, "nesterov")
    assert again == dataclasses.replace(config, outer_optimizer=config.outer_optimizer.resolved(default_outer))
    assert (again_spec.name, again_spec.config()) == (spec.name, spec.config())
    # Printing the printed file gives it back: the [research] table and the comments included.
    assert print_config(capsys, ["--config", str(printed)]) == text


def test_unset_keys_are_left_out_and_derived_values_are_comments(capsys: pytest.CaptureFixture[str]) -> None:
    text = print_config(capsys, ["--workload", "mlp", "--device", "cpu", "--rounds", "7"])
    assert "= null" not in text and "= None" not in text
    raw = tomllib.loads(text)
    assert "round_deadline_s" not in raw["simulation"] and "name" not in raw["sites"][0]
    assert "resolved_device" not in raw and "run_rounds" not in raw
    assert '# Resolved: runs on cpu (simulation.device = "cpu"), 7 rounds.' in text.splitlines()


def _optional_keys_without_a_none_default(cls: type[Any], prefix: str = "") -> list[str]:
    """Dotted keys of ``cls`` (and the dataclasses under it) typed ``X | None`` whose default
    is not ``None``: such a key set to ``None`` could not be written to TOML and read back."""
    found: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        annotation = hints[f.name]
        members = typing.get_args(annotation) if typing.get_origin(annotation) in (Union, types.UnionType) else ()
        if type(None) in members:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if default is not None:
                found.append(prefix + f.name)
        for member in members or (annotation,):
            for inner in typing.get_args(member) or (member,):  # list[SiteConfig] -> SiteConfig
                if dataclasses.is_dataclass(inner) and isinstance(inner, type):
                    found += _optional_keys_without_a_none_default(inner, f"{prefix}{f.name}.")
    return found


@pytest.mark.parametrize(
    "schema",
    [SimulatorConfig, ResearchConfig, *(factory.config_class for factory in WORKLOADS.values())],
    ids=lambda schema: schema.__name__,
)
def test_every_key_a_print_leaves_out_reads_back_as_none(schema: type[Any]) -> None:
    """``--print-config`` leaves ``None`` values out (TOML has no null); that is lossless only
    while every ``X | None`` key defaults to ``None``. A new key that breaks this needs another
    spelling of "unset" in the file."""
    assert _optional_keys_without_a_none_default(schema) == []


def test_toml_text_leaves_none_out_of_tables_and_refuses_it_in_arrays() -> None:
    text = toml_text({"a": None, "b": {"c": None, "d": 1}, "e": [{"f": None, "g": "x"}]}, comments=["hi", ""])
    assert text.startswith("# hi\n#\n\n")
    assert tomllib.loads(text) == {"b": {"d": 1}, "e": [{"g": "x"}]}
    with pytest.raises(ValueError, match=r"b\.c: TOML has no null"):
        toml_text({"b": {"c": [1, None]}})

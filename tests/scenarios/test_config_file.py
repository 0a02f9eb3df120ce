"""One reader for every command's TOML: the file-level errors name the file and what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from geoloco.scenarios.config_file import ConfigFileError, read_toml
from geoloco.scenarios.scenario import ScenarioError


def test_reads_a_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[algorithm]\ninner_steps = 5\nuplink_codec = "int8"\n')
    assert read_toml(path) == {"algorithm": {"inner_steps": 5, "uplink_codec": "int8"}}


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing.toml", "file not found"),
        (lambda d: d, "is a folder; pass the TOML file"),
        (lambda d: (d / "bad.toml", (d / "bad.toml").write_text("[algorithm\n"))[0], "not valid TOML"),
    ],
)
def test_file_level_errors_name_the_file(tmp_path: Path, make, message: str) -> None:  # type: ignore[no-untyped-def]
    path = make(tmp_path)
    with pytest.raises(ConfigFileError, match=message) as info:
        read_toml(path)
    assert info.value.source == str(path) and str(info.value).startswith(f"{path}: ")


def test_scenario_errors_are_the_same_type() -> None:
    assert ScenarioError is ConfigFileError

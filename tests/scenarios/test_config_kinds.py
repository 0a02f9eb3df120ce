"""A config file handed to the wrong command is refused in one line naming the command that runs it.

The kind is told in one place (``geoloco.scenarios.config_kinds``) from the keys only one kind's
schema has; every command that reads a file goes through ``read_config``. Run through the real
entry point, ``geoloco.scenarios.cli.main`` in-process, and once as a subprocess.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from geoloco.scenarios.cli import main
from geoloco.scenarios.config_file import EXIT_CONFIG_ERROR, tomllib
from geoloco.scenarios.config_kinds import (
    COORDINATOR,
    KINDS,
    RELAY,
    SCENARIO,
    SIMULATE,
    detect_config_kind,
    distinguishing_keys,
)

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "scenarios"
QUICKSTART = SCENARIOS / "quickstart.toml"
SIMULATE_FILE = SCENARIOS / "simulate.toml"
COORDINATOR_FILE = SCENARIOS / "coordinator.toml"
RELAY_FILE = ROOT / "relay" / "relay.toml"
SHIPPED = {
    **{path: None for path in sorted(SCENARIOS.glob("*.toml"))},
    QUICKSTART: SCENARIO, SIMULATE_FILE: SIMULATE, COORDINATOR_FILE: COORDINATOR, RELAY_FILE: RELAY,
}
"""Every shipped TOML file, with the kind it must be detected as where the name says it."""


@pytest.fixture(autouse=True)
def _no_reexec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEOLOCO_NO_MALLOC_REEXEC", "1")  # re-executing would replace pytest


def test_each_kind_is_told_by_keys_only_its_schema_has() -> None:
    keys = distinguishing_keys()
    assert set(keys) == set(KINDS)
    # [run] is every kind's; the [run] keys only one kind has tell it (run.KEY).
    assert keys[SCENARIO] == {"faults", "run.timeout_s", "run.time_budget_s"}
    assert keys[SIMULATE] == {
        "simulation", "research", "run.total_inner_steps", "run.target_eval_loss", "run.eval_every_steps",
        "run.max_wall_clock_s",
    }
    assert {"total_rounds", "allowed_sites", "checkpoint_dir"} <= keys[COORDINATOR]
    assert {"coordinator", "upward_codec"} <= keys[RELAY]
    for kind, own in keys.items():
        assert not own & set().union(*(other for name, other in keys.items() if name != kind)), kind


@pytest.mark.parametrize("path", list(SHIPPED), ids=[p.name for p in SHIPPED])
def test_every_shipped_file_has_a_kind(path: Path) -> None:
    kind = detect_config_kind(tomllib.loads(path.read_text()))
    assert kind in KINDS, f"{path.name}: its keys do not tell which command runs it"
    assert SHIPPED[path] in (None, kind)


@pytest.mark.parametrize(
    ("raw", "kind"),
    [
        ({"algorithm": {"inner_steps": 5}, "workload": {"name": "mlp"}}, None),  # shared tables only
        ({"run": {"timeout_s": 1.0}, "simulation": {}}, None),  # two kinds: the schema says which key is wrong
        ({"run": {"rounds": 1}}, None),  # [run] alone: every kind has it
        ({"faults": [{"kind": "kill_site"}]}, SCENARIO),
        ({"total_rounds": 3, "algorithm": {}}, COORDINATOR),
    ],
)
def test_a_file_whose_keys_do_not_tell_has_no_kind(raw: dict[str, object], kind: str | None) -> None:
    assert detect_config_kind(raw) == kind


WRONG_KIND = [
    # (argv with {path}, the file, the command line the error must name)
    (["simulate", "--config", "{path}", "--out", "{tmp}"], QUICKSTART, "geoloco emulate {path}"),
    (["simulate", "--config", "{path}", "--out", "{tmp}"], COORDINATOR_FILE, "geoloco coordinator --config {path}"),
    (["simulate", "--config", "{path}", "--out", "{tmp}"], RELAY_FILE, "geoloco relay --config {path}"),
    (["emulate", "{path}", "--check"], SIMULATE_FILE, "geoloco simulate --config {path}"),
    (["emulate", "{path}", "--check"], COORDINATOR_FILE, "geoloco coordinator --config {path}"),
    (["coordinator", "--config", "{path}", "--insecure"], QUICKSTART, "geoloco emulate {path}"),
    (["coordinator", "--config", "{path}", "--insecure"], SIMULATE_FILE, "geoloco simulate --config {path}"),
    (["relay", "--config", "{path}", "--insecure"], COORDINATOR_FILE, "geoloco coordinator --config {path}"),
    (["sweep", "{path}", "--out", "{tmp}", "--no-plots"], QUICKSTART, "geoloco emulate {path}"),
    (["tune", "{path}", "--param", "outer_optimizer.lr=0.1:1.0", "--trials", "1", "--out", "{tmp}", "--no-plots"],
     COORDINATOR_FILE, "geoloco coordinator --config {path}"),
    (["plan", "{path}", "--step-time", "0.1"], RELAY_FILE, "geoloco relay --config {path}"),
]


@pytest.mark.parametrize(
    ("argv", "path", "usage"), WRONG_KIND, ids=[f"{a[0]}-{p.name}" for a, p, _ in WRONG_KIND]
)
def test_a_file_of_another_kind_is_refused_in_one_line_naming_its_command(
    argv: list[str], path: Path, usage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main([a.format(path=path, tmp=out) for a in argv]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    kind = KINDS[detect_config_kind(tomllib.loads(path.read_text())) or ""]
    assert err.count("\n") == 1, err
    assert err.startswith(f"geoloco {argv[0]}: error: {path}: is {kind.what} (it has "), err
    assert err.endswith(f"; run it with `{usage.format(path=path)}`\n"), err
    assert not out.exists()


def test_the_refusal_is_the_whole_of_stderr_in_a_real_process(tmp_path: Path) -> None:
    """What a user sees: one line, status 2, no traceback and no log lines around it."""
    proc = subprocess.run(
        [sys.executable, "-m", "geoloco.scenarios.cli", "simulate", "--config", "scenarios/quickstart.toml",
         "--out", str(tmp_path / "out")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == EXIT_CONFIG_ERROR
    assert proc.stderr == (
        "geoloco simulate: error: scenarios/quickstart.toml: is an emulate scenario (it has run.timeout_s), "
        "not a simulate config; run it with `geoloco emulate scenarios/quickstart.toml`\n"
    )
    assert proc.stdout == ""

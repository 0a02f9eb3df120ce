"""Every ``geoloco`` command reports a config error the same way, and reads ``[workload]`` alike.

One error type (``ConfigFileError``), one exit status (``EXIT_CONFIG_ERROR``) and one line on
stderr, ``geoloco COMMAND: error: SOURCE: dotted.key: what is allowed``, for a bad file, table or
flag of ``simulate``, ``sweep``, ``plan``, ``emulate``, ``coordinator``, ``site`` and ``certs``; and one
``WorkloadSpec`` from the same ``[workload]`` table whichever command reads it. In-process through
``geoloco.scenarios.cli.main`` (the subprocess variants are in the per-command test files).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from geoloco.scenarios.cli import SUBCOMMANDS, main
from geoloco.scenarios.config_file import EXIT_CONFIG_ERROR
from geoloco.scenarios.workloads import DEFAULT_WORKLOAD, WorkloadSpec

SIMULATE = """
[workload]
name = "mlp"
{workload}
[algorithm]
inner_steps = {inner_steps}
[sites]
count = 3
[simulation]
rounds = 1
device = "cpu"
"""

SCENARIO = """
[workload]
name = "mlp"
{workload}
[algorithm]
inner_steps = {inner_steps}
[run]
rounds = 2
[[sites]]
name = "0"
[[sites]]
name = "1"
[[sites]]
name = "2"
"""

COORDINATOR = """
total_rounds = 2
min_sites = 3
insecure = true
[workload]
name = "mlp"
{workload}
[algorithm]
inner_steps = {inner_steps}
"""

FILE_COMMANDS = {
    "simulate": (SIMULATE, lambda path, out: ["simulate", "--config", str(path), "--out", str(out)]),
    "emulate": (SCENARIO, lambda path, out: ["emulate", str(path), "--check"]),
    "coordinator": (COORDINATOR, lambda path, out: ["coordinator", "--config", str(path), "--insecure"]),
    "sweep": (SIMULATE, lambda path, out: ["sweep", str(path), "--out", str(out), "--no-plots"]),
    "plan": (SCENARIO, lambda path, out: ["plan", str(path), "--step-time", "0.1"]),
    "tune": (SIMULATE, lambda path, out: ["tune", str(path), "--param", "outer_optimizer.lr=0.1:1.0",
                                          "--trials", "1", "--out", str(out), "--no-plots"]),
}
"""Commands that read a TOML file: (template, argv for a file and an output folder)."""


@pytest.fixture(autouse=True)
def _no_reexec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEOLOCO_NO_MALLOC_REEXEC", "1")  # re-executing would replace pytest


def _write(tmp_path: Path, template: str, *, workload: str = "", inner_steps: int = 5) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(template.format(workload=workload, inner_steps=inner_steps))
    return path


def test_every_command_is_covered() -> None:
    # relay reads a TOML file without run settings (they come from the coordinator): its bad
    # keys and missing file are checked in tests/relay/test_relay_cli.py; export reads a
    # checkpoint folder, not a TOML file (tests/scenarios/test_export_cmd.py).
    assert set(SUBCOMMANDS) == {*FILE_COMMANDS, "site", "certs", "relay", "export"}


@pytest.mark.parametrize("command", FILE_COMMANDS)
@pytest.mark.parametrize(
    ("change", "key", "allowed"),
    [
        ({"inner_steps": 0}, "algorithm.inner_steps", "must be >= 1"),
        ({"workload": "hidden_dims = 3"}, "workload.hidden_dims", "allowed options: input_dim (int)"),
        ({"workload": 'hidden_dim = "3"'}, "workload.hidden_dim", "must be int"),
    ],
)
def test_file_commands_report_a_bad_key_alike(
    command: str, change: dict[str, object], key: str, allowed: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    template, argv = FILE_COMMANDS[command]
    path = _write(tmp_path, template, **change)  # type: ignore[arg-type]
    out = tmp_path / "out"
    assert main(argv(path, out)) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert err.startswith(f"geoloco {command}: error: {path}: {key}: "), err
    assert allowed in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("command", FILE_COMMANDS)
def test_file_commands_report_a_missing_file_alike(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.toml"
    assert main(FILE_COMMANDS[command][1](missing, tmp_path / "out")) == EXIT_CONFIG_ERROR
    assert capsys.readouterr().err == f"geoloco {command}: error: {missing}: file not found\n"


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["site", "--coordinator", "localhost:1", "--name", "0", "--insecure", "--speed-factor", "2"],
            "geoloco site: error: command line: --speed-factor: must be in (0, 1]",
        ),
        (
            ["site", "--coordinator", "localhost:1", "--name", "a/b", "--insecure"],
            "geoloco site: error: command line: --name: ",
        ),
        (
            ["site", "--coordinator", "localhost:1", "--name", "0", "--insecure", "--workload", "resnet"],
            "geoloco site: error: command line: --workload: got 'resnet'; allowed values: gpt, mlp",
        ),
        (
            ["certs", "issue", "{tmp}", "x", "--host", "h"],
            "geoloco certs issue: error: command line: --host: only applies with --coordinator",
        ),
        (["certs", "issue", "{tmp}", "x"], "geoloco certs issue: error: {tmp}: "),
    ],
)
def test_flag_commands_report_a_bad_flag_alike(
    argv: list[str], line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert err.startswith(line.replace("{tmp}", str(tmp_path))), err


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--rounds", "0"],
        ["coordinator", "--config", "c.toml", "--port", "70000"],
        ["site", "--coordinator", "h:1", "--name", "0", "--insecure", "--num-sites", "0"],
        ["site", "--coordinator", "h:1", "--name", "0", "--insecure", "--metrics-port", "-1"],
        ["site", "--coordinator", "h:1", "--name", "0", "--insecure", "--colluding-sites", "-1"],
        ["site", "--coordinator", "h:1", "--name", "0", "--insecure", "--min-threshold", "1"],
    ],
)
def test_a_bad_flag_value_exits_with_the_same_status(argv: list[str]) -> None:
    """argparse rejects it (usage on stderr) with the status of every other config error."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == EXIT_CONFIG_ERROR


# ------------------------------------------------------------------------------------------------
# One [workload] table, one WorkloadSpec


def _spec_through_every_command(tmp_path: Path, workload_table: str) -> dict[str, WorkloadSpec]:
    """The ``WorkloadSpec`` each command reads from the same table (absent: ``""``)."""
    from geoloco.scenarios import coordinator_cmd, simulate_cmd, site_cmd
    from geoloco.scenarios.scenario import load_scenario

    def file(template: str, name: str) -> Path:
        text = template.format(workload="", inner_steps=5).replace('[workload]\nname = "mlp"\n', workload_table)
        path = tmp_path / name
        path.write_text(text)
        return path

    simulate_args = argparse.Namespace(
        config=file(SIMULATE, "s.toml"), workload=None, rounds=None, sites=None, seed=None, device=None
    )
    coordinator_args = argparse.Namespace(
        config=file(COORDINATOR, "c.toml"), host=None, port=None, http_port=None, certs=None,
        cert_name=None, insecure=True, metrics=None, checkpoint_dir=None,
    )
    coordinator_config, coordinator_spec = coordinator_cmd.load_config(coordinator_args)
    site_args = argparse.Namespace(
        name="0", workload=None, workload_option=[], seed=None, site_index=None, num_sites=None,
        inner_lr=None,
    )
    # The site reads the table the coordinator advertises (RunConfig.config_json).
    site_plan = site_cmd.resolve_plan(site_args, coordinator_config.to_dict())
    return {
        "simulate": simulate_cmd.load_config(simulate_args)[0],
        "emulate": load_scenario(file(SCENARIO, "e.toml")).workload,
        "coordinator": coordinator_spec,
        "site": site_plan.workload,
    }


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        (
            '[workload]\nname = "mlp"\nhidden_dim = 8\nbatch_size = 4\n',
            WorkloadSpec(name="mlp", options={"hidden_dim": 8, "batch_size": 4}),
        ),
        ('[workload]\nsize = "tiny"\n', WorkloadSpec(name="gpt", options={"size": "tiny"})),
        ("", WorkloadSpec()),
    ],
    ids=["options", "name-defaulted", "no-table"],
)
def test_the_same_workload_table_gives_the_same_spec_in_every_command(
    table: str, expected: WorkloadSpec, tmp_path: Path
) -> None:
    specs = _spec_through_every_command(tmp_path, table)
    assert specs == dict.fromkeys(specs, expected)
    assert expected.name in ("mlp", DEFAULT_WORKLOAD)
    assert {command: spec.config() for command, spec in specs.items()} == dict.fromkeys(specs, expected.config())

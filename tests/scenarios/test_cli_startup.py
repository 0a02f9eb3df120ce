"""CLI start-up: help for every command parses without importing torch (about 2-6 s on a loaded
machine, for a command that prints text), in a fresh interpreter as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from geoloco.scenarios.cli import SUBCOMMANDS

PROBE = """
import json, sys
from geoloco.scenarios.cli import main
try:
    main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
heavy = sorted(m for m in ("torch", "numpy", "grpc", "cryptography") if m in sys.modules)
print(json.dumps({"code": code, "heavy": heavy}))
"""


def _probe(*argv: str) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("argv", [("--help",), *((name, "--help") for name in SUBCOMMANDS)], ids=" ".join)
def test_help_does_not_import_torch(argv: tuple[str, ...]) -> None:
    result = _probe(*argv)
    assert result["code"] == 0
    assert "torch" not in result["heavy"], f"geoloco {' '.join(argv)} imported {result['heavy']}"


def test_a_usage_error_does_not_import_torch() -> None:
    result = _probe("simulate", "--rounds", "many")
    assert result["code"] == 2 and "torch" not in result["heavy"]


def test_grpc_core_lines_stay_out_of_the_commands_output_unless_debugging(monkeypatch: pytest.MonkeyPatch) -> None:
    """gRPC's C-core lines (I1201/E1201 ...) interleaved with geoloco's: the CLI silences them
    before grpc is imported, except with --log-level DEBUG or when the user set the variable."""
    from geoloco.scenarios.cli import quiet_grpc_core

    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    quiet_grpc_core(["coordinator", "--config", "c.toml"])
    assert os.environ["GRPC_VERBOSITY"] == "NONE"
    for debug in (["--log-level", "DEBUG", "site"], ["--log-level=DEBUG", "site"]):
        monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
        quiet_grpc_core(debug)
        assert "GRPC_VERBOSITY" not in os.environ
    monkeypatch.setenv("GRPC_VERBOSITY", "INFO")
    quiet_grpc_core(["site"])
    assert os.environ["GRPC_VERBOSITY"] == "INFO"

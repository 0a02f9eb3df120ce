"""``geoloco coordinator`` beside a previous run it cannot resume: one line and exit 1, or
``--fresh``.

A checkpoint folder that holds a previous run's tensor files but no ``checkpoint.json`` used to
start a new run at round 0 beside them; now the command stops before serving with one line that
says what is wrong and names ``--fresh``, which sets ``resume = false``.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from geoloco.coordinator.checkpoint import POINTER_NAME, save_checkpoint
from geoloco.coordinator.server import CoordinatorServer
from geoloco.scenarios.cli import build_parser, main
from geoloco.scenarios.config_file import EXIT_RUNTIME_ERROR
from geoloco.scenarios.coordinator_cmd import load_config

CONFIG = """
total_rounds = 2
checkpoint_dir = "{checkpoints}"

[workload]
name = "mlp"
"""


@pytest.fixture(autouse=True)
def _no_reexec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEOLOCO_NO_MALLOC_REEXEC", "1")  # re-executing would replace pytest


def test_tensor_files_without_a_pointer_stop_the_start_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def serve(self: CoordinatorServer) -> int:
        raise AssertionError("the coordinator must not serve beside a run it cannot resume")

    monkeypatch.setattr(CoordinatorServer, "start", serve)
    checkpoints = tmp_path / "checkpoints"
    save_checkpoint(checkpoints, 4, {"weights": torch.zeros(3)})
    (checkpoints / POINTER_NAME).unlink()
    config = tmp_path / "coordinator.toml"
    config.write_text(CONFIG.format(checkpoints=checkpoints))

    status = main(["coordinator", "--config", str(config), "--insecure", "--port", "0", "--http-port", "0"])
    captured = capsys.readouterr()
    assert status == EXIT_RUNTIME_ERROR
    assert "listening on" not in captured.out and "starting at round" not in captured.out
    errors = [line for line in captured.err.splitlines() if line.startswith("geoloco coordinator: error:")]
    assert len(errors) == 1 and "round-000004.safetensors" in errors[0] and "--fresh" in errors[0], captured.err
    assert "Traceback" not in captured.err
    assert (checkpoints / "round-000004.safetensors").exists()


def test_fresh_flag_sets_resume_false(tmp_path: Path) -> None:
    config = tmp_path / "coordinator.toml"
    config.write_text(CONFIG.format(checkpoints=tmp_path / "checkpoints"))
    parser = build_parser()
    resumed, _ = load_config(parser.parse_args(["coordinator", "--config", str(config), "--insecure"]))
    fresh, _ = load_config(parser.parse_args(["coordinator", "--config", str(config), "--insecure", "--fresh"]))
    assert resumed.resume is True and fresh.resume is False


def _live_coordinator(checkpoints: Path) -> CoordinatorServer:
    """A serving coordinator holding ``checkpoints`` (another process in real life)."""
    from geoloco.coordinator.config import CoordinatorConfig
    from geoloco.scenarios.workloads import MLPWorkload

    model = MLPWorkload().build_model(0)
    server = CoordinatorServer.from_model(
        CoordinatorConfig(insecure=True, port=0, total_rounds=2, checkpoint_dir=str(checkpoints)), model
    )
    server.start()
    return server


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("geoloco coordinator: error:")]


def test_fresh_beside_a_live_coordinator_is_refused_naming_it_and_moves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same folder (and port): the lock refuses before anything is read, moved or bound."""
    checkpoints = tmp_path / "checkpoints"
    live = _live_coordinator(checkpoints)
    try:
        save_checkpoint(checkpoints, 4, {"weights": torch.zeros(3)})
        before = sorted(p.name for p in checkpoints.iterdir())
        config = tmp_path / "coordinator.toml"
        config.write_text(CONFIG.format(checkpoints=checkpoints))
        status = main([
            "coordinator", "--config", str(config), "--insecure", "--fresh",
            "--port", str(live.port), "--http-port", "0",
        ])
        captured = capsys.readouterr()
        assert status == EXIT_RUNTIME_ERROR
        errors = _errors(captured.err)
        assert len(errors) == 1 and "in use by another coordinator" in errors[0], captured.err
        assert f"pid {os.getpid()} on {socket.gethostname()}" in errors[0]
        assert "starting at round" not in captured.out and "Traceback" not in captured.err
        assert sorted(p.name for p in checkpoints.iterdir()) == before
        assert live.rounds.round == 0 and not live.rounds.finished  # still serving its run
    finally:
        live.stop(grace=0)


def test_fresh_on_a_port_in_use_fails_before_moving_the_previous_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another folder, same port: the bind fails first, so the previous run stays where it was."""
    live = _live_coordinator(tmp_path / "live")
    try:
        checkpoints = tmp_path / "checkpoints"
        save_checkpoint(checkpoints, 4, {"weights": torch.zeros(3)})
        metrics = tmp_path / "metrics.jsonl"
        metrics.write_text('{"round": 3}\n')
        before = sorted(p.name for p in checkpoints.iterdir())
        config = tmp_path / "coordinator.toml"
        config.write_text(f'metrics_path = "{metrics}"' + CONFIG.format(checkpoints=checkpoints))
        status = main([
            "coordinator", "--config", str(config), "--insecure", "--fresh",
            "--port", str(live.port), "--http-port", "0",
        ])
        captured = capsys.readouterr()
        assert status == EXIT_RUNTIME_ERROR
        assert sorted(p.name for p in checkpoints.iterdir()) == before
        assert metrics.read_text() == '{"round": 3}\n'
        errors = _errors(captured.err)
        assert len(errors) == 1 and f"cannot listen on 127.0.0.1:{live.port}" in errors[0], captured.err
        assert "nothing was moved" in errors[0]
        assert "starting at round" not in captured.out
    finally:
        live.stop(grace=0)

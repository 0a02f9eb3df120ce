"""A new run (``resume = false``, ``--fresh``) never loses the previous run's work.

* One coordinator per checkpoint folder: ``CheckpointFolderLock`` refuses a second one (another
  process or another server in this one) with one line naming the holder's pid and host; the
  kernel drops the lock when the holder dies, so a killed coordinator blocks nothing.
* The server binds its port before it moves the previous run aside: a start that cannot serve
  leaves the checkpoints and the metrics file where they were.
* ``metrics.jsonl`` moves into ``previous-run-N`` with the checkpoints, so the rounds of one file
  never go backwards.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _round_helpers import FakeClock, join, tiny_weights, upload

from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.checkpoint import LOCK_NAME, POINTER_NAME, CheckpointError, CheckpointFolderLock
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.metrics import MetricsWriter, read_metrics
from geoloco.coordinator.rounds import RoundStateMachine
from geoloco.coordinator.server import CoordinatorServer


def _config(tmp_path: Path, **overrides: object) -> CoordinatorConfig:
    settings: dict[str, object] = {
        "algorithm": AlgorithmConfig(inner_steps=2),
        "insecure": True,
        "total_rounds": 10,
        "min_sites": 1,
        "port": 0,
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "metrics_path": str(tmp_path / "metrics.jsonl"),
    }
    settings.update(overrides)
    return CoordinatorConfig(**settings)  # type: ignore[arg-type]


def _previous_run(tmp_path: Path, rounds: int = 2) -> list[str]:
    """A previous run of ``rounds`` rounds in ``tmp_path/ckpt`` with its metrics file; the names
    of its checkpoint files."""
    config = _config(tmp_path)
    weights, layout = tiny_weights()
    machine = RoundStateMachine(config, weights, layout, clock=FakeClock())
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    join(machine, "a")
    for r in range(rounds):
        upload(machine, "a", torch.randn(machine.numel, generator=torch.Generator().manual_seed(r)))
        record = machine.poll()
        assert record is not None
        writer.write(record)
    writer.close()
    machine.close()  # as a stopped coordinator: its background snapshot is on disk
    return sorted(p.name for p in (tmp_path / "ckpt").iterdir())


def _server(config: CoordinatorConfig) -> CoordinatorServer:
    weights, layout = tiny_weights()
    return CoordinatorServer(config, weights, layout, clock=FakeClock())


def test_a_second_holder_of_the_folder_is_refused_with_the_holders_pid_and_host(tmp_path: Path) -> None:
    first = CheckpointFolderLock.acquire(tmp_path)
    with pytest.raises(CheckpointError) as info:
        CheckpointFolderLock.acquire(tmp_path)
    message = str(info.value)
    assert "\n" not in message and "in use by another coordinator" in message
    assert f"pid {os.getpid()} on {socket.gethostname()}" in message
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()
    CheckpointFolderLock.acquire(tmp_path).release()


def test_the_lock_of_a_killed_holder_is_free_at_once(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from geoloco.coordinator.checkpoint import CheckpointFolderLock as L; "
         "lock = L.acquire(sys.argv[1]); print('held', flush=True); sys.stdin.read()",
         str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError, match=f"pid {holder.pid} on "):
            CheckpointFolderLock.acquire(tmp_path)
    finally:
        holder.kill()
        holder.wait(10)
    assert (tmp_path / LOCK_NAME).exists()  # killed: it could not remove its file ...
    CheckpointFolderLock.acquire(tmp_path).release()  # ... but the kernel dropped its lock


def test_a_second_server_on_a_live_coordinators_folder_is_refused_and_touches_nothing(tmp_path: Path) -> None:
    files = _previous_run(tmp_path)
    live = _server(_config(tmp_path))
    try:
        live.start()
        assert live.rounds.round == 2
        with pytest.raises(CheckpointError, match="in use by another coordinator"):
            _server(_config(tmp_path, resume=False))
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == sorted([*files, LOCK_NAME])
        assert [r["round"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]
    finally:
        live.stop(grace=0)
    assert not (tmp_path / "ckpt" / LOCK_NAME).exists()


def test_a_fresh_start_that_cannot_bind_moves_nothing(tmp_path: Path) -> None:
    files = _previous_run(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = _server(_config(tmp_path, resume=False, port=taken.getsockname()[1]))
        try:
            with pytest.raises((OSError, RuntimeError)):
                server.start()
        finally:
            server.stop(grace=0)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == files
    assert [r["round"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]


def test_a_fresh_run_moves_the_metrics_file_aside_with_the_checkpoints(tmp_path: Path) -> None:
    files = _previous_run(tmp_path)
    server = _server(_config(tmp_path, resume=False))
    try:
        server.start()
        archive = tmp_path / "ckpt" / "previous-run-1"
        assert server.previous_run == archive
        assert sorted(p.name for p in archive.iterdir()) == sorted([*files, "metrics.jsonl"])
        assert [r["round"] for r in read_metrics(archive / "metrics.jsonl")] == [0, 1]
        rounds = server.rounds
        join(rounds, "a")
        upload(rounds, "a", torch.full((rounds.numel,), 0.01))
        deadline = time.monotonic() + 30
        while rounds.round == 0 and time.monotonic() < deadline:
            rounds.wait_for_change(0.2)
        assert rounds.round == 1
    finally:
        server.stop(grace=0)
    # The new file holds the new run only: its rounds start at 0 and never go backwards.
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["round"] for r in records] == [0]
    assert (tmp_path / "ckpt" / POINTER_NAME).exists()

"""A coordinator starts from its checkpoint folder only when it can trust it, and says so.

Without sockets: ``RoundStateMachine`` runs two rounds with a checkpoint folder, the folder is
damaged in one way, and a new state machine on it must refuse with ``CheckpointError`` (one line
naming the problem and ``--fresh``) instead of resuming from it or silently starting over. With
``resume = false`` it starts at round 0 and keeps the previous run aside. A round record that the
previous process did not write (killed between the checkpoint and the metrics line) is replayed
from the checkpoint, exactly once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _round_helpers import FakeClock, join, tiny_weights, upload

from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.checkpoint import POINTER_NAME, CheckpointError
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.metrics import MetricsWriter, read_metrics
from geoloco.coordinator.rounds import RoundStateMachine


def _make(tmp_path: Path, **overrides: object) -> RoundStateMachine:
    settings: dict[str, object] = {
        "algorithm": AlgorithmConfig(inner_steps=2, downlink_codec="int8"),
        "insecure": True,
        "total_rounds": 10,
        "min_sites": 1,
        "checkpoint_dir": str(tmp_path / "ckpt"),
    }
    settings.update(overrides)
    weights, layout = tiny_weights()
    return RoundStateMachine(CoordinatorConfig(**settings), weights, layout, clock=FakeClock())  # type: ignore[arg-type]


def _two_rounds(tmp_path: Path, metrics: MetricsWriter | None = None) -> RoundStateMachine:
    rounds = _make(tmp_path) if metrics is None else _make(tmp_path, metrics_path=str(metrics.path))
    join(rounds, "a")
    for r in range(2):
        upload(rounds, "a", torch.randn(rounds.numel, generator=torch.Generator().manual_seed(r)))
        record = rounds.poll()
        assert record is not None
        if metrics is not None:
            metrics.write(record)
    assert rounds.round == 2
    rounds.close()  # as a stopped coordinator: its background snapshot is on disk
    return rounds


def _edit_pointer(tmp_path: Path, edit: object) -> None:
    path = tmp_path / "ckpt" / POINTER_NAME
    pointer = json.loads(path.read_text())
    edit(pointer)  # type: ignore[operator]
    path.write_text(json.dumps(pointer))


def test_missing_metadata_key_is_a_one_line_error_not_a_traceback(tmp_path: Path) -> None:
    _two_rounds(tmp_path)
    _edit_pointer(tmp_path, lambda p: p["metadata"].pop("strategy"))
    with pytest.raises(CheckpointError, match=r"metadata lacks 'strategy'.*--fresh") as info:
        _make(tmp_path)
    assert "\n" not in str(info.value)


def test_weights_that_do_not_match_the_recorded_digest_are_refused(tmp_path: Path) -> None:
    _two_rounds(tmp_path)
    _edit_pointer(tmp_path, lambda p: p["metadata"].update(weights_digest="0" * 64))
    with pytest.raises(CheckpointError, match=r"holds weights with digest .* records 0000"):
        _make(tmp_path)


def test_tensor_files_without_their_pointer_do_not_start_a_new_run(tmp_path: Path) -> None:
    _two_rounds(tmp_path)
    (tmp_path / "ckpt" / POINTER_NAME).unlink()
    with pytest.raises(CheckpointError, match="--fresh"):
        _make(tmp_path)


def test_resume_false_starts_at_round_zero_and_keeps_the_previous_run(tmp_path: Path) -> None:
    first = _two_rounds(tmp_path)
    fresh = _make(tmp_path, resume=False)
    assert fresh.round == 0
    assert torch.equal(fresh.weights, tiny_weights()[0])
    archived = tmp_path / "ckpt" / "previous-run-1"
    assert (archived / POINTER_NAME).exists() and (archived / "round-000002.safetensors").exists()
    # The archived run is intact: moved back, it resumes where it stopped.
    for path in archived.iterdir():
        path.replace(tmp_path / "ckpt" / path.name)
    resumed = _make(tmp_path)
    assert resumed.round == 2 and torch.equal(resumed.weights, first.weights)


def test_a_round_record_lost_after_its_checkpoint_is_replayed_once(tmp_path: Path) -> None:
    metrics_path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(metrics_path)
    first = _two_rounds(tmp_path, writer)
    writer.close()
    lines = metrics_path.read_text().splitlines()
    # The process died after round 1's checkpoint, before its record (and mid-way through a line).
    metrics_path.write_text(lines[0] + "\n" + lines[1][:25])

    _make(tmp_path, metrics_path=str(metrics_path))
    records = read_metrics(metrics_path)
    assert [r["round"] for r in records] == [0, 1]
    assert records[1]["session_id"] == first.session_id and records[1]["replayed"] is True
    assert records[1]["weights_digest"] == first.digest_hex
    assert records[1]["participants"] == ["a"]
    # Another restart finds the record there and writes nothing.
    _make(tmp_path, metrics_path=str(metrics_path))
    assert [r["round"] for r in read_metrics(metrics_path)] == [0, 1]
    # A session that wrote its metrics elsewhere (or none) gets nothing replayed into this file.
    elsewhere = tmp_path / "elsewhere.jsonl"
    _make(tmp_path, metrics_path=str(elsewhere))
    assert not elsewhere.exists() or read_metrics(elsewhere) == []

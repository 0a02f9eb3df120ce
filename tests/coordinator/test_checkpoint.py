"""Checkpoints survive crashes: atomic writes, checksums, pruning, and no pickle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from geoloco.coordinator.checkpoint import (
    POINTER_NAME,
    CheckpointError,
    load_latest_checkpoint,
    save_checkpoint,
)


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "theta": torch.randn(1000, generator=g),
        "outer.momentum_buffer": torch.randn(1000, generator=g),
        "downlink.residual": torch.randn(1000, generator=g),
    }


def test_round_trip_is_bit_exact(tmp_path: Path) -> None:
    tensors = _tensors(0)
    save_checkpoint(tmp_path, 3, tensors, {"config": {"H": 50}, "outer": {"step": 3}})
    ckpt = load_latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.round == 3
    assert ckpt.metadata == {"config": {"H": 50}, "outer": {"step": 3}}
    for name, t in tensors.items():
        assert torch.equal(ckpt.tensors[name], t)


def test_empty_folder_has_no_checkpoint(tmp_path: Path) -> None:
    assert load_latest_checkpoint(tmp_path / "missing") is None


def test_latest_wins_and_old_files_are_pruned(tmp_path: Path) -> None:
    for r in range(5):
        save_checkpoint(tmp_path, r, _tensors(r), keep=2)
    ckpt = load_latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.round == 4
    assert torch.equal(ckpt.tensors["theta"], _tensors(4)["theta"])
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [
        "round-000003.safetensors",
        "round-000004.safetensors",
    ]


def test_crash_before_pointer_update_keeps_previous_checkpoint(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, _tensors(1))
    pointer = (tmp_path / POINTER_NAME).read_bytes()
    save_checkpoint(tmp_path, 2, _tensors(2))
    # Simulate kill -9 between writing the round-2 tensor file and updating the pointer.
    (tmp_path / POINTER_NAME).write_bytes(pointer)
    ckpt = load_latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.round == 1
    assert torch.equal(ckpt.tensors["theta"], _tensors(1)["theta"])


def test_corrupted_tensor_file_is_refused(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 7, _tensors(7))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        load_latest_checkpoint(tmp_path)


def test_missing_tensor_file_and_bad_pointer_are_refused(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 2, _tensors(2))
    path.unlink()
    with pytest.raises(CheckpointError, match="does not exist"):
        load_latest_checkpoint(tmp_path)
    (tmp_path / POINTER_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match="not a valid"):
        load_latest_checkpoint(tmp_path)
    pointer = {"format_version": 99, "round": 1, "tensor_file": "x", "sha256": "0"}
    (tmp_path / POINTER_NAME).write_text(json.dumps(pointer))
    with pytest.raises(CheckpointError, match="format_version"):
        load_latest_checkpoint(tmp_path)


def test_no_pickle_in_tensor_file(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 0, _tensors(0))
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    assert set(header) - {"__metadata__"} == set(_tensors(0))


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="round_number"):
        save_checkpoint(tmp_path, -1, _tensors(0))
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path, 0, _tensors(0), keep=0)

"""Checkpoints survive crashes: atomic writes, checksums, pruning, and no pickle."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from geoloco.coordinator.checkpoint import (
    POINTER_NAME,
    CheckpointError,
    archive_previous_run,
    load_latest_checkpoint,
    save_checkpoint,
)
from geoloco.protos.transport_malloc import return_free_heap


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


def _rewrite_pointer(folder: Path, **changes: object) -> None:
    pointer = json.loads((folder / POINTER_NAME).read_text())
    pointer.update(changes)
    (folder / POINTER_NAME).write_text(json.dumps(pointer))


def test_pointer_naming_a_file_outside_the_folder_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    save_checkpoint(elsewhere, 3, _tensors(3))
    folder = tmp_path / "run"
    save_checkpoint(folder, 3, _tensors(0))
    outside = json.loads((elsewhere / POINTER_NAME).read_text())
    for name in ("../elsewhere/round-000003.safetensors", str(elsewhere / "round-000003.safetensors")):
        _rewrite_pointer(folder, tensor_file=name, sha256=outside["sha256"])
        with pytest.raises(CheckpointError, match="must name round-000003.safetensors in"):
            load_latest_checkpoint(folder)


def test_pointer_naming_a_file_of_another_round_is_refused(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 3, _tensors(3), keep=3)
    save_checkpoint(tmp_path, 4, _tensors(4), keep=3)
    # A pointer that says round 4 but names round 3's (intact) file: resuming it would replay
    # round 3 under round 4's number.
    sha3 = hashlib.sha256((tmp_path / "round-000003.safetensors").read_bytes()).hexdigest()
    _rewrite_pointer(tmp_path, tensor_file="round-000003.safetensors", sha256=sha3)
    with pytest.raises(CheckpointError, match="is for round 4 but names tensor file 'round-000003"):
        load_latest_checkpoint(tmp_path)


def test_tensor_files_without_a_pointer_are_not_a_new_run(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 5, _tensors(5))
    (tmp_path / POINTER_NAME).unlink()
    with pytest.raises(CheckpointError, match=r"no checkpoint.json.*--fresh"):
        load_latest_checkpoint(tmp_path)


def test_missing_metadata_keys_are_named(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 2, _tensors(2), {"strategy": {}})
    with pytest.raises(CheckpointError, match="metadata lacks 'weights_digest'"):
        load_latest_checkpoint(tmp_path, required_metadata=("strategy", "weights_digest"))
    _rewrite_pointer(tmp_path, metadata=[1, 2])
    with pytest.raises(CheckpointError, match="metadata must be a JSON object"):
        load_latest_checkpoint(tmp_path)


def test_archive_moves_a_previous_run_aside(tmp_path: Path) -> None:
    assert archive_previous_run(tmp_path / "none") is None
    save_checkpoint(tmp_path, 1, _tensors(1))
    save_checkpoint(tmp_path, 2, _tensors(2))
    archive = archive_previous_run(tmp_path)
    assert archive is not None and archive.name == "previous-run-1"
    assert load_latest_checkpoint(tmp_path) is None
    kept = load_latest_checkpoint(archive)
    assert kept is not None and kept.round == 2
    save_checkpoint(tmp_path, 0, _tensors(0))
    assert archive_previous_run(tmp_path) == tmp_path / "previous-run-2"


def _rss_anon_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_a_checkpoint_is_written_without_a_copy_and_loaded_as_a_memory_map(tmp_path: Path) -> None:
    """Multi-GB checkpoints: the writer streams the tensors' own memory (no serialised blob,
    which ``tracemalloc`` would see as one model-sized ``bytes``), and loading maps the file
    (its pages are the page cache's, not the process's anonymous memory) until a tensor is
    written to."""
    import tracemalloc

    size = 16 << 20  # 64 MiB of fp32
    tensors = {"theta": torch.arange(size, dtype=torch.float32), "outer.momentum_buffer": torch.ones(size)}
    tracemalloc.start()
    try:
        save_checkpoint(tmp_path, 1, tensors)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"saving allocated {peak} bytes of Python objects"
    del tensors
    return_free_heap()
    before = _rss_anon_bytes()
    ckpt = load_latest_checkpoint(tmp_path)
    assert ckpt is not None
    assert float(ckpt.tensors["theta"][-1]) == size - 1 and float(ckpt.tensors["theta"].sum()) > 0
    # The checksum's read blocks are freed, but once an earlier test in this process started a
    # server (its malloc tunables keep freed heap for reuse) they can stay resident: count what
    # is live, not what glibc keeps (34.9 MB in one full run, with two 16 MiB blocks kept).
    return_free_heap()
    grown = _rss_anon_bytes() - before
    assert grown < 32 << 20, f"loading (and reading) 128 MiB of tensors took {grown} bytes of anonymous memory"
    ckpt.tensors["outer.momentum_buffer"].mul_(2)  # private mapping: writes never reach the file
    again = load_latest_checkpoint(tmp_path)
    assert again is not None and float(again.tensors["outer.momentum_buffer"][0]) == 1.0

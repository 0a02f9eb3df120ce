"""Crash-safe coordinator checkpoints: safetensors for tensors, JSON for everything else.

A checkpoint is two files in the checkpoint folder:

* ``round-000012.safetensors`` — every tensor (global weights, outer optimizer state, downlink
  residual), never pickle, so loading a checkpoint cannot execute code;
* ``checkpoint.json`` — the pointer to the newest tensor file, with its SHA-256, the round number
  and JSON metadata (config, scalar optimizer state).

Each file is written atomically and the tensor file streamed tensor by tensor
(``geoloco.protos.atomic_files``), so ``kill -9`` at any instant leaves either the previous
checkpoint or the new one, never a torn file, and writing costs no memory beyond the tensors.
Loading memory-maps the tensor file (``safetensors``' default): a multi-GB checkpoint's pages are
read on first use and stay in the page cache, where the kernel can drop them, until a tensor is
written (the mapping is private: the outer optimizer's in-place updates copy only what they touch
and never reach the file). The global weights are never written in place, so a resumed
coordinator's weights cost page cache, not process memory.

The tensor file is written before the pointer; a crash between the two leaves an
orphan tensor file that the next save removes. The last ``keep`` tensor files are kept so an
operator can roll back by hand.

Loading trusts nothing in the pointer: the tensor file it names must be a plain
``round-NNNNNN.safetensors`` name inside the folder, of the pointer's own round, with the SHA-256
the pointer records; the metadata must hold the keys the caller needs. A folder with tensor files
but no pointer is refused too (the pointer holds the optimizer's scalar state, so those files
cannot be resumed, and starting over beside them would silently discard a run):
``archive_previous_run`` moves such files aside when the operator asks for a new run.

One coordinator at a time: ``CheckpointFolderLock`` holds ``coordinator.lock`` in the folder (an
advisory ``flock``, released by the kernel when the process dies, so a killed coordinator leaves
no stale lock; the file names the holder's pid and host for the refusal message).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from geoloco.protos.atomic_files import atomic_write, atomic_write_safetensors, file_sha256, fsync_dir
from geoloco.protos.folder_lock import FolderInUseError, FolderLock

logger = logging.getLogger(__name__)

POINTER_NAME = "checkpoint.json"
FORMAT_VERSION = 1
_TENSOR_FILE = re.compile(r"^round-(\d{6,})\.safetensors$")
ARCHIVE_PREFIX = "previous-run-"
"""Sub-folders where ``archive_previous_run`` moves the files of a run that is not resumed."""
FRESH_HINT = "or start a new run with `--fresh` (`resume = false`), which moves the old files aside"
"""How every refusal ends: what the operator can do besides repairing the checkpoint."""
LOG_DIR = "round-log"
"""The sub-folder of the round log (``geoloco.coordinator.round_log``): part of the run's files."""
LOCK_NAME = "coordinator.lock"
"""The file ``CheckpointFolderLock`` holds in the checkpoint folder while a coordinator uses it."""


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be trusted (missing file, checksum mismatch, bad JSON)."""


@dataclass(slots=True)
class Checkpoint:
    """What a coordinator needs to resume: the round it reached, its tensors and its metadata."""

    round: int
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None


def save_checkpoint(
    directory: str | os.PathLike[str],
    round_number: int,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, Any] | None = None,
    *,
    keep: int = 2,
) -> Path:
    """Write a checkpoint for ``round_number`` atomically and return the tensor file's path."""
    if round_number < 0:
        raise ValueError(f"round_number must be >= 0, got {round_number}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    tensor_path = folder / f"round-{round_number:06d}.safetensors"
    sha256 = atomic_write_safetensors(tensor_path, tensors)
    pointer = {
        "format_version": FORMAT_VERSION,
        "round": round_number,
        "tensor_file": tensor_path.name,
        "sha256": sha256,
        "metadata": metadata or {},
    }
    atomic_write(folder / POINTER_NAME, json.dumps(pointer, indent=2, sort_keys=True).encode())
    _prune(folder, keep=keep, current=tensor_path.name)
    logger.debug("checkpoint for round %d written to %s", round_number, tensor_path)
    return tensor_path


def _round_of(name: str) -> int | None:
    match = _TENSOR_FILE.match(name)
    return int(match.group(1)) if match else None


def _prune(folder: Path, *, keep: int, current: str) -> None:
    current_round = _round_of(current)
    assert current_round is not None
    rounds = {p: r for p in folder.iterdir() if (r := _round_of(p.name)) is not None}
    older = sorted((p for p, r in rounds.items() if r < current_round), key=rounds.__getitem__)
    # Files newer than the current one are orphans of a crash between the tensor file and the
    # pointer update, superseded by a restart from an older round; they would mislead an operator.
    newer = [p for p, r in rounds.items() if r > current_round]
    for p in older[: max(0, len(older) - (keep - 1))] + newer:
        p.unlink(missing_ok=True)
    for tmp in folder.glob(".*.tmp-*"):
        tmp.unlink(missing_ok=True)


def previous_run_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The pointer, tensor files and round log of a run in ``directory`` (empty when none)."""
    folder = Path(directory)
    if not folder.is_dir():
        return []
    return sorted(
        p for p in folder.iterdir()
        if p.name == POINTER_NAME or _round_of(p.name) is not None
        or (p.name == LOG_DIR and p.is_dir())
    )


def archive_previous_run(
    directory: str | os.PathLike[str], *, also: Sequence[str | os.PathLike[str]] = ()
) -> Path | None:
    """Move a previous run's checkpoint files into a new ``previous-run-N`` sub-folder so a new
    run starts beside them without deleting them; the sub-folder, or None when there was nothing.

    ``also``: other files of the run (its ``metrics.jsonl``) that go into the same sub-folder
    under their own names when they exist and are not empty, so a new run's records never follow
    the old run's in one file."""
    files = previous_run_files(directory)
    extra = [Path(p) for p in also if Path(p).is_file() and Path(p).stat().st_size > 0]
    if not files and not extra:
        return None
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    n = 1
    while (folder / f"{ARCHIVE_PREFIX}{n}").exists():
        n += 1
    archive = folder / f"{ARCHIVE_PREFIX}{n}"
    archive.mkdir()
    for path in files:
        os.replace(path, archive / path.name)
    for path in extra:
        shutil.move(path, archive / path.name)  # may be on another file system
        fsync_dir(path.parent)
    fsync_dir(folder)
    logger.warning("moved the previous run's files (%d) to %s", len(files) + len(extra), archive)
    return archive


def _read_pointer(pointer_path: Path) -> tuple[int, str, str, dict[str, Any]]:
    """(round, tensor file name, sha256 hex, metadata) of a pointer file, each checked for type."""
    try:
        pointer = json.loads(pointer_path.read_text())
        if not isinstance(pointer, dict):
            raise TypeError(f"expected a JSON object, got {type(pointer).__name__}")
        version = pointer.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"{pointer_path} has format_version {version!r}; this geoloco reads version "
                f"{FORMAT_VERSION}; resume it with the geoloco that wrote it, {FRESH_HINT}"
            )
        round_number, name, sha256 = pointer["round"], pointer["tensor_file"], pointer["sha256"]
        metadata = pointer.get("metadata", {})
        if isinstance(round_number, bool) or not isinstance(round_number, int) or round_number < 0:
            raise TypeError(f"round must be an integer >= 0, got {round_number!r}")
        if not isinstance(name, str) or not isinstance(sha256, str):
            raise TypeError("tensor_file and sha256 must be strings")
        if not isinstance(metadata, dict):
            raise TypeError(f"metadata must be a JSON object, got {type(metadata).__name__}")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{pointer_path} is not a valid geoloco checkpoint pointer ({type(exc).__name__}: {exc}); "
            f"restore it from a backup, {FRESH_HINT}"
        ) from exc
    return round_number, name, sha256, metadata


def load_latest_checkpoint(
    directory: str | os.PathLike[str], *, required_metadata: Sequence[str] = ()
) -> Checkpoint | None:
    """The newest checkpoint in ``directory``, or ``None`` when the folder holds no run at all.

    Raises :class:`CheckpointError` (one line: what is wrong and what to do) when the pointer is
    missing beside tensor files, names a file outside the folder or of another round, when that
    file is missing or fails its checksum, or when the metadata lacks a ``required_metadata``
    key: resuming from untrusted state, or silently starting over, would be worse than stopping.
    """
    folder = Path(directory)
    pointer_path = folder / POINTER_NAME
    if not pointer_path.exists():
        orphans = [p.name for p in previous_run_files(folder)]
        if orphans:
            raise CheckpointError(
                f"{folder} holds tensor files of a previous run ({', '.join(orphans[:3])}"
                f"{', ...' if len(orphans) > 3 else ''}) but no {POINTER_NAME}, so it cannot be "
                f"resumed; restore {POINTER_NAME} from a backup, {FRESH_HINT}"
            )
        return None
    round_number, name, expected, metadata = _read_pointer(pointer_path)
    if _round_of(name) != round_number or Path(name).name != name:
        raise CheckpointError(
            f"{pointer_path} is for round {round_number} but names tensor file {name!r}; it must "
            f"name round-{round_number:06d}.safetensors in {folder}; restore the pointer from a "
            f"backup, {FRESH_HINT}"
        )
    tensor_path = folder / name
    if not tensor_path.is_file():
        raise CheckpointError(
            f"{pointer_path} names {name}, which does not exist; restore it from a backup, {FRESH_HINT}"
        )
    actual = file_sha256(tensor_path)
    if actual != expected:
        raise CheckpointError(
            f"{tensor_path} fails its checksum (sha256 {actual[:16]}..., expected {expected[:16]}...); "
            f"restore it from a backup, {FRESH_HINT}"
        )
    missing = [key for key in required_metadata if key not in metadata]
    if missing:
        raise CheckpointError(
            f"{pointer_path} metadata lacks {', '.join(repr(k) for k in missing)}; it was not written "
            f"by this geoloco's coordinator; restore it from a backup, {FRESH_HINT}"
        )
    try:
        tensors = load_file(str(tensor_path))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{tensor_path} cannot be read ({exc}); restore it from a backup, {FRESH_HINT}") from exc
    return Checkpoint(round=round_number, tensors=tensors, metadata=metadata, path=tensor_path)


class CheckpointFolderLock(FolderLock):
    """Exclusive use of a checkpoint folder by one coordinator process.

    ``acquire`` takes an advisory ``flock`` on ``folder/coordinator.lock`` without waiting and
    writes the holder's pid, host and start time into it (``geoloco.protos.folder_lock``); a
    second coordinator on the same folder (another process, or another server in this one) gets
    a ``CheckpointError`` naming the holder instead of resuming beside it, or moving its files
    aside. The kernel drops the lock when the holder dies, so nothing stale is left to delete by
    hand; ``release`` removes the file.
    """

    @classmethod
    def acquire(cls, directory: str | os.PathLike[str]) -> CheckpointFolderLock:
        try:
            return cls.take(directory, LOCK_NAME)
        except FolderInUseError as err:
            raise CheckpointError(
                f"{err.folder} is in use by another coordinator ({err.holder.text}); stop that one "
                "first, or give this one another checkpoint_dir"
            ) from None

"""The write-ahead round log: a round made durable by its mean update, not by a full checkpoint.

A coordinator must not broadcast weights it could not rebuild after ``kill -9`` (every site would
hold a round the restarted coordinator never reached). A full checkpoint — weights, outer
momentum, downlink residual: 2-3 times the model, written, hashed and fsynced — was that proof,
and the largest phase of a big model's round. But the round's new state is a deterministic
function of the previous state and one vector, the mean update the outer step consumed: logging
that vector (once the model's size, written to the page cache in one copy before the outer step
may overwrite it, fsynced *while* the outer step and the downlink encode run) is proof enough.
Full checkpoints become snapshots written in the background while the sites train
(``SnapshotWriter``), and a restart replays the logged rounds after the newest snapshot.

An entry is two files in ``checkpoint_dir/round-log``:

* ``round-000012.mean`` — the raw bytes of round 12's mean update (the round's fragment);
* ``round-000012.json`` — written atomically *after* the mean is on disk: the plan's facts to
  replay the step (fragment, sites), the digest the replayed weights must have, and the same
  metadata a checkpoint of round 13 would hold (history, privacy, the round's record).

The JSON is the commit: a mean without one is a round that was never broadcast, ignored and
removed. Replay recomputes the weights and checks them against the recorded digest, an end-to-end
check that also catches a corrupted mean file. Entries older than the newest snapshot are removed
once the snapshot is durable (``compact``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from geoloco.coordinator.checkpoint import FRESH_HINT, LOG_DIR, CheckpointError, save_checkpoint
from geoloco.protos.atomic_files import atomic_write, fsync_dir

logger = logging.getLogger(__name__)

_ENTRY = re.compile(r"^round-(\d{6,})\.(json|mean)$")
ENTRY_FORMAT = 1

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class LoggedRound:
    """A committed entry: what replaying round ``round`` needs."""

    round: int
    fragment: int
    sites: tuple[str, ...]
    weights_digest: str
    """Of the weights after the round: the replay must reproduce it."""
    metadata: dict[str, Any]
    """What a checkpoint of round ``round + 1`` would hold besides its tensors."""
    mean_path: Path
    numel: int
    dtype: torch.dtype
    mean_crc32: int

    def read_mean(self) -> torch.Tensor:
        """The logged mean update, checked for its size and CRC-32 (a truncated or damaged file
        is refused in one line)."""
        expected = self.numel * torch.empty((), dtype=self.dtype).element_size()
        try:
            size = self.mean_path.stat().st_size
        except OSError as exc:
            raise CheckpointError(f"{self.mean_path} cannot be read ({exc}); {FRESH_HINT}") from exc
        if size != expected:
            raise CheckpointError(
                f"{self.mean_path} holds {size} bytes, its entry says {expected}; the round log is "
                f"damaged; restore checkpoint_dir from a backup, {FRESH_HINT}"
            )
        data = bytearray(self.mean_path.read_bytes())
        actual = zlib.crc32(data)
        if actual != self.mean_crc32:
            raise CheckpointError(
                f"{self.mean_path} fails its checksum (CRC-32 {actual:08x}, its entry says "
                f"{self.mean_crc32:08x}); the round log is damaged; restore checkpoint_dir from a "
                f"backup, {FRESH_HINT}"
            )
        return torch.frombuffer(data, dtype=self.dtype)


@dataclass(slots=True)
class _Pending:
    """A mean written and being fsynced, not yet committed."""

    round: int
    path: Path
    numel: int
    dtype: str
    crc32: int
    sync: threading.Thread
    errors: list[OSError]


def _round_of(name: str) -> tuple[int, str] | None:
    match = _ENTRY.match(name)
    return (int(match.group(1)), match.group(2)) if match else None


class RoundLog:
    """The round log of one checkpoint folder (module doc). One round at a time is written:
    ``observe`` (the mean, from inside the outer step) then ``commit`` or ``discard``."""

    def __init__(self, checkpoint_dir: str | os.PathLike[str]) -> None:
        self.folder = Path(checkpoint_dir) / LOG_DIR
        self._pending: _Pending | None = None

    def observe(self, round_number: int, mean: torch.Tensor) -> None:
        """Write round ``round_number``'s mean to the page cache now (the outer step may overwrite
        it next) and fsync it in a thread that ``commit`` joins, so the disk works while the
        outer step and the downlink encode compute."""
        self.discard()
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"round-{round_number:06d}.mean"
        host = mean.detach().to("cpu").contiguous()
        dtype = str(host.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise ValueError(f"the round log stores {', '.join(_DTYPES)} means, got {dtype}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = host.reshape(-1).view(torch.uint8).numpy().data
            written = 0
            while written < len(view):
                written += os.write(fd, view[written:])
        except BaseException:
            os.close(fd)
            raise
        # The replay's weights-digest check alone misses a flipped bit that a lossy downlink
        # rounds away, while the outer state it feeds would silently diverge: a CRC-32 (a third
        # of SHA-256's time; the file guards against damage, not against an adversary) is taken
        # from memory before the outer step may overwrite the mean.
        crc = zlib.crc32(view)
        errors: list[OSError] = []

        def sync() -> None:
            try:
                os.fsync(fd)
            except OSError as exc:  # reported by commit
                errors.append(exc)
            finally:
                os.close(fd)

        thread = threading.Thread(target=sync, name="geoloco-round-log-fsync", daemon=True)
        thread.start()
        self._pending = _Pending(round_number, path, host.numel(), dtype, crc, thread, errors)

    @property
    def observed(self) -> int | None:
        """The round whose mean is written and not yet committed or discarded."""
        return None if self._pending is None else self._pending.round

    def commit(
        self, round_number: int, *, fragment: int, sites: tuple[str, ...], weights_digest: str,
        metadata: dict[str, Any],
    ) -> None:
        """Make round ``round_number`` durable: wait for its mean's fsync, then write its entry
        atomically. After this returns, its weights may be broadcast."""
        pending = self._pending
        if pending is None or pending.round != round_number:
            raise RuntimeError(f"the round log holds no mean of round {round_number} to commit")
        self._pending = None
        pending.sync.join()
        if pending.errors:
            raise pending.errors[0]
        entry = {
            "format": ENTRY_FORMAT,
            "round": round_number,
            "fragment": fragment,
            "sites": list(sites),
            "weights_digest": weights_digest,
            "mean_file": pending.path.name,
            "mean_crc32": pending.crc32,
            "numel": pending.numel,
            "dtype": pending.dtype,
            "metadata": metadata,
        }
        atomic_write(self.folder / f"round-{round_number:06d}.json", json.dumps(entry, sort_keys=True).encode())

    def discard(self) -> None:
        """Forget an observed mean that will not be committed (the round was aborted after its
        outer step, or it is made durable by a full checkpoint instead)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.sync.join()
        pending.path.unlink(missing_ok=True)

    def entries(self, from_round: int) -> list[LoggedRound]:
        """The committed entries of rounds ``from_round``, ``from_round + 1``, ... up to the
        first gap (a later entry past a gap cannot be replayed and is ignored)."""
        rounds = sorted(r for r in self._committed() if r >= from_round)
        found: list[LoggedRound] = []
        for expected, r in enumerate(rounds, start=from_round):
            if r != expected:
                break
            found.append(self._read(r))
        return found

    def _read(self, round_number: int) -> LoggedRound:
        path = self.folder / f"round-{round_number:06d}.json"
        try:
            entry = json.loads(path.read_text())
            if entry.get("format") != ENTRY_FORMAT:
                raise ValueError(f"format {entry.get('format')!r}, this geoloco reads {ENTRY_FORMAT}")
            mean_file, dtype = str(entry["mean_file"]), str(entry["dtype"])
            if Path(mean_file).name != mean_file or _round_of(mean_file) != (round_number, "mean"):
                raise ValueError(f"mean_file {mean_file!r} is not this round's")
            if dtype not in _DTYPES:
                raise ValueError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
            metadata = entry["metadata"]
            if not isinstance(metadata, dict) or entry["round"] != round_number:
                raise ValueError("metadata must be an object and round must be the file's")
            return LoggedRound(
                round=round_number, fragment=int(entry["fragment"]),
                sites=tuple(str(s) for s in entry["sites"]), weights_digest=str(entry["weights_digest"]),
                metadata=metadata, mean_path=self.folder / mean_file, numel=int(entry["numel"]),
                dtype=_DTYPES[dtype], mean_crc32=int(entry["mean_crc32"]),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(
                f"{path} is not a valid round-log entry ({type(exc).__name__}: {exc}); restore "
                f"checkpoint_dir from a backup, {FRESH_HINT}"
            ) from exc

    def newest_round(self) -> int | None:
        """The newest committed round (its weights may have been broadcast), or None."""
        return max(self._committed(), default=None)

    def _committed(self) -> set[int]:
        """Rounds with a committed entry (its JSON written)."""
        if not self.folder.is_dir():
            return set()
        return {m[0] for p in self.folder.iterdir() if (m := _round_of(p.name)) is not None and m[1] == "json"}

    def compact(self, snapshot_round: int) -> None:
        """Remove entries a durable snapshot of ``snapshot_round`` covers (rounds before it), and
        means no entry committed (keeping the one being written); then the folder when empty."""
        if not self.folder.is_dir():
            return
        keep = self.observed
        committed = self._committed()
        removed = False
        for p in self.folder.iterdir():
            m = _round_of(p.name)
            if m is None or m[0] == keep:
                continue
            if m[0] < snapshot_round or (m[1] == "mean" and m[0] not in committed):
                p.unlink(missing_ok=True)
                removed = True
        if removed:
            fsync_dir(self.folder)
        if keep is None and not any(self.folder.iterdir()):
            # An empty log leaves the checkpoint folder as a run without one would.
            self.folder.rmdir()


class SnapshotWriter:
    """Full checkpoints written by a background thread while the sites train the next round.

    The tensors handed over are the coordinator's live weights and outer state: nothing changes
    them until the next outer step, which ``join``s first. ``on_durable`` runs in the thread once
    the snapshot is on disk (the round log compacts there)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def start(
        self, directory: str | os.PathLike[str], round_number: int, tensors: dict[str, torch.Tensor],
        metadata: dict[str, Any], *, keep: int, on_durable: Callable[[int], None],
    ) -> None:
        self.join()

        def write() -> None:
            try:
                save_checkpoint(directory, round_number, tensors, metadata, keep=keep)
                on_durable(round_number)
            except Exception:
                logger.exception(
                    "the snapshot of round %d could not be written; the round log keeps the run "
                    "recoverable and grows until a snapshot succeeds", round_number,
                )

        thread = threading.Thread(target=write, name="geoloco-snapshot", daemon=True)
        thread.start()
        # Published once started: a shutdown joining from another thread must never find a
        # thread that has not started (``Thread.join`` raises then; seen once under load).
        self._thread = thread

    def join(self) -> None:
        """Wait for the snapshot in progress (before the live state changes, and at shutdown)."""
        thread = self._thread
        if thread is not None:
            thread.join()
            if self._thread is thread:
                self._thread = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

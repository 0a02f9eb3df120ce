"""Per-round metrics as JSON lines: one self-contained JSON object per line, appended and flushed.

JSON lines survive crashes (a torn last line is the only possible damage), can be appended to
across coordinator restarts, and are read by ``pandas.read_json(path, lines=True)`` or a few lines
of Python. Every record carries the ``session_id`` so a restart is visible in the file.

A session writes one record per round, so (``session_id``, ``round``) identifies a record:
``append_missing_record`` uses it to replay, after a restart, the record of a round whose
checkpoint was written but whose record was not (the process died in between) without ever
writing one twice. A torn last line, the only damage a crash can leave, is cut off before
anything is appended, so it never ends up in the middle of the file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from pathlib import Path
from typing import Any

from geoloco.algorithms.record import RoundRecord
from geoloco.protos.tensorboard import TensorBoardWriter

logger = logging.getLogger(__name__)

__all__ = ["MetricsWriter", "append_missing_record", "plain_record", "read_metrics"]


def plain_record(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` as the file holds it: string keys, lists for tuples, null for NaN/Inf."""
    plain: dict[str, Any] = _plain(record)
    return plain


def _plain(value: Any) -> Any:
    """JSON cannot hold NaN/Inf; write them as null rather than producing an unreadable file."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class MetricsWriter:
    """Appends records to a JSON-lines file (thread-safe; each line flushed when written), and
    with ``tensorboard_dir`` their scalars to TensorBoard too (``geoloco.protos.tensorboard``)."""

    def __init__(self, path: str | os.PathLike[str], tensorboard_dir: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _cut_torn_tail(self.path)
        self._lock = threading.Lock()
        self._tensorboard: TensorBoardWriter | None = None
        if tensorboard_dir is not None:
            self._tensorboard = TensorBoardWriter(tensorboard_dir, step_key="round")
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: RoundRecord) -> None:
        data = record.to_dict()
        line = json.dumps(_plain(data), sort_keys=True, allow_nan=False)
        with self._lock:
            if self._file.closed:
                logger.warning("metrics record after close dropped: %s", line[:200])
                return
            self._file.write(line + "\n")
            self._file.flush()
            if self._tensorboard is not None:
                try:
                    self._tensorboard.write(data)
                except Exception:
                    logger.exception("TensorBoard scalars of round %s not written", record.round)

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()
                if self._tensorboard is not None:
                    self._tensorboard.close()


def _cut_torn_tail(path: Path) -> None:
    """Truncate a last line without its newline (a write cut short by a crash)."""
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            block = min(size, 1 << 20)
            while True:
                f.seek(size - block)
                tail = f.read(block)
                cut = tail.rfind(b"\n")
                if cut >= 0 or block == size:
                    break
                block = min(size, block * 2)
            keep = size - block + cut + 1 if cut >= 0 else 0
            logger.warning("cutting a torn last line (%d bytes) off %s", size - keep, path)
            f.truncate(keep)
    except FileNotFoundError:
        return


def append_missing_record(path: str | os.PathLike[str], record: dict[str, Any]) -> bool:
    """Append ``record`` unless the file already holds one of the same session and round;
    True when it was written (flushed and fsync'ed: it replays a record a crash lost)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    _cut_torn_tail(target)
    key = (record.get("session_id"), record.get("round"))
    if target.exists() and any((r.get("session_id"), r.get("round")) == key for r in read_metrics(target)):
        return False
    line = json.dumps(_plain(record), sort_keys=True, allow_nan=False)
    with open(target, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())
    return True


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a metrics file (a torn last line from a crash is skipped)."""
    records = []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                logger.warning("skipping a torn last line in %s", path)
                continue
            raise
    return records

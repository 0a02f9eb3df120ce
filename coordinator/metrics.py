"""Per-round metrics as JSON lines: one self-contained JSON object per line, appended and flushed.

JSON lines survive crashes (a torn last line is the only possible damage), can be appended to
across coordinator restarts, and are read by ``pandas.read_json(path, lines=True)`` or a few lines
of Python. Every record carries the ``session_id`` so a restart is visible in the file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["MetricsWriter", "read_metrics"]


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
    """Appends records to a JSON-lines file (thread-safe; each line flushed when written)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(_plain(record), sort_keys=True, allow_nan=False)
        with self._lock:
            if self._file.closed:
                logger.warning("metrics record after close dropped: %s", line[:200])
                return
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()


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

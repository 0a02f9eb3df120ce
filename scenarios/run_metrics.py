"""The coordinator's ``metrics.jsonl`` read while the run goes: records, rounds done, losses.

The emulator polls ``MetricsTail.read()``; each complete new line becomes a record with
``observed_s`` (seconds since the run started, by the emulator's clock) added, which the report
uses to place rounds on the wall clock. A line still being written waits for its newline.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Losses", "MetricsTail"]


@dataclass(frozen=True, slots=True)
class Losses:
    """The latest losses the records report, for the progress display."""

    per_site: dict[str, float]
    """Each site's latest training loss."""
    train: float | None
    """Mean training loss over the sites of the latest round."""
    eval: float | None
    """The latest evaluation loss of the global weights."""


class MetricsTail:
    """Reads the coordinator's metrics file incrementally."""

    def __init__(self, path: Path, clock: Callable[[], float]) -> None:
        self.path = path
        self.clock = clock
        """Seconds since the run started."""
        self.records: list[dict[str, Any]] = []
        self.round_started_s: dict[int, float] = {}
        """Round number -> when it was first seen under way (the previous one aggregated)."""
        self._offset = 0
        self._buffer = b""

    def read(self) -> None:
        """Take in the lines written since the last call."""
        if not self.path.exists():
            return
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        data = self._buffer + data
        *lines, self._buffer = data.split(b"\n")
        for line in lines:
            if not line.strip():
                continue
            record = json.loads(line)
            now = self.clock()
            record["observed_s"] = round(now, 3)
            done_before = self.rounds_done
            self.records.append(record)
            if self.rounds_done > done_before:
                self.round_started_s.setdefault(self.rounds_done, now)

    @property
    def rounds_done(self) -> int:
        return 1 + max((int(r["round"]) for r in self.records), default=-1)

    @property
    def run_finished(self) -> bool:
        """The coordinator recorded the end of the run."""
        return any(r.get("run_finished") for r in self.records)

    def losses(self) -> Losses:
        per_site: dict[str, float] = {}
        eval_loss = None
        for record in self.records:
            for site, metrics in (record.get("site_metrics") or {}).items():
                if metrics.get("train_loss") is not None:
                    per_site[site] = float(metrics["train_loss"])
            if record.get("eval_loss") is not None:
                eval_loss = float(record["eval_loss"])
        train = None
        if self.records:
            latest = [
                float(m["train_loss"])
                for m in (self.records[-1].get("site_metrics") or {}).values()
                if m.get("train_loss") is not None
            ]
            train = sum(latest) / len(latest) if latest else None
        return Losses(per_site=per_site, train=train, eval=eval_loss)

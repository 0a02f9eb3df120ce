"""TensorBoard scalars from round records, beside ``metrics.jsonl``.

The JSON-lines file stays the record of a run (exact values, every key); TensorBoard is a view of
it for people who already watch their training there. ``record_scalars`` picks the plottable
numbers out of one record, whoever wrote it (the coordinator's ``metrics.jsonl`` records or the
simulator's ``RoundRecord.to_dict()``, which share their keys): losses, bytes, utilization,
round time and epsilon where present. ``TensorBoardWriter`` writes them with
``torch.utils.tensorboard`` (which needs the ``tensorboard`` package, the optional extra
``pip install 'geoloco[tensorboard]'``). TensorBoard keeps scalars as 32-bit floats: byte counts
past 2**24 are rounded there, never in ``metrics.jsonl``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["TensorBoardUnavailable", "TensorBoardWriter", "record_scalars"]

logger = logging.getLogger(__name__)


class TensorBoardUnavailable(RuntimeError):
    """The ``tensorboard`` package is missing; the message says how to install it."""


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _sum(table: Any) -> float | None:
    if not isinstance(table, Mapping) or not table:
        return None
    values = [_number(v) for v in table.values()]
    return sum(v for v in values if v is not None)


def record_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """Tag -> value of one round record; tags whose value is missing or not finite are left out."""
    scalars: dict[str, float | None] = {
        "loss/eval": _number(record.get("eval_loss")),
        "loss/train": _number(record.get("train_loss")),
        "bytes/up_round": _sum(record.get("bytes_up")),
        "bytes/down_round": _sum(record.get("bytes_down")),
        "bytes/up_total": _number(record.get("bytes_up_total")),
        "bytes/down_total": _number(record.get("bytes_down_total")),
        "time/round_s": _number(record.get("round_time_s")),
        "time/wall_clock_s": _number(record.get("wall_clock_s")),
        "privacy/epsilon": _number(record.get("epsilon")),
        "sites/participants": _number(len(record["participants"])) if isinstance(
            record.get("participants"), list) else None,
        "update_norm": _number(record.get("update_norm")),
    }
    site_metrics = record.get("site_metrics")
    if scalars["loss/train"] is None and isinstance(site_metrics, Mapping):
        # The coordinator's record: the mean of the losses the aggregated sites reported.
        losses = [_number(m.get("train_loss")) for m in site_metrics.values() if isinstance(m, Mapping)]
        found = [v for v in losses if v is not None]
        scalars["loss/train"] = sum(found) / len(found) if found else None
    utilization = record.get("utilization")
    if isinstance(utilization, Mapping) and utilization:
        shares = [v for v in (_number(u) for u in utilization.values()) if v is not None]
        if shares:
            scalars["utilization/mean"] = sum(shares) / len(shares)
            scalars["utilization/min"] = min(shares)
        for site, share in utilization.items():
            scalars[f"utilization/site/{site}"] = _number(share)
    return {tag: value for tag, value in scalars.items() if value is not None}


class TensorBoardWriter:
    """Writes each record's scalars into a TensorBoard event file under ``logdir``.

    ``step_key`` names the record key used as the step: ``"inner_steps_total"`` for the
    simulator (comparable across H), ``"round"`` for the coordinator."""

    def __init__(self, logdir: str | os.PathLike[str], step_key: str = "round") -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise TensorBoardUnavailable(
                f"TensorBoard output needs the `tensorboard` package ({err}): pip install 'geoloco[tensorboard]'"
            ) from None
        self.logdir = os.fspath(logdir)
        self.step_key = step_key
        self._writer = SummaryWriter(log_dir=self.logdir)

    def write(self, record: Mapping[str, Any]) -> None:
        step = int(record.get(self.step_key) or 0)
        for tag, value in record_scalars(record).items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

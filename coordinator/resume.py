"""Where a coordinator session starts: from its checkpoint, from round 0, or not at all.

``config.resume`` (default on; ``--fresh`` turns it off) decides what a ``checkpoint_dir`` with a
previous run's files means:

* resume on, a checkpoint there: it is verified (``load_latest_checkpoint``: pointer, file, round,
  SHA-256, metadata keys), restored, and the restored weights must have the digest the metadata
  records; the round record the checkpoint carries is replayed into ``metrics_path`` when the
  previous process, writing to the same file, died before writing it;
* resume on, files there that cannot be resumed (tensor files without a pointer, a bad pointer or
  file): ``CheckpointError``, one line saying what is wrong and what to do; a run is never
  silently started over beside them;
* resume off: the run starts at round 0, and the previous run's files (checkpoints and the
  ``metrics_path`` file) move into ``checkpoint_dir/previous-run-N`` (``set_aside_previous_run``)
  before its first round can be checkpointed. ``CoordinatorServer`` does that once its port is
  bound, so a start that cannot serve leaves the previous run where it was.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from geoloco.coordinator.checkpoint import (
    FRESH_HINT,
    POINTER_NAME,
    CheckpointError,
    archive_previous_run,
    load_latest_checkpoint,
)
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.metrics import append_missing_record
from geoloco.coordinator.phases import ROUND_RECORD_KEY, GlobalWeights, RoundPhases
from geoloco.coordinator.round_log import RoundLog

logger = logging.getLogger(__name__)

REQUIRED_METADATA = ("strategy", "weights_digest")
"""Checkpoint metadata keys without which a run cannot be resumed exactly."""


def start_round(config: CoordinatorConfig, phases: RoundPhases, *, set_aside: bool = True) -> int:
    """Restore ``phases`` from ``config.checkpoint_dir`` as the module doc says; the round to open.
    ``set_aside=False``: with resume off, leave a previous run's files where they are; the caller
    moves them (``set_aside_previous_run``) before the first checkpoint."""
    folder = config.checkpoint_dir
    if folder is None:
        return 0
    if not config.resume:
        if set_aside:
            set_aside_previous_run(config)
        return 0
    checkpoint = load_latest_checkpoint(folder, required_metadata=REQUIRED_METADATA)
    if checkpoint is None:
        return 0
    try:
        weights = phases.restore(checkpoint.tensors, checkpoint.metadata, checkpoint.round)
    except (KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"{folder}/{POINTER_NAME} metadata is incomplete or malformed ({type(exc).__name__}: {exc}); "
            f"restore it from a backup, {FRESH_HINT}"
        ) from exc
    restored = GlobalWeights.of(weights)
    recorded = checkpoint.metadata["weights_digest"]
    if restored.digest != recorded:
        raise CheckpointError(
            f"{checkpoint.path} holds weights with digest {restored.digest[:16]}... but "
            f"{POINTER_NAME} records {str(recorded)[:16]}...; restore both from a backup, {FRESH_HINT}"
        )
    phases.weights = restored
    metadata, round_number = checkpoint.metadata, checkpoint.round
    logged = RoundLog(folder).entries(checkpoint.round)
    for entry in logged:
        phases.replay_logged(entry)
    if logged:
        metadata, round_number = logged[-1].metadata, logged[-1].round + 1
        phases.restore_state(metadata)
        logger.info(
            "replayed %d logged round(s) after the checkpoint of round %d: at round %d",
            len(logged), checkpoint.round, round_number,
        )
    _replay_round_record(config, phases, metadata, round_number)
    return round_number


def set_aside_previous_run(config: CoordinatorConfig) -> Path | None:
    """With ``resume = false``: move the previous run's checkpoint files and its non-empty
    ``metrics_path`` file into ``checkpoint_dir/previous-run-N``; the sub-folder, or None when
    there was nothing to move (or resume is on, or there is no checkpoint folder)."""
    if config.resume or config.checkpoint_dir is None:
        return None
    also = [config.metrics_path] if config.metrics_path is not None else []
    archive = archive_previous_run(config.checkpoint_dir, also=also)
    if archive is not None:
        logger.warning("resume = false: starting a new run; the previous one is in %s", archive)
    return archive


def _replay_round_record(
    config: CoordinatorConfig, phases: RoundPhases, metadata: dict[str, Any], next_round: int
) -> None:
    """Write the record of the round before ``next_round`` (from its durable state's
    ``metadata``) if the previous process did not, into the file it was writing to (a session
    that kept no metrics, or kept them elsewhere, is left so)."""
    record: Any = metadata.get(ROUND_RECORD_KEY)
    saved = metadata.get("config")
    previous = saved.get("metrics_path") if isinstance(saved, dict) else None
    if config.metrics_path is None or not isinstance(record, dict) or not isinstance(previous, str):
        return
    if Path(previous).resolve() != Path(config.metrics_path).resolve():
        return
    record = dict(record)
    due = bool(record.get("run_finished")) or next_round % config.eval_every == 0
    if phases.eval_fn is not None and due and record.get("eval_loss") is None:
        # The restored weights are the round's result bit for bit: the same loss as then.
        try:
            record["eval_loss"] = float(phases.eval_fn(phases.weights.cpu))
        except Exception:
            logger.exception("eval_fn failed while replaying round %d's record", next_round - 1)
    if append_missing_record(config.metrics_path, record):
        logger.warning(
            "replayed the metrics record of round %d, which the previous process did not write",
            record.get("round"),
        )

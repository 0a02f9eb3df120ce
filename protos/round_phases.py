"""Names of a round's phases, and how a site reports its own with an upload.

Both sides time every round so a user sees where a round goes (``metrics.jsonl``, the status
page). The coordinator times its own phases directly. A site's phases travel in the upload's
``metrics`` map, one entry per phase (``phase_<name>_s``), which is the only channel from a site
to the coordinator's round record. The upload happens *before* the site's own upload finishes
being timed and before its download and apply, so an upload carries:

* this round's ``train``, ``pseudo_gradient`` and ``encode`` (``phase_<name>_s``);
* the *previous* round's ``upload``, ``wait``, ``download``, ``apply`` and ``verify``
  (``prev_phase_<name>_s``): they are only known once that round's broadcast is applied.

The coordinator's record of round ``r`` therefore shows, per site (``site_phases_s``), the
training of round ``r`` and the upload, wait, download, apply and verify of round ``r - 1``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final

__all__ = [
    "COORDINATOR_PHASES",
    "SITE_PHASES",
    "SITE_PHASES_AFTER_UPLOAD",
    "SITE_PHASES_BEFORE_UPLOAD",
    "site_metric_name",
    "site_phases_from_metrics",
]

SITE_PHASES_BEFORE_UPLOAD: Final = ("train", "pseudo_gradient", "encode")
"""A site's phases of a round that are over when it uploads (reported with that upload)."""
SITE_PHASES_AFTER_UPLOAD: Final = ("upload", "wait", "download", "apply", "verify")
"""A site's phases of a round that end after its upload (reported with the next upload).
``wait``: from the end of the upload until the broadcast header arrives; ``download``: the
broadcast's bytes after the header; ``apply``: the strategy's downlink addition; ``verify``:
the digest of the new weights against the coordinator's."""
SITE_PHASES: Final = SITE_PHASES_BEFORE_UPLOAD + SITE_PHASES_AFTER_UPLOAD

COORDINATOR_PHASES: Final = (
    "receive", "verify", "add", "outer_step", "downlink_encode", "checkpoint", "broadcast",
)
"""The coordinator's phases of a round, disjoint in time (so they sum to at most the round's
wall time, ``round_wall_s``). ``receive``: upload streams in flight while no upload was being
verified or added; ``verify``: checksum, decode, finite and norm checks; ``add``: into the
aggregation buffer; ``outer_step``: the outer optimizer (and the new weights' digest);
``downlink_encode``: the downlink codec and its serialisation; ``checkpoint``: the wait for the
round to be durable (the round log's commit, a background checkpoint still being written, or a
full checkpoint due now); ``broadcast``: hashing the delta and publishing the new weights to
waiting sites (the transfer itself is in each site's ``download``)."""

_PREFIX: Final = "phase_"
_PREVIOUS_PREFIX: Final = "prev_phase_"
_SUFFIX: Final = "_s"


def site_metric_name(phase: str) -> str:
    """The upload ``metrics`` entry carrying ``phase`` (module doc: which round it is of)."""
    if phase in SITE_PHASES_BEFORE_UPLOAD:
        return f"{_PREFIX}{phase}{_SUFFIX}"
    if phase in SITE_PHASES_AFTER_UPLOAD:
        return f"{_PREVIOUS_PREFIX}{phase}{_SUFFIX}"
    raise ValueError(f"unknown site phase {phase!r}; site phases are {', '.join(SITE_PHASES)}")


def site_phases_from_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """The site phases an upload's ``metrics`` carries, by phase name (absent ones left out;
    negative or non-numeric values, which no honest site sends, are left out too)."""
    phases: dict[str, float] = {}
    for phase in SITE_PHASES:
        value = metrics.get(site_metric_name(phase))
        if isinstance(value, (int, float)) and math.isfinite(value) and value >= 0:
            phases[phase] = float(value)
    return phases

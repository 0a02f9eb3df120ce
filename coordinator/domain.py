"""The coordinator's domain objects: what membership, upload intake and round phases exchange.

No protobuf here. ``geoloco.coordinator.translate`` turns requests into these objects and these
objects into responses; everything below the servicer works on them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from geoloco.algorithms.round import Round
from geoloco.coordinator.round_timing import RoundTimings
from geoloco.protos.wire_files import RangeBlob

__all__ = [
    "OPEN_PHASES",
    "SITE_PHASES",
    "BroadcastHeader",
    "BroadcastRecord",
    "CoordinatorRound",
    "HeartbeatResult",
    "JoinResult",
    "ModelSnapshot",
    "RoundInfo",
    "RoundPhase",
    "RoundProgress",
    "UploadProgress",
    "UploadSpec",
    "WaitResult",
]


class RoundPhase(str, Enum):
    """Where the current round stands."""

    WAITING_FOR_QUORUM = "waiting_for_quorum"
    RUNNING = "running"
    AGGREGATING = "aggregating"
    FINISHED = "finished"


OPEN_PHASES = (RoundPhase.WAITING_FOR_QUORUM, RoundPhase.RUNNING)
"""Phases in which the current round accepts uploads."""

SITE_PHASES = ("fetching", "training", "uploading", "waiting")
"""What a site reports doing in its heartbeats (``""``: unspecified)."""


@dataclass(frozen=True, slots=True)
class RoundInfo:
    """The open round as a site needs to know it."""

    round: int
    round_seed: int
    deadline_remaining_s: float
    uplink_codec: str = ""
    """The site's own uplink codec this round (adaptive uplink); empty: the run's."""
    fastest_step_s: float = 0.0
    """Asynchronous merges with Dynamic Local Updates: the fastest member's seconds per inner
    step (``RoundContext.fastest_step_s``); 0: unknown or not used."""
    upload_numel: int = 0
    """Values in the site's upload for the round (``pb.RoundInfo.upload_numel``)."""
    fragment: int = 0
    """The fragment the round synchronises (0 without streaming)."""


@dataclass(frozen=True, slots=True)
class JoinResult:
    session_id: str
    site: str
    round: RoundInfo
    weights_digest: str
    """Hex SHA-256 of ``θ_round``."""
    must_fetch_model: bool


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    rejoin_required: bool
    round: RoundInfo
    run_finished: bool


@dataclass(frozen=True, slots=True)
class ModelSnapshot:
    """The current global weights as FetchModel serves them."""

    round: int
    weights: torch.Tensor
    """CPU, contiguous fp32 (never modified in place: each round installs a new tensor)."""
    digest: str
    """Hex SHA-256 of ``weights``."""


@dataclass(frozen=True, slots=True, eq=False)
class BroadcastRecord:
    """What the coordinator broadcast at the end of ``round``."""

    round: int
    data: bytes | RangeBlob
    """``Encoded.to_bytes()`` of the downlink delta; a large one in a file
    (``geoloco.coordinator.broadcast_store``)."""
    codec: str
    shape: tuple[int, ...]
    chunk_size: int
    weights_digest: str
    """Hex SHA-256 of ``θ_{round+1}``."""
    contributors: frozenset[str]
    run_finished: bool
    data_sha256: bytes | None = None
    """SHA-256 of ``data`` (its manifest's checksum), computed while the checkpoint is written so
    the first waiting site does not wait for it; None: computed when first asked."""


@dataclass(frozen=True, slots=True)
class BroadcastHeader:
    """The answer to a site waiting for round ``round``: apply ``record``'s delta, or (``record``
    None) resync to the current weights ``weights_digest``."""

    round: int
    included: bool
    num_contributors: int
    next_round: RoundInfo
    run_finished: bool
    weights_digest: str
    record: BroadcastRecord | None = None
    start_chunk: int = 0
    refused: bool = False
    """The round refused the site's update (``pb.BroadcastHeader.refused``): it drops it."""


@dataclass(frozen=True, slots=True)
class RoundProgress:
    round: int
    uploads_complete: int
    quorum: int
    deadline_remaining_s: float


@dataclass(frozen=True, slots=True)
class WaitResult:
    """Outcome of one ``wait_broadcast`` step: a header, or progress while the round is open."""

    header: BroadcastHeader | None = None
    progress: RoundProgress | None = None


@dataclass(frozen=True, slots=True)
class UploadSpec:
    """An upload's manifest as the coordinator checks it. Two specs are equal when their
    manifests are, once both name the caller (a resumed upload resends the identical one)."""

    site: str = field(compare=False)
    """The site the manifest names (may be empty; the caller's identity is what counts)."""
    session_id: str
    round: int
    fragment: int
    codec: str
    dtype: str
    shape: tuple[int, ...]
    total_bytes: int
    chunk_size: int
    num_chunks: int
    checksum: tuple[int, str]
    """(algorithm, hex digest) of the encoded update's bytes."""
    sample_weight: float
    inner_steps: int
    metrics: dict[str, float]
    nbytes: int = field(compare=False)
    """Serialized size of the manifest message (counted as received bytes)."""
    wire: Any = field(compare=False, repr=False)
    """The manifest normalized to name the caller: what the wire-level assembler keeps and
    compares (opaque here)."""
    raw: Any = field(compare=False, repr=False)
    """The manifest as received (opaque here)."""
    shard_index: int = 0
    shard_count: int = 0
    """> 1: one rank's shard of a sharded site's update (``geoloco.coordinator.shards``)."""
    shard_split: str = ""
    instance_id: str = field(default="", compare=False)
    """The sending process (``UploadManifest.instance_id``), checked against the site's member;
    not part of the update's identity (a restarted process re-sends the same update)."""


@dataclass(frozen=True, slots=True)
class UploadProgress:
    """Where an upload stands (the answer to Upload and UploadStatus)."""

    known: bool = True
    complete: bool = False
    folded_late: bool = False
    merged_round: int | None = None
    """Asynchronous merges: the merge the complete update entered (``UploadResponse.merged_round``)."""
    received: tuple[tuple[int, int], ...] = ()
    missing: tuple[tuple[int, int], ...] = ()
    received_bytes: int = 0
    manifest: Any = field(default=None, compare=False, repr=False)
    """The stored manifest (``UploadSpec.wire``), for UploadStatus."""


@dataclass(slots=True)
class CoordinatorRound:
    """The open round: the round core's ``Round`` (contributors, weights, arrivals, folded late
    updates, rejected sites, the aggregation buffer, the deadline in force) plus what only the
    coordinator tracks: upload buffers, bytes and the sites' own metrics."""

    core: Round
    departed: set[str] = field(default_factory=set)
    """Sites that left or were dropped during the round without contributing."""
    left_out: set[str] = field(default_factory=set)
    """Rejected sites whose update nobody judged (their relay's partial was refused): not
    waited for, but not told their update was refused (``BroadcastHeader.refused``)."""
    uploads: dict[str, Any] = field(default_factory=dict)
    """site -> its upload (``geoloco.coordinator.intake.PlainUpload``)."""
    held: dict[str, Any] = field(default_factory=dict)
    """Asynchronous merges: the next update of a site whose update is already in this merge,
    held for the next one (site -> ``PlainUpload``)."""
    stale_uploads: dict[str, Any] = field(default_factory=dict)
    """Uploads for the previous round, to be folded into this one (``late_updates = "fold"``)."""
    bytes_up: dict[str, int] = field(default_factory=dict)
    bytes_down: dict[str, int] = field(default_factory=dict)
    site_metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    inner_steps: dict[str, int] = field(default_factory=dict)
    """site -> inner steps its upload reports."""
    staleness: dict[str, int] = field(default_factory=dict)
    """Asynchronous merges: site -> merges between the version its update was computed from and
    this merge (``geoloco.algorithms.async_merge.stale_admission``)."""
    timings: RoundTimings = field(default_factory=RoundTimings)
    """Where the round's time goes (``geoloco.coordinator.round_timing``)."""
    ended: threading.Event = field(default_factory=threading.Event)
    """Set once the round is replaced by the next (its broadcast is ready) or the coordinator
    closes. AwaitBroadcast calls wait on it, not on the session's condition: a condition wakes
    every waiting stream at every upload and join, which costs the square of the sites per
    round; this wakes each stream once per round."""

    @property
    def number(self) -> int:
        return self.core.number

    @property
    def contributed(self) -> dict[str, float]:
        return self.core.contributed

    @property
    def rejected(self) -> dict[str, str]:
        """site -> why its update was rejected."""
        return self.core.rejected

    @property
    def folded(self) -> dict[str, float]:
        return self.core.folded

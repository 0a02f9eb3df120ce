"""Translation between protobuf messages and the coordinator's domain objects.

The only module below the servicer that builds or reads ``pb.*`` messages: requests become
``geoloco.coordinator.domain`` objects here, and domain answers become responses. The state
machine, membership, intake and phases never see a message (the wire-level upload assembler of
``geoloco.protos.wire_assembly`` carries the manifest it was opened with, opaque to them).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from geoloco.algorithms.params import ParamLayout
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.domain import (
    BroadcastHeader,
    BroadcastRecord,
    HeartbeatResult,
    JoinResult,
    ModelSnapshot,
    RoundInfo,
    RoundProgress,
    UploadProgress,
    UploadSpec,
)
from geoloco.coordinator.shard_views import ShardKey, ShardSlice
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.errors import InvalidUpdateError
from geoloco.protos.protocol_version import PROTOCOL_VERSION
from geoloco.protos.upload_check import finite_metrics
from geoloco.protos.wire_buffers import RAW_CODEC, ManifestError, num_chunks_for, to_index_ranges
from geoloco.protos.wire_chunks import ChunkRef, message_nbytes
from geoloco.protos.wire_manifests import blob_manifest

__all__ = [
    "BlobCache",
    "broadcast_header",
    "checksum",
    "digest_hex",
    "heartbeat_response",
    "join_response",
    "model_layout",
    "model_manifest",
    "round_info",
    "round_progress",
    "run_config",
    "site_phase",
    "upload_chunks",
    "upload_response",
    "upload_spec",
    "upload_status_response",
]

_SITE_PHASES = {
    pb.SITE_PHASE_FETCHING: "fetching",
    pb.SITE_PHASE_TRAINING: "training",
    pb.SITE_PHASE_UPLOADING: "uploading",
    pb.SITE_PHASE_WAITING: "waiting",
}
"""``SitePhase`` -> ``geoloco.coordinator.domain.SITE_PHASES``."""

_WEIGHTING = {"samples": pb.WEIGHTING_SAMPLES, "steps": pb.WEIGHTING_STEPS}


# -- digests --


def checksum(hex_digest: str) -> pb.Checksum:
    """A hex SHA-256 digest (of weights) as a ``Checksum``."""
    return pb.Checksum(algorithm=pb.CHECKSUM_ALGORITHM_SHA256, digest=bytes.fromhex(hex_digest))


def digest_hex(message: pb.Checksum | None) -> str | None:
    """The hex SHA-256 digest a ``Checksum`` carries; None for none or another algorithm."""
    if message is None or message.algorithm != pb.CHECKSUM_ALGORITHM_SHA256:
        return None
    return message.digest.hex()


# -- run setup --


def run_config(config: CoordinatorConfig, *, inner_steps: int, uplink_codec: str, downlink_codec: str) -> pb.RunConfig:
    """What every site is told about the run (``JoinResponse.config``)."""
    c = config
    return pb.RunConfig(
        inner_steps=inner_steps,
        uplink_codec=uplink_codec,
        downlink_codec=downlink_codec,
        seed=c.seed,
        weighting=_WEIGHTING.get(c.algorithm.weighting, pb.WEIGHTING_UNIFORM),
        total_rounds=c.total_rounds,
        quorum=c.min_sites,
        round_deadline_ms=0 if c.round_deadline_s is None else int(c.round_deadline_s * 1000),
        heartbeat_interval_ms=int(c.heartbeat_interval_s * 1000),
        heartbeat_timeout_ms=int(c.heartbeat_timeout_s * 1000),
        config_json=json.dumps(c.to_dict(), sort_keys=True),
    )


def model_layout(layout: ParamLayout) -> pb.ModelLayout:
    message = pb.ModelLayout(numel=layout.numel, dtype="float32")
    for entry in layout.entries:
        message.tensors.add(name=entry.name, shape=list(entry.shape), offset=entry.offset, numel=entry.numel)
    return message


def round_info(info: RoundInfo) -> pb.RoundInfo:
    return pb.RoundInfo(
        round=info.round,
        round_seed=info.round_seed,
        deadline_remaining_ms=int(info.deadline_remaining_s * 1000),
        uplink_codec=info.uplink_codec,
        fastest_step_s=info.fastest_step_s,
        upload_numel=info.upload_numel,
        fragment=info.fragment,
    )


# -- membership --


def join_response(result: JoinResult, *, config: pb.RunConfig, layout: pb.ModelLayout) -> pb.JoinResponse:
    return pb.JoinResponse(
        session_id=result.session_id,
        site=result.site,
        config=config,
        round=round_info(result.round),
        layout=layout,
        weights_digest=checksum(result.weights_digest),
        must_fetch_model=result.must_fetch_model,
        protocol_version=PROTOCOL_VERSION,
    )


def site_phase(phase: pb.SitePhase) -> str:
    """A reported ``SitePhase`` as its domain name (``""`` when unspecified or unknown)."""
    return _SITE_PHASES.get(phase, "")


def heartbeat_response(result: HeartbeatResult) -> pb.HeartbeatResponse:
    return pb.HeartbeatResponse(
        rejoin_required=result.rejoin_required,
        round=round_info(result.round),
        run_finished=result.run_finished,
    )


# -- FetchModel --


def model_manifest(
    snapshot: ModelSnapshot, request: pb.FetchModelRequest, *, layout: pb.ModelLayout, chunk_size: int
) -> pb.ModelManifest:
    """The manifest of a FetchModel stream: the raw fp32 weights, resumed at the requested
    chunk only if the site still expects the same weights."""
    digest = checksum(snapshot.digest)
    total = snapshot.weights.numel() * snapshot.weights.element_size()
    blob = pb.BlobManifest(
        total_bytes=total,
        chunk_size=chunk_size,
        num_chunks=num_chunks_for(total, chunk_size),
        checksum=digest,
        codec=RAW_CODEC,
        shape=[snapshot.weights.numel()],
        dtype="float32",
    )
    same_weights = request.HasField("expect_digest") and request.expect_digest == digest
    stride = max(1, request.chunk_stride)
    # A resumption of the same weights goes on where it broke; otherwise from the top -- for one
    # of several parallel strided streams, the top of its own share (its residue).
    start = request.start_chunk if same_weights else request.start_chunk % stride
    if start > blob.num_chunks:
        raise InvalidUpdateError(f"start_chunk {start} is past the model's {blob.num_chunks} chunks")
    return pb.ModelManifest(round=snapshot.round, layout=layout, blob=blob, start_chunk=start)


# -- uploads --


def upload_spec(manifest: pb.UploadManifest, site: str) -> UploadSpec:
    """An Upload stream's manifest; ``site`` is the caller (the certificate's name with TLS).
    Metrics that are not finite numbers are left out (``finite_metrics``)."""
    normalized = pb.UploadManifest()
    normalized.CopyFrom(manifest)
    normalized.site = site
    normalized.ClearField("instance_id")  # which process sent the update is not part of it
    blob = manifest.blob
    return UploadSpec(
        site=manifest.site,
        session_id=manifest.session_id,
        round=manifest.round,
        fragment=manifest.fragment,
        codec=blob.codec,
        dtype=blob.dtype,
        shape=tuple(blob.shape),
        total_bytes=blob.total_bytes,
        chunk_size=blob.chunk_size,
        num_chunks=blob.num_chunks,
        checksum=(blob.checksum.algorithm, blob.checksum.digest.hex()),
        sample_weight=manifest.sample_weight,
        inner_steps=manifest.inner_steps,
        metrics=finite_metrics(manifest.metrics),
        nbytes=message_nbytes(manifest),
        wire=normalized,
        raw=manifest,
        shard_index=manifest.shard_index,
        shard_count=manifest.shard_count,
        shard_split=manifest.shard_split,
        instance_id=manifest.instance_id,
    )


def upload_chunks(requests: Iterable[pb.UploadRequest | ChunkRef]) -> Iterator[tuple[Any, int]]:
    """The chunks after an Upload stream's manifest, each with its message's size; a second
    manifest is an error."""
    for request in requests:
        kind = request.WhichOneof("kind")
        if kind != "chunk":
            raise ManifestError(
                f"Upload stream has a {kind!r} message after its manifest; only chunks may follow"
            )
        yield request.chunk, message_nbytes(request)


def upload_response(progress: UploadProgress) -> pb.UploadResponse:
    response = pb.UploadResponse(
        complete=progress.complete,
        missing=to_index_ranges(progress.missing),
        received_bytes=progress.received_bytes,
    )
    if progress.folded_late:
        response.folded_late = True
    if progress.merged_round is not None:
        response.merged_round = progress.merged_round
    return response


def upload_status_response(progress: UploadProgress) -> pb.UploadStatusResponse:
    if not progress.known:
        return pb.UploadStatusResponse(known=False)
    response = pb.UploadStatusResponse(
        known=True,
        manifest=progress.manifest,
        received=to_index_ranges(progress.received),
        missing=to_index_ranges(progress.missing),
        complete=progress.complete,
    )
    if progress.folded_late:
        response.folded_late = True
    if progress.merged_round is not None:
        response.merged_round = progress.merged_round
    return response


# -- broadcasts --


class BlobCache:
    """The ``BlobManifest`` of the latest broadcast, computed once (its checksum reads every
    byte of the delta) however many sites ask."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._record: BroadcastRecord | None = None
        self._blob: pb.BlobManifest | None = None

    def blob(self, record: BroadcastRecord) -> pb.BlobManifest:
        with self._lock:
            if self._record is not record or self._blob is None:
                self._blob = _blob(record)
                self._record = record
            return self._blob


def _blob(record: BroadcastRecord) -> pb.BlobManifest:
    return blob_manifest(
        record.data, codec=record.codec, shape=list(record.shape), dtype="float32", chunk_size=record.chunk_size,
        checksum_algorithm=pb.CHECKSUM_ALGORITHM_SHA256, digest=record.data_sha256,
    )


def shard_key(ref: pb.ShardRef) -> ShardKey:
    """A request's ``ShardRef`` as (index, count, split)."""
    return int(ref.index), int(ref.count), str(ref.split)


def shard_blob(rows: ShardSlice, *, chunk_size: int) -> pb.BlobManifest:
    """The manifest of a rank's rows of a delta (``geoloco.coordinator.shard_views``)."""
    return blob_manifest(
        rows.data, codec=rows.codec, shape=[rows.numel], dtype="float32", chunk_size=chunk_size,
        checksum_algorithm=pb.CHECKSUM_ALGORITHM_SHA256, digest=rows.sha256,
    )


def broadcast_header(header: BroadcastHeader, blobs: BlobCache | None = None) -> pb.BroadcastHeader:
    """APPLY_DELTA with the record's delta, or RESYNC to ``weights_digest``."""
    record = header.record
    if record is None:
        return pb.BroadcastHeader(
            action=pb.BROADCAST_ACTION_RESYNC,
            round=header.round,
            included=header.included,
            refused=header.refused,
            num_contributors=header.num_contributors,
            weights_digest=checksum(header.weights_digest),
            next_round=round_info(header.next_round),
            run_finished=header.run_finished,
        )
    return pb.BroadcastHeader(
        action=pb.BROADCAST_ACTION_APPLY_DELTA,
        round=header.round,
        included=header.included,
        refused=header.refused,
        num_contributors=header.num_contributors,
        delta=blobs.blob(record) if blobs is not None else _blob(record),
        weights_digest=checksum(header.weights_digest),
        next_round=round_info(header.next_round),
        run_finished=header.run_finished,
        start_chunk=header.start_chunk,
    )


def round_progress(progress: RoundProgress) -> pb.RoundProgress:
    return pb.RoundProgress(
        round=progress.round,
        uploads_complete=progress.uploads_complete,
        quorum=progress.quorum,
        deadline_remaining_ms=int(progress.deadline_remaining_s * 1000),
    )

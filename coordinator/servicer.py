"""The gRPC servicer: proto in -> one round-state-machine call -> proto out.

No decision is taken here; ``geoloco.coordinator.translate`` turns requests into domain objects
and answers into responses. Identity comes from ``geoloco.protos.transport_tls.resolve_site`` (the
client certificate with TLS), errors are ``StatusError`` exceptions that
``ErrorStatusInterceptor`` turns into a status code plus the ``geoloco-error-reason`` trailing
metadata, and big buffers go through the chunk streams of ``geoloco.protos.wire_chunks`` and
``geoloco.protos.wire_assembly``. Every
message sent to or received from a site is counted (serialized protobuf bytes, without HTTP/2 and
TLS framing) for the per-round metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace

import grpc

from geoloco.coordinator import translate
from geoloco.coordinator.domain import BroadcastHeader
from geoloco.coordinator.relayed import RelayedSite, RelayedUploads, relay_link
from geoloco.coordinator.rounds import SECURE_STAGE_WAIT_S, RoundStateMachine
from geoloco.coordinator.shard_views import ShardKey, ShardViews
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import geoloco_pb2_grpc as pb_grpc
from geoloco.protos import secagg_wire
from geoloco.protos.errors import IdentityError, InvalidUpdateError
from geoloco.protos.transport_tls import resolve_site
from geoloco.protos.wire_assembly import read_upload_manifest
from geoloco.protos.wire_chunks import ChunkRef, broadcast_responses, message_nbytes, model_responses
from geoloco.protos.wire_files import RangeBlob

__all__ = ["CoordinatorServicer"]

logger = logging.getLogger(__name__)


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """Serves one ``RoundStateMachine`` over gRPC."""

    def __init__(
        self,
        rounds: RoundStateMachine,
        *,
        insecure: bool,
        chunk_size: int,
        progress_interval_s: float,
    ) -> None:
        self.rounds = rounds
        self.insecure = insecure
        self.chunk_size = chunk_size
        self.progress_interval_s = progress_interval_s
        self._run_config = translate.run_config(
            rounds.config,
            inner_steps=rounds.strategy.inner_steps,
            uplink_codec=rounds.uplink_codec,
            downlink_codec=rounds.downlink_codec,
        )
        self._layout = translate.model_layout(rounds.layout)
        self._blobs = translate.BlobCache()
        self._shard_views = ShardViews(
            [tuple(e.shape) for e in rounds.layout.entries], spill_directory=rounds.config.checkpoint_dir
        )
        self.relays = RelayedUploads(rounds.intake, rounds.config.relays, insecure=insecure)
        """Regional relays: whom each may speak for, and their partial sums."""

    def _site(self, context: grpc.ServicerContext, claimed: str) -> str:
        relay = self.relays.relay_of(context)
        if relay is not None:
            return self.relays.speak_for(relay, claimed)
        return resolve_site(context, claimed, insecure=self.insecure)

    def _link(self, context: grpc.ServicerContext, site: str) -> str:
        """Whom bytes sent to ``site`` travel through: the relay calling for it, or the site."""
        relay = self.relays.relay_of(context)
        return site if relay is None else relay_link(relay)

    def _relayed_upload(
        self,
        manifest: pb.UploadManifest,
        requests: Iterator[pb.UploadRequest | ChunkRef],
        context: grpc.ServicerContext,
    ) -> pb.UploadResponse:
        relay = self.relays.relay_of(context)
        if relay is None:
            if not self.insecure:
                raise IdentityError("only a relay's certificate (geoloco:relay:NAME) may upload relayed_sites")
            relay = self.relays.insecure_relay(manifest.site)
        relayed = [
            RelayedSite(r.site, r.weight, r.inner_steps, dict(r.metrics), r.rejected, r.left_out)
            for r in manifest.relayed_sites
        ]
        try:
            progress = self.relays.receive(
                relay, translate.upload_spec(manifest, manifest.site), relayed, translate.upload_chunks(requests)
            )
        except grpc.RpcError:
            logger.info("upload stream of relay %s for round %d broke", relay, manifest.round)
            return pb.UploadResponse()
        return translate.upload_response(progress)

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinResponse:
        site = self._site(context, request.site)
        result = self.rounds.join(
            site,
            protocol_version=request.protocol_version,
            has_weights=request.has_weights,
            weights_digest=translate.digest_hex(request.weights_digest) if request.HasField("weights_digest") else None,
            software_version=request.software_version,
            instance=request.instance_id,
            peer=str(context.peer()),
            via=self.relays.relay_of(context) or "",
        )
        return translate.join_response(result, config=self._run_config, layout=self._layout)

    def FetchModel(
        self, request: pb.FetchModelRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.FetchModelResponse | ChunkRef]:
        site = self._site(context, request.site)
        snapshot = self.rounds.model_snapshot(site, request.session_id, instance=request.instance_id)
        if request.HasField("shard"):  # a sharded site's rank: its rows only
            key = translate.shard_key(request.shard)
            snapshot = replace(
                snapshot,
                weights=self._shard_views.weight_rows(snapshot.weights, key),
                digest=self._shard_views.rows_digest(snapshot.weights, snapshot.digest, key),
            )
        manifest = translate.model_manifest(snapshot, request, layout=self._layout, chunk_size=self.chunk_size)
        manifest.shard_rows = request.HasField("shard")
        link = self._link(context, site)
        for response in model_responses(manifest, snapshot.weights, stride=request.chunk_stride):
            self.rounds.count_bytes_down(link, message_nbytes(response))
            yield response

    def Upload(
        self, request_iterator: Iterator[pb.UploadRequest | ChunkRef], context: grpc.ServicerContext
    ) -> pb.UploadResponse:
        try:
            manifest = read_upload_manifest(request_iterator)
        except grpc.RpcError:
            # Cancelled before its manifest (the peer went away, or the admission's idle-read
            # watchdog ended it): nothing arrived, nobody is left to read a response.
            logger.info("upload stream from %s broke before its manifest", context.peer())
            return pb.UploadResponse()
        if manifest.relayed_sites:
            return self._relayed_upload(manifest, request_iterator, context)
        site = self._site(context, manifest.site)
        try:
            progress = self.rounds.receive_upload(
                site, translate.upload_spec(manifest, site), translate.upload_chunks(request_iterator)
            )
        except grpc.RpcError:
            # The site's stream broke (cancelled, connection lost, idle too long): what arrived
            # is kept for UploadStatus; nobody is left to read a response.
            logger.info("upload stream of %s for round %d broke", site, manifest.round)
            return pb.UploadResponse()
        return translate.upload_response(progress)

    def UploadStatus(
        self, request: pb.UploadStatusRequest, context: grpc.ServicerContext
    ) -> pb.UploadStatusResponse:
        site = self._site(context, request.site)
        progress = self.rounds.upload_status(
            site, request.session_id, request.round, request.fragment, instance=request.instance_id
        )
        return translate.upload_status_response(progress)

    def AwaitBroadcast(
        self, request: pb.AwaitBroadcastRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.AwaitBroadcastResponse | ChunkRef]:
        site = self._site(context, request.site)
        if request.HasField("shard"):
            self._shard_views.ranges(translate.shard_key(request.shard))  # refused now, not after the wait
        link = self._link(context, site)
        first = True
        while True:
            result = self.rounds.wait_broadcast(
                site,
                request.session_id,
                request.round,
                timeout_s=self.progress_interval_s,
                start_chunk=request.start_chunk,
                check_member=first,
                instance=request.instance_id,
                withheld=request.withheld,
            )
            first = False
            if result.progress is not None:
                if not context.is_active():
                    return
                response = pb.AwaitBroadcastResponse(progress=translate.round_progress(result.progress))
                self.rounds.count_bytes_down(link, message_nbytes(response))
                yield response
                continue
            assert result.header is not None
            header = translate.broadcast_header(result.header, self._blobs)
            data = result.header.record.data if result.header.record is not None else None
            if request.HasField("shard"):
                data = self._shard_header(header, result.header, translate.shard_key(request.shard), data)
            for message in broadcast_responses(header, data, stride=request.chunk_stride):
                self.rounds.count_bytes_down(link, message_nbytes(message))
                yield message
            return

    def _shard_header(
        self, header: pb.BroadcastHeader, found: BroadcastHeader, key: ShardKey, data: bytes | RangeBlob | None
    ) -> bytes | RangeBlob | None:
        """Turn a broadcast header into a rank's (``geoloco.coordinator.shard_views``): the
        digest of its rows of the new weights and, where the codec allows, only its rows of the
        delta; returns the bytes to serve."""
        weights = self.rounds.weights_with_digest(found.weights_digest)
        if weights is not None:
            header.shard_weights_digest.CopyFrom(
                translate.checksum(self._shard_views.rows_digest(weights, found.weights_digest, key))
            )
        record = found.record
        if record is None:
            return data
        rows = self._shard_views.delta_rows(record, key)
        if rows is None:
            return data
        header.delta.CopyFrom(translate.shard_blob(rows, chunk_size=record.chunk_size))
        if header.start_chunk > header.delta.num_chunks:
            raise InvalidUpdateError(
                f"start_chunk {header.start_chunk} is past the shard's {header.delta.num_chunks} chunks of the delta"
            )
        header.shard_rows = True
        return rows.data

    def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.HeartbeatResponse:
        site = self._site(context, request.site)
        result = self.rounds.heartbeat(
            site,
            request.session_id,
            round_number=request.round,
            phase=translate.site_phase(request.phase),
            inner_steps_done=request.inner_steps_done,
            instance=request.instance_id,
            via=self.relays.relay_of(context) or "",
        )
        return translate.heartbeat_response(result)

    def SecureStage(
        self, request: pb.SecureStageRequest, context: grpc.ServicerContext
    ) -> pb.SecureStageResponse:
        site = self._site(context, request.site)
        reply = self.rounds.secure_stage(
            site, request.session_id, request.round, request.stage, secagg_wire.request_message(request),
            wait_s=min(request.wait_ms / 1000, SECURE_STAGE_WAIT_S),
            instance=request.instance_id,
        )
        response = secagg_wire.stage_response(request.stage, reply)
        self.rounds.count_stage_bytes(site, request.ByteSize(), response.ByteSize())
        return response

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveResponse:
        site = self._site(context, request.site)
        self.rounds.leave(site, request.session_id, request.reason, instance=request.instance_id)
        return pb.LeaveResponse()

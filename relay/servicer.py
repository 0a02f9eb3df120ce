"""The relay's gRPC service: the coordinator's own protocol, served to a region's sites.

Join, Heartbeat and Leave are passed to the coordinator on the site's behalf (the answer, errors
included, comes back unchanged; the relay keeps what it needs: the session, the run's settings,
the open round, the process holding the site's name). FetchModel is streamed through. Uploads
stay at the relay, which verifies them and adds them to the round's partial sum
(``geoloco.relay.hub``); AwaitBroadcast is answered from the one broadcast the relay fetched.
What the relay answers itself, it refuses to a replaced process of a site
(``RelayHub.check_instance``). Secure-aggregation stage calls are passed through; a secure
round's masked uploads are added in the ring (``geoloco.relay.masked``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import grpc

from geoloco.algorithms.privacy.secagg_messages import STAGE_WITHDRAW
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import geoloco_pb2_grpc as pb_grpc
from geoloco.protos.errors import StatusError
from geoloco.protos.transport_tls import resolve_site
from geoloco.protos.wire_assembly import read_upload_manifest, upload_chunks
from geoloco.protos.wire_chunks import ChunkRef, broadcast_responses, message_nbytes
from geoloco.relay.hub import AskCoordinator, RelayHub
from geoloco.relay.upstream import Traffic, Upstream

__all__ = ["RelayServicer"]

logger = logging.getLogger(__name__)


class RelayServicer(pb_grpc.CoordinatorServicer):
    """Serves one ``RelayHub`` to the region's sites (module doc)."""

    def __init__(
        self, hub: RelayHub, upstream: Upstream, traffic: Traffic, *, insecure: bool, progress_interval_s: float
    ) -> None:
        self.hub = hub
        self.upstream = upstream
        self.traffic = traffic
        self.insecure = insecure
        self.progress_interval_s = progress_interval_s

    def _site(self, context: grpc.ServicerContext, claimed: str) -> str:
        site = resolve_site(context, claimed, insecure=self.insecure)
        self.hub.check_allowed(site)
        return site

    def _up(self, site: str, message: Any) -> None:
        self.traffic.add(f"site:{site}->relay", message_nbytes(message))

    def _down(self, site: str, message: Any) -> Any:
        self.traffic.add(f"relay->site:{site}", message_nbytes(message))
        return message

    def _forward(self, site: str, method: str, request: Any) -> Any:
        """A unary call passed to the coordinator, made for ``site``."""
        self._up(site, request)
        forwarded = type(request)()
        forwarded.CopyFrom(request)
        forwarded.site = site
        return self._down(site, self.upstream.unary(method, forwarded))

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinResponse:
        site = self._site(context, request.site)
        with self.hub.join_lock(site):
            response: pb.JoinResponse = self._forward(site, "Join", request)
            self.hub.joined(site, response, request.instance_id)
        return response

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        site = self._site(context, request.site)
        response: pb.HeartbeatResponse = self._forward(site, "Heartbeat", request)
        self.hub.heard(site, response)
        return response

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveResponse:
        site = self._site(context, request.site)
        try:
            response: pb.LeaveResponse = self._forward(site, "Leave", request)
        finally:
            self.hub.left(site)
        return response

    def FetchModel(
        self, request: pb.FetchModelRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.FetchModelResponse | ChunkRef]:
        site = self._site(context, request.site)
        self._up(site, request)
        forwarded = pb.FetchModelRequest()
        forwarded.CopyFrom(request)
        forwarded.site = site
        for message in self.upstream.stream("FetchModel", forwarded):
            yield self._down(site, message)

    def Upload(
        self, request_iterator: Iterator[pb.UploadRequest | ChunkRef], context: grpc.ServicerContext
    ) -> pb.UploadResponse:
        try:
            manifest = read_upload_manifest(request_iterator)
        except grpc.RpcError:
            logger.info("upload stream from %s broke before its manifest", context.peer())
            return pb.UploadResponse()
        site = self._site(context, manifest.site)
        self._up(site, manifest)
        assembler = self.hub.open_upload(site, manifest)

        def chunks() -> Iterator[pb.Chunk | ChunkRef]:
            for chunk in upload_chunks(request_iterator):
                self._up(site, chunk)
                self.hub.still_open(site, assembler, manifest.instance_id)
                yield chunk

        try:
            assembler.consume(chunks())
        except grpc.RpcError:
            logger.info("upload stream of %s for round %d broke", site, manifest.round)
            return pb.UploadResponse()
        if not assembler.complete:
            return assembler.upload_response()
        return self.hub.finish_upload(site, assembler)

    def UploadStatus(self, request: pb.UploadStatusRequest, context: grpc.ServicerContext) -> pb.UploadStatusResponse:
        site = self._site(context, request.site)
        self._up(site, request)
        return self._down(site, self.hub.upload_status(site, request))

    def AwaitBroadcast(
        self, request: pb.AwaitBroadcastRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.AwaitBroadcastResponse | ChunkRef]:
        site = self._site(context, request.site)
        self._up(site, request)
        if request.withheld:  # it sends no update: neither the relay nor the coordinator waits for it
            self.hub.withheld(site, request)
        while True:
            answer = self.hub.wait_broadcast(site, request, timeout_s=self.progress_interval_s)
            if isinstance(answer, AskCoordinator):
                # The round's partial was refused and one of its sites may have counted by its own
                # upload (a failover): the coordinator says so for the site; the delta is the
                # relay's cached one.
                header, data = answer.header, answer.data
                verdict = self._ask_coordinator(site, request, header)
                header.included, header.refused = verdict.included, verdict.refused
                for message in broadcast_responses(header, data, stride=request.chunk_stride):
                    yield self._down(site, message)
                return
            if isinstance(answer, pb.RoundProgress):
                if not context.is_active():
                    return
                yield self._down(site, pb.AwaitBroadcastResponse(progress=answer))
                continue
            header, data = answer
            for message in broadcast_responses(header, data, stride=request.chunk_stride):
                yield self._down(site, message)
            return

    def _ask_coordinator(
        self, site: str, request: pb.AwaitBroadcastRequest, cached: pb.BroadcastHeader
    ) -> pb.BroadcastHeader:
        """The coordinator's header of ``request.round`` for ``site``, without the delta the
        relay holds (``start_chunk`` past its last chunk; an older round's RESYNC has none)."""
        forwarded = pb.AwaitBroadcastRequest()
        forwarded.CopyFrom(request)
        forwarded.site = site
        forwarded.ClearField("withheld")
        forwarded.start_chunk = cached.delta.num_chunks
        for message in self.upstream.stream("AwaitBroadcast", forwarded):
            if message.HasField("header"):
                return message.header
        raise StatusError("coordinator: no broadcast header; ask again", code=grpc.StatusCode.UNAVAILABLE)

    def SecureStage(self, request: pb.SecureStageRequest, context: grpc.ServicerContext) -> pb.SecureStageResponse:
        """Passed to the coordinator unchanged but for the site's name (the caller's certificate):
        advertisements and survivor signatures are signed with the site's identity key (bound to
        its certificate by the run's CA), shares are encrypted for their recipient, so the relay
        can neither read nor forge what it carries (``geoloco.relay.masked``)."""
        site = self._site(context, request.site)
        response: pb.SecureStageResponse = self._forward(site, "SecureStage", request)
        self.hub.heard(site)
        if request.stage == STAGE_WITHDRAW:
            self.hub.withdrew(site, int(request.round))
        return response

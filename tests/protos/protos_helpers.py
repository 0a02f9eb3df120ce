"""Shared pieces of the transport tests: a small coordinator servicer built only from the wire
helpers, and a server on port 0 around it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc

from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import geoloco_pb2_grpc as pb_grpc
from geoloco.protos.errors import StaleSessionError
from geoloco.protos.transport_endpoints import add_coordinator_servicer, build_server
from geoloco.protos.transport_tls import TLSFiles, resolve_site
from geoloco.protos.wire_assembly import UploadAssembler, read_upload_manifest, upload_chunks
from geoloco.protos.wire_chunks import broadcast_responses, model_responses
from geoloco.protos.wire_manifests import blob_manifest, model_layout

SESSION_ID = "session-1"
SITES = ("eu-west", "us_east.2")


class MiniCoordinator(pb_grpc.CoordinatorServicer):
    """Just enough coordinator to exercise the transport: assembles uploads, serves a model and
    one broadcast, checks the session in Heartbeat. Records who called."""

    def __init__(self, *, insecure: bool, model: bytes, delta: bytes = b"") -> None:
        self.insecure = insecure
        self.model = model
        self.delta = delta
        self.lock = threading.Lock()
        self.uploads: dict[tuple[str, int, int], UploadAssembler] = {}
        self.completed: dict[tuple[str, int, int], bytes] = {}
        self.callers: list[tuple[str, str]] = []
        self.upload_streams_ended = 0
        self.upload_ended = threading.Condition(self.lock)
        self.upload_opened = threading.Event()
        """Set once an Upload stream's manifest was read and its assembler registered."""
        layout = model_layout([("w", (len(model) // 4,))])
        self.model_manifest = pb.ModelManifest(
            round=3, layout=layout, blob=blob_manifest(model, dtype="float32")
        )

    def _site(self, context: grpc.ServicerContext, claimed: str, rpc: str) -> str:
        site = resolve_site(context, claimed, insecure=self.insecure)
        with self.lock:
            self.callers.append((rpc, site))
        return site

    def Upload(self, request_iterator, context):
        try:
            return self._upload(request_iterator, context)
        finally:
            with self.upload_ended:
                self.upload_streams_ended += 1
                self.upload_ended.notify_all()

    def wait_upload_streams_ended(self, count: int, timeout_s: float = 30.0) -> None:
        with self.upload_ended:
            if not self.upload_ended.wait_for(
                lambda: self.upload_streams_ended >= count, timeout_s
            ):
                raise TimeoutError(f"only {self.upload_streams_ended} Upload streams ended")

    def _upload(self, request_iterator, context):
        manifest = read_upload_manifest(request_iterator)
        site = self._site(context, manifest.site, "Upload")
        key = (site, manifest.round, manifest.fragment)
        with self.lock:
            assembler = self.uploads.get(key)
            if assembler is None:
                assembler = UploadAssembler(manifest, max_total_bytes=256 << 20)
                self.uploads[key] = assembler
        self.upload_opened.set()
        assembler.check_same_manifest(manifest)
        assembler.consume(upload_chunks(request_iterator))
        if assembler.complete:
            data = assembler.finish()
            with self.lock:
                self.completed[key] = bytes(data)
        return assembler.upload_response()

    def UploadStatus(self, request, context):
        site = self._site(context, request.site, "UploadStatus")
        with self.lock:
            assembler = self.uploads.get((site, request.round, request.fragment))
        if assembler is None:
            return pb.UploadStatusResponse(known=False)
        return assembler.status_response()

    def FetchModel(self, request, context):
        self._site(context, request.site, "FetchModel")
        manifest = pb.ModelManifest()
        manifest.CopyFrom(self.model_manifest)
        if request.start_chunk and request.expect_digest == manifest.blob.checksum:
            manifest.start_chunk = request.start_chunk
        yield from model_responses(manifest, self.model)

    def AwaitBroadcast(self, request, context):
        self._site(context, request.site, "AwaitBroadcast")
        yield pb.AwaitBroadcastResponse(
            progress=pb.RoundProgress(round=request.round, uploads_complete=1, quorum=2)
        )
        if request.round != 3:
            header = pb.BroadcastHeader(action=pb.BROADCAST_ACTION_RESYNC, round=request.round)
            yield from broadcast_responses(header, None)
            return
        header = pb.BroadcastHeader(
            action=pb.BROADCAST_ACTION_APPLY_DELTA,
            round=3,
            included=True,
            num_contributors=2,
            delta=blob_manifest(self.delta, codec="int8", shape=[len(self.delta)]),
            next_round=pb.RoundInfo(round=4, round_seed=44),
            start_chunk=request.start_chunk,
        )
        yield from broadcast_responses(header, self.delta)

    def Heartbeat(self, request, context):
        self._site(context, request.site, "Heartbeat")
        if request.session_id != SESSION_ID:
            raise StaleSessionError(f"session {request.session_id!r} is stale; call Join")
        return pb.HeartbeatResponse(round=pb.RoundInfo(round=3))


def start_server(
    servicer: MiniCoordinator, tls: TLSFiles | None
) -> tuple[grpc.Server, int]:
    server, port = build_server(tls=tls, insecure=tls is None, max_workers=8)
    add_coordinator_servicer(servicer, server)
    server.start()
    return server, port


def model_bytes(nbytes: int, seed: int = 0) -> bytes:
    import random

    return random.Random(seed).randbytes(nbytes)


def fail_after(
    iterator: Iterator, count: int, error: Exception, *, once: threading.Event | None = None
) -> Iterator:
    """Yield ``count`` items of ``iterator``, then raise ``error`` (a broken stream); with
    ``once``, not before that event is set (the peer saw the stream: a stream cancelled before
    its first message left would test nothing)."""
    for i, item in enumerate(iterator):
        if i == count:
            if once is not None and not once.wait(30):
                raise TimeoutError("the peer never saw the stream before it was to break")
            raise error
        yield item

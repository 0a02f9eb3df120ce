"""The site's side of the wire: one channel to the coordinator, retries, resumable transfers.

Every call goes through ``_call``, which retries transient failures (UNAVAILABLE while the
coordinator restarts, a stream cut by the network, a deadline) with exponential backoff and
jitter, and gives up with ``CoordinatorUnreachableError`` after ``give_up_after_s`` without a
successful call. Statuses that mean "re-join" (stale session, not a member), "too late"
(wrong round) or "run over" become exceptions the agent's loop acts on; anything else is a
``SiteAgentError`` carrying the coordinator's message, which says what to change.

Transfers resume instead of restarting: an Upload whose stream broke asks ``UploadStatus`` which
chunks arrived and sends only the rest (a large upload goes over several parallel streams, see
``client_streams``); FetchModel and AwaitBroadcast keep a ``wire_assembly.Download``
across attempts and ask the coordinator to continue from the first missing chunk.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch

from geoloco.algorithms.privacy.secagg_stages import StageMessage
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import secagg_wire
from geoloco.protos.identity import new_instance_id
from geoloco.protos.protocol_version import PROTOCOL_VERSION
from geoloco.protos.transport_endpoints import client_channel, coordinator_stub
from geoloco.protos.transport_errors import error_reason
from geoloco.protos.transport_options import (
    HEARTBEAT_TIMEOUT_S,
    JOIN_TIMEOUT_S,
    LEAVE_TIMEOUT_S,
    SECURE_STAGE_TIMEOUT_S,
    UPLOAD_STATUS_TIMEOUT_S,
    transfer_timeout,
)
from geoloco.protos.transport_tls import TLSFiles, check_tls_files
from geoloco.protos.wire_assembly import Download, read_broadcast_stream, read_model_stream
from geoloco.protos.wire_buffers import IncompleteError, WireError
from geoloco.protos.wire_chunks import message_nbytes
from geoloco.protos.wire_manifests import blob_manifest
from geoloco.site_agent.backoff import Backoff, describe_error
from geoloco.site_agent.client_broadcast import ExtraStreams, OpenBroadcast, on_header
from geoloco.site_agent.client_retry import TRANSIENT_CODES, HandshakeWatch, TransientWireError, wire_retrying
from geoloco.site_agent.client_streams import (
    StreamChannels,
    StreamPlanner,
    run_streams,
    upload_in_streams,
)
from geoloco.site_agent.config import SiteAgentConfig
from geoloco.site_agent.connectivity import ConnectivityWatch, RoundTimer, backoff_cap, reconnect_options
from geoloco.site_agent.errors import (
    AgentStopped,
    CoordinatorUnreachableError,
    RejoinRequired,
    RoundClosed,
    RunFinished,
    SiteAgentError,
    SiteReplaced,
    TLSSetupError,
    UpdateRejected,
)

__all__ = [
    "AgentStopped",
    "CoordinatorClient",
    "CoordinatorUnreachableError",
    "RejoinRequired",
    "RoundClosed",
    "RunFinished",
    "SiteAgentError",
    "SiteReplaced",
    "TLSSetupError",
    "UpdateRejected",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

def _software_version() -> str:
    try:
        return "geoloco " + importlib.metadata.version("geoloco")
    except importlib.metadata.PackageNotFoundError:
        return "geoloco (not installed)"


SOFTWARE_VERSION = _software_version()
"""Sent in Join, for the coordinator's log."""


@dataclass(slots=True)
class TransferStats:
    """Serialized message bytes received, for the round's metrics (bytes sent are the
    uploads' own sizes)."""

    received: int = 0
    broadcast_header_s: float = 0.0
    """``time.monotonic()`` when the latest AwaitBroadcast header arrived (the end of the
    site's ``wait`` phase, the start of its ``download``)."""


class CoordinatorClient:
    """A site's connection to the coordinator (used from the agent's thread and its heartbeat
    thread; the channel is thread-safe, the session id is read atomically).

    Every request carries ``instance_id``, the site process's random id: the coordinator lets
    one process hold a site name at a time, and a process another one replaced gets
    ``SiteReplaced`` from any call (``geoloco.coordinator.membership``).
    """

    def __init__(
        self,
        target: str,
        *,
        site: str,
        tls: TLSFiles | None,
        insecure: bool,
        config: SiteAgentConfig,
        stop_event: threading.Event,
        server_name: str | None = None,
        interceptors: Iterable[Any] = (),
        instance_id: str | None = None,
    ) -> None:
        """``instance_id``: this site process's id (``JoinRequest.instance_id``); every client
        of one process must share it (``geoloco site``'s probe and its agent, a sharded site's
        ranks), or each would replace the others at the coordinator. None: a new random one."""
        if tls is not None:  # a certificate of another CA is named before anything is dialled
            try:
                check_tls_files(tls, name=site)
            except ValueError as err:
                raise TLSSetupError(str(err)) from None
        self.target = target
        self.site = site
        self.instance_id = instance_id or new_instance_id()
        self.config = config
        self._stop = stop_event
        channel = client_channel(
            target, tls=tls, insecure=insecure, server_name=server_name,
            extra_options=reconnect_options(config),
        )
        interceptors = list(interceptors)

        def intercept(raw: grpc.Channel) -> grpc.Channel:
            return grpc.intercept_channel(raw, *interceptors) if interceptors else raw

        self._channel = intercept(channel)
        self._stream_channels = StreamChannels(
            target, tls=tls, insecure=insecure, server_name=server_name,
            extra_options=reconnect_options(config), intercept=intercept,
        )
        """Channels of the 2nd..Kth stream of a parallel upload (``client_streams``)."""
        self._raw_channel = channel
        self._stub = coordinator_stub(self._channel)
        self._handshakes = HandshakeWatch(target, tls=tls, insecure=insecure, server_name=server_name, name=site)
        """Names a TLS mistake behind failed connections and stops the retries it makes futile."""
        self.session_id: str = ""
        self.shard: pb.ShardRef | None = None
        """Set on the client of one rank of a sharded site (``geoloco.site_agent.sharded``):
        uploads name that shard and downloads ask for its rows; None: the whole model."""
        self.stats = TransferStats()
        self._active_calls: set[Any] = set()
        self._lock = threading.Lock()
        self._interrupting = 0
        """``interrupting()`` bodies running: while > 0 every call ends at once (AgentStopped)."""
        self.connectivity = ConnectivityWatch(channel, stop_event)
        """Wakes retry sleeps when the path to the coordinator comes back."""
        self._last_delta_bytes = 0
        """Size of the last broadcast delta (``auto`` picks the next one's K from it)."""
        self.streams = StreamPlanner(config.parallel_streams)
        """K of each transfer; ``auto`` from measured throughput (``client_streams``)."""
        self.round_timer = RoundTimer()
        """The round time seen (between broadcasts): retries are a fraction of it apart."""

    # ---------------------------------------------------------------------------------------
    # Error handling and retries

    def _classify(self, error: grpc.RpcError) -> Exception | None:
        """The agent-level exception for a non-transient error, or None to retry."""
        code = error.code()
        if code == grpc.StatusCode.CANCELLED and self._halted:
            return AgentStopped()
        reason = error_reason(error)
        if reason == pb.ERROR_REASON_SITE_REPLACED:
            return SiteReplaced(error.details() or describe_error(error))
        if reason in (pb.ERROR_REASON_STALE_SESSION, pb.ERROR_REASON_NOT_A_MEMBER):
            return RejoinRequired(describe_error(error))
        if reason == pb.ERROR_REASON_RUN_FINISHED:
            return RunFinished(describe_error(error))
        if reason in (pb.ERROR_REASON_WRONG_ROUND, pb.ERROR_REASON_MANIFEST_CONFLICT):
            # Too late, or the round already holds another update from this site (sent before
            # a restart of this process): either way the round's broadcast settles it.
            return RoundClosed(describe_error(error))
        if code in TRANSIENT_CODES:
            return self._handshakes.failed(error)
        if code == grpc.StatusCode.INVALID_ARGUMENT and reason == pb.ERROR_REASON_BAD_MANIFEST:
            return UpdateRejected(describe_error(error))
        return SiteAgentError(f"the coordinator at {self.target} refused the request: {describe_error(error)}")

    def _sleep(self, seconds: float, since: int | None) -> None:
        self.connectivity.sleep(seconds, since=since)
        if self._halted:
            raise AgentStopped()

    def backoff_cap(self) -> float:
        """The longest pause between retries now (``connectivity.backoff_cap``)."""
        return backoff_cap(self.config, self.round_timer.round_time_s)

    def _backoff(self, what: str) -> Backoff:
        return Backoff(
            what, config=self.config, target=self.target, classify=self._classify, sleep=self._sleep,
            cap=self.backoff_cap, ready_mark=lambda: self.connectivity.ready_count,
        )

    def _call(self, what: str, attempt: Callable[[], T], backoff: Backoff | None = None) -> T:
        """Run ``attempt`` until it succeeds, retrying transient failures with backoff."""
        backoff = backoff or self._backoff(what)
        while True:
            if self._halted:
                raise AgentStopped()
            backoff.attempting()
            try:
                result = attempt()
            except grpc.RpcError as error:
                backoff.failed(error)
                continue
            self._handshakes.succeeded()
            return result

    @property
    def _halted(self) -> bool:
        """The agent stops, or an ``interrupting()`` body runs: no call may start or be retried."""
        return self._stop.is_set() or self._interrupting > 0

    def _track(self, call: Any) -> Any:
        # Checked under the lock that cancel_active_calls and interrupting() take: a call that
        # starts just after they cancelled the active ones is cancelled here, not left to block.
        with self._lock:
            self._active_calls.add(call)
            cancel = self._halted
        if cancel:
            call.cancel()
        return call

    def _untrack(self, call: Any) -> None:
        with self._lock:
            self._active_calls.discard(call)

    def cancel_active_calls(self) -> None:
        """Cancel blocking streams (used by ``SiteAgent.stop``)."""
        with self._lock:
            calls = list(self._active_calls)
        for call in calls:
            call.cancel()

    @contextlib.contextmanager
    def interrupting(self) -> Iterator[None]:
        """While the body runs, every call of this client ends with ``AgentStopped``: those in
        flight (cancelled, not retried) and those that start meanwhile. Stops the client's other
        threads (``AsyncRounds``' follower and uploader) without closing the client, which the
        agent goes on using: a plain cancel let a wait that started a moment later, or the retry
        of a cancelled one, block for good."""
        with self._lock:
            self._interrupting += 1
        try:
            self.cancel_active_calls()
            yield
        finally:
            with self._lock:
                self._interrupting -= 1

    def _counted(self, responses: Iterator[Any]) -> Iterator[Any]:
        for response in responses:
            with self._lock:  # parallel download streams count into one total
                self.stats.received += message_nbytes(response)
            yield response

    def _header_stamped(self, responses: Iterator[Any]) -> Iterator[Any]:
        for response in responses:
            if response.WhichOneof("kind") == "header":
                self.stats.broadcast_header_s = time.monotonic()
            yield response

    # ---------------------------------------------------------------------------------------
    # Unary calls

    def join(self, *, has_weights: bool, weights_round: int, digest_hex: str | None) -> pb.JoinResponse:
        request = pb.JoinRequest(
            site=self.site,
            protocol_version=PROTOCOL_VERSION,
            software_version=SOFTWARE_VERSION,
            has_weights=has_weights,
            weights_round=weights_round,
            instance_id=self.instance_id,
        )
        if digest_hex is not None:
            request.weights_digest.CopyFrom(
                pb.Checksum(algorithm=pb.CHECKSUM_ALGORITHM_SHA256, digest=bytes.fromhex(digest_hex))
            )
        response: pb.JoinResponse = self._call(
            "Join", lambda: self._stub.Join(request, timeout=JOIN_TIMEOUT_S)
        )
        self.session_id = response.session_id
        return response

    def heartbeat(self, *, round_number: int, phase: pb.SitePhase, inner_steps_done: int) -> pb.HeartbeatResponse:
        """One attempt (the heartbeat thread simply tries again at its next tick)."""
        return self._stub.Heartbeat(
            pb.HeartbeatRequest(
                site=self.site,
                session_id=self.session_id,
                round=round_number,
                phase=phase,
                inner_steps_done=inner_steps_done,
                instance_id=self.instance_id,
            ),
            timeout=HEARTBEAT_TIMEOUT_S,
        )

    def leave(self, reason: str) -> None:
        """Best effort: a coordinator that is gone drops the site by heartbeat timeout anyway."""
        try:
            self._stub.Leave(
                pb.LeaveRequest(
                    site=self.site, session_id=self.session_id, reason=reason, instance_id=self.instance_id
                ),
                timeout=LEAVE_TIMEOUT_S,
            )
        except grpc.RpcError as error:
            logger.info("Leave failed (%s); the coordinator will time this site out", describe_error(error))

    # ---------------------------------------------------------------------------------------
    # FetchModel

    def fetch_model(self, numel: int) -> tuple[pb.ModelManifest, torch.Tensor]:
        """The current global weights (a new CPU fp32 tensor), resuming broken downloads; with
        ``shard`` set, only that shard's ``numel`` rows (``ModelManifest.shard_rows``)."""
        weights = torch.empty(numel, dtype=torch.float32)

        def out_factory(blob: pb.BlobManifest) -> torch.Tensor:
            if blob.total_bytes != numel * 4 or blob.dtype != "float32":
                raise SiteAgentError(
                    f"the coordinator serves {blob.total_bytes} bytes of {blob.dtype} weights but "
                    f"this site's model has {numel} float32 parameters; use the same model class"
                    + ("" if self.shard is None else " (and a coordinator that serves a rank's rows: this version)")
                )
            return weights.view(torch.uint8)

        streams = self.streams.for_download(numel * 4)
        download = Download(max_total_bytes=numel * 4, out_factory=out_factory, parallel=streams > 1)
        timeout = transfer_timeout(-(-numel * 4 // streams), min_bytes_per_s=self.config.min_transfer_rate)
        manifests: list[pb.ModelManifest] = []

        def stream(residue: int) -> None:
            """One of ``streams`` strided calls (``chunk_stride``), resuming its own share."""
            if streams == 1:
                start, digest = download.resume_point()
            else:
                first, digest = download.stream_resume_point(residue, streams)
                if first is None:
                    return  # this stream's share arrived whole before
                start = first
            request = pb.FetchModelRequest(
                site=self.site, session_id=self.session_id, start_chunk=start,
                chunk_stride=streams if streams > 1 else 0,  # absent: what older coordinators know
                shard=self.shard, instance_id=self.instance_id,
            )
            if digest is not None:
                request.expect_digest.CopyFrom(digest)
            stub = self._stub if residue == 0 else self._stream_channels.stubs(residue)[residue - 1]
            call = self._track(stub.FetchModel(request, timeout=timeout))
            try:
                manifests.append(read_model_stream(self._counted(call), download))
            finally:
                self._untrack(call)

        def attempt() -> pb.ModelManifest:
            run_streams([functools.partial(self._call, f"FetchModel stream {r}", wire_retrying(
                functools.partial(stream, r))) for r in range(streams)])
            try:
                download.result()
            except IncompleteError as error:  # the weights changed between streams: resume
                raise TransientWireError(error) from None
            except WireError as error:  # checksum mismatch: start over
                download.assembler = None
                raise TransientWireError(error) from None
            blob = download.assembler.manifest if download.assembler is not None else None
            return next((m for m in reversed(manifests) if m.blob == blob), manifests[-1])

        started = time.perf_counter()
        manifest = self._call("FetchModel", wire_retrying(attempt))
        if len(manifests) == streams:  # one call per stream: nothing was resumed
            self.streams.downloaded(streams, numel * 4, time.perf_counter() - started)
        return manifest, weights

    # ---------------------------------------------------------------------------------------
    # Upload

    def upload(
        self,
        *,
        round_number: int,
        data: bytes,
        codec: str,
        shape: list[int],
        sample_weight: float,
        metrics: dict[str, float],
        inner_steps: int = 0,
        dtype: str = "float32",
        chunk_size: int | None = None,
        fragment: int = 0,
    ) -> pb.UploadResponse:
        """Upload one encoded update for ``round_number``; resumes a broken stream.

        ``fragment``: the Streaming DiLoCo fragment the update covers (0 = the whole model).
        With ``shard`` set (a sharded site's rank) the manifest names that shard.

        Raises ``RoundClosed`` when the round closed before the upload completed, and
        ``UpdateRejected`` when the coordinator refused its content. ``dtype`` and ``chunk_size``
        differ from the defaults only for masked (secure-aggregation) uploads, whose wire chunks
        must be exactly the protocol's chunks.
        """
        manifest = pb.UploadManifest(
            site=self.site,
            session_id=self.session_id,
            round=round_number,
            fragment=fragment,
            sample_weight=sample_weight,
            blob=blob_manifest(
                data, codec=codec, shape=shape, dtype=dtype, chunk_size=chunk_size or self.config.chunk_size
            ),
            metrics=metrics,
            inner_steps=inner_steps,
            instance_id=self.instance_id,
        )
        if self.shard is not None:
            manifest.shard_index, manifest.shard_count = self.shard.index, self.shard.count
            manifest.shard_split = self.shard.split
        num_chunks = manifest.blob.num_chunks
        streams = self.streams.for_upload(len(data), num_chunks)
        started = time.perf_counter()
        # Each of K streams carries about 1/K of the bytes: its deadline follows its share.
        timeout = transfer_timeout(-(-len(data) // streams), min_bytes_per_s=self.config.min_transfer_rate)
        missing: list[tuple[int, int]] | None = None
        backoff = self._backoff(f"Upload for round {round_number}")
        for attempt_index in range(self.config.max_upload_attempts):
            if self._halted:
                raise AgentStopped()
            backoff.attempting()
            try:
                response = upload_in_streams(
                    self._stub, self._stream_channels, manifest, data,
                    missing if missing is not None else [(0, num_chunks)], streams=streams, timeout=timeout,
                )
                if response.complete:
                    if attempt_index == 0:  # a whole transfer, nothing resumed: a measurement
                        self.streams.uploaded(streams, len(data), time.perf_counter() - started)
                    return response
            except grpc.RpcError as error:
                backoff.failed(error)  # raises what retrying cannot fix; sleeps otherwise
            # Broken or incomplete stream: ask what arrived and send only the rest.
            status = self._call("UploadStatus", lambda: self._upload_status(round_number, fragment))
            backoff.alive()  # the coordinator answers: the give-up clock starts again
            # The coordinator knows an upload by site, round and fragment; another update of the
            # same round (an asynchronous site's two updates from one base version) is not this one.
            other = status.known and status.HasField("manifest") and (
                status.manifest.blob.checksum != manifest.blob.checksum
            )
            if status.complete and not other:
                response = pb.UploadResponse(
                    complete=True, received_bytes=len(data), folded_late=status.folded_late
                )
                if status.HasField("merged_round"):
                    response.merged_round = status.merged_round
                return response
            missing = [(r.start, r.end) for r in status.missing] if status.known and not other else None
            logger.info(
                "upload for round %d incomplete after stream %d; resending %s",
                round_number, attempt_index + 1,
                "everything" if missing is None else f"{sum(e - s for s, e in missing)} chunks",
            )
        raise SiteAgentError(
            f"upload for round {round_number} still incomplete after {self.config.max_upload_attempts} "
            "streams; the link is too unreliable, or raise max_upload_attempts"
        )

    def _upload_status(self, round_number: int, fragment: int = 0) -> pb.UploadStatusResponse:
        return self._stub.UploadStatus(
            pb.UploadStatusRequest(
                site=self.site, session_id=self.session_id, round=round_number, fragment=fragment,
                instance_id=self.instance_id,
            ),
            timeout=UPLOAD_STATUS_TIMEOUT_S,
        )

    # ---------------------------------------------------------------------------------------
    # SecureStage

    def secure_stage(
        self, round_number: int, stage: str, message: StageMessage, *, wait_ms: int = 1000
    ) -> tuple[StageMessage, str]:
        """One secure-aggregation stage: ``(reply, abort reason or "")`` once it closes; the
        messages are ``geoloco.algorithms.privacy.secagg_stages`` dataclasses (``secagg_wire`` translates).

        The coordinator holds each call up to ``wait_ms``; an open stage is simply asked again
        (stage calls are idempotent), and a transient failure is retried like any call.
        """
        request = secagg_wire.stage_request(
            stage, message, site=self.site, session_id=self.session_id, round_number=round_number,
            wait_ms=wait_ms,
        )
        request.instance_id = self.instance_id
        backoff = self._backoff(f"SecureStage {stage} of round {round_number}")
        while True:
            response: pb.SecureStageResponse = self._call(
                "SecureStage", lambda: self._stub.SecureStage(request, timeout=SECURE_STAGE_TIMEOUT_S), backoff
            )
            self.stats.received += message_nbytes(response)
            backoff.alive()
            if response.aborted:
                return None, response.abort_reason or "aborted"
            if response.ready:
                return secagg_wire.reply_message(stage, response), ""

    # ---------------------------------------------------------------------------------------
    # AwaitBroadcast

    def _await_call(
        self, round_number: int, start_chunk: int, stride: int = 1, stub: Any = None, withheld: str = ""
    ) -> Any:
        request = pb.AwaitBroadcastRequest(
            site=self.site, session_id=self.session_id, round=round_number, start_chunk=start_chunk,
            chunk_stride=stride if stride > 1 else 0,  # absent: what older coordinators know
            shard=self.shard, instance_id=self.instance_id, withheld=withheld,
        )
        stub = stub if stub is not None else self._stub
        return self._track(stub.AwaitBroadcast(request, timeout=self.config.await_timeout_s))

    def open_broadcast(self, round_number: int) -> OpenBroadcast:
        """Start waiting for round ``round_number``'s broadcast now, before uploading to it.

        The request then travels ahead of the upload, so the broadcast leaves the coordinator the
        moment the round closes instead of one round trip later, when a site that asked only after
        its upload's response would have reached it. Pass the result to ``await_broadcast``, or
        ``cancel`` it when the upload fails.
        """
        mark = self.connectivity.ready_count
        stride = self.streams.for_broadcast(self._last_delta_bytes)
        return OpenBroadcast(
            round_number, self._await_call(round_number, 0, stride), release=self._untrack, ready_mark=mark,
            stride=stride,
        )

    def await_broadcast(
        self,
        round_number: int,
        *,
        on_progress: Callable[[pb.RoundProgress], None] | None = None,
        opened: OpenBroadcast | None = None,
        withheld: str = "",
    ) -> tuple[pb.BroadcastHeader, memoryview | None]:
        """Wait for round ``round_number``'s broadcast: (header, encoded delta bytes or None).
        ``withheld``: this site sends no update to the round, and why (the round stops waiting
        for it; every attempt says so again, which the coordinator takes once).

        The bytes are a view of the download's own buffer (checksum-verified), not a copy: a
        256 MiB delta is not copied once more on its way to the decoder.

        ``opened`` is a wait started earlier by ``open_broadcast``; it serves the first attempt,
        and retries open fresh calls that resume the download where it broke.
        """
        if opened is not None and opened.round != round_number:
            raise ValueError(
                f"the open broadcast wait is for round {opened.round}, not round {round_number}"
            )
        streams = opened.stride if opened is not None else self.streams.for_broadcast(self._last_delta_bytes)
        download = Download(parallel=streams > 1)
        backoff = self._backoff(f"AwaitBroadcast for round {round_number}")
        first = opened.take() if opened is not None else None
        first_mark = opened.ready_mark if opened is not None else None

        def progress(message: pb.RoundProgress) -> None:
            backoff.alive()  # a round may take longer than give_up_after_s; progress is contact
            if on_progress is not None:
                on_progress(message)

        def share(residue: int) -> None:
            """Stream ``residue`` of ``streams`` (1..K-1), opened once the header is known."""

            def once() -> None:
                start, _ = download.stream_resume_point(residue, streams)
                if start is None:
                    return
                stub = self._stream_channels.stubs(residue)[residue - 1]
                call = self._await_call(round_number, start, streams, stub)
                try:
                    read_broadcast_stream(self._counted(call), download)
                finally:
                    self._untrack(call)

            self._call(f"AwaitBroadcast stream {residue}", wire_retrying(once))

        attempts = 0

        def attempt() -> tuple[pb.BroadcastHeader, memoryview | None]:
            nonlocal first, attempts
            attempts += 1
            header_at: list[float] = []

            def header_arrived(header: pb.BroadcastHeader) -> None:
                header_at.append(time.perf_counter())
                extra.start(header)

            if first is not None:
                # Opened before the upload: a path that came back since then must count.
                call, first = first, None
                backoff.attempting(since=first_mark)
            else:
                start, _ = download.resume_point()
                if streams > 1:
                    own, _ = download.stream_resume_point(0, streams)
                    start = own if own is not None else start
                call = self._await_call(round_number, start, streams, withheld=withheld)
            extra = ExtraStreams(streams, share)
            try:
                responses = on_header(self._header_stamped(self._counted(call)), header_arrived)
                header = read_broadcast_stream(responses, download, on_progress=progress)
            finally:
                self._untrack(call)
                extra.join()
            if header.action != pb.BROADCAST_ACTION_APPLY_DELTA:
                return header, None
            self._last_delta_bytes = header.delta.total_bytes
            try:
                data = download.result()
            except IncompleteError as error:
                raise TransientWireError(error) from None
            except WireError as error:
                download.assembler = None
                raise TransientWireError(error) from None
            if attempts == 1 and header_at:  # header to verified bytes: not the round's wait
                self.streams.downloaded(streams, len(data), time.perf_counter() - header_at[0])
            return header, data

        answer = self._call("AwaitBroadcast", wire_retrying(attempt), backoff)
        self.round_timer.broadcast_received()
        return answer

    def close(self) -> None:
        self.cancel_active_calls()
        self.connectivity.close()
        self._stream_channels.close()
        self._raw_channel.close()

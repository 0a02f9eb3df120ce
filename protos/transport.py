"""gRPC plumbing in one place: options, deadlines, TLS, servers, channels, identity, errors.

Every gRPC option geoloco sets lives here with the reason for it, so the coordinator and the
site agent cannot drift apart. Servers bind port 0 by default and report the bound port.

Security. With TLS the server requires a client certificate signed by the run's CA and the
site name comes from that certificate (``geoloco.protos.identity``). Plain text exists only
behind an explicit ``insecure=True`` (the CLI's ``--insecure``), for local runs; the site name
is then whatever the request's ``site`` field says.

Throughput (see ``benchmarks/bench_transfer.py``). Two things matter for chunk streams:

* Copies. protobuf's Python runtimes copy a bytes field when a message is built, serialized,
  parsed and read. ``coordinator_stub`` and ``add_coordinator_servicer`` register the chunk
  fast path (``wire.MessageCodec``): chunk messages are written and read by hand, one copy per
  side, while every byte on the wire stays plain protobuf (peers using the bare generated code
  interoperate). Use them instead of the generated ``CoordinatorStub`` /
  ``add_CoordinatorServicer_to_server``.
* Fresh buffers. gRPC allocates a new buffer per message; glibc serves allocations above its
  mmap threshold with fresh mmaps, whose page faults cost more than the copy itself. The
  ``MALLOC_TUNABLES`` keep chunk-sized buffers on the heap. glibc reads ``GLIBC_TUNABLES`` only at
  process start, so launchers pass ``recommended_env()`` to the processes they start (the
  emulator), and the CLI entry points of long-running processes (``geoloco coordinator``,
  ``geoloco site``) call ``reexec_with_malloc_tunables()`` first, which re-executes the
  interpreter once with the variable set.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import grpc

from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import geoloco_pb2_grpc as pb_grpc
from geoloco.protos import wire
from geoloco.protos.errors import IdentityError, StatusError
from geoloco.protos.identity import site_from_uri, validate_site_name
from geoloco.protos.wire import MAX_CHUNK_SIZE, MiB

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
"""``geoloco.v1.Coordinator``."""

# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------

MAX_MESSAGE_BYTES = MAX_CHUNK_SIZE + 12 * MiB
"""Largest single message either side sends or accepts (16 MiB). Big buffers are chunked, so
this only has to fit one chunk (``MAX_CHUNK_SIZE``) plus framing, and the largest non-chunk
message: a JoinResponse whose ModelLayout lists every parameter (~50 bytes each, so 12 MiB of
headroom covers models with ~200k named tensors). gRPC's default receive limit of 4 MiB would
refuse a 4 MiB chunk plus its framing."""

KEEPALIVE_TIME_MS = 30_000
"""Ping an idle connection every 30 s: AwaitBroadcast can block for a whole round, and NATs and
firewalls between data centers drop silent TCP connections after a few minutes; pings also
detect a dead peer long before the TCP timeout (~15 min)."""

KEEPALIVE_TIMEOUT_MS = 10_000
"""A ping unanswered this long closes the connection (calls fail UNAVAILABLE and are retried)."""

MIN_PING_INTERVAL_MS = 10_000
"""Servers accept client pings this often (gRPC's default 5 min would answer our 30 s pings with
GOAWAY "too_many_pings"); must stay below KEEPALIVE_TIME_MS."""

RECONNECT_BACKOFF_INITIAL_MS = 500
RECONNECT_BACKOFF_MAX_MS = 10_000
"""Reconnect quickly after a coordinator restart (gRPC's default max backoff is 2 min)."""

RETRY_METHODS = ("Join", "Heartbeat", "UploadStatus", "Leave")
"""Unary, idempotent RPCs that gRPC itself retries on UNAVAILABLE (a restarting coordinator);
the streaming RPCs resume at the application level (UploadStatus, start_chunk)."""

_RETRY_POLICY = {
    "maxAttempts": 5,
    "initialBackoff": "0.2s",
    "maxBackoff": "5s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}

SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": SERVICE_NAME, "method": m} for m in RETRY_METHODS],
                "retryPolicy": _RETRY_POLICY,
            }
        ]
    }
)

_COMMON_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # Keep pinging while a call is open but silent (a blocked AwaitBroadcast); the default (2)
    # stops pinging after two pings without data.
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
)

SERVER_OPTIONS: tuple[tuple[str, Any], ...] = _COMMON_OPTIONS + (
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    # A second coordinator on the same port must fail to bind, not silently share the traffic.
    ("grpc.so_reuseport", 0),
)
"""Options of every geoloco gRPC server. No message compression anywhere: payloads are already
compressed (or are fp32 noise that gzip barely shrinks), so gzip would only burn CPU. HTTP/2
flow control keeps its default BDP probing, which sizes windows to each link's
bandwidth-delay product on long WAN paths."""

CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = _COMMON_OPTIONS + (
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_INITIAL_MS),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS),
    ("grpc.enable_retries", 1),
    ("grpc.service_config", SERVICE_CONFIG),
)
"""Options of every site -> coordinator channel."""

# ---------------------------------------------------------------------------------------------
# Deadlines (seconds)
# ---------------------------------------------------------------------------------------------

JOIN_TIMEOUT_S = 30.0
"""Join may wait for the coordinator to load a checkpoint after a restart."""
HEARTBEAT_TIMEOUT_S = 10.0
UPLOAD_STATUS_TIMEOUT_S = 10.0
LEAVE_TIMEOUT_S = 10.0
SECURE_STAGE_TIMEOUT_S = 15.0
"""Deadline of one SecureStage call (the coordinator holds it at most about a second)."""
CONNECT_TIMEOUT_S = 30.0
"""How long ``wait_for_channel`` waits for the first connection."""

TRANSFER_BASE_S = 30.0
"""Fixed allowance of every streaming transfer (connection, manifest, checksum)."""
DEFAULT_MIN_TRANSFER_RATE = 1_000_000
"""Bytes/s below which a transfer counts as stuck (8 Mbit/s). Emulated slow links should pass
their own rate to ``transfer_timeout``."""

SHUTDOWN_GRACE_S = 5.0
"""On shutdown, running RPCs get this long to finish before they are cancelled. An upload cut
off here resumes after the restart (UploadStatus), so a short grace loses nothing."""


def transfer_timeout(nbytes: int, *, min_bytes_per_s: float = DEFAULT_MIN_TRANSFER_RATE) -> float:
    """Deadline for streaming ``nbytes``: a fixed allowance plus the time at the slowest
    acceptable rate."""
    if min_bytes_per_s <= 0:
        raise ValueError(f"min_bytes_per_s must be positive, got {min_bytes_per_s}")
    return TRANSFER_BASE_S + nbytes / min_bytes_per_s


def await_broadcast_timeout(
    round_deadline_s: float,
    delta_bytes: int,
    *,
    min_bytes_per_s: float = DEFAULT_MIN_TRANSFER_RATE,
) -> float:
    """Deadline for AwaitBroadcast: the rest of the round, then the delta's transfer."""
    return round_deadline_s + transfer_timeout(delta_bytes, min_bytes_per_s=min_bytes_per_s)


def server_workers(max_sites: int) -> int:
    """Thread-pool size for a coordinator expecting up to ``max_sites`` sites.

    A blocked AwaitBroadcast holds a worker thread for the whole round, and each site may have
    an Upload, a Heartbeat and a UploadStatus open beside it.
    """
    return 4 * max(1, max_sites) + 8


# ---------------------------------------------------------------------------------------------
# TLS material
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TLSFiles:
    """PEM files of one party: the run's CA and this party's certificate and key."""

    ca: Path
    """CA certificate that signed every party (``ca.crt``)."""
    cert: Path
    """This party's certificate (``NAME.crt``)."""
    key: Path
    """This party's private key (``NAME.key``)."""

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str], name: str) -> TLSFiles:
        """The files ``geoloco certs`` writes: DIR/ca.crt, DIR/NAME.crt and DIR/NAME.key."""
        directory = Path(directory)
        return cls(
            ca=directory / "ca.crt", cert=directory / f"{name}.crt", key=directory / f"{name}.key"
        )

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(ca, cert, key) bytes; a missing file says which and how to make it."""
        out = []
        for label, path in (
            ("CA certificate", self.ca),
            ("certificate", self.cert),
            ("key", self.key),
        ):
            try:
                out.append(Path(path).read_bytes())
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"TLS {label} {path} not found; create it with `geoloco certs init DIR` and "
                    "`geoloco certs issue DIR NAME`, or pass --insecure for a local plain-text run"
                ) from None
        return out[0], out[1], out[2]


def _check_mode(tls: TLSFiles | None, insecure: bool) -> None:
    if tls is None and not insecure:
        raise ValueError(
            "no TLS files given; pass TLS certificates (geoloco certs) or insecure=True "
            "(--insecure) for an unauthenticated plain-text connection"
        )
    if tls is not None and insecure:
        raise ValueError("both TLS files and insecure=True given; choose one")


# ---------------------------------------------------------------------------------------------
# Stub and servicer registration with the chunk fast path
# ---------------------------------------------------------------------------------------------

_METHODS: dict[str, tuple[str, type, type]] = {
    # name: (grpc cardinality, request type, response type)
    "Join": ("unary_unary", pb.JoinRequest, pb.JoinResponse),
    "FetchModel": ("unary_stream", pb.FetchModelRequest, pb.FetchModelResponse),
    "Upload": ("stream_unary", pb.UploadRequest, pb.UploadResponse),
    "UploadStatus": ("unary_unary", pb.UploadStatusRequest, pb.UploadStatusResponse),
    "AwaitBroadcast": ("unary_stream", pb.AwaitBroadcastRequest, pb.AwaitBroadcastResponse),
    "Heartbeat": ("unary_unary", pb.HeartbeatRequest, pb.HeartbeatResponse),
    "Leave": ("unary_unary", pb.LeaveRequest, pb.LeaveResponse),
    "SecureStage": ("unary_unary", pb.SecureStageRequest, pb.SecureStageResponse),
}
_CODECS: dict[type, wire.MessageCodec] = {
    pb.UploadRequest: wire.UPLOAD_REQUEST_CODEC,
    pb.FetchModelResponse: wire.FETCH_MODEL_RESPONSE_CODEC,
    pb.AwaitBroadcastResponse: wire.AWAIT_BROADCAST_RESPONSE_CODEC,
}


def _serializer(message_type: type) -> Callable[[Any], bytes]:
    codec = _CODECS.get(message_type)
    return codec.serialize if codec else message_type.SerializeToString


def _deserializer(message_type: type) -> Callable[[bytes], Any]:
    codec = _CODECS.get(message_type)
    return codec.deserialize if codec else message_type.FromString


def coordinator_stub(channel: grpc.Channel) -> pb_grpc.CoordinatorStub:
    """The generated ``CoordinatorStub`` with the chunk fast path for Upload, FetchModel and
    AwaitBroadcast: it sends ``wire.ChunkRef`` items and yields them for received chunks
    (see ``wire.ChunkRef``); every other message is plain protobuf. Use this, not the bare
    generated stub, with the ``wire`` senders."""
    stub = pb_grpc.CoordinatorStub(channel)
    for name, (cardinality, request_type, response_type) in _METHODS.items():
        multicallable = getattr(channel, cardinality)(
            f"/{SERVICE_NAME}/{name}",
            request_serializer=_serializer(request_type),
            response_deserializer=_deserializer(response_type),
        )
        setattr(stub, name, multicallable)
    return stub


def add_coordinator_servicer(servicer: pb_grpc.CoordinatorServicer, server: grpc.Server) -> None:
    """Register ``servicer`` like the generated ``add_CoordinatorServicer_to_server``, with the
    chunk fast path (Upload chunks arrive as ``wire.ChunkRef``; FetchModel/AwaitBroadcast
    handlers may yield ``ChunkRef``, as the ``wire`` senders do)."""
    handlers = {}
    for name, (cardinality, request_type, response_type) in _METHODS.items():
        factory = getattr(grpc, f"{cardinality}_rpc_method_handler")
        handlers[name] = factory(
            getattr(servicer, name),
            request_deserializer=_deserializer(request_type),
            response_serializer=_serializer(response_type),
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


# ---------------------------------------------------------------------------------------------
# Server
# ---------------------------------------------------------------------------------------------


def build_server(
    *,
    tls: TLSFiles | None,
    insecure: bool = False,
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 32,
    interceptors: Sequence[grpc.ServerInterceptor] | None = None,
    extra_options: Sequence[tuple[str, Any]] = (),
) -> tuple[grpc.Server, int]:
    """A not-yet-started gRPC server bound to ``host:port`` (0 = any free port) and the bound
    port. Register the servicer (``add_coordinator_servicer``), then ``server.start()``.

    With TLS, clients must present a certificate signed by ``tls.ca``, and the default
    interceptors also refuse certificates that name no site. Without explicit ``interceptors``
    the server gets ``default_interceptors(insecure)``.
    """
    _check_mode(tls, insecure)
    if interceptors is None:
        interceptors = default_interceptors(insecure=insecure)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="geoloco-grpc"),
        options=list(SERVER_OPTIONS) + list(extra_options),
        interceptors=list(interceptors),
    )
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if tls is None:
        bound = server.add_insecure_port(address)
        if bound:
            logger.warning(
                "gRPC server listening WITHOUT TLS on %s port %d (insecure mode)", host, bound
            )
    else:
        ca, cert, key = tls.read()
        credentials = grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=True
        )
        bound = server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"could not bind a gRPC server to {address}")
    return server, bound


def stop_server(server: grpc.Server, grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """Stop accepting calls, give running ones ``grace_s`` seconds, then cancel them."""
    server.stop(grace_s).wait(grace_s + 5.0)


# ---------------------------------------------------------------------------------------------
# Client
# ---------------------------------------------------------------------------------------------


def client_channel(
    target: str,
    *,
    tls: TLSFiles | None,
    insecure: bool = False,
    server_name: str | None = None,
    extra_options: Sequence[tuple[str, Any]] = (),
) -> grpc.Channel:
    """A channel to the coordinator at ``target`` (``host:port``).

    ``server_name`` overrides the name checked against the coordinator's certificate, for
    dialing an address that is not in it (a tunnel, a NAT'd IP, a shaped-link proxy).
    """
    _check_mode(tls, insecure)
    options = list(CHANNEL_OPTIONS) + list(extra_options)
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    ca, cert, key = tls.read()
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )
    return grpc.secure_channel(target, credentials, options=options)


def wait_for_channel(channel: grpc.Channel, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Block until the channel is connected; ``TimeoutError`` after ``timeout_s``."""
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        raise TimeoutError(
            f"could not connect to the coordinator within {timeout_s:.0f} s (wrong address, "
            "coordinator down, or a TLS handshake failure: check that both sides use "
            "certificates from the same CA)"
        ) from None


# ---------------------------------------------------------------------------------------------
# Identity
# ---------------------------------------------------------------------------------------------


def site_from_auth_context(
    auth_context: Mapping[str, Iterable[bytes]], *, allow_common_name: bool = False
) -> str | None:
    """The site a peer certificate names: its ``geoloco:site:NAME`` URI SAN (or, when
    ``allow_common_name``, a valid site name in its common name, for certificates from a PKI
    that cannot add URIs). None when the peer is not a site certificate."""
    names: set[str] = set()
    for key in ("peer_uri", "x509_subject_alternative_name"):
        for value in auth_context.get(key, ()):
            site = site_from_uri(value.decode("utf-8", "replace"))
            if site is not None:
                names.add(site)
    if len(names) > 1:
        raise IdentityError(
            f"peer certificate names several sites {sorted(names)}; issue one per site"
        )
    if names:
        return names.pop()
    if allow_common_name:
        for value in auth_context.get("x509_common_name", ()):
            try:
                return validate_site_name(value.decode("utf-8", "replace"))
            except ValueError:
                return None
    return None


def peer_site(context: grpc.ServicerContext, *, allow_common_name: bool = False) -> str | None:
    """The site named by the calling peer's certificate; None on a plain-text connection."""
    return site_from_auth_context(context.auth_context(), allow_common_name=allow_common_name)


def resolve_site(
    context: grpc.ServicerContext, claimed: str, *, insecure: bool, allow_common_name: bool = False
) -> str:
    """The caller's site name, which servicers use as identity.

    TLS: the certificate's name; ``claimed`` (a request's ``site`` field) must be empty or the
    same. Insecure: ``claimed`` itself, validated. Raises ``IdentityError``.
    """
    if insecure:
        if not claimed:
            raise IdentityError(
                "plain-text mode: the request must name its site in the `site` field",
                code=grpc.StatusCode.INVALID_ARGUMENT,
            )
        try:
            return validate_site_name(claimed)
        except ValueError as e:
            raise IdentityError(str(e), code=grpc.StatusCode.INVALID_ARGUMENT) from None
    site = peer_site(context, allow_common_name=allow_common_name)
    if site is None:
        raise IdentityError(
            "the client certificate names no site (expected a URI SAN geoloco:site:NAME); "
            "issue it with `geoloco certs issue DIR NAME`",
            code=grpc.StatusCode.UNAUTHENTICATED,
        )
    if claimed and claimed != site:
        raise IdentityError(
            f"request claims site {claimed!r} but the client certificate names {site!r}"
        )
    return site


# ---------------------------------------------------------------------------------------------
# Errors across the wire
# ---------------------------------------------------------------------------------------------

ERROR_REASON_KEY = "geoloco-error-reason"
"""Trailing-metadata key carrying the ``ErrorReason`` name of a failed call."""


def abort(
    context: grpc.ServicerContext, code: grpc.StatusCode, reason: int, message: str
) -> NoReturn:
    """End the call with ``code`` and ``message``, and ``reason`` in the trailing metadata."""
    if reason != pb.ERROR_REASON_UNSPECIFIED:
        context.set_trailing_metadata(((ERROR_REASON_KEY, pb.ErrorReason.Name(reason)),))
    context.abort(code, message)
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises


def abort_with(context: grpc.ServicerContext, error: StatusError) -> NoReturn:
    abort(context, error.code, error.reason, str(error))


def error_reason(error: grpc.RpcError) -> int:
    """The ``ErrorReason`` of a failed call (``ERROR_REASON_UNSPECIFIED`` when none was sent)."""
    trailing = getattr(error, "trailing_metadata", None)
    metadata = trailing() if callable(trailing) else None
    for key, value in metadata or ():
        if key == ERROR_REASON_KEY:
            try:
                return pb.ErrorReason.Value(value)
            except ValueError:
                logger.warning("unknown error reason %r from the peer", value)
    return pb.ERROR_REASON_UNSPECIFIED


def _log_and_abort(context: grpc.ServicerContext, error: StatusError, method: str) -> NoReturn:
    logger.info("%s -> %s %s: %s", method, error.code.name, error.reason_name, error)
    abort_with(context, error)


def _wrap_handler(
    handler: grpc.RpcMethodHandler,
    method: str,
    *,
    before: Callable[[grpc.ServicerContext], None] | None = None,
    map_errors: bool = False,
) -> grpc.RpcMethodHandler:
    """Rebuild ``handler`` so each call first runs ``before(context)`` and, with ``map_errors``,
    turns a ``StatusError`` raised by the handler -- or while its response stream is being
    produced -- into the matching status."""

    def guard_unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            if before is not None:
                before(context)
            if not map_errors:
                return behavior(request, context)
            try:
                return behavior(request, context)
            except StatusError as e:
                _log_and_abort(context, e, method)

        return call

    def guard_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
        def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            if before is not None:
                before(context)
            if not map_errors:
                yield from behavior(request, context)
                return
            try:
                yield from behavior(request, context)
            except StatusError as e:
                _log_and_abort(context, e, method)

        return call

    return rebuild_handler(handler, guard_unary, guard_stream)


def rebuild_handler(
    handler: grpc.RpcMethodHandler,
    wrap_unary_response: Callable[[Callable[..., Any]], Callable[..., Any]],
    wrap_stream_response: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> grpc.RpcMethodHandler:
    """The same handler with its behaviour wrapped: ``wrap_unary_response`` for RPCs that answer
    with one message, ``wrap_stream_response`` for those that answer with a stream (a generator).
    The one place that knows grpc's four handler kinds, for every server interceptor of ours."""
    kw = dict(
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap_unary_response(handler.unary_unary), **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(wrap_unary_response(handler.stream_unary), **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap_stream_response(handler.unary_stream), **kw)
    return grpc.stream_stream_rpc_method_handler(wrap_stream_response(handler.stream_stream), **kw)


class ErrorStatusInterceptor(grpc.ServerInterceptor):
    """Turns a ``StatusError`` escaping a handler into its status code + ``ErrorReason``, so
    servicers raise domain errors instead of calling ``context.abort`` by hand."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return _wrap_handler(handler, handler_call_details.method, map_errors=True)


class RequireSiteCertificateInterceptor(grpc.ServerInterceptor):
    """Refuses, before any servicer code runs, TLS peers whose certificate names no site.

    The TLS handshake already rejects certificates from other CAs; this catches certificates
    from the right CA that are not site certificates (and keeps the check out of every handler).
    """

    def __init__(self, *, allow_common_name: bool = False) -> None:
        self.allow_common_name = allow_common_name

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        def check(context: grpc.ServicerContext) -> None:
            try:
                site = peer_site(context, allow_common_name=self.allow_common_name)
            except IdentityError as e:
                _log_and_abort(context, e, method)
            if site is None:
                _log_and_abort(
                    context,
                    IdentityError(
                        "the client certificate names no site (expected a URI SAN "
                        "geoloco:site:NAME); issue it with `geoloco certs issue DIR NAME`",
                        code=grpc.StatusCode.UNAUTHENTICATED,
                    ),
                    method,
                )

        return _wrap_handler(handler, method, before=check)


def default_interceptors(*, insecure: bool) -> list[grpc.ServerInterceptor]:
    """Error mapping always; the site-certificate check with TLS."""
    interceptors: list[grpc.ServerInterceptor] = [ErrorStatusInterceptor()]
    if not insecure:
        interceptors.insert(0, RequireSiteCertificateInterceptor())
    return interceptors


# ---------------------------------------------------------------------------------------------
# Process environment (malloc tunables)
# ---------------------------------------------------------------------------------------------

MALLOC_TUNABLES = {
    # Serve allocations up to 32 MiB from the heap instead of fresh mmaps (page faults).
    "glibc.malloc.mmap_threshold": "33554432",
    # Do not give freed heap memory back to the kernel below 1 GiB, so it is reused warm.
    "glibc.malloc.trim_threshold": "1073741824",
}
_REEXEC_MARK = "GEOLOCO_MALLOC_REEXEC"


def _is_glibc() -> bool:
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def _merge_tunables(existing: str) -> str:
    """Add our tunables to a GLIBC_TUNABLES string, keeping any the user set explicitly."""
    items = [p for p in existing.split(":") if p]
    keys = {p.split("=", 1)[0] for p in items}
    items += [f"{k}={v}" for k, v in MALLOC_TUNABLES.items() if k not in keys]
    return ":".join(items)


def recommended_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: ``os.environ``) plus ``GLIBC_TUNABLES`` for fast chunk buffers.

    Pass it as ``env=`` to every coordinator/site process a launcher starts; it has no effect
    on an already running process. Harmless on non-glibc systems (the variable is ignored).
    """
    env = dict(os.environ if base is None else base)
    env["GLIBC_TUNABLES"] = _merge_tunables(env.get("GLIBC_TUNABLES", ""))
    return env


def malloc_tunables_active() -> bool:
    """Whether this process was started with our tunables (or explicit values for them)."""
    current = os.environ.get("GLIBC_TUNABLES", "")
    keys = {p.split("=", 1)[0] for p in current.split(":") if p}
    return all(k in keys for k in MALLOC_TUNABLES)


def reexec_with_malloc_tunables(argv: Sequence[str] | None = None) -> None:
    """Re-execute this Python process with the malloc tunables set, once; returns only when
    nothing needs doing (already set, not glibc, or already re-executed).

    Call it first thing in the entry point of a long-running transfer process (before threads
    or gRPC start). ``GEOLOCO_NO_MALLOC_REEXEC=1`` disables it.
    """
    if (
        malloc_tunables_active()
        or not _is_glibc()
        or os.environ.get(_REEXEC_MARK)
        or os.environ.get("GEOLOCO_NO_MALLOC_REEXEC")
    ):
        return
    env = recommended_env()
    env[_REEXEC_MARK] = "1"
    args = list(sys.orig_argv if argv is None else argv)
    logger.debug("re-executing with GLIBC_TUNABLES=%s", env["GLIBC_TUNABLES"])
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *args[1:]], env)

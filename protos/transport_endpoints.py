"""Both ends of a gRPC connection to the coordinator: stub and servicer registration, servers, channels.

Servers bind port 0 by default and report the bound port. ``build_server`` and
``client_channel`` apply the options of ``geoloco.protos.transport_options``, the TLS material of
``geoloco.protos.transport_tls`` (mutual TLS, or plain text only behind an explicit
``insecure=True``) and the interceptors of ``geoloco.protos.transport_errors``.

Copies (see ``benchmarks/bench_transfer.py``). protobuf's Python runtimes copy a bytes field
when a message is built, serialized, parsed and read. ``coordinator_stub`` and
``add_coordinator_servicer`` register the chunk fast path (``wire_chunks.MessageCodec``): chunk
messages are written and read by hand, one copy per side, while every byte on the wire stays
plain protobuf (peers using the bare generated code interoperate). Use them instead of the
generated ``CoordinatorStub`` / ``add_CoordinatorServicer_to_server``. The other half of chunk
throughput, glibc's fresh buffers, is ``geoloco.protos.transport_malloc``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import grpc
from google.protobuf.message import Message

from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import geoloco_pb2_grpc as pb_grpc
from geoloco.protos.transport_errors import (
    checked_requests,
    default_interceptors,
    single_request,
    tolerant_deserializer,
)
from geoloco.protos.transport_options import (
    CHANNEL_OPTIONS,
    CONNECT_TIMEOUT_S,
    SERVER_OPTIONS,
    SERVICE_NAME,
    SHUTDOWN_GRACE_S,
)
from geoloco.protos.transport_tls import TLSFiles, check_mode
from geoloco.protos.wire_chunks import (
    AWAIT_BROADCAST_RESPONSE_CODEC,
    FETCH_MODEL_RESPONSE_CODEC,
    UPLOAD_REQUEST_CODEC,
    MessageCodec,
)

logger = logging.getLogger(__name__)

__all__ = [
    "add_coordinator_servicer",
    "build_server",
    "channel_options",
    "client_channel",
    "coordinator_stub",
    "stop_server",
    "wait_for_channel",
]


# ---------------------------------------------------------------------------------------------
# Stub and servicer registration with the chunk fast path
# ---------------------------------------------------------------------------------------------

_METHODS: dict[str, tuple[str, type[Message], type[Message]]] = {
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
_CODECS: dict[type[Message], MessageCodec] = {
    pb.UploadRequest: UPLOAD_REQUEST_CODEC,
    pb.FetchModelResponse: FETCH_MODEL_RESPONSE_CODEC,
    pb.AwaitBroadcastResponse: AWAIT_BROADCAST_RESPONSE_CODEC,
}


def _serializer(message_type: type[Message]) -> Callable[[Any], bytes]:
    codec = _CODECS.get(message_type)
    return codec.serialize if codec else message_type.SerializeToString


def _deserializer(message_type: type[Message]) -> Callable[[bytes], Any]:
    codec = _CODECS.get(message_type)
    return codec.deserialize if codec else message_type.FromString


def coordinator_stub(channel: grpc.Channel) -> pb_grpc.CoordinatorStub:
    """The generated ``CoordinatorStub`` with the chunk fast path for Upload, FetchModel and
    AwaitBroadcast: it sends ``wire_chunks.ChunkRef`` items and yields them for received chunks
    (see ``wire_chunks.ChunkRef``); every other message is plain protobuf. Use this, not the bare
    generated stub, with the ``wire_chunks`` senders."""
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
    chunk fast path (Upload chunks arrive as ``wire_chunks.ChunkRef``; FetchModel/AwaitBroadcast
    handlers may yield ``ChunkRef``, as the ``wire_chunks`` senders do).

    Every method is registered as request-streaming, whatever its cardinality in the schema (the
    wire does not tell them apart: a unary call is a stream of one message). grpc's sync server
    reads a unary request on a worker thread *before* any interceptor or handler code runs, so a
    call that sends its headers and never its message would hold that thread unseen; as a
    stream, the handler's wrappers (the admission checks, the idle-read deadline) run first and
    read the one message themselves. Unparsable request bytes become ``MalformedRequestError``.
    """
    handlers = {}
    for name, (cardinality, request_type, response_type) in _METHODS.items():
        response_streaming = cardinality.endswith("stream")
        factory = grpc.stream_stream_rpc_method_handler if response_streaming else grpc.stream_unary_rpc_method_handler
        handlers[name] = factory(
            _reading(getattr(servicer, name), name, request_streaming=cardinality.startswith("stream")),
            request_deserializer=tolerant_deserializer(_deserializer(request_type), request_type.DESCRIPTOR.full_name),
            response_serializer=_serializer(response_type),
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def _reading(behavior: Callable[..., Any], method: str, *, request_streaming: bool) -> Callable[..., Any]:
    """``behavior`` fed from the call's request stream: checked message by message, or, for a
    unary method, its one message."""
    if request_streaming:
        def call_with_stream(requests: Any, context: grpc.ServicerContext) -> Any:
            return behavior(checked_requests(requests, method), context)

        return call_with_stream

    def call(requests: Any, context: grpc.ServicerContext) -> Any:
        return behavior(single_request(requests, method), context)

    return call


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
    maximum_concurrent_rpcs: int | None = None,
) -> tuple[grpc.Server, int]:
    """A not-yet-started gRPC server bound to ``host:port`` (0 = any free port) and the bound
    port. Register the servicer (``add_coordinator_servicer``), then ``server.start()``.

    With TLS, clients must present a certificate signed by ``tls.ca``, and the default
    interceptors also refuse certificates that name no site. Without explicit ``interceptors``
    the server gets ``default_interceptors(insecure)``. ``maximum_concurrent_rpcs``: gRPC's own
    bound on calls in progress (beyond it, RESOURCE_EXHAUSTED before any handler runs).
    """
    check_mode(tls, insecure)
    if interceptors is None:
        interceptors = default_interceptors(insecure=insecure)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="geoloco-grpc"),
        options=list(SERVER_OPTIONS) + list(extra_options),
        interceptors=list(interceptors),
        maximum_concurrent_rpcs=maximum_concurrent_rpcs,
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


def channel_options(extra_options: Sequence[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
    """``CHANNEL_OPTIONS`` with ``extra_options`` replacing the defaults they name. grpc keeps
    the *first* value of an option given twice, so appending an override would silently lose
    it (a site's ``reconnect_max_s`` did)."""
    overridden = {name for name, _ in extra_options}
    return [(name, value) for name, value in CHANNEL_OPTIONS if name not in overridden] + list(extra_options)


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
    check_mode(tls, insecure)
    options = channel_options(extra_options)
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

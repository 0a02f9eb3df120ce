"""Errors across the wire: domain errors become gRPC statuses with a machine-readable reason.

``ErrorStatusInterceptor`` turns any ``StatusError`` escaping a handler into
``context.abort(error.code, str(error))`` with the ``ErrorReason`` name in the trailing metadata
key ``ERROR_REASON_KEY``; ``error_reason`` reads it back on the client.
``RequireSiteCertificateInterceptor`` refuses TLS peers whose certificate names no site.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import grpc

from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.errors import IdentityError, StatusError
from geoloco.protos.transport_tls import peer_relay, peer_site

logger = logging.getLogger(__name__)

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
        behavior, wrap, factory = handler.unary_unary, wrap_unary_response, grpc.unary_unary_rpc_method_handler
    elif handler.stream_unary:
        behavior, wrap, factory = handler.stream_unary, wrap_unary_response, grpc.stream_unary_rpc_method_handler
    elif handler.unary_stream:
        behavior, wrap, factory = handler.unary_stream, wrap_stream_response, grpc.unary_stream_rpc_method_handler
    else:
        behavior, wrap, factory = handler.stream_stream, wrap_stream_response, grpc.stream_stream_rpc_method_handler
    wrapped = wrap(behavior)
    # grpc runs a behaviour on the pool named by its ``experimental_thread_pool`` attribute (the
    # admission's control pool for heartbeats); a wrapper must keep it, or the call falls back
    # to the main pool that a flood can fill.
    pool = getattr(behavior, THREAD_POOL_ATTRIBUTE, None)
    if pool is not None:
        setattr(wrapped, THREAD_POOL_ATTRIBUTE, pool)
    return factory(wrapped, **kw)


THREAD_POOL_ATTRIBUTE = "experimental_thread_pool"
"""Attribute of a handler's behaviour through which grpc's sync server picks the thread pool
that runs it (``grpc._server._select_thread_pool_for_behavior``)."""


class WrappingInterceptor(grpc.ServerInterceptor, ABC):
    """A server interceptor that wraps each method's handler the same way for every call.

    gRPC asks the interceptors for a call's handler on its one dispatch thread, for every call;
    rebuilding the same wrapper each time (four interceptors deep) was serial work that grows
    with the calls of every site. The wrapper is built once per method and kept while the
    handler below it is the same object (it is: the servicer's handlers, and the interceptors'
    below, are kept too). Unknown methods have no handler and are not kept."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        known = self._wrapped.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = self.wrap(handler, method)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    @abstractmethod
    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """``handler`` of the full method name ``method``, wrapped (``rebuild_handler``)."""


class MalformedRequestError(StatusError):
    """Bytes that do not parse as the method's request message (INVALID_ARGUMENT, where grpc
    itself would answer INTERNAL "Exception deserializing request!" and count nothing)."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = pb.ERROR_REASON_UNSPECIFIED


class MalformedRequest:
    """What the server's request deserializer yields for bytes it cannot parse; the handler
    raises ``MalformedRequestError`` on meeting it (``check_request``)."""

    __slots__ = ("error", "message_type", "nbytes")

    def __init__(self, message_type: str, nbytes: int, error: Exception) -> None:
        self.message_type = message_type
        self.nbytes = nbytes
        self.error = error

    def refusal(self, method: str) -> MalformedRequestError:
        return MalformedRequestError(
            f"{method}: {self.nbytes} bytes that are not a valid {self.message_type} ({self.error}); "
            "the client must speak the same geoloco.proto as the coordinator"
        )


def tolerant_deserializer(parse: Callable[[bytes], Any], message_type: str) -> Callable[[bytes], Any]:
    """``parse``, returning a ``MalformedRequest`` instead of raising on bad bytes."""

    def deserialize(buf: bytes) -> Any:
        try:
            return parse(buf)
        except Exception as error:  # noqa: BLE001 (DecodeError, or whatever a hand-written parser raises)
            return MalformedRequest(message_type, len(buf), error)

    return deserialize


def check_request(request: Any, method: str) -> Any:
    """``request`` itself, or ``MalformedRequestError`` when it did not parse."""
    if type(request) is MalformedRequest:
        raise request.refusal(method)
    return request


def single_request(requests: Iterator[Any], method: str) -> Any:
    """The one message of a unary method's request stream (``MalformedRequestError`` when the
    client half-closed without sending it, or it did not parse)."""
    request = next(requests, None)
    if request is None:
        raise MalformedRequestError(f"{method}: the call ended without its request message (exactly one is required)")
    return check_request(request, method)


def checked_requests(requests: Iterator[Any], method: str) -> Iterator[Any]:
    """A request stream that raises ``MalformedRequestError`` at the first unparsable message."""
    for request in requests:
        yield check_request(request, method)


class ErrorStatusInterceptor(WrappingInterceptor):
    """Turns a ``StatusError`` escaping a handler into its status code + ``ErrorReason``, so
    servicers raise domain errors instead of calling ``context.abort`` by hand."""

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        return _wrap_handler(handler, method, map_errors=True)


class RequireSiteCertificateInterceptor(WrappingInterceptor):
    """Refuses, before any servicer code runs, TLS peers whose certificate names no site (nor a
    regional relay, whose every request is checked against its ``[relays]`` list later).

    The TLS handshake already rejects certificates from other CAs; this catches certificates
    from the right CA that are not site certificates (and keeps the check out of every handler).
    """

    def __init__(self, *, allow_common_name: bool = False) -> None:
        super().__init__()
        self.allow_common_name = allow_common_name

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        def check(context: grpc.ServicerContext) -> None:
            try:
                site = peer_site(context, allow_common_name=self.allow_common_name)
            except IdentityError as e:
                _log_and_abort(context, e, method)
            if site is None and peer_relay(context) is None:
                _log_and_abort(
                    context,
                    IdentityError(
                        "the client certificate names no site (expected a URI SAN "
                        "geoloco:site:NAME, or geoloco:relay:NAME for a regional relay); issue it "
                        "with `geoloco certs issue DIR NAME`",
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

"""Errors across the wire: domain errors become gRPC statuses with a machine-readable reason.

``ErrorStatusInterceptor`` turns any ``StatusError`` escaping a handler into
``context.abort(error.code, str(error))`` with the ``ErrorReason`` name in the trailing metadata
key ``ERROR_REASON_KEY``; ``error_reason`` reads it back on the client.
``RequireSiteCertificateInterceptor`` refuses TLS peers whose certificate names no site.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import grpc

from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.errors import IdentityError, StatusError
from geoloco.protos.transport_tls import peer_site

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

"""What the coordinator client (``client``) retries: transient statuses, and wire errors retried
like network failures; and what it stops retrying: a TLS mistake behind failed connections
(``HandshakeWatch``), which no retry mends."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import grpc

from geoloco.protos.transport_tls import HandshakeDiagnosis, TLSFiles, diagnose_handshake
from geoloco.protos.wire_buffers import WireError
from geoloco.site_agent.errors import TLSSetupError

__all__ = ["TLS_FAILURES_TO_STOP", "TRANSIENT_CODES", "HandshakeWatch", "TransientWireError", "wire_retrying"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.INTERNAL,  # e.g. RST_STREAM when a connection dies mid-stream
        grpc.StatusCode.CANCELLED,  # the server cancelled our call while shutting down
        grpc.StatusCode.UNKNOWN,  # a request iterator that failed locally mid-stream
        grpc.StatusCode.DATA_LOSS,  # checksum mismatch: send (or fetch) again
    }
)
"""Statuses worth retrying: the same call may succeed once the network or coordinator is back."""


class TransientWireError(grpc.RpcError):
    """A transfer that arrived broken (checksum mismatch): retried like a network failure."""

    def __init__(self, error: WireError) -> None:
        super().__init__(str(error))
        self._error = error

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DATA_LOSS

    def details(self) -> str:
        return str(self._error)

    def trailing_metadata(self) -> tuple[()]:
        return ()


def wire_retrying(attempt: Callable[[], T]) -> Callable[[], T]:
    """Broken streams that surface as wire errors (a stream cut between chunks looks like a
    short read) are retried like transport failures."""

    def wrapped() -> T:
        try:
            return attempt()
        except WireError as error:
            raise TransientWireError(error) from None

    return wrapped


TLS_FAILURES_TO_STOP = 2
"""The same TLS mistake diagnosed on this many failed calls in a row (each one already several
attempts of gRPC's own retry policy) stops the site (``TLSSetupError``) instead of retrying for
``give_up_after_s``: a wrong CA or host name does not mend itself, and an operator should not
wait minutes to learn which it is."""

_CONNECT_FAILURE = ("failed to connect", "Socket closed", "andshake", "Hostname Verification", "ssl")
"""Details of a connection that failed to open (or was closed at once): worth a diagnosis."""

DIAGNOSIS_TIMEOUT_S = 3.0
"""Bound on each step of the diagnosing dial (connect, handshake, first read)."""


class HandshakeWatch:
    """Names the TLS mistake behind a connection that failed to open, and says when to stop.

    gRPC reports only "failed to connect" (with two addresses for ``localhost``, often the other
    address's error): on such a failure the watch dials once with Python's ``ssl``
    (``transport_tls.diagnose_handshake``), logs a diagnosis once at ERROR, and answers
    ``TLSSetupError`` when the same one came back ``TLS_FAILURES_TO_STOP`` times in a row. A
    connection refused, a timeout or a link that is cut is no diagnosis: retried as before.
    """

    def __init__(
        self, target: str, *, tls: TLSFiles | None, insecure: bool, server_name: str | None, name: str
    ) -> None:
        self._target = target
        self._tls = tls
        self._insecure = insecure
        self._server_name = server_name
        self._name = name
        self._lock = threading.Lock()
        self._seen: HandshakeDiagnosis | None = None
        self._strikes = 0

    def failed(self, error: grpc.RpcError) -> TLSSetupError | None:
        """The error to stop with, or None to retry."""
        details = (error.details() if hasattr(error, "details") else "") or ""
        if error.code() != grpc.StatusCode.UNAVAILABLE or not any(s in details for s in _CONNECT_FAILURE):
            return None
        diagnosis = diagnose_handshake(
            self._target, tls=self._tls, insecure=self._insecure, server_name=self._server_name,
            name=self._name, timeout_s=DIAGNOSIS_TIMEOUT_S,
        )
        with self._lock:
            if diagnosis is None:
                self._seen, self._strikes = None, 0
                return None
            if diagnosis == self._seen:
                self._strikes += 1
            else:
                self._seen, self._strikes = diagnosis, 1
                logger.error("site %s: %s", self._name, diagnosis)
            return TLSSetupError(str(diagnosis)) if self._strikes >= TLS_FAILURES_TO_STOP else None

    def succeeded(self) -> None:
        """A call went through: whatever was seen before is not in the way any more."""
        if self._strikes:
            with self._lock:
                self._seen, self._strikes = None, 0

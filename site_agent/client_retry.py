"""What the coordinator client (``client``) retries: transient statuses, and wire errors retried
like network failures."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import grpc

from geoloco.protos.wire_buffers import WireError

__all__ = ["TRANSIENT_CODES", "TransientWireError", "wire_retrying"]

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

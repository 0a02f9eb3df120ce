"""Wire errors retried like network failures, for the coordinator client (``client``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import grpc

from geoloco.protos.wire import WireError

__all__ = ["TransientWireError", "wire_retrying"]

T = TypeVar("T")


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

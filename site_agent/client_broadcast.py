"""AwaitBroadcast pieces of the coordinator client: the wait opened ahead of the upload, and
the extra strided streams that share a large delta with the first one.

A broadcast's size is only known from its header, so the first call asks, with
``chunk_stride`` K, for chunks 0, K, 2K, ...; the moment its header arrives, K-1 more calls (one
connection each) ask for the shares starting at 1..K-1. K comes from the previous broadcast's
size (deltas are alike from round to round) or the configured ``parallel_streams``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from geoloco.protos import geoloco_pb2 as pb

__all__ = ["ExtraStreams", "OpenBroadcast", "on_header"]


class OpenBroadcast:
    """An AwaitBroadcast call started ahead of the upload it waits on (see ``open_broadcast``)."""

    def __init__(
        self,
        round_number: int,
        call: Any,
        *,
        release: Callable[[Any], None],
        ready_mark: int | None = None,
        stride: int = 1,
    ) -> None:
        self.round = round_number
        self.stride = stride
        """The call's ``chunk_stride``: how many parallel streams share the delta."""
        self.ready_mark = ready_mark
        """The channel's ``ready_count`` when the call went out (``ConnectivityWatch``)."""
        self._call: Any = call
        self._release = release
        """Forget the call in the client's list of active calls."""

    def take(self) -> Any:
        """The call, handed over once to ``await_broadcast``."""
        call, self._call = self._call, None
        if call is None:
            raise RuntimeError(f"the open broadcast wait for round {self.round} was already used")
        return call

    def cancel(self) -> None:
        """Abandon the wait (the upload failed); a no-op once the call was handed over."""
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
            self._release(call)


class ExtraStreams:
    """Streams 1..K-1 of a parallel broadcast download, started when the header arrives and
    joined when the first stream ends."""

    def __init__(self, streams: int, run: Callable[[int], None]) -> None:
        """``run(residue)`` downloads one share, retrying on its own until done or failed."""
        self.streams = streams
        self._run = run
        self._threads: list[threading.Thread] = []
        self._errors: list[Exception] = []

    def start(self, header: pb.BroadcastHeader) -> None:
        if self.streams <= 1 or self._threads or header.action != pb.BROADCAST_ACTION_APPLY_DELTA:
            return
        for residue in range(1, min(self.streams, header.delta.num_chunks)):
            thread = threading.Thread(
                target=self._guarded, args=(residue,), name=f"geoloco-broadcast-{residue}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def _guarded(self, residue: int) -> None:
        try:
            self._run(residue)
        except Exception as error:  # noqa: BLE001 (re-raised by join, in the agent's thread)
            self._errors.append(error)

    def join(self) -> None:
        """Wait for every extra stream; raise the first one's failure."""
        for thread in self._threads:
            thread.join()
        self._threads.clear()
        if self._errors:
            error, self._errors = self._errors[0], []
            raise error


def on_header(responses: Iterator[Any], callback: Callable[[pb.BroadcastHeader], None]) -> Iterator[Any]:
    """Pass ``responses`` through, calling ``callback`` with the header when it goes by."""
    for response in responses:
        if response.WhichOneof("kind") == "header":
            callback(response.header)
        yield response

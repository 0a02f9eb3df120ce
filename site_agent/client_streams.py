"""Transfers over K parallel streams, each on its own TCP connection.

One TCP connection rarely fills a long fat link: its window, not the link, bounds it. An upload
is therefore spread over K concurrent Upload calls of the *same* manifest, each carrying a
disjoint, chunk-interleaved subset of the chunks (stream i sends chunks i, i+K, i+2K, ...). The
coordinator already feeds every stream of one manifest into one thread-safe assembler, so no
protocol change is needed; interleaving keeps the chunks arriving nearly in order, so the
coordinator's running checksum keeps up instead of rereading the blob at the end. Downloads
(FetchModel, AwaitBroadcast) do the same with ``chunk_stride``: call i asks for chunks i, i+K, ...

gRPC multiplexes every call of one channel over one HTTP/2 connection, so K streams on one
channel still share one TCP window. Each extra stream gets its own channel with a private
subchannel pool (``grpc.use_local_subchannel_pool``), which gives it its own connection.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any, TypeVar

import grpc

from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.transport_endpoints import client_channel, coordinator_stub
from geoloco.protos.transport_tls import TLSFiles
from geoloco.protos.wire_buffers import MAX_CHUNK_SIZE
from geoloco.protos.wire_chunks import upload_requests

T = TypeVar("T")

__all__ = [
    "AUTO_BYTES_PER_STREAM",
    "MAX_AUTO_STREAMS",
    "MAX_STREAMS",
    "StreamChannels",
    "StreamPlanner",
    "StreamTuner",
    "choose_streams",
    "download_streams",
    "interleave",
    "parse_parallel_streams",
    "run_streams",
    "upload_in_streams",
]

MiB = 1 << 20
AUTO_BYTES_PER_STREAM = 64 * MiB
"""``"auto"`` opens one stream per this many payload bytes: below it one stream carries the
upload (a second connection's handshake and threads cost more than they save)."""
MAX_AUTO_STREAMS = 4
"""The most streams ``"auto"`` picks (see benchmarks/README.md, "Parallel streams")."""
MAX_STREAMS = 32
"""The most streams a site may configure."""


def parse_parallel_streams(value: object) -> int | str:
    """``parallel_streams`` as configured: ``"auto"`` or an int in 1..MAX_STREAMS."""
    if value == "auto":
        return "auto"
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_STREAMS:
        raise ValueError(
            f"parallel_streams must be 'auto' or an integer in 1..{MAX_STREAMS}, got {value!r}"
        )
    return value


def choose_streams(setting: int | str, nbytes: int, num_chunks: int) -> int:
    """How many streams carry a payload of ``nbytes`` in ``num_chunks`` chunks.

    ``"auto"``: one per ``AUTO_BYTES_PER_STREAM`` bytes, at most ``MAX_AUTO_STREAMS``; a
    configured number is taken as is. Never more streams than chunks.
    """
    if setting == "auto":
        wanted = min(MAX_AUTO_STREAMS, max(1, math.ceil(nbytes / AUTO_BYTES_PER_STREAM)))
    else:
        wanted = int(setting)
    return max(1, min(wanted, num_chunks))


MIN_MEASURED_BYTES = 16 * MiB
"""Transfers smaller than this teach ``StreamTuner`` nothing: latency, not the link, sets them."""
HELPED = 1.15
"""More streams must move at least this many times the bytes per second to be kept."""
REPROBE_AFTER = 16
"""Transfers at one K after which the next larger K is tried again (the link may have changed)."""


class StreamTuner:
    """K for ``parallel_streams = "auto"`` from what the site measured, not only the size.

    The payload's size sets a ceiling (``choose_streams``: one stream per 64 MiB, at most
    ``MAX_AUTO_STREAMS``); within it K starts at 1 and doubles only when the last doubling
    *helped*: a transfer at 2K must have run at least ``HELPED`` times the throughput measured
    at K, else the site stays at K (on loopback, or a link one connection fills, extra streams
    only cost CPU and connections). K falls back when a smaller K measured faster, and the next
    doubling is tried again after ``REPROBE_AFTER`` transfers (links change). Throughput per K
    is an exponential moving average of bytes / seconds of whole transfers of at least
    ``MIN_MEASURED_BYTES``. Pure logic, fed by the client (``observe``) and tested without a
    network.
    """

    def __init__(self, *, smoothing: float = 0.5) -> None:
        self.rates: dict[int, float] = {}
        """Bytes per second measured with K streams (moving average)."""
        self.current = 1
        self._since_probe = 0
        self._smoothing = smoothing

    def choose(self, nbytes: int, num_chunks: int) -> int:
        """Streams for the next transfer of ``nbytes`` in ``num_chunks`` chunks."""
        ceiling = choose_streams("auto", nbytes, num_chunks)
        if nbytes < MIN_MEASURED_BYTES:
            return min(self.current, ceiling)
        k = min(self.current, ceiling)
        larger = 2 * k
        if larger <= ceiling and k in self.rates and (
            larger not in self.rates or self._since_probe >= REPROBE_AFTER
        ):
            return larger  # a probe: is the link worth more streams?
        return k

    def choose_download(self, nbytes: int) -> int:
        """``choose`` for a download, whose chunk count the server's manifest will tell: capped,
        like ``download_streams``, by the fewest chunks ``nbytes`` can come in."""
        return self.choose(nbytes, max(1, -(-nbytes // MAX_CHUNK_SIZE)))

    def observe(self, streams: int, nbytes: int, seconds: float) -> None:
        """A whole transfer of ``nbytes`` over ``streams`` streams took ``seconds``."""
        if nbytes < MIN_MEASURED_BYTES or seconds <= 0 or streams < 1:
            return
        rate = nbytes / seconds
        old = self.rates.get(streams)
        self.rates[streams] = rate if old is None else old + self._smoothing * (rate - old)
        if streams != self.current:
            self._since_probe = 0
        else:
            self._since_probe += 1
        self.current = self._best()

    def _best(self) -> int:
        """The smallest K that no larger measured K beats by ``HELPED``, walking up by doubling."""
        best = min(self.rates)
        k = best
        while 2 * k in self.rates:
            k *= 2
            if self.rates[k] >= HELPED * self.rates[best]:
                best = k
        for smaller in sorted(self.rates):
            if smaller < best and self.rates[smaller] >= self.rates[best]:
                return smaller
        return best


class StreamPlanner:
    """K for each transfer of one client: ``parallel_streams`` as configured, or (``"auto"``)
    a ``StreamTuner`` per direction fed with the client's own whole transfers."""

    def __init__(self, setting: int | str) -> None:
        self.setting = setting
        self.upload = StreamTuner()
        self.download = StreamTuner()

    @property
    def auto(self) -> bool:
        return self.setting == "auto"

    def for_upload(self, nbytes: int, num_chunks: int) -> int:
        return self.upload.choose(nbytes, num_chunks) if self.auto else choose_streams(self.setting, nbytes, num_chunks)

    def for_download(self, nbytes: int) -> int:
        """K for a FetchModel of ``nbytes``."""
        return self.download.choose_download(nbytes) if self.auto else download_streams(self.setting, nbytes)

    def for_broadcast(self, last_delta_bytes: int) -> int:
        """K for the next broadcast, whose size is known only from its header: a configured
        number as is, ``auto`` from the last delta's size (one stream before the first)."""
        return self.download.choose_download(last_delta_bytes) if self.auto else int(self.setting)

    def uploaded(self, streams: int, nbytes: int, seconds: float) -> None:
        """A whole upload (nothing resumed) took ``seconds``."""
        if self.auto:
            self.upload.observe(streams, nbytes, seconds)

    def downloaded(self, streams: int, nbytes: int, seconds: float) -> None:
        """A whole download took ``seconds`` (a broadcast: from its header, not the wait)."""
        if self.auto:
            self.download.observe(streams, nbytes, seconds)


def download_streams(setting: int | str, nbytes: int) -> int:
    """How many strided streams download ``nbytes`` (FetchModel, AwaitBroadcast).

    The server's chunk size is not known before its manifest, so K is capped by the fewest
    chunks the blob can have (chunks of ``MAX_CHUNK_SIZE``): stream K-1's first chunk exists.
    """
    return choose_streams(setting, nbytes, max(1, -(-nbytes // MAX_CHUNK_SIZE)))


def run_streams(parts: Sequence[Callable[[], T]]) -> list[T]:
    """Run ``parts`` concurrently (the first in this thread); their results in order, or the
    first part's exception once every part has ended."""
    results: list[Any] = [None] * len(parts)
    errors: list[Exception | None] = [None] * len(parts)

    def run(index: int) -> None:
        try:
            results[index] = parts[index]()
        except Exception as error:  # noqa: BLE001 (re-raised below, in the caller's thread)
            errors[index] = error

    threads = [
        threading.Thread(target=run, args=(index,), name=f"geoloco-stream-{index}", daemon=True)
        for index in range(1, len(parts))
    ]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join()
    for error in errors:
        if error is not None:
            raise error
    return results


def interleave(ranges: Iterable[tuple[int, int]], streams: int) -> list[list[tuple[int, int]]]:
    """Deal the chunk indices of ``ranges`` round-robin over ``streams`` lists of ranges.

    Every index lands in exactly one list; lists that would be empty are dropped.
    """
    dealt: list[list[tuple[int, int]]] = [[] for _ in range(streams)]
    position = 0
    for start, end in ranges:
        for index in range(start, end):
            target = dealt[position % streams]
            if target and target[-1][1] == index:
                target[-1] = (target[-1][0], index + 1)
            else:
                target.append((index, index + 1))
            position += 1
    return [subset for subset in dealt if subset]


class StreamChannels:
    """The extra channels (one TCP connection each) behind streams 2..K, opened on first use
    and kept for the client's lifetime."""

    def __init__(
        self,
        target: str,
        *,
        tls: TLSFiles | None,
        insecure: bool,
        server_name: str | None,
        extra_options: Sequence[tuple[str, Any]],
        intercept: Callable[[grpc.Channel], grpc.Channel],
    ) -> None:
        self._open_args = (target, tls, insecure, server_name, tuple(extra_options))
        self._intercept = intercept
        self._channels: list[grpc.Channel] = []
        self._stubs: list[Any] = []
        self._lock = threading.Lock()

    def stubs(self, count: int) -> list[Any]:
        """Stubs of ``count`` distinct extra channels."""
        target, tls, insecure, server_name, extra = self._open_args
        with self._lock:
            while len(self._stubs) < count:
                options = [
                    *extra,
                    ("grpc.use_local_subchannel_pool", 1),
                    ("geoloco.stream_index", len(self._channels) + 1),
                ]
                channel = client_channel(
                    target, tls=tls, insecure=insecure, server_name=server_name, extra_options=options
                )
                self._channels.append(channel)
                self._stubs.append(coordinator_stub(self._intercept(channel)))
            return self._stubs[:count]

    def close(self) -> None:
        with self._lock:
            for channel in self._channels:
                channel.close()
            self._channels.clear()
            self._stubs.clear()


def upload_in_streams(
    stub: Any,
    channels: StreamChannels,
    manifest: pb.UploadManifest,
    data: bytes,
    missing: list[tuple[int, int]],
    *,
    streams: int,
    timeout: float,
) -> pb.UploadResponse:
    """Send the ``missing`` chunks over up to ``streams`` concurrent Upload calls (the first on
    ``stub``, the others on ``channels``), each with a disjoint interleaved share.

    Returns a complete response if any stream got one; otherwise raises the first stream's
    error once every stream has ended (what the others delivered stays with the coordinator for
    the resumption), or returns an incomplete response.
    """
    subsets = interleave(missing, streams)
    if len(subsets) <= 1:
        return stub.Upload(upload_requests(manifest, data, missing=missing), timeout=timeout)
    stubs = [stub, *channels.stubs(len(subsets) - 1)]

    def send(index: int) -> tuple[pb.UploadResponse | None, grpc.RpcError | None]:
        # A stream's error is kept, not raised: another stream may still complete the upload.
        try:
            requests = upload_requests(manifest, data, missing=subsets[index])
            return stubs[index].Upload(requests, timeout=timeout), None
        except grpc.RpcError as error:
            return None, error

    outcomes = run_streams([partial(send, index) for index in range(len(subsets))])
    for response, _ in outcomes:
        if response is not None and response.complete:
            return response
    for _, error in outcomes:
        if error is not None:
            raise error
    return pb.UploadResponse(complete=False)

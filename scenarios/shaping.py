"""Portable link shaping: a userspace TCP relay per site, between the site and the coordinator.

The site dials its relay's loopback port instead of the coordinator's; the relay forwards opaque
bytes (so mutual TLS stays end to end) and shapes each direction like a WAN link:

- **Bandwidth**: a token bucket per link direction (shared by every connection of the site). A
  segment leaves the bucket once its bytes are paid for, so a burst of ``n`` bytes finishes
  ``8·n / bandwidth`` after it started, the simulator's ``bytes / bandwidth``.
- **Latency and jitter**: each segment is released no earlier than its departure + ``latency`` +
  a uniform draw from ``[0, jitter]``, and never before the segment ahead of it (TCP keeps order).
- **Loss**: modelled as a retransmission. A segment of ``n`` bytes spans ``ceil(n / MSS)`` TCP
  segments; with probability ``1 − (1 − p)^segments`` one of them was lost and the whole stream
  waits ``RETRANSMIT_MIN_S`` + one round trip longer (head-of-line blocking, as TCP does).
- **Cut**: ``cut(seconds)`` aborts every connection and refuses new ones until the time is up.
- **Per-flow window** (``flow_window_bytes``): each TCP connection through the relay has at most
  that many bytes in flight, unacknowledged (sent, and not yet a round trip old: delivered plus
  the return path's latency), so one flow moves at most ``window / RTT`` whatever the link's
  bandwidth, as a real TCP connection whose window (receive buffer, or congestion window) is
  smaller than the path's bandwidth-delay product. Without it a relayed connection is bounded
  by the bandwidth alone, and parallel streams would look useless on a long fat link; with it
  K connections move up to K windows per round trip, until the shared bucket caps them.

The relay also measures: bytes per direction, and *bursts* — maximal runs of traffic in one
direction (gaps shorter than a round trip) — with the time their first byte reached the relay and
their last byte was delivered. The emulator turns those into the per-site communication timeline
and the fidelity check against the simulator's clock.

All relays of a run share one asyncio event loop in a background thread (``RelayHub``); every
timestamp is ``time.monotonic()``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

__all__ = [
    "Burst",
    "FlowWindow",
    "LinkRelay",
    "LinkShape",
    "RelayHub",
    "TokenBucket",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

MSS = 1448
"""TCP payload bytes per segment on a 1500-byte MTU path (for the loss model)."""
RETRANSMIT_MIN_S = 0.2
"""Linux's minimum retransmission timeout; a loss costs this plus one round trip."""
READ_SIZE = 16 * 1024
"""Bytes read from a socket at once: the granularity of shaping."""
BUCKET_BURST_BYTES = 4 * 1024
"""Token-bucket depth: how many bytes may leave back to back after an idle period."""
MIN_QUEUE_BYTES = 256 * 1024
"""Bytes a direction buffers before it stops reading (back-pressure on the sender)."""
MIN_BURST_BYTES = 1024
"""Bursts smaller than this (heartbeats, pings) are not recorded."""
CONTROL_MESSAGE_BYTES = 512
"""A segment smaller than this, arriving alone, is a control message (heartbeat, ack)."""

Direction = Literal["up", "down"]


@dataclass(frozen=True, slots=True)
class LinkShape:
    """One direction of a link."""

    bandwidth_bps: float
    """Bits per second."""
    latency_s: float = 0.0
    """One-way delay in seconds."""
    jitter_s: float = 0.0
    """Extra delay drawn uniformly from ``[0, jitter_s]`` per forwarded segment."""
    loss: float = 0.0
    """Probability that one TCP segment is lost (costs a retransmission delay)."""
    flow_window_bytes: int | None = None
    """Bytes one TCP connection may have in flight (module doc); None: no per-flow limit."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth_bps) and self.bandwidth_bps > 0):
            raise ValueError(f"bandwidth_bps must be > 0, got {self.bandwidth_bps}")
        if self.latency_s < 0 or self.jitter_s < 0:
            raise ValueError("latency_s and jitter_s must be >= 0")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")
        if self.flow_window_bytes is not None and not (
            isinstance(self.flow_window_bytes, int) and self.flow_window_bytes >= MSS
        ):
            raise ValueError(
                f"flow_window_bytes must be an integer >= {MSS} (one TCP segment) or unset, "
                f"got {self.flow_window_bytes!r}"
            )

    @property
    def retransmit_delay_s(self) -> float:
        return RETRANSMIT_MIN_S + 2 * self.latency_s


class TokenBucket:
    """Bytes earn the right to leave at ``rate`` bytes/s; at most ``burst`` saved up while idle.

    ``reserve(n, now)`` returns when the ``n``-th byte has left. Tokens may go negative (a debt
    paid by later time), which serialises back-to-back reservations in order.
    """

    def __init__(self, rate_bytes_per_s: float, burst_bytes: float = BUCKET_BURST_BYTES) -> None:
        if rate_bytes_per_s <= 0:
            raise ValueError(f"rate must be > 0 bytes/s, got {rate_bytes_per_s}")
        self.rate = rate_bytes_per_s
        self.burst = burst_bytes
        self._tokens = burst_bytes
        self._last: float | None = None

    def reserve(self, nbytes: int, now: float) -> float:
        if self._last is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= nbytes
        return now if self._tokens >= 0 else now + (-self._tokens) / self.rate


class FlowWindow:
    """One TCP connection's window in one direction: at most ``window_bytes`` in flight.

    A segment is in flight from when it leaves until its acknowledgement could be back: its
    delivery plus ``return_latency_s`` (the opposite direction's one-way delay).
    ``earliest(n, now)`` is when ``n`` more bytes fit (a segment larger than the whole window
    goes alone); ``sent(n, delivered_s)`` records one. Pure bookkeeping over times, so the
    emulator's relay and tests share it.
    """

    def __init__(self, window_bytes: int, return_latency_s: float) -> None:
        if window_bytes < 1:
            raise ValueError(f"window_bytes must be >= 1, got {window_bytes}")
        self.window_bytes = window_bytes
        self.return_latency_s = return_latency_s
        self._acks: deque[tuple[float, int]] = deque()
        self._in_flight = 0
        self._last = 0.0
        self.bytes_sent = 0
        self.waits = 0
        """Segments that had to wait for the window (the flow was window-bound)."""

    def ready_at(self, nbytes: int, now: float) -> float:
        """When ``nbytes`` more could leave, at or after ``now`` (and never before the last
        segment); changes nothing."""
        at = max(now, self._last)
        in_flight = self._in_flight
        for acked_at, size in self._acks:
            if acked_at > at and in_flight + nbytes <= self.window_bytes:
                break
            in_flight -= size
            at = max(at, acked_at)
        return at

    def earliest(self, nbytes: int, now: float) -> float:
        """``ready_at``, and the flow moves on to that time (acknowledged bytes leave flight)."""
        at = self.ready_at(nbytes, now)
        self.waits += at > max(now, self._last)
        acks = self._acks
        while acks and acks[0][0] <= at:
            self._in_flight -= acks.popleft()[1]
        self._last = at
        return at

    def sent(self, nbytes: int, delivered_s: float) -> None:
        """``nbytes`` left and are delivered at ``delivered_s``."""
        self._acks.append((delivered_s + self.return_latency_s, nbytes))
        self._in_flight += nbytes
        self.bytes_sent += nbytes


@dataclass(slots=True)
class Burst:
    """A run of traffic in one direction of one site's link."""

    direction: Direction
    start_s: float
    """``time.monotonic()`` when its first byte reached the relay."""
    end_s: float
    """When its last byte was (or is scheduled to be) delivered."""
    nbytes: int

    def to_dict(self, origin_s: float = 0.0) -> dict[str, Any]:
        return {
            "direction": self.direction,
            "start_s": round(self.start_s - origin_s, 6),
            "end_s": round(self.end_s - origin_s, 6),
            "bytes": self.nbytes,
        }


@dataclass(slots=True)
class _DirectionState:
    shape: LinkShape
    bucket: TokenBucket
    rng: random.Random
    direction: Direction
    bytes: int = 0
    """Bytes delivered so far."""
    last_delivery_s: float = 0.0
    bursts: list[Burst] = field(default_factory=list)
    current: Burst | None = None
    last_arrival_s: float = 0.0
    opposite: _DirectionState | None = field(default=None, repr=False)
    """The other direction of the same link (bursts alternate between them)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards the burst log, read by the emulator's thread."""

    @property
    def burst_gap_s(self) -> float:
        """Traffic separated by less than a round trip (flow-control stalls) is one burst."""
        return 2 * self.shape.latency_s + 0.05

    def schedule(self, nbytes: int, now: float, previous_s: float) -> float:
        """Delivery time of a segment of ``nbytes`` that reached the relay at ``now``."""
        shape = self.shape
        departure = self.bucket.reserve(nbytes, now)
        deliver = departure + shape.latency_s
        if shape.jitter_s:
            deliver += self.rng.uniform(0.0, shape.jitter_s)
        if shape.loss:
            segments = max(1, math.ceil(nbytes / MSS))
            if self.rng.random() < 1.0 - (1.0 - shape.loss) ** segments:
                deliver += shape.retransmit_delay_s
        deliver = max(deliver, previous_s)
        with self.lock:
            self._track(nbytes, now, deliver)
        return deliver

    def _track(self, nbytes: int, now: float, deliver: float) -> None:
        current = self.current
        if current is not None and now <= current.end_s + self.burst_gap_s and not self._answered():
            if current.nbytes < MIN_BURST_BYTES:
                # Only control chatter (a heartbeat) so far: the transfer starts now.
                current.start_s = now
            if nbytes >= CONTROL_MESSAGE_BYTES or now - self.last_arrival_s <= 0.02:
                # A lone small message after the transfer (the next heartbeat) does not extend it.
                current.end_s = max(current.end_s, deliver)
            current.nbytes += nbytes
        else:
            self._close_current()
            self.current = Burst(self.direction, now, deliver, nbytes)
        self.last_arrival_s = now

    def _answered(self) -> bool:
        """The other direction started a transfer since our last segment: a request was
        answered (an upload acknowledged, a broadcast received), so our next bytes are a new
        transfer even if they follow quickly."""
        other = self.opposite.current if self.opposite is not None else None
        return (
            other is not None
            and other.nbytes >= MIN_BURST_BYTES
            and other.start_s > self.last_arrival_s
        )

    def _close_current(self) -> None:
        if self.current is not None and self.current.nbytes >= MIN_BURST_BYTES:
            self.bursts.append(self.current)
        self.current = None

    def finished_bursts(self, now: float) -> list[Burst]:
        with self.lock:
            current = self.current
            if current is not None and now > current.end_s + self.burst_gap_s:
                self._close_current()
            return list(self.bursts)


class LinkRelay:
    """One site's shaped link: listens on loopback, forwards to the coordinator's address."""

    def __init__(
        self,
        name: str,
        up: LinkShape,
        down: LinkShape,
        *,
        seed: int = 0,
        host: str = "127.0.0.1",
        send_buffer: int | None = None,
    ) -> None:
        """``send_buffer``: set when the kernel shapes the wire after the relay (``--shaping
        kernel``): the site-facing socket's send buffer is clamped to this many bytes and a
        downlink burst ends when its last byte was handed to that socket, so the measured
        transfer follows the shaped wire instead of ending once the socket buffer took it."""
        self.name = name
        self.host = host
        self.send_buffer = send_buffer
        self.target: tuple[str, int] | None = None
        rng = random.Random(f"{seed}:{name}")
        self.up = _DirectionState(up, TokenBucket(up.bandwidth_bps / 8), random.Random(rng.random()), "up")
        self.down = _DirectionState(
            down, TokenBucket(down.bandwidth_bps / 8), random.Random(rng.random()), "down"
        )
        self.up.opposite, self.down.opposite = self.down, self.up
        self.port = 0
        self.cut_until_s = 0.0
        self.connections_refused = 0
        self.connections_cut = 0
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.flows: list[tuple[FlowWindow | None, FlowWindow | None]] = []
        """(up, down) window of every connection relayed so far (None: no per-flow limit)."""

    # -- state visible to the emulator (read from other threads: plain attribute reads) -------

    @property
    def bytes_up(self) -> int:
        return self.up.bytes

    @property
    def bytes_down(self) -> int:
        return self.down.bytes

    def is_cut(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) < self.cut_until_s

    def active_direction(self, now: float | None = None, window_s: float = 0.3) -> Direction | None:
        """``"up"``/``"down"`` while a transfer of real size is moving, else None."""
        now = time.monotonic() if now is None else now
        for state in (self.up, self.down):
            current = state.current
            if current is not None and current.nbytes >= 4 * MIN_BURST_BYTES and now <= current.end_s + window_s:
                return state.direction
        return None

    def bursts(self, now: float | None = None) -> list[Burst]:
        now = time.monotonic() if now is None else now
        return sorted(
            self.up.finished_bursts(now) + self.down.finished_bursts(now), key=lambda b: b.start_s
        )

    # -- inside the event loop -----------------------------------------------------------------

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._abort_all()

    def _abort_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    def cut(self, seconds: float) -> None:
        """Drop every connection and refuse new ones for ``seconds`` (called in the loop)."""
        self.cut_until_s = max(self.cut_until_s, time.monotonic() + seconds)
        self.connections_cut += len(self._writers) // 2
        self._abort_all()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.is_cut() or self.target is None:
            self.connections_refused += 1
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError as err:
            logger.debug("relay %s: coordinator %s unreachable: %s", self.name, self.target, err)
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        if self.send_buffer is not None:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer)
            writer.transport.set_write_buffer_limits(high=self.send_buffer)
        up_window, down_window = self._flow_window(self.up, self.down), self._flow_window(self.down, self.up)
        self.flows.append((up_window, down_window))
        try:
            await asyncio.gather(
                self._pump(reader, up_writer, self.up, window=up_window),
                self._pump(
                    up_reader, writer, self.down, track_writes=self.send_buffer is not None, window=down_window
                ),
            )
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    @staticmethod
    def _flow_window(state: _DirectionState, opposite: _DirectionState) -> FlowWindow | None:
        window = state.shape.flow_window_bytes
        return None if window is None else FlowWindow(window, opposite.shape.latency_s)

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        state: _DirectionState,
        *,
        track_writes: bool = False,
        window: FlowWindow | None = None,
    ) -> None:
        shape = state.shape
        limit = max(MIN_QUEUE_BYTES, int(2 * shape.bandwidth_bps / 8 * (shape.latency_s + shape.jitter_s)))
        queue: asyncio.Queue[tuple[float, bytes, Burst | None] | None] = asyncio.Queue(
            maxsize=max(4, limit // READ_SIZE)
        )
        loop = asyncio.get_running_loop()

        async def deliver() -> None:
            while True:
                item = await queue.get()
                if item is None:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                deliver_at, data, burst = item
                delay = deliver_at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                # Counted as they are handed to the socket: the peer may read them (and whoever
                # watches the count look at it) before write() or drain() returns.
                state.bytes += len(data)
                writer.write(data)
                await writer.drain()
                state.last_delivery_s = time.monotonic()
                if burst is not None:
                    with state.lock:
                        burst.end_s = max(burst.end_s, state.last_delivery_s)

        sender = loop.create_task(deliver())
        previous = 0.0
        try:
            while True:
                data = await reader.read(READ_SIZE)
                if not data:
                    await queue.put(None)
                    break
                if window is not None:
                    # Not read further until the window has room: the sender's TCP stalls, as
                    # behind a full window (flow control), and its data stays in its buffers.
                    wait = window.earliest(len(data), time.monotonic()) - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                previous = state.schedule(len(data), time.monotonic(), previous)
                if window is not None:
                    window.sent(len(data), previous)
                await queue.put((previous, data, state.current if track_writes else None))
            await sender
        finally:
            sender.cancel()


class RelayHub:
    """Runs every ``LinkRelay`` of a run on one event loop in a daemon thread."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="geoloco-relays", daemon=True)
        self._thread.start()
        self.relays: dict[str, LinkRelay] = {}

    def _call(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def add(
        self,
        name: str,
        up: LinkShape,
        down: LinkShape,
        *,
        seed: int = 0,
        host: str = "127.0.0.1",
        send_buffer: int | None = None,
    ) -> LinkRelay:
        """A new relay listening on a free port of ``host`` (``relay.port``): loopback, or the
        emulator's end of the site's veth pair under kernel shaping (see ``LinkRelay``)."""
        relay = LinkRelay(name, up, down, seed=seed, host=host, send_buffer=send_buffer)
        self._call(relay.start())
        self.relays[name] = relay
        return relay

    def set_target(self, host: str, port: int) -> None:
        """Point every relay at the coordinator (again, after it restarted on a new port)."""
        self.set_targets({name: (host, port) for name in self.relays})

    def set_targets(self, targets: dict[str, tuple[str, int]]) -> None:
        """Point each named relay at its own next hop (a chain of links: site -> regional relay
        -> the coordinator's link -> the coordinator)."""

        async def update() -> None:
            for name, target in targets.items():
                self.relays[name].target = target

        self._call(update())

    def cut(self, name: str, seconds: float) -> None:
        async def cut() -> None:
            self.relays[name].cut(seconds)

        self._call(cut())

    def close(self) -> None:
        if not self._loop.is_running():
            return

        async def close_all() -> None:
            for relay in self.relays.values():
                await relay.close()
            # The connections' pumps end once their transports are aborted, but only at their
            # next turn of the loop: cancelled and awaited here, none is left pending when the
            # loop closes ("Task was destroyed but it is pending!").
            current = asyncio.current_task()
            pending = [task for task in asyncio.all_tasks() if task is not current]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        try:
            self._call(close_all())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            if not self._thread.is_alive():
                self._loop.close()

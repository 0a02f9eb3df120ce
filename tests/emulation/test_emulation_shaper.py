"""The relay shaper on real loopback sockets: rate, latency, loss, cut — measured, with tolerances."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from geoloco.scenarios.shaping import LinkShape, RelayHub, TokenBucket


class Sink:
    """A TCP server that records when each received byte count was reached, and echoes nothing."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.received = 0
        self.first_byte_s: float | None = None
        self.last_byte_s: float | None = None
        self.done = threading.Event()
        self.expected = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.server.accept()
        except OSError:
            return
        with conn:
            while True:
                data = conn.recv(65536)
                if not data:
                    break
                now = time.monotonic()
                if self.first_byte_s is None:
                    self.first_byte_s = now
                self.received += len(data)
                self.last_byte_s = now
                if self.expected and self.received >= self.expected:
                    self.done.set()
        self.done.set()

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def hub() -> Iterator[RelayHub]:
    hub = RelayHub()
    yield hub
    hub.close()


def test_token_bucket_serialises_reservations() -> None:
    bucket = TokenBucket(1000.0, burst_bytes=0)
    assert bucket.reserve(500, 0.0) == pytest.approx(0.5)
    # A second reservation at the same instant waits behind the first.
    assert bucket.reserve(500, 0.0) == pytest.approx(1.0)
    # After an idle second the debt is paid and nothing saved beyond the (zero) burst.
    assert bucket.reserve(100, 2.0) == pytest.approx(2.1)


def test_relay_rate_and_latency_match_the_clock_model(hub: RelayHub) -> None:
    sink = Sink()
    rate_bps, latency_s = 4e6, 0.05
    relay = hub.add("a", LinkShape(rate_bps, latency_s), LinkShape(rate_bps, latency_s))
    hub.set_target("127.0.0.1", sink.port)
    nbytes = 300_000
    sink.expected = nbytes
    with socket.create_connection(("127.0.0.1", relay.port)) as conn:
        # Latency of a small first message, then the rate of a bulk transfer behind it.
        t0 = time.monotonic()
        conn.sendall(b"x" * 100)
        deadline = time.monotonic() + 5
        while sink.first_byte_s is None and time.monotonic() < deadline:
            time.sleep(0.001)
        assert sink.first_byte_s is not None
        one_way = sink.first_byte_s - t0
        assert latency_s * 0.9 <= one_way <= latency_s + 0.03, one_way
        t1 = time.monotonic()
        conn.sendall(b"y" * (nbytes - 100))
        assert sink.done.wait(10)
    measured = sink.last_byte_s - t1  # type: ignore[operator]
    predicted = latency_s + 8 * (nbytes - 100) / rate_bps
    assert abs(measured / predicted - 1) < 0.15, (measured, predicted)
    assert relay.bytes_up == nbytes
    bursts = [b for b in relay.bursts(time.monotonic() + 10) if b.direction == "up"]
    assert sum(b.nbytes for b in bursts) == pytest.approx(nbytes, abs=200)
    sink.close()


def test_loss_adds_retransmission_delay(hub: RelayHub) -> None:
    sink = Sink()
    nbytes = 200_000
    sink.expected = nbytes
    shape = LinkShape(1e9, 0.01, loss=0.02)  # ~140 segments: several losses almost surely
    relay = hub.add("lossy", shape, shape, seed=1)
    hub.set_target("127.0.0.1", sink.port)
    with socket.create_connection(("127.0.0.1", relay.port)) as conn:
        t0 = time.monotonic()
        conn.sendall(b"z" * nbytes)
        assert sink.done.wait(20)
    measured = sink.last_byte_s - t0  # type: ignore[operator]
    # Lossless it would take ~10 ms; each loss holds the stream back >= 0.22 s.
    assert measured >= shape.retransmit_delay_s, measured
    assert sink.received == nbytes
    sink.close()


def test_cut_drops_connections_and_refuses_new_ones(hub: RelayHub) -> None:
    sink = Sink()
    relay = hub.add("c", LinkShape(1e9), LinkShape(1e9))
    hub.set_target("127.0.0.1", sink.port)
    conn = socket.create_connection(("127.0.0.1", relay.port))
    conn.sendall(b"hello")
    assert _wait(lambda: sink.received == 5)
    hub.cut("c", 30.0)
    assert relay.is_cut()
    conn.settimeout(5)
    # The relay aborted the connection: the site sees EOF or a reset.
    try:
        assert conn.recv(10) == b""
    except ConnectionResetError:
        pass
    conn.close()
    again = socket.create_connection(("127.0.0.1", relay.port))
    again.settimeout(5)
    try:
        assert again.recv(10) == b""
    except ConnectionResetError:
        pass
    again.close()
    assert _wait(lambda: relay.connections_refused >= 1)
    sink.close()


def _wait(condition, timeout_s: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return False


def test_closing_the_hub_mid_connection_leaves_no_task_pending() -> None:
    """A connection still open when the run ends: its relay tasks are cancelled and awaited
    before the hub's loop closes, not left pending for the interpreter to report at exit."""
    import asyncio

    hub = RelayHub()
    sink = Sink()
    slow = LinkShape(1e6, 0.5)  # bytes still queued in the relay when it closes
    relay = hub.add("open", slow, slow)
    hub.set_target("127.0.0.1", sink.port)
    conn = socket.create_connection(("127.0.0.1", relay.port))
    try:
        conn.sendall(b"x" * 200_000)
        assert _wait(lambda: sink.received > 0)
        loop = hub._loop
        hub.close()
        assert loop.is_closed()
        assert [task for task in asyncio.all_tasks(loop) if not task.done()] == []
    finally:
        conn.close()
        sink.close()

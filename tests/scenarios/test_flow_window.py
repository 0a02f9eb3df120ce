"""The emulator's per-flow window: one TCP connection moves at most window / RTT, K connections
up to K times that until the link's bandwidth caps them (``shaping.FlowWindow``), in the pure
model and through a real relay; and the scenario key that sets it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from geoloco.algorithms.config import ConfigError
from geoloco.scenarios.scenario import EmulatedSite
from geoloco.scenarios.shaping import FlowWindow, LinkShape, RelayHub, TokenBucket

SEGMENT = 16 * 1024
MiB = 1 << 20


def _simulate(flows: int, *, window: int, latency_s: float, bandwidth_bps: float, duration_s: float) -> list[int]:
    """Bytes each of ``flows`` always-busy senders gets delivered within ``duration_s`` through
    one shared bucket, each behind its own window; segments leave in time order."""
    bucket = TokenBucket(bandwidth_bps / 8)
    windows = [FlowWindow(window, latency_s) for _ in range(flows)]
    delivered = [0] * flows
    while True:
        ready = [w.ready_at(SEGMENT, 0.0) for w in windows]
        flow = min(range(flows), key=ready.__getitem__)
        at = windows[flow].earliest(SEGMENT, ready[flow])
        if at > duration_s:
            return delivered
        deliver = bucket.reserve(SEGMENT, at) + latency_s
        windows[flow].sent(SEGMENT, deliver)
        if deliver <= duration_s:
            delivered[flow] += SEGMENT


def test_one_flow_is_capped_at_window_per_round_trip_and_two_get_twice() -> None:
    link = {"window": 1 * MiB, "latency_s": 0.04, "bandwidth_bps": 1e9, "duration_s": 10.0}
    cap = MiB / 0.08 * 10.0  # window / RTT over the run: 131 MB, an eighth of the link's 1.25 GB
    one = sum(_simulate(1, **link))
    two = _simulate(2, **link)
    assert 0.9 * cap <= one <= cap
    assert 1.8 <= sum(two) / one <= 2.05
    assert abs(two[0] - two[1]) <= 0.05 * sum(two)  # fair shares
    many = sum(_simulate(16, **link))  # 16 windows per RTT would be 2.1 GB: the link caps it
    assert 0.9 * 1.25e9 <= many <= 1.25e9 * 1.01


def test_a_segment_waits_only_when_the_window_is_full() -> None:
    window = FlowWindow(100, return_latency_s=0.5)
    assert window.earliest(60, 0.0) == 0.0
    window.sent(60, delivered_s=0.5)  # acknowledged at 1.0
    assert window.earliest(40, 0.1) == 0.1  # 100 in flight: still fits
    window.sent(40, delivered_s=0.6)  # acknowledged at 1.1
    assert window.ready_at(10, 0.2) == 1.0  # full: wait for the first acknowledgement
    assert window.earliest(10, 0.2) == 1.0 and window.waits == 1
    assert window.earliest(500, 1.0) == 1.1  # larger than the window: goes alone, once all is acked


class _Sinks:
    """A TCP server that drains any number of connections and counts bytes per connection."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.received: list[int] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with self.lock:
                self.received.append(0)
                slot = len(self.received) - 1
            threading.Thread(target=self._drain, args=(conn, slot), daemon=True).start()

    def _drain(self, conn: socket.socket, slot: int) -> None:
        with conn:
            while data := conn.recv(65536):
                with self.lock:
                    self.received[slot] += len(data)

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def hub() -> Iterator[RelayHub]:
    hub = RelayHub()
    yield hub
    hub.close()


def test_through_a_real_relay_one_connection_cannot_beat_its_window(hub: RelayHub) -> None:
    sinks = _Sinks()
    window, latency_s = 64 * 1024, 0.05  # 64 KiB per 100 ms round trip: 655 KB/s per flow
    shape = LinkShape(1e9, latency_s, flow_window_bytes=window)
    relay = hub.add("a", shape, shape)
    hub.set_target("127.0.0.1", sinks.port)
    nbytes = 8 * window
    try:
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", relay.port)) as conn:
            conn.sendall(b"x" * nbytes)
            deadline = time.monotonic() + 60
            while sum(sinks.received) < nbytes and time.monotonic() < deadline:
                time.sleep(0.01)
        elapsed = time.monotonic() - t0
        assert sum(sinks.received) == nbytes
        # Eight windows need at least seven more round trips after the first window left
        # (a lower bound: a loaded machine only makes it later). Unshaped it takes milliseconds.
        assert elapsed >= 7 * 2 * latency_s
        up, _ = relay.flows[0]
        assert up is not None and up.bytes_sent == nbytes and up.waits >= 7
    finally:
        sinks.close()


def test_the_scenario_key_is_validated_and_reaches_the_link_shape() -> None:
    site = EmulatedSite(name="a", flow_window_bytes=4 * MiB)
    assert site.flow_window_bytes == 4 * MiB
    assert EmulatedSite(name="b").flow_window_bytes is None
    with pytest.raises(ConfigError, match="flow_window_bytes"):
        EmulatedSite(name="c", flow_window_bytes=100)
    with pytest.raises(ValueError, match="flow_window_bytes"):
        LinkShape(1e9, flow_window_bytes=0)


def test_a_scenario_file_sets_the_window_per_site() -> None:
    from geoloco.scenarios.scenario import parse_scenario

    scenario = parse_scenario({
        "sites": [
            {"name": "far", "uplink_bps": 1e9, "downlink_bps": 1e9, "latency_s": 0.04, "flow_window_bytes": MiB},
            {"name": "near"},
        ],
    })
    assert [site.flow_window_bytes for site in scenario.sites] == [MiB, None]

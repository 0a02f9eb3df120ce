"""One upload over K parallel streams, over real gRPC with mutual TLS to a real coordinator.

Every Upload call is watched by a client interceptor that records which chunk indices it
carried and on which channel, so the tests can show the streams' shares are disjoint, cover the
whole update, and went over distinct channels (connections); one stream is cut mid-transfer to
show the upload resumes and completes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.compression import Encoded, decode, parse_codec
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.server import CoordinatorServer
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.protocol_version import PROTOCOL_VERSION
from geoloco.protos.transport_endpoints import client_channel, coordinator_stub
from geoloco.protos.transport_tls import TLSFiles
from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_site
from geoloco.site_agent.client import CoordinatorClient
from geoloco.site_agent.client_streams import choose_streams, interleave, parse_parallel_streams
from geoloco.site_agent.config import SiteAgentConfig

CHUNK = 256


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    init_ca(directory)
    issue_coordinator(directory)
    for name in ("a", "b"):
        issue_site(directory, name)
    return directory


@pytest.fixture
def server(certs: Path) -> Iterator[CoordinatorServer]:
    model = torch.nn.Linear(64, 64)
    layout = ParamLayout.from_model(model)
    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(inner_steps=1),
        certs_dir=str(certs),
        min_sites=2,  # the round stays open after a's upload (b never uploads): its buffer stays
        total_rounds=3,
    )
    server = CoordinatorServer(config, layout.flatten(model), layout)
    server.start()
    yield server
    server.stop(grace=0)


class UploadWatch(grpc.StreamUnaryClientInterceptor):  # type: ignore[misc]
    """Records, per Upload call, the chunk indices it sent; cuts call ``cut_call`` after
    ``cut_after`` chunks by failing its request iterator (the stream is cancelled)."""

    def __init__(self, channel_name: str, log: list[tuple[str, list[int]]], cut: dict[str, int]) -> None:
        self.channel_name = channel_name
        self.log = log
        self.cut = cut
        self.lock = threading.Lock()

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        if not details.method.endswith("/Upload"):
            return continuation(details, request_iterator)
        sent: list[int] = []
        with self.lock:
            call_number = len(self.log)
            self.log.append((self.channel_name, sent))
        limit = self.cut.get("after") if self.cut.get("call") == call_number else None

        def watched() -> Iterator[Any]:
            for request in request_iterator:
                if request.WhichOneof("kind") == "chunk":
                    if limit is not None and len(sent) >= limit:
                        raise ConnectionResetError("stream cut by the test")
                    sent.append(request.chunk.index)
                yield request

        return continuation(details, watched())


class _Counter:
    """Names each intercepted channel, so the log shows which channel carried which call."""

    def __init__(self) -> None:
        self.count = 0


def _client(
    server: CoordinatorServer, certs: Path, streams: int | str, log: list[tuple[str, list[int]]],
    cut: dict[str, int],
) -> CoordinatorClient:
    config = SiteAgentConfig(
        chunk_size=CHUNK, parallel_streams=streams, backoff_initial_s=0.05, backoff_max_s=0.1
    )
    client = CoordinatorClient(
        f"localhost:{server.port}", site="a", tls=TLSFiles.from_dir(certs, "a"), insecure=False,
        config=config, stop_event=threading.Event(),
    )
    # Every channel the client opens (the main one and each extra stream's) goes through
    # ``intercept``: wrap it so each channel records its own calls under its own name.
    counter = _Counter()
    original = client._stream_channels._intercept

    def intercept(raw: grpc.Channel) -> grpc.Channel:
        counter.count += 1
        return grpc.intercept_channel(original(raw), UploadWatch(f"extra-{counter.count}", log, cut))

    client._stream_channels._intercept = intercept
    client._stub = coordinator_stub(grpc.intercept_channel(client._channel, UploadWatch("main", log, cut)))
    return client


def _join_both(client: CoordinatorClient, server: CoordinatorServer, certs: Path) -> grpc.Channel:
    client.join(has_weights=False, weights_round=0, digest_hex=None)
    other = client_channel(f"localhost:{server.port}", tls=TLSFiles.from_dir(certs, "b"))
    coordinator_stub(other).Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=10)
    return other


def _update(server: CoordinatorServer) -> tuple[bytes, int]:
    numel = server.rounds.numel
    encoded = parse_codec("none").encode(torch.randn(numel, generator=torch.Generator().manual_seed(3)), seed=0)
    return encoded.to_bytes(), numel


def _added_whole(server: CoordinatorServer, data: bytes) -> bool:
    """The round's running sum holds site "a"'s update bit for bit: the bytes arrived whole (the
    coordinator drops an upload's bytes once its update is in the sum, so the sum is what is
    left to compare)."""
    aggregation = server.rounds._ctx.round.core.aggregation
    update = decode(Encoded.from_bytes(data)).reshape(-1)
    return torch.equal(aggregation._buffer, update * aggregation.total_weight)


def test_an_upload_over_three_streams_arrives_whole_each_stream_carrying_a_disjoint_share(
    server: CoordinatorServer, certs: Path
) -> None:
    log: list[tuple[str, list[int]]] = []
    client = _client(server, certs, 3, log, {})
    other = _join_both(client, server, certs)
    try:
        data, numel = _update(server)
        response = client.upload(
            round_number=0, data=data, codec="none", shape=[numel], sample_weight=1.0, metrics={}
        )
        assert response.complete
        num_chunks = -(-len(data) // CHUNK)
        assert num_chunks >= 30
        assert len(log) == 3, log  # three calls, one attempt, nothing resent
        assert sorted(name for name, _ in log) == ["extra-1", "extra-2", "main"]
        shares = [set(sent) for _, sent in log]
        assert all(shares), "every stream carried chunks"
        assert sum(len(s) for s in shares) == num_chunks  # disjoint ...
        assert set().union(*shares) == set(range(num_chunks))  # ... and complete
        assert _added_whole(server, data)  # bit-identical at the coordinator
    finally:
        client.close()
        other.close()


def test_a_stream_cut_mid_transfer_is_resumed_and_the_upload_completes(
    server: CoordinatorServer, certs: Path
) -> None:
    log: list[tuple[str, list[int]]] = []
    client = _client(server, certs, 3, log, {"call": 1, "after": 3})
    other = _join_both(client, server, certs)
    try:
        data, numel = _update(server)
        response = client.upload(
            round_number=0, data=data, codec="none", shape=[numel], sample_weight=1.0, metrics={}
        )
        assert response.complete
        num_chunks = -(-len(data) // CHUNK)
        first_attempt, resumed = log[:3], log[3:]
        cut_share = first_attempt[1][1]
        assert len(cut_share) == 3  # the cut stream delivered 3 chunks, then broke
        assert resumed, "the missing chunks went out again"
        resent = set().union(*(set(sent) for _, sent in resumed))
        whole = [set(sent) for _, sent in (first_attempt[0], first_attempt[2])]
        # Only the cut stream's share was sent again (UploadStatus said what was missing): none
        # of the chunks the two whole streams delivered, and every chunk the cut one lacked.
        residue = cut_share[0] % 3
        assert all(index % 3 == residue for index in resent)
        assert not resent & (whole[0] | whole[1])
        assert {i for i in range(num_chunks) if i % 3 == residue} - set(cut_share) <= resent
        assert _added_whole(server, data)
    finally:
        client.close()
        other.close()


def test_interleave_deals_every_index_once_round_robin() -> None:
    assert interleave([(0, 7)], 3) == [[(0, 1), (3, 4), (6, 7)], [(1, 2), (4, 5)], [(2, 3), (5, 6)]]
    assert interleave([(2, 4), (9, 10)], 1) == [[(2, 4), (9, 10)]]
    assert interleave([(0, 2)], 4) == [[(0, 1)], [(1, 2)]]  # never an empty stream


def test_auto_picks_one_stream_for_small_payloads_and_more_for_large_ones() -> None:
    mib = 1 << 20
    assert choose_streams("auto", 10 * mib, 10) == 1
    assert choose_streams("auto", 200 * mib, 200) == 4
    assert choose_streams("auto", 1 << 30, 1024) == 4
    assert choose_streams(8, 1 << 30, 3) == 3  # never more streams than chunks
    assert choose_streams(2, 1, 1) == 1


def test_parallel_streams_setting_is_validated_with_a_clear_error() -> None:
    assert parse_parallel_streams("auto") == "auto"
    assert parse_parallel_streams("4") == 4
    assert SiteAgentConfig(parallel_streams=2).parallel_streams == 2
    for bad in (0, 33, "many", 1.5, True):
        with pytest.raises(ValueError, match="parallel_streams"):
            SiteAgentConfig(parallel_streams=bad)


def test_site_command_takes_parallel_streams_and_refuses_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from geoloco.scenarios import site_cmd

    parser = argparse.ArgumentParser()
    site_cmd.register(parser.add_subparsers(dest="command"))
    base = ["site", "--coordinator", "localhost:1", "--name", "a", "--insecure"]
    known, _ = parser.parse_known_args([*base, "--parallel-streams", "3"])
    assert known.parallel_streams == 3
    known, _ = parser.parse_known_args(base)
    assert known.parallel_streams == "auto"
    with pytest.raises(SystemExit):
        parser.parse_known_args([*base, "--parallel-streams", "0"])
    assert "parallel_streams must be 'auto' or an integer in 1..32" in capsys.readouterr().err


# --- downloads: FetchModel over K strided streams (chunk_stride) ------------------------------


@pytest.fixture
def big_server(certs: Path) -> Iterator[tuple[CoordinatorServer, torch.Tensor]]:
    """A model of ~8.6 MB (3 streams at the most chunks can be of 4 MiB) in 64 KiB chunks."""
    model = torch.nn.Linear(1024, 2100)
    layout = ParamLayout.from_model(model)
    weights = layout.flatten(model)
    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(inner_steps=1), certs_dir=str(certs), min_sites=2, total_rounds=3,
        chunk_size=64 * 1024,
    )
    server = CoordinatorServer(config, weights.clone(), layout)
    server.start()
    yield server, weights
    server.stop(grace=0)


class _WatchedStream:
    """A FetchModel call that records the chunk indices it delivered and, past ``limit``
    chunks, is cancelled (a stream cut mid-transfer)."""

    def __init__(self, call: Any, received: list[int], limit: int | None) -> None:
        self._call, self._received, self._limit = call, received, limit

    def __iter__(self) -> _WatchedStream:
        return self

    def __next__(self) -> Any:
        if self._limit is not None and len(self._received) >= self._limit:
            self._call.cancel()
        response = next(self._call)
        if response.WhichOneof("kind") == "chunk":
            self._received.append(response.chunk.index)
        return response

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


class FetchWatch(grpc.UnaryStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, log: list[tuple[int, int, list[int]]], cut: dict[str, int], method: str = "/FetchModel") -> None:
        self.log, self.cut, self.lock, self.method = log, cut, threading.Lock(), method

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        call = continuation(details, request)
        if not details.method.endswith(self.method):
            return call
        received: list[int] = []
        with self.lock:
            number = len(self.log)
            self.log.append((request.start_chunk, request.chunk_stride, received))
        limit = self.cut.get("after") if self.cut.get("call") == number else None
        return _WatchedStream(call, received, limit)


def _fetching_client(
    server: CoordinatorServer, certs: Path, log: list[tuple[int, int, list[int]]], cut: dict[str, int]
) -> tuple[CoordinatorClient, grpc.Channel]:
    watch = FetchWatch(log, cut)
    client = CoordinatorClient(
        f"localhost:{server.port}", site="a", tls=TLSFiles.from_dir(certs, "a"), insecure=False,
        config=SiteAgentConfig(parallel_streams=3, backoff_initial_s=0.05, backoff_max_s=0.1),
        stop_event=threading.Event(), interceptors=[watch],
    )
    return client, _join_both(client, server, certs)


def test_fetch_model_over_three_streams_is_bit_identical_each_stream_a_disjoint_share(
    big_server: tuple[CoordinatorServer, torch.Tensor], certs: Path
) -> None:
    server, expected = big_server
    log: list[tuple[int, int, list[int]]] = []
    client, other = _fetching_client(server, certs, log, {})
    try:
        _, weights = client.fetch_model(expected.numel())
        assert torch.equal(weights, expected)
        num_chunks = -(-expected.numel() * 4 // (64 * 1024))
        assert sorted((start, stride) for start, stride, _ in log) == [(0, 3), (1, 3), (2, 3)]
        for start, _, received in log:
            assert received == list(range(start, num_chunks, 3))  # its share, in order, once
    finally:
        client.close()
        other.close()


def test_a_fetch_stream_cut_mid_transfer_resumes_its_own_share_only(
    big_server: tuple[CoordinatorServer, torch.Tensor], certs: Path
) -> None:
    server, expected = big_server
    log: list[tuple[int, int, list[int]]] = []
    client, other = _fetching_client(server, certs, log, {"call": 1, "after": 5})
    try:
        _, weights = client.fetch_model(expected.numel())
        assert torch.equal(weights, expected)
        num_chunks = -(-expected.numel() * 4 // (64 * 1024))
        cut_start, _, cut_received = log[1]
        assert len(cut_received) == 5
        resumed = log[3:]
        assert len(resumed) == 1, log  # only the cut stream went again ...
        start, stride, received = resumed[0]
        # ... from its first missing chunk, with its own stride, and only its own share.
        assert stride == 3 and start == cut_start + 5 * 3
        assert received == list(range(start, num_chunks, 3))
    finally:
        client.close()
        other.close()


def _broadcast_round(certs: Path, log: list[tuple[int, int, list[int]]], cut: dict[str, int]) -> tuple[Any, int]:
    """One round of one site with K=3; the header and the delta's number of chunks."""
    model = torch.nn.Linear(1024, 2100)
    layout = ParamLayout.from_model(model)
    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(inner_steps=1), certs_dir=str(certs), min_sites=1, total_rounds=3,
        chunk_size=64 * 1024,
    )
    server = CoordinatorServer(config, layout.flatten(model), layout)
    server.start()
    client = CoordinatorClient(
        f"localhost:{server.port}", site="a", tls=TLSFiles.from_dir(certs, "a"), insecure=False,
        config=SiteAgentConfig(parallel_streams=3, chunk_size=64 * 1024),
        stop_event=threading.Event(), interceptors=[FetchWatch(log, cut, "/AwaitBroadcast")],
    )
    try:
        client.join(has_weights=False, weights_round=0, digest_hex=None)
        numel = layout.numel
        update = torch.randn(numel, generator=torch.Generator().manual_seed(5))
        data = parse_codec("none").encode(update, seed=0).to_bytes()
        opened = client.open_broadcast(0)
        uploaded = client.upload(
            round_number=0, data=data, codec="none", shape=[numel], sample_weight=1.0, metrics={}
        )
        assert uploaded.complete
        header, delta = client.await_broadcast(0, opened=opened)
        assert header.action == pb.BROADCAST_ACTION_APPLY_DELTA and delta is not None
        assert len(delta) == header.delta.total_bytes  # and its SHA-256 was checked
        assert header.delta.num_chunks >= 3
        return header, header.delta.num_chunks
    finally:
        client.close()
        server.stop(grace=0)


def test_a_broadcast_over_three_streams_arrives_verified_each_stream_a_disjoint_share(certs: Path) -> None:
    log: list[tuple[int, int, list[int]]] = []
    _, num_chunks = _broadcast_round(certs, log, {})
    assert sorted((start, stride) for start, stride, _ in log) == [(0, 3), (1, 3), (2, 3)]
    for start, _, received in log:
        assert received == list(range(start, num_chunks, 3))


def test_a_broadcast_stream_cut_mid_transfer_resumes_its_own_share_only(certs: Path) -> None:
    log: list[tuple[int, int, list[int]]] = []
    _, num_chunks = _broadcast_round(certs, log, {"call": 1, "after": 4})
    cut_start, _, cut_received = log[1]
    assert len(cut_received) == 4
    assert len(log) == 4, log  # the three streams and one resumption of the cut one
    start, stride, received = log[3]
    assert stride == 3 and start == cut_start + 4 * 3
    assert received == list(range(start, num_chunks, 3))


def test_auto_uploads_feed_the_tuner_which_picks_the_next_k(
    server: CoordinatorServer, certs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``auto`` the client measures each whole upload and asks ``StreamTuner`` for K: the
    first upload goes over one stream, and its throughput makes the tuner probe two next."""
    from geoloco.site_agent import client_streams

    monkeypatch.setattr(client_streams, "MIN_MEASURED_BYTES", 1)
    monkeypatch.setattr(client_streams, "AUTO_BYTES_PER_STREAM", 1024)
    log: list[tuple[str, list[int]]] = []
    client = _client(server, certs, "auto", log, {})
    other = _join_both(client, server, certs)
    try:
        data, numel = _update(server)
        assert client.upload(
            round_number=0, data=data, codec="none", shape=[numel], sample_weight=1.0, metrics={}
        ).complete
        assert len(log) == 1  # one stream: nothing measured before
        assert set(client.streams.upload.rates) == {1} and client.streams.upload.rates[1] > 0
        assert client.streams.upload.choose(len(data), -(-len(data) // CHUNK)) == 2
    finally:
        client.close()
        other.close()


def test_auto_broadcasts_are_timed_from_their_header_and_feed_the_download_tuner(
    certs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first broadcast goes over one stream; its transfer (header to verified bytes, not the
    wait for the round) is measured, and the next broadcast probes two streams."""
    from geoloco.site_agent import client_streams

    monkeypatch.setattr(client_streams, "MIN_MEASURED_BYTES", 1)
    monkeypatch.setattr(client_streams, "AUTO_BYTES_PER_STREAM", 1024)
    monkeypatch.setattr(client_streams, "MAX_CHUNK_SIZE", 16 * 1024)  # caps K for a download's size
    model = torch.nn.Linear(256, 256)
    layout = ParamLayout.from_model(model)
    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(inner_steps=1), certs_dir=str(certs), min_sites=1, total_rounds=3,
        chunk_size=16 * 1024,
    )
    server = CoordinatorServer(config, layout.flatten(model), layout)
    server.start()
    client = CoordinatorClient(
        f"localhost:{server.port}", site="a", tls=TLSFiles.from_dir(certs, "a"), insecure=False,
        config=SiteAgentConfig(parallel_streams="auto", chunk_size=16 * 1024), stop_event=threading.Event(),
    )
    try:
        client.join(has_weights=False, weights_round=0, digest_hex=None)
        data = parse_codec("none").encode(torch.randn(layout.numel), seed=0).to_bytes()
        assert client.upload(
            round_number=0, data=data, codec="none", shape=[layout.numel], sample_weight=1.0, metrics={}
        ).complete
        header, delta = client.await_broadcast(0)
        assert delta is not None and len(delta) == header.delta.total_bytes
        assert set(client.streams.download.rates) == {1}
        assert client.streams.for_broadcast(len(delta)) == 2
    finally:
        client.close()
        server.stop(grace=0)

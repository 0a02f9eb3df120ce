"""Floods and garbage over real gRPC with mutual TLS: the run's own sites stay served.

A coordinator on a loopback port with a small thread pool (``max_sites``) meets idle Upload
streams that never send a byte -- from a certificate outside ``allowed_sites``, from a listed
site that opens too many, from everyone beyond the total bound -- and request bytes that are no
protobuf at all. Each is refused with its own status and counted as a rejected request, while
the legitimate sites' heartbeats are answered and their round closes with the right weights.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from _round_helpers import FakeClock, chunk_requests, encode_update, tiny_weights, upload_manifest

from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator import events as ev
from geoloco.coordinator.admission_config import CONTROL_PER_PEER
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.server import CoordinatorServer
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.protocol_version import PROTOCOL_VERSION
from geoloco.protos.transport_endpoints import client_channel, coordinator_stub
from geoloco.protos.transport_options import SERVICE_NAME, server_workers
from geoloco.protos.transport_tls import TLSFiles
from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_site

ALLOWED = ["a", "b", "c"]
HANG_S = 30.0
"""Client deadline of calls that must be answered: only a real hang (a starved pool) exceeds it."""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    init_ca(directory)
    issue_coordinator(directory)
    for name in [*ALLOWED, "intruder"]:
        issue_site(directory, name)
    return directory


class Rejections:
    """The ``REQUEST_REJECTED`` events of a coordinator (what its counters count)."""

    def __init__(self, server: CoordinatorServer) -> None:
        self.events: list[ev.RoundEvent] = []
        self._lock = threading.Lock()
        server.rounds.events.add_listener(self._on_event)

    def _on_event(self, event: ev.RoundEvent) -> None:
        if event.kind == ev.REQUEST_REJECTED:
            with self._lock:
                self.events.append(event)

    def count(self, method: str, code: grpc.StatusCode) -> int:
        with self._lock:
            return sum(1 for e in self.events if e.data["method"] == method and e.data["code"] == code.name)


def _admission(**settings: object) -> object:
    """An ``[admission]`` table (imported here: the tests of behaviour that predates it must
    run, and fail, without it)."""
    from geoloco.coordinator.admission_config import AdmissionConfig

    return AdmissionConfig(**settings)  # type: ignore[arg-type]


def _start(certs: Path, *, clock: Callable[[], float] | None = None, **overrides: object) -> CoordinatorServer:
    weights, layout = tiny_weights()
    settings: dict[str, object] = {
        "algorithm": AlgorithmConfig(inner_steps=1),
        "certs_dir": str(certs),
        "allowed_sites": ALLOWED,
        "min_sites": 2,
        "total_rounds": 3,
        "max_sites": 2,  # a 16-thread main pool: a few dozen idle streams would fill it
    }
    settings.update(overrides)
    server = CoordinatorServer(CoordinatorConfig(**settings), weights, layout,  # type: ignore[arg-type]
                               **({} if clock is None else {"clock": clock}))
    server.start()
    return server


class Site:
    """A raw gRPC client holding one certificate."""

    def __init__(self, certs: Path, port: int, name: str) -> None:
        self.channel = client_channel(f"localhost:{port}", tls=TLSFiles.from_dir(certs, name))
        self.stub = coordinator_stub(self.channel)
        self.session = ""

    def join(self) -> None:
        self.session = self.stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=HANG_S).session_id

    def heartbeat(self) -> pb.HeartbeatResponse:
        return self.stub.Heartbeat(pb.HeartbeatRequest(session_id=self.session), timeout=HANG_S)

    def upload(self, server: CoordinatorServer, seed: int) -> pb.UploadResponse:
        update = torch.randn(server.rounds.numel, generator=torch.Generator().manual_seed(seed))
        data, spec = encode_update(update)
        manifest = upload_manifest(self.session, server.rounds.round, data, codec=spec, numel=server.rounds.numel)

        def stream() -> Iterator[pb.UploadRequest]:
            yield pb.UploadRequest(manifest=manifest)
            yield from chunk_requests(manifest, data)

        return self.stub.Upload(stream(), timeout=HANG_S)

    def close(self) -> None:
        self.channel.close()


class IdleStreams:
    """``count`` Upload streams that open and never send a message (until ``release``)."""

    def __init__(self, site: Site, count: int) -> None:
        self._gate = threading.Event()
        self.calls = [site.stub.Upload.future(self._idle(), timeout=120) for _ in range(count)]

    @classmethod
    def on(cls, stub: object, count: int) -> IdleStreams:
        """The same streams through a bare stub (an insecure client claiming no name yet)."""
        streams = cls.__new__(cls)
        streams._gate = threading.Event()
        streams.calls = [stub.Upload.future(streams._idle(), timeout=120) for _ in range(count)]  # type: ignore[attr-defined]
        return streams

    def _idle(self) -> Iterator[pb.UploadRequest]:
        self._gate.wait()
        yield from ()

    def ended_with(self, code: grpc.StatusCode) -> int:
        return sum(
            1 for call in self.calls
            if call.done() and not call.cancelled() and isinstance(call.exception(), grpc.RpcError)
            and call.exception().code() == code
        )

    def refused(self, code: grpc.StatusCode, expected: int) -> int:
        """How many ended with ``code``, once ``expected`` did (or ``HANG_S`` passed)."""
        gate = threading.Event()
        for _ in range(int(HANG_S / 0.05)):
            if self.ended_with(code) >= expected:
                break
            gate.wait(0.05)
        return self.ended_with(code)

    def still_open(self) -> int:
        return sum(1 for call in self.calls if not call.done())

    def release(self) -> None:
        self._gate.set()
        for call in self.calls:
            call.cancel()


def _wait(predicate: Callable[[], bool], server: CoordinatorServer, timeout_s: float = HANG_S) -> bool:
    for _ in range(int(timeout_s / 0.1)):
        if predicate():
            return True
        server.rounds.wait_for_change(0.1)
    return predicate()


def test_idle_streams_from_an_unlisted_certificate_are_refused_before_any_read(certs: Path) -> None:
    """Three times the whole thread pool of idle streams from "intruder": every one is refused
    PERMISSION_DENIED (no message was ever sent, so the check ran before the first read) and
    counted, while "a" and "b" heartbeat, upload and close their round."""
    server = _start(certs)
    rejections = Rejections(server)
    flood_size = 3 * server_workers(2)
    intruder, a, b = (Site(certs, server.port, n) for n in ("intruder", "a", "b"))
    flood = IdleStreams(intruder, flood_size)
    try:
        assert flood.refused(grpc.StatusCode.PERMISSION_DENIED, flood_size) == flood_size
        assert rejections.count("Upload", grpc.StatusCode.PERMISSION_DENIED) == flood_size
        a.join()
        b.join()
        assert not a.heartbeat().rejoin_required and not b.heartbeat().rejoin_required
        assert a.upload(server, 1).complete and b.upload(server, 2).complete
        assert _wait(lambda: server.rounds.round == 1, server)
        assert sorted(server.rounds.members) == ["a", "b"]
    finally:
        flood.release()
        for site in (intruder, a, b):
            site.close()
        server.stop(grace=0)


def test_a_listed_site_gets_its_per_peer_share_and_idle_reads_are_cut(certs: Path) -> None:
    """"c" opens 3x its per-peer share of idle streams: the share is admitted, the rest refused
    RESOURCE_EXHAUSTED; the admitted ones are cancelled DEADLINE_EXCEEDED once idle for
    ``stream_idle_timeout_s``; "a" and "b" are answered all along and their round closes."""
    share = 6
    # max_sites 8: 32 streams, so the per-peer bound binds before the other sites' reserves do.
    server = _start(certs, max_sites=8, admission=_admission(max_rpcs_per_peer=share, stream_idle_timeout_s=1.0))
    rejections = Rejections(server)
    theta = server.rounds.weights.clone()
    a, b, c = (Site(certs, server.port, n) for n in ("a", "b", "c"))
    flood = IdleStreams(c, 3 * share)
    try:
        assert flood.refused(grpc.StatusCode.RESOURCE_EXHAUSTED, 2 * share) == 2 * share
        assert rejections.count("Upload", grpc.StatusCode.RESOURCE_EXHAUSTED) == 2 * share
        a.join()
        b.join()
        assert not a.heartbeat().rejoin_required
        assert flood.refused(grpc.StatusCode.DEADLINE_EXCEEDED, share) == share
        assert _wait(lambda: rejections.count("Upload", grpc.StatusCode.DEADLINE_EXCEEDED) == share, server)
        assert server.admission.open_calls("c") == 0
        assert torch.equal(server.rounds.weights, theta)
        assert a.upload(server, 1).complete and b.upload(server, 2).complete
        assert _wait(lambda: server.rounds.round == 1, server)
    finally:
        flood.release()
        for site in (a, b, c):
            site.close()
        server.stop(grace=0)


def test_unary_calls_that_never_send_their_request_do_not_starve_heartbeats(certs: Path) -> None:
    """A listed site opens Heartbeat calls whose request message never comes (headers only),
    twice its per-peer share: the extra ones are refused RESOURCE_EXHAUSTED, the admitted ones
    are cancelled DEADLINE_EXCEEDED once idle, and "a" joins and heartbeats meanwhile. (grpc reads
    a unary request on a worker thread before any handler code runs; these used to hold a
    thread each, unseen, for as long as the client liked.)"""
    share = 6
    admitted = min(share, CONTROL_PER_PEER)  # one identity's share of the control pool
    server = _start(certs, admission=_admission(max_rpcs_per_peer=share, stream_idle_timeout_s=1.0))
    rejections = Rejections(server)
    a, c = Site(certs, server.port, "a"), Site(certs, server.port, "c")
    half_open = c.channel.stream_unary(f"/{SERVICE_NAME}/Heartbeat")
    flood = IdleStreams.on(type("Stub", (), {"Upload": half_open})(), 2 * share)
    try:
        assert flood.refused(grpc.StatusCode.RESOURCE_EXHAUSTED, 2 * share - admitted) == 2 * share - admitted
        a.join()
        assert not a.heartbeat().rejoin_required
        assert flood.refused(grpc.StatusCode.DEADLINE_EXCEEDED, admitted) == admitted
        assert rejections.count("Heartbeat", grpc.StatusCode.RESOURCE_EXHAUSTED) == 2 * share - admitted
        assert _wait(lambda: rejections.count("Heartbeat", grpc.StatusCode.DEADLINE_EXCEEDED) == admitted, server)
        assert server.admission.open_calls("c") == 0
        assert server.rounds.members == ["a"]
    finally:
        flood.release()
        a.close()
        c.close()
        server.stop(grace=0)


def test_insecure_idle_streams_are_bounded_in_total_and_cut_when_idle(certs: Path) -> None:
    """With ``--insecure`` callers cannot be told apart: idle streams beyond ``max_streams`` are
    refused UNAVAILABLE, the admitted ones are cancelled DEADLINE_EXCEEDED once idle, and a site
    joins and heartbeats throughout (its calls run on the control pool)."""
    weights, layout = tiny_weights()
    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(inner_steps=1), insecure=True, min_sites=1, total_rounds=3, max_sites=2,
        admission=_admission(max_streams=4, stream_idle_timeout_s=1.0),  # type: ignore[arg-type]
    )
    server = CoordinatorServer(config, weights, layout)
    server.start()
    rejections = Rejections(server)
    channel = client_channel(server.address, tls=None, insecure=True)
    stub = coordinator_stub(channel)
    flood = IdleStreams.on(stub, 12)
    try:
        assert flood.refused(grpc.StatusCode.UNAVAILABLE, 8) == 8
        session = stub.Join(pb.JoinRequest(site="a", protocol_version=PROTOCOL_VERSION), timeout=HANG_S).session_id
        beat = stub.Heartbeat(pb.HeartbeatRequest(site="a", session_id=session), timeout=HANG_S)
        assert not beat.rejoin_required
        assert flood.refused(grpc.StatusCode.DEADLINE_EXCEEDED, 4) == 4
        assert rejections.count("Upload", grpc.StatusCode.UNAVAILABLE) == 8
        assert _wait(lambda: rejections.count("Upload", grpc.StatusCode.DEADLINE_EXCEEDED) == 4, server)
        assert server.admission.open_calls() == 0
    finally:
        flood.release()
        channel.close()
        server.stop(grace=0)


def test_beyond_the_total_stream_bound_calls_are_unavailable_but_heartbeats_answered(certs: Path) -> None:
    """Idle streams of "b" and "c" take every long-lived slot but the one kept in reserve for
    "a" (5 slots, 3 identities, one each): "c"'s calls beyond it are refused UNAVAILABLE (a site
    retries), "a" still gets its slot, and heartbeats, on their own pool, are answered."""
    server = _start(certs, admission=_admission(max_rpcs_per_peer=4, max_streams=5))
    rejections = Rejections(server)
    a, b, c = (Site(certs, server.port, n) for n in ("a", "b", "c"))
    floods: list[IdleStreams] = []
    try:
        a.join()
        assert not a.heartbeat().rejoin_required
        floods = [IdleStreams(b, 3)]
        assert _wait(lambda: server.admission.open_calls() == 3, server)
        floods.append(IdleStreams(c, 3))
        assert floods[1].refused(grpc.StatusCode.UNAVAILABLE, 2) == 2
        assert server.admission.open_calls() == 4 and floods[1].still_open() == 1
        floods.append(IdleStreams(a, 2))
        assert floods[2].refused(grpc.StatusCode.UNAVAILABLE, 1) == 1
        assert server.admission.open_calls() == 5 and floods[2].still_open() == 1
        assert rejections.count("Upload", grpc.StatusCode.UNAVAILABLE) == 3
        for _ in range(3):
            assert not a.heartbeat().rejoin_required
    finally:
        for flood in floods:
            flood.release()
        for site in (a, b, c):
            site.close()
        server.stop(grace=0)


def test_two_listed_sites_holding_idle_joins_do_not_starve_the_others_heartbeats(certs: Path) -> None:
    """"c" and "intruder" (both listed) each open 16 Joins that send headers and never their
    message, more than the whole control pool used to hold (16 + 8 threads): each keeps only
    its share of the pool, the rest is refused RESOURCE_EXHAUSTED at once, and "a" and "b" join
    and heartbeat at once throughout (they used to wait for the idle timeout and be dropped)."""
    listed = ["a", "b", "c", "intruder"]
    server = _start(certs, allowed_sites=listed, admission=_admission(stream_idle_timeout_s=20.0))
    rejections = Rejections(server)
    a, b, c, intruder = (Site(certs, server.port, n) for n in listed)
    floods = [
        IdleStreams.on(type("Stub", (), {"Upload": site.channel.stream_unary(f"/{SERVICE_NAME}/Join")})(), 16)
        for site in (c, intruder)
    ]
    try:
        for flood in floods:
            assert flood.refused(grpc.StatusCode.RESOURCE_EXHAUSTED, 16 - CONTROL_PER_PEER) == 16 - CONTROL_PER_PEER
            assert flood.still_open() == CONTROL_PER_PEER
        for site in (a, b):
            session = site.stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=5.0).session_id
            site.session = session
        for _ in range(3):
            for site in (a, b):
                beat = site.stub.Heartbeat(pb.HeartbeatRequest(session_id=site.session), timeout=5.0)
                assert not beat.rejoin_required
        assert rejections.count("Join", grpc.StatusCode.RESOURCE_EXHAUSTED) == 2 * (16 - CONTROL_PER_PEER)
        assert sorted(server.rounds.members) == ["a", "b"]
    finally:
        for flood in floods:
            flood.release()
        for site in (a, b, c, intruder):
            site.close()
        server.stop(grace=0)


def test_two_listed_sites_holding_idle_uploads_leave_an_honest_site_its_streams(certs: Path) -> None:
    """"c" and "intruder" each hold 16 idle Upload streams (their per-peer bound): the streams
    beyond their reserve are refused UNAVAILABLE while the honest sites' reserves would not fit
    any more, so "a" and "b" upload, and their round closes (before, the two filled
    ``max_streams`` and honest uploads got UNAVAILABLE)."""
    listed = ["a", "b", "c", "intruder"]
    server = _start(certs, allowed_sites=listed)
    rejections = Rejections(server)
    limits = server.admission.limits
    a, b, c, intruder = (Site(certs, server.port, n) for n in listed)
    floods: list[IdleStreams] = []
    try:
        a.join()
        b.join()
        floods = [IdleStreams(c, 16)]
        assert _wait(
            lambda: server.admission.open_calls("c") >= 2 and floods[0].ended_with(grpc.StatusCode.UNAVAILABLE) > 0,
            server,
        )
        floods.append(IdleStreams(intruder, 16))
        assert floods[1].refused(grpc.StatusCode.UNAVAILABLE, 1) >= 1
        assert server.admission.open_calls() <= limits.max_streams - 2 * 2  # a's and b's reserves stay free
        assert a.upload(server, 1).complete and b.upload(server, 2).complete
        assert _wait(lambda: server.rounds.round == 1, server)
        assert rejections.count("Upload", grpc.StatusCode.UNAVAILABLE) >= 2
    finally:
        for flood in floods:
            flood.release()
        for site in (a, b, c, intruder):
            site.close()
        server.stop(grace=0)


def test_a_relay_certificate_not_in_relays_is_refused_before_any_read(tmp_path: Path) -> None:
    """A relay certificate of the run's CA whose name ``[relays]`` does not list gets
    PERMISSION_DENIED on its first call, before anything is read, as an unlisted site does (it
    used to be admitted and hold its streams until the idle timeout)."""
    from geoloco.scenarios.certs import issue_relay

    init_ca(tmp_path)
    issue_coordinator(tmp_path)
    for name in ("a", "b"):
        issue_site(tmp_path, name)
    issue_relay(tmp_path, "eu")
    issue_relay(tmp_path, "rogue")
    server = _start(tmp_path, allowed_sites=["a", "b"], relays={"eu": ["a", "b"]})
    rejections = Rejections(server)
    rogue = Site(tmp_path, server.port, "rogue")
    flood = IdleStreams(rogue, 8)
    try:
        assert flood.refused(grpc.StatusCode.PERMISSION_DENIED, 8) == 8
        assert rejections.count("Upload", grpc.StatusCode.PERMISSION_DENIED) == 8
        details = flood.calls[0].exception().details()
        assert "relay 'rogue' is not in this coordinator's [relays] table" in details and "eu" in details
        assert server.admission.open_calls() == 0
    finally:
        flood.release()
        rogue.close()
        server.stop(grace=0)


def test_malformed_request_bytes_are_invalid_argument_and_counted(certs: Path) -> None:
    """Bytes that are no protobuf message (a length prefix running past the end) for a unary
    method and for the Upload stream: INVALID_ARGUMENT naming the message type, counted, and
    the model untouched."""
    server = _start(certs)
    rejections = Rejections(server)
    theta = server.rounds.weights.clone()
    garbage = b"\x0a\x7fnot a message"
    a = Site(certs, server.port, "a")
    try:
        a.join()
        heartbeat = a.channel.unary_unary(f"/{SERVICE_NAME}/Heartbeat")
        with pytest.raises(grpc.RpcError) as unary:
            heartbeat(garbage, timeout=HANG_S)
        assert unary.value.code() == grpc.StatusCode.INVALID_ARGUMENT, unary.value.details()
        assert "HeartbeatRequest" in unary.value.details()
        upload = a.channel.stream_unary(f"/{SERVICE_NAME}/Upload")
        with pytest.raises(grpc.RpcError) as stream:
            upload(iter([garbage]), timeout=HANG_S)
        assert stream.value.code() == grpc.StatusCode.INVALID_ARGUMENT, stream.value.details()
        assert "UploadRequest" in stream.value.details()
        assert rejections.count("Heartbeat", grpc.StatusCode.INVALID_ARGUMENT) == 1
        assert rejections.count("Upload", grpc.StatusCode.INVALID_ARGUMENT) == 1
        assert torch.equal(server.rounds.weights, theta)
        assert server.rounds.status()["contributed"] == []
        assert not a.heartbeat().rejoin_required
    finally:
        a.close()
        server.stop(grace=0)


def test_a_join_that_never_calls_again_is_dropped_after_the_grace(certs: Path) -> None:
    """Insecure mode: "ghost" joins under a made-up name and never calls again. The round waits
    for it only ``silent_join_grace_s``, not ``heartbeat_timeout_s``: it closes with "a"'s update
    while "a" itself, which called since joining, stays a member."""
    clock = FakeClock()
    weights, layout = tiny_weights()
    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(inner_steps=1), insecure=True, min_sites=1, total_rounds=3,
        heartbeat_interval_s=1.0, heartbeat_timeout_s=60.0,
        admission=_admission(silent_join_grace_s=5.0),
    )
    server = CoordinatorServer(config, weights, layout, clock=clock)
    server.start()
    dropped: list[ev.RoundEvent] = []
    server.rounds.events.add_listener(lambda e: dropped.append(e) if e.kind == ev.SITE_DROPPED else None)
    channel = client_channel(server.address, tls=None, insecure=True)
    stub = coordinator_stub(channel)
    try:
        session = stub.Join(pb.JoinRequest(site="a", protocol_version=PROTOCOL_VERSION), timeout=HANG_S).session_id
        stub.Join(pb.JoinRequest(site="ghost", protocol_version=PROTOCOL_VERSION), timeout=HANG_S)
        update = torch.randn(server.rounds.numel, generator=torch.Generator().manual_seed(3))
        data, spec = encode_update(update)
        manifest = upload_manifest(session, 0, data, codec=spec, numel=server.rounds.numel, site="a")
        requests = [pb.UploadRequest(manifest=manifest), *chunk_requests(manifest, data)]
        assert stub.Upload(iter(requests), timeout=HANG_S).complete
        clock.advance(4.0)
        server.rounds.wake()
        assert sorted(server.rounds.members) == ["a", "ghost"], "dropped before its grace"
        clock.advance(2.0)
        server.rounds.wake()
        assert _wait(lambda: server.rounds.round == 1, server)
        assert server.rounds.members == ["a"]
        assert [e.site for e in dropped] == ["ghost"]
    finally:
        channel.close()
        server.stop(grace=0)


@pytest.mark.parametrize(
    ("admission", "key"),
    [
        ({"silent_join_grace_s": 30.0}, "admission.silent_join_grace_s"),
        ({"silent_join_grace_s": 1.0}, "admission.silent_join_grace_s"),
        ({"max_streams": server_workers(64)}, "admission.max_streams"),
        ({"max_streams": 10, "max_concurrent_rpcs": 10}, "admission.max_concurrent_rpcs"),
        ({"max_rpcs_per_peer": 2}, "admission.max_rpcs_per_peer"),
        ({"stream_idle_timeout_s": 0}, "admission.stream_idle_timeout_s"),
    ],
)
def test_admission_keys_are_validated_with_their_dotted_name(admission: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        CoordinatorConfig.from_dict({"insecure": True, "heartbeat_interval_s": 2.0, "heartbeat_timeout_s": 15.0,
                                     "admission": admission})
    assert info.value.key == key


def test_admission_defaults_follow_max_sites_and_the_heartbeat() -> None:
    limits = CoordinatorConfig(insecure=True, max_sites=10, heartbeat_interval_s=2.0).admission_limits
    assert limits.workers == server_workers(10)
    assert limits.max_streams < limits.workers < limits.max_concurrent_rpcs
    assert limits.silent_join_grace_s == 15.0  # unset: no shorter grace than heartbeat_timeout_s

"""A site name is a lease held by one process, over real gRPC with mutual TLS (raw stubs).

Two processes holding the same certificate are told apart by ``JoinRequest.instance_id``. The
newer Join takes the name (a site restarted after ``kill -9`` is back at once); the coordinator
says so at WARNING naming both, and from then on every request of the older process is refused
with ``ERROR_REASON_SITE_REPLACED`` -- its heartbeat, its upload, its Leave (which would end the
newer one's membership), its Join, and an AwaitBroadcast it was already waiting in, which must
not hand it a header whose ``included`` speaks of the newer process's update. Under secure
aggregation its SecureStage calls are refused too: they would advertise keys, or withdraw from the
secure round, in the name the newer process holds.

Also here: a manifest conflict whose checksums are equal names the field that differs.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from _round_helpers import chunk_requests, encode_update, tiny_weights, upload_manifest

from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
from geoloco.algorithms.privacy.secagg_messages import STAGE_CONSISTENCY, STAGE_WITHDRAW
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.server import CoordinatorServer
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import secagg_wire
from geoloco.protos.protocol_version import PROTOCOL_VERSION
from geoloco.protos.transport_endpoints import client_channel, coordinator_stub
from geoloco.protos.transport_errors import error_reason
from geoloco.protos.transport_tls import TLSFiles
from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_site

OLD, NEW = "0ld0ld0ld0ld", "n3wn3wn3wn3w"
"""Instance ids of the two processes of site "a" (their first 8 characters appear in messages)."""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    init_ca(directory)
    issue_coordinator(directory)
    for name in ("a", "b"):
        issue_site(directory, name)
    return directory


def _start(certs: Path, **settings: object) -> Iterator[CoordinatorServer]:
    weights, layout = tiny_weights()
    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(inner_steps=1), certs_dir=str(certs), total_rounds=3, chunk_size=16,
        progress_interval_s=0.5, **settings,  # type: ignore[arg-type]
    )
    server = CoordinatorServer(config, weights, layout)
    server.start()
    yield server
    server.stop(grace=0)


@pytest.fixture
def server(certs: Path) -> Iterator[CoordinatorServer]:
    yield from _start(certs, allowed_sites=["a", "b"], min_sites=1)


@pytest.fixture
def secure_server(certs: Path) -> Iterator[CoordinatorServer]:
    """Secure aggregation; its rounds need 3 sites, so with "a" alone stage calls wait."""
    privacy = PrivacyConfig(secure_aggregation=True, clip_norm=1.0)
    yield from _start(certs, allowed_sites=["a", "b", "c"], min_sites=3, privacy=privacy)


class Process:
    """One process of a site: its certificate's channel and its instance id."""

    def __init__(self, certs: Path, port: int, site: str, instance: str) -> None:
        self.channel = client_channel(f"localhost:{port}", tls=TLSFiles.from_dir(certs, site))
        self.stub = coordinator_stub(self.channel)
        self.instance = instance
        self.session = ""

    def join(self) -> pb.JoinResponse:
        response = self.stub.Join(
            pb.JoinRequest(protocol_version=PROTOCOL_VERSION, instance_id=self.instance), timeout=10
        )
        self.session = response.session_id
        return response

    def heartbeat(self) -> pb.HeartbeatResponse:
        return self.stub.Heartbeat(pb.HeartbeatRequest(session_id=self.session, instance_id=self.instance), timeout=10)

    def manifest(self, numel: int, seed: int, **metrics: float) -> tuple[pb.UploadManifest, bytes]:
        update = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
        data, codec = encode_update(update)
        manifest = upload_manifest(self.session, 0, data, codec=codec, numel=numel, chunk_size=16)
        manifest.instance_id = self.instance
        manifest.metrics.update(metrics)
        return manifest, data

    def upload(self, manifest: pb.UploadManifest, data: bytes) -> pb.UploadResponse:
        def stream() -> Iterator[pb.UploadRequest]:
            yield pb.UploadRequest(manifest=manifest)
            yield from chunk_requests(manifest, data)

        return self.stub.Upload(stream(), timeout=10)

    def await_broadcast(self, round_number: int, waiting: threading.Event | None = None) -> pb.BroadcastHeader:
        request = pb.AwaitBroadcastRequest(session_id=self.session, round=round_number, instance_id=self.instance)
        for response in self.stub.AwaitBroadcast(request, timeout=30):
            if response.WhichOneof("kind") == "header":
                return response.header
            if waiting is not None:
                waiting.set()
        raise AssertionError("AwaitBroadcast ended without a header")

    def secure_stage(self, stage: str) -> pb.SecureStageResponse:
        """A call of a stage that carries no message (the stage's wait is not the point here)."""
        request = secagg_wire.stage_request(stage, None, site="", session_id=self.session, round_number=0, wait_ms=0)
        request.instance_id = self.instance
        response: pb.SecureStageResponse = self.stub.SecureStage(request, timeout=10)
        return response

    def leave(self) -> None:
        self.stub.Leave(pb.LeaveRequest(session_id=self.session, instance_id=self.instance), timeout=10)

    def close(self) -> None:
        self.channel.close()


def _replaced(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    error = info.value
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error
    assert error_reason(error) == pb.ERROR_REASON_SITE_REPLACED, error.trailing_metadata()
    return error


def test_the_newer_process_takes_the_name_and_every_request_of_the_older_is_refused(
    server: CoordinatorServer, certs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old, new = Process(certs, server.port, "a", OLD), Process(certs, server.port, "a", NEW)
    try:
        old.join()
        assert not old.heartbeat().rejoin_required
        # The older process waits for round 0's broadcast, as a site does while it uploads; the
        # round closes while it waits (its first progress message says the wait is on).
        waited: list[pb.BroadcastHeader | grpc.RpcError] = []
        waiting = threading.Event()

        def wait() -> None:
            try:
                waited.append(old.await_broadcast(0, waiting))
            except grpc.RpcError as error:
                waited.append(error)

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        assert waiting.wait(30)

        caplog.set_level(logging.INFO, logger="geoloco.coordinator")
        new.join()
        joins = [r for r in caplog.records if r.name == "geoloco.coordinator.membership"]
        assert [r.levelno for r in joins] == [logging.WARNING], [r.getMessage() for r in joins]
        warning = joins[0].getMessage()
        assert "site a" in warning and OLD[:8] in warning and NEW[:8] in warning
        assert warning.count(":") >= 4, warning  # both peers' addresses (ipv4:host:port or ipv6:[::1]:port)

        details = _replaced(old.heartbeat).details()
        assert "another process joined as site 'a' at " in details and " from ip" in details, details
        assert NEW[:8] in details and "this one" in details and "stops" in details, details
        numel = server.rounds.numel
        _replaced(lambda: old.upload(*old.manifest(numel, seed=1)))

        assert new.upload(*new.manifest(numel, seed=2)).complete  # min_sites = 1: round 0 closes
        header = new.await_broadcast(0)
        assert header.included and header.num_contributors == 1
        waiter.join(30)
        assert len(waited) == 1 and isinstance(waited[0], grpc.RpcError), waited
        assert error_reason(waited[0]) == pb.ERROR_REASON_SITE_REPLACED

        _replaced(old.leave)
        assert server.rounds.members == ["a"]  # the older process could not end the newer's membership
        _replaced(old.join)  # nor take the name back
        assert not new.heartbeat().rejoin_required
    finally:
        old.close()
        new.close()


def test_the_secure_stage_calls_of_a_replaced_process_are_refused(
    secure_server: CoordinatorServer, certs: Path
) -> None:
    old, new = Process(certs, secure_server.port, "a", OLD), Process(certs, secure_server.port, "a", NEW)
    try:
        old.join()
        assert not old.secure_stage(STAGE_CONSISTENCY).ready  # served: the round waits for 3 sites
        new.join()
        for stage in (STAGE_CONSISTENCY, STAGE_WITHDRAW):
            details = _replaced(functools.partial(old.secure_stage, stage)).details()
            assert NEW[:8] in details and "this one" in details, details
        assert not new.secure_stage(STAGE_CONSISTENCY).ready
        assert secure_server.rounds.members == ["a"]
    finally:
        old.close()
        new.close()


def test_a_manifest_conflict_with_equal_checksums_names_the_field_that_differs(
    server: CoordinatorServer, certs: Path
) -> None:
    """Two processes (or a restarted one) send the same update bytes with other metrics: the
    refusal used to print two identical checksums; it names the metric instead."""
    a, b = Process(certs, server.port, "a", OLD), Process(certs, server.port, "b", "b")
    try:
        a.join()
        b.join()  # two members: round 0 stays open after a's upload
        manifest, data = a.manifest(server.rounds.numel, seed=3, train_loss=0.5)
        assert a.upload(manifest, data).complete
        again, _ = a.manifest(server.rounds.numel, seed=3, train_loss=0.625)
        with pytest.raises(grpc.RpcError) as info:
            a.upload(again, data)
        assert error_reason(info.value) == pb.ERROR_REASON_MANIFEST_CONFLICT
        details = info.value.details()
        assert "the same bytes (checksum sha256:" in details, details
        assert "metrics['train_loss'] (stored 0.5, sent 0.625)" in details, details
        assert "stored checksum" not in details, details
    finally:
        a.close()
        b.close()

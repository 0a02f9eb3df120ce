"""Bad input over real gRPC with mutual TLS: each gets a precise status and changes nothing.

A raw client (the generated stub, no site agent) sends each kind of malformed or unauthorised
request to a coordinator on a loopback port; after each, the global weights must be bit-for-bit
what they were and no update may have entered the aggregate.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from _round_helpers import chunk_requests, encode_update, tiny_weights, upload_manifest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.server import CoordinatorServer
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.protocol_version import PROTOCOL_VERSION
from geoloco.protos.transport_endpoints import client_channel, coordinator_stub
from geoloco.protos.transport_errors import error_reason
from geoloco.protos.transport_tls import TLSFiles
from geoloco.protos.wire_buffers import MAX_CHUNK_SIZE
from geoloco.protos.wire_chunks import upload_requests
from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_site, load_ca

ALLOWED = ["a", "b"]


def _issue_client_without_site(directory: Path, name: str) -> None:
    """A client certificate signed by the run's CA that names no site (no geoloco URI)."""
    authority = load_ca(directory)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "not a site!")]))
        .issuer_name(authority.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(authority.key, hashes.SHA256())
    )
    (directory / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / f"{name}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    init_ca(directory)
    issue_coordinator(directory)
    for name in [*ALLOWED, "intruder"]:
        issue_site(directory, name)
    _issue_client_without_site(directory, "nosite")
    other = tmp_path_factory.mktemp("other-ca")
    init_ca(other)
    issue_site(other, "a")
    return directory


@pytest.fixture
def server(certs: Path) -> Iterator[CoordinatorServer]:
    weights, layout = tiny_weights()
    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(inner_steps=1),
        certs_dir=str(certs),
        allowed_sites=ALLOWED,
        min_sites=2,
        total_rounds=5,
        max_upload_bytes=1024,
        chunk_size=16,  # several chunks even for the tiny model, to exercise resumption
    )
    server = CoordinatorServer(config, weights, layout)
    server.start()
    yield server
    server.stop(grace=0)


class Client:
    """A raw gRPC client holding one site's certificate."""

    def __init__(self, certs: Path, port: int, name: str, ca_dir: Path | None = None) -> None:
        tls = TLSFiles.from_dir(certs, name)
        if ca_dir is not None:
            tls = TLSFiles(ca=certs / "ca.crt", cert=ca_dir / f"{name}.crt", key=ca_dir / f"{name}.key")
        self.channel = client_channel(f"localhost:{port}", tls=tls)
        self.stub = coordinator_stub(self.channel)
        self.session = ""

    def join(self, site: str = "") -> pb.JoinResponse:
        response = self.stub.Join(
            pb.JoinRequest(site=site, protocol_version=PROTOCOL_VERSION), timeout=10
        )
        self.session = response.session_id
        return response

    def upload(self, manifest: pb.UploadManifest, chunks: Iterator[pb.UploadRequest]) -> pb.UploadResponse:
        def stream() -> Iterator[pb.UploadRequest]:
            yield pb.UploadRequest(manifest=manifest)
            yield from chunks

        return self.stub.Upload(stream(), timeout=10)

    def close(self) -> None:
        self.channel.close()


@pytest.fixture
def client(server: CoordinatorServer, certs: Path) -> Iterator[Client]:
    c = Client(certs, server.port, "a")
    c.join()
    yield c
    c.close()


def _update(seed: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def _expect(code: grpc.StatusCode, call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    error = info.value
    assert error.code() == code, f"expected {code.name}, got {error.code().name}: {error.details()}"
    return error


def _wait_until(predicate: Callable[[], bool], server: CoordinatorServer, timeout_s: float) -> bool:
    """Wait (on the coordinator's state changes, no fixed sleeps) until ``predicate`` holds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        server.rounds.wait_for_change(min(remaining, 0.5))
    return True


def _unchanged(server: CoordinatorServer, theta: torch.Tensor) -> None:
    assert torch.equal(server.rounds.weights, theta), "bad input changed the global weights"
    assert server.rounds.status()["contributed"] == [], "bad input entered the aggregate"


def _good(client: Client, server: CoordinatorServer, seed: int = 1, round_number: int = 0,
          **manifest_overrides: object) -> tuple[pb.UploadManifest, bytes]:
    data, spec = encode_update(_update(seed, server.rounds.numel))
    kwargs: dict[str, object] = {"codec": spec, "numel": server.rounds.numel, "chunk_size": 16}
    kwargs.update(manifest_overrides)
    manifest = upload_manifest(client.session, round_number, data, **kwargs)  # type: ignore[arg-type]
    return manifest, data


@pytest.mark.parametrize(
    ("overrides", "what"),
    [
        ({"shape": [7]}, "shape"),
        ({"dtype": "float16"}, "dtype"),
        ({"codec": "int8:block=256"}, "codec"),
        ({"sample_weight": float("nan")}, "sample_weight"),
    ],
)
def test_manifest_that_does_not_fit_the_run_is_invalid_argument(
    server: CoordinatorServer, client: Client, overrides: dict[str, object], what: str
) -> None:
    theta = server.rounds.weights.clone()
    manifest, data = _good(client, server, **overrides)
    error = _expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: client.upload(manifest, chunk_requests(manifest, data)),
    )
    assert what in error.details()
    _unchanged(server, theta)


def test_bytes_encoded_with_another_codec_are_invalid_argument(
    server: CoordinatorServer, client: Client
) -> None:
    theta = server.rounds.weights.clone()
    data, _ = encode_update(_update(1, server.rounds.numel), "int8")
    manifest = upload_manifest(client.session, 0, data, codec="none", numel=server.rounds.numel)
    error = _expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: client.upload(manifest, chunk_requests(manifest, data)),
    )
    assert "int8" in error.details()
    _unchanged(server, theta)


def test_non_finite_update_is_invalid_argument_and_dropped_for_the_round(
    server: CoordinatorServer, client: Client
) -> None:
    theta = server.rounds.weights.clone()
    poisoned = _update(1, server.rounds.numel)
    poisoned[0] = float("inf")
    data, spec = encode_update(poisoned)
    manifest = upload_manifest(client.session, 0, data, codec=spec, numel=server.rounds.numel)
    _expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: client.upload(manifest, chunk_requests(manifest, data)))
    _unchanged(server, theta)
    again, again_data = _good(client, server, seed=2)
    _expect(
        grpc.StatusCode.FAILED_PRECONDITION,
        lambda: client.upload(again, chunk_requests(again, again_data)),
    )
    _unchanged(server, theta)


def test_old_and_future_rounds_are_failed_precondition(
    server: CoordinatorServer, client: Client, certs: Path
) -> None:
    other = Client(certs, server.port, "b")
    try:
        other.join()
        for c, seed in ((client, 1), (other, 2)):
            manifest, data = _good(c, server, seed=seed)
            assert c.upload(manifest, chunk_requests(manifest, data)).complete
        # The driver thread aggregates round 0 as soon as both uploads are in.
        assert _wait_until(lambda: server.rounds.round == 1, server, timeout_s=30)
    finally:
        other.close()
    theta = server.rounds.weights.clone()
    for round_number in (0, 3):
        manifest, data = _good(client, server, seed=5, round_number=round_number)
        error = _expect(
            grpc.StatusCode.FAILED_PRECONDITION,
            lambda: client.upload(manifest, chunk_requests(manifest, data)),
        )
        assert error_reason(error) == pb.ERROR_REASON_WRONG_ROUND
    _unchanged(server, theta)


def test_duplicate_chunks_across_streams_are_ignored(server: CoordinatorServer, client: Client) -> None:
    manifest, data = _good(client, server)
    chunks = list(chunk_requests(manifest, data))
    assert len(chunks) > 3
    first = client.upload(manifest, iter(chunks[:3]))
    assert not first.complete and first.received_bytes == 3 * 16
    # Resend everything: the three chunks already there are duplicates and are ignored.
    response = client.upload(manifest, iter(chunks))
    assert response.complete and not response.missing
    assert server.rounds.status()["contributed"] == ["a"]


def test_stream_past_the_manifest_is_resource_exhausted(server: CoordinatorServer, client: Client) -> None:
    theta = server.rounds.weights.clone()
    manifest, data = _good(client, server)
    chunks = list(chunk_requests(manifest, data))
    looping = chunks[:-1] + chunks[:2] + chunks[-1:]  # more bytes in one stream than the blob holds
    error = _expect(grpc.StatusCode.RESOURCE_EXHAUSTED, lambda: client.upload(manifest, iter(looping)))
    assert "more than the manifest" in error.details()
    _unchanged(server, theta)


def test_oversize_chunk_is_resource_exhausted(server: CoordinatorServer, client: Client) -> None:
    theta = server.rounds.weights.clone()
    manifest, data = _good(client, server)
    big = pb.UploadRequest(chunk=pb.Chunk(index=0, data=data[:32]))  # slot holds 16 bytes
    _expect(grpc.StatusCode.RESOURCE_EXHAUSTED, lambda: client.upload(manifest, iter([big])))
    _unchanged(server, theta)


@pytest.mark.parametrize("field", ["total_bytes", "chunk_size"])
def test_manifest_beyond_the_limits_is_resource_exhausted(
    server: CoordinatorServer, client: Client, field: str
) -> None:
    theta = server.rounds.weights.clone()
    manifest, data = _good(client, server)
    if field == "total_bytes":
        manifest.blob.total_bytes = 10**9
        manifest.blob.num_chunks = 10**9 // 16 + 1
    else:
        manifest.blob.chunk_size = MAX_CHUNK_SIZE + 1
        manifest.blob.num_chunks = 1
    _expect(grpc.StatusCode.RESOURCE_EXHAUSTED, lambda: client.upload(manifest, iter(())))
    _unchanged(server, theta)


def test_checksum_mismatch_is_data_loss(server: CoordinatorServer, client: Client) -> None:
    theta = server.rounds.weights.clone()
    manifest, data = _good(client, server)
    corrupted = bytes([data[0] ^ 0xFF]) + data[1:]
    _expect(
        grpc.StatusCode.DATA_LOSS, lambda: client.upload(manifest, upload_requests_only(manifest, corrupted))
    )
    _unchanged(server, theta)
    # Every chunk must be sent again; then the upload completes.
    status = client.stub.UploadStatus(
        pb.UploadStatusRequest(session_id=client.session, round=0), timeout=10
    )
    assert status.known and not status.received and not status.complete
    assert client.upload(manifest, chunk_requests(manifest, data)).complete


def upload_requests_only(manifest: pb.UploadManifest, data: bytes) -> Iterator[pb.UploadRequest]:
    """Chunk messages of ``data`` under ``manifest`` without checking the manifest's checksum."""
    stream = upload_requests(manifest, data)
    next(stream)
    return stream


def test_broken_stream_resumes_with_only_the_missing_chunks(
    server: CoordinatorServer, client: Client
) -> None:
    manifest, data = _good(client, server)
    chunks = list(chunk_requests(manifest, data))

    def upload_status() -> pb.UploadStatusResponse:
        return client.stub.UploadStatus(pb.UploadStatusRequest(session_id=client.session, round=0), timeout=10)

    def breaks_midway() -> Iterator[pb.UploadRequest]:
        yield from chunks[:2]
        # The link drops only once the coordinator holds part of the upload: a stream cancelled
        # before its first chunks left the client (a loaded machine) would leave nothing to resume.
        deadline = time.monotonic() + 30
        while not upload_status().known and time.monotonic() < deadline:
            time.sleep(0.01)
        raise ConnectionResetError("link dropped")

    with pytest.raises(grpc.RpcError):
        client.upload(manifest, breaks_midway())
    status = upload_status()
    assert status.known and not status.complete
    received = {i for r in status.received for i in range(r.start, r.end)}
    missing = [i for r in status.missing for i in range(r.start, r.end)]
    assert received <= {0, 1} and sorted(received | set(missing)) == list(range(len(chunks)))
    response = client.upload(manifest, iter(chunks[i] for i in missing))
    assert response.complete
    assert server.rounds.status()["contributed"] == ["a"]


def test_claiming_another_sites_identity_is_permission_denied(
    server: CoordinatorServer, certs: Path
) -> None:
    theta = server.rounds.weights.clone()
    impostor = Client(certs, server.port, "a")
    try:
        error = _expect(grpc.StatusCode.PERMISSION_DENIED, lambda: impostor.join(site="b"))
        assert "'b'" in error.details() and "'a'" in error.details()
        impostor.join()
        manifest, data = _good(impostor, server, site="b")
        _expect(
            grpc.StatusCode.PERMISSION_DENIED,
            lambda: impostor.upload(manifest, chunk_requests(manifest, data)),
        )
    finally:
        impostor.close()
    _unchanged(server, theta)
    assert server.rounds.members == ["a"]


def test_site_outside_allowed_sites_is_permission_denied(server: CoordinatorServer, certs: Path) -> None:
    intruder = Client(certs, server.port, "intruder")
    try:
        error = _expect(grpc.StatusCode.PERMISSION_DENIED, lambda: intruder.join())
        assert "allowed_sites" in error.details()
    finally:
        intruder.close()
    assert server.rounds.members == []


def test_certificate_naming_no_site_is_unauthenticated(server: CoordinatorServer, certs: Path) -> None:
    anonymous = Client(certs, server.port, "nosite")
    try:
        _expect(grpc.StatusCode.UNAUTHENTICATED, lambda: anonymous.join())
    finally:
        anonymous.close()
    assert server.rounds.members == []


def test_certificate_from_another_ca_is_refused(server: CoordinatorServer, certs: Path) -> None:
    other_ca = certs.parent / next(p.name for p in certs.parent.iterdir() if p.name.startswith("other-ca"))
    stranger = Client(certs, server.port, "a", ca_dir=other_ca)
    try:
        # FetchModel is not in the channel's automatic retry policy, so the refusal is immediate.
        _expect(
            grpc.StatusCode.UNAVAILABLE,
            lambda: list(stranger.stub.FetchModel(pb.FetchModelRequest(), timeout=10)),
        )
    finally:
        stranger.close()
    assert server.rounds.members == []


def test_stale_session_carries_its_reason(server: CoordinatorServer, client: Client) -> None:
    client.session = "session-before-a-restart"
    manifest, data = _good(client, server)
    error = _expect(
        grpc.StatusCode.FAILED_PRECONDITION,
        lambda: client.upload(manifest, chunk_requests(manifest, data)),
    )
    assert error_reason(error) == pb.ERROR_REASON_STALE_SESSION
    beat = client.stub.Heartbeat(pb.HeartbeatRequest(session_id=client.session), timeout=10)
    assert beat.rejoin_required


def _both_upload(server: CoordinatorServer, client: Client, certs: Path) -> None:
    other = Client(certs, server.port, "b")
    try:
        other.join()
        for c, seed in ((client, 1), (other, 2)):
            manifest, data = _good(c, server, seed=seed)
            assert c.upload(manifest, chunk_requests(manifest, data)).complete
    finally:
        other.close()
    assert _wait_until(lambda: server.rounds.round == 1, server, timeout_s=30)


def test_fetch_model_resumes_only_while_the_weights_are_unchanged(
    server: CoordinatorServer, client: Client
) -> None:
    full = list(client.stub.FetchModel(pb.FetchModelRequest(session_id=client.session), timeout=10))
    digest = full[0].manifest.blob.checksum
    assert full[0].manifest.blob.num_chunks > 3
    resumed = list(
        client.stub.FetchModel(
            pb.FetchModelRequest(session_id=client.session, start_chunk=3, expect_digest=digest),
            timeout=10,
        )
    )
    assert resumed[0].manifest.start_chunk == 3
    assert [r.chunk.index for r in resumed[1:]] == [r.chunk.index for r in full[4:]]
    stale = pb.Checksum(algorithm=digest.algorithm, digest=bytes(len(digest.digest)))
    restarted = list(
        client.stub.FetchModel(
            pb.FetchModelRequest(session_id=client.session, start_chunk=3, expect_digest=stale),
            timeout=10,
        )
    )
    assert restarted[0].manifest.start_chunk == 0 and len(restarted) == len(full)


def test_await_broadcast_resumes_mid_delta(server: CoordinatorServer, client: Client, certs: Path) -> None:
    _both_upload(server, client, certs)
    request = pb.AwaitBroadcastRequest(session_id=client.session, round=0)
    full = list(client.stub.AwaitBroadcast(request, timeout=10))
    header = full[0].header
    assert header.action == pb.BROADCAST_ACTION_APPLY_DELTA and header.included
    assert header.delta.num_chunks > 2
    request.start_chunk = 2
    resumed = list(client.stub.AwaitBroadcast(request, timeout=10))
    assert resumed[0].header.start_chunk == 2
    tail = b"".join(bytes(r.chunk.data) for r in resumed[1:])
    assert tail == b"".join(bytes(r.chunk.data) for r in full[3:])


def test_fetch_model_streams_the_exact_weights(server: CoordinatorServer, client: Client) -> None:
    responses = list(
        client.stub.FetchModel(pb.FetchModelRequest(session_id=client.session), timeout=10)
    )
    manifest = responses[0].manifest
    data = b"".join(bytes(r.chunk.data) for r in responses[1:])
    weights = torch.frombuffer(bytearray(data), dtype=torch.float32)
    assert torch.equal(weights, server.rounds.weights)
    assert manifest.blob.checksum.digest.hex() == server.rounds.digest_hex
    assert [t.name for t in manifest.layout.tensors] == [e.name for e in server.rounds.layout.entries]

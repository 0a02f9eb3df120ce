"""Real gRPC servers on port 0: mutual TLS, site identity, chunked streams, resume, errors."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from protos_helpers import (
    SESSION_ID,
    SITES,
    MiniCoordinator,
    fail_after,
    model_bytes,
    start_server,
)

from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import geoloco_pb2_grpc as pb_grpc
from geoloco.protos.errors import IdentityError
from geoloco.protos.transport_endpoints import (
    _METHODS,
    add_coordinator_servicer,
    build_server,
    client_channel,
    coordinator_stub,
    stop_server,
)
from geoloco.protos.transport_errors import WrappingInterceptor, error_reason, rebuild_handler
from geoloco.protos.transport_malloc import is_glibc, recommended_env
from geoloco.protos.transport_options import CHANNEL_OPTIONS, SERVER_OPTIONS, server_workers, transfer_timeout
from geoloco.protos.transport_tls import TLSFiles, site_from_auth_context
from geoloco.protos.wire_assembly import Download, read_broadcast_stream, read_model_stream
from geoloco.protos.wire_buffers import DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, ranges_to_indices
from geoloco.protos.wire_chunks import as_messages, upload_requests
from geoloco.protos.wire_manifests import blob_manifest
from geoloco.scenarios import certs

MiB = 1 << 20
CALL_TIMEOUT_S = 30.0
HANDSHAKE_TIMEOUT_S = 10.0


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA with a coordinator certificate and two site certificates."""
    directory = tmp_path_factory.mktemp("pki")
    certs.init_ca(directory)
    certs.issue_coordinator(directory)
    for site in SITES:
        certs.issue_site(directory, site)
    return directory


@pytest.fixture(scope="session")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An unrelated CA that issued a certificate for a site with a legitimate name."""
    directory = tmp_path_factory.mktemp("other-pki")
    certs.init_ca(directory)
    certs.issue_site(directory, SITES[0])
    return directory


@pytest.fixture(scope="module")
def tls_server(pki):
    servicer = MiniCoordinator(insecure=False, model=model_bytes(3 * MiB + 123), delta=b"d" * 5000)
    server, port = start_server(servicer, TLSFiles.from_dir(pki, "coordinator"))
    yield servicer, port
    stop_server(server, grace_s=0.5)


def _stub(port: int, tls: TLSFiles | None, **kwargs) -> pb_grpc.CoordinatorStub:
    channel = client_channel(f"localhost:{port}", tls=tls, insecure=tls is None, **kwargs)
    return coordinator_stub(channel)


def _upload(stub, data: bytes, *, site: str = "", round: int = 1, chunk_size: int = 256 * 1024):
    manifest = pb.UploadManifest(
        site=site,
        session_id=SESSION_ID,
        round=round,
        sample_weight=10.0,
        blob=blob_manifest(data, codec="none", chunk_size=chunk_size),
    )
    return manifest, stub.Upload(upload_requests(manifest, data), timeout=CALL_TIMEOUT_S)


def test_site_certificate_streams_and_is_identified(tls_server, pki):
    servicer, port = tls_server
    data = model_bytes(3 * MiB + 5, seed=1)
    for site in SITES:
        stub = _stub(port, TLSFiles.from_dir(pki, site))
        _, response = _upload(stub, data, round=1)
        assert response.complete and response.received_bytes == len(data)
        assert servicer.completed[(site, 1, 0)] == data
    assert {site for rpc, site in servicer.callers if rpc == "Upload"} >= set(SITES)


def test_claiming_another_site_is_permission_denied(tls_server, pki):
    _, port = tls_server
    stub = _stub(port, TLSFiles.from_dir(pki, SITES[0]))
    with pytest.raises(grpc.RpcError) as info:
        _upload(stub, b"abc", site=SITES[1], round=2)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_reason(info.value) == pb.ERROR_REASON_IDENTITY_MISMATCH
    assert SITES[1] in info.value.details()


def _expect_handshake_failure(channel: grpc.Channel) -> None:
    # A client-streaming call: gRPC's retry policy (unary RPCs only) would otherwise retry the
    # UNAVAILABLE for a few seconds before reporting it.
    stub = pb_grpc.CoordinatorStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.Upload(iter([]), timeout=HANDSHAKE_TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_without_certificate_is_rejected(tls_server, pki):
    servicer, port = tls_server
    before = len(servicer.callers)
    ca = (pki / "ca.crt").read_bytes()
    channel = grpc.secure_channel(
        f"localhost:{port}", grpc.ssl_channel_credentials(root_certificates=ca)
    )
    _expect_handshake_failure(channel)
    assert len(servicer.callers) == before


def test_certificate_from_another_ca_is_rejected(tls_server, pki, other_pki):
    servicer, port = tls_server
    before = len(servicer.callers)
    # The client trusts the real CA (so the server side of the handshake is fine) but presents
    # a certificate for a legitimate site name signed by another CA.
    rogue = TLSFiles(
        ca=pki / "ca.crt", cert=other_pki / f"{SITES[0]}.crt", key=other_pki / f"{SITES[0]}.key"
    )
    _expect_handshake_failure(client_channel(f"localhost:{port}", tls=rogue))
    assert len(servicer.callers) == before


def test_coordinator_certificate_cannot_act_as_a_site(tls_server, pki):
    # Same CA, but issued for server authentication only: the TLS handshake refuses it.
    _, port = tls_server
    _expect_handshake_failure(
        client_channel(
            f"localhost:{port}", tls=TLSFiles.from_dir(pki, "coordinator")
        )
    )


def test_same_ca_certificate_that_names_no_site_is_unauthenticated(tls_server, pki):
    servicer, port = tls_server
    authority = certs.load_ca(pki)
    # A client-auth certificate from the right CA without a geoloco:site: URI (another tool's).
    pair = certs._issue(
        authority,
        "plain-client",
        [x509.DNSName("plain-client")],
        ExtendedKeyUsageOID.CLIENT_AUTH,
        30,
        force=True,
    )
    stub = coordinator_stub(
        client_channel(
            f"localhost:{port}",
            tls=TLSFiles(ca=pki / "ca.crt", cert=pair.cert, key=pair.key),
        )
    )
    before = len(servicer.callers)
    with pytest.raises(grpc.RpcError) as info:
        stub.Heartbeat(pb.HeartbeatRequest(session_id=SESSION_ID), timeout=CALL_TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error_reason(info.value) == pb.ERROR_REASON_IDENTITY_MISMATCH
    assert len(servicer.callers) == before  # the interceptor stopped it before the servicer


def test_server_name_is_checked_and_can_be_overridden(tls_server, pki):
    """Sites dialing an address that is not in the coordinator certificate (a tunnel, a NAT)
    name the expected server instead; a name the certificate lacks fails the handshake."""
    _, port = tls_server
    tls = TLSFiles.from_dir(pki, SITES[0])
    wrong = client_channel(f"127.0.0.1:{port}", tls=tls, server_name="elsewhere.example")
    _expect_handshake_failure(wrong)
    right = coordinator_stub(
        client_channel(f"127.0.0.1:{port}", tls=tls, server_name="localhost")
    )
    response = right.Heartbeat(pb.HeartbeatRequest(session_id=SESSION_ID), timeout=CALL_TIMEOUT_S)
    assert response.round.round == 3


def test_status_errors_carry_their_reason(tls_server, pki):
    _, port = tls_server
    stub = _stub(port, TLSFiles.from_dir(pki, SITES[0]))
    with pytest.raises(grpc.RpcError) as info:
        stub.Heartbeat(pb.HeartbeatRequest(session_id="old"), timeout=CALL_TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_reason(info.value) == pb.ERROR_REASON_STALE_SESSION

    bad = [pb.UploadRequest(chunk=pb.Chunk(index=0, data=b"x"))]
    with pytest.raises(grpc.RpcError) as info:
        stub.Upload(iter(bad), timeout=CALL_TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_reason(info.value) == pb.ERROR_REASON_BAD_MANIFEST

    data = bytes(4096)
    manifest = pb.UploadManifest(
        session_id=SESSION_ID, round=9, blob=blob_manifest(data, chunk_size=1024)
    )
    oversize = [
        pb.UploadRequest(manifest=manifest),
        pb.UploadRequest(chunk=pb.Chunk(index=0, data=bytes(2048))),
    ]
    with pytest.raises(grpc.RpcError) as info:
        stub.Upload(iter(oversize), timeout=CALL_TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_reason(info.value) == pb.ERROR_REASON_CHUNK_OUT_OF_BOUNDS


def test_broken_upload_resumes_with_only_the_missing_chunks(tls_server, pki):
    servicer, port = tls_server
    site = SITES[1]
    stub = _stub(port, TLSFiles.from_dir(pki, site))
    data = model_bytes(2 * MiB, seed=7)
    manifest = pb.UploadManifest(
        session_id=SESSION_ID,
        round=5,
        sample_weight=3.0,
        blob=blob_manifest(data, chunk_size=128 * 1024),
    )
    requests = upload_requests(manifest, data)
    ended = servicer.upload_streams_ended
    servicer.upload_opened.clear()
    with pytest.raises(grpc.RpcError) as info:
        # The site crashes after the manifest and 6 chunks: the stream is cancelled, and chunks
        # still in flight are lost.
        stub.Upload(
            fail_after(requests, 7, RuntimeError("site crashed"), once=servicer.upload_opened),
            timeout=CALL_TIMEOUT_S,
        )
    assert info.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
    servicer.wait_upload_streams_ended(ended + 1)

    status = stub.UploadStatus(
        pb.UploadStatusRequest(session_id=SESSION_ID, round=5), timeout=CALL_TIMEOUT_S
    )
    assert status.known and not status.complete and status.manifest == manifest
    received = ranges_to_indices(status.received)
    assert received == list(range(len(received))) and len(received) <= 6  # an in-order prefix
    assert ranges_to_indices(status.missing) == list(range(len(received), 16))
    assembler = servicer.uploads[(site, 5, 0)]
    bytes_before = assembler.received_bytes

    response = stub.Upload(
        upload_requests(manifest, data, missing=status.missing), timeout=CALL_TIMEOUT_S
    )
    assert response.complete and not response.missing
    assert assembler.duplicates == 0  # nothing already received was sent again
    assert assembler.received_bytes - bytes_before == len(data) - len(received) * 128 * 1024
    assert servicer.completed[(site, 5, 0)] == data

    # Idempotent: the whole upload again changes nothing and still reports complete.
    again = stub.Upload(upload_requests(manifest, data), timeout=CALL_TIMEOUT_S)
    assert again.complete and assembler.duplicates == manifest.blob.num_chunks


def test_fetch_model_resumes_and_broadcast_streams(tls_server, pki):
    servicer, port = tls_server
    stub = _stub(port, TLSFiles.from_dir(pki, SITES[0]))
    download = Download()
    with pytest.raises(ConnectionError):
        responses = stub.FetchModel(
            pb.FetchModelRequest(session_id=SESSION_ID), timeout=CALL_TIMEOUT_S
        )
        read_model_stream(fail_after(responses, 3, ConnectionError("dropped")), download)
    start, digest = download.resume_point()
    assert start == 2
    responses = stub.FetchModel(
        pb.FetchModelRequest(session_id=SESSION_ID, start_chunk=start, expect_digest=digest),
        timeout=CALL_TIMEOUT_S,
    )
    manifest = read_model_stream(responses, download)
    assert manifest.start_chunk == start and manifest.round == 3
    assert bytes(download.result()) == servicer.model
    assert download.assembler.duplicates == 0

    progress: list[pb.RoundProgress] = []
    delta = Download()
    header = read_broadcast_stream(
        stub.AwaitBroadcast(
            pb.AwaitBroadcastRequest(session_id=SESSION_ID, round=3), timeout=CALL_TIMEOUT_S
        ),
        delta,
        on_progress=progress.append,
    )
    assert header.action == pb.BROADCAST_ACTION_APPLY_DELTA and header.next_round.round == 4
    assert bytes(delta.result()) == servicer.delta and progress[0].quorum == 2
    resync = read_broadcast_stream(
        stub.AwaitBroadcast(
            pb.AwaitBroadcastRequest(session_id=SESSION_ID, round=1), timeout=CALL_TIMEOUT_S
        ),
        Download(),
    )
    assert resync.action == pb.BROADCAST_ACTION_RESYNC


def test_64_mib_passes_under_default_message_limits():
    """Chunking, not raised limits, is what lets big buffers through: a grpc server and channel
    with gRPC's default options (4 MiB receive limit) stream 64 MiB both ways, and refuse it
    as one message."""
    model = os.urandom(64 * MiB)
    servicer = MiniCoordinator(insecure=True, model=model)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    add_coordinator_servicer(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        stub = coordinator_stub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        download = Download()
        read_model_stream(
            stub.FetchModel(pb.FetchModelRequest(site="eu"), timeout=60), download
        )
        assert bytes(download.result()) == model

        manifest = pb.UploadManifest(
            site="eu", round=1, blob=blob_manifest(model, chunk_size=DEFAULT_CHUNK_SIZE)
        )
        assert stub.Upload(upload_requests(manifest, model), timeout=60).complete

        one_message = [pb.UploadRequest(chunk=pb.Chunk(index=0, data=model))]
        with pytest.raises(grpc.RpcError) as info:
            stub.Upload(iter(one_message), timeout=60)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        server.stop(0)


def test_fast_path_and_plain_generated_code_interoperate():
    """The chunk fast path puts protobuf's own bytes on the wire: a plain generated stub talks
    to a fast-path server and a fast-path stub to a plain generated server."""
    data = os.urandom(3 * MiB + 17)
    manifest = pb.UploadManifest(site="lab", round=1, blob=blob_manifest(data, chunk_size=MiB))
    fast = MiniCoordinator(insecure=True, model=data)
    plain = MiniCoordinator(insecure=True, model=data)
    fast_server, fast_port = start_server(fast, None)
    plain_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_CoordinatorServicer_to_server(plain, plain_server)
    plain_port = plain_server.add_insecure_port("127.0.0.1:0")
    plain_server.start()
    try:
        plain_stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(f"127.0.0.1:{fast_port}"))
        requests = as_messages(upload_requests(manifest, data), pb.UploadRequest)
        assert plain_stub.Upload(requests, timeout=CALL_TIMEOUT_S).complete
        assert fast.completed[("lab", 1, 0)] == data
        responses = list(
            plain_stub.FetchModel(pb.FetchModelRequest(site="lab"), timeout=CALL_TIMEOUT_S)
        )
        assert all(isinstance(r, pb.FetchModelResponse) for r in responses)
        assert b"".join(r.chunk.data for r in responses[1:]) == data

        fast_stub = coordinator_stub(grpc.insecure_channel(f"127.0.0.1:{plain_port}"))
        assert fast_stub.Upload(
            upload_requests(manifest, data), timeout=CALL_TIMEOUT_S
        ).complete
        assert plain.completed[("lab", 1, 0)] == data
    finally:
        stop_server(fast_server, grace_s=0.5)
        plain_server.stop(0)


def test_fast_path_method_table_matches_the_schema():
    service = pb.DESCRIPTOR.services_by_name["Coordinator"]
    assert set(_METHODS) == {m.name for m in service.methods}
    for method in service.methods:
        cardinality, request_type, response_type = _METHODS[method.name]
        assert request_type.DESCRIPTOR.full_name == method.input_type.full_name
        assert response_type.DESCRIPTOR.full_name == method.output_type.full_name
        if hasattr(method, "client_streaming"):
            expected = (
                f"{'stream' if method.client_streaming else 'unary'}_"
                f"{'stream' if method.server_streaming else 'unary'}"
            )
            assert cardinality == expected
    stub = coordinator_stub(grpc.insecure_channel("127.0.0.1:1"))
    assert all(callable(getattr(stub, name)) for name in _METHODS)


def test_insecure_mode_requires_explicit_flag_and_site_field(tmp_path):
    with pytest.raises(ValueError, match="insecure"):
        build_server(tls=None)
    with pytest.raises(ValueError, match="insecure"):
        client_channel("localhost:1", tls=None)
    with pytest.raises(FileNotFoundError, match="geoloco certs"):
        build_server(tls=TLSFiles.from_dir(tmp_path, "coordinator"))

    servicer = MiniCoordinator(insecure=True, model=b"\x00" * 16)
    server, port = start_server(servicer, None)
    try:
        stub = _stub(port, None)
        assert (
            stub.Heartbeat(
                pb.HeartbeatRequest(site="lab-1", session_id=SESSION_ID), timeout=CALL_TIMEOUT_S
            ).round.round
            == 3
        )
        assert ("Heartbeat", "lab-1") in servicer.callers
        for bad in ("", "../etc"):
            with pytest.raises(grpc.RpcError) as info:
                stub.Heartbeat(
                    pb.HeartbeatRequest(site=bad, session_id=SESSION_ID), timeout=CALL_TIMEOUT_S
                )
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        stop_server(server, grace_s=0.5)


def test_site_identity_from_auth_context():
    ctx = {
        "transport_security_type": [b"ssl"],
        "x509_common_name": [b"eu-west"],
        "x509_subject_alternative_name": [b"geoloco:site:eu-west", b"localhost"],
    }
    assert site_from_auth_context(ctx) == "eu-west"
    assert site_from_auth_context({"x509_common_name": [b"eu-west"]}) is None
    assert (
        site_from_auth_context({"x509_common_name": [b"eu-west"]}, allow_common_name=True)
        == "eu-west"
    )
    assert site_from_auth_context({"peer_uri": [b"geoloco:site:a/b"]}) is None
    with pytest.raises(IdentityError, match="several"):
        site_from_auth_context(
            {"x509_subject_alternative_name": [b"geoloco:site:a", b"geoloco:site:b"]}
        )


def test_options_and_deadlines_are_consistent():
    options = dict(CHANNEL_OPTIONS)
    assert options["grpc.max_receive_message_length"] >= MAX_CHUNK_SIZE + 1024
    server = dict(SERVER_OPTIONS)
    assert (
        server["grpc.http2.min_recv_ping_interval_without_data_ms"]
        < options["grpc.keepalive_time_ms"]
    )
    assert transfer_timeout(100 * MiB) > transfer_timeout(MiB)
    assert server_workers(10) >= 2 * 10
    with pytest.raises(ValueError):
        transfer_timeout(1, min_bytes_per_s=0)


def test_a_site_channel_option_replaces_the_transport_default_of_the_same_name():
    """grpc keeps the first value of an option given twice: a site's reconnect bound appended
    after the transport's defaults was silently ignored."""
    from geoloco.protos.transport_endpoints import channel_options
    from geoloco.protos.transport_options import CHANNEL_OPTIONS

    name = "grpc.max_reconnect_backoff_ms"
    assert name in dict(CHANNEL_OPTIONS) and dict(CHANNEL_OPTIONS)[name] != 1000
    options = channel_options([(name, 1000)])
    assert [value for key, value in options if key == name] == [1000]
    assert {key for key, _ in options} == {key for key, _ in CHANNEL_OPTIONS}


def test_malloc_tunables_env_and_reexec():
    env = recommended_env({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096"})
    parts = env["GLIBC_TUNABLES"].split(":")
    assert "glibc.malloc.mmap_threshold=4096" in parts  # the user's own value wins
    assert "glibc.malloc.trim_threshold=1073741824" in parts
    fresh = recommended_env({})
    assert "glibc.malloc.mmap_threshold=33554432" in fresh["GLIBC_TUNABLES"]

    code = (
        "import os\n"
        "from geoloco.protos.transport_malloc import malloc_tunables_active, reexec_with_malloc_tunables\n"
        "reexec_with_malloc_tunables()\n"
        "print(malloc_tunables_active(), os.environ.get('GEOLOCO_MALLOC_REEXEC'))\n"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("GLIBC_TUNABLES", "GEOLOCO_NO_MALLOC_REEXEC")
    }
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    if is_glibc():
        assert result.stdout.split() == ["True", "1"]
    else:
        assert result.stdout.split() == ["False", "None"]


@pytest.mark.skipif(not is_glibc(), reason="malloc_trim and GLIBC_TUNABLES exist only on glibc")
def test_heap_freed_before_serving_goes_back_to_the_kernel():
    """A model built from layers below the mmap threshold and dropped after flattening stays
    resident under our trim threshold until ``return_free_heap``: a coordinator's memory must not
    depend on how its caller built the model."""
    code = (
        "import torch\n"
        "from geoloco.protos.transport_malloc import return_free_heap\n"
        "def rss():\n"
        "    return int(open('/proc/self/statm').read().split()[1]) * 4096\n"
        "layers = [torch.ones(4 * 2**20) for _ in range(16)]\n"  # 16 x 16 MiB, on the heap
        "flat = torch.cat(layers)\n"
        "del layers\n"
        "kept = rss()\n"
        "print(return_free_heap(), kept - rss())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=recommended_env({**os.environ, "GLIBC_TUNABLES": ""}),
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    ran, released = result.stdout.split()
    assert ran == "True"
    assert int(released) >= 128 * 2**20, f"only {int(released) >> 20} MiB went back"


def test_leaf_certificates_expire_with_their_ca(pki):
    authority = certs.load_ca(pki)
    site = x509.load_pem_x509_certificate((pki / f"{SITES[0]}.crt").read_bytes())
    assert site.not_valid_after_utc <= authority.cert.not_valid_after_utc
    assert site.not_valid_before_utc < datetime.datetime.now(datetime.timezone.utc)


def test_an_interceptor_wraps_a_methods_handler_once():
    """gRPC asks for a call's handler on its one dispatch thread for every call: the wrapper is
    built once per method while the handler below stays the same object, and again when it
    changes."""
    built: list[str] = []

    class Counting(WrappingInterceptor):
        def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
            built.append(method)
            return rebuild_handler(handler, lambda behavior: behavior, lambda behavior: behavior)

    interceptor = Counting()
    heartbeat = SimpleNamespace(method="/geoloco.v1.Coordinator/Heartbeat")
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    first = interceptor.intercept_service(lambda details: handler, heartbeat)
    assert first is not None and first is not handler
    assert all(interceptor.intercept_service(lambda details: handler, heartbeat) is first for _ in range(3))
    assert built == [heartbeat.method]
    replaced = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    assert interceptor.intercept_service(lambda details: replaced, heartbeat) is not first
    assert interceptor.intercept_service(lambda details: None, SimpleNamespace(method="/x/Unknown")) is None
    assert built == [heartbeat.method, heartbeat.method]

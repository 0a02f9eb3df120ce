"""An upload's manifest identifies its update, over real gRPC with mutual TLS.

Every encoded update ends with its own CRC-32, so a CRC-32 over the whole update is one constant:
with it, two different updates of the same size had equal manifests. A second, different update
from a site whose first one completed was answered "complete" (the first one stayed counted), and
a replacement sent while the first was partial was merged with it chunk by chunk until the final
checksum failed. With a manifest checksum that identifies the bytes, the coordinator refuses the
second update at its manifest (MANIFEST_CONFLICT, before any chunk), and a replacement of a partial
upload is taken whole.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from _round_helpers import chunk_requests, encode_update, tiny_weights, upload_manifest

from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.server import CoordinatorServer
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.protocol_version import PROTOCOL_VERSION
from geoloco.protos.transport_endpoints import client_channel, coordinator_stub
from geoloco.protos.transport_errors import error_reason
from geoloco.protos.transport_tls import TLSFiles
from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_site


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
    weights, layout = tiny_weights()
    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(inner_steps=1),
        certs_dir=str(certs),
        min_sites=2,  # the round stays open after site a's upload: b never uploads
        total_rounds=3,
        chunk_size=16,
    )
    server = CoordinatorServer(config, weights, layout)
    server.start()
    yield server
    server.stop(grace=0)


@pytest.fixture
def stub(server: CoordinatorServer, certs: Path) -> Iterator[tuple[object, str]]:
    channels = []
    session = ""
    for name in ("a", "b"):
        channel = client_channel(f"localhost:{server.port}", tls=TLSFiles.from_dir(certs, name))
        channels.append(channel)
        joined = coordinator_stub(channel).Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=10)
        if name == "a":
            session = joined.session_id
    yield coordinator_stub(channels[0]), session
    for channel in channels:
        channel.close()


def _two_updates(numel: int) -> tuple[bytes, bytes]:
    """Two different encoded updates of exactly the same size (and codec, shape, dtype)."""
    first, _ = encode_update(torch.randn(numel, generator=torch.Generator().manual_seed(1)))
    second, _ = encode_update(torch.randn(numel, generator=torch.Generator().manual_seed(2)))
    assert len(first) == len(second) and first != second
    return first, second


def _stream(manifest: pb.UploadManifest, chunks: Iterator[pb.UploadRequest]) -> Iterator[pb.UploadRequest]:
    yield pb.UploadRequest(manifest=manifest)
    yield from chunks


def test_a_second_different_update_of_the_same_size_is_refused_at_its_manifest(
    server: CoordinatorServer, stub: tuple[object, str]
) -> None:
    client, session = stub
    numel = server.rounds.numel
    first, second = _two_updates(numel)
    manifest_1 = upload_manifest(session, 0, first, codec="none", numel=numel)
    manifest_2 = upload_manifest(session, 0, second, codec="none", numel=numel)
    assert manifest_1.blob.total_bytes == manifest_2.blob.total_bytes

    done = client.Upload(_stream(manifest_1, chunk_requests(manifest_1, first)), timeout=10)  # type: ignore[attr-defined]
    assert done.complete

    # The manifest alone, no chunk: the refusal must come from the manifest, at once.
    with pytest.raises(grpc.RpcError) as info:
        client.Upload(_stream(manifest_2, iter(())), timeout=10)  # type: ignore[attr-defined]
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
    assert error_reason(info.value) == pb.ERROR_REASON_MANIFEST_CONFLICT
    # The first update is still the one that counts; resending it is still "complete".
    again = client.Upload(_stream(manifest_1, iter(())), timeout=10)  # type: ignore[attr-defined]
    assert again.complete


def test_a_replacement_of_a_partial_upload_is_taken_whole_not_merged(
    server: CoordinatorServer, stub: tuple[object, str]
) -> None:
    client, session = stub
    numel = server.rounds.numel
    first, second = _two_updates(numel)
    manifest_1 = upload_manifest(session, 0, first, codec="none", numel=numel)
    manifest_2 = upload_manifest(session, 0, second, codec="none", numel=numel)
    half = manifest_1.blob.num_chunks // 2
    assert half >= 1
    partial = client.Upload(  # type: ignore[attr-defined]
        _stream(manifest_1, itertools.islice(chunk_requests(manifest_1, first), half)), timeout=10
    )
    assert not partial.complete

    # The site restarted and recomputed its update: every chunk of the new one is taken (not
    # only those the partial one lacked), so it completes and verifies.
    replaced = client.Upload(_stream(manifest_2, chunk_requests(manifest_2, second)), timeout=10)  # type: ignore[attr-defined]
    assert replaced.complete
    status = client.UploadStatus(pb.UploadStatusRequest(session_id=session, round=0), timeout=10)  # type: ignore[attr-defined]
    assert status.complete and status.manifest.blob.checksum == manifest_2.blob.checksum

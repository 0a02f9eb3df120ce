"""The coordinator's side of sharded sites, driven over real gRPC with mutual TLS (port 0):
shards are held until all of a site's arrived (all or nothing), and manifests that do not name
a tile of the vector are refused with errors that say what is allowed."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from _cluster import make_certs
from torch import nn

from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
from geoloco.algorithms.shard_split import shard_numel, shard_ranges
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.compression import Encoded, decode
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.intake import PlainIntake
from geoloco.coordinator.server import CoordinatorServer
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.transport_tls import TLSFiles
from geoloco.site_agent.client import CoordinatorClient, RoundClosed
from geoloco.site_agent.config import SiteAgentConfig
from geoloco.site_agent.errors import SiteAgentError

SITES = ["fs", "other"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3))  # 5 and 3 rows: uneven 2-way splits


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[CoordinatorServer, Path, ParamLayout]]:
    certs = make_certs(tmp_path / "certs", SITES)
    model = _model()
    layout = ParamLayout.from_model(model)
    server = CoordinatorServer(
        CoordinatorConfig(
            certs_dir=str(certs), min_sites=2, total_rounds=2, heartbeat_timeout_s=600.0,
            algorithm=AlgorithmConfig(inner_steps=1, uplink_codec="none", weighting="samples"),
        ),
        layout.flatten(model), layout, None,
    )
    server.start()
    try:
        yield server, certs, layout
    finally:
        server.stop(grace=0)


def _client(server: CoordinatorServer, certs: Path, site: str) -> CoordinatorClient:
    client = CoordinatorClient(
        f"localhost:{server.port}", site=site, tls=TLSFiles.from_dir(certs, site), insecure=False,
        config=SiteAgentConfig(device="cpu", backoff_initial_s=0.05, max_upload_attempts=2),
        stop_event=threading.Event(),
    )
    client.join(has_weights=False, weights_round=0, digest_hex=None)
    return client


def _upload(client: CoordinatorClient, values: torch.Tensor, shard: tuple[int, int, str] | None,
            weight: float = 10.0) -> bool:
    values = values.contiguous()
    client.shard = None if shard is None else pb.ShardRef(index=shard[0], count=shard[1], split=shard[2])
    encoded = Encoded("none", tuple(values.shape), torch.float32, values.view(torch.uint8))
    response = client.upload(
        round_number=0, data=encoded.to_bytes(), codec="none", shape=list(values.shape), sample_weight=weight,
        metrics={}, inner_steps=1,
    )
    return bool(response.complete)


def _shapes(layout: ParamLayout) -> list[tuple[int, ...]]:
    return [e.shape for e in layout.entries]


def test_split_follows_fsdp2_rows_and_tiles_the_vector() -> None:
    shapes = [(5, 4), (5,), (3, 5), (3,), ()]
    numel = sum(max(1, torch.Size(s).numel()) for s in shapes)
    for count in (1, 2, 3, 7):
        covered = torch.zeros(numel, dtype=torch.int64)
        for index in range(count):
            for offset, n in shard_ranges(shapes, index, count):
                covered[offset : offset + n] += 1
        assert bool((covered == 1).all()), count
    # torch.chunk's rows: 5 rows in 2 -> 3 + 2; the 0-d parameter belongs to shard 0.
    assert shard_ranges(shapes, 1, 2) == [(12, 8), (23, 2), (35, 5), (42, 1)]
    assert shard_numel(shapes, 0, 2) == 12 + 3 + 10 + 2 + 1
    with pytest.raises(ValueError, match="shards are numbered 0 .. count-1"):
        shard_ranges(shapes, 2, 2)
    with pytest.raises(ValueError, match="splits are"):
        shard_ranges(shapes, 0, 2, "rows")


def test_a_site_counts_only_once_all_its_shards_arrived(
    cluster: tuple[CoordinatorServer, Path, ParamLayout],
) -> None:
    server, certs, layout = cluster
    fs, other = _client(server, certs, "fs"), _client(server, certs, "other")
    full = torch.linspace(-1.0, 1.0, layout.numel)
    shapes = _shapes(layout)
    shard0 = torch.cat([full[o : o + n] for o, n in shard_ranges(shapes, 0, 2)])
    shard1 = torch.cat([full[o : o + n] for o, n in shard_ranges(shapes, 1, 2)])
    before = server.rounds.weights.clone()
    assert _upload(fs, shard0, (0, 2, "dim0"))
    assert _upload(other, torch.zeros(layout.numel), None)
    # Shard 1 missing: the round waits for the site; nothing of it entered the sum.
    status = server.rounds.status()
    assert status["round"] == 0, status
    assert torch.equal(server.rounds.weights, before)
    assert _upload(fs, shard1, (1, 2, "dim0"))
    header, _ = other.await_broadcast(0)
    assert header.num_contributors == 2
    # The mean of fs's update (`full`, its two shards put back in place) and other's zeros moves
    # every coordinate by the same multiple of `full`: a shard added at the wrong rows breaks it.
    moved = before - server.rounds.weights
    scale = float(moved[0] / full[0])
    assert scale > 0
    torch.testing.assert_close(moved, scale * full, rtol=1e-5, atol=1e-6)
    fs.close()
    other.close()


def test_shards_that_do_not_tile_the_vector_are_refused(
    cluster: tuple[CoordinatorServer, Path, ParamLayout],
) -> None:
    server, certs, layout = cluster
    fs = _client(server, certs, "fs")
    shapes = _shapes(layout)
    n0 = shard_numel(shapes, 0, 2)
    with pytest.raises(SiteAgentError, match=r"split 'dim0' of this model gives it \[\d+\] elements"):
        _upload(fs, torch.zeros(n0 + 1), (0, 2, "dim0"))
    with pytest.raises(SiteAgentError, match="shard_index 0 .. shard_count-1"):
        _upload(fs, torch.zeros(n0), (2, 2, "dim0"))
    with pytest.raises(SiteAgentError, match="known splits are"):
        _upload(fs, torch.zeros(n0), (0, 2, "rows"))
    assert _upload(fs, torch.zeros(n0), (0, 2, "dim0"))
    # Another shard count for the same site and round: the shards would overlap.
    with pytest.raises(SiteAgentError, match="must upload with the same shard_count"):
        _upload(fs, torch.zeros(shard_numel(shapes, 1, 3)), (1, 3, "dim0"))
    with pytest.raises(SiteAgentError, match="one update with one weight"):
        _upload(fs, torch.zeros(shard_numel(shapes, 1, 2)), (1, 2, "dim0"), weight=3.0)
    with pytest.raises(SiteAgentError, match="either one whole update or all of its shards"):
        _upload(fs, torch.zeros(layout.numel), None)
    # Nothing was lost: the model is intact and the site can still complete its update.
    assert _upload(fs, torch.zeros(shard_numel(shapes, 1, 2)), (1, 2, "dim0"))
    fs.close()


def test_shards_are_refused_with_secure_aggregation(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs", SITES)
    model = _model()
    layout = ParamLayout.from_model(model)
    server = CoordinatorServer(
        CoordinatorConfig(
            certs_dir=str(certs), min_sites=3, total_rounds=1, heartbeat_timeout_s=600.0,
            algorithm=AlgorithmConfig(inner_steps=1, uplink_codec="none", weighting="uniform"),
            privacy=PrivacyConfig(secure_aggregation=True, clip_norm=10.0, chunk_size=1024),
        ),
        layout.flatten(model), layout, None,
    )
    server.start()
    try:
        fs = _client(server, certs, "fs")
        with pytest.raises(SiteAgentError, match="do not combine with secure aggregation.*data-parallel"):
            _upload(fs, torch.zeros(shard_numel(_shapes(layout), 0, 2)), (0, 2, "dim0"))
        fs.close()
    finally:
        server.stop(grace=0)


def test_a_non_finite_shard_drops_the_whole_site_for_the_round(
    cluster: tuple[CoordinatorServer, Path, ParamLayout],
) -> None:
    server, certs, layout = cluster
    fs, other = _client(server, certs, "fs"), _client(server, certs, "other")
    shapes = _shapes(layout)
    before = server.rounds.weights.clone()
    assert _upload(fs, torch.ones(shard_numel(shapes, 0, 2)), (0, 2, "dim0"))
    bad = torch.zeros(shard_numel(shapes, 1, 2))
    bad[0] = float("nan")
    with pytest.raises(SiteAgentError, match="NaN or Inf.*whole update is dropped"):
        _upload(fs, bad, (1, 2, "dim0"))
    # With fs refused the quorum of both sites cannot be met: the round aborted at once instead
    # of waiting, so fs's retry finds it closed.
    with pytest.raises(RoundClosed, match="round 0 is closed"):
        _upload(fs, torch.zeros(shard_numel(shapes, 1, 2)), (1, 2, "dim0"))
    # fs's held shard 0 went with it, and nothing of fs entered the sum.
    intake = server.rounds.intake
    assert isinstance(intake, PlainIntake)
    assert not intake.shards.holds("fs")
    assert torch.equal(server.rounds.weights, before)
    fs.close()
    other.close()


def test_a_rank_downloads_its_rows_of_the_weights_and_of_the_broadcast(
    cluster: tuple[CoordinatorServer, Path, ParamLayout],
) -> None:
    server, certs, layout = cluster
    shapes = _shapes(layout)
    fs, other = _client(server, certs, "fs"), _client(server, certs, "other")
    before = server.rounds.weights.clone()
    fs.shard = pb.ShardRef(index=1, count=2, split="dim0")
    rows_of = lambda flat: torch.cat([flat[o : o + n] for o, n in shard_ranges(shapes, 1, 2)])  # noqa: E731
    manifest, rows = fs.fetch_model(shard_numel(shapes, 1, 2))
    assert manifest.shard_rows and torch.equal(rows, rows_of(before))
    assert manifest.blob.checksum.digest == hashlib.sha256(rows_of(before).numpy().tobytes()).digest()

    full = torch.linspace(-1.0, 1.0, layout.numel)
    for index in range(2):
        assert _upload(fs, torch.cat([full[o : o + n] for o, n in shard_ranges(shapes, index, 2)]), (index, 2, "dim0"))
    assert _upload(other, torch.zeros(layout.numel), None)
    header, data = fs.await_broadcast(0)
    after = server.rounds.weights.clone()
    assert header.shard_rows and data is not None
    delta = decode(Encoded.from_bytes(data))
    assert delta.numel() == shard_numel(shapes, 1, 2)
    assert torch.equal(rows_of(before) + delta, rows_of(after))  # the coordinator's own float sum
    assert header.shard_weights_digest.digest == hashlib.sha256(rows_of(after).numpy().tobytes()).digest()

    fs.shard = pb.ShardRef(index=2, count=2, split="dim0")
    with pytest.raises(SiteAgentError, match=r"shard 2 of 2; count must be 1 \.\. \d+ and index 0 \.\. count-1"):
        fs.fetch_model(shard_numel(shapes, 1, 2))
    # AwaitBroadcast refuses the impossible shard at once too, instead of holding the call open.
    fs.shard = pb.ShardRef(index=9, count=4, split="dim0")
    with pytest.raises(SiteAgentError, match=r"shard 9 of 4"):
        fs.await_broadcast(1)
    assert torch.equal(server.rounds.weights, after)
    fs.close()
    other.close()


def test_a_site_cannot_hold_more_than_one_update_in_empty_shard_manifests(
    cluster: tuple[CoordinatorServer, Path, ParamLayout],
) -> None:
    """A listed site opens shard manifests of 4,096 shards, each announcing 64 KiB, and never
    sends a chunk: the buffers they allocate stop at one whole update's bytes
    plus a little per shard (each manifest used to hold 128 KiB, 512 MiB per site whatever the
    model), and the refusal says why."""
    from geoloco.coordinator.shards import SHARD_OVERHEAD_BYTES
    from geoloco.protos.protocol_version import PROTOCOL_VERSION
    from geoloco.protos.transport_endpoints import client_channel, coordinator_stub
    from geoloco.protos.wire_manifests import blob_manifest

    server, certs, layout = cluster
    intake = server.rounds.intake
    assert isinstance(intake, PlainIntake)
    count, per_shard = 4096, 64 * 1024
    allowed = intake.max_upload_bytes + count * SHARD_OVERHEAD_BYTES
    channel = client_channel(f"localhost:{server.port}", tls=TLSFiles.from_dir(certs, "fs"))
    stub = coordinator_stub(channel)
    try:
        session = stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=10).session_id
        blob = blob_manifest(bytes(per_shard), codec="none", shape=[0], dtype="float32")
        opened, refusals = 0, []
        for index in range(8, 8 + allowed // per_shard + 8):  # shards 5.. of this model are empty
            manifest = pb.UploadManifest(
                session_id=session, round=0, sample_weight=1.0, inner_steps=1, blob=blob,
                shard_index=index, shard_count=count, shard_split="dim0",
            )
            try:
                stub.Upload(iter([pb.UploadRequest(manifest=manifest)]), timeout=10)
                opened += 1
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
                refusals.append(err)
        assert opened * per_shard <= allowed < (opened + 1) * per_shard, refusals[0].details()  # type: ignore[attr-defined]
        assert len(refusals) == 8
        details = refusals[0].details()  # type: ignore[attr-defined]
        assert "announce" in details and "more than one whole update may" in details, details
    finally:
        channel.close()

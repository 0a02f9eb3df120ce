"""Per-site uplink codecs over real gRPC with mutual TLS (``[algorithm.adaptive_uplink]``).

Two raw clients upload round 0 in the run's codec, one of them slowly (its chunks paced, so the
coordinator measures a slow link); round 1's info then gives the slow site a top-k codec and the
fast one the dense codec, each upload in the other's codec is refused, and the round's result is
the weighted mean of what each site sent, decoded.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from _round_helpers import chunk_requests, tiny_weights, upload_manifest

from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.link_codec import AdaptiveUplinkConfig
from geoloco.algorithms.optimizers import OuterOptimizerConfig
from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.compression import decode, parse_codec
from geoloco.compression.encoded import Encoded
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.server import CoordinatorServer
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.protocol_version import PROTOCOL_VERSION
from geoloco.protos.transport_endpoints import client_channel, coordinator_stub
from geoloco.protos.transport_tls import TLSFiles
from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_site

SITES = ["fast", "slow"]
INT8 = parse_codec("int8").spec
PACE_S = 0.1
"""Pause before each of the slow site's chunks: a link ~100x slower than loopback."""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    init_ca(directory)
    issue_coordinator(directory)
    for name in SITES:
        issue_site(directory, name)
    return directory


@pytest.fixture
def server(certs: Path) -> Iterator[CoordinatorServer]:
    weights, layout = tiny_weights()
    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(
            inner_steps=1, uplink_codec="int8", weighting="samples",
            adaptive_uplink=AdaptiveUplinkConfig(enabled=True, min_density=0.2, max_density=0.5),
        ),
        outer_optimizer=OuterOptimizerConfig(name="sgd", lr=1.0, momentum=0.0),
        certs_dir=str(certs), allowed_sites=SITES, min_sites=2, total_rounds=3, chunk_size=16,
    )
    server = CoordinatorServer(config, weights, layout)
    server.start()
    yield server
    server.stop(grace=0)


class Site:
    """A raw gRPC client holding one site's certificate."""

    def __init__(self, certs: Path, port: int, name: str) -> None:
        self.name = name
        self.channel = client_channel(f"localhost:{port}", tls=TLSFiles.from_dir(certs, name))
        self.stub = coordinator_stub(self.channel)
        self.session = ""
        self.round_info = pb.RoundInfo()

    def join(self) -> None:
        response = self.stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=10)
        self.session, self.round_info = response.session_id, response.round

    def upload(self, round_number: int, encoded: Encoded, weight: float, *, pace_s: float = 0.0) -> None:
        data = encoded.to_bytes()
        manifest = upload_manifest(
            self.session, round_number, data, codec=encoded.spec, numel=encoded.shape[0],
            sample_weight=weight, chunk_size=16,
        )

        def stream() -> Iterator[pb.UploadRequest]:
            yield pb.UploadRequest(manifest=manifest)
            for request in chunk_requests(manifest, data):
                time.sleep(pace_s)
                yield request

        self.stub.Upload(stream(), timeout=30)

    def await_round(self, round_number: int) -> pb.BroadcastHeader:
        request = pb.AwaitBroadcastRequest(session_id=self.session, round=round_number)
        for response in self.stub.AwaitBroadcast(request, timeout=30):
            if response.HasField("header"):
                self.round_info = response.header.next_round
                return response.header
        raise AssertionError(f"no broadcast header for round {round_number}")

    def close(self) -> None:
        self.channel.close()


def _encode(spec: str, seed: int, numel: int) -> Encoded:
    update = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    return parse_codec(spec).encode(update, seed=seed)


def _weighted_mean(sent: list[tuple[Encoded, float]]) -> torch.Tensor:
    total = sum(weight for _, weight in sent)
    return sum((decode(encoded) * weight for encoded, weight in sent), torch.zeros(sent[0][0].shape[0])) / total


def test_sites_with_different_links_get_different_codecs_and_an_exact_weighted_mean(
    server: CoordinatorServer, certs: Path
) -> None:
    numel = server.rounds.numel
    fast, slow = (Site(certs, server.port, name) for name in SITES)
    try:
        fast.join()
        slow.join()
        # Nothing measured yet: the run's codec for both.
        assert fast.round_info.uplink_codec == slow.round_info.uplink_codec == INT8
        theta = server.rounds.weights.clone()
        round0 = [(_encode(INT8, 1, numel), 3.0), (_encode(INT8, 2, numel), 1.0)]
        fast.upload(0, *round0[0])
        slow.upload(0, *round0[1], pace_s=PACE_S)
        fast.await_round(0)
        slow.await_round(0)
        torch.testing.assert_close(server.rounds.weights, theta - _weighted_mean(round0), rtol=1e-6, atol=1e-6)

        # Round 1: each site learns its own codec from the broadcast header.
        assert fast.round_info.round == slow.round_info.round == 1
        assert fast.round_info.uplink_codec == INT8
        slow_codec = slow.round_info.uplink_codec
        assert slow_codec.startswith("topk:0.2,") and slow_codec.endswith("|" + INT8)

        # Another codec than the assigned one is refused, and changes nothing.
        theta = server.rounds.weights.clone()
        for site, wrong in ((slow, INT8), (fast, slow_codec)):
            with pytest.raises(grpc.RpcError) as info:
                site.upload(1, _encode(wrong, 9, numel), 1.0)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "uplink codec" in str(info.value.details())
        assert server.rounds.status()["contributed"] == []

        round1 = [(_encode(INT8, 3, numel), 2.0), (_encode(slow_codec, 4, numel), 5.0)]
        fast.upload(1, *round1[0])
        slow.upload(1, *round1[1])
        header = fast.await_round(1)
        assert header.num_contributors == 2
        slow.await_round(1)
        torch.testing.assert_close(server.rounds.weights, theta - _weighted_mean(round1), rtol=1e-6, atol=1e-6)
    finally:
        fast.close()
        slow.close()


def test_refused_junk_does_not_measure_a_link_so_an_honest_site_keeps_the_dense_codec(
    server: CoordinatorServer, certs: Path
) -> None:
    """A hostile site streams 1 MB of junk at loopback speed (refused: not an encoded tensor)
    before its real update. Measured, the junk would make it the typical site and give the honest
    site, whose link is as fast as its own, a top-k codec; only verified, admitted uploads measure
    a link, so both keep the dense codec."""
    numel = server.rounds.numel
    honest, hostile = (Site(certs, server.port, name) for name in SITES)
    try:
        honest.join()
        hostile.join()
        junk = torch.randint(0, 256, (1 << 20,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
        data = junk.numpy().tobytes()
        manifest = upload_manifest(
            hostile.session, 0, data, codec=INT8, numel=numel, sample_weight=1.0, chunk_size=1 << 16
        )
        stream = [pb.UploadRequest(manifest=manifest), *chunk_requests(manifest, data)]
        with pytest.raises(grpc.RpcError) as info:
            hostile.stub.Upload(iter(stream), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        # Both real uploads take the same time on the wire (paced alike).
        honest.upload(0, _encode(INT8, 1, numel), 1.0, pace_s=PACE_S)
        hostile.upload(0, _encode(INT8, 2, numel), 1.0, pace_s=PACE_S)
        honest.await_round(0)
        hostile.await_round(0)
        assert honest.round_info.round == hostile.round_info.round == 1
        assert honest.round_info.uplink_codec == INT8, honest.round_info.uplink_codec
        assert hostile.round_info.uplink_codec == INT8, hostile.round_info.uplink_codec
    finally:
        honest.close()
        hostile.close()


def test_adaptive_uplink_with_secure_aggregation_is_refused() -> None:
    with pytest.raises(ConfigError, match="adaptive_uplink.enabled.*one codec"):
        CoordinatorConfig(
            algorithm=AlgorithmConfig(uplink_codec="none", adaptive_uplink=AdaptiveUplinkConfig(enabled=True)),
            privacy=PrivacyConfig(secure_aggregation=True, clip_norm=1.0), insecure=True,
            allowed_sites=["a", "b", "c"], min_sites=3,
        )

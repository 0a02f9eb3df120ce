"""A relay cannot speak for a site outside its ``[relays]`` list, over real gRPC and mutual TLS.

The coordinator checks the site every relayed call names against the relay's list, the sites of
every partial sum too, refuses partial sums from a site certificate and calls from a relay it
does not know; a relay refuses sites outside its own list. A refused partial leaves the round
untouched.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from _relay_helpers import Site, coordinator, make_certs, relay

from geoloco.algorithms.update_guard import UpdateGuardConfig
from geoloco.compression import parse_codec
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.server import CoordinatorServer
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.protocol_version import PROTOCOL_VERSION
from geoloco.protos.transport_endpoints import client_channel, coordinator_stub
from geoloco.protos.transport_errors import error_reason
from geoloco.protos.transport_tls import TLSFiles
from geoloco.protos.wire_chunks import upload_requests
from geoloco.protos.wire_manifests import blob_manifest


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def server(certs: Path) -> Iterator[CoordinatorServer]:
    server = coordinator(certs)
    yield server
    server.stop(grace=0)


def _as(certs: Path, name: str, port: int) -> tuple[object, object]:
    channel = client_channel(f"localhost:{port}", tls=TLSFiles.from_dir(certs, name))
    return channel, coordinator_stub(channel)


def _partial(
    session: str, sites: dict[str, float], numel: int, value: float = 1.0
) -> tuple[pb.UploadManifest, bytes]:
    encoded = parse_codec("none").encode(torch.full((numel,), value))
    data = encoded.to_bytes()
    manifest = pb.UploadManifest(
        session_id=session, round=0, sample_weight=sum(sites.values()), inner_steps=len(sites),
        blob=blob_manifest(data, codec="none", shape=[numel], dtype="float32", chunk_size=64),
        relayed_sites=[pb.RelayedSite(site=s, weight=w, inner_steps=1) for s, w in sites.items()],
    )
    return manifest, data


def _refused(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    return info.value


def test_a_relay_cannot_join_or_upload_for_another_regions_site(certs: Path, server: CoordinatorServer) -> None:
    channel, eu = _as(certs, "eu", server.port)
    try:
        join = pb.JoinRequest(protocol_version=PROTOCOL_VERSION)
        own = eu.Join(pb.JoinRequest(site="site-a", protocol_version=PROTOCOL_VERSION), timeout=10)  # type: ignore[attr-defined]
        err = _refused(lambda: eu.Join(pb.JoinRequest(site="site-c", protocol_version=PROTOCOL_VERSION), timeout=10))  # type: ignore[attr-defined]
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert error_reason(err) == pb.ERROR_REASON_IDENTITY_MISMATCH
        assert "may not speak for site 'site-c'" in (err.details() or "")
        # A relayed call must name its site.
        err = _refused(lambda: eu.Join(join, timeout=10))  # type: ignore[attr-defined]
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT

        # site-c joins on its own; relay eu then forges it into a partial sum with its own site.
        site_c = Site("site-c", certs, f"localhost:{server.port}")
        site_c.join()
        manifest, data = _partial(own.session_id, {"site-a": 1.0, "site-c": 1.0}, server.rounds.numel)
        err = _refused(lambda: eu.Upload(upload_requests(manifest, data), timeout=10))  # type: ignore[attr-defined]
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "site-c" in (err.details() or "")
        status = server.rounds.status()
        assert status["contributed"] == [] and status["round"] == 0
        # The honest partial (its own site only) is taken.
        manifest, data = _partial(own.session_id, {"site-a": 1.0}, server.rounds.numel)
        assert eu.Upload(upload_requests(manifest, data), timeout=10).complete  # type: ignore[attr-defined]
        assert server.rounds.status()["contributed"] == ["site-a"]
        site_c.close()
    finally:
        channel.close()  # type: ignore[attr-defined]


def test_a_relay_cannot_weigh_its_sites_up(certs: Path) -> None:
    """Under uniform weighting every site weighs 1, through a relay too; the round stays as it was."""
    server = coordinator(certs, weighting="uniform")
    channel, eu = _as(certs, "eu", server.port)
    try:
        session = eu.Join(pb.JoinRequest(site="site-a", protocol_version=PROTOCOL_VERSION), timeout=10).session_id  # type: ignore[attr-defined]
        manifest, data = _partial(session, {"site-a": 50.0}, server.rounds.numel)
        err = _refused(lambda: eu.Upload(upload_requests(manifest, data), timeout=10))  # type: ignore[attr-defined]
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "under weighting 'uniform' its weight is 1" in (err.details() or "")
        assert server.rounds.status()["contributed"] == []
    finally:
        channel.close()  # type: ignore[attr-defined]
        server.stop(grace=0)


def _weighted_partial(
    session: str, round_number: int, sites: dict[str, tuple[float, int]], numel: int
) -> tuple[pb.UploadManifest, bytes]:
    """A partial listing each site with the ``(weight, inner_steps)`` the relay claims for it."""
    encoded = parse_codec("none").encode(torch.full((numel,), 0.01))
    data = encoded.to_bytes()
    manifest = pb.UploadManifest(
        session_id=session, round=round_number, sample_weight=sum(w for w, _ in sites.values()),
        inner_steps=sum(n for _, n in sites.values()),
        blob=blob_manifest(data, codec="none", shape=[numel], dtype="float32", chunk_size=64),
        relayed_sites=[pb.RelayedSite(site=s, weight=w, inner_steps=n) for s, (w, n) in sites.items()],
    )
    return manifest, data


def test_a_relay_cannot_claim_more_inner_steps_than_a_round_runs(certs: Path) -> None:
    """weighting = "steps", H = 1: a relay listing its site with 1e12 steps (and the matching
    weight, within max_sample_weight) would set the mean; the partial is refused as the site's own
    upload would be, and the round is untouched."""
    server = coordinator(certs, weighting="steps", min_sites=1)
    channel, eu = _as(certs, "eu", server.port)
    try:
        session = eu.Join(pb.JoinRequest(site="site-a", protocol_version=PROTOCOL_VERSION), timeout=10).session_id  # type: ignore[attr-defined]
        manifest, data = _weighted_partial(session, 0, {"site-a": (1e12, 10**12)}, server.rounds.numel)
        err = _refused(lambda: eu.Upload(upload_requests(manifest, data), timeout=10))  # type: ignore[attr-defined]
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "site 'site-a': inner_steps 1000000000000" in (err.details() or ""), err.details()
        assert server.rounds.status()["contributed"] == []
        manifest, data = _weighted_partial(session, 0, {"site-a": (1.0, 1)}, server.rounds.numel)
        assert eu.Upload(upload_requests(manifest, data), timeout=10).complete  # type: ignore[attr-defined]
    finally:
        channel.close()  # type: ignore[attr-defined]
        server.stop(grace=0)


def test_a_relay_cannot_weigh_a_site_far_above_the_other_sites(certs: Path) -> None:
    """weighting = "samples": the weights a relay assigns its sites meet the bound a site's own
    weight meets, ``weight_factor`` x the other sites' recent weights."""
    server = coordinator(certs, min_sites=2, rounds=2)
    channel, eu = _as(certs, "eu", server.port)
    site_c = Site("site-c", certs, f"localhost:{server.port}")
    try:
        session = eu.Join(pb.JoinRequest(site="site-a", protocol_version=PROTOCOL_VERSION), timeout=10).session_id  # type: ignore[attr-defined]
        site_c.join()
        numel = server.rounds.numel
        manifest, data = _weighted_partial(session, 0, {"site-a": (100.0, 1)}, numel)
        assert eu.Upload(upload_requests(manifest, data), timeout=10).complete  # type: ignore[attr-defined]
        assert site_c.upload(torch.full((numel,), 0.01), "none", weight=200.0).complete
        deadline = time.monotonic() + 30
        while server.rounds.round < 1:
            assert time.monotonic() < deadline, server.rounds.status()
            server.rounds.wait_for_change(0.1)
        manifest, data = _weighted_partial(session, 1, {"site-a": (1e12, 1)}, numel)
        err = _refused(lambda: eu.Upload(upload_requests(manifest, data), timeout=10))  # type: ignore[attr-defined]
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = err.details() or ""
        assert "site 'site-a'" in details and "weight_factor" in details, details
        assert server.rounds.status()["contributed"] == []
        manifest, data = _weighted_partial(session, 1, {"site-a": (100.0, 1)}, numel)
        assert eu.Upload(upload_requests(manifest, data), timeout=10).complete  # type: ignore[attr-defined]
    finally:
        site_c.close()
        channel.close()  # type: ignore[attr-defined]
        server.stop(grace=0)


def test_relayed_sites_enter_the_guards_history_so_a_direct_site_cannot_grow_its_own_bound(certs: Path) -> None:
    """A direct site whose update grows 1.5x a round beside a relay's flat partial of two sites:
    the partial's norm stands for each of its sites in the guard's history, so the direct site's
    bound comes from them (norm_factor 4) and it is refused once it outgrows it. Before, only
    direct sites' norms entered the history: the lone direct site set its own median and grew
    without bound (11,223x in 24 rounds)."""
    server = coordinator(
        certs, min_sites=3, rounds=12, update_guard=UpdateGuardConfig(norm_floor=0.1, norm_factor=4.0)
    )
    channel, eu = _as(certs, "eu", server.port)
    site_c = Site("site-c", certs, f"localhost:{server.port}")
    try:
        session = eu.Join(pb.JoinRequest(site="site-a", protocol_version=PROTOCOL_VERSION), timeout=10).session_id  # type: ignore[attr-defined]
        eu.Join(pb.JoinRequest(site="site-b", protocol_version=PROTOCOL_VERSION), timeout=10)  # type: ignore[attr-defined]
        site_c.join()
        numel = server.rounds.numel
        refused_at = None
        for number in range(8):
            manifest, data = _weighted_partial(session, number, {"site-a": (1.0, 1), "site-b": (1.0, 1)}, numel)
            assert eu.Upload(upload_requests(manifest, data), timeout=10).complete  # type: ignore[attr-defined]
            try:
                site_c.upload(torch.full((numel,), 0.01 * 1.5**number), "none", round_number=number)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "site 'site-c''s update" in (err.details() or ""), err.details()
                assert "exceeds the bound" in (err.details() or ""), err.details()
                refused_at = number
                break
            deadline = time.monotonic() + 30
            while server.rounds.round <= number:
                assert time.monotonic() < deadline, server.rounds.status()
                server.rounds.wait_for_change(0.1)
        assert refused_at == 4  # 1.5^4 = 5.1 > 4 x the partials' norm, the first such round
    finally:
        site_c.close()
        channel.close()  # type: ignore[attr-defined]
        server.stop(grace=0)


def test_a_partial_beyond_the_norm_bound_its_sites_are_held_to_is_refused(certs: Path) -> None:
    """A weighted mean of updates within the guard's norm bound is within it too: a partial
    beyond it is refused like a site's own update, and the round stays as it was."""
    server = coordinator(certs, update_guard=UpdateGuardConfig(norm_floor=10.0))
    channel, eu = _as(certs, "eu", server.port)
    try:
        session = eu.Join(pb.JoinRequest(site="site-a", protocol_version=PROTOCOL_VERSION), timeout=10).session_id  # type: ignore[attr-defined]
        numel = server.rounds.numel
        manifest, data = _partial(session, {"site-a": 1.0}, numel, value=1e3)
        err = _refused(lambda: eu.Upload(upload_requests(manifest, data), timeout=10))  # type: ignore[attr-defined]
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "exceeds the bound 10" in (err.details() or "")
        assert server.rounds.status()["contributed"] == []
        assert float(server.rounds.weights.abs().max()) < 1e3
    finally:
        channel.close()  # type: ignore[attr-defined]
        server.stop(grace=0)


def test_a_site_counts_once_whether_its_own_upload_or_its_relays_partial_comes_first(certs: Path) -> None:
    """One update per site and round across direct and relayed uploads: the second path is
    refused (FAILED_PRECONDITION) and the round's sum holds the site once."""
    server = coordinator(certs, min_sites=4)
    channel, eu = _as(certs, "eu", server.port)
    us_channel, us = _as(certs, "us", server.port)
    site_a = Site("site-a", certs, f"localhost:{server.port}")
    site_c = Site("site-c", certs, f"localhost:{server.port}")
    try:
        numel = server.rounds.numel
        session = site_a.join().session_id
        site_c.join()
        # The relay's partial counts site-a first: site-a's own upload is refused.
        manifest, data = _partial(session, {"site-a": 1.0}, numel)
        assert eu.Upload(upload_requests(manifest, data), timeout=10).complete  # type: ignore[attr-defined]
        err = _refused(lambda: site_a.upload(torch.ones(numel), "none"))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "already counts in round 0" in (err.details() or "")
        # site-c's own upload counts first: its relay's partial naming it is refused.
        assert site_c.upload(torch.ones(numel), "none").complete
        manifest, data = _partial(session, {"site-c": 1.0}, numel)
        err = _refused(lambda: us.Upload(upload_requests(manifest, data), timeout=10))  # type: ignore[attr-defined]
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "site 'site-c' already has an update for round 0" in (err.details() or "")
        status = server.rounds.status()
        assert sorted(status["contributed"]) == ["site-a", "site-c"]
        aggregation = server.rounds._ctx.round.core.aggregation
        assert aggregation.total_weight == 2.0, "each site is in the sum once"  # type: ignore[attr-defined]
    finally:
        site_a.close()
        site_c.close()
        channel.close()  # type: ignore[attr-defined]
        us_channel.close()  # type: ignore[attr-defined]
        server.stop(grace=0)


def test_a_relay_replaces_a_refused_partial_and_the_round_goes_on(certs: Path) -> None:
    """A partial refused for its values (beyond the norm bound) never counted: the relay's next, honest partial for the
    same round replaces it instead of meeting MANIFEST_CONFLICT, so the round does not stall."""
    # site-b joins too and never uploads, so the round stays open after site-a's partial counts
    # (with min_sites = 1 it could close before the checks below read it).
    server = coordinator(certs, min_sites=2, update_guard=UpdateGuardConfig(norm_floor=10.0))
    channel, eu = _as(certs, "eu", server.port)
    try:
        session = eu.Join(pb.JoinRequest(site="site-a", protocol_version=PROTOCOL_VERSION), timeout=10).session_id  # type: ignore[attr-defined]
        eu.Join(pb.JoinRequest(site="site-b", protocol_version=PROTOCOL_VERSION), timeout=10)  # type: ignore[attr-defined]
        numel = server.rounds.numel
        manifest, data = _partial(session, {"site-a": 1.0}, numel, value=1e3)
        err = _refused(lambda: eu.Upload(upload_requests(manifest, data), timeout=10))  # type: ignore[attr-defined]
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        manifest, data = _partial(session, {"site-a": 1.0}, numel, value=0.5)
        assert eu.Upload(upload_requests(manifest, data), timeout=10).complete  # type: ignore[attr-defined]
        assert server.rounds.status()["contributed"] == ["site-a"]
        # Once a partial counts, a different one for the round is still a conflict.
        manifest, data = _partial(session, {"site-a": 1.0}, numel, value=0.25)
        err = _refused(lambda: eu.Upload(upload_requests(manifest, data), timeout=10))  # type: ignore[attr-defined]
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        channel.close()  # type: ignore[attr-defined]
        server.stop(grace=0)


def test_a_site_certificate_cannot_send_a_partial_sum(certs: Path, server: CoordinatorServer) -> None:
    site = Site("site-a", certs, f"localhost:{server.port}")
    try:
        session = site.join().session_id
        manifest, data = _partial(session, {"site-a": 1.0}, server.rounds.numel)
        err = _refused(lambda: site.stub.Upload(upload_requests(manifest, data), timeout=10))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "relay" in (err.details() or "")
        assert server.rounds.status()["contributed"] == []
    finally:
        site.close()


def test_a_relay_missing_from_the_relays_table_is_refused(certs: Path, server: CoordinatorServer) -> None:
    channel, ap = _as(certs, "ap", server.port)
    try:
        err = _refused(lambda: ap.Join(pb.JoinRequest(site="site-a", protocol_version=PROTOCOL_VERSION), timeout=10))  # type: ignore[attr-defined]
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "not in this coordinator's [relays] table" in (err.details() or "")
    finally:
        channel.close()  # type: ignore[attr-defined]


def test_a_relay_refuses_a_site_outside_its_list(certs: Path, server: CoordinatorServer) -> None:
    eu = relay(certs, "eu", server.port)
    site = Site("site-x", certs, f"localhost:{eu.port}")
    try:
        err = _refused(site.join)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "not served by relay 'eu'" in (err.details() or "")
        assert server.rounds.members == []
    finally:
        site.close()
        eu.stop(grace=0)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (
            {"privacy": {"dp": "central", "clip_norm": 1.0}, "algorithm": {"weighting": "uniform"}},
            "dp = 'central' without secure aggregation",
        ),
        ({"algorithm": {"aggregation": "median"}}, "robust aggregation"),
        ({"algorithm": {"late_updates": "fold"}}, "late updates are not folded through relays"),
        ({"algorithm": {"partial_updates": {"enabled": True}}}, "partial parameter updates"),
        ({"relays": {"eu": ["site-a"], "us": ["site-a"]}}, "already listed under relay 'eu'"),
        ({"relays": {"eu": []}}, "must list at least one site"),
        ({"relays": {"e u": ["site-a"]}}, "relay name"),
    ],
)
def test_relay_config_refuses_what_relays_cannot_run(extra: dict[str, object], needle: str) -> None:
    data: dict[str, object] = {"insecure": True, "relays": {"eu": ["site-a", "site-b"]}, **extra}
    with pytest.raises(ValueError, match="relays") as info:
        CoordinatorConfig.from_dict(data)
    assert needle in str(info.value)


@pytest.mark.parametrize("dp", ["off", "central", "distributed"])
def test_relay_config_takes_secure_aggregation_with_or_without_dp(dp: str) -> None:
    config = CoordinatorConfig.from_dict(
        {
            "insecure": True, "relays": {"eu": ["site-a", "site-b"], "us": ["site-c"]}, "min_sites": 3,
            "algorithm": {"weighting": "uniform"},
            "privacy": {"secure_aggregation": True, "clip_norm": 1.0, "dp": dp},
        }
    )
    assert config.relays == {"eu": ["site-a", "site-b"], "us": ["site-c"]}

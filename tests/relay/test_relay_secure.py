"""Secure aggregation through two regional relays, over real gRPC and mutual TLS.

Four sites (two per relay) run one secure round as the real site code does it (``SecureSite``:
identity bound to the TLS certificate, key advertisement, encrypted shares, masked upload,
survivor signature, unmask answer), every call going through their region's relay. ``site-d``
drops out after sending its shares (it leaves, or goes silent until the heartbeat timeout drops
it at its relay and at the coordinator), so the coordinator must rebuild its mask key from the
survivors' shares and remove its pairwise masks.

- The relayed result equals the flat secure result (same sites, same updates, no relay) and the
  plain mean of the three survivors within the secure-vs-plain tolerance (1e-5).
- Each relay forwards the ring sum of its sites' masked uploads, listing them; at that moment
  nothing the relay holds for the round contains a single site's masked vector, except the sum
  itself when the partial has one site (``us``: ``site-d`` dropped, so ``site-c``'s masked
  vector goes up alone, exactly what a flat coordinator receives from ``site-c``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from _relay_helpers import REGIONS, SITES, Site, coordinator, make_certs, relay, tiny_weights, updates
from google.protobuf.message import Message

from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig, PrivateUpdateEncoder, secure_index_seed
from geoloco.algorithms.privacy.secagg_stages import StageMessage
from geoloco.coordinator.metrics import read_metrics
from geoloco.coordinator.server import CoordinatorServer
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import secagg_wire
from geoloco.protos.protocol_version import PROTOCOL_VERSION
from geoloco.protos.transport_endpoints import client_channel, coordinator_stub
from geoloco.protos.transport_tls import TLSFiles
from geoloco.protos.wire_chunks import upload_requests
from geoloco.protos.wire_manifests import blob_manifest
from geoloco.relay import RelayServer
from geoloco.site_agent.secure_site import SecureSite, SiteIdentity

NUMEL = 37
PRIVACY = PrivacyConfig(secure_aggregation=True, clip_norm=10.0, chunk_size=16)
DROPPED = "site-d"
SURVIVORS = ["site-a", "site-b", "site-c"]
SECURE_VS_PLAIN = 1e-5
HEARTBEAT_TIMEOUT_S = 6.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"))


class SecureTestSite:
    """A site's secure round over raw gRPC calls, with the real site-side protocol code."""

    def __init__(self, name: str, certs: Path, target: str, privacy: PrivacyConfig) -> None:
        self.site = Site(name, certs, target)
        self.privacy = privacy
        self.tls = TLSFiles.from_dir(certs, name)
        self.masked = b""
        self.round_seed = 0
        self.round_number = 0
        """The round ``run`` takes part in."""
        self.drops = name == DROPPED
        """``run`` drops out after sending its shares."""
        self.certs = certs
        self.fail_over_to = ""
        """Set: the site's relay is gone before it uploads; it goes on with this address."""
        self.silent = False
        """The dropped site crashes (stops calling, heartbeats included) instead of leaving."""
        self.gone = threading.Event()

    def join(self) -> None:
        self.round_seed = int(self.site.join().round.round_seed)

    def heartbeats(self, stop: threading.Event) -> None:
        """What a site agent's heartbeat thread does, until the site is gone or the test stops."""
        while not stop.wait(0.3) and not self.gone.is_set():
            try:
                self.site.stub.Heartbeat(pb.HeartbeatRequest(session_id=self.site.session, round=0), timeout=10)
            except grpc.RpcError:
                continue  # a relay stopped under it (the failover test)

    def _call(self, stage: str, message: StageMessage) -> tuple[StageMessage, str]:
        request = secagg_wire.stage_request(
            stage, message, site="", session_id=self.site.session, round_number=self.round_number, wait_ms=1000
        )
        for _ in range(120):
            response: pb.SecureStageResponse = self.site.stub.SecureStage(request, timeout=30)
            if response.aborted:
                return None, response.abort_reason or "aborted"
            if response.ready:
                return secagg_wire.reply_message(stage, response), ""
        raise AssertionError(f"{self.site.name}: stage {stage} never closed")

    def run(self, update: torch.Tensor, dropped: threading.Event, go: threading.Event) -> None:
        ca, cert, key = self.tls.read()
        secure = SecureSite(
            SiteIdentity.create(self.site.name, cert, key), self.privacy, "none", numel=NUMEL,
            session=self.site.session, round_number=self.round_number, index_seed=secure_index_seed(self.round_seed),
            call=self._call, ca_pem=ca,
        )
        secure.share_keys()
        if self.drops:
            # Dropped after sending its shares: it never uploads nor answers the unmasking.
            if not self.silent:
                self.site.stub.Leave(pb.LeaveRequest(session_id=self.site.session, reason="dropout"), timeout=20)
            self.gone.set()
            dropped.set()
            return
        assert go.wait(timeout=60)
        if self.fail_over_to:
            self.site.close()
            self.site = Site(self.site.name, self.certs, self.fail_over_to, session=self.site.session)
        self.masked = secure.masked_upload(update, PrivateUpdateEncoder(self.privacy, "none"))
        manifest = pb.UploadManifest(
            session_id=self.site.session, round=self.round_number, sample_weight=1.0, inner_steps=1,
            metrics={"train_loss": 1.5},
            blob=blob_manifest(
                self.masked, codec="secagg", shape=[secure.context.numel], dtype="uint32",
                chunk_size=self.privacy.chunk_size * 4,
            ),
        )
        response: pb.UploadResponse = self.site.stub.Upload(upload_requests(manifest, self.masked), timeout=60)
        assert response.complete, self.site.name
        try:
            secure.unmask()
        except grpc.RpcError as err:
            # The round closed as soon as enough answers arrived: a repeated poll of the last
            # stage is then a late call (a site agent treats it as RoundClosed), or one after
            # the run's last round.
            late = (f"at round {self.round_number + 1}", f"the run finished after round {self.round_number}")
            details = err.details() or ""
            if err.code() != grpc.StatusCode.FAILED_PRECONDITION or not any(m in details for m in late):
                raise


def _secure_coordinator(
    certs: Path, *, relays: bool, privacy: PrivacyConfig = PRIVACY, metrics_path: Path | None = None
) -> CoordinatorServer:
    # A silent site is dropped after HEARTBEAT_TIMEOUT_S (by the coordinator and by its relay).
    return coordinator(
        certs, numel=NUMEL, min_sites=3, rounds=2, relays=relays, privacy=privacy, weighting="uniform",
        metrics_path=metrics_path,
        heartbeat_interval_s=1.0, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, secure_stage_timeout_s=60.0,
    )


def _secure_round(
    certs: Path, server: CoordinatorServer, targets: dict[str, str], ups: dict[str, torch.Tensor],
    privacy: PrivacyConfig = PRIVACY, between: Callable[[list[SecureTestSite]], None] | None = None,
    silent: bool = False,
) -> tuple[torch.Tensor, dict[str, pb.BroadcastHeader], dict[str, bytes]]:
    """One secure round of the four sites, ``site-d`` leaving (or going ``silent``) after its
    shares; ``between`` runs once it dropped, before the others upload."""
    sites = [SecureTestSite(name, certs, targets[name], privacy) for name in SITES]
    stop = threading.Event()
    try:
        for s in sites:
            s.join()
            s.silent = silent
        dropped, go = threading.Event(), threading.Event()
        with ThreadPoolExecutor(2 * len(sites)) as pool:
            try:
                for s in sites:
                    pool.submit(s.heartbeats, stop)
                futures = [pool.submit(s.run, ups[s.site.name], dropped, go) for s in sites]
                assert dropped.wait(timeout=120)
                if between is not None:
                    between(sites)
                go.set()
                for future in futures:
                    future.result(timeout=120)
                headers = {s.site.name: s.site.await_broadcast()[0] for s in sites if s.site.name != DROPPED}
            finally:
                stop.set()
                go.set()
        return server.rounds.weights.clone(), headers, {s.site.name: s.masked for s in sites}
    finally:
        for s in sites:
            s.site.close()


def _plain_result(certs: Path, ups: dict[str, torch.Tensor]) -> torch.Tensor:
    server = coordinator(certs, numel=NUMEL, min_sites=3, relays=False, weighting="uniform")
    sites = [Site(name, certs, f"localhost:{server.port}") for name in SURVIVORS]
    try:
        for s in sites:
            s.join()
        for s in sites:
            assert s.upload(ups[s.name], "none", weight=1.0).complete
        sites[0].await_broadcast()
        return server.rounds.weights.clone()
    finally:
        for s in sites:
            s.close()
        server.stop(grace=0)


def _held_bytes(root: object) -> list[bytes]:
    """Every byte string, array and tensor reachable from ``root`` (protobuf messages, which
    carry manifests only, and locks are skipped)."""
    seen: set[int] = set()
    out: list[bytes] = []
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (str, int, float, bool, type(None), Message, threading.Thread)):
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            out.append(obj.tobytes())
        elif isinstance(obj, torch.Tensor):
            out.append(obj.detach().cpu().numpy().tobytes())
        elif isinstance(obj, (bytes, bytearray, memoryview)):
            out.append(bytes(obj))
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        else:
            stack.extend(getattr(obj, "__dict__", {}).values())
            for cls in type(obj).__mro__:
                stack.extend(getattr(obj, name) for name in getattr(cls, "__slots__", ()) if hasattr(obj, name))
    return out


def _spy(relay_server: RelayServer, seen: list[tuple[pb.UploadManifest, bytes, list[bytes]]]) -> None:
    """Record each partial the relay sends upward and everything it holds for the round then."""
    upload: Callable[..., Any] = relay_server.upstream.upload

    def spied(manifest: pb.UploadManifest, data: bytes) -> Any:
        seen.append((manifest, bytes(data), _held_bytes(relay_server.hub.round)))
        return upload(manifest, data)

    relay_server.upstream.upload = spied  # type: ignore[method-assign]


@pytest.mark.parametrize("silent", [False, True], ids=["dropout-leaves", "dropout-goes-silent"])
def test_secure_round_through_two_relays_with_a_dropout_equals_flat_and_plain(certs: Path, silent: bool) -> None:
    ups = {name: u / 4 for name, u in updates(NUMEL, dyadic=False, seed=3).items()}
    plain = _plain_result(certs, ups)

    flat = _secure_coordinator(certs, relays=False)
    try:
        flat_weights, flat_headers, _ = _secure_round(
            certs, flat, {name: f"localhost:{flat.port}" for name in SITES}, ups, silent=silent
        )
        flat_record = flat.rounds.status()
    finally:
        flat.stop(grace=0)

    server = _secure_coordinator(certs, relays=True)
    relays = {name: relay(certs, name, server.port) for name in REGIONS}
    partials: dict[str, list[tuple[pb.UploadManifest, bytes, list[bytes]]]] = {name: [] for name in REGIONS}
    for name, r in relays.items():
        _spy(r, partials[name])
    try:
        targets = {site: f"localhost:{relays[region].port}" for region, names in REGIONS.items() for site in names}
        weights, headers, masked = _secure_round(certs, server, targets, ups, silent=silent)
        status = server.rounds.status()
    finally:
        for r in relays.values():
            r.stop(grace=0)
        server.stop(grace=0)

    # The coordinator unmasked the survivors' sum, site-d's masks removed: flat == relayed == plain.
    assert flat_record["round"] == status["round"] == 1
    torch.testing.assert_close(weights, flat_weights, rtol=0, atol=SECURE_VS_PLAIN)
    torch.testing.assert_close(weights, plain, rtol=0, atol=SECURE_VS_PLAIN)
    assert (weights - tiny_weights(NUMEL)[0]).abs().max() > 100 * SECURE_VS_PLAIN  # the round changed them
    for name in SURVIVORS:
        assert headers[name].included and flat_headers[name].included, name
        assert headers[name].num_contributors == flat_headers[name].num_contributors == 3

    # One partial per relay, the ring sum of the sites it lists; the relay held no site's
    # masked vector alone when it sent it (but for the one-site partial's sum itself).
    (eu,) = partials["eu"]
    (us,) = partials["us"]
    assert sorted(s.site for s in eu[0].relayed_sites) == ["site-a", "site-b"]
    assert [s.site for s in us[0].relayed_sites] == ["site-c"]
    ring = (np.frombuffer(masked["site-a"], np.uint32) + np.frombuffer(masked["site-b"], np.uint32)).tobytes()
    assert eu[1] == ring
    assert eu[1] not in (masked["site-a"], masked["site-b"])
    assert us[1] == masked["site-c"]
    for (_manifest, data, held), region in ((eu, "eu"), (us, "us")):
        own = [masked[s] for s in REGIONS[region] if masked[s]]
        holding = [b for b in held if any(m in b for m in own)]
        assert all(b == data for b in holding), region


def test_a_relay_cannot_advertise_keys_in_a_sites_name(certs: Path) -> None:
    """The relay's own certificate cannot vouch for a site's identity key: an advertisement it
    makes for ``site-a`` is refused by the coordinator (and would be by every site)."""
    server = _secure_coordinator(certs, relays=True)
    channels = {
        name: client_channel(f"localhost:{server.port}", tls=TLSFiles.from_dir(certs, name)) for name in REGIONS
    }
    stubs = {name: coordinator_stub(channel) for name, channel in channels.items()}
    try:
        joined = {
            site: stubs[region].Join(pb.JoinRequest(site=site, protocol_version=PROTOCOL_VERSION), timeout=20)
            for region, site in (("eu", "site-a"), ("eu", "site-b"), ("us", "site-c"))
        }
        _ca, relay_cert, relay_key = TLSFiles.from_dir(certs, "eu").read()
        forged = SiteIdentity.create("site-a", relay_cert, relay_key)

        def call(stage: str, message: StageMessage) -> tuple[StageMessage, str]:
            request = secagg_wire.stage_request(
                stage, message, site="site-a", session_id=joined["site-a"].session_id, round_number=0, wait_ms=0
            )
            stubs["eu"].SecureStage(request, timeout=20)
            raise AssertionError("the forged advertisement was accepted")

        secure = SecureSite(
            forged, PRIVACY, "none", numel=NUMEL, session=joined["site-a"].session_id, round_number=0,
            index_seed=secure_index_seed(joined["site-a"].round.round_seed), call=call, ca_pem=None,
        )
        with pytest.raises(grpc.RpcError) as info:
            secure.share_keys()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "is not bound to a certificate of this run's CA" in (info.value.details() or "")
    finally:
        for channel in channels.values():
            channel.close()
        server.stop(grace=0)


def test_distributed_dp_through_relays_is_accounted_as_flat(certs: Path, tmp_path: Path) -> None:
    """DP accounting is the coordinator's, unchanged: the same round with distributed noise
    reports the same epsilon and survivors through relays as flat."""
    privacy = PrivacyConfig(
        secure_aggregation=True, clip_norm=10.0, chunk_size=16, dp="distributed", noise_multiplier=1.0
    )
    ups = updates(NUMEL, dyadic=False, seed=4)
    records = {}
    for relayed in (False, True):
        metrics = tmp_path / f"{'relayed' if relayed else 'flat'}.jsonl"
        server = _secure_coordinator(certs, relays=relayed, privacy=privacy, metrics_path=metrics)
        relays = {name: relay(certs, name, server.port) for name in REGIONS} if relayed else {}
        try:
            targets = {
                site: f"localhost:{relays[region].port if relayed else server.port}"
                for region, names in REGIONS.items()
                for site in names
            }
            _secure_round(certs, server, targets, ups, privacy)
        finally:
            for r in relays.values():
                r.stop(grace=0)
            server.stop(grace=0)
        (records[relayed], *_) = read_metrics(metrics)
    flat, through = records[False], records[True]
    assert sorted(through["participants"]) == sorted(flat["participants"]) == SURVIVORS
    assert through["epsilon"] == flat["epsilon"] > 0
    for key in ("survivors", "noise_multiplier", "epsilon"):
        assert through["privacy"][key] == flat["privacy"][key], key
    assert through["privacy"]["survivors"] == SURVIVORS


def test_a_relay_killed_after_the_key_stages_its_sites_upload_to_the_coordinator(certs: Path) -> None:
    """Secure round, relay ``eu`` stopped after the key stages: its sites upload their own masked
    updates to the coordinator (their key-stage messages are already there), ``us`` still sends
    a partial; the round unmasks to the flat result of the survivors."""
    ups = {name: u / 4 for name, u in updates(NUMEL, dyadic=False, seed=5).items()}
    plain = _plain_result(certs, ups)
    server = _secure_coordinator(certs, relays=True)
    relays = {name: relay(certs, name, server.port) for name in REGIONS}
    partials: dict[str, list[tuple[pb.UploadManifest, bytes, list[bytes]]]] = {name: [] for name in REGIONS}
    for name, r in relays.items():
        _spy(r, partials[name])

    def kill_eu(sites: list[SecureTestSite]) -> None:
        relays["eu"].stop(grace=0)
        for s in sites:
            if s.site.name in REGIONS["eu"]:
                s.fail_over_to = f"localhost:{server.port}"

    try:
        targets = {site: f"localhost:{relays[region].port}" for region, names in REGIONS.items() for site in names}
        weights, headers, _masked = _secure_round(certs, server, targets, ups, between=kill_eu)
        record = server.rounds.status()
    finally:
        for r in relays.values():
            r.stop(grace=0)
        server.stop(grace=0)
    assert record["round"] == 1
    assert partials["eu"] == [] and [s.site for s in partials["us"][0][0].relayed_sites] == ["site-c"]
    torch.testing.assert_close(weights, plain, rtol=0, atol=SECURE_VS_PLAIN)
    assert all(headers[name].included and headers[name].num_contributors == 3 for name in SURVIVORS)


def test_the_coordinator_refuses_a_masked_partial_it_cannot_count(certs: Path) -> None:
    """Every listed site is checked as if it uploaded itself: a site of another region, a
    weight other than 1 and sites that did not share keys are refused; nothing is counted."""
    server = _secure_coordinator(certs, relays=True)
    channels = {
        name: client_channel(f"localhost:{server.port}", tls=TLSFiles.from_dir(certs, name)) for name in REGIONS
    }
    stubs = {name: coordinator_stub(channel) for name, channel in channels.items()}
    try:
        session = ""
        for region, site in (("eu", "site-a"), ("eu", "site-b"), ("us", "site-c")):
            join = pb.JoinRequest(site=site, protocol_version=PROTOCOL_VERSION)
            session = stubs[region].Join(join, timeout=20).session_id
        data = bytes(NUMEL * 4)

        def partial(sites: dict[str, float]) -> grpc.RpcError:
            manifest = pb.UploadManifest(
                session_id=session, round=0, sample_weight=float(len(sites)), inner_steps=len(sites),
                blob=blob_manifest(data, codec="secagg", shape=[NUMEL], dtype="uint32", chunk_size=64),
                relayed_sites=[pb.RelayedSite(site=s, weight=w, inner_steps=1) for s, w in sites.items()],
            )
            with pytest.raises(grpc.RpcError) as info:
                stubs["eu"].Upload(upload_requests(manifest, data), timeout=20)
            return info.value

        err = partial({"site-a": 1.0, "site-c": 1.0})
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "may not speak for site 'site-c'" in err.details()
        err = partial({"site-a": 2.0, "site-b": 1.0})
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "counts with weight 1" in err.details()
        err = partial({"site-a": 1.0, "site-b": 1.0})
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "secure round 0" in err.details()
        assert server.rounds.status()["contributed"] == []
    finally:
        for channel in channels.values():
            channel.close()
        server.stop(grace=0)

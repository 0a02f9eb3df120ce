"""A round through two regional relays equals the same round flat, over real gRPC and mutual TLS.

Four sites upload the same updates twice: once straight to a coordinator, once through two
relays (two sites each) to a second coordinator. With relays the coordinator adds each relay's
partial mean ``Σ w_k g_k / W`` with weight ``W``; the flat coordinator adds every ``w_k g_k``.

- Bitwise: with updates whose float32 sums are exact (multiples of 1/64) and weights whose
  sum per relay is a power of two, the coordinators' new weights are bit for bit equal whatever the summation order.
- Otherwise within float32 rounding: the relayed mean differs from the flat one only by the
  order of additions (the partials are summed first) and one division by ``W`` undone by one
  multiplication by ``W``: a few ulp of ``Σ |w_k g_k| / Σ w_k``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from _relay_helpers import REGIONS, SITES, Site, coordinator, make_certs, relay, updates

from geoloco.algorithms.update_guard import UpdateGuardConfig
from geoloco.coordinator.server import CoordinatorServer
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.errors import StatusError
from geoloco.protos.wire_assembly import Download, read_broadcast_stream
from geoloco.protos.wire_chunks import upload_requests
from geoloco.protos.wire_files import BlobSpill
from geoloco.relay import RelayServer
from geoloco.relay.upstream import Upstream


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"))


@contextmanager
def _regions(
    certs: Path, *, relay_options: dict[str, Any] | None = None, **coordinator_options: Any
) -> Iterator[tuple[CoordinatorServer, dict[str, RelayServer], list[Site]]]:
    """A coordinator, one relay per region and every site joined through its relay; all
    stopped afterwards (the coordinator object stays readable). The test's sites send no
    heartbeats: unless a test is about dropping them, the coordinator waits for them long enough
    that a loaded machine does not drop one between two of its calls."""
    coordinator_options.setdefault("heartbeat_timeout_s", 120.0)
    server = coordinator(certs, **coordinator_options)
    relays = {name: relay(certs, name, server.port, **(relay_options or {})) for name in REGIONS}
    sites = [Site(n, certs, f"localhost:{relays[r].port}") for r, names in REGIONS.items() for n in names]
    try:
        for s in sites:
            s.join()
        yield server, relays, sites
    finally:
        for s in sites:
            s.close()
        for r in relays.values():
            r.stop(grace=0)
        server.stop(grace=0)


def _upload_or_error(
    site: Site, update: torch.Tensor, codec: str, weight: float = 1.0, *, round_number: int = 0
) -> object:
    """The site's upload answer, or the error it got (uploads run concurrently in a pool)."""
    try:
        return site.upload(update, codec, weight=weight, round_number=round_number)
    except grpc.RpcError as err:
        return err


def _broadcast_or_error(site: Site) -> object:
    """The site's broadcast header, or the error its wait got."""
    try:
        return site.await_broadcast()[0]
    except grpc.RpcError as err:
        return err


def _answer_lost(monkeypatch: pytest.MonkeyPatch, relay_name: str | None = None) -> None:
    """Relay ``relay_name``'s partial (every relay's: None) reaches the coordinator, but the
    answer is lost and the resend refused as late."""
    real_upload = Upstream.upload

    def answer_lost(self: Upstream, manifest: object, data: bytes) -> object:
        response = real_upload(self, manifest, data)  # type: ignore[arg-type]
        if relay_name is not None and self.config.name != relay_name:
            return response
        raise StatusError(
            "round 0 is closed; apply its broadcast (AwaitBroadcast)", code=grpc.StatusCode.FAILED_PRECONDITION
        )

    monkeypatch.setattr(Upstream, "upload", answer_lost)


def _wait_round(server: CoordinatorServer, number: int) -> None:
    deadline = time.monotonic() + 60
    while server.rounds.round < number:
        assert time.monotonic() < deadline, f"round {number - 1} never closed: {server.rounds.status()}"
        time.sleep(0.02)


def _flat(
    certs: Path, ups: dict[str, torch.Tensor], weights: dict[str, float], codec: str
) -> tuple[torch.Tensor, bytes]:
    server = coordinator(certs, codec=codec, numel=next(iter(ups.values())).numel())
    sites = [Site(name, certs, f"localhost:{server.port}") for name in SITES]
    try:
        for s in sites:
            s.join()
        for s in sites:
            assert s.upload(ups[s.name], codec, weight=weights[s.name]).complete
        _wait_round(server, 1)
        header, delta = sites[0].await_broadcast()
        return server.rounds.weights.clone(), delta
    finally:
        for s in sites:
            s.close()
        server.stop(grace=0)


def _relayed(
    certs: Path, ups: dict[str, torch.Tensor], weights: dict[str, float], codec: str, tmp_path: Path,
    upward_codec: str = "none",
    spill: bool = False,
) -> Iterator[tuple[torch.Tensor, dict[str, tuple[object, bytes]], CoordinatorServer, dict[str, RelayServer]]]:
    """``spill``: every upload, at the relays and the coordinator, arrives in a file buffer."""
    server = coordinator(
        certs, codec=codec, numel=next(iter(ups.values())).numel(), metrics_path=tmp_path / "metrics.jsonl"
    )
    relays = {
        name: relay(
            certs, name, server.port, metrics_path=str(tmp_path / f"{name}.jsonl"), upward_codec=upward_codec
        )
        for name in REGIONS
    }
    if spill:
        server.rounds.intake.spill = BlobSpill(str(tmp_path / "coordinator-uploads"), min_bytes=1)
        for name, r in relays.items():
            r.hub.spill = BlobSpill(str(tmp_path / f"{name}-uploads"), min_bytes=1)
    sites = [
        Site(name, certs, f"localhost:{relays[region].port}") for region, names in REGIONS.items() for name in names
    ]
    try:
        for s in sites:
            s.join()
        # A relay answers an upload once the coordinator took its partial: upload concurrently.
        with ThreadPoolExecutor(len(sites)) as pool:
            done = list(pool.map(lambda s: s.upload(ups[s.name], codec, weight=weights[s.name]), sites))
        assert all(d.complete for d in done)
        _wait_round(server, 1)
        broadcasts = {s.name: s.await_broadcast() for s in sites}
        yield server.rounds.weights.clone(), broadcasts, server, relays  # type: ignore[misc]
    finally:
        for s in sites:
            s.close()
        for r in relays.values():
            r.stop(grace=0)
        server.stop(grace=0)


@pytest.mark.parametrize("spill", [False, True], ids=["in-memory", "file-backed-uploads"])
def test_relayed_round_is_bitwise_the_flat_round_when_sums_are_exact(certs: Path, tmp_path: Path, spill: bool) -> None:
    numel = 37
    ups = updates(numel, dyadic=True)
    # Each relay's W is a power of two, so its mean Σ w_k g_k / W times W gives back the sum.
    weights = {"site-a": 1.0, "site-b": 3.0, "site-c": 2.0, "site-d": 2.0}
    flat_weights, flat_delta = _flat(certs, ups, weights, "none")
    for relayed_weights, broadcasts, server, _relays in _relayed(certs, ups, weights, "none", tmp_path, spill=spill):
        assert torch.equal(relayed_weights, flat_weights)
        for name, (header, delta) in broadcasts.items():
            assert header.included, name  # type: ignore[attr-defined]
            assert header.num_contributors == 4  # type: ignore[attr-defined]
            assert delta == flat_delta, name
        # The coordinator counted four contributors with their own weights, and every byte
        # from the sites' region arrived on the relay's link.
        status = server.rounds.status()
        assert status["members"] == sorted(SITES)
    if spill:  # each host made its file buffers in its own folder (unnamed files: none left)
        for host in ("coordinator", *REGIONS):
            folder = tmp_path / f"{host}-uploads"
            assert folder.is_dir() and not any(folder.iterdir()), host
    # The coordinator's record: each relayed site with its own metrics and its relay, and the
    # bytes per link (the relays', no site's).
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sorted(record["participants"]) == sorted(SITES)
    assert record["sample_weights"] == weights
    assert record["site_metrics"]["site-a"] == {"train_loss": 1.5, "relay:eu": 1.0}
    assert record["site_metrics"]["site-d"] == {"train_loss": 1.5, "relay:us": 1.0}
    assert set(record["bytes_up"]) == {"relay:eu", "relay:us"}
    # Each relay's metrics record names the sites its partial contained and the bytes per link.
    for region, names in REGIONS.items():
        records = [json.loads(line) for line in (tmp_path / f"{region}.jsonl").read_text().splitlines()]
        assert [r["round"] for r in records] == [0]
        assert records[0]["partial"] == {name: weights[name] for name in names}
        assert records[0]["counted_by_coordinator"] is True
        links = records[0]["bytes"]
        assert links["relay->coordinator"] > 0 and links["coordinator->relay"] > 0
        assert all(links[f"site:{name}->relay"] > 0 for name in names)


def test_a_broadcast_that_arrives_before_the_partials_answer_waits_for_it(
    certs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relay's upward broadcast wait goes out before its partial, as a site's goes out before
    its upload, so the broadcast leaves the coordinator when the round closes. It can then arrive
    before the coordinator's answer to the partial (slowed here by 0.5 s), and only that answer
    says which sites counted: the relay's copy of the broadcast waits for it instead of telling
    the sites they were left out (they would put their updates back and send them twice)."""
    events: list[tuple[str, str, float]] = []
    real_upload, real_stream = Upstream.upload, Upstream.stream

    def slow_answer(self: Upstream, manifest: object, data: bytes) -> object:
        response = real_upload(self, manifest, data)  # type: ignore[arg-type]
        time.sleep(0.5)
        events.append(("answered", self.config.name, time.monotonic()))
        return response

    def watched_stream(self: Upstream, method: str, request: object) -> Iterator[object]:
        if method == "AwaitBroadcast":
            events.append(("asked", self.config.name, time.monotonic()))
        return real_stream(self, method, request)

    monkeypatch.setattr(Upstream, "upload", slow_answer)
    monkeypatch.setattr(Upstream, "stream", watched_stream)
    numel = 37
    ups = updates(numel, dyadic=True)
    weights = {"site-a": 1.0, "site-b": 3.0, "site-c": 2.0, "site-d": 2.0}
    flat_weights, flat_delta = _flat(certs, ups, weights, "none")
    for relayed_weights, broadcasts, _server, _relays in _relayed(certs, ups, weights, "none", tmp_path):
        assert torch.equal(relayed_weights, flat_weights)
        for name, (header, delta) in broadcasts.items():
            assert header.included, name  # type: ignore[attr-defined]
            assert delta == flat_delta, name
    for region in REGIONS:
        asked = [t for what, name, t in events if what == "asked" and name == region]
        answered = [t for what, name, t in events if what == "answered" and name == region]
        assert len(answered) == 1 and asked and asked[0] < answered[0], events
        (record,) = [json.loads(line) for line in (tmp_path / f"{region}.jsonl").read_text().splitlines()]
        assert record["counted_by_coordinator"] is True


def test_relayed_round_matches_flat_within_float32_rounding_with_int8(certs: Path, tmp_path: Path) -> None:
    numel = 37
    ups = updates(numel, dyadic=False, seed=3)
    weights = {"site-a": 3.0, "site-b": 1.7, "site-c": 0.9, "site-d": 5.25}
    flat_weights, _ = _flat(certs, ups, weights, "int8")
    for relayed_weights, broadcasts, _server, _relays in _relayed(certs, ups, weights, "int8", tmp_path):
        assert not torch.equal(relayed_weights, torch.zeros_like(relayed_weights))
        # A few float32 ulp of the update scale: the sums are reassociated, nothing else differs.
        torch.testing.assert_close(relayed_weights, flat_weights, rtol=0, atol=1e-6)
        assert all(header.included for header, _ in broadcasts.values())  # type: ignore[attr-defined]


def test_relay_upward_uplink_codec_sends_a_quarter_and_keeps_its_error_feedback(certs: Path, tmp_path: Path) -> None:
    """``upward_codec = "uplink"``: the partial goes up int8 like the sites' updates (a quarter of
    the float32 bytes); what int8 dropped stays in the relay's residual, and the result is the
    flat one within one int8 quantization step of the partial mean."""
    numel = 4001
    ups = updates(numel, dyadic=False, seed=5)
    weights = {"site-a": 3.0, "site-b": 1.7, "site-c": 0.9, "site-d": 5.25}
    flat_weights, _ = _flat(certs, ups, weights, "int8")
    for relayed_weights, broadcasts, server, relays in _relayed(
        certs, ups, weights, "int8", tmp_path, upward_codec="uplink"
    ):
        assert all(header.included for header, _ in broadcasts.values())  # type: ignore[attr-defined]
        scale = max(float(u.abs().max()) for u in ups.values())
        # Outer Nesterov (lr 0.7, momentum 0.9) moves the weights 1.33x the mean update.
        torch.testing.assert_close(relayed_weights, flat_weights, rtol=0, atol=1.33 * scale / 127)
        assert not torch.equal(relayed_weights, flat_weights)
        for r in relays.values():
            (residual,) = r.hub.residuals.values()
            assert 0 < float(residual.abs().max()) <= scale / 127 * 10
        up = server.rounds.status()
        assert up["round"] == 1
    records = [json.loads(line) for line in (tmp_path / "eu.jsonl").read_text().splitlines()]
    int8_bytes = records[0]["bytes"]["relay->coordinator"]
    assert int8_bytes < 2 * numel  # a float32 partial alone is 4 bytes per parameter


def test_an_update_refused_at_the_relay_is_reported_so_the_round_does_not_wait_for_it(
    certs: Path, tmp_path: Path
) -> None:
    """The relay applies the run's [update_guard] to each site's update, as the coordinator would
    to a site's own upload; the refusal goes up with the partial, so the coordinator records the
    site as rejected instead of waiting for it (no deadline here: it would wait forever)."""
    numel = 37
    ups = updates(numel, dyadic=True)
    ups["site-a"] = torch.full((numel,), 1e20)  # finite, but far beyond any norm bound
    weights = dict.fromkeys(SITES, 1.0)
    with _regions(certs, numel=numel, metrics_path=tmp_path / "metrics.jsonl", min_sites=3) as (server, relays, sites):
        with ThreadPoolExecutor(len(sites)) as pool:
            answers = dict(zip(
                [s.name for s in sites],
                pool.map(lambda s: _upload_or_error(s, ups[s.name], "none", weights[s.name]), sites),
                strict=True,
            ))
        refused = answers.pop("site-a")
        assert isinstance(refused, grpc.RpcError) and refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "update_guard" in (refused.details() or "")
        assert all(a.complete for a in answers.values())  # type: ignore[attr-defined]
        _wait_round(server, 1)
        header, _ = sites[0].await_broadcast()
        assert not header.included and header.num_contributors == 3
        assert header.refused, "site-a drops its refused update instead of keeping it"
        header, _ = sites[1].await_broadcast()
        assert header.included and not header.refused
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sorted(record["participants"]) == ["site-b", "site-c", "site-d"]
    assert record["rejected"] == ["site-a"]


def test_a_partial_whose_answer_was_lost_still_counts_its_sites(
    certs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator took relay eu's partial, but the answer never reached the relay and its
    resend was refused as late (the partial had closed the round). The relay took that for a
    refusal and told its sites they were left out, so each would put its counted update back
    into its residual and send it twice. The broadcast says the partial counted, and the
    sites now hear that."""
    _answer_lost(monkeypatch, "eu")
    numel = 37
    ups = updates(numel, dyadic=True)
    weights = {"site-a": 1.0, "site-b": 3.0, "site-c": 2.0, "site-d": 2.0}
    flat_weights, _ = _flat(certs, ups, weights, "none")
    with _regions(certs, numel=numel) as (server, relays, sites):
        with ThreadPoolExecutor(len(sites)) as pool:
            list(pool.map(lambda s: _upload_or_error(s, ups[s.name], "none", weights[s.name]), sites))
        _wait_round(server, 1)
        for s in sites:
            header, _ = s.await_broadcast()
            assert header.included and header.num_contributors == 4, s.name
    assert torch.equal(server.rounds.weights, flat_weights)


def test_a_site_cannot_move_its_relay_to_a_later_round(certs: Path, tmp_path: Path) -> None:
    """The relay follows the coordinator's rounds, never a site's: an upload or a withheld notice
    naming a later round used to end the relay's open round, and every update in it. Now the
    upload is refused as the coordinator refuses it, the notice changes nothing (its wait gets
    the coordinator's answer), one from another session is refused like its wait, and the round
    goes on with every site."""
    numel = 37
    ups = updates(numel, dyadic=True)
    weights = {"site-a": 1.0, "site-b": 3.0, "site-c": 2.0, "site-d": 2.0}
    flat_weights, _ = _flat(certs, ups, weights, "none")
    with _regions(certs, numel=numel) as (server, relays, sites):
        a = sites[0]
        with pytest.raises(grpc.RpcError) as ahead:
            a.upload(ups[a.name], "none", round_number=5, weight=weights[a.name])
        assert ahead.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "round 5 is not open yet" in (ahead.value.details() or "")
        notice = a.stub.AwaitBroadcast(
            pb.AwaitBroadcastRequest(session_id=a.session, round=7, withheld="no update"), timeout=10
        )
        with pytest.raises(grpc.RpcError) as waited:  # the coordinator's answer to the wait, passed on
            list(notice)
        assert waited.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "round 7 is not open yet" in (waited.value.details() or "")
        stale = a.stub.AwaitBroadcast(pb.AwaitBroadcastRequest(session_id="stale", round=0, withheld="x"), timeout=5)
        with pytest.raises(grpc.RpcError) as refused:
            list(stale)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert [r.hub.round.number for r in relays.values()] == [0, 0]
        with ThreadPoolExecutor(len(sites)) as pool:
            done = list(pool.map(lambda s: s.upload(ups[s.name], "none", weight=weights[s.name]), sites))
        assert all(d.complete for d in done)
        _wait_round(server, 1)
        for s in sites:
            header, _ = s.await_broadcast()
            assert header.included and header.num_contributors == 4, s.name
    assert torch.equal(server.rounds.weights, flat_weights)


def test_a_site_that_withholds_while_its_upload_arrives_is_left_out_once(certs: Path, tmp_path: Path) -> None:
    """Site a's upload is half in at the relay when the site says it sends no update this round
    (``withheld``). The coordinator drops such an upload; the relay used to let it finish, so
    its partial listed site a as counted and as rejected, and the coordinator refused the whole
    partial. Now the upload stream is stopped and the round counts the other three."""
    numel = 37
    ups = updates(numel, dyadic=True)
    with _regions(certs, numel=numel, metrics_path=tmp_path / "metrics.jsonl", min_sites=3) as (server, relays, sites):
        a, *others = sites
        manifest, data = a.manifest(ups[a.name], "none", metrics={})
        release = threading.Event()

        def half_then_rest() -> Iterator[object]:
            requests = iter(upload_requests(manifest, data))
            yield next(requests)  # the manifest
            yield next(requests)  # the first chunk
            release.wait(30)
            yield from requests

        with ThreadPoolExecutor(1) as pool:
            stream = pool.submit(a.stub.Upload, half_then_rest(), timeout=30)
            hub = relays["eu"].hub
            deadline = time.monotonic() + 20
            while a.name not in hub.round.assemblers:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            notice = a.stub.AwaitBroadcast(
                pb.AwaitBroadcastRequest(session_id=a.session, round=0, withheld="no update"), timeout=30
            )
            while a.name in hub.round.assemblers:  # the notice reached the relay
                assert time.monotonic() < deadline
                time.sleep(0.01)
            release.set()
            with pytest.raises(grpc.RpcError) as stopped:
                stream.result()
            assert stopped.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with ThreadPoolExecutor(len(others)) as pool:
            done = list(pool.map(lambda s: s.upload(ups[s.name], "none"), others))
        assert all(d.complete for d in done)
        _wait_round(server, 1)
        header = read_broadcast_stream(notice, Download())
        assert not header.included and header.num_contributors == 3
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sorted(record["participants"]) == ["site-b", "site-c", "site-d"]
    assert record["rejected"] == ["site-a"]


@pytest.mark.parametrize(
    ("inner_steps", "metrics", "why"),
    [
        (10**6, {"train_loss": 1.5}, "inner steps"),
        (1, {f"m{k}": 1.0 for k in range(40)}, "at most 32 are allowed"),
    ],
    ids=["inner-steps-beyond-the-round", "too-many-metrics"],
)
def test_what_the_coordinator_would_refuse_of_one_site_the_relay_refuses_for_that_site_alone(
    certs: Path, tmp_path: Path, inner_steps: int, metrics: dict[str, float], why: str
) -> None:
    """Site a's upload claims more inner steps than a round runs, or carries too many metrics:
    the coordinator refuses such an upload of a direct site, alone. The relay passed it on, and
    the coordinator refused the whole partial, every site of the region with it. Now the relay
    refuses site a, reports it, and the round counts the other three."""
    numel = 37
    ups = updates(numel, dyadic=True)
    with _regions(certs, numel=numel, metrics_path=tmp_path / "metrics.jsonl", min_sites=3) as (server, relays, sites):
        a, *others = sites
        with pytest.raises(grpc.RpcError) as refused:
            a.upload(ups[a.name], "none", inner_steps=inner_steps, metrics=metrics)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert why in (refused.value.details() or "")
        with ThreadPoolExecutor(len(others)) as pool:
            done = list(pool.map(lambda s: s.upload(ups[s.name], "none"), others))
        assert all(d.complete for d in done)
        _wait_round(server, 1)
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sorted(record["participants"]) == ["site-b", "site-c", "site-d"]
    assert record["rejected"] == ["site-a"] and why in record["rejected_reasons"]["site-a"]


def test_the_broadcast_a_relay_fetches_speaks_for_a_site_of_its_partial(
    certs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Site a withholds its update and is the first of relay eu's sites to wait; then eu's
    partial (site b alone) is taken but its answer is lost. The broadcast's ``included`` is
    about the site the relay asked for: had the first waiting site's wait started the upstream
    wait, it would speak of site a, say nothing of the partial, and site b would be told it was
    left out (and send its counted update again)."""
    _answer_lost(monkeypatch, "eu")
    numel = 37
    ups = updates(numel, dyadic=True)
    with _regions(certs, numel=numel, min_sites=3) as (server, relays, sites):
        a, b, *others = sites
        notice = a.stub.AwaitBroadcast(
            pb.AwaitBroadcastRequest(session_id=a.session, round=0, withheld="no update"), timeout=30
        )
        hub = relays["eu"].hub
        deadline = time.monotonic() + 20
        while hub.round.core is None or a.name not in hub.round.core.rejected:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda s: _upload_or_error(s, ups[s.name], "none"), [b, *others]))
        _wait_round(server, 1)
        header, _ = b.await_broadcast()
        assert header.included and header.num_contributors == 3
        assert not read_broadcast_stream(notice, Download()).included


@pytest.mark.parametrize("case", ["answer-lost", "round-aborted"])
def test_the_relays_error_feedback_follows_what_its_sites_are_told(
    certs: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """With ``upward_codec = "uplink"`` the relay keeps what int8 dropped of its partial in its
    own residual. It must follow the same verdict as its sites: a partial that counted although
    its answer was lost keeps the new residual (rewinding it would send the old one twice); a
    partial whose round was aborted goes back to the residual before it, as its sites take their
    updates back."""
    if case == "answer-lost":
        _answer_lost(monkeypatch)
        guard = UpdateGuardConfig()
        ups = updates(37, dyadic=False, seed=4)
    else:
        guard = UpdateGuardConfig(max_abs_weight=10.0)
        ups = {name: torch.full((37,), 50.0) + torch.linspace(0, 1, 37) for name in SITES}
    with _regions(
        certs, codec="int8", numel=37, update_guard=guard, relay_options={"upward_codec": "uplink"}
    ) as (server, relays, sites):
        with ThreadPoolExecutor(len(sites)) as pool:
            list(pool.map(lambda s: _upload_or_error(s, ups[s.name], "int8"), sites))
        _wait_round(server, 1)
        headers = [s.await_broadcast()[0] for s in sites]
        kept = [0 in r.hub.residuals for r in relays.values()]
    if case == "answer-lost":
        assert all(h.included for h in headers) and kept == [True, True]
    else:
        assert not any(h.included for h in headers) and kept == [False, False]


def test_sites_dropped_as_silent_after_reaching_their_relay_still_count(certs: Path) -> None:
    """A relay may wait longer for its region's sites than the coordinator waits for a silent
    site; the sites here send no heartbeats and the coordinator drops them after 1 s. Their
    updates, already at the relay, count, as a direct site's finished upload does when it
    leaves. The coordinator used to refuse the whole partial (not a member), and the round,
    waiting for four updates, never closed."""
    numel = 37
    ups = updates(numel, dyadic=True)
    weights = {"site-a": 1.0, "site-b": 3.0, "site-c": 2.0, "site-d": 2.0}
    flat_weights, _ = _flat(certs, ups, weights, "none")
    with _regions(certs, numel=numel, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0) as (server, relays, sites):
        deadline = time.monotonic() + 20
        while server.rounds.members:  # every site dropped as silent
            assert time.monotonic() < deadline, server.rounds.members
            time.sleep(0.05)
        with ThreadPoolExecutor(2 * len(sites)) as pool:
            # Each site's wait for the broadcast, which the relay answers itself, tells the relay
            # the site is alive (the coordinator never hears of it): the relay waits for the
            # region's two updates instead of sending the first alone. (The relay's own wait
            # upstream, made for a site the coordinator dropped, is refused: not a member.)
            for s in sites:
                pool.submit(_broadcast_or_error, s)
            done = list(pool.map(lambda s: s.upload(ups[s.name], "none", weight=weights[s.name]), sites))
            assert all(d.complete for d in done)
        _wait_round(server, 1)
    assert torch.equal(server.rounds.weights, flat_weights)


def test_a_round_the_coordinator_aborts_after_taking_the_partials_counts_no_relayed_site(
    certs: Path, tmp_path: Path
) -> None:
    """The coordinator took both partials, then aborted the round: the new weights would leave
    ``[update_guard] max_abs_weight``. Nobody counted and the model is unchanged, so every site,
    relayed or not, hears ``included = false`` and keeps its update in its residual. The relay
    used to answer from its partial's acceptance alone, and its sites' work was lost."""
    numel = 37
    ups = {name: torch.full((numel,), 50.0) for name in SITES}  # each norm ~304, inside the bound
    with _regions(
        certs, numel=numel, metrics_path=tmp_path / "metrics.jsonl",
        update_guard=UpdateGuardConfig(max_abs_weight=10.0),
    ) as (server, _relays, sites):
        before = server.rounds.weights.clone()
        with ThreadPoolExecutor(len(sites)) as pool:
            done = list(pool.map(lambda s: s.upload(ups[s.name], "none", weight=1.0), sites))
        assert all(d.complete for d in done)  # both partials were taken
        _wait_round(server, 1)
        for s in sites:
            header, _ = s.await_broadcast()
            assert not header.included and header.num_contributors == 0, s.name
    assert torch.equal(server.rounds.weights, before)
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record["aborted"] and "max_abs_weight" in record["aborted"], record["aborted"]


@pytest.mark.parametrize("withholding", [["site-a"], ["site-a", "site-b"]], ids=["one-site", "the-whole-relay"])
def test_sites_that_withhold_their_update_through_a_relay_are_not_waited_for(
    certs: Path, tmp_path: Path, withholding: list[str]
) -> None:
    """A site whose pseudo-gradient had NaN/Inf values sends none and says so with its wait for
    the broadcast (``AwaitBroadcastRequest.withheld``). Through a relay, the relay's partial names
    it as rejected with that reason, so the coordinator, which waits for every site here (no
    deadline), closes the round with the others instead of waiting for ever. When both sites of
    ``eu`` withhold, no upload ever opens the relay's round: it still sends a partial that counts
    no site and carries no values, naming both."""
    numel = 37
    ups = updates(numel, dyadic=True)
    uploading = [n for n in SITES if n not in withholding]
    why = "its pseudo-gradient had NaN/Inf values"
    with _regions(
        certs, numel=numel, metrics_path=tmp_path / "metrics.jsonl", min_sites=len(uploading)
    ) as (_server, _relays, joined):
        sites = {s.name: s for s in joined}
        with ThreadPoolExecutor(4) as pool:
            withheld = [pool.submit(sites[n].await_broadcast, withheld=why) for n in withholding]
            uploads = [pool.submit(sites[n].upload, ups[n], "none") for n in uploading]
            assert all(u.result(timeout=60).complete for u in uploads)
            headers = [w.result(timeout=60)[0] for w in withheld]
        assert all(not h.included and h.num_contributors == len(uploading) for h in headers)
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sorted(record["participants"]) == uploading
    assert record["rejected"] == withholding
    reasons = record["rejected_reasons"]
    assert all(reasons[s].startswith(f"the site sent no update: {why}") for s in withholding)


def test_a_refused_partial_reports_its_sites_so_the_round_does_not_wait_for_them(
    certs: Path, tmp_path: Path
) -> None:
    """Site a failed over: its own upload counted at the coordinator, then its relay's partial
    of a and b came and was refused (a counts once). The relay cannot take a out of a sum, so b
    was neither counted nor refused, and the coordinator, which waits for every member here (no
    deadline), waited for b until it was dropped as silent. The relay now reports the refused
    partial's sites as refused; a keeps its own update, b is recorded as left out at once, and
    each hears the truth (a counted, b left out but not refused) from the relay or the
    coordinator alike."""
    numel = 37
    ups = updates(numel, dyadic=True)
    with _regions(certs, numel=numel, metrics_path=tmp_path / "metrics.jsonl", min_sites=3) as (server, _relays, sites):
        a, b, c, d = sites
        direct = Site(a.name, certs, f"localhost:{server.port}", session=a.session)
        try:
            assert direct.upload(ups[a.name], "none").complete
        finally:
            direct.close()
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda s: _upload_or_error(s, ups[s.name], "none"), sites))
        assert all(isinstance(x, grpc.RpcError) for x in answers[:2]), "eu's partial was refused"
        assert "was refused: coordinator: site 'site-a' already has an update" in answers[1].details()  # type: ignore[union-attr]
        assert all(x.complete for x in answers[2:])  # type: ignore[union-attr]
        _wait_round(server, 1)
        header, _ = b.await_broadcast()
        assert not header.included and header.num_contributors == 3
        assert not header.refused, "b's update was never judged: it keeps it for the next round"
        # The coordinator says the same to b (after a failover, or a restart against it).
        b_direct = Site(b.name, certs, f"localhost:{server.port}", session=b.session)
        try:
            header, _ = b_direct.await_broadcast()
        finally:
            b_direct.close()
        assert not header.included and not header.refused
        # And a, asking its relay, hears that it counted (by its own upload): only the
        # coordinator knows that, so the relay passes the wait through.
        header, _ = a.await_broadcast()
        assert header.included and not header.refused
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sorted(record["participants"]) == ["site-a", "site-c", "site-d"]
    assert record["rejected"] == ["site-b"]
    reason = record["rejected_reasons"]["site-b"]
    assert "its relay's partial sum was refused" in reason and "site 'site-a' already has an update" in reason
    assert "dropped" not in json.dumps(record)


def test_one_sites_wrong_shape_cannot_set_the_shape_of_its_regions_partial(certs: Path, tmp_path: Path) -> None:
    """Site a's manifest is a float32 vector shorter than the model, which a relay could not
    tell from a Streaming DiLoCo fragment: the first manifest of a round fixed its shape, so
    site b's honest upload was refused and the coordinator refused the partial of a alone. The
    coordinator now says what each round takes (``RoundInfo.upload_numel``, ``fragment``): the
    relay refuses a alone and the round counts the other three."""
    numel = 37
    ups = updates(numel, dyadic=True)
    with _regions(certs, numel=numel, metrics_path=tmp_path / "metrics.jsonl", min_sites=3) as (server, _relays, sites):
        a, *others = sites
        with pytest.raises(grpc.RpcError) as refused:
            a.upload(ups[a.name][: numel - 5], "none")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the round takes fragment 0 of shape [37]" in (refused.value.details() or "")
        with ThreadPoolExecutor(len(others)) as pool:
            done = list(pool.map(lambda s: s.upload(ups[s.name], "none"), others))
        assert all(d.complete for d in done)
        _wait_round(server, 1)
        header, _ = a.await_broadcast()
        assert header.refused and not header.included
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sorted(record["participants"]) == ["site-b", "site-c", "site-d"]
    assert record["rejected"] == ["site-a"] and "shape [37]" in record["rejected_reasons"]["site-a"]


def test_a_counted_sites_later_manifest_of_another_shape_leaves_its_update_in(certs: Path, tmp_path: Path) -> None:
    """Site a's update is in the relay's sum when the site sends a manifest of another shape
    for the same round. The relay refused the site for it, so the partial listed a as counted
    and refused at once; the coordinator refused the partial and the region was left out. The
    counted update stays now, the manifest alone is refused."""
    numel = 37
    ups = updates(numel, dyadic=True)
    with _regions(certs, numel=numel, metrics_path=tmp_path / "metrics.jsonl", min_sites=4) as (server, relays, sites):
        a, *others = sites
        with ThreadPoolExecutor(len(sites)) as pool:
            first = pool.submit(_upload_or_error, a, ups[a.name], "none")
            deadline = time.monotonic() + 20
            while "site-a" not in relays["eu"].hub.round.updates:  # in the sum; the partial waits for b
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with pytest.raises(grpc.RpcError) as refused:
                a.upload(ups[a.name][: numel - 5], "none")
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            done = list(pool.map(lambda s: s.upload(ups[s.name], "none"), others))
            assert all(d.complete for d in done) and first.result().complete  # type: ignore[union-attr]
        _wait_round(server, 1)
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sorted(record["participants"]) == SITES and record["rejected"] == []


def test_a_failed_over_site_whose_own_upload_was_refused_hears_so_from_its_relay(
    certs: Path, tmp_path: Path
) -> None:
    """Site a's own upload to the coordinator (a failover) was refused (more inner steps than
    a round runs), then its relay's partial of a and b was refused because a already had an
    update in the round. The relay served a, the claim of its broadcast wait, its cached header
    with the relay's own view of refusals (none): a kept a refused update. The claim's header
    speaks of its own update, refusal included."""
    numel = 37
    ups = updates(numel, dyadic=True)
    with _regions(certs, numel=numel, metrics_path=tmp_path / "metrics.jsonl", min_sites=2) as (server, relays, sites):
        a, b, c, d = sites
        direct = Site(a.name, certs, f"localhost:{server.port}", session=a.session)
        try:
            with pytest.raises(grpc.RpcError) as refused:
                direct.upload(ups[a.name], "none", inner_steps=5, metrics={})
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with ThreadPoolExecutor(4) as pool:
                first = pool.submit(_upload_or_error, a, ups[a.name], "none")
                deadline = time.monotonic() + 20
                while "site-a" not in relays["eu"].hub.round.updates:  # a is the claim
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                list(pool.map(lambda s: _upload_or_error(s, ups[s.name], "none"), [b, c, d]))
                first.result()
            _wait_round(server, 1)
            via_coordinator, _ = direct.await_broadcast()
        finally:
            direct.close()
        via_relay, _ = a.await_broadcast()
        assert via_coordinator.refused and not via_coordinator.included
        assert via_relay.refused and not via_relay.included


def test_a_partial_refused_for_its_content_tells_its_sites_their_updates_were_refused(
    certs: Path, tmp_path: Path
) -> None:
    """Region eu's sites weigh 150 each in round 0 against us's 1, then 160: the relay, which
    knows only its own sites' weights (160 is within 100 x the other eu site's 150), passes
    them; the coordinator holds each against every other site's (median 1) or its own largest
    (150) and refuses eu's partial in round 1 for its content. Its sites were judged, not just
    left out: they drop their updates (refused), as a site refused directly does, where a
    partial refused for its place in the round (a failover) leaves them out."""
    numel = 37
    ups = updates(numel, dyadic=True)
    weights = [
        {"site-a": 150.0, "site-b": 150.0, "site-c": 1.0, "site-d": 1.0},
        {"site-a": 160.0, "site-b": 160.0, "site-c": 1.0, "site-d": 1.0},
    ]
    with _regions(
        certs, numel=numel, rounds=2, metrics_path=tmp_path / "metrics.jsonl", min_sites=2
    ) as (server, _relays, sites):
        for number in (0, 1):
            with ThreadPoolExecutor(len(sites)) as pool:
                answers = list(pool.map(
                    lambda s: _upload_or_error(s, ups[s.name], "none", weights[number][s.name], round_number=number),
                    sites,
                ))
            _wait_round(server, number + 1)
        assert all(isinstance(x, grpc.RpcError) for x in answers[:2]), "eu's partial was refused in round 1"
        header, _ = sites[1].await_broadcast(1)
        assert header.refused and not header.included
        header, _ = sites[2].await_broadcast(1)
        assert header.included and not header.refused
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sorted(records[1]["rejected"]) == ["site-a", "site-b"]

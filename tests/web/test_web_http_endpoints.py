"""The HTTP side of a real coordinator: /metrics scraped over a socket and parsed with the
Prometheus client's own parser, /api/status, the static page, read-only methods, and access
control beyond loopback (client certificates from the run's CA, or a bearer token)."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from _round_helpers import tiny_model
from prometheus_client.parser import text_string_to_metric_families

from geoloco.algorithms.config import ConfigError
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.http_status import HTTPStatusConfig
from geoloco.coordinator.server import CoordinatorServer
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.protocol_version import PROTOCOL_VERSION
from geoloco.protos.transport_endpoints import client_channel, coordinator_stub
from geoloco.protos.transport_errors import error_reason
from geoloco.protos.transport_tls import TLSFiles
from geoloco.protos.wire_chunks import message_nbytes
from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_site

TOKEN = "correct-horse-battery-staple-42"


def get(url: str, *, headers: dict[str, str] | None = None, context: ssl.SSLContext | None = None,
        method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def seen_by_site(error: grpc.RpcError) -> str:
    """The ``reason`` label for the ``ErrorReason`` a site read from the call's trailers."""
    return pb.ErrorReason.Name(error_reason(error)).removeprefix("ERROR_REASON_").lower()


def scrape(url: str, **kwargs) -> dict[tuple[str, tuple], float]:
    status, headers, body = get(url + "metrics", **kwargs)
    assert status == 200, body
    assert headers["Content-Type"].startswith("text/plain; version=")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


@pytest.fixture
def insecure_server(tmp_path: Path):
    config = CoordinatorConfig(insecure=True, total_rounds=3, http=HTTPStatusConfig(enabled=True, port=0))
    server = CoordinatorServer.from_model(config, tiny_model())
    server.start()
    try:
        yield server
    finally:
        server.stop(grace=0.2)


def test_library_default_serves_no_http(tmp_path: Path) -> None:
    server = CoordinatorServer.from_model(CoordinatorConfig(insecure=True), tiny_model())
    assert server.http_status is None and server.status_url is None


def test_metrics_scraped_and_parsed_after_real_grpc_calls(insecure_server: CoordinatorServer) -> None:
    url = insecure_server.status_url
    assert url is not None and url.startswith("http://127.0.0.1:")
    with client_channel(insecure_server.address, tls=None, insecure=True) as channel:
        stub = coordinator_stub(channel)
        joined = stub.Join(pb.JoinRequest(site="alpha", protocol_version=PROTOCOL_VERSION), timeout=10)
        with pytest.raises(grpc.RpcError) as old:
            stub.Join(pb.JoinRequest(site="beta", protocol_version=PROTOCOL_VERSION + 1), timeout=10)
        assert old.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as stale:
            stub.UploadStatus(pb.UploadStatusRequest(site="alpha", session_id="not-the-session"), timeout=10)
        assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError):
            stub.Leave(pb.LeaveRequest(site="gamma", session_id=joined.session_id), timeout=10)
        fetched = sum(message_nbytes(m) for m in stub.FetchModel(
            pb.FetchModelRequest(site="alpha", session_id=joined.session_id), timeout=10
        ))

    m = scrape(url)
    rejected = {
        labels: v for (name, labels), v in m.items() if name == "geoloco_coordinator_rejected_requests_total"
    }
    assert rejected == {
        (("code", "FAILED_PRECONDITION"), ("method", "Join"), ("reason", seen_by_site(old.value))): 1,
        (("code", "FAILED_PRECONDITION"), ("method", "Leave"), ("reason", "not_a_member")): 1,
        (("code", "FAILED_PRECONDITION"), ("method", "UploadStatus"), ("reason", "stale_session")): 1,
    }
    assert m[("geoloco_coordinator_sites_connected", ())] == 1
    assert m[("geoloco_coordinator_round", ())] == 0
    # FetchModel's messages, counted as the wire bytes the servicer sent.
    assert m[("geoloco_coordinator_site_bytes_sent_total", (("site", "alpha"),))] == fetched > 0

    status, headers, body = get(url + "api/status")
    assert status == 200 and headers["Content-Type"] == "application/json"
    doc = json.loads(body)
    assert doc["session_id"] == insecure_server.session_id and doc["round"] == 0
    assert [s["name"] for s in doc["sites"]] == ["alpha"]
    assert doc["sites"][0]["bytes_down"] == fetched
    assert doc["config"]["transport"] == "insecure (plain text)" and doc["config"]["total_rounds"] == 3
    texts = [e["text"] for e in doc["events"]]
    assert any(f"Join refused: FAILED_PRECONDITION ({seen_by_site(old.value)})" in t for t in texts)
    assert any(t.startswith("alpha joined at round 0") for t in texts)


def test_page_is_static_self_contained_and_read_only(insecure_server: CoordinatorServer) -> None:
    url = insecure_server.status_url
    status, headers, body = get(url)
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    page = body.decode()
    for marker in ('id="sites"', 'id="loss-chart"', 'id="bytes-chart"', 'id="events"', "/static/app.js"):
        assert marker in page
    for asset in ("static/app.js", "static/style.css"):
        status, _, body = get(url + asset)
        assert status == 200 and body
    for path in ("", "static/app.js", "static/style.css"):
        text = get(url + path)[2].decode()
        assert "http://" not in text.replace("http://www.w3.org", "") and "https://" not in text, path
    assert get(url + "nope")[0] == 404
    assert get(url + "static/../server.py")[0] == 404
    for method in ("POST", "PUT", "DELETE"):
        status, headers, _ = get(url + "api/status", method=method)
        assert status == 405 and headers["Allow"] == "GET, HEAD"


def test_bearer_token_guards_the_data(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    config = CoordinatorConfig(
        insecure=True, http=HTTPStatusConfig(enabled=True, port=0, token_file=str(token_file))
    )
    with CoordinatorServer.from_model(config, tiny_model()) as server:
        url = server.status_url
        for path in ("metrics", "api/status"):
            status, headers, _ = get(url + path)
            assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
            assert get(url + path, headers={"Authorization": "Bearer wrong-token-0000000000"})[0] == 401
            assert get(url + path, headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200
        assert get(url)[0] == 200  # the shell holds no run data; its script sends the token


def test_short_token_is_refused(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("short")
    config = CoordinatorConfig(insecure=True, http=HTTPStatusConfig(enabled=True, port=0, token_file=str(token_file)))
    with pytest.raises(ValueError, match="at least 16"):
        CoordinatorServer.from_model(config, tiny_model())


def test_beyond_loopback_needs_certificates_or_a_token() -> None:
    with pytest.raises(ConfigError, match="token_file"):
        CoordinatorConfig(insecure=True, http=HTTPStatusConfig(enabled=True, host="0.0.0.0"))
    # Disabled, or on loopback, is fine.
    CoordinatorConfig(insecure=True, http=HTTPStatusConfig(enabled=False, host="0.0.0.0"))
    CoordinatorConfig(insecure=True, http=HTTPStatusConfig(enabled=True, host="::1"))


def test_beyond_loopback_https_requires_a_client_certificate_from_the_run_ca(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    init_ca(certs)
    issue_coordinator(certs)
    issue_site(certs, "prometheus")
    config = CoordinatorConfig(
        certs_dir=str(certs), http=HTTPStatusConfig(enabled=True, host="0.0.0.0", port=0)
    )
    with CoordinatorServer.from_model(config, tiny_model()) as server:
        url = server.status_url
        assert url is not None and url.startswith("https://127.0.0.1:")
        anonymous = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            get(url + "metrics", context=anonymous)
        client = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        files = TLSFiles.from_dir(certs, "prometheus")
        client.load_cert_chain(str(files.cert), str(files.key))
        m = scrape(url, context=client)
        assert m[("geoloco_coordinator_sites_connected", ())] == 0
        assert get(url + "api/status", context=client)[0] == 200

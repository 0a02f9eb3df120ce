"""The coordinator's HTTP side: Prometheus ``/metrics`` and a live, read-only status page.

One small threaded HTTP server (standard library) next to the gRPC port serves

* ``/`` (with ``/static/app.js`` and ``/static/style.css``): a page that polls ``/api/status``
  and draws the site table, the loss curve and the bytes-per-round chart on canvases (no
  library, nothing fetched from the internet, no build step);
* ``/api/status``: JSON, see ``StatusBoard.snapshot``; ``?site_offset=&site_limit=&site_name=
  &site_state=`` pick the page of the site table and ``rounds_after=`` the rounds not seen yet
  (``StatusQuery``), so a thousand sites and a long run cost the page one screenful;
* ``/metrics``: ``CoordinatorMetrics.render()`` in the Prometheus text format.

Only GET and HEAD exist: nothing on the page changes the run.

Access. Bound to loopback (the default) it needs no credentials: whoever can reach it already
runs on the coordinator's machine. Bound beyond loopback it refuses to start unless it can
authenticate clients, in one of two ways:

* the coordinator has TLS certificates (``certs_dir``): the server speaks HTTPS with the
  coordinator's certificate and requires a client certificate signed by the run's CA, the same
  CA as gRPC (issue one for Prometheus with ``geoloco certs issue DIR prometheus``);
* ``token_file`` is set: requests must carry ``Authorization: Bearer TOKEN``. With certificates
  as well, either credential is accepted. The page's shell (HTML/JS/CSS, no run data) is served
  to anyone; its data comes from ``/api/status``, which the page calls with the token taken from
  the URL fragment (``https://host:port/#token=TOKEN``; a fragment never leaves the browser).

The token lives in a file rather than in the config because the config is copied into
checkpoints, ``metrics.jsonl`` and every site's ``RunConfig``.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from geoloco.coordinator.http_config import DEFAULT_HTTP_PORT, HTTPStatusConfig, is_loopback
from geoloco.coordinator.prometheus import CONTENT_TYPE_LATEST, CoordinatorMetrics
from geoloco.coordinator.status_board import (
    STATE_DONE,
    STATE_DOWN,
    STATE_LEFT,
    StatusBoard,
    StatusQuery,
    config_summary,
)

if TYPE_CHECKING:
    from geoloco.coordinator.config import CoordinatorConfig
    from geoloco.coordinator.rounds import RoundStateMachine
    from geoloco.protos.transport_tls import TLSFiles

__all__ = [
    "DEFAULT_HTTP_PORT",
    "STATE_DONE",
    "STATE_DOWN",
    "STATE_LEFT",
    "CoordinatorStatus",
    "HTTPStatusConfig",
    "StatusBoard",
    "StatusHTTPServer",
    "StatusPortError",
    "config_summary",
    "is_loopback",
    "without_local_paths",
]
"""(``HTTPStatusConfig``, ``StatusBoard`` and the states are defined in ``http_config`` and
``status_board`` and re-exported here.)"""

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).with_name("static")
STATIC_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/style.css": ("style.css", "text/css; charset=utf-8"),
}
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'"
)
"""The page may load nothing from anywhere else (and cannot be framed)."""

HANDSHAKE_TIMEOUT_S = 10.0

LOCAL_PATH_SUFFIXES = ("_dir", "_path", "_file")
"""Config keys naming files or folders on the coordinator's machine (``certs_dir``,
``checkpoint_dir``, ``metrics_path``, ``http.token_file``, and any a workload table adds): the
status page leaves them out, since on loopback anyone on the machine may read it without
credentials, and they tell where the run's keys are."""


def without_local_paths(value: Any) -> Any:
    """``value`` (the page's config summary) without the keys that name local paths, at any depth."""
    if isinstance(value, dict):
        return {
            key: without_local_paths(item)
            for key, item in value.items()
            if not (isinstance(key, str) and key.endswith(LOCAL_PATH_SUFFIXES))
        }
    if isinstance(value, list):
        return [without_local_paths(item) for item in value]
    return value




# -------------------------------------------------------------------------------------------
# The HTTP server


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    timeout = HANDSHAKE_TIMEOUT_S

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            self.request.settimeout(HANDSHAKE_TIMEOUT_S)
            self.request.do_handshake()
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: HTTPStatus, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", CONTENT_SECURITY_POLICY)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _authorized(self) -> bool:
        owner = self.server.owner
        if not owner.auth_required:
            return True
        if owner.token is not None:
            header = self.headers.get("Authorization", "")
            scheme, _, value = header.partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), owner.token.encode()):
                return True
        # A certificate is only there if it verified against the run's CA.
        return isinstance(self.request, ssl.SSLSocket) and bool(self.request.getpeercert())

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        owner = self.server.owner
        if path in STATIC_FILES:
            name, content_type = STATIC_FILES[path]
            self._send(HTTPStatus.OK, (STATIC_DIR / name).read_bytes(), content_type)
            return
        if path not in ("/api/status", "/metrics"):
            self._send(HTTPStatus.NOT_FOUND, b"not found; try /, /api/status or /metrics\n", "text/plain")
            return
        if not self._authorized():
            self._send(
                HTTPStatus.UNAUTHORIZED,
                b"authentication required: a client certificate from the run's CA or a bearer token\n",
                "text/plain",
                {"WWW-Authenticate": 'Bearer realm="geoloco"'},
            )
            return
        if path == "/metrics":
            self._send(HTTPStatus.OK, owner.metrics.render(), CONTENT_TYPE_LATEST)
            return
        try:
            query = StatusQuery.from_params(parse_qs(urlsplit(self.path).query, keep_blank_values=True))
        except ValueError as err:
            self._send(HTTPStatus.BAD_REQUEST, f"{err}\n".encode(), "text/plain; charset=utf-8")
            return
        body = json.dumps(owner.status(query), allow_nan=False).encode()
        self._send(HTTPStatus.OK, body, "application/json")

    def _refuse(self) -> None:
        self._send(
            HTTPStatus.METHOD_NOT_ALLOWED, b"read-only: only GET and HEAD\n", "text/plain", {"Allow": "GET, HEAD"}
        )

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse  # noqa: N815


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: StatusHTTPServer

    def __init__(self, address: tuple[str, int], owner: StatusHTTPServer, *, ipv6: bool) -> None:
        self.address_family = socket.AF_INET6 if ipv6 else socket.AF_INET
        self.owner = owner
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("HTTP request from %s failed", client_address, exc_info=True)  # noqa: LOG014 (called from the handler)


class StatusHTTPServer:
    """Serves ``metrics`` and ``status()`` over HTTP(S) on its own thread."""

    def __init__(
        self,
        config: HTTPStatusConfig,
        *,
        metrics: CoordinatorMetrics,
        status: Callable[[StatusQuery], dict[str, Any]],
        tls: TLSFiles | None = None,
    ) -> None:
        """``tls``: the coordinator's ``TLSFiles`` (CA, certificate, key), or None."""
        self.config = config
        self.metrics = metrics
        self.status = status
        self.tls = tls
        self.token = config.read_token()
        self.auth_required = not is_loopback(config.host) or self.token is not None
        if not is_loopback(config.host) and self.token is None and tls is None:
            raise ValueError(
                f"http.host {config.host!r} is reachable from other machines; give the coordinator "
                "certificates (certs_dir) or set http.token_file"
            )
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def scheme(self) -> str:
        return "https" if self._use_tls else "http"

    @property
    def _use_tls(self) -> bool:
        # HTTPS whenever clients come from other machines and there are certificates for it.
        return self.tls is not None and not is_loopback(self.config.host)

    def start(self) -> int:
        """Bind and serve; returns the port (``config.port`` 0 picks a free one)."""
        if self._server is not None:
            raise RuntimeError("the status server is already started")
        host = self.config.host
        try:
            server = _Server((host.strip("[]"), self.config.port), self, ipv6=":" in host)
        except OSError as err:
            raise StatusPortError(
                f"cannot serve the status page on {host}:{self.config.port}: {err}; set [http] port "
                "to a free port (0 = any), or enabled = false"
            ) from None
        tls = self.tls if self._use_tls else None
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(str(tls.cert), str(tls.key))
            context.load_verify_locations(cafile=str(tls.ca))
            # With a token, browsers without a client certificate may use the token instead.
            context.verify_mode = ssl.CERT_OPTIONAL if self.token is not None else ssl.CERT_REQUIRED
            server.socket = context.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="geoloco-http-status", daemon=True
        )
        self._thread.start()
        logger.info("status page on %s", self.url)
        return self.port

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the status server is not started; call start() first")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = self.config.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        elif ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{self.scheme}://{host}:{self.port}/"

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = None


class StatusPortError(OSError):
    """The status page's port could not be bound (told apart from the gRPC port's failure)."""


class CoordinatorStatus:
    """Prometheus metrics, the status board and their HTTP server, listening to one
    ``RoundStateMachine`` (refused calls reach them as ``REQUEST_REJECTED`` events, which the
    server's ``RejectedRequestInterceptor`` emits)."""

    def __init__(self, config: CoordinatorConfig, rounds: RoundStateMachine) -> None:
        self.rounds = rounds
        self.metrics = CoordinatorMetrics(clock=rounds.clock)
        self.metrics.watch(lambda: len(rounds.members), lambda: rounds.round)
        self.board = StatusBoard(
            without_local_paths(config_summary(config, rounds)),
            heartbeat_interval_s=config.heartbeat_interval_s,
            clock=rounds.clock,
        )
        rounds.events.add_listener(self.metrics.on_event)
        rounds.events.add_listener(self.board.on_event)
        self.http = StatusHTTPServer(
            config.http, metrics=self.metrics, status=self.status, tls=config.tls_files
        )

    def status(self, query: StatusQuery | None = None) -> dict[str, Any]:
        """``/api/status``: ``query`` picks the page of the site table and the rounds."""
        rounds = self.rounds
        return self.board.snapshot(
            round_number=rounds.round, phase=rounds.phase.value, session_id=rounds.session_id, query=query
        )

    def start(self) -> int:
        return self.http.start()

    def stop(self) -> None:
        self.http.stop()
        self.rounds.events.remove_listener(self.metrics.on_event)
        self.rounds.events.remove_listener(self.board.on_event)

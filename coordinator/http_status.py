"""The coordinator's HTTP side: Prometheus ``/metrics`` and a live, read-only status page.

One small threaded HTTP server (standard library) next to the gRPC port serves

* ``/`` (with ``/static/app.js`` and ``/static/style.css``): a page that polls ``/api/status``
  and draws the site table, the loss curve and the bytes-per-round chart on canvases (no
  library, nothing fetched from the internet, no build step);
* ``/api/status``: JSON, see ``StatusBoard.snapshot``;
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
import ipaddress
import json
import logging
import math
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geoloco.algorithms.config import require
from geoloco.coordinator import events as ev
from geoloco.coordinator.prometheus import CONTENT_TYPE_LATEST, CoordinatorMetrics
from geoloco.protos import geoloco_pb2 as pb

if TYPE_CHECKING:
    from geoloco.coordinator.config import CoordinatorConfig
    from geoloco.coordinator.rounds import RoundStateMachine

__all__ = [
    "CoordinatorStatus",
    "DEFAULT_HTTP_PORT",
    "HTTPStatusConfig",
    "STATE_DONE",
    "STATE_DOWN",
    "STATE_LEFT",
    "StatusBoard",
    "StatusHTTPServer",
    "is_loopback",
]

logger = logging.getLogger(__name__)

DEFAULT_HTTP_PORT = 9470
"""Port of ``/metrics`` and the status page when enabled without a port (``geoloco coordinator``)."""

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

STATE_DOWN = "down"
"""A member silent for ``DOWN_AFTER_HEARTBEATS`` heartbeat intervals (after its first
heartbeat), or dropped."""
STATE_LEFT = "left"
STATE_DONE = "done"
STATE_JOINED = "joined"
PHASE_STATES = {
    pb.SITE_PHASE_FETCHING: "fetching",
    pb.SITE_PHASE_TRAINING: "training",
    pb.SITE_PHASE_UPLOADING: "uploading",
    pb.SITE_PHASE_WAITING: "waiting",
}
"""Site state shown for the ``SitePhase`` a member reports in its heartbeats."""
DOWN_AFTER_HEARTBEATS = 3.0
"""A member is shown down after this many heartbeat intervals without a sign of life: it is
still in the run (its upload may still count) until ``heartbeat_timeout_s`` drops it."""
RATE_WINDOW_S = 5.0
"""Link rates are bytes over the last this many seconds."""
MAX_EVENTS = 200
MAX_ROUNDS = 5000
HANDSHAKE_TIMEOUT_S = 10.0


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(kw_only=True, slots=True)
class HTTPStatusConfig:
    """``[http]`` table of the coordinator config: ``/metrics`` and the status page."""

    enabled: bool = False
    """Serve the HTTP endpoints. Off in the library; ``geoloco coordinator`` and ``geoloco
    emulate`` turn it on unless the config says ``enabled = false``."""
    host: str = "127.0.0.1"
    """Address to listen on. Beyond loopback, clients must authenticate (the run's client
    certificates when the coordinator has ``certs_dir``, or ``token_file``)."""
    port: int = DEFAULT_HTTP_PORT
    """Port to listen on; 0 picks a free one (logged as ``status page on http://HOST:PORT/``)."""
    token_file: str | None = None
    """File holding a bearer token that clients must send (``Authorization: Bearer TOKEN``);
    required beyond loopback when the coordinator runs without certificates."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        require(0 <= self.port <= 65535, "port", f"must be in 0..65535, got {self.port}")
        require(bool(self.host), "host", "must not be empty; use 127.0.0.1 or 0.0.0.0")

    def check_exposure(self, *, has_certificates: bool) -> None:
        """Refuse an unauthenticated endpoint reachable from other machines."""
        require(
            not self.enabled or is_loopback(self.host) or has_certificates or self.token_file is not None,
            "http.host",
            f"{self.host!r} is reachable from other machines but the coordinator has no "
            "certificates (certs_dir) to check clients with; set http.token_file, or listen on "
            "127.0.0.1",
        )

    def read_token(self) -> str | None:
        if self.token_file is None:
            return None
        try:
            token = Path(self.token_file).read_text(encoding="utf-8").strip()
        except OSError as err:
            raise ValueError(f"http.token_file {self.token_file!r} cannot be read: {err}") from None
        if len(token) < 16:
            raise ValueError(
                f"the token in http.token_file {self.token_file!r} is {len(token)} characters; use "
                "at least 16 (e.g. `python -c 'import secrets; print(secrets.token_urlsafe())'`)"
            )
        return token


# -------------------------------------------------------------------------------------------
# The status board: what the page shows, fed by events


def _finite(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


@dataclass(slots=True)
class _Site:
    name: str
    first_seen_s: float
    last_seen_s: float
    member: bool = True
    state: str = STATE_JOINED
    down_reported: bool = False
    heard: bool = False
    """A heartbeat arrived since the last join. Silence only counts after one: the site CLI
    joins once to learn the run's settings and again when its model is built."""
    rounds_joined: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    joins: int = 0
    recent: deque[tuple[float, int, int]] = field(default_factory=deque)
    """(time, bytes up, bytes down) transfers within ``RATE_WINDOW_S``."""


class StatusBoard:
    """The live state behind ``/api/status``: an ``EventHub`` listener (``on_event``)."""

    def __init__(
        self,
        config_summary: dict[str, Any],
        *,
        heartbeat_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config_summary = config_summary
        self.down_after_s = DOWN_AFTER_HEARTBEATS * heartbeat_interval_s
        self.clock = clock
        self.wall_clock = wall_clock
        self._lock = threading.Lock()
        self._sites: dict[str, _Site] = {}
        self._events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self._rounds: deque[dict[str, Any]] = deque(maxlen=MAX_ROUNDS)
        self._run_finished = False
        self._started_wall = wall_clock()
        self._rejected_total = 0

    def _event(self, kind: str, text: str, site: str | None = None) -> None:
        self._events.append({"time": self.wall_clock(), "kind": kind, "site": site, "text": text})

    def _site(self, name: str, now: float) -> _Site:
        site = self._sites.get(name)
        if site is None:
            site = self._sites[name] = _Site(name=name, first_seen_s=now, last_seen_s=now)
        return site

    def on_event(self, event: ev.RoundEvent) -> None:
        with self._lock:
            self._apply(event)

    def _apply(self, event: ev.RoundEvent) -> None:
        kind, name, data, now = event.kind, event.site, event.data, event.time_s
        if kind == ev.ROUND_AGGREGATED:
            self._on_round(data)
            return
        if kind == ev.REQUEST_REJECTED:
            self._rejected_total += 1
            who = f" from {name}" if name else ""
            self._event(
                "rejected",
                f"{data['method']}{who} refused: {data['code']} ({data['reason']}): {data['message']}",
            )
            return
        if kind in (ev.ROUND_STARTED, ev.CHECKPOINT_SAVED) or name is None:
            # Round starts are in the round chart; the event list keeps what needs attention.
            return
        site = self._site(name, now)
        site.last_seen_s = max(site.last_seen_s, now)
        if kind == ev.SITE_JOINED:
            was_down = site.state == STATE_DOWN or site.down_reported or not site.member
            site.joins += 1
            site.member, site.state, site.down_reported, site.heard = True, STATE_JOINED, False, False
            if site.joins == 1:
                self._event("join", f"{name} joined at round {event.round}", name)
            elif was_down:
                self._event("recovery", f"{name} is back (re-joined at round {event.round})", name)
            else:
                self._event("join", f"{name} re-joined at round {event.round}", name)
        elif kind == ev.SITE_LEFT:
            site.member = False
            site.state = STATE_DONE if self._run_finished else STATE_LEFT
            self._event("leave", f"{name} left ({data.get('reason') or 'no reason given'})", name)
        elif kind == ev.SITE_DROPPED:
            site.member, site.state = False, STATE_DOWN
            if not site.down_reported:
                site.down_reported = True
            self._event("fault", f"{name} dropped after {data['silent_s']:.1f} s without a heartbeat", name)
        elif kind == ev.HEARTBEAT:
            site.heard = True
            if site.down_reported and site.member:
                site.down_reported = False
                self._event("recovery", f"{name} is heard from again", name)
            site.state = PHASE_STATES.get(data.get("phase", pb.SITE_PHASE_UNSPECIFIED), site.state)
        elif kind in (ev.BYTES_RECEIVED, ev.BYTES_SENT):
            up = data["nbytes"] if kind == ev.BYTES_RECEIVED else 0
            down = data["nbytes"] if kind == ev.BYTES_SENT else 0
            site.bytes_up += up
            site.bytes_down += down
            site.recent.append((now, up, down))
            self._prune(site, now)
        elif kind == ev.UPDATE_AGGREGATED:
            site.rounds_joined += 1
        elif kind == ev.UPDATE_REJECTED:
            self._event("rejected", f"{name}'s update for round {event.round} was rejected: {data['why']}", name)

    @staticmethod
    def _prune(site: _Site, now: float) -> None:
        while site.recent and site.recent[0][0] < now - RATE_WINDOW_S:
            site.recent.popleft()

    def _on_round(self, record: Any) -> None:
        site_metrics = record.get("site_metrics") or {}
        losses = [m["train_loss"] for m in site_metrics.values() if _finite(m.get("train_loss")) is not None]
        self._rounds.append(
            {
                "round": record["round"],
                "eval_loss": _finite(record.get("eval_loss")),
                "train_loss": sum(losses) / len(losses) if losses else None,
                "bytes_up": int(sum(record.get("bytes_up", {}).values())),
                "bytes_down": int(sum(record.get("bytes_down", {}).values())),
                "participants": len(record["participants"]),
                "excluded": list(record["excluded"]),
                "round_time_s": _finite(record.get("round_time_s")),
                "deadline_s": _finite(record.get("deadline_s")),
                "update_norm": _finite(record.get("update_norm")),
                "epsilon": _finite(record.get("epsilon")),
                "fragment": record.get("fragment"),
                "time": self.wall_clock(),
            }
        )
        if record["excluded"]:
            self._event(
                "fault",
                f"round {record['round']} closed without {', '.join(record['excluded'])} (stragglers)",
            )
        if record.get("run_finished"):
            self._run_finished = True
            self._event("round", f"run finished after round {record['round']}")

    def snapshot(self, *, round_number: int, phase: str, session_id: str) -> dict[str, Any]:
        """The JSON document of ``/api/status``."""
        with self._lock:
            now = self.clock()
            sites = []
            for site in sorted(self._sites.values(), key=lambda s: s.name):
                silent = now - site.last_seen_s
                state = site.state
                if site.member and site.heard and silent > self.down_after_s and not self._run_finished:
                    state = STATE_DOWN
                    if not site.down_reported:
                        site.down_reported = True
                        self._event("fault", f"{site.name} silent for {silent:.1f} s", site.name)
                self._prune(site, now)
                window = min(RATE_WINDOW_S, max(now - site.first_seen_s, 1e-3))
                sites.append(
                    {
                        "name": site.name,
                        "state": state,
                        "member": site.member,
                        "last_seen_s": round(max(0.0, silent), 3),
                        "rounds_joined": site.rounds_joined,
                        "bytes_up": site.bytes_up,
                        "bytes_down": site.bytes_down,
                        "rate_up_bps": 8 * sum(x[1] for x in site.recent) / window,
                        "rate_down_bps": 8 * sum(x[2] for x in site.recent) / window,
                    }
                )
            return {
                "session_id": session_id,
                "time": self.wall_clock(),
                "started": self._started_wall,
                "round": round_number,
                "phase": phase,
                "run_finished": self._run_finished,
                "config": self.config_summary,
                "sites": sites,
                "rounds": list(self._rounds),
                "events": list(self._events)[::-1],
                "rejected_total": self._rejected_total,
            }


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

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's signature
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

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802
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
        else:
            body = json.dumps(owner.status(), allow_nan=False).encode()
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
        logger.debug("HTTP request from %s failed", client_address, exc_info=True)


class StatusHTTPServer:
    """Serves ``metrics`` and ``status()`` over HTTP(S) on its own thread."""

    def __init__(
        self,
        config: HTTPStatusConfig,
        *,
        metrics: CoordinatorMetrics,
        status: Callable[[], dict[str, Any]],
        tls: Any | None = None,
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
            raise OSError(
                f"cannot serve the status page on {host}:{self.config.port}: {err}; set [http] port "
                "to a free port (0 = any), or enabled = false"
            ) from None
        if self._use_tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(str(self.tls.cert), str(self.tls.key))
            context.load_verify_locations(cafile=str(self.tls.ca))
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


# -------------------------------------------------------------------------------------------
# Wiring for CoordinatorServer


def config_summary(config: CoordinatorConfig, rounds: RoundStateMachine) -> dict[str, Any]:
    """What the page shows about the run: the headline settings plus the whole config."""
    algorithm = config.algorithm
    return {
        "algorithm": algorithm.name,
        "inner_steps": rounds.strategy.inner_steps,
        "uplink_codec": rounds.uplink_codec,
        "downlink_codec": algorithm.downlink_codec,
        "outer_optimizer": config.outer_optimizer.to_dict(),
        "total_rounds": config.total_rounds,
        "min_sites": config.min_sites,
        "round_deadline_s": config.round_deadline_s,
        "adaptive_deadline": (
            {"min_s": config.adaptive_deadline.min_s, "max_s": config.adaptive_deadline.max_s}
            if config.adaptive_deadline.enabled else None
        ),
        "round_time_budget_s": algorithm.round_time_budget_s,
        "weighting": algorithm.weighting,
        "late_updates": algorithm.late_updates,
        "streaming": (
            {
                "fragments": algorithm.streaming.fragments,
                "overlap_steps": algorithm.streaming.overlap_steps,
                "mix": algorithm.streaming.mix,
            }
            if algorithm.streaming.enabled else None
        ),
        "privacy": (
            {
                "secure_aggregation": config.privacy.secure_aggregation,
                "dp": config.privacy.dp,
                "noise_multiplier": config.privacy.noise_multiplier,
                "delta": config.privacy.delta,
                "epsilon_budget": config.privacy.epsilon_budget,
            }
            if config.privacy.enabled else None
        ),
        "heartbeat_interval_s": config.heartbeat_interval_s,
        "heartbeat_timeout_s": config.heartbeat_timeout_s,
        "parameters": rounds.numel,
        "transport": "insecure (plain text)" if config.insecure else "mutual TLS",
        "allowed_sites": config.allowed_sites,
        "workload": config.workload,
        "full": config.to_dict(),
    }


class CoordinatorStatus:
    """Prometheus metrics, the status board and their HTTP server, listening to one
    ``RoundStateMachine``; ``interceptor`` goes into the gRPC server to count refused calls."""

    def __init__(self, config: CoordinatorConfig, rounds: RoundStateMachine) -> None:
        self.rounds = rounds
        self.metrics = CoordinatorMetrics(clock=rounds.clock)
        self.metrics.watch(lambda: len(rounds.members), lambda: rounds.round)
        self.board = StatusBoard(
            config_summary(config, rounds),
            heartbeat_interval_s=config.heartbeat_interval_s,
            clock=rounds.clock,
        )
        rounds.events.add_listener(self.metrics.on_event)
        rounds.events.add_listener(self.board.on_event)
        self.interceptor = ev.RejectedRequestInterceptor(rounds.events)
        self.http = StatusHTTPServer(
            config.http, metrics=self.metrics, status=self.status, tls=config.tls_files
        )

    def status(self) -> dict[str, Any]:
        rounds = self.rounds
        return self.board.snapshot(
            round_number=rounds.round, phase=rounds.phase.value, session_id=rounds.session_id
        )

    def start(self) -> int:
        return self.http.start()

    def stop(self) -> None:
        self.http.stop()
        self.rounds.events.remove_listener(self.metrics.on_event)
        self.rounds.events.remove_listener(self.board.on_event)

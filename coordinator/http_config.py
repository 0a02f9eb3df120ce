"""The ``[http]`` table of the coordinator config: ``/metrics`` and the live status page.

Its own module so that ``geoloco.coordinator.config`` needs nothing of the HTTP server (which
needs the state machine, which needs the config).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from geoloco.algorithms.config import require

__all__ = ["DEFAULT_HTTP_PORT", "HTTPStatusConfig", "is_loopback"]

DEFAULT_HTTP_PORT = 9470
"""Port of ``/metrics`` and the status page when enabled without a port (``geoloco coordinator``)."""

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

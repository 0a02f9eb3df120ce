"""A relay's configuration: one dataclass, validated in one place (``geoloco relay --config``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geoloco.algorithms.config import ConfigError, config_from_dict, config_to_dict, require
from geoloco.protos.identity import validate_site_name
from geoloco.protos.transport_tls import TLSFiles
from geoloco.protos.wire_buffers import DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE

__all__ = ["UPWARD_CODECS", "RelayConfig"]

UPWARD_CODECS = ("none", "uplink")
"""Codecs of the upward partial sum: ``none`` (lossless float32: the relayed result is the flat
one) or ``uplink``, the run's own uplink codec (the coordinator decodes it as it decodes the
sites'), with the relay's own error-feedback residual."""


@dataclass(kw_only=True, slots=True)
class RelayConfig:
    """Everything one relay process needs; the run's settings come from the coordinator."""

    name: str
    """The relay's name, as its certificate (``geoloco certs issue DIR NAME --relay``) and the
    coordinator's ``[relays]`` table spell it."""
    coordinator: str
    """``host:port`` of the coordinator (or of a relay above this one is not supported)."""
    sites: list[str] = field(default_factory=list)
    """Sites this relay serves; others are refused at once. Empty: whatever the coordinator's
    ``[relays]`` list allows (it checks every call anyway)."""
    host: str = "127.0.0.1"
    """Address the relay listens on for its sites."""
    port: int = 0
    """Port for the sites; 0 picks a free one (``RelayServer.start()`` returns it)."""
    certs_dir: str | None = None
    """Folder made by ``geoloco certs`` with ``ca.crt`` and the relay's ``NAME.crt``/``.key``."""
    cert_name: str | None = None
    """Certificate file name in ``certs_dir``; unset: ``name``."""
    coordinator_server_name: str | None = None
    """Name to check the coordinator's certificate against when ``coordinator`` is an address
    it does not list."""
    insecure: bool = False
    """Plain text on both sides, for local experiments only."""
    max_wait_s: float = 30.0
    """A round's partial sum goes upward when every site that joined through the relay has
    uploaded, or this many seconds after the round's first upload, whichever comes first."""
    upward_codec: str = "none"
    """Codec of the partial sum sent to the coordinator: ``none`` or ``uplink`` (see
    ``UPWARD_CODECS``); not used in secure-aggregation runs (the masked ring sum goes up as is)."""
    chunk_size: int = DEFAULT_CHUNK_SIZE
    """Bytes per chunk of the partial sum's upload."""
    progress_interval_s: float = 2.0
    """AwaitBroadcast sends its sites a progress message this often while the round is open."""
    metrics_path: str | None = None
    """JSON-lines file with one record per forwarded round: the sites the partial contained and
    the bytes on each link (sites -> relay, relay -> coordinator and back)."""
    max_sites: int = 64
    """Sizes the relay's thread pool (each waiting site holds a thread)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for key, value in (("name", self.name), *((f"sites[{i}]", s) for i, s in enumerate(self.sites))):
            try:
                validate_site_name(value)
            except ValueError as err:
                raise ConfigError(key, str(err)) from None
        require(len(set(self.sites)) == len(self.sites), "sites", "lists a site twice")
        require(bool(self.coordinator), "coordinator", "must be the coordinator's host:port")
        require(0 <= self.port <= 65535, "port", f"must be in 0..65535, got {self.port}")
        require(
            not (self.insecure and self.certs_dir is not None),
            "insecure",
            "insecure = true and certs_dir are mutually exclusive; drop one",
        )
        require(
            self.insecure or self.certs_dir is not None,
            "certs_dir",
            "set certs_dir (made by `geoloco certs init/issue --relay`) for mutual TLS, or "
            "insecure = true for an unauthenticated local run",
        )
        require(self.max_wait_s > 0, "max_wait_s", f"must be > 0 seconds, got {self.max_wait_s}")
        require(
            self.upward_codec in UPWARD_CODECS,
            "upward_codec",
            f"got {self.upward_codec!r}; allowed: 'none' (lossless float32) or 'uplink' (the run's "
            "uplink codec, with the relay's own error feedback)",
        )
        require(
            0 < self.chunk_size <= MAX_CHUNK_SIZE,
            "chunk_size",
            f"must be in 1..{MAX_CHUNK_SIZE} bytes, got {self.chunk_size}",
        )
        require(self.progress_interval_s > 0, "progress_interval_s", f"must be > 0, got {self.progress_interval_s}")
        require(self.max_sites >= 1, "max_sites", f"must be >= 1, got {self.max_sites}")

    @property
    def tls_files(self) -> TLSFiles | None:
        """The relay's CA, certificate and key (both sides), or None in insecure mode."""
        if self.certs_dir is None:
            return None
        return TLSFiles.from_dir(Path(self.certs_dir), self.cert_name or self.name)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RelayConfig:
        """Build from a parsed TOML table; errors name the key and what is allowed."""
        return config_from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)

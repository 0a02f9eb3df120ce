"""TLS material and identity: the PEM files of a party, and the site a peer certificate names.

With TLS the server requires a client certificate signed by the run's CA and the site name comes
from that certificate (``geoloco.protos.identity``). Plain text exists only behind an explicit
``insecure=True`` (the CLI's ``--insecure``); the site name is then whatever the request's
``site`` field says.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from geoloco.protos.errors import IdentityError
from geoloco.protos.identity import relay_from_uri, site_from_uri, validate_site_name

# ---------------------------------------------------------------------------------------------
# TLS material
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TLSFiles:
    """PEM files of one party: the run's CA and this party's certificate and key."""

    ca: Path
    """CA certificate that signed every party (``ca.crt``)."""
    cert: Path
    """This party's certificate (``NAME.crt``)."""
    key: Path
    """This party's private key (``NAME.key``)."""

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str], name: str) -> TLSFiles:
        """The files ``geoloco certs`` writes: DIR/ca.crt, DIR/NAME.crt and DIR/NAME.key."""
        directory = Path(directory)
        return cls(
            ca=directory / "ca.crt", cert=directory / f"{name}.crt", key=directory / f"{name}.key"
        )

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(ca, cert, key) bytes; a missing file says which and how to make it."""
        out = []
        for label, path in (
            ("CA certificate", self.ca),
            ("certificate", self.cert),
            ("key", self.key),
        ):
            try:
                out.append(Path(path).read_bytes())
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"TLS {label} {path} not found; create it with `geoloco certs init DIR` and "
                    "`geoloco certs issue DIR NAME`, or pass --insecure for a local plain-text run"
                ) from None
        return out[0], out[1], out[2]


def check_mode(tls: TLSFiles | None, insecure: bool) -> None:
    """Refuse a missing choice (neither TLS files nor ``insecure``) and a contradictory one."""
    if tls is None and not insecure:
        raise ValueError(
            "no TLS files given; pass TLS certificates (geoloco certs) or insecure=True "
            "(--insecure) for an unauthenticated plain-text connection"
        )
    if tls is not None and insecure:
        raise ValueError("both TLS files and insecure=True given; choose one")



# ---------------------------------------------------------------------------------------------
# Identity
# ---------------------------------------------------------------------------------------------


def site_from_auth_context(
    auth_context: Mapping[str, Iterable[bytes]], *, allow_common_name: bool = False
) -> str | None:
    """The site a peer certificate names: its ``geoloco:site:NAME`` URI SAN (or, when
    ``allow_common_name``, a valid site name in its common name, for certificates from a PKI
    that cannot add URIs). None when the peer is not a site certificate."""
    names: set[str] = set()
    for key in ("peer_uri", "x509_subject_alternative_name"):
        for value in auth_context.get(key, ()):
            site = site_from_uri(value.decode("utf-8", "replace"))
            if site is not None:
                names.add(site)
    if len(names) > 1:
        raise IdentityError(
            f"peer certificate names several sites {sorted(names)}; issue one per site"
        )
    if names:
        return names.pop()
    if allow_common_name:
        for value in auth_context.get("x509_common_name", ()):
            try:
                return validate_site_name(value.decode("utf-8", "replace"))
            except ValueError:
                return None
    return None


def peer_site(context: grpc.ServicerContext, *, allow_common_name: bool = False) -> str | None:
    """The site named by the calling peer's certificate; None on a plain-text connection."""
    return site_from_auth_context(context.auth_context(), allow_common_name=allow_common_name)


def peer_relay(context: grpc.ServicerContext) -> str | None:
    """The relay named by the calling peer's certificate (URI SAN ``geoloco:relay:NAME``); None
    on a plain-text connection or for any other certificate."""
    names = {
        relay
        for key in ("peer_uri", "x509_subject_alternative_name")
        for value in context.auth_context().get(key, ())
        if (relay := relay_from_uri(value.decode("utf-8", "replace"))) is not None
    }
    if len(names) > 1:
        raise IdentityError(f"peer certificate names several relays {sorted(names)}; issue one per relay")
    return names.pop() if names else None


def resolve_site(
    context: grpc.ServicerContext, claimed: str, *, insecure: bool, allow_common_name: bool = False
) -> str:
    """The caller's site name, which servicers use as identity.

    TLS: the certificate's name; ``claimed`` (a request's ``site`` field) must be empty or the
    same. Insecure: ``claimed`` itself, validated. Raises ``IdentityError``.
    """
    if insecure:
        if not claimed:
            raise IdentityError(
                "plain-text mode: the request must name its site in the `site` field",
                code=grpc.StatusCode.INVALID_ARGUMENT,
            )
        try:
            return validate_site_name(claimed)
        except ValueError as e:
            raise IdentityError(str(e), code=grpc.StatusCode.INVALID_ARGUMENT) from None
    site = peer_site(context, allow_common_name=allow_common_name)
    if site is None:
        raise IdentityError(
            "the client certificate names no site (expected a URI SAN geoloco:site:NAME); "
            "issue it with `geoloco certs issue DIR NAME`",
            code=grpc.StatusCode.UNAUTHENTICATED,
        )
    if claimed and claimed != site:
        raise IdentityError(
            f"request claims site {claimed!r} but the client certificate names {site!r}"
        )
    return site

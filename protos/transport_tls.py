"""TLS material and identity: the PEM files of a party, and the site a peer certificate names.

With TLS the server requires a client certificate signed by the run's CA and the site name comes
from that certificate (``geoloco.protos.identity``). Plain text exists only behind an explicit
``insecure=True`` (the CLI's ``--insecure``); the site name is then whatever the request's
``site`` field says.

TLS mistakes are named, not reported as outages: gRPC tells a client only that it failed to
connect (the cause is in C-core's log lines, and with two addresses for ``localhost`` not even
the right address's), so ``check_tls_files`` checks a party's own files before it dials and
``diagnose_handshake`` dials the peer once with Python's ``ssl`` to name what went wrong: the
peer's certificate is from another CA, it does not name the host dialled, the peer refused our
certificate, or one side speaks plain text and the other TLS; each with what to do, in one line.
"""

from __future__ import annotations

import os
import re
import socket
import ssl
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
# TLS mistakes, named
# ---------------------------------------------------------------------------------------------

WRONG_CA = "wrong CA"
"""The peer's certificate was not issued by the CA this party was given."""
HOST_NOT_IN_CERTIFICATE = "host name not in the certificate"
"""The peer's certificate does not name the host this party dials."""
CERTIFICATE_REFUSED = "certificate refused"
"""The peer closed the connection right after the handshake: it refused this party's certificate."""
PLAIN_TEXT_PEER = "peer speaks plain text"
"""This party uses TLS, the peer plain text (started with --insecure)."""
TLS_PEER = "peer requires TLS"
"""This party speaks plain text (--insecure), the peer requires mutual TLS."""

_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
"""An HTTP/2 client preface and an empty SETTINGS frame: a gRPC server answers with its own."""
_HOSTNAME_MISMATCH_CODES = frozenset({62, 64})
"""OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH and X509_V_ERR_IP_ADDRESS_MISMATCH."""
_TARGET_RE = re.compile(r"^(?:dns:(?:///)?)?(?:\[(?P<v6>[^\]]+)\]|(?P<host>[^:/,\[\]]+)):(?P<port>\d+)$")


@dataclass(frozen=True, slots=True)
class HandshakeDiagnosis:
    """What is wrong with a TLS (or plain-text) connection, and what to do, in one line."""

    cause: str
    """``WRONG_CA``, ``HOST_NOT_IN_CERTIFICATE``, ``CERTIFICATE_REFUSED``, ``PLAIN_TEXT_PEER`` or
    ``TLS_PEER``."""
    message: str

    def __str__(self) -> str:
        return self.message


def check_tls_files(tls: TLSFiles, *, name: str) -> None:
    """Refuse, before dialling, a certificate that the given CA did not issue or a key that is
    not the certificate's: ``ValueError`` with one line saying which file and what to do.
    ``name``: the party's name (site, relay), for the ``geoloco certs issue`` hint."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization

    ca_pem, cert_pem, key_pem = tls.read()
    reissue = (
        f"issue it from the run's CA folder (`geoloco certs issue DIR {name}`) and copy that "
        f"folder's ca.crt, {name}.crt and {name}.key together"
    )
    try:
        ca = x509.load_pem_x509_certificate(ca_pem)
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"TLS files {tls.ca}, {tls.cert}, {tls.key} cannot be read as PEM ({err}); {reissue}"
        ) from None
    try:
        cert.verify_directly_issued_by(ca)
    except (InvalidSignature, ValueError, TypeError):
        issuer, subject = cert.issuer.rfc4514_string(), ca.subject.rfc4514_string()
        which = (
            f"both are named {subject!r} but are two different CAs, from two runs of `geoloco certs init`"
            if issuer == subject
            else f"it was issued by {issuer!r}, the CA is {subject!r}"
        )
        raise ValueError(
            f"TLS: certificate {tls.cert} was not issued by the CA in {tls.ca} ({which}); {reissue}"
        ) from None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    encoding = serialization.Encoding.DER
    if key.public_key().public_bytes(encoding, public) != cert.public_key().public_bytes(encoding, public):
        raise ValueError(f"TLS: key {tls.key} is not the key of certificate {tls.cert}; {reissue}")


def diagnose_handshake(
    target: str,
    *,
    tls: TLSFiles | None,
    insecure: bool,
    server_name: str | None = None,
    peer: str = "the coordinator",
    name: str = "NAME",
    timeout_s: float = 5.0,
) -> HandshakeDiagnosis | None:
    """Dial ``target`` (``host:port``) once as a client with ``tls`` (or plain text) would, and
    name a TLS mistake; None when the connection works, or fails for another reason (nothing
    listens, the network: what retrying is for). ``peer`` and ``name`` (this party's name) only
    word the message."""
    match = _TARGET_RE.match(target.strip())
    if match is None:
        return None  # several addresses or a resolver scheme: leave it to gRPC's own messages
    host = match["v6"] or match["host"]
    port = int(match["port"])
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError:
        return None
    with sock:
        if insecure or tls is None:
            context = _client_context(None)
            try:
                with context.wrap_socket(sock, server_hostname=host):
                    pass
            except (ssl.SSLError, OSError):
                return None  # no TLS there: plain text on both sides
            return HandshakeDiagnosis(
                TLS_PEER,
                f"TLS: {peer} at {target} requires mutual TLS but this side speaks plain text "
                f"(--insecure); start this side with --certs DIR holding the run's ca.crt, {name}.crt "
                f"and {name}.key (`geoloco certs issue DIR {name}`) instead of --insecure",
            )
        checked_name = server_name or host
        context = _client_context(tls)
        try:
            conn = context.wrap_socket(sock, server_hostname=checked_name)
        except ssl.SSLCertVerificationError as err:
            if err.verify_code in _HOSTNAME_MISMATCH_CODES:
                names = _certificate_names(host, port, server_name=checked_name, timeout_s=timeout_s)
                return HandshakeDiagnosis(
                    HOST_NOT_IN_CERTIFICATE,
                    f"TLS: {peer}'s certificate at {target} does not name {checked_name!r} (it names "
                    f"{', '.join(names) or 'no host'}); dial one of those names, or pass --server-name "
                    f"with one of them, or reissue it naming this host (`geoloco certs issue DIR "
                    f"coordinator --coordinator --host {checked_name} --force`)",
                )
            return HandshakeDiagnosis(
                WRONG_CA,
                f"TLS: {peer} at {target} presents a certificate that the CA in {tls.ca} did not "
                f"issue ({err.verify_message}): the two sides hold different CAs; copy ca.crt from "
                f"the folder of the run's `geoloco certs init` with {name}.crt and {name}.key issued "
                f"from it (`geoloco certs issue DIR {name}`)",
            )
        except ssl.SSLError as err:
            if err.reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "HTTP_REQUEST", "UNEXPECTED_RECORD"):
                return HandshakeDiagnosis(
                    PLAIN_TEXT_PEER,
                    f"TLS: {peer} at {target} speaks plain text (started with --insecure) but this "
                    f"side uses TLS; start {peer} with --certs DIR (mutual TLS), or, on a trusted "
                    "local network only, this side with --insecure too",
                )
            if "ALERT" in str(err.reason):
                return _refused(peer, target, tls, name, str(err.reason))
            return None
        except OSError:
            return None
        with conn:
            conn.settimeout(min(timeout_s, 2.0))
            try:
                conn.sendall(_HTTP2_PREFACE)
                answer = conn.recv(16)
            except ssl.SSLError as err:
                return _refused(peer, target, tls, name, str(err.reason))
            except TimeoutError:
                return None  # it holds the connection: TLS is fine
            except OSError:
                return _refused(peer, target, tls, name, "connection reset")
            if answer == b"":
                return _refused(peer, target, tls, name, "closed right after the handshake")
    return None


def _refused(peer: str, target: str, tls: TLSFiles, name: str, detail: str) -> HandshakeDiagnosis:
    return HandshakeDiagnosis(
        CERTIFICATE_REFUSED,
        f"TLS: {peer} at {target} refused this side's certificate {tls.cert} ({detail}): it was not "
        f"issued by {peer}'s CA; use {name}.crt and {name}.key issued from the run's CA folder "
        f"(`geoloco certs issue DIR {name}`) with that folder's ca.crt",
    )


def _client_context(tls: TLSFiles | None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.set_alpn_protocols(["h2"])  # what gRPC offers
    if tls is None:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        context.load_verify_locations(cafile=str(tls.ca))
        context.load_cert_chain(certfile=str(tls.cert), keyfile=str(tls.key))
    return context


def _certificate_names(host: str, port: int, *, server_name: str, timeout_s: float) -> list[str]:
    """The DNS names and IP addresses the certificate served at ``host:port`` names."""
    from cryptography import x509

    try:
        with (
            socket.create_connection((host, port), timeout=timeout_s) as sock,
            _client_context(None).wrap_socket(sock, server_hostname=server_name) as conn,
        ):
            der = conn.getpeercert(binary_form=True)
        if der is None:
            return []
        sans = x509.load_der_x509_certificate(der).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except (OSError, ValueError, x509.ExtensionNotFound):
        return []
    names = sans.value
    return [*names.get_values_for_type(x509.DNSName), *(str(a) for a in names.get_values_for_type(x509.IPAddress))]


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

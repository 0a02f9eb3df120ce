"""A private certificate authority for mutual TLS between the coordinator and its sites.

``init_ca`` makes a CA (EC P-256 key, self-signed certificate) in a directory; ``issue_site`` and
``issue_coordinator`` sign leaf certificates with it. Everything is ECDSA P-256 with SHA-256
because that is what gRPC's TLS stack (BoringSSL) accepts everywhere; Ed25519 certificates are
not supported there.

Files in the directory::

    ca.crt  ca.key              the authority (keep ca.key offline in real deployments)
    NAME.crt  NAME.key          one pair per site, and one for the coordinator

Keys are written with mode 0600, certificates with 0644. Nothing is overwritten unless
``force=True`` (a replaced CA silently invalidates every certificate it signed).

A site certificate names the site in its common name and in the URI SAN
``geoloco:site:NAME`` (see ``geoloco.protos.identity``) and is only valid for TLS client
authentication; the coordinator certificate is only valid for server authentication, carries
the URI SAN ``geoloco:coordinator`` and the DNS/IP names clients dial (``localhost`` and
``127.0.0.1`` by default, plus any extra host names or addresses).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from geoloco.protos.identity import COORDINATOR_URI, relay_uri, site_uri, validate_site_name

logger = logging.getLogger(__name__)

CA_CERT_FILE = "ca.crt"
CA_KEY_FILE = "ca.key"
DEFAULT_COORDINATOR_NAME = "coordinator"
DEFAULT_CA_DAYS = 3650
DEFAULT_LEAF_DAYS = 825
"""Leaf lifetime: the longest that common TLS clients accept for server certificates."""
CLOCK_SKEW = datetime.timedelta(minutes=5)
"""Certificates start this long in the past so machines with slightly late clocks accept them."""
DEFAULT_COORDINATOR_HOSTS = ("localhost", "127.0.0.1")

_RESERVED_NAMES = {"ca"}


@dataclass(frozen=True, slots=True)
class IssuedPair:
    """Where a certificate and its private key were written."""

    cert: Path
    """PEM certificate (0644)."""
    key: Path
    """PEM PKCS#8 private key, unencrypted (0600)."""


@dataclass(frozen=True, slots=True)
class Authority:
    """A loaded CA: what ``issue_*`` needs to sign."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    directory: Path


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write via a temp file in the same directory, chmod, then rename: never a half file, never
    a key readable by others even for a moment."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _refuse_overwrite(paths: Iterable[Path], force: bool, what: str) -> None:
    existing = [str(p) for p in paths if p.exists()]
    if existing and not force:
        raise FileExistsError(
            f"{what} already exists ({', '.join(existing)}); add --force to replace it "
            "(force=True from Python)"
            + (", which invalidates every certificate it signed" if what == "CA" else "")
        )


def _check_name(name: str) -> str:
    validate_site_name(name)
    if name.lower() in _RESERVED_NAMES:
        raise ValueError(f"name {name!r} is reserved for the CA's own files; choose another")
    return name


def init_ca(
    directory: str | os.PathLike[str],
    *,
    common_name: str = "geoloco CA",
    valid_days: int = DEFAULT_CA_DAYS,
    force: bool = False,
) -> IssuedPair:
    """Create ``ca.crt`` / ``ca.key`` in ``directory`` (created if missing, mode 0700)."""
    if valid_days <= 0:
        raise ValueError(f"valid_days must be positive, got {valid_days}")
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    pair = IssuedPair(directory / CA_CERT_FILE, directory / CA_KEY_FILE)
    _refuse_overwrite((pair.cert, pair.key), force, "CA")
    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + datetime.timedelta(days=valid_days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_atomic(pair.key, _key_pem(key), 0o600)
    _write_atomic(pair.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    logger.debug("created CA %s", pair.cert)
    return pair


def load_ca(directory: str | os.PathLike[str]) -> Authority:
    """Load the CA made by ``init_ca``; errors say to run ``geoloco certs init`` first."""
    directory = Path(directory)
    cert_path, key_path = directory / CA_CERT_FILE, directory / CA_KEY_FILE
    missing = [str(p) for p in (cert_path, key_path) if not p.exists()]
    if missing:
        raise FileNotFoundError(
            f"no CA in {directory} (missing {', '.join(missing)}); run `geoloco certs init "
            f"{directory}` first"
        )
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{key_path} is not an EC private key; re-create the CA with init_ca")
    cert_key = cert.public_key()
    if (
        not isinstance(cert_key, ec.EllipticCurvePublicKey)
        or cert_key.public_numbers() != key.public_key().public_numbers()
    ):
        raise ValueError(f"{key_path} does not belong to {cert_path}; the CA files are mixed up")
    return Authority(cert=cert, key=key, directory=directory)


def _leaf_key_usage() -> x509.KeyUsage:
    # ECDHE key exchange only needs signatures from the leaf key.
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=False,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )


def _issue(
    authority: Authority,
    name: str,
    sans: Sequence[x509.GeneralName],
    usage: x509.ObjectIdentifier | Sequence[x509.ObjectIdentifier],
    valid_days: int,
    force: bool,
) -> IssuedPair:
    if valid_days <= 0:
        raise ValueError(f"valid_days must be positive, got {valid_days}")
    pair = IssuedPair(authority.directory / f"{name}.crt", authority.directory / f"{name}.key")
    _refuse_overwrite((pair.cert, pair.key), force, f"certificate for {name!r}")
    key = _new_key()
    now = _now()
    not_after = min(now + datetime.timedelta(days=valid_days), authority.cert.not_valid_after_utc)
    ca_ski = authority.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(authority.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_leaf_key_usage(), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([usage] if isinstance(usage, x509.ObjectIdentifier) else list(usage)),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(authority.key, hashes.SHA256())
    )
    _write_atomic(pair.key, _key_pem(key), 0o600)
    _write_atomic(pair.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    logger.debug("issued %s", pair.cert)
    return pair


def issue_site(
    directory: str | os.PathLike[str],
    name: str,
    *,
    valid_days: int = DEFAULT_LEAF_DAYS,
    force: bool = False,
) -> IssuedPair:
    """Issue ``NAME.crt`` / ``NAME.key``: a TLS client certificate that names site ``name``."""
    _check_name(name)
    authority = load_ca(directory)
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(site_uri(name))]
    return _issue(authority, name, sans, ExtendedKeyUsageOID.CLIENT_AUTH, valid_days, force)


def _host_names(hosts: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    seen: set[str] = set()
    for host in hosts:
        host = host.strip()
        if not host:
            raise ValueError("empty host name for the coordinator certificate")
        if host in seen:
            continue
        seen.add(host)
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
            continue
        except ValueError:
            pass
        labels = host.rstrip(".").split(".")
        if any(
            not label
            or len(label) > 63
            or not all(c.isalnum() or c in "-*" for c in label)
            or label.startswith("-")
            for label in labels
        ):
            raise ValueError(
                f"invalid host name {host!r} for the coordinator certificate: use DNS labels "
                "(letters, digits, '-') separated by dots, or an IP address"
            )
        names.append(x509.DNSName(host))
    return names


def issue_coordinator(
    directory: str | os.PathLike[str],
    name: str = DEFAULT_COORDINATOR_NAME,
    *,
    hosts: Iterable[str] = (),
    valid_days: int = DEFAULT_LEAF_DAYS,
    force: bool = False,
) -> IssuedPair:
    """Issue the coordinator's TLS server certificate ``NAME.crt`` / ``NAME.key``.

    It is valid for ``localhost`` and ``127.0.0.1`` plus ``hosts`` (DNS names or IP addresses
    the sites dial). Sites that dial another name set the channel's target name override to one
    of these (``geoloco.protos.transport_endpoints.client_channel(..., server_name=...)``).
    """
    _check_name(name)
    authority = load_ca(directory)
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(COORDINATOR_URI)]
    sans += _host_names([*DEFAULT_COORDINATOR_HOSTS, *hosts])
    return _issue(authority, name, sans, ExtendedKeyUsageOID.SERVER_AUTH, valid_days, force)


def issue_relay(
    directory: str | os.PathLike[str],
    name: str,
    *,
    hosts: Iterable[str] = (),
    valid_days: int = DEFAULT_LEAF_DAYS,
    force: bool = False,
) -> IssuedPair:
    """Issue a regional relay's ``NAME.crt`` / ``NAME.key`` (``geoloco relay``): one certificate
    for both of its sides, a server certificate its sites dial (``localhost``, ``127.0.0.1`` and
    ``hosts``) and a client certificate that names relay ``name`` (URI SAN
    ``geoloco:relay:NAME``, never a site URI) to the coordinator."""
    _check_name(name)
    authority = load_ca(directory)
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(relay_uri(name))]
    sans += _host_names([*DEFAULT_COORDINATOR_HOSTS, *hosts])
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    return _issue(authority, name, sans, usages, valid_days, force)


def describe(cert_path: str | os.PathLike[str]) -> str:
    """One line for logs: subject, SANs and expiry of a PEM certificate."""
    cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        san_text = ", ".join(str(getattr(n, "value", n)) for n in sans)
    except x509.ExtensionNotFound:
        san_text = "-"
    return (
        f"{cert.subject.rfc4514_string()} SAN[{san_text}] "
        f"valid until {cert.not_valid_after_utc:%Y-%m-%d}"
    )

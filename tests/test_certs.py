"""`geoloco certs`: CA and leaf certificates for mutual TLS (files, modes, contents, CLI)."""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from geoloco.protos.identity import COORDINATOR_URI, site_from_uri, validate_site_name
from geoloco.scenarios import certs, certs_cmd


def _load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _sans(cert: x509.Certificate) -> x509.SubjectAlternativeName:
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


def _eku(cert: x509.Certificate) -> list:
    return list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


@pytest.fixture
def ca_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "pki"
    certs.init_ca(directory)
    return directory


def test_init_writes_a_p256_ca_with_private_key_modes(ca_dir: Path):
    cert = _load(ca_dir / "ca.crt")
    assert _mode(ca_dir / "ca.key") == 0o600
    assert _mode(ca_dir / "ca.crt") == 0o644
    assert _mode(ca_dir) == 0o700
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert cert.public_key().curve.name == "secp256r1"
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    cert.verify_directly_issued_by(cert)  # self-signed
    assert not list(ca_dir.glob(".*"))  # no temp files left behind


def test_init_refuses_to_overwrite_without_force(ca_dir: Path):
    before = (ca_dir / "ca.crt").read_bytes()
    with pytest.raises(FileExistsError, match="add --force to replace it"):
        certs.init_ca(ca_dir)
    assert (ca_dir / "ca.crt").read_bytes() == before
    certs.init_ca(ca_dir, force=True)
    assert (ca_dir / "ca.crt").read_bytes() != before
    assert _mode(ca_dir / "ca.key") == 0o600


def test_site_certificate_names_the_site_and_is_client_only(ca_dir: Path):
    pair = certs.issue_site(ca_dir, "eu-west_1")
    assert pair.cert == ca_dir / "eu-west_1.crt" and _mode(pair.key) == 0o600
    cert = _load(pair.cert)
    ca = _load(ca_dir / "ca.crt")
    cert.verify_directly_issued_by(ca)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "eu-west_1"
    uris = _sans(cert).get_values_for_type(x509.UniformResourceIdentifier)
    assert uris == ["geoloco:site:eu-west_1"]
    assert site_from_uri(uris[0]) == "eu-west_1"
    assert _eku(cert) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    with pytest.raises(FileExistsError):
        certs.issue_site(ca_dir, "eu-west_1")


def test_coordinator_certificate_is_server_only_with_hosts(ca_dir: Path):
    pair = certs.issue_coordinator(ca_dir, hosts=["coord.example.org", "10.1.2.3", "localhost"])
    cert = _load(pair.cert)
    cert.verify_directly_issued_by(_load(ca_dir / "ca.crt"))
    sans = _sans(cert)
    assert sans.get_values_for_type(x509.DNSName) == ["localhost", "coord.example.org"]
    assert sans.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("10.1.2.3"),
    ]
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [COORDINATOR_URI]
    assert _eku(cert) == [ExtendedKeyUsageOID.SERVER_AUTH]
    with pytest.raises(ValueError, match="host name"):
        certs.issue_coordinator(ca_dir, "coord2", hosts=["bad host!"])


@pytest.mark.parametrize(
    "name", ["", "a/b", "../x", "x y", ".hidden", "-dash", "a" * 64, "ca", "CA", "tab\t", "é"]
)
def test_bad_names_are_refused_with_the_rule(ca_dir: Path, name: str):
    with pytest.raises(ValueError) as info:
        certs.issue_site(ca_dir, name)
    assert "letters, digits" in str(info.value) or "reserved" in str(info.value)
    assert sorted(p.name for p in ca_dir.iterdir()) == ["ca.crt", "ca.key"]


def test_names_that_are_valid():
    for name in ("a", "eu-west", "us_east.2", "A" * 63):
        assert validate_site_name(name) == name


def test_issue_without_ca_says_how_to_make_one(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="geoloco certs init"):
        certs.issue_site(tmp_path, "eu")


def test_mismatched_ca_files_are_detected(ca_dir: Path, tmp_path: Path):
    other = tmp_path / "other"
    certs.init_ca(other)
    (ca_dir / "ca.key").write_bytes((other / "ca.key").read_bytes())
    with pytest.raises(ValueError, match="does not belong"):
        certs.load_ca(ca_dir)


def test_a_ca_certificate_without_an_ec_key_is_refused_as_mixed_up(ca_dir: Path):
    # It used to fail with AttributeError: an Ed25519 public key has no public_numbers().
    key = ed25519.Ed25519PrivateKey.generate()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "not the CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, None)
    )
    (ca_dir / "ca.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(ValueError, match="does not belong"):
        certs.load_ca(ca_dir)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="geoloco")
    certs_cmd.register(parser.add_subparsers(dest="command", required=True))
    return parser


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return args.handler(args)


def test_cli_init_and_issue(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    directory = tmp_path / "run-certs"
    assert _run(["certs", "init", str(directory)]) == 0
    assert _run(["certs", "issue", str(directory), "site-a"]) == 0
    assert (
        _run(
            [
                "certs",
                "issue",
                str(directory),
                "coordinator",
                "--coordinator",
                "--host",
                "coord.lan",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "site-a.crt" in out and "geoloco:site:site-a" in out
    assert "coord.lan" in _sans(_load(directory / "coordinator.crt")).get_values_for_type(
        x509.DNSName
    )

    assert _run(["certs", "init", str(directory)]) == 2
    assert "--force" in capsys.readouterr().err
    assert _run(["certs", "init", str(directory), "--force"]) == 0
    assert _run(["certs", "issue", str(directory), "bad/name"]) == 2
    assert "invalid site name" in capsys.readouterr().err
    assert _run(["certs", "issue", str(directory), "site-b", "--host", "x"]) == 2
    assert "--coordinator" in capsys.readouterr().err


def test_cli_requires_an_action():
    with pytest.raises(SystemExit):
        _parser().parse_args(["certs"])

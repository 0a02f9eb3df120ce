"""``geoloco relay``: config errors name the file, the key and what is allowed; the shipped
example is a valid config; relay certificates name a relay and no site."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509

from geoloco.protos.identity import relay_from_uri, site_from_uri
from geoloco.relay import RelayConfig
from geoloco.scenarios.cli import main
from geoloco.scenarios.config_file import EXIT_CONFIG_ERROR, read_toml
from geoloco.scenarios.relay_cmd import EXAMPLE_CONFIG

GOOD = 'name = "eu"\ncoordinator = "localhost:7000"\ncerts_dir = "certs"\n'


def test_the_shipped_example_is_a_valid_relay_config() -> None:
    config = RelayConfig.from_dict(read_toml(EXAMPLE_CONFIG))
    assert config.name == "eu" and config.upward_codec == "none"


@pytest.mark.parametrize(
    ("text", "key", "allowed"),
    [
        (GOOD + "max_wait_z = 1\n", "max_wait_z", "unknown key; allowed keys:"),
        (GOOD + 'upward_codec = "int8"\n', "upward_codec", "allowed: 'none' (lossless float32) or 'uplink'"),
        (GOOD.replace('"eu"', '"e u"'), "name", "invalid site name"),
        (GOOD + "max_wait_s = 0\n", "max_wait_s", "must be > 0 seconds"),
        ('name = "eu"\ncoordinator = "localhost:7000"\n', "certs_dir", "set certs_dir"),
    ],
)
def test_relay_reports_a_bad_key(
    text: str, key: str, allowed: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "relay.toml"
    path.write_text(text)
    assert main(["relay", "--config", str(path)]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert err.startswith(f"geoloco relay: error: {path}: {key}: "), err
    assert allowed in err and "Traceback" not in err


def test_relay_reports_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.toml"
    assert main(["relay", "--config", str(missing)]) == EXIT_CONFIG_ERROR
    assert capsys.readouterr().err == f"geoloco relay: error: {missing}: file not found\n"


def test_a_relay_certificate_names_a_relay_and_no_site(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["certs", "init", str(tmp_path)]) == 0
    assert main(["certs", "issue", str(tmp_path), "eu", "--relay", "--host", "relay.example"]) == 0
    cert = x509.load_pem_x509_certificate((tmp_path / "eu.crt").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
    assert [relay_from_uri(u) for u in uris] == ["eu"]
    assert all(site_from_uri(u) is None for u in uris)
    assert "relay.example" in sans.get_values_for_type(x509.DNSName)
    usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert usages == {x509.oid.ExtendedKeyUsageOID.SERVER_AUTH, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH}
    capsys.readouterr()
    assert main(["certs", "issue", str(tmp_path), "x", "--relay", "--coordinator"]) == EXIT_CONFIG_ERROR
    assert "choose --coordinator or --relay" in capsys.readouterr().err

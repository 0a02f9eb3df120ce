"""TLS mistakes are named and stop the site early, instead of reading as a 300 s network outage.

gRPC tells a client only that it "failed to connect" (and, with two addresses for ``localhost``,
often the other address's error). A site now checks its own certificate against its CA before it
dials, and when a connection fails it dials once with Python's ``ssl`` to name the mistake: the
coordinator's certificate is from another CA, it does not name the host dialled, or one side
speaks plain text and the other TLS. The same diagnosis twice in a row stops the site with one
line that says what to do, whatever ``give_up_after_s`` (300 s by default) says.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from geoloco.algorithms.params import ParamLayout
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.server import CoordinatorServer
from geoloco.protos.transport_tls import (
    HOST_NOT_IN_CERTIFICATE,
    PLAIN_TEXT_PEER,
    TLS_PEER,
    WRONG_CA,
    TLSFiles,
    check_tls_files,
    diagnose_handshake,
)
from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_site
from geoloco.scenarios.cli import main
from geoloco.scenarios.config_file import EXIT_RUNTIME_ERROR

STOP_WITHIN_S = 30.0


@pytest.fixture(autouse=True)
def _no_reexec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEOLOCO_NO_MALLOC_REEXEC", "1")  # re-executing would replace pytest


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The run's CA folder, another CA's folder, and a folder mixing the run's ca.crt with a
    site certificate of the other CA."""
    root = tmp_path_factory.mktemp("certs")
    run, other, mixed = root / "run", root / "other", root / "mixed"
    for folder in (run, other):
        init_ca(folder)
        issue_coordinator(folder)
        issue_site(folder, "a")
    mixed.mkdir()
    shutil.copy(run / "ca.crt", mixed / "ca.crt")
    for name in ("a.crt", "a.key"):
        shutil.copy(other / name, mixed / name)
    return {"run": run, "other": other, "mixed": mixed}


def _coordinator(certs_dir: Path | None, host: str = "127.0.0.1") -> CoordinatorServer:
    model = torch.nn.Linear(3, 2)
    layout = ParamLayout.from_model(model)
    config = CoordinatorConfig(
        certs_dir=None if certs_dir is None else str(certs_dir), insecure=certs_dir is None, host=host,
        port=0, min_sites=1, total_rounds=1,
    )
    server = CoordinatorServer(config, layout.flatten(model), layout)
    server.start()
    return server


@pytest.fixture(scope="module")
def tls_coordinator(certs: dict[str, Path]) -> Iterator[CoordinatorServer]:
    # On 127.0.0.2, a loopback address its certificate (localhost, 127.0.0.1) does not name.
    server = _coordinator(certs["run"], host="127.0.0.2")
    yield server
    server.stop(grace=0)


@pytest.fixture(scope="module")
def plain_coordinator() -> Iterator[CoordinatorServer]:
    server = _coordinator(None)
    yield server
    server.stop(grace=0)


def test_a_certificate_of_another_ca_is_named_before_dialling(certs: dict[str, Path]) -> None:
    check_tls_files(TLSFiles.from_dir(certs["run"], "a"), name="a")
    with pytest.raises(ValueError, match=r"was not issued by the CA in .*two different CAs") as info:
        check_tls_files(TLSFiles.from_dir(certs["mixed"], "a"), name="a")
    assert "\n" not in str(info.value) and "geoloco certs issue DIR a" in str(info.value)


def test_each_handshake_mistake_is_named(
    certs: dict[str, Path], tls_coordinator: CoordinatorServer, plain_coordinator: CoordinatorServer
) -> None:
    tls = TLSFiles.from_dir(certs["run"], "a")
    at_tls = f"127.0.0.2:{tls_coordinator.port}"
    assert diagnose_handshake(at_tls, tls=tls, insecure=False, server_name="localhost") is None  # all well

    cases = [
        (at_tls, TLSFiles.from_dir(certs["other"], "a"), "localhost", WRONG_CA, "did not issue"),
        (at_tls, tls, None, HOST_NOT_IN_CERTIFICATE, "does not name '127.0.0.2' (it names localhost, 127.0.0.1)"),
        (at_tls, None, None, TLS_PEER, "requires mutual TLS"),
        (f"127.0.0.1:{plain_coordinator.port}", tls, None, PLAIN_TEXT_PEER, "speaks plain text"),
    ]
    for target, files, server_name, cause, words in cases:
        found = diagnose_handshake(target, tls=files, insecure=files is None, server_name=server_name, name="a")
        assert found is not None and found.cause == cause, (cause, found)
        assert words in found.message and "\n" not in found.message
    assert diagnose_handshake(f"127.0.0.1:{plain_coordinator.port}", tls=None, insecure=True) is None


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("site certificate from another CA", ["was not issued by the CA", "geoloco certs issue DIR a"]),
        ("host name not in the certificate", ["does not name '127.0.0.2'", "--server-name", "--host 127.0.0.2"]),
        ("plain text against TLS", ["requires mutual TLS", "--certs DIR"]),
    ],
)
def test_the_site_command_stops_early_with_one_line_naming_the_mistake(
    case: str, words: list[str], certs: dict[str, Path], tls_coordinator: CoordinatorServer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    mode = {
        "site certificate from another CA": ["--certs", str(certs["mixed"])],
        "host name not in the certificate": ["--certs", str(certs["run"])],
        "plain text against TLS": ["--insecure"],
    }[case]
    started = time.monotonic()
    status = main(["site", "--coordinator", f"127.0.0.2:{tls_coordinator.port}", "--name", "a", *mode,
                   "--device", "cpu", "--give-up-after", "60"])  # twice the bound: not what stops it
    elapsed = time.monotonic() - started
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("geoloco site: error:")]
    assert status == EXIT_RUNTIME_ERROR and elapsed < STOP_WITHIN_S, (status, elapsed)
    assert len(errors) == 1, errors
    for expected in words:
        assert expected in errors[0], (expected, errors[0])
    assert "give_up_after_s" not in errors[0] and "check that it is running" not in errors[0]
    assert tls_coordinator.rounds.members == []

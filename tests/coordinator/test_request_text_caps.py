"""Attacker-sized text is never kept, over real gRPC with mutual TLS.

Strings a request carries (codec, dtype, session id...) reach error messages, the log and the
status page's event list; a site's upload ``metrics`` map reaches the round's record and the
page's mean train loss. Each must be cut to a bounded size, repeated rejections counted rather
than stored one by one, and the metrics of an update that was not aggregated ignored.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from _round_helpers import chunk_requests, encode_update, tiny_weights, upload_manifest

from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.http_config import HTTPStatusConfig
from geoloco.coordinator.metrics import read_metrics
from geoloco.coordinator.server import CoordinatorServer
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.protocol_version import PROTOCOL_VERSION
from geoloco.protos.transport_endpoints import client_channel, coordinator_stub
from geoloco.protos.transport_tls import TLSFiles
from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_site

SITES = ["a", "b"]
HUGE = 200_000
"""Characters of an attacker's string (well inside gRPC's message size limit)."""
MAX_DETAILS = 2048
"""Generous bound on what any error message or event text may keep."""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    init_ca(directory)
    issue_coordinator(directory)
    for name in SITES:
        issue_site(directory, name)
    return directory


@pytest.fixture
def server(certs: Path, tmp_path: Path) -> Iterator[CoordinatorServer]:
    weights, layout = tiny_weights()
    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(inner_steps=1),
        certs_dir=str(certs),
        allowed_sites=SITES,
        min_sites=1,
        total_rounds=3,
        metrics_path=str(tmp_path / "metrics.jsonl"),
        http=HTTPStatusConfig(enabled=True, port=0),
    )
    server = CoordinatorServer(config, weights, layout)
    server.start()
    yield server
    server.stop(grace=0)


class Client:
    def __init__(self, certs: Path, port: int, name: str) -> None:
        self.channel = client_channel(f"localhost:{port}", tls=TLSFiles.from_dir(certs, name))
        self.stub = coordinator_stub(self.channel)
        self.session = ""

    def join(self) -> None:
        self.session = self.stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=10).session_id

    def upload(self, update: torch.Tensor, *, edit: Any = None, metrics: dict[str, float] | None = None,
               session: str | None = None) -> pb.UploadResponse:
        data, spec = encode_update(update)
        manifest = upload_manifest(self.session if session is None else session, 0, data, codec=spec,
                                   numel=update.numel())
        if metrics:
            manifest.metrics.update(metrics)
        if edit is not None:
            edit(manifest)

        def stream() -> Iterator[pb.UploadRequest]:
            yield pb.UploadRequest(manifest=manifest)
            yield from chunk_requests(manifest, data)

        return self.stub.Upload(stream(), timeout=30)

    def close(self) -> None:
        self.channel.close()


@pytest.fixture
def clients(server: CoordinatorServer, certs: Path) -> Iterator[dict[str, Client]]:
    made = {name: Client(certs, server.port, name) for name in SITES}
    for client in made.values():
        client.join()
    yield made
    for client in made.values():
        client.close()


def _refused(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def _status(server: CoordinatorServer) -> dict[str, Any]:
    assert server.http_status is not None
    return server.http_status.status()


def _update(numel: int, seed: int = 1) -> torch.Tensor:
    return 0.01 * torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def _set_codec(text: str) -> Any:
    def edit(manifest: pb.UploadManifest) -> None:
        manifest.blob.codec = text

    return edit


def _set_dtype(text: str) -> Any:
    def edit(manifest: pb.UploadManifest) -> None:
        manifest.blob.dtype = text

    return edit


@pytest.mark.parametrize("field", ["codec", "dtype", "session_id"])
def test_huge_request_strings_are_cut_in_the_error_and_on_the_status_page(
    server: CoordinatorServer, clients: dict[str, Client], field: str
) -> None:
    client = clients["a"]
    numel = server.rounds.numel
    for i in range(25):
        text = f"{i:03d}" + "x" * HUGE
        if field == "codec":
            error = _refused(lambda: client.upload(_update(numel), edit=_set_codec(text)))
        elif field == "dtype":
            error = _refused(lambda: client.upload(_update(numel), edit=_set_dtype(text)))
        else:
            error = _refused(lambda: client.upload(_update(numel), session=text))
        assert error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
        assert len(error.details()) <= MAX_DETAILS, f"{field}: {len(error.details())} characters echoed"
        assert f"{i:03d}xxx" in error.details(), "the error no longer says what was sent"
    status = _status(server)
    assert status["rejected_total"] == 25
    rejections = [e for e in status["events"] if e["kind"] == "rejected"]
    assert all(len(e["text"]) <= MAX_DETAILS for e in status["events"])
    # 25 refusals of the same kind are one entry with a count, not 25 stored messages.
    assert len(rejections) == 1, [e["text"][:80] for e in rejections]
    assert rejections[0]["count"] == 25


def test_metrics_of_a_rejected_update_are_not_kept(
    server: CoordinatorServer, clients: dict[str, Client], tmp_path: Path
) -> None:
    numel = server.rounds.numel
    poisoned = _update(numel)
    poisoned[0] = float("nan")
    error = _refused(lambda: clients["a"].upload(poisoned, metrics={"train_loss": 1e9, "junk": 7.0}))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert clients["b"].upload(_update(numel, 2), metrics={"train_loss": 2.0}).complete
    path = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not (path.exists() and read_metrics(path)):
        assert time.monotonic() < deadline, server.rounds.status()
        server.rounds.wait_for_change(0.1)
    record = read_metrics(path)[-1]
    assert record["site_metrics"] == {"b": {"train_loss": 2.0}}
    assert _status(server)["rounds"][-1]["train_loss"] == 2.0


@pytest.mark.parametrize(
    ("metrics", "what"),
    [
        ({f"m{i}": float(i) for i in range(5000)}, "entries"),
        ({"k" * HUGE: 1.0}, "characters"),
    ],
)
def test_an_oversized_metrics_map_is_invalid_argument(
    server: CoordinatorServer, clients: dict[str, Client], metrics: dict[str, float], what: str
) -> None:
    theta = server.rounds.weights.clone()
    error = _refused(lambda: clients["a"].upload(_update(server.rounds.numel), metrics=metrics))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "metrics" in error.details() and what in error.details(), error.details()
    assert len(error.details()) <= MAX_DETAILS
    assert torch.equal(server.rounds.weights, theta)
    assert server.rounds.status()["contributed"] == []

"""The status page's config view leaves out where the run keeps its files.

On loopback ``/api/status`` needs no credentials; the whole config it shows must not tell an
unauthenticated reader where the certificates (and their private keys), checkpoints, metrics
or the HTTP token live.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from _round_helpers import tiny_model
from test_web_http_endpoints import get

from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.http_status import HTTPStatusConfig
from geoloco.coordinator.server import CoordinatorServer
from geoloco.scenarios.certs import init_ca, issue_coordinator


def _keys(value: Any) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for item in value.values() for k in _keys(item)}
    if isinstance(value, list):
        return {k for item in value for k in _keys(item)}
    return set()


def test_unauthenticated_status_shows_no_local_paths(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    certs.mkdir()
    init_ca(certs)
    issue_coordinator(certs)
    config = CoordinatorConfig(
        certs_dir=str(certs),
        checkpoint_dir=str(tmp_path / "ckpt"),
        metrics_path=str(tmp_path / "metrics.jsonl"),
        workload={"name": "mlp", "data_dir": str(tmp_path / "data")},
        http=HTTPStatusConfig(enabled=True, port=0),
    )
    server = CoordinatorServer.from_model(config, tiny_model())
    server.start()
    try:
        url = server.status_url
        assert url is not None
        status, _, body = get(url + "api/status")
    finally:
        server.stop(grace=0)
    assert status == 200
    assert str(tmp_path) not in body.decode()
    document = json.loads(body)
    full = document["config"]["full"]
    assert full["total_rounds"] == config.total_rounds and full["cert_name"] == "coordinator"
    assert full["workload"] == {"name": "mlp"}
    assert not {k for k in _keys(document["config"]) if k.endswith(("_dir", "_path", "_file"))}

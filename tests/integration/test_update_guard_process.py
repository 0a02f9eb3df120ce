"""A real ``geoloco coordinator`` process keeps running when a site sends float32-max updates.

Raw gRPC clients (mutual TLS, site certificates) stand in for hostile sites: in the first run one
site's float32-max update must be refused with INVALID_ARGUMENT; in the second, with a norm bound
too large to stop them, two such updates overflow the sum and the round must be aborted. Either
way the process prints the round as done, stays alive, finishes the run normally (exit status 0)
and its checkpoint never holds non-finite or overflowed weights.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from _cluster import make_certs
from _processes import COORDINATOR_END, COORDINATOR_ROUND, LISTENING, Process, Processes, names

from geoloco.compression import parse_codec
from geoloco.coordinator.checkpoint import load_latest_checkpoint
from geoloco.coordinator.metrics import read_metrics
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.protocol_version import PROTOCOL_VERSION
from geoloco.protos.transport_endpoints import client_channel, coordinator_stub
from geoloco.protos.transport_tls import TLSFiles
from geoloco.protos.wire_chunks import upload_requests
from geoloco.protos.wire_manifests import blob_manifest

F32_MAX = torch.finfo(torch.float32).max

CONFIG = """
total_rounds = 2
seed = 1
min_sites = 1
allowed_sites = ["0", "1"]
heartbeat_interval_s = 0.5
heartbeat_timeout_s = 120.0
drain_timeout_s = 1.0
metrics_path = "{metrics}"
checkpoint_dir = "{checkpoints}"

[workload]
name = "mlp"

[algorithm]
inner_steps = 1
uplink_codec = "none"
downlink_codec = "none"
"""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"), ["0", "1"])


class Client:
    def __init__(self, certs: Path, port: int, name: str) -> None:
        self.channel = client_channel(f"localhost:{port}", tls=TLSFiles.from_dir(certs, name))
        self.stub = coordinator_stub(self.channel)
        response = self.stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=30)
        self.session, self.numel = response.session_id, response.layout.numel

    def upload(self, round_number: int, update: torch.Tensor) -> pb.UploadResponse:
        encoded = parse_codec("none").encode(update, seed=0)
        data = encoded.to_bytes()
        manifest = pb.UploadManifest(
            session_id=self.session, round=round_number, sample_weight=1.0,
            blob=blob_manifest(data, codec=encoded.spec, shape=[self.numel], dtype="float32", chunk_size=1 << 16),
        )
        return self.stub.Upload(upload_requests(manifest, data), timeout=60)

    def leave(self) -> None:
        self.stub.Leave(pb.LeaveRequest(session_id=self.session), timeout=30)
        self.channel.close()


def _small(numel: int, seed: int) -> torch.Tensor:
    return 0.01 * torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def _start(processes: Processes, tmp_path: Path, certs: Path, norm_floor: str | None) -> tuple[Process, int]:
    """The coordinator CLI; ``norm_floor``: an ``[update_guard]`` table with it (None: the defaults)."""
    config = tmp_path / "coordinator.toml"
    text = CONFIG.format(metrics=tmp_path / "metrics.jsonl", checkpoints=tmp_path / "checkpoints")
    if norm_floor is not None:
        text += f"\n[update_guard]\nnorm_floor = {norm_floor}\n"
    config.write_text(text)
    process = processes.start("coordinator", "coordinator", "--config", str(config), "--certs", str(certs),
                              "--http-port", "0")
    _, match = process.wait_line(LISTENING, what="the listening line")
    return process, int(match["port"])


def _finish(process: Process, clients: dict[str, Client], tmp_path: Path) -> None:
    """Round 1 with sane updates from both; the run ends normally with sane checkpointed weights."""
    for k, client in enumerate(clients.values()):
        assert client.upload(1, _small(client.numel, 10 + k)).complete
    process.wait_line(COORDINATOR_ROUND, where=lambda m: m["round"] == "1", what="round 1 done")
    for client in clients.values():
        client.leave()
    assert process.wait_exit() == 0, process.describe()
    _, end = process.wait_line(COORDINATOR_END, what="the final line")
    assert end["how"] == "finished", process.describe()
    checkpoint = load_latest_checkpoint(tmp_path / "checkpoints")
    assert checkpoint is not None
    weights = checkpoint.tensors["weights"]
    assert bool(torch.isfinite(weights).all()) and float(weights.abs().max()) < 100.0


def test_a_float32_max_update_is_refused_and_the_process_runs_on(certs: Path, tmp_path: Path) -> None:
    with Processes(tmp_path) as processes:
        process, port = _start(processes, tmp_path, certs, None)
        clients = {name: Client(certs, port, name) for name in ("0", "1")}
        numel = clients["0"].numel
        with pytest.raises(grpc.RpcError) as info:
            clients["0"].upload(0, torch.full((numel,), F32_MAX))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "norm" in info.value.details()
        assert clients["1"].upload(0, _small(numel, 1)).complete
        _, done = process.wait_line(COORDINATOR_ROUND, where=lambda m: m["round"] == "0", what="round 0 done")
        assert names(done["participants"]) == {"1"}
        assert process.popen.poll() is None, process.describe()
        _finish(process, clients, tmp_path)
    record = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert record["rejected"] == ["0"] and "norm" in record["rejected_reasons"]["0"]


def test_float32_max_updates_that_overflow_the_sum_abort_the_round_and_the_process_runs_on(
    certs: Path, tmp_path: Path
) -> None:
    with Processes(tmp_path) as processes:
        process, port = _start(processes, tmp_path, certs, "1e300")
        clients = {name: Client(certs, port, name) for name in ("0", "1")}
        numel = clients["0"].numel
        for client in clients.values():
            assert client.upload(0, torch.full((numel,), F32_MAX)).complete
        _, done = process.wait_line(COORDINATOR_ROUND, where=lambda m: m["round"] == "0", what="round 0 done")
        assert names(done["participants"]) == set()
        assert process.popen.poll() is None, process.describe()
        _finish(process, clients, tmp_path)
    record = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert "not finite" in record["aborted"]

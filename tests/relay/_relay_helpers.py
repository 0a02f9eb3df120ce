"""Helpers of the relay tests: certificates, a coordinator, relays and sites speaking raw gRPC
over mutual TLS, so a test controls every site's upload exactly."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch

from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.compression import parse_codec
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.server import CoordinatorServer
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.protocol_version import PROTOCOL_VERSION
from geoloco.protos.transport_endpoints import client_channel, coordinator_stub
from geoloco.protos.transport_tls import TLSFiles
from geoloco.protos.wire_assembly import Download, read_broadcast_stream
from geoloco.protos.wire_chunks import upload_requests
from geoloco.protos.wire_manifests import blob_manifest
from geoloco.relay import RelayConfig, RelayServer

REGIONS = {"eu": ["site-a", "site-b"], "us": ["site-c", "site-d"]}
SITES = [s for sites in REGIONS.values() for s in sites]


def make_certs(directory: Path) -> Path:
    from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_relay, issue_site

    init_ca(directory)
    issue_coordinator(directory)
    for relay in [*REGIONS, "ap"]:  # "ap" is in no coordinator's [relays] table
        issue_relay(directory, relay)
    for site in [*SITES, "site-x"]:
        issue_site(directory, site)
    return directory


def tiny_model(numel: int = 37) -> torch.nn.Linear:
    """The model of the relay tests' coordinators: ``numel`` parameters, the same at every call."""
    torch.manual_seed(0)
    return torch.nn.Linear(numel - 1, 1)


def tiny_weights(numel: int = 37) -> tuple[torch.Tensor, ParamLayout]:
    model = tiny_model(numel)
    layout = ParamLayout.from_model(model)
    return layout.flatten(model), layout


def coordinator(
    certs: Path, *, codec: str = "none", weighting: str = "samples", rounds: int = 1, numel: int = 37,
    metrics_path: Path | None = None, min_sites: int = len(SITES), relays: bool = True, **extra: Any,
) -> CoordinatorServer:
    weights, layout = tiny_weights(numel)
    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(inner_steps=1, uplink_codec=codec, weighting=weighting),  # type: ignore[arg-type]
        certs_dir=str(certs),
        min_sites=min_sites,
        total_rounds=rounds,
        relays={k: list(v) for k, v in REGIONS.items()} if relays else {},
        drain_timeout_s=0.0,
        metrics_path=None if metrics_path is None else str(metrics_path),
        **extra,
    )
    server = CoordinatorServer(config, weights, layout)
    server.start()
    return server


def relay(certs: Path, name: str, coordinator_port: int, **kwargs: Any) -> RelayServer:
    server = RelayServer(
        RelayConfig(
            name=name, coordinator=f"localhost:{coordinator_port}", certs_dir=str(certs), sites=REGIONS[name],
            **kwargs,
        )
    )
    server.start()
    return server


@dataclass
class Site:
    """A site as raw gRPC calls (no training): join, upload a given update, await the broadcast."""

    name: str
    certs: Path
    target: str
    session: str = ""
    channel: Any = field(default=None, repr=False)
    instance: str = ""
    """This process's ``instance_id`` in its Join, Upload and AwaitBroadcast ("" sends none)."""

    def __post_init__(self) -> None:
        self.channel = client_channel(self.target, tls=TLSFiles.from_dir(self.certs, self.name))
        self.stub = coordinator_stub(self.channel)

    def join(self) -> pb.JoinResponse:
        response: pb.JoinResponse = self.stub.Join(
            pb.JoinRequest(protocol_version=PROTOCOL_VERSION, instance_id=self.instance), timeout=20
        )
        self.session = response.session_id
        return response

    def manifest(
        self, update: torch.Tensor, codec: str, *, round_number: int = 0, weight: float = 1.0,
        inner_steps: int = 1, metrics: dict[str, float] | None = None,
    ) -> tuple[pb.UploadManifest, bytes]:
        """The manifest and bytes of this site's upload of ``update`` (for a test that sends
        them its own way, or with another inner-step count or metrics)."""
        encoded = parse_codec(codec).encode(update, seed=0)
        data = encoded.to_bytes()
        manifest = pb.UploadManifest(
            session_id=self.session, round=round_number, sample_weight=weight, inner_steps=inner_steps,
            metrics={"train_loss": 1.5} if metrics is None else metrics, instance_id=self.instance,
            blob=blob_manifest(data, codec=encoded.spec, shape=[update.numel()], dtype="float32", chunk_size=64),
        )
        return manifest, data

    def upload(
        self, update: torch.Tensor, codec: str, *, round_number: int = 0, weight: float = 1.0, inner_steps: int = 1,
        metrics: dict[str, float] | None = None,
    ) -> pb.UploadResponse:
        manifest, data = self.manifest(
            update, codec, round_number=round_number, weight=weight, inner_steps=inner_steps, metrics=metrics
        )
        response: pb.UploadResponse = self.stub.Upload(upload_requests(manifest, data), timeout=20)
        return response

    def await_broadcast(self, round_number: int = 0, *, withheld: str = "") -> tuple[pb.BroadcastHeader, bytes]:
        download = Download()
        responses = self.stub.AwaitBroadcast(
            pb.AwaitBroadcastRequest(
                session_id=self.session, round=round_number, instance_id=self.instance, withheld=withheld
            ),
            timeout=60,
        )
        header = read_broadcast_stream(responses, download)
        data = bytes(download.result()) if header.action == pb.BROADCAST_ACTION_APPLY_DELTA else b""
        return header, data

    def close(self) -> None:
        self.channel.close()


def updates(numel: int, *, dyadic: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """One update per site: small multiples of 1/64 (every float32 sum of them is exact, so
    any summation order gives the same bits), or plain random values."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for site in SITES:
        if dyadic:
            out[site] = torch.randint(-64, 65, (numel,), generator=g).to(torch.float32) / 64
        else:
            out[site] = torch.randn(numel, generator=g)
    return out


def sites_at(names: list[str], certs: Path, target: str) -> Iterator[Site]:
    for name in names:
        yield Site(name, certs, target)


def rpc_code(err: BaseException) -> grpc.StatusCode | None:
    return err.code() if isinstance(err, grpc.RpcError) else None  # type: ignore[attr-defined]

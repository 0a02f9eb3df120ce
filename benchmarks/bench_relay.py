"""Coordinator traffic per round, flat vs through regional relays (real gRPC, mutual TLS, one
machine).

    python benchmarks/bench_relay.py [--numel N] [--codec int8] [--regions 2] [--sites-per-region 2 6]

For each region size it runs one round twice: every site uploading straight to a coordinator,
and the same sites behind one relay per region. It prints the coordinator's bytes received and
sent in that round (serialized protobuf, as the coordinator's byte events count them: the upload manifests
and chunks in, the progress messages, broadcast headers and chunks out; joins carry no counted
bytes, the sites fetch no model), flat and relayed side by side with their ratio and the ``relays / sites`` target
ratio, for both upward codecs: ``none`` (float32: a relay saves coordinator ingress only when its
sites' encoded updates together exceed one float32 vector) and ``uplink`` (the run's codec with
the relay's own error feedback).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.compression import parse_codec
from geoloco.coordinator import events as ev
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
from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_relay, issue_site


def _round(
    certs: Path, regions: dict[str, list[str]], numel: int, codec: str, *, relayed: bool, upward: str = "none"
) -> dict[str, int]:
    """One round; the coordinator's bytes in and out of it (its byte events, uploads to broadcasts)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(numel - 1, 1)
    layout = ParamLayout.from_model(model)
    sites = [s for names in regions.values() for s in names]
    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(inner_steps=1, uplink_codec=codec, downlink_codec=codec),
        certs_dir=str(certs), min_sites=len(sites), total_rounds=1,
        relays={k: list(v) for k, v in regions.items()}, drain_timeout_s=0.0,
    )
    server = CoordinatorServer(config, layout.flatten(model), layout)
    counts = {"up": 0, "down": 0}

    def count(event: ev.RoundEvent) -> None:
        if event.kind in (ev.BYTES_RECEIVED, ev.BYTES_SENT):
            counts["up" if event.kind == ev.BYTES_RECEIVED else "down"] += int(event.data["nbytes"])

    server.rounds.events.add_listener(count)
    server.start()
    relays = {}
    if relayed:
        for name, names in regions.items():
            relays[name] = RelayServer(
                RelayConfig(
                    name=name, coordinator=f"localhost:{server.port}", certs_dir=str(certs), sites=names,
                    upward_codec=upward,
                )
            )
            relays[name].start()
    target = {s: f"localhost:{relays[r].port if relayed else server.port}" for r, ns in regions.items() for s in ns}
    channels = {s: client_channel(target[s], tls=TLSFiles.from_dir(certs, s)) for s in sites}
    stubs = {s: coordinator_stub(c) for s, c in channels.items()}
    try:
        sessions = {
            s: stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=60).session_id
            for s, stub in stubs.items()
        }

        def upload_and_wait(site: str) -> None:
            g = torch.Generator().manual_seed(sites.index(site))
            encoded = parse_codec(codec).encode(torch.randn(numel, generator=g) * 1e-3, seed=0)
            data = encoded.to_bytes()
            manifest = pb.UploadManifest(
                session_id=sessions[site], round=0, sample_weight=1.0, inner_steps=1,
                blob=blob_manifest(data, codec=encoded.spec, shape=[numel], dtype="float32"),
            )
            assert stubs[site].Upload(upload_requests(manifest, data), timeout=300).complete
            responses = stubs[site].AwaitBroadcast(pb.AwaitBroadcastRequest(session_id=sessions[site], round=0))
            read_broadcast_stream(responses, Download())

        with ThreadPoolExecutor(len(sites)) as pool:
            list(pool.map(upload_and_wait, sites))
    finally:
        for channel in channels.values():
            channel.close()
        for r in relays.values():
            r.stop(grace=0)
        server.stop(grace=0)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--numel", type=int, default=1_000_000)
    parser.add_argument("--codec", default="int8")
    parser.add_argument("--regions", type=int, default=2)
    parser.add_argument("--sites-per-region", type=int, nargs="+", default=[2, 6])
    args = parser.parse_args(argv)
    print(
        f"numel {args.numel:,} ({4 * args.numel / 2**20:.1f} MiB fp32), codec {args.codec} up and down, "
        f"{args.regions} regions; upward none (float32) or uplink ({args.codec} with the relay's residual); "
        "bytes are the coordinator's in one round"
    )
    print(f"{'sites':>5} {'upward':>6} {'in flat':>12} {'in relayed':>12} {'ratio':>6} {'out flat':>12} "
          f"{'out relayed':>12} {'ratio':>6} {'relays/sites':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        certs = Path(tmp) / "certs"
        init_ca(certs)
        issue_coordinator(certs)
        for k in range(args.regions):
            issue_relay(certs, f"r{k}")
        for per in args.sites_per_region:
            regions = {f"r{k}": [f"s{k}-{i}" for i in range(per)] for k in range(args.regions)}
            for names in regions.values():
                for s in names:
                    if not (certs / f"{s}.crt").exists():
                        issue_site(certs, s)
            flat = _round(certs, regions, args.numel, args.codec, relayed=False)
            n = args.regions * per
            for upward in ("none", "uplink"):
                relayed = _round(certs, regions, args.numel, args.codec, relayed=True, upward=upward)
                print(
                    f"{n:>5} {upward:>6} {flat['up']:>12,} {relayed['up']:>12,} {relayed['up'] / flat['up']:>6.3f} "
                    f"{flat['down']:>12,} {relayed['down']:>12,} {relayed['down'] / flat['down']:>6.3f} "
                    f"{args.regions / n:>12.3f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())

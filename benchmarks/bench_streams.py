"""One upload over K parallel streams (mutual TLS, loopback) beside raw TCP of the same bytes.

A site process sends one payload (default 1 GiB) to a coordinator-like process with
``client_streams.upload_in_streams`` -- the code path of ``CoordinatorClient.upload`` -- for
K = 1, 2, 4, 8, once with one TCP connection per stream (``StreamChannels``, what the site
does) and once with all K streams multiplexed over one channel (one HTTP/2 connection). The
receiving side feeds every stream of one manifest into one ``UploadAssembler`` and verifies
its SHA-256, as the coordinator's intake does. Then the same payload comes back as K strided
FetchModel calls (``chunk_stride``, one connection each) into one ``wire_assembly.Download``, checksum
verified, as ``CoordinatorClient.fetch_model`` makes them. The same bytes also go once through a plain TCP
socket between two processes (``sendall`` / ``recv_into``). Each cell runs once (the machine is
shared); ratios are against the raw socket of the same run. Every process runs with
``transport_malloc.recommended_env()``, the malloc tunables the ``geoloco`` commands apply.

    python benchmarks/bench_streams.py                  # 1 GiB, K = 1, 2, 4, 8
    python benchmarks/bench_streams.py --size-mib 256 --streams 1,4
    python benchmarks/bench_streams.py --size-mib 64 --streams 1,2,4 --layouts connections \
        --link-mbit 1000 --rtt-ms 80 --window-kib 1024
        # through the emulator's relay: 1 Gbit/s, 80 ms, each TCP connection's window 1 MiB

Timing starts when the first Upload call starts and ends when every stream's response (the
last one sent after the checksum check) has arrived; the site's checksum of the payload is
computed before the clock starts.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
_SITE = "bench-site"


def _payload(nbytes: int) -> bytearray:
    """Incompressible-looking bytes, made fast (a 1 MiB random block repeated)."""
    block = os.urandom(MiB)
    data = bytearray(nbytes)
    for offset in range(0, nbytes, MiB):
        piece = data[offset : offset + MiB]
        data[offset : offset + len(piece)] = block[: len(piece)]
    return data


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _role_server(args: argparse.Namespace) -> None:
    from geoloco.protos import geoloco_pb2 as pb
    from geoloco.protos.transport_endpoints import add_coordinator_servicer, build_server, stop_server
    from geoloco.protos.transport_tls import TLSFiles, resolve_site
    from geoloco.protos.wire_assembly import UploadAssembler, read_upload_manifest, upload_chunks
    from geoloco.protos.wire_chunks import model_responses
    from geoloco.protos.wire_manifests import blob_manifest

    buffer = bytearray(args.size)  # reused by every upload, as a coordinator would
    assemblers: dict[int, Any] = {}
    serve = _payload(args.size)  # what FetchModel serves
    served = [blob_manifest(serve, chunk_size=args.chunk_mib * MiB)]
    lock = threading.Lock()

    class BenchCoordinator:
        def Upload(self, request_iterator: Any, context: Any) -> Any:
            manifest = read_upload_manifest(request_iterator)
            resolve_site(context, manifest.site, insecure=False)
            with lock:
                assembler = assemblers.get(manifest.round)
                if assembler is None:
                    assemblers.clear()
                    assembler = UploadAssembler(manifest, out=buffer)
                    assemblers[manifest.round] = assembler
            assembler.consume(upload_chunks(request_iterator))
            if assembler.complete:
                assembler.finish()
            return assembler.upload_response()

        def FetchModel(self, request: Any, context: Any) -> Any:
            manifest = pb.ModelManifest(round=0, blob=served[0], start_chunk=request.start_chunk)
            yield from model_responses(manifest, serve, stride=request.chunk_stride)

    from geoloco.protos import geoloco_pb2_grpc as pb_grpc

    servicer = type("Servicer", (BenchCoordinator, pb_grpc.CoordinatorServicer), {})()
    tls = TLSFiles.from_dir(args.tls_dir, "coordinator")
    server, port = build_server(tls=tls, insecure=False, max_workers=16)
    add_coordinator_servicer(servicer, server)
    server.start()
    print(port, flush=True)
    sys.stdin.read()  # the driver closes stdin to stop us
    stop_server(server, grace_s=1.0)


class _OneChannel:
    """Stands in for ``StreamChannels``: every extra stream on the main channel (HTTP/2
    multiplexing, one TCP connection)."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub

    def stubs(self, count: int) -> list[Any]:
        return [self._stub] * count


def _role_client(args: argparse.Namespace) -> None:
    import grpc

    from geoloco.protos import geoloco_pb2 as pb
    from geoloco.protos.transport_endpoints import client_channel, coordinator_stub, wait_for_channel
    from geoloco.protos.transport_tls import TLSFiles
    from geoloco.protos.wire_assembly import Download
    from geoloco.protos.wire_manifests import blob_manifest
    from geoloco.site_agent.client_streams import StreamChannels, run_streams, upload_in_streams

    tls = TLSFiles.from_dir(args.tls_dir, _SITE)
    target = f"localhost:{args.port}"
    channel = client_channel(target, tls=tls)
    wait_for_channel(channel, 30)
    stub = coordinator_stub(channel)
    extra = StreamChannels(
        target, tls=tls, insecure=False, server_name=None, extra_options=(), intercept=lambda c: c
    )
    data = _payload(args.size)
    receive = bytearray(args.size)
    blob = blob_manifest(data, chunk_size=args.chunk_mib * MiB)
    results = []
    round_number = 0
    for layout in args.layouts.split(","):
        for streams in (int(k) for k in args.streams.split(",")):
            if layout == "shared" and streams == 1:
                continue  # the same as one connection
            round_number += 1
            manifest = pb.UploadManifest(round=round_number, blob=blob)
            channels = extra if layout == "connections" else _OneChannel(stub)
            if layout == "connections":
                for other in channels.stubs(streams - 1):  # connect outside the timing
                    try:
                        other.UploadStatus(pb.UploadStatusRequest(round=0), timeout=30)
                    except grpc.RpcError:
                        pass  # UNIMPLEMENTED here: the connection is up, that is all we need
            cpu0 = _cpu_seconds()
            t0 = time.perf_counter()
            response = upload_in_streams(
                stub, channels, manifest, data, [(0, blob.num_chunks)], streams=streams, timeout=900
            )
            elapsed = time.perf_counter() - t0
            if not response.complete:
                raise RuntimeError(f"upload with {streams} streams incomplete: {response}")
            results.append(
                {"layout": layout, "streams": streams, "seconds": elapsed, "client_cpu_s": _cpu_seconds() - cpu0}
            )
    for streams in (int(k) for k in args.streams.split(",")):
        stubs = [stub, *extra.stubs(streams - 1)]
        download = Download(max_total_bytes=args.size, out_factory=lambda _b: receive, parallel=streams > 1)
        cpu0 = _cpu_seconds()
        t0 = time.perf_counter()
        run_streams([
            functools.partial(_fetch_share, stubs[r], download, r, streams) for r in range(streams)
        ])
        download.result()
        elapsed = time.perf_counter() - t0
        results.append(
            {"layout": "download", "streams": streams, "seconds": elapsed, "client_cpu_s": _cpu_seconds() - cpu0}
        )
    extra.close()
    channel.close()
    print(json.dumps(results), flush=True)


def _fetch_share(stub: Any, download: Any, residue: int, streams: int) -> None:
    """One strided FetchModel call, as ``CoordinatorClient.fetch_model`` makes it."""
    from geoloco.protos import geoloco_pb2 as pb
    from geoloco.protos.wire_assembly import read_model_stream

    request = pb.FetchModelRequest(start_chunk=residue, chunk_stride=streams if streams > 1 else 0)
    read_model_stream(stub.FetchModel(request, timeout=900), download)


def _role_raw_server(args: argparse.Namespace) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    buffer = memoryview(bytearray(args.size))
    conn, _ = listener.accept()
    received = 0
    while received < args.size:
        n = conn.recv_into(buffer[received : received + 4 * MiB])
        if n == 0:
            raise ConnectionError("raw sender closed early")
        received += n
    conn.sendall(b"k")
    conn.close()


def _role_raw_client(args: argparse.Namespace) -> None:
    data = memoryview(_payload(args.size))
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", args.port)) as conn:
        for offset in range(0, args.size, 4 * MiB):
            conn.sendall(data[offset : offset + 4 * MiB])
        if conn.recv(1) != b"k":
            raise ConnectionError("raw receiver did not acknowledge")
    print(json.dumps([{"seconds": time.perf_counter() - t0}]), flush=True)


def _pair(server_role: str, client_role: str, common: list[str], hub: Any = None) -> list[dict[str, Any]]:
    """Run a server and a client process; with ``hub`` (a ``RelayHub`` holding one shaped
    relay) the client dials the relay, which forwards to the server."""
    from geoloco.protos.transport_malloc import recommended_env

    # The malloc tunables the coordinator and site commands run with (``transport_malloc``):
    # without them every 1 MiB message is a fresh mmap and its page faults.
    env = recommended_env()
    server = subprocess.Popen(
        [sys.executable, __file__, "--role", server_role, *common],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )
    try:
        port = server.stdout.readline().strip() if server.stdout else ""
        if not port:
            raise RuntimeError(f"{server_role} did not start")
        if hub is not None:
            hub.set_target("127.0.0.1", int(port))
            port = str(next(iter(hub.relays.values())).port)
        client = subprocess.run(
            [sys.executable, __file__, "--role", client_role, "--port", port, *common],
            capture_output=True, text=True, timeout=1800, env=env,
        )
        if client.returncode != 0:
            raise RuntimeError(f"{client_role} failed:\n{client.stderr}")
        result: list[dict[str, Any]] = json.loads(client.stdout.strip().splitlines()[-1])
        return result
    finally:
        if server.stdin:
            server.stdin.close()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--role", default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tls-dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--size-mib", type=int, default=1024, help="payload size (default 1024)")
    parser.add_argument("--chunk-mib", type=int, default=1, help="chunk size (default 1)")
    parser.add_argument("--streams", default="1,2,4,8", help="stream counts to try")
    parser.add_argument(
        "--layouts", default="connections,shared",
        help="'connections' (one TCP connection per stream) and/or 'shared' (one channel)",
    )
    parser.add_argument("--link-mbit", type=float, help="shape the link: bandwidth per direction (Mbit/s)")
    parser.add_argument("--rtt-ms", type=float, default=80.0, help="shaped link: round trip (default 80)")
    parser.add_argument(
        "--window-kib", type=int, default=1024, help="shaped link: per-flow TCP window (default 1024 KiB)"
    )
    args = parser.parse_args()
    args.size = args.size_mib * MiB
    roles = {
        "server": _role_server, "client": _role_client,
        "raw-server": _role_raw_server, "raw-client": _role_raw_client,
    }
    if args.role != "driver":
        roles[args.role](args)
        return
    from geoloco.scenarios import certs
    from geoloco.scenarios.shaping import LinkShape, RelayHub

    hub = None
    link = "loopback"
    if args.link_mbit is not None:
        shape = LinkShape(args.link_mbit * 1e6, args.rtt_ms / 2000, flow_window_bytes=args.window_kib * 1024)
        hub = RelayHub()
        hub.add("bench", shape, shape)
        per_flow = args.window_kib * 1024 * 8 / (args.rtt_ms / 1000) / 1e6
        link = (
            f"a shaped link ({args.link_mbit:g} Mbit/s, RTT {args.rtt_ms:g} ms, per-flow window "
            f"{args.window_kib} KiB: one flow at most {per_flow:.0f} Mbit/s)"
        )
    try:
        with tempfile.TemporaryDirectory(prefix="geoloco-bench-") as tmp:
            pki = Path(tmp)
            certs.init_ca(pki)
            certs.issue_coordinator(pki)
            certs.issue_site(pki, _SITE)
            common = ["--size-mib", str(args.size_mib), "--tls-dir", str(pki)]
            raw = _pair("raw-server", "raw-client", common, hub)[0]["seconds"]
            rows = _pair(
                "server", "client",
                [*common, "--chunk-mib", str(args.chunk_mib), "--streams", args.streams, "--layouts", args.layouts],
                hub,
            )
    finally:
        if hub is not None:
            hub.close()
    rate = args.size / 1e6
    print(f"payload {args.size_mib} MiB, chunks {args.chunk_mib} MiB, mutual TLS over {link}, one run each\n")
    print("| path | streams | seconds | MB/s | Mbit/s | x raw TCP | site CPU s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(f"| raw TCP socket | 1 | {raw:.2f} | {rate / raw:.0f} | {8 * rate / raw:.0f} | 1.00 | - |")
    for row in rows:
        name = {
            "connections": "upload, TLS, a connection per stream",
            "shared": "upload, TLS, streams share one channel",
            "download": "download (FetchModel), TLS, a connection per stream",
        }[row["layout"]]
        print(
            f"| {name} | {row['streams']} | {row['seconds']:.2f} | {rate / row['seconds']:.0f} | "
            f"{8 * rate / row['seconds']:.0f} | {raw / row['seconds']:.2f} | {row['client_cpu_s']:.1f} |"
        )


if __name__ == "__main__":
    main()

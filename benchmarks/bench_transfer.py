"""Upload throughput through geoloco's real transport, beside a raw TCP socket.

A site process streams one update (default 256 MiB) to a coordinator process over loopback:
``transport_endpoints.client_channel`` + ``wire_chunks.upload_requests`` on one side,
``transport_endpoints.build_server`` + a servicer built from ``wire_assembly.read_upload_manifest``
/ ``UploadAssembler`` (checksum verified) on the other -- the code path the coordinator uses. The
same bytes also go through a plain TCP socket between two processes (``sendall`` / ``recv_into``),
the ceiling for a Python process on this machine. Every combination of TLS on/off, chunk size
and glibc malloc tunables on/off (``transport_malloc.recommended_env()``) runs in fresh processes;
the best of ``--repeats`` runs is reported, as a markdown table.

    python benchmarks/bench_transfer.py                 # full table (~1 min on 2 cores)
    python benchmarks/bench_transfer.py --profile       # where the time goes (cProfile, 1 MiB)

Timing starts when the Upload call starts and ends when the coordinator's response (sent after
the checksum check) arrives; the site's own checksum of the update is reported separately.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20
CHUNK_SIZES = {"256KiB": 256 * 1024, "1MiB": MiB, "4MiB": 4 * MiB}
_SITE = "bench-site"


def _payload(nbytes: int) -> bytearray:
    """Incompressible-looking bytes, made fast (a 1 MiB random block repeated)."""
    block = os.urandom(MiB)
    data = bytearray(nbytes)
    for offset in range(0, nbytes, MiB):
        piece = data[offset : offset + MiB]
        data[offset : offset + len(piece)] = block[: len(piece)]
    return data


# --- roles (each runs in its own process) ----------------------------------------------------


def _role_server(args: argparse.Namespace) -> None:
    import grpc  # noqa: F401  (import cost outside any timing)

    from geoloco.protos import geoloco_pb2 as pb
    from geoloco.protos import geoloco_pb2_grpc as pb_grpc
    from geoloco.protos.transport_endpoints import add_coordinator_servicer, build_server, stop_server
    from geoloco.protos.transport_tls import TLSFiles, resolve_site
    from geoloco.protos.wire_assembly import UploadAssembler, read_upload_manifest, upload_chunks

    insecure = args.tls_dir is None
    receive_buffer = bytearray(args.size)  # reused across uploads, as a coordinator would

    class BenchCoordinator(pb_grpc.CoordinatorServicer):
        def Upload(self, request_iterator, context):
            cpu0 = _cpu_seconds()
            manifest = read_upload_manifest(request_iterator)
            resolve_site(context, manifest.site, insecure=insecure)
            out = receive_buffer if manifest.blob.total_bytes == len(receive_buffer) else None
            assembler = UploadAssembler(manifest, out=out)
            assembler.consume(upload_chunks(request_iterator))
            if assembler.complete:
                assembler.finish()
            # Process-wide CPU (all threads, gRPC's own included) spent on this upload.
            context.set_trailing_metadata((("bench-cpu-s", f"{_cpu_seconds() - cpu0:.6f}"),))
            return assembler.upload_response()

    tls = None if insecure else TLSFiles.from_dir(args.tls_dir, "coordinator")
    server, port = build_server(tls=tls, insecure=insecure, max_workers=4)
    if args.path == "fast":
        add_coordinator_servicer(BenchCoordinator(), server)
    else:
        pb_grpc.add_CoordinatorServicer_to_server(BenchCoordinator(), server)
    profiler = cProfile.Profile() if args.profile_out else None
    if profiler:
        profiler.enable()
    server.start()
    print(port, flush=True)
    sys.stdin.read()  # the driver closes stdin to stop us
    stop_server(server, grace_s=1.0)
    if profiler:
        profiler.disable()
        profiler.dump_stats(args.profile_out)
    del pb


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _role_client(args: argparse.Namespace) -> None:
    from geoloco.protos import geoloco_pb2 as pb
    from geoloco.protos import geoloco_pb2_grpc as pb_grpc
    from geoloco.protos.transport_endpoints import client_channel, coordinator_stub, wait_for_channel
    from geoloco.protos.transport_tls import TLSFiles
    from geoloco.protos.wire_chunks import as_messages, upload_requests
    from geoloco.protos.wire_manifests import blob_manifest

    insecure = args.tls_dir is None
    tls = None if insecure else TLSFiles.from_dir(args.tls_dir, _SITE)
    channel = client_channel(f"localhost:{args.port}", tls=tls, insecure=insecure)
    wait_for_channel(channel, 30)
    if args.path == "fast":
        stub = coordinator_stub(channel)
    else:
        stub = pb_grpc.CoordinatorStub(channel)
    data = _payload(args.size)
    results = []
    profiler = cProfile.Profile() if args.profile_out else None
    for name in args.chunks.split(","):
        chunk_size = CHUNK_SIZES[name]
        t0 = time.perf_counter()
        blob = blob_manifest(data, chunk_size=chunk_size)
        checksum_s = time.perf_counter() - t0
        manifest = pb.UploadManifest(site=_SITE if insecure else "", round=1, blob=blob)
        best = float("inf")
        client_cpu, server_cpu = [], []
        for repeat in range(args.repeats):
            manifest.round = repeat + 1
            requests = upload_requests(manifest, data)
            if args.path != "fast":
                requests = as_messages(requests, pb.UploadRequest)
            if profiler:
                profiler.enable()
            cpu0 = _cpu_seconds()
            t0 = time.perf_counter()
            response, call = stub.Upload.with_call(requests, timeout=600)
            elapsed = time.perf_counter() - t0
            client_cpu.append(_cpu_seconds() - cpu0)
            if profiler:
                profiler.disable()
            if not response.complete:
                raise RuntimeError(f"upload incomplete: {response}")
            trailing = dict(call.trailing_metadata() or ())
            server_cpu.append(float(trailing.get("bench-cpu-s", "nan")))
            best = min(best, elapsed)
        results.append(
            {
                "chunk": name,
                "seconds": best,
                "checksum_s": checksum_s,
                "client_cpu_s": sorted(client_cpu)[len(client_cpu) // 2],
                "server_cpu_s": sorted(server_cpu)[len(server_cpu) // 2],
            }
        )
    if profiler:
        profiler.dump_stats(args.profile_out)
    print(json.dumps(results), flush=True)


def _role_raw_server(args: argparse.Namespace) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    buffer = memoryview(bytearray(args.size))
    for _ in range(args.repeats):
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
    best = float("inf")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        with socket.create_connection(("127.0.0.1", args.port)) as conn:
            for offset in range(0, args.size, 4 * MiB):
                conn.sendall(data[offset : offset + 4 * MiB])
            if conn.recv(1) != b"k":
                raise ConnectionError("raw receiver did not acknowledge")
        best = min(best, time.perf_counter() - t0)
    print(json.dumps([{"chunk": "-", "seconds": best, "checksum_s": 0.0}]), flush=True)
    del args


# --- driver ----------------------------------------------------------------------------------


def _spawn(role: str, env: dict[str, str], *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, "--role", role, *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _pair(
    server_role: str,
    client_role: str,
    env: dict[str, str],
    common: list[str],
    client_extra: list[str],
    server_extra: list[str] = (),
) -> list[dict]:
    server = _spawn(server_role, env, *common, *server_extra)
    try:
        port = server.stdout.readline().strip()
        if not port:
            raise RuntimeError(f"{server_role} did not start")
        client = subprocess.run(
            [
                sys.executable,
                __file__,
                "--role",
                client_role,
                "--port",
                port,
                *common,
                *client_extra,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
        )
        if client.returncode != 0:
            raise RuntimeError(f"{client_role} failed:\n{client.stderr}")
        return json.loads(client.stdout.strip().splitlines()[-1])
    finally:
        if server.stdin:
            server.stdin.close()
        server.wait(timeout=60)


def _environments(which: str) -> dict[str, dict[str, str]]:
    from geoloco.protos.transport_malloc import recommended_env

    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    plain["GEOLOCO_NO_MALLOC_REEXEC"] = "1"
    envs = {"off": plain, "on": recommended_env(plain)}
    return envs if which == "both" else {which: envs[which]}


def _make_certs(directory: Path) -> None:
    from geoloco.scenarios import certs

    certs.init_ca(directory)
    certs.issue_coordinator(directory)
    certs.issue_site(directory, _SITE)


def _print_profile(path: str, title: str, limit: int = 14) -> None:
    out = io.StringIO()
    stats = pstats.Stats(path, stream=out)
    stats.strip_dirs().sort_stats("tottime").print_stats(limit)
    print(f"\n### {title} (cProfile, sorted by own time)\n\n```")
    lines = out.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    print("\n".join(lines[max(0, start - 2) : start + limit + 1]))
    print("```")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tls-dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--profile-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--size-mib", type=int, default=256, help="update size (default 256)")
    parser.add_argument("--chunks", default=",".join(CHUNK_SIZES), help="chunk sizes to try")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell; best is kept")
    parser.add_argument("--tls", choices=["both", "on", "off"], default="both")
    parser.add_argument(
        "--path",
        default="fast,protobuf",
        help="code paths: 'fast' (transport_endpoints.coordinator_stub / add_coordinator_servicer, "
        "chunks as wire_chunks.ChunkRef) and/or 'protobuf' (generated stub and registration, chunks "
        "as protobuf messages)",
    )
    parser.add_argument("--malloc", choices=["both", "on", "off"], default="both")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile one plain-text 1 MiB configuration (both processes) instead of the table",
    )
    args = parser.parse_args()
    args.size = args.size_mib * MiB
    for path in args.path.split(","):
        if path not in ("fast", "protobuf"):
            parser.error(f"unknown --path {path!r}; use fast and/or protobuf")
    roles = {
        "server": _role_server,
        "client": _role_client,
        "raw-server": _role_raw_server,
        "raw-client": _role_raw_client,
    }
    if args.role != "driver":
        roles[args.role](args)
        return

    common = ["--size-mib", str(args.size_mib), "--repeats", str(args.repeats)]
    with tempfile.TemporaryDirectory(prefix="geoloco-bench-") as tmp:
        if args.profile:
            env = _environments(args.malloc if args.malloc != "both" else "on")
            ((label, env),) = list(env.items())[:1]
            server_prof, client_prof = f"{tmp}/server.prof", f"{tmp}/client.prof"
            path = ["--path", args.path.split(",")[0]]
            _pair(
                "server",
                "client",
                env,
                common + path,
                ["--chunks", "1MiB", "--profile-out", client_prof],
                ["--profile-out", server_prof],
            )
            _print_profile(client_prof, f"site (client), malloc tunables {label}")
            _print_profile(server_prof, f"coordinator (server), malloc tunables {label}")
            return
        pki = Path(tmp) / "pki"
        _make_certs(pki)
        rows = []
        checksum_s: list[float] = []
        for malloc, env in _environments(args.malloc).items():
            raw = _pair("raw-server", "raw-client", env, common, [])[0]
            raw_rate = args.size / raw["seconds"] / 1e6
            rows.append(("raw TCP socket", "-", malloc, "-", raw_rate, 1.0, None))
            for path in args.path.split(","):
                for tls in ["off", "on"] if args.tls == "both" else [args.tls]:
                    tls_args = ["--tls-dir", str(pki)] if tls == "on" else []
                    results = _pair(
                        "server",
                        "client",
                        env,
                        common + tls_args + ["--path", path],
                        ["--chunks", args.chunks],
                    )
                    for r in results:
                        rate = args.size / r["seconds"] / 1e6
                        name = "gRPC + TLS" if tls == "on" else "gRPC plain text"
                        gib = args.size / (1 << 30)
                        cpu = (r["client_cpu_s"] / gib, r["server_cpu_s"] / gib)
                        rows.append((name, path, malloc, r["chunk"], rate, rate / raw_rate, cpu))
                        checksum_s.append(r["checksum_s"])
    print(
        f"\nUpload of {args.size_mib} MiB over loopback, best of {args.repeats}, "
        f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}\n"
    )
    print(
        "| transport | path | malloc tunables | chunk | MB/s | x raw socket "
        "| CPU s/GiB site | CPU s/GiB coordinator |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|")
    for name, path, malloc, chunk, rate, ratio, cpu in rows:
        cpu_text = "- | -" if cpu is None else f"{cpu[0]:.2f} | {cpu[1]:.2f}"
        print(f"| {name} | {path} | {malloc} | {chunk} | {rate:,.0f} | {ratio:.2f} | {cpu_text} |")
    if checksum_s:
        median = sorted(checksum_s)[len(checksum_s) // 2]
        print(
            f"\nThe site's CRC-32 of the update (outside the timed call; the coordinator's is "
            f"inside, overlapped with receiving): median {median:.3f} s"
        )


if __name__ == "__main__":
    main()

"""Round times of a 3-site run, quiet and under a flood of idle Upload streams, side by side.

    python benchmarks/bench_flood.py [--flood 300] [--rounds 8] [--inner-steps 400]

A coordinator with mutual TLS and ``allowed_sites = ["0", "1", "2"]`` runs the built-in MLP
workload with three site agents (threads of this process, as in the integration tests). The
flooded run first starts a second process holding a certificate from the same CA that is *not*
in ``allowed_sites`` ("intruder"); it keeps ``--flood`` Upload streams open that never send a
byte (spread over ten connections), opening a new one ``--reopen-s`` after each ends. The
coordinator's default thread pool has ``4 x 64 + 8 = 264`` workers, so before admission control
a few hundred such streams took every thread and the sites' heartbeats timed out.

Printed: each round's ``round_time_s`` (from the coordinator's metrics records) quiet and flooded
with their ratio, the medians, sites dropped, how the sites' heartbeats ended, and how the flood's
streams ended (status codes). A run that does not finish within ``--timeout`` is reported as
stalled. Writes ``results/flood.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SITES = ("0", "1", "2")


def flood_worker(port: int, certs: Path, count: int, reopen_s: float, connections: int) -> None:
    """The flooding process: ``count`` idle Upload streams, re-opened as they end, until stdin
    closes. asyncio gRPC, so the flood costs this process no thread per stream: on a shared
    machine its own CPU use would otherwise weigh on the coordinator's round times."""
    import asyncio

    import grpc
    import grpc.aio

    from geoloco.protos import geoloco_pb2 as pb
    from geoloco.protos.transport_options import CHANNEL_OPTIONS, SERVICE_NAME
    from geoloco.protos.transport_tls import TLSFiles

    ca, cert, key = TLSFiles.from_dir(certs, "intruder").read()
    ended: Counter[str] = Counter()
    opened = 0

    async def flood() -> None:
        nonlocal opened
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(stop.set)), daemon=True).start()
        credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        channels = [
            grpc.aio.secure_channel(f"localhost:{port}", credentials, options=list(CHANNEL_OPTIONS))
            for _ in range(connections)
        ]
        uploads = [
            channel.stream_unary(
                f"/{SERVICE_NAME}/Upload",
                request_serializer=pb.UploadRequest.SerializeToString,
                response_deserializer=pb.UploadResponse.FromString,
            )
            for channel in channels
        ]

        async def idle() -> Any:
            await stop.wait()
            return
            yield

        async def slot(i: int) -> None:
            nonlocal opened
            while not stop.is_set():
                opened += 1
                try:  # the idle stream half-closes once ``stop`` is set, so every call ends
                    await uploads[i % connections](idle(), timeout=3600)
                    ended["OK"] += 1
                except grpc.RpcError as error:
                    ended[error.code().name] += 1
                if not stop.is_set():
                    await asyncio.sleep(reopen_s)

        print("flooding", flush=True)
        await asyncio.gather(*(slot(i) for i in range(count)))
        for channel in channels:
            await channel.close()

    asyncio.run(flood())
    print(json.dumps({"opened": opened, "ended": dict(ended)}), flush=True)


def run(certs: Path, *, flood: int, rounds: int, inner_steps: int, reopen_s: float, timeout_s: float) -> dict[str, Any]:
    """One 3-site run, flooded when ``flood`` > 0."""
    import grpc

    from geoloco.algorithms.optimizers import InnerOptimizerConfig
    from geoloco.algorithms.params import ParamLayout
    from geoloco.algorithms.record import RoundRecord
    from geoloco.algorithms.strategy import AlgorithmConfig
    from geoloco.coordinator import events as ev
    from geoloco.coordinator.config import CoordinatorConfig
    from geoloco.coordinator.server import CoordinatorServer
    from geoloco.protos.transport_tls import TLSFiles
    from geoloco.scenarios.workloads import build_workload
    from geoloco.site_agent.agent import SiteAgent
    from geoloco.site_agent.config import SiteAgentConfig

    workload = build_workload("mlp")
    inner = InnerOptimizerConfig(lr=3e-3)
    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(inner_steps=inner_steps),
        inner_optimizer=inner,
        certs_dir=str(certs),
        allowed_sites=list(SITES),
        min_sites=len(SITES),
        total_rounds=rounds,
    )
    model = workload.build_model(0)
    layout = ParamLayout.from_model(model)
    records: list[RoundRecord] = []
    server = CoordinatorServer(config, layout.flatten(model), layout, on_round_end=records.append)
    seen: Counter[str] = Counter()
    server.rounds.events.add_listener(
        lambda e: seen.update([f"{e.kind}:{e.data.get('code', '')}" if e.kind == ev.REQUEST_REJECTED else e.kind])
    )
    port = server.start()
    flooder = None
    if flood:
        flooder = subprocess.Popen(
            [sys.executable, __file__, "--flood-worker", "--port", str(port), "--certs", str(certs),
             "--flood", str(flood), "--reopen-s", str(reopen_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert flooder.stdout is not None and flooder.stdout.readline().strip() == "flooding"
        time.sleep(3.0)  # let the flood build up before the sites arrive

    heartbeats: Counter[str] = Counter()

    class CountHeartbeats(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
        """Tallies how the sites' heartbeats end (OK, DEADLINE_EXCEEDED...)."""

        def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
            outcome = continuation(details, request)
            if details.method.endswith("/Heartbeat"):
                heartbeats[outcome.code().name] += 1
            return outcome

    agents: list[SiteAgent] = []
    threads: list[threading.Thread] = []
    for index, name in enumerate(SITES):
        site_model = workload.build_model(0)
        agent = SiteAgent(
            site_model, inner.build(site_model.parameters()),
            workload.site_batches(index, len(SITES), 0), workload.loss,
            coordinator=f"localhost:{port}", site=name, tls=TLSFiles.from_dir(certs, name),
            config=SiteAgentConfig(device="cpu", backoff_initial_s=0.05, backoff_max_s=0.5),
            interceptors=[CountHeartbeats()],
        )
        agents.append(agent)
        threads.append(threading.Thread(target=agent.run, name=f"site-{name}", daemon=True))
    started = time.monotonic()
    for thread in threads:
        thread.start()
    finished = server.wait_until_finished(timeout=timeout_s)
    elapsed = time.monotonic() - started
    for agent in agents:
        agent.stop()
    for thread in threads:
        thread.join(10)
    flood_report: dict[str, Any] = {}
    if flooder is not None:
        assert flooder.stdin is not None and flooder.stdout is not None
        flooder.stdin.close()
        flood_report = json.loads(flooder.stdout.readline() or "{}")
        flooder.wait(30)
    server.stop(grace=0.5)
    return {
        "flood": flood,
        "finished": finished,
        "elapsed_s": elapsed,
        "round_times_s": [r.round_time_s for r in records],
        "contributors": [len(r.participants) for r in records],
        "sites_dropped": seen[ev.SITE_DROPPED],
        "rejected": {k.split(":", 1)[1]: v for k, v in seen.items() if k.startswith(ev.REQUEST_REJECTED)},
        "heartbeats": dict(heartbeats),
        "flooder": flood_report,
    }


def _fmt(value: float | None) -> str:
    return "  -   " if value is None else f"{value:6.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flood", type=int, default=300, help="idle Upload streams kept open")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=400)
    parser.add_argument("--reopen-s", type=float, default=1.0, help="delay before re-opening a refused stream")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds before a run counts as stalled")
    parser.add_argument("--flood-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--certs", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.flood_worker:
        flood_worker(args.port, args.certs, args.flood, args.reopen_s, connections=10)
        return

    from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_site

    with tempfile.TemporaryDirectory() as tmp:
        certs = Path(tmp)
        init_ca(certs)
        issue_coordinator(certs)
        for name in (*SITES, "intruder"):
            issue_site(certs, name)
        kw = {
            "rounds": args.rounds, "inner_steps": args.inner_steps, "reopen_s": args.reopen_s,
            "timeout_s": args.timeout,
        }
        quiet = run(certs, flood=0, **kw)
        flooded = run(certs, flood=args.flood, **kw)

    print(f"3 sites, MLP, H={args.inner_steps}, {args.rounds} rounds; flood: {args.flood} idle Upload streams "
          f"from an unlisted certificate, re-opened {args.reopen_s:g} s after each ends")
    print(f"{'round':>5} | {'quiet s':>7} | {'flooded s':>9} | {'flooded/quiet':>13}")
    q_times, f_times = quiet["round_times_s"], flooded["round_times_s"]
    for i in range(max(len(q_times), len(f_times))):
        q = q_times[i] if i < len(q_times) else None
        f = f_times[i] if i < len(f_times) else None
        ratio = f"{f / q:13.2f}" if q and f is not None else f"{'-':>13}"
        print(f"{i:>5} | {_fmt(q):>7} | {_fmt(f):>9} | {ratio}")
    q_med = statistics.median(q_times) if q_times else None
    f_med = statistics.median(f_times) if f_times else None
    ratio = f"{f_med / q_med:.2f}" if q_med and f_med is not None else "-"
    print(f"median | {_fmt(q_med):>7} | {_fmt(f_med):>9} | {ratio:>13}")
    for label, result in (("quiet", quiet), ("flooded", flooded)):
        print(
            f"{label}: finished={result['finished']} in {result['elapsed_s']:.1f} s, "
            f"rounds={len(result['round_times_s'])}, "
            f"contributors per round={result['contributors']}, sites dropped={result['sites_dropped']}, "
            f"heartbeats={result['heartbeats']}, rejected={result['rejected'] or 0}"
        )
    print(f"flood streams: {flooded['flooder']}")
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "flood.json").write_text(json.dumps(
        {"args": vars(args) | {"certs": None}, "platform": platform.platform(), "quiet": quiet, "flooded": flooded},
        indent=2, default=str,
    ))


if __name__ == "__main__":
    main()

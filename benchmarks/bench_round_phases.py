"""Where a big model's round goes: whole rounds beside a raw TCP transfer, phase by phase.

A coordinator process (``CoordinatorServer``, checkpoints on, as deployed) and ``--sites`` site
processes (``SiteAgent``, one each) run ``--rounds`` FedAvg/DiLoCo rounds of a 64M-parameter
(256 MiB fp32) model, laid out as 16 tensors, over loopback with mutual TLS (or plain text:
``--plain``); the inner step is trivial (one SGD step
on a loss that touches a few weights), so what is measured is the round's fixed cost: pseudo-
gradient, encoding, upload, verification, aggregation, outer step, downlink, checkpoint,
broadcast, apply and digest. In the same run two plain processes move the same bytes up and
down raw TCP sockets (the upload's size up, the broadcast's size down, one connection per site,
all at once), the floor for this machine; the ratio says how far above it a round is, beside
the issue's target (3x with one site, 4x with more).

Reported per uplink/downlink codec (``none`` and ``int8``):

* the whole round as the site sees it (``RoundResult.round_time_s``: from the start of training
  to the broadcast applied), median over the rounds after the first;
* the raw TCP up-and-down time of the same bytes, and the ratio;
* the last round's phase breakdown from ``metrics.jsonl`` (coordinator ``phases_s`` and
  ``round_wall_s``; the site's phases, whose transfers are of the round before);
* peak RSS (``ru_maxrss``) of the coordinator and of the largest site process, each beside its
  target: coordinator 3x the fp32 model + the compressed uploads in flight (sites x upload)
  + 300 MB; site the weights + the global copy + the inner optimizer state (none: SGD) + one
  residual (a lossy uplink's error feedback) + 300 MB.

    python benchmarks/bench_round_phases.py                     # both codecs, 3 rounds
    python benchmarks/bench_round_phases.py --codecs int8 --numel 16000000
    python benchmarks/bench_round_phases.py --sites 4 --rounds 2
    python benchmarks/bench_round_phases.py --plain              # no TLS

Needs about 3 GB for each process at 64M parameters (site ~0.5 GB + 5x the model, coordinator
~0.6 GB + 8x the model with dense uploads).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
MB = 1_000_000
TENSORS = 16
_OVERHEAD_MB = 300
_LOSSLESS = ("none",)
_SITE = "0"  # the first site's name (bench_site_memory.py runs this one alone)


def _site_file(site: str) -> str:
    """Where a site process leaves its results (``site.json`` for the first, as before)."""
    return "site.json" if site == _SITE else f"site-{site}.json"


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _model(numel: int, seed: int) -> Any:
    import torch
    from torch import nn

    class Stack(nn.Module):
        """``TENSORS`` equal flat tensors, like a stack of layers."""

        def __init__(self) -> None:
            super().__init__()
            generator = torch.Generator().manual_seed(seed)
            size = numel // TENSORS
            self.layers = nn.ParameterList(
                nn.Parameter(torch.randn(size, generator=generator) * 0.02) for _ in range(TENSORS)
            )

    return Stack()


def _loss(model: Any, batch: Any) -> Any:
    return (model.layers[0][: batch.numel()] * batch).sum()


# --- roles (each runs in its own process) ----------------------------------------------------


def _role_coordinator(args: argparse.Namespace) -> None:
    from geoloco.algorithms.optimizers import InnerOptimizerConfig
    from geoloco.algorithms.params import ParamLayout
    from geoloco.algorithms.strategy import AlgorithmConfig
    from geoloco.coordinator.config import CoordinatorConfig
    from geoloco.coordinator.server import CoordinatorServer

    out = Path(args.out)
    model = _model(args.numel, 0)
    layout = ParamLayout.from_model(model)
    flat = layout.flatten(model)
    del model
    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(inner_steps=1, uplink_codec=args.codec, downlink_codec=args.codec),
        inner_optimizer=InnerOptimizerConfig(lr=1e-3),
        total_rounds=args.rounds, min_sites=args.sites,
        certs_dir=None if args.plain else args.certs, insecure=args.plain,
        checkpoint_dir=str(out / "checkpoints"), metrics_path=str(out / "metrics.jsonl"),
        checkpoint_every=args.checkpoint_every, device=args.device,
    )
    server = CoordinatorServer(config, flat, layout)
    del flat
    serve_run(server, out, args.timeout)


def serve_run(server: Any, out: Path, timeout: float) -> None:
    """Serve a started-to-be coordinator until its run finished and its sites left; write its
    port to ``out/port`` first and its peak RSS to ``out/coordinator.json`` last."""
    server.start()
    (out / "port").write_text(str(server.port))
    try:
        if not server.wait_until_finished(timeout):
            raise SystemExit("the run did not finish in time")
        deadline = time.monotonic() + 60
        while server.rounds.members and time.monotonic() < deadline:
            time.sleep(0.1)  # let the sites take the last broadcast and leave
    finally:
        server.stop(grace=1.0)
    (out / "coordinator.json").write_text(json.dumps({"peak_rss_mib": _peak_rss_mib()}))


def _role_site(args: argparse.Namespace) -> None:
    import torch

    from geoloco.protos.transport_tls import TLSFiles
    from geoloco.site_agent.agent import SiteAgent
    from geoloco.site_agent.config import RoundResult, SiteAgentConfig, SiteHooks

    out = Path(args.out)
    site = getattr(args, "site", _SITE)
    plain = bool(getattr(args, "plain", False))
    model = _model(args.numel, 0)
    results: list[RoundResult] = []
    agent = SiteAgent(
        model, torch.optim.SGD(model.parameters(), lr=1e-3), itertools.repeat(torch.ones(8)), _loss,
        coordinator=f"localhost:{args.port}", site=site,
        tls=None if plain else TLSFiles.from_dir(Path(args.certs), site), insecure=plain,
        config=SiteAgentConfig(device=getattr(args, "device", "cpu")), hooks=SiteHooks(on_round_end=results.append),
    )
    agent.run()
    (out / _site_file(site)).write_text(json.dumps({
        "peak_rss_mib": _peak_rss_mib(),
        "round_time_s": [r.round_time_s for r in results],
        "bytes_up": [r.bytes_up for r in results],
        "bytes_down": [r.bytes_down for r in results],
    }))


def _role_echo(args: argparse.Namespace) -> None:
    """Raw TCP peer: receive ``--up`` bytes, then send ``--down`` bytes back."""
    listener = socket.create_server(("127.0.0.1", 0))
    Path(args.out).write_text(str(listener.getsockname()[1]))
    conn, _ = listener.accept()
    with conn:
        buffer = bytearray(MiB)
        left = args.up
        while left:
            got = conn.recv_into(buffer, min(len(buffer), left))
            if not got:
                raise SystemExit("raw TCP sender closed early")
            left -= got
        conn.sendall(bytes(args.down))


# --- driver ----------------------------------------------------------------------------------


def _spawn(role: str, *extra: str) -> subprocess.Popen[bytes]:
    from geoloco.protos.transport_malloc import recommended_env

    env = {**os.environ, **recommended_env()}
    return subprocess.Popen([sys.executable, __file__, "--role", role, *extra], env=env)


def _wait_file(path: Path, process: subprocess.Popen[bytes], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists() or not path.read_text():
        if process.poll() is not None:
            raise SystemExit(f"{process.args} exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.05)
    return path.read_text()


def _raw_tcp_s(up: int, down: int, work: Path, connections: int = 1) -> float:
    """Seconds for ``connections`` sockets at once each to send ``up`` bytes to another process
    and receive ``down`` bytes back: the bytes of a round with that many sites, moved raw."""
    echoes = []
    for index in range(connections):
        port_file = work / f"echo-port-{index}"
        echo = _spawn("echo", "--out", str(port_file), "--up", str(up), "--down", str(down))
        echoes.append((echo, int(_wait_file(port_file, echo, 60))))
    payload = bytearray(os.urandom(MiB)) * (up // MiB + 1)
    view = memoryview(payload)[:up]
    conns = [socket.create_connection(("127.0.0.1", port)) for _, port in echoes]

    def move(conn: socket.socket) -> None:
        buffer = bytearray(MiB)
        conn.sendall(view)
        left = down
        while left:
            got = conn.recv_into(buffer, min(len(buffer), left))
            if not got:
                raise SystemExit("raw TCP peer closed early")
            left -= got

    try:
        start = time.perf_counter()
        threads = [threading.Thread(target=move, args=(conn,)) for conn in conns]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - start
    finally:
        for conn in conns:
            conn.close()
    for echo, _ in echoes:
        echo.wait(30)
    return elapsed


def _run_codec(codec: str, args: argparse.Namespace, certs: Path, work: Path) -> dict[str, Any]:
    out = work / codec
    out.mkdir()
    common = ["--codec", codec, "--numel", str(args.numel), "--rounds", str(args.rounds),
              "--certs", str(certs), "--out", str(out), "--timeout", str(args.timeout),
              "--sites", str(args.sites), "--device", args.device, "--checkpoint-every", str(args.checkpoint_every),
              *(["--plain"] if args.plain else [])]
    coordinator = _spawn("coordinator", *common)
    port = _wait_file(out / "port", coordinator, 300)
    sites = [_spawn("site", *common, "--port", port, "--site", str(i)) for i in range(args.sites)]
    for process in (*sites, coordinator):
        if process.wait(args.timeout) != 0:
            raise SystemExit(f"{process.args} exited with {process.returncode}")
    from geoloco.coordinator.metrics import read_metrics

    records = read_metrics(out / "metrics.jsonl")
    site_results = {str(i): json.loads((out / _site_file(str(i))).read_text()) for i in range(args.sites)}
    coordinator_result = json.loads((out / "coordinator.json").read_text())
    up = max(max(r["bytes_up"]) for r in site_results.values())
    down = max(r["downlink_bytes"] for r in records)
    raw_s = _raw_tcp_s(up, down, out, args.sites)
    # A round takes as long as its slowest site: per round, the largest site's time.
    per_round = [max(times) for times in zip(*(r["round_time_s"] for r in site_results.values()))]
    later = per_round[1:] or per_round
    model = 4 * args.numel
    residual = 0 if codec in _LOSSLESS else model
    return {
        "codec": codec,
        "sites": args.sites,
        "plain": args.plain,
        "round_s": statistics.median(later),
        "round_times_s": per_round,
        "raw_tcp_s": raw_s,
        "upload_bytes": up,
        "downlink_bytes": down,
        "coordinator_phases_s": records[-1].get("phases_s", {}),
        "round_wall_s": records[-1].get("round_wall_s") or 0.0,
        "site_phases_s": records[-1].get("site_phases_s", {}),
        "coordinator_peak_rss_mib": coordinator_result["peak_rss_mib"],
        "coordinator_target_mib": (3 * model + args.sites * up + _OVERHEAD_MB * MB) / MiB,
        "site_peak_rss_mib": max(r["peak_rss_mib"] for r in site_results.values()),
        "site_peak_rss_all_mib": [r["peak_rss_mib"] for r in site_results.values()],
        "site_target_mib": (2 * model + residual + _OVERHEAD_MB * MB) / MiB,
    }


def _largest(phases: dict[str, float]) -> str:
    return max(phases, key=lambda k: phases[k]) if phases else "-"


def _report(results: list[dict[str, Any]], numel: int) -> None:
    from geoloco.protos.round_phases import COORDINATOR_PHASES, SITE_PHASES

    model_mib = 4 * numel / MiB
    sites = results[0]["sites"] if results else 1
    target = 3 if sites == 1 else 4
    transport = "plain text" if results and results[0]["plain"] else "mutual TLS"
    print(f"\n{numel:,} parameters ({model_mib:.0f} MiB fp32), {sites} site(s), {transport}, loopback\n")
    print("| codec | round (median) | raw TCP up+down | ratio (target <= "
          f"{target}x) | upload | downlink | coordinator peak RSS / target | site peak RSS / target |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        ratio = r["round_s"] / r["raw_tcp_s"]
        print(
            f"| {r['codec']} | {r['round_s']:.2f} s | {r['raw_tcp_s']:.2f} s "
            f"| {ratio:.1f}x ({'met' if ratio <= target else 'missed'}) "
            f"| {r['upload_bytes'] / MiB:.0f} MiB | {r['downlink_bytes'] / MiB:.0f} MiB "
            f"| {r['coordinator_peak_rss_mib']:.0f} / {r['coordinator_target_mib']:.0f} MiB "
            f"({r['coordinator_peak_rss_mib'] / r['coordinator_target_mib']:.2f}) "
            f"| {r['site_peak_rss_mib']:.0f} / {r['site_target_mib']:.0f} MiB "
            f"({r['site_peak_rss_mib'] / r['site_target_mib']:.2f}) |"
        )
    for r in results:
        print(f"\nlast round, codec {r['codec']} (all rounds, slowest site's view: "
              f"{', '.join(f'{t:.2f}' for t in r['round_times_s'])} s)")
        phases = r["coordinator_phases_s"]
        print("  coordinator: " + ", ".join(f"{k} {phases.get(k, 0.0):.2f}" for k in COORDINATOR_PHASES)
              + f"; wall {r['round_wall_s']:.2f} s (other: waiting for the sites "
              f"{r['round_wall_s'] - sum(phases.values()):.2f}); largest: {_largest(phases)}")
        for name, site in sorted(r["site_phases_s"].items()):
            print(f"  site {name}: " + ", ".join(f"{k} {site[k]:.2f}" for k in SITE_PHASES if k in site)
                  + f" s (upload..verify: the round before); largest: {_largest(site)}")
    print("\n" + json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["coordinator", "site", "echo"])
    parser.add_argument("--codecs", default="none,int8", help="comma-separated uplink=downlink codecs")
    parser.add_argument("--codec", default="none")
    parser.add_argument("--numel", type=int, default=64 * MiB, help="model parameters (64Mi: 256 MiB fp32)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--certs")
    parser.add_argument("--out")
    parser.add_argument("--port")
    parser.add_argument("--sites", type=int, default=1, help="site processes, one site each")
    parser.add_argument("--site", default=_SITE, help=argparse.SUPPRESS)
    parser.add_argument("--plain", action="store_true", help="plain text instead of mutual TLS")
    parser.add_argument("--device", default="cpu", help="where the coordinator and sites compute (cpu, cuda)")
    parser.add_argument(
        "--checkpoint-every", type=int, default=1,
        help="the coordinator's checkpoint_every (a full checkpoint every this many rounds; the round log between)",
    )
    parser.add_argument("--up", type=int, default=0)
    parser.add_argument("--down", type=int, default=0)
    args = parser.parse_args()
    if args.role is not None:
        {"coordinator": _role_coordinator, "site": _role_site, "echo": _role_echo}[args.role](args)
        return
    if args.numel % TENSORS:
        raise SystemExit(f"--numel must be a multiple of {TENSORS}")
    from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_site

    with tempfile.TemporaryDirectory(prefix="geoloco-round-phases-") as tmp:
        work = Path(tmp)
        certs = work / "certs"
        init_ca(certs)
        issue_coordinator(certs)
        for index in range(args.sites):
            issue_site(certs, str(index))
        results = [_run_codec(codec, args, certs, work) for codec in args.codecs.split(",")]
    _report(results, args.numel)


if __name__ == "__main__":
    main()

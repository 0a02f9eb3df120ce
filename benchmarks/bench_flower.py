"""The same FedAvg round in Flower and in geoloco, alternated in one run, beside raw TCP.

    python -m venv /tmp/flwr-venv && /tmp/flwr-venv/bin/pip install torch==2.13.0 flwr==1.42.0
    python benchmarks/bench_flower.py --flower-python /tmp/flwr-venv/bin/python [--sites 1,4]

Flower gets its own virtual environment: flwr 1.42 pins a protobuf that geoloco's does not
accept, so the two never share an interpreter; each side runs in its own processes anyway.

Per number of sites N, ``--pairs`` pairs alternate geoloco and Flower (A B A B ...):

* **geoloco**: ``bench_round_phases.py`` with ``--plain`` (no TLS, as Flower's side), codec
  ``none`` both ways, N site processes, the median of the rounds after the first as the slowest
  site sees them (broadcast to broadcast), and the raw-TCP time of the same bytes in that run;
* **Flower**: a Flower 1.42 server (``start_server``, FedAvg, ``min_fit_clients = N``, no
  evaluation) and N client processes (``start_client``, a ``NumPyClient`` that returns its
  parameters as trained: one SGD step as in geoloco's bench), the same model (``TENSORS`` float32
  arrays, ``--numel`` values in all), insecure gRPC; the median of the times between two
  ``aggregate_fit`` ends, rounds after the first.

Both train one step on the same tiny batch: the rounds measure moving and handling 4 bytes per
parameter each way, not training. Prints a table of medians and the ratio Flower / geoloco.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TENSORS = 16


# --- Flower side (runs under --flower-python) ---------------------------------------------------


def _arrays(numel: int) -> list[Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    size = numel // TENSORS
    return [(rng.standard_normal(size, dtype=np.float32) * 0.02) for _ in range(TENSORS)]


def _role_flower_server(args: argparse.Namespace) -> None:
    import flwr as fl
    from flwr.common import ndarrays_to_parameters

    ends: list[float] = []

    class Timed(fl.server.strategy.FedAvg):
        def aggregate_fit(self, server_round: int, results: Any, failures: Any) -> Any:  # type: ignore[no-untyped-def]
            out = super().aggregate_fit(server_round, results, failures)
            ends.append(time.perf_counter())
            return out

    strategy = Timed(
        fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=args.sites, min_available_clients=args.sites,
        initial_parameters=ndarrays_to_parameters(_arrays(args.numel)),
    )
    fl.server.start_server(
        server_address=f"127.0.0.1:{args.port}", config=fl.server.ServerConfig(num_rounds=args.rounds),
        strategy=strategy, grpc_max_message_length=2**31 - 1,
    )
    rounds = [b - a for a, b in itertools.pairwise(ends)]
    Path(args.out).write_text(json.dumps({"round_times_s": rounds}))


def _role_flower_client(args: argparse.Namespace) -> None:
    import flwr as fl
    import numpy as np

    class Client(fl.client.NumPyClient):
        def fit(self, parameters: Any, config: Any) -> Any:  # type: ignore[no-untyped-def]
            batch = np.ones(8, dtype=np.float32)
            trained = [p.copy() for p in parameters]
            trained[0][:8] -= 1e-3 * batch  # one SGD step of geoloco's bench loss on the same batch
            return trained, 1, {}

    fl.client.start_client(
        server_address=f"127.0.0.1:{args.port}", client=Client().to_client(), grpc_max_message_length=2**31 - 1,
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _flower_round(flower_python: str, sites: int, numel: int, rounds: int, work: Path) -> float:
    port = _free_port()
    out = work / f"flower-{sites}-{time.monotonic_ns()}.json"
    common = ["--numel", str(numel), "--port", str(port), "--sites", str(sites), "--rounds", str(rounds)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    server = subprocess.Popen(
        [flower_python, __file__, "--role", "flower-server", "--out", str(out), *common],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    clients: list[subprocess.Popen[bytes]] = []
    try:
        time.sleep(3.0)  # the server binds before the clients dial (they retry, but not for long)
        clients = [
            subprocess.Popen([flower_python, __file__, "--role", "flower-client", *common], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(sites)
        ]
        if server.wait(1800) != 0:
            raise SystemExit(f"the Flower server exited with {server.returncode}")
        for client in clients:
            client.wait(120)
    finally:
        for process in (server, *clients):
            if process.poll() is None:
                process.kill()
    times = json.loads(out.read_text())["round_times_s"]
    return statistics.median(times)


def _geoloco_round(sites: int, numel: int, rounds: int) -> tuple[float, float]:
    result = subprocess.run(
        [sys.executable, str(HERE / "bench_round_phases.py"), "--plain", "--codecs", "none", "--numel", str(numel),
         "--rounds", str(rounds), "--sites", str(sites)],
        capture_output=True, text=True, timeout=1800,
    )
    if result.returncode != 0:
        raise SystemExit(f"bench_round_phases.py failed: {result.stderr[-2000:]}")
    record = json.loads(result.stdout.strip().splitlines()[-1])[0]
    later = record["round_times_s"][1:] or record["round_times_s"]
    return statistics.median(later), record["raw_tcp_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["flower-server", "flower-client"])
    parser.add_argument("--flower-python", help="the interpreter of a venv with flwr 1.42 (see the module doc)")
    parser.add_argument("--sites", default="1,4", help="comma-separated numbers of sites")
    parser.add_argument("--numel", type=int, default=64 * 2**20, help="model parameters (64Mi: 256 MiB fp32)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=2, help="geoloco / Flower pairs per number of sites")
    parser.add_argument("--port", type=int)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.role == "flower-server":
        args.sites = int(args.sites)
        _role_flower_server(args)
        return
    if args.role == "flower-client":
        _role_flower_client(args)
        return
    if not args.flower_python:
        raise SystemExit("--flower-python is required: the interpreter of a venv with flwr 1.42 (module doc)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="geoloco-flower-") as tmp:
        for sites in (int(s) for s in args.sites.split(",")):
            ours, theirs, raw = [], [], []
            for pair in range(args.pairs):
                geoloco_s, raw_s = _geoloco_round(sites, args.numel, args.rounds)
                flower_s = _flower_round(args.flower_python, sites, args.numel, args.rounds, Path(tmp))
                print(f"N={sites} pair {pair + 1}: geoloco {geoloco_s:.2f} s, Flower {flower_s:.2f} s, "
                      f"raw TCP {raw_s:.2f} s", flush=True)
                ours.append(geoloco_s)
                theirs.append(flower_s)
                raw.append(raw_s)
            rows.append((sites, statistics.median(ours), statistics.median(theirs), statistics.median(raw)))
    print(f"\n{args.numel / 2**20:.0f}Mi parameters, codec none, plain text, {args.pairs} pairs, medians; "
          f"load {os.getloadavg()[0]:.1f}\n")
    print("| sites | geoloco round | Flower round | Flower / geoloco | raw TCP | geoloco / raw TCP |")
    print("|---:|---:|---:|---:|---:|---:|")
    for sites, ours_s, theirs_s, raw_s in rows:
        print(f"| {sites} | {ours_s:.2f} s | {theirs_s:.2f} s | {theirs_s / ours_s:.2f}x | {raw_s:.2f} s | "
              f"{ours_s / raw_s:.1f}x |")


if __name__ == "__main__":
    main()

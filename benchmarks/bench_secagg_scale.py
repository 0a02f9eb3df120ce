"""The whole secure-aggregation protocol in one process at hundreds to thousands of sites.

What ``geoloco simulate`` runs for a secure round (``run_round_in_memory``: every site's
``SecAggClient`` and the coordinator's ``SecAggServer``, real X25519, Ed25519, AES-GCM, Shamir
and ChaCha20 masks, not an exact-sum shortcut), timed and sized per stage: the seconds all
parties spent in it together (they run one after another here) and the bytes up (sites to the
coordinator) and down (the coordinator to the sites). One site drops after its upload, so the
unmasking reconstructs a dropped site's masks too. The sum is checked against the exact one.

    python benchmarks/bench_secagg_scale.py                          # 64, 256, 1024 sites, SecAgg+
    python benchmarks/bench_secagg_scale.py --sites 64,256 --graph full
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from geoloco.algorithms.privacy.secagg_crypto import neighbour_graph
from geoloco.algorithms.privacy.secagg_in_memory import StageCost, run_round_in_memory
from geoloco.algorithms.privacy.secagg_messages import RoundContext
from geoloco.scenarios.progress import human_bytes

STAGES = ("advertise_keys", "share_keys", "masked_input", "consistency", "unmask")


def one_round(sites: int, params: int, graph: str) -> tuple[float, dict[str, StageCost], int]:
    context = RoundContext("bench", 0, numel=params, neighbours=graph)  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    inputs = {s: rng.integers(0, 2**32, params, dtype=np.uint32) for s in range(sites)}
    keys = {s: Ed25519PrivateKey.generate() for s in range(sites)}
    stages: dict[str, StageCost] = {}
    started = time.perf_counter()
    total, survivors = run_round_in_memory(context, inputs, keys, drop_after_upload=[1], stages=stages)
    seconds = time.perf_counter() - started
    expected = np.zeros(params, dtype=np.uint64)
    for s in survivors:
        expected += inputs[s]
    if not np.array_equal(total.astype(np.uint64), expected % 2**32):
        raise SystemExit(f"{sites} sites: the secure sum differs from the exact sum")
    degree = max(len(v) for v in neighbour_graph(range(sites), graph, session="bench", round_index=0).values())  # type: ignore[arg-type]
    return seconds, stages, degree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sites", default="64,256,1024", help="comma-separated site counts")
    parser.add_argument("--params", type=int, default=1000, help="values each site sums")
    parser.add_argument("--graph", choices=("secagg+", "full"), default="secagg+")
    args = parser.parse_args()
    counts = [int(x) for x in args.sites.split(",")]
    print(f"One secure round in one process, {args.params} values per site, graph {args.graph}, one site "
          "dropped after its upload; seconds of all parties together, bytes up / down.\n")
    print("| sites | neighbours | round | " + " | ".join(STAGES) + " | up | down | down per site |")
    print("|---:|---:|---:|" + "---:|" * len(STAGES) + "---:|---:|---:|")
    results: list[tuple[int, float]] = []
    for n in counts:
        seconds, stages, degree = one_round(n, args.params, args.graph)
        up = sum(c.bytes_up for c in stages.values())
        down = sum(c.bytes_down for c in stages.values())
        cells = " | ".join(f"{stages[s].seconds:.2f} s" for s in STAGES)
        print(f"| {n} | {degree} | {seconds:.2f} s | {cells} | {human_bytes(up)} | {human_bytes(down)} | "
              f"{human_bytes(down / n)} |", flush=True)
        results.append((n, seconds))
    if len(results) > 1:
        n0, s0 = results[0]
        print(f"\nSeconds per site, relative to {n0} sites (1.00x: linear in the sites): " + ", ".join(
            f"{n}: {(seconds / n) / (s0 / n0):.2f}x" for n, seconds in results
        ))

if __name__ == "__main__":
    main()

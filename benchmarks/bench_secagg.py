"""Secure aggregation cost: mask generation beside the raw ChaCha20 keystream, and round time.

Table 1 — one site of an ``--sites`` round masks a ``--params`` update chunk by chunk
(``SecAggClient.mask_chunk``: one self-mask and one pairwise mask per neighbour, each a ChaCha20
keystream, added in ``Z_{2^32}``). Beside it, the raw keystream of the same cipher for the same
number of bytes in the same process. The ratio says what the masking arithmetic costs on top of
the cipher, which is the floor.

Table 2 — one aggregation round of ``--sites`` sites x ``--params`` fp32 values, in one process
(no network): plain (``UpdateEncoder("none")`` + ``RunningSum``) vs secure
(clip + fixed point + masks + the coordinator's chunked sum and unmasking), all stages timed.
"Per-site critical path" is what a round takes when the sites run in parallel, as in a
deployment: the slowest site's work plus the coordinator's.

Table 3 — the real system: one coordinator (this process) and ``--sites`` site processes
(``SiteAgent``, spawned) over loopback gRPC with mutual TLS, a ``--params`` linear model, one
SGD inner step per round, uplink codec ``none`` and downlink ``int8``. The same run with and
without ``[privacy] secure_aggregation`` (no DP), steady-state seconds per round (time between
consecutive round broadcasts, after ``--warmup-rounds``), ratio printed.

    python benchmarks/bench_secagg.py               # 8 sites, 10M parameters
    python benchmarks/bench_secagg.py --params 1000000 --sites 4   # quick
    python benchmarks/bench_secagg.py --only grpc   # only table 3
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from geoloco.algorithms.aggregation import RunningSum
from geoloco.algorithms.diloco import UpdateEncoder
from geoloco.algorithms.fixed_point import lift
from geoloco.algorithms.privacy.private_aggregation import (
    PrivacyConfig,
    PrivateUpdateEncoder,
    decode_secure_sum,
    plan_secure_round,
)
from geoloco.algorithms.privacy.secagg_client import SecAggClient
from geoloco.algorithms.privacy.secagg_crypto import keystream_into, num_chunks
from geoloco.algorithms.privacy.secagg_server import SecAggServer


def _timed(fn):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _setup(n: int, privacy: PrivacyConfig, numel: int):  # type: ignore[no-untyped-def]
    keys = {s: Ed25519PrivateKey.generate() for s in range(n)}
    identities = {s: k.public_key() for s, k in keys.items()}
    context, fixed = plan_secure_round(privacy, "none", numel=numel, num_sites=n, session="bench", round_index=1)
    clients = {s: SecAggClient(s, context, keys[s], identities) for s in range(n)}
    server = SecAggServer(context)
    for c in clients.values():
        server.receive_advertisement(c.advertise())
    ads = server.advertisements()
    for s, c in clients.items():
        server.receive_shares(s, c.share_keys(ads))
    server.close_share_keys()
    for s, c in clients.items():
        c.receive_shares(server.shares_for(s))
    return context, fixed, clients, server


def mask_table(n: int, numel: int, chunk: int, repeats: int) -> list[str]:
    privacy = PrivacyConfig(secure_aggregation=True, clip_norm=1.0, chunk_size=chunk)
    context, _, clients, _ = _setup(n, privacy, numel)
    client = clients[0]
    values = np.zeros(chunk, dtype=np.int64)
    chunks = num_chunks(numel, chunk)
    masks = 1 + len(client.masking_neighbours)
    total_bytes = masks * numel * 4
    key = b"k" * 32

    def masked() -> None:
        for i in range(chunks):
            start, stop = context.chunk_bounds(i)
            client.mask_chunk(i, values[: stop - start])

    buffer = bytearray(chunk * 4)

    def raw() -> None:
        for i in range(chunks):
            start, stop = context.chunk_bounds(i)
            view = memoryview(buffer)[: (stop - start) * 4]
            for _ in range(masks):
                keystream_into(key, i, view)

    t_raw = min(_timed(raw)[1] for _ in range(repeats))
    t_mask = min(_timed(masked)[1] for _ in range(repeats))
    mb = total_bytes / 1e6
    return [
        f"| what ({n} sites: {masks} keystreams of {numel:,} x 4 B) | seconds | MB/s of keystream | ratio |",
        "|---|---:|---:|---:|",
        f"| raw ChaCha20 keystream (cryptography) | {t_raw:.3f} | {mb / t_raw:,.0f} | 1.00 |",
        f"| SecAggClient.mask_chunk (keystream + Z_2^32 add) | {t_mask:.3f} | {mb / t_mask:,.0f} "
        f"| {t_raw / t_mask:.2f} |",
    ]


def round_table(n: int, numel: int, chunk: int) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    updates = {s: 1e-3 * torch.randn(numel, generator=gen) for s in range(n)}

    # Plain: each site encodes with the lossless codec; the coordinator adds decoded uploads.
    encoders = {s: UpdateEncoder("none") for s in range(n)}
    site_times = []
    uploads = {}
    for s in range(n):
        uploads[s], t = _timed(lambda s=s: encoders[s].encode(updates[s], seed=s).to_bytes())
        site_times.append(t)
    agg = RunningSum(numel=numel)
    from geoloco.compression import Encoded

    def plain_server() -> torch.Tensor:
        for s in range(n):
            agg.add(Encoded.from_bytes(uploads[s]), site=s)
        return agg.result()

    plain_mean, t_plain_server = _timed(plain_server)
    plain = (sum(site_times), max(site_times), t_plain_server)

    privacy = PrivacyConfig(secure_aggregation=True, clip_norm=10.0, chunk_size=chunk)
    (context, fixed, clients, server), t_setup = _timed(lambda: _setup(n, privacy, numel))
    site_times = []
    server_time = 0.0
    penc = {s: PrivateUpdateEncoder(privacy, "none") for s in range(n)}
    for s in range(n):
        start = time.perf_counter()
        blobs = [
            (i, clients[s].mask_chunk(i, ints))
            for i, ints in enumerate(penc[s].encode(updates[s], fixed, context, index_seed=0, num_sites=n))
        ]
        clients[s].finish_upload()
        site_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        for i, blob in blobs:
            server.receive_masked_chunk(s, i, blob)
        server_time += time.perf_counter() - start
        del blobs
    start = time.perf_counter()
    survivors = server.close_upload()
    sigs = {s: clients[s].sign_survivors(1, survivors) for s in survivors}
    for s, sig in sigs.items():
        server.receive_signature(s, sig)
    request = server.unmask_request()
    for s in survivors:
        server.receive_unmask(clients[s].unmask(request))
    total = server.result()
    mean = decode_secure_sum(lift(total, 32), fixed, count=n, numel=numel, uplink_codec="none", index_seed=0)
    server_time += time.perf_counter() - start
    err = (mean - plain_mean).abs().max().item()
    secure = (sum(site_times), max(site_times), server_time)
    crit_plain = plain[1] + plain[2]
    crit_secure = secure[1] + secure[2] + t_setup / n
    return [
        f"| {n} sites x {numel:,} params | all sites' work (s) | per-site critical path (s) | coordinator (s) |",
        "|---|---:|---:|---:|",
        f"| plain (none codec) | {plain[0]:.2f} | {crit_plain:.2f} | {plain[2]:.2f} |",
        f"| secure aggregation | {secure[0]:.2f} | {crit_secure:.2f} | {secure[2]:.2f} |",
        f"| ratio secure / plain | {secure[0] / plain[0]:.1f}x | {crit_secure / crit_plain:.1f}x "
        f"| {secure[2] / plain[2]:.1f}x |",
        "",
        f"key setup (advertise + share keys, all sites): {t_setup:.2f} s; "
        f"max |secure mean - plain mean| = {err:.2e} (fixed-point bound {1 / fixed.scale:.2e})",
    ]


# -- Table 3: round time over loopback gRPC ----------------------------------------------------


def _linear_model(params: int) -> torch.nn.Module:
    """A single linear layer with about ``params`` weights (the round's payload, not the compute)."""
    torch.manual_seed(0)
    width = 1000
    return torch.nn.Linear(width, max(1, params // width), bias=False)


def _site_main(port: int, name: str, certs: str, params: int) -> None:
    """One site process: a SiteAgent that trains one SGD step per round until the run ends."""
    import itertools

    from geoloco.protos.transport_tls import TLSFiles
    from geoloco.site_agent.agent import SiteAgent
    from geoloco.site_agent.config import SiteAgentConfig

    torch.set_num_threads(1)
    model = _linear_model(params)
    batch = torch.randn(4, 1000)
    agent = SiteAgent(
        model, torch.optim.SGD(model.parameters(), lr=1e-3), itertools.repeat(batch),
        lambda m, b: m(b).square().mean(), coordinator=f"localhost:{port}", site=name,
        tls=TLSFiles.from_dir(certs, name), config=SiteAgentConfig(device="cpu"),
    )
    agent.run()


def grpc_round_table(n: int, params: int, chunk: int, rounds: int, warmup: int) -> list[str]:
    import multiprocessing
    import tempfile

    from geoloco.algorithms.params import ParamLayout
    from geoloco.algorithms.strategy import AlgorithmConfig
    from geoloco.coordinator.config import CoordinatorConfig
    from geoloco.coordinator.server import CoordinatorServer
    from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_site

    names = [f"site{i}" for i in range(n)]
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as certs:
        init_ca(certs)
        issue_coordinator(certs)
        for name in names:
            issue_site(certs, name)
        for label, privacy in (
            ("plain", {}),
            ("secure aggregation", {"secure_aggregation": True, "clip_norm": 1e3, "chunk_size": chunk}),
        ):
            model = _linear_model(params)
            layout = ParamLayout.from_model(model)
            config = CoordinatorConfig.from_dict({
                "algorithm": AlgorithmConfig(inner_steps=1, uplink_codec="none", downlink_codec="int8").to_dict(),
                "run": {"rounds": rounds, "min_sites": n}, "certs_dir": certs, "allowed_sites": names,
                "privacy": privacy, "max_sites": 2 * n + 4,
            })
            stamps: list[float] = []
            server = CoordinatorServer(
                config, layout.flatten(model), layout, on_round_end=lambda r: stamps.append(time.perf_counter())
            )
            port = server.start()
            context = multiprocessing.get_context("spawn")
            sites = [context.Process(target=_site_main, args=(port, name, certs, params)) for name in names]
            for site in sites:
                site.start()
            try:
                if not server.wait_until_finished(timeout=1800):
                    raise RuntimeError(f"{label}: the run did not finish within 30 minutes")
            finally:
                for site in sites:
                    site.join(timeout=120)
                    if site.is_alive():
                        site.kill()
                server.stop()
            steady = stamps[warmup:]
            results[label] = (steady[-1] - steady[0]) / (len(steady) - 1)
    plain, secure = results["plain"], results["secure aggregation"]
    return [
        f"| {n} sites x {params:,} params, loopback gRPC + mutual TLS | seconds per round | ratio |",
        "|---|---:|---:|",
        f"| plain (`none` uplink, `int8` downlink) | {plain:.2f} | 1.00 |",
        f"| secure aggregation | {secure:.2f} | {secure / plain:.2f}x (target <= 1.5x) |",
        "",
        f"(steady state: rounds {warmup + 1}..{rounds} of {rounds}; one SGD inner step per round)",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sites", type=int, default=8)
    parser.add_argument("--params", type=int, default=10_000_000)
    parser.add_argument("--chunk", type=int, default=1 << 18)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="rounds per run of table 3")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="rounds of table 3 left out")
    parser.add_argument("--only", choices=("mask", "round", "grpc"), default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.only in (None, "mask"):
        print("\n".join(mask_table(args.sites, args.params, args.chunk, args.repeats)))
        print()
    if args.only in (None, "round"):
        print("\n".join(round_table(args.sites, args.params, args.chunk)))
        print()
    if args.only in (None, "grpc"):
        print("\n".join(grpc_round_table(args.sites, args.params, args.chunk, args.rounds, args.warmup_rounds)))


if __name__ == "__main__":
    main()

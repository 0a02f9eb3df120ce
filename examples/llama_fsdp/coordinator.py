"""The coordinator of the Llama example: starts the run from the same model the sites build.

    python examples/llama_fsdp/coordinator.py --certs certs --sites dc-east --port 7000

It makes the certificates on first use (a private CA, the coordinator's certificate and one per
site named in ``--sites``, in ``--certs``; copy ``ca.crt`` and a site's ``NAME.crt``/``NAME.key``
to that site), serves the run over gRPC with mutual TLS, scores the global weights on held-out
text after every round and writes one JSON line per round to ``--metrics``.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from model import ModelSize, build_model, eval_loss, eval_windows  # model.py, beside this file

from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.server import CoordinatorServer
from geoloco.scenarios.certs import CA_CERT_FILE, init_ca, issue_coordinator, issue_site


def make_certs(certs: Path, sites: list[str], hosts: list[str]) -> None:
    """A CA and the certificates of the coordinator and every site, unless the CA exists."""
    if (certs / CA_CERT_FILE).exists():
        return
    init_ca(certs)
    issue_coordinator(certs, hosts=hosts)  # valid for localhost, 127.0.0.1 and these names
    for name in sites:
        issue_site(certs, name)


def start_coordinator(
    certs: Path, sites: list[str], *, host: str = "127.0.0.1", port: int = 0, rounds: int = 10,
    inner_steps: int = 20, seed: int = 0, metrics: Path | None = None, eval_windows_count: int = 8,
    seq_len: int = 128,
) -> CoordinatorServer:
    """Start serving the run (port 0 picks a free port: read ``server.port``)."""
    model = build_model(ModelSize(), seed=seed)  # θ_0: the sites build the same architecture
    layout = ParamLayout.from_model(model)
    windows = eval_windows(eval_windows_count, seq_len)

    def score(flat_weights: torch.Tensor) -> float:  # the global weights' held-out loss, logged with each round
        layout.load_(model, flat_weights)
        return eval_loss(model, windows)

    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(
            inner_steps=inner_steps,
            uplink_codec="int8",  # 4x smaller uploads; error feedback keeps what rounding lost
            weighting="samples",  # a site weighs by the tokens its ranks trained on
        ),
        total_rounds=rounds,
        min_sites=len(sites),  # wait for every site before the first round
        allowed_sites=sites,
        host=host,
        port=port,
        certs_dir=str(certs),
        metrics_path=None if metrics is None else str(metrics),
    )
    server = CoordinatorServer(config, layout.flatten(model), layout, score)
    server.start()
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--certs", type=Path, default=Path("certs"))
    parser.add_argument("--sites", nargs="+", default=["dc-east"], help="names of the sites that take part")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=7000)
    parser.add_argument("--public-name", action="append", default=[],
                        help="a DNS name or IP address the sites dial (for the coordinator's certificate)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="seeds the run's initial weights")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--metrics", type=Path, default=Path("llama-metrics.jsonl"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    make_certs(args.certs, args.sites, args.public_name)
    server = start_coordinator(
        args.certs, args.sites, host=args.host, port=args.port, rounds=args.rounds,
        inner_steps=args.inner_steps, seed=args.seed, metrics=args.metrics, seq_len=args.seq_len,
    )
    print(f"coordinator listening on {args.host}:{server.port}; waiting for {args.sites}", flush=True)
    try:
        server.wait_until_finished()
    finally:
        server.stop()
    print(f"run finished; per-round metrics in {args.metrics}", flush=True)


if __name__ == "__main__":
    main()

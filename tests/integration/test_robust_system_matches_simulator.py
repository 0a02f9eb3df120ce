"""Robust aggregation in the real coordinator (gRPC over loopback, mutual TLS) against the simulator.

The plain mean adds updates in arrival order, so with three or more sites the real system and the
simulator agree only to 1e-6 (``test_real_system_matches_simulator``). A robust aggregation holds
the round's updates and combines them in site-name order, so here every replica must end on the
simulator's weights bit for bit, whatever order the uploads arrived in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _cluster import AgentThread, Run, make_certs

from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.metrics import read_metrics
from geoloco.scenarios.workloads import build_workload


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"), ["0", "1", "2", "3"])


@pytest.mark.parametrize(
    ("num_sites", "options"),
    [
        (3, {"clip_to_median_norm": 1.0}),
        (4, {"aggregation": "trimmed_mean", "trim_fraction": 0.25, "clip_to_median_norm": 2.0}),
    ],
    ids=["clipped-mean-3-sites", "clipped-trimmed-mean-4-sites"],
)
def test_robust_rounds_end_with_the_simulators_weights_bitwise(
    certs: Path, tmp_path: Path, num_sites: int, options: dict[str, Any]
) -> None:
    run = Run(
        workload=build_workload("mlp"),
        num_sites=num_sites,
        rounds=3,
        seed=4,
        algorithm=AlgorithmConfig(inner_steps=3, uplink_codec="int8", downlink_codec="int8", **options),
    )
    metrics = tmp_path / "metrics.jsonl"
    server = run.start_coordinator(certs, metrics_path=str(metrics))
    threads = [AgentThread(run.agent(certs, server.port, k)) for k in range(num_sites)]
    try:
        for t in threads:
            t.start()
        summaries = [t.finish() for t in threads]
        assert server.wait_until_finished(30)
    finally:
        server.stop(grace=0)
    assert all(s.run_finished and s.rounds_included == run.rounds for s in summaries)
    assert {s.weights_digest for s in summaries} == {server.rounds.digest_hex}
    assert torch.equal(server.rounds.weights, run.simulate())
    records = read_metrics(metrics)
    assert [sorted(r["participants"]) for r in records] == [[str(k) for k in range(num_sites)]] * run.rounds

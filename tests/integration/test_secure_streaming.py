"""Secure aggregation and DP per Streaming DiLoCo fragment, over gRPC with mutual TLS.

Three ``SiteAgent`` threads and a coordinator (in this process) run Streaming DiLoCo with P = 2
fragments, secure aggregation and distributed (Skellam) DP: every round is its own secure sum
over that round's fragment only (the masked uploads are a fragment's size, not the model's), each
fragment sync is one DP release (epsilon grows every round), and all sites end on the
coordinator's weights digest.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _cluster import AgentThread, Run, make_certs

from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.algorithms.streaming import FragmentPartition, StreamingConfig
from geoloco.coordinator.metrics import read_metrics
from geoloco.scenarios.workloads import build_workload
from geoloco.site_agent.config import RoundResult

STREAMING = StreamingConfig(enabled=True, fragments=2, overlap_steps=1, mix=0.5)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"), ["0", "1", "2"])


def test_streaming_secure_dp_each_fragment_sync_is_its_own_secure_sum(certs: Path, tmp_path: Path) -> None:
    run = Run(
        workload=build_workload("mlp"), num_sites=3, rounds=4, seed=3,
        algorithm=AlgorithmConfig(
            inner_steps=4, uplink_codec="none", downlink_codec="none", streaming=STREAMING
        ),
    )
    privacy = PrivacyConfig(
        secure_aggregation=True, clip_norm=1.0, dp="distributed", noise_multiplier=1.0, chunk_size=4096
    )
    metrics = tmp_path / "metrics.jsonl"
    server = run.start_coordinator(certs, privacy=privacy, metrics_path=str(metrics))
    results: list[RoundResult] = []
    threads = [AgentThread(run.agent(certs, server.port, k, results)) for k in range(3)]
    try:
        for thread in threads:
            thread.start()
        summaries = [thread.finish(timeout_s=120) for thread in threads]
        assert server.wait_until_finished(30)
    finally:
        server.stop(grace=0)
    assert all(s.run_finished and s.rounds_included == run.rounds for s in summaries)
    assert {s.weights_digest for s in summaries} == {server.rounds.digest_hex}
    partition = FragmentPartition.from_layout(
        ParamLayout.from_model(run.workload.build_model(run.seed)), 2
    )
    assert partition[0].numel != partition[1].numel
    records = read_metrics(metrics)
    assert [r["fragment"] for r in records] == [0, 1, 0, 1]
    for record in records:
        assert record["privacy"]["secure_aggregation"] is True
        assert sorted(record["privacy"]["survivors"]) == ["0", "1", "2"]
        assert "aborted" not in record["privacy"]
    epsilons = [r["epsilon"] for r in records]
    assert 0 < epsilons[0] < epsilons[1] < epsilons[2] < epsilons[3]
    # Each masked upload is the round's fragment, 4 bytes per value: a fragment's size.
    for result in results:
        fragment = partition[result.round % 2]
        assert result.bytes_up == 4 * fragment.numel, (result.round, result.bytes_up)

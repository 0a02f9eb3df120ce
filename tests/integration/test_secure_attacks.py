"""Secure aggregation against a hostile or refusing site in the real system (gRPC, mutual TLS).

Four ``SiteAgent`` threads and an in-process coordinator on loopback; one site misbehaves through
the protocol client it runs (patched for that site only), everything else is the real stack.

* ``test_a_malformed_unmask_answer_never_crashes_the_coordinator``: site 3 answers the unmask
  request with truncated shares. The coordinator refuses that answer (INVALID_ARGUMENT), unmasks
  with the other three (threshold 3) and goes on: both rounds complete, site 3's upload is in
  each sum and every site ends on the coordinator's weights.
* ``test_a_site_refusing_after_keys_were_shared_aborts_the_round_instead_of_stalling``: with
  ``min_sites = 4``, site 3 refuses round 0 after keys were shared (a bad share reached it). It
  withdraws; the quorum can no longer upload, so round 0 ends at once with "no change" (the key
  stage deadline is 10 minutes: waiting for it would time the test out), and round 1 runs with
  all four.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _cluster import AgentThread, Run, make_certs

from geoloco.algorithms.privacy import PrivacyConfig
from geoloco.algorithms.secagg_client import SecAggClient
from geoloco.algorithms.secagg_crypto import site_index
from geoloco.algorithms.secagg_messages import SecAggViolation, UnmaskRequest, UnmaskResponse
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.metrics import read_metrics
from geoloco.scenarios.workloads import build_workload

SITES = ["0", "1", "2", "3"]
HOSTILE = site_index("3")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"), SITES)


def _run_cluster(certs: Path, tmp_path: Path, **overrides: Any) -> list[dict[str, Any]]:
    run = Run(
        workload=build_workload("mlp"), num_sites=4, rounds=2, seed=3,
        algorithm=AlgorithmConfig(inner_steps=2, uplink_codec="none", downlink_codec="none"),
    )
    privacy = PrivacyConfig(secure_aggregation=True, clip_norm=10.0, chunk_size=4096)
    metrics = tmp_path / "metrics.jsonl"
    server = run.start_coordinator(
        certs, privacy=privacy, metrics_path=str(metrics), secure_stage_timeout_s=600.0,
        heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0, **overrides,
    )
    try:
        threads = [AgentThread(run.agent(certs, server.port, i)) for i in range(4)]
        for thread in threads:
            thread.start()
        summaries = [thread.finish(timeout_s=150) for thread in threads]
        alive = server.rounds is not None
    finally:
        server.stop()
    records = read_metrics(metrics)
    assert alive and all(s.run_finished and s.weights_digest == records[-1]["weights_digest"] for s in summaries)
    return records


def test_a_malformed_unmask_answer_never_crashes_the_coordinator(
    certs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    honest = SecAggClient.unmask

    def truncated(self: SecAggClient, request: UnmaskRequest) -> UnmaskResponse:
        response = honest(self, request)
        if self.site != HOSTILE:
            return response
        shares = {u: share[:7] for u, share in response.self_mask_shares.items()}
        return UnmaskResponse(response.site, response.round_index, shares, response.mask_key_shares)

    monkeypatch.setattr(SecAggClient, "unmask", truncated)
    records = _run_cluster(certs, tmp_path, min_sites=4)
    assert [r["round"] for r in records] == [0, 1]
    for record in records:
        assert "aborted" not in record["privacy"]
        assert sorted(record["participants"]) == SITES  # its upload is in the sum
        assert record["privacy"]["dropped_after_upload"] == ["3"]  # its answer was refused


def test_a_site_refusing_after_keys_were_shared_aborts_the_round_instead_of_stalling(
    certs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    honest = SecAggClient.receive_shares

    def refuse_round_0(self: SecAggClient, shares: Any) -> None:
        if self.site == HOSTILE and self.context.round_index == 0:
            raise SecAggViolation("site 3: the share from site 0 fails authentication (injected)")
        honest(self, shares)

    monkeypatch.setattr(SecAggClient, "receive_shares", refuse_round_0)
    records = _run_cluster(certs, tmp_path, min_sites=4)
    assert [r["round"] for r in records] == [0, 1]
    assert records[0]["participants"] == []
    assert "can still upload" in records[0]["privacy"]["aborted"]
    assert sorted(records[1]["participants"]) == SITES

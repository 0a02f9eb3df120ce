"""Secure aggregation against a hostile coordinator or a hostile or refusing site in the real
system (gRPC, mutual TLS).

``SiteAgent`` threads and an in-process coordinator on loopback; one site misbehaves through the
protocol client it runs (patched for that site only), or the coordinator's config is what a
hostile one would declare; everything else is the real stack.

* ``test_a_malformed_unmask_answer_never_crashes_the_coordinator``: site 3 answers the unmask
  request with truncated shares. The coordinator refuses that answer (INVALID_ARGUMENT), unmasks
  with the other three (threshold 3) and goes on: both rounds complete, site 3's upload is in
  each sum and every site ends on the coordinator's weights.
* ``test_a_site_refusing_after_keys_were_shared_aborts_the_round_instead_of_stalling``: with
  ``min_sites = 4``, site 3 refuses round 0 after keys were shared (a bad share reached it). It
  withdraws; the quorum can no longer upload, so round 0 ends at once with "no change" (the key
  stage deadline is 10 minutes: waiting for it would time the test out), and round 1 runs with
  all four.
* ``test_sites_refuse_a_threshold_picked_by_a_coordinator_declaring_no_colluding_sites``: the
  coordinator declares ``colluding_sites = 0`` and so takes 3 of 5 (or picks 2 of 3), which one
  colluding site breaks; five (three) sites with their default assumption of one colluding site
  refuse before sharing keys, each saying the threshold, the holders, both assumptions and what
  it allows, and the round ends at once with no change.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
from _cluster import AgentThread, Run, make_certs

from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
from geoloco.algorithms.privacy.secagg_client import SecAggClient
from geoloco.algorithms.privacy.secagg_crypto import site_index
from geoloco.algorithms.privacy.secagg_messages import SecAggViolation, UnmaskRequest, UnmaskResponse
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.metrics import read_metrics
from geoloco.scenarios.workloads import build_workload

SITES = ["0", "1", "2", "3"]
HOSTILE = site_index("3")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"), SITES)


@pytest.fixture(scope="module")
def certs5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs5"), [*SITES, "4"])


def _run_cluster(
    certs: Path, tmp_path: Path, *, num_sites: int = 4, rounds: int = 2, privacy: PrivacyConfig | None = None,
    **overrides: Any,
) -> list[dict[str, Any]]:
    run = Run(
        workload=build_workload("mlp"), num_sites=num_sites, rounds=rounds, seed=3,
        algorithm=AlgorithmConfig(inner_steps=2, uplink_codec="none", downlink_codec="none"),
    )
    if privacy is None:
        privacy = PrivacyConfig(secure_aggregation=True, clip_norm=10.0, chunk_size=4096)
    metrics = tmp_path / "metrics.jsonl"
    server = run.start_coordinator(
        certs, privacy=privacy, metrics_path=str(metrics), secure_stage_timeout_s=600.0,
        heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0, **overrides,
    )
    try:
        threads = [AgentThread(run.agent(certs, server.port, i)) for i in range(num_sites)]
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


@pytest.mark.parametrize(
    ("num_sites", "threshold", "least"), [(5, 3, 4), (3, None, 3)], ids=["3-of-5", "default-2-of-3"]
)
def test_sites_refuse_a_threshold_picked_by_a_coordinator_declaring_no_colluding_sites(
    certs5: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, num_sites: int, threshold: int | None, least: int
) -> None:
    # The coordinator declares colluding_sites = 0, so its config takes 3 of 5 (or picks 2 of 3),
    # which one site on its side breaks. The sites keep their own assumption (SiteAgentConfig's
    # default colluding_sites = 1): each refuses before sharing keys, the round ends with no change.
    privacy = PrivacyConfig(
        secure_aggregation=True, clip_norm=10.0, chunk_size=4096, threshold=threshold, colluding_sites=0
    )
    caplog.set_level(logging.WARNING, logger="geoloco.site_agent.secure_site")
    records = _run_cluster(certs5, tmp_path, num_sites=num_sites, rounds=1, privacy=privacy, min_sites=num_sites)
    assert [r["round"] for r in records] == [0]
    assert records[0]["participants"] == []
    # The refusals end the round at once (not at the 10-minute key-stage deadline).
    assert "can still upload" in records[0]["privacy"]["aborted"]
    t = least - 1
    why = re.compile(
        rf"site (\d+): refusing secure round: site \d+: refusing to share keys: threshold {t} of {num_sites} share "
        rf"holders is below what this site accepts: 2 t > holders \+ colluding_sites with colluding_sites = 1 "
        rf"\(this site assumes 1, the coordinator declared 0\) needs t >= {least}.*allowed: t = {least}..{num_sites}\."
    )
    messages = [r.getMessage() for r in caplog.records]
    refusals = [m for m in messages if "refusing" in m]
    refused = {match.group(1) for match in map(why.match, refusals) if match}
    assert refused and len(refused) == len(refusals), refusals  # every refusal says what is wrong and allowed
    # A site whose refusal would have come after the first ones ended the round sees it end (aborted,
    # or the run over): none takes part.
    ended_line = re.compile(r"site (\d+): (secure round 0 aborted|not part of secure round 0)")
    ended = {match.group(1) for match in map(ended_line.match, messages) if match}
    assert refused | ended == {str(k) for k in range(num_sites)}

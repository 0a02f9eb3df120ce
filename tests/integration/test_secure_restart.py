"""A coordinator restarted in the middle of a secure round (real gRPC, mutual TLS, agent threads).

Three sites upload round 1's masked updates; before they answer the unmasking, the coordinator
is stopped and a new one resumes from its round-1 checkpoint on the same port. The sites' masks
and key stages belong to the old coordinator, so the new round 1 can never be unmasked: the new
coordinator refuses their resent masked uploads and, since every live site then waits for the
broadcast without having advertised keys, aborts round 1 at once (not after
``secure_stage_timeout_s``, set to 10 minutes here so waiting for it would time the test out).
Each site's round-1 update goes back into its error-feedback residual (the broadcast says "not
included"), and the run finishes with every site on the coordinator's weights.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from _cluster import AgentThread, Run, make_certs, wait_for

from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.metrics import read_metrics
from geoloco.coordinator.server import CoordinatorServer
from geoloco.scenarios.workloads import build_workload
from geoloco.site_agent.config import RoundResult
from geoloco.site_agent.secure_site import SecureUplink


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"), ["0", "1", "2"])


def test_restarted_coordinator_aborts_the_interrupted_secure_round_at_once(
    certs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = Run(
        workload=build_workload("mlp"), num_sites=3, rounds=3, seed=2,
        algorithm=AlgorithmConfig(inner_steps=3, uplink_codec="none", downlink_codec="none"),
    )
    privacy = PrivacyConfig(secure_aggregation=True, clip_norm=10.0, chunk_size=4096)
    overrides: dict[str, Any] = {
        "privacy": privacy, "checkpoint_dir": str(tmp_path / "ckpt"), "secure_stage_timeout_s": 600.0,
    }
    # Hold every site at round 1's unmasking until the coordinator has been replaced.
    at_unmask = threading.Semaphore(0)
    restarted = threading.Event()
    real_unmask = SecureUplink.unmask

    def held_unmask(self: SecureUplink) -> bool:
        assert self._round is not None
        if self._round.context.round_index == 1 and not restarted.is_set():
            at_unmask.release()
            wait_for(restarted)
        return real_unmask(self)

    monkeypatch.setattr(SecureUplink, "unmask", held_unmask)
    residual_norms: dict[tuple[str, int], float] = {}
    first = run.start_coordinator(certs, **overrides)
    agents = [run.agent(certs, first.port, k) for k in range(3)]
    for agent in agents:
        def record(result: RoundResult, agent: Any = agent) -> None:
            residual = agent.uplink_residual()
            residual_norms[(agent.site, result.round)] = float(torch.linalg.vector_norm(residual))
            assert result.included == (result.round != 1), result
        agent.hooks.on_round_end = record
    threads = [AgentThread(agent) for agent in agents]
    second: CoordinatorServer | None = None
    try:
        for thread in threads:
            thread.start()
        for _ in range(3):
            assert at_unmask.acquire(timeout=60), "sites did not reach round 1's unmasking"
        first.stop(grace=0)
        assert first.rounds.round == 1
        metrics = tmp_path / "metrics.jsonl"
        second = run.start_coordinator(certs, port=first.port, metrics_path=str(metrics), **overrides)
        assert second.rounds.round == 1
        restarted.set()
        summaries = [thread.finish(timeout_s=60) for thread in threads]
        assert second.wait_until_finished(30)
    finally:
        restarted.set()
        first.stop(grace=0)
        if second is not None:
            second.stop(grace=0)
    assert {s.weights_digest for s in summaries} == {second.rounds.digest_hex}
    assert all(s.run_finished and s.rounds_included == 2 for s in summaries), summaries
    records = read_metrics(metrics)
    assert [r["round"] for r in records] == [1, 2]
    assert "aborted" in records[0]["privacy"] and records[0]["participants"] == []
    assert sorted(records[1]["privacy"]["survivors"]) == ["0", "1", "2"]
    for site in ("0", "1", "2"):
        # Included rounds leave only the rounding error (< 1e-6 a coordinate) in the residual;
        # the aborted round's whole update was put back.
        assert residual_norms[(site, 0)] < 1e-3
        assert residual_norms[(site, 1)] > 100 * residual_norms[(site, 0)]
        assert residual_norms[(site, 2)] < 1e-3

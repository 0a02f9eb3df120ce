"""Adaptive overlap through the real system: two site agents over gRPC with mutual TLS.

Each site measures its own step time and how long its fragments were away, chooses τ and its next
round's steps with ``choose_overlap`` and reports what it saw and chose with the upload. Asserted:
the choices replay exactly from the reported measurements (the same pure rule as the simulator),
round r runs the steps chosen at round r-1's upload, the first rounds run the configured values,
and ``weighting = "steps"`` weighs each upload by the steps it really covers. No timing asserted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _cluster import AgentThread, Run, make_certs

from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.algorithms.streaming import StreamingConfig
from geoloco.algorithms.streaming_overlap import OverlapBounds, OverlapChoice, choose_overlap
from geoloco.coordinator.metrics import read_metrics
from geoloco.scenarios.workloads import build_workload

STREAMING = StreamingConfig(
    enabled=True, fragments=3, overlap_steps=1, adaptive_overlap=True, overlap_steps_max=12,
    interval_steps_max=12,
)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"), ["0", "1"])


def _measured(value: float) -> float | None:
    return None if value < 0 else value


def test_sites_choose_their_overlap_with_the_pure_rule(certs: Path, tmp_path: Path) -> None:
    run = Run(
        workload=build_workload("mlp"), num_sites=2, rounds=8, seed=4,
        algorithm=AlgorithmConfig(
            inner_steps=6, uplink_codec="int8", downlink_codec="int8", weighting="steps",
            streaming=STREAMING,
        ),
    )
    metrics = tmp_path / "metrics.jsonl"
    server = run.start_coordinator(certs, metrics_path=str(metrics))
    threads = [AgentThread(run.agent(certs, server.port, k, [])) for k in range(2)]
    try:
        for t in threads:
            t.start()
        summaries = [t.finish() for t in threads]
        assert server.wait_until_finished(60)
    finally:
        server.stop(grace=0)
    assert all(s.run_finished and s.rounds_included == run.rounds for s in summaries)
    records = read_metrics(metrics)
    bounds = OverlapBounds.from_config(6, STREAMING)
    assert bounds.fixed == OverlapChoice(overlap_steps=1, round_steps=2)
    for site in ("0", "1"):
        reported = [r["site_metrics"][site] for r in records]
        steps = [int(m["inner_steps"]) for m in reported]
        choices = []
        for m in reported:
            expected = choose_overlap(
                bounds, step_s=_measured(m["step_s"]), transfer_s=_measured(m["transfer_s"])
            )
            got = OverlapChoice(int(m["overlap_steps"]), int(m["next_round_steps"]), expected.needed_steps)
            assert got == expected, (site, m)
            choices.append(got)
        # Round 0 measured no transfer; round 1's choice has only round 0's, start-up, skipped.
        assert reported[0]["transfer_s"] == -1.0 and reported[1]["transfer_s"] == -1.0
        assert choices[0] == choices[1] == bounds.fixed
        # From round 2 on the rule has a transfer time and a step time to work with.
        assert all(m["transfer_s"] > 0 and m["step_s"] > 0 for m in reported[2:])
        assert all(m["merge_wait_s"] >= 0 for m in reported)
        assert all(c.needed_steps is not None for c in choices[2:])
        assert steps[0] == bounds.interval
        assert steps[1:] == [c.round_steps for c in choices[:-1]]
        assert all(bounds.interval <= n <= 12 for n in steps)
        # weighting = "steps": each upload weighs what it covers.
        assert [r["sample_weights"][site] for r in records] == [float(n) for n in steps]

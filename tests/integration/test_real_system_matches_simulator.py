"""The real coordinator and site agents (gRPC over loopback, mutual TLS) against the simulator.

Sites run as threads of this process, each with its own model, optimizer, data stream and gRPC
channel; everything between them is real: certificates, chunked streams, the round state machine.

Equality with the simulator. The coordinator adds each update to its aggregation buffer the
moment the upload completes, i.e. in arrival order; the simulator adds sites in index order.
Float addition is commutative but not associative, so with two sites (``0 + a + b`` vs
``0 + b + a``) the results are bitwise equal and with three (``(a + b) + c`` vs ``(a + c) + b``)
they may differ in the last bit of a few coordinates, which later rounds carry along: there we
demand 1e-6 relative (L2) instead. Every replica (coordinator and sites) is always bit-identical:
they apply the same decoded bytes, and the weights digests are compared.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest
import torch
from _cluster import AgentThread, Run, make_certs, on_round, relative_difference, wait_for

from geoloco.algorithms.record import SHARED_RECORD_KEYS, RoundRecord
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.metrics import read_metrics
from geoloco.coordinator.server import CoordinatorServer
from geoloco.scenarios.workloads import build_workload
from geoloco.site_agent.config import RoundResult


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"), ["0", "1", "2"])


@pytest.fixture(scope="module")
def mlp() -> object:
    return build_workload("mlp")


def _run(run: Run, certs: Path, **overrides: object) -> tuple[torch.Tensor, CoordinatorServer, dict[str, str]]:
    server = run.start_coordinator(certs, **overrides)
    threads = [AgentThread(run.agent(certs, server.port, k)) for k in range(run.num_sites)]
    try:
        for t in threads:
            t.start()
        summaries = {t.agent.site: t.finish() for t in threads}
        assert server.wait_until_finished(30)
    finally:
        server.stop(grace=0)
    assert all(s.run_finished and s.rounds_included == run.rounds for s in summaries.values())
    return server.rounds.weights, server, {k: s.weights_digest for k, s in summaries.items()}


@pytest.mark.parametrize(
    ("num_sites", "bitwise"),
    [(2, True), (3, False)],
    ids=["2-sites-bitwise", "3-sites-1e-6"],
)
def test_sites_end_with_the_simulators_weights(
    certs: Path, mlp: object, tmp_path: Path, num_sites: int, bitwise: bool
) -> None:
    run = Run(
        workload=mlp,
        num_sites=num_sites,
        rounds=4,
        seed=5,
        algorithm=AlgorithmConfig(inner_steps=4, uplink_codec="int8", downlink_codec="int8"),
    )
    metrics = tmp_path / "metrics.jsonl"
    weights, server, digests = _run(run, certs, metrics_path=str(metrics))
    expected, predicted = run.simulate_records()
    assert set(digests.values()) == {server.rounds.digest_hex}, "a replica differs from the coordinator"
    if bitwise:
        assert torch.equal(weights, expected)
    else:
        assert relative_difference(weights, expected) <= 1e-6
    records = read_metrics(metrics)
    assert [r["round"] for r in records] == list(range(run.rounds))
    for record in records:
        assert sorted(record["participants"]) == [str(k) for k in range(num_sites)]
        assert record["excluded"] == [] and record["update_norm"] > 0
        assert all(record["bytes_up"][str(k)] > 0 for k in range(num_sites))
    # One record type: both hosts' records have the same keys, and every fact both fill has the
    # same type in both.
    for real, sim in zip(records, predicted, strict=True):
        simulated = json.loads(json.dumps(sim.to_dict()))  # as metrics.jsonl would hold it
        assert set(real) == set(simulated) == {f.name for f in dataclasses.fields(RoundRecord)}
        for key in SHARED_RECORD_KEYS:
            assert key in real and key in simulated, key
            assert _kind(real[key]) == _kind(simulated[key]) or None in (real[key], simulated[key]), (
                key, real[key], simulated[key]
            )
        assert real["inner_steps"] == simulated["inner_steps"] == {str(k): 4 for k in range(num_sites)}
        assert real["round"] == simulated["round"]
        assert real["fragment"] == simulated["fragment"] is None  # no streaming: None on both hosts
        assert real["weights_digest"] == simulated["weights_digest"] or not bitwise


def _kind(value: object) -> str:
    """A JSON value's type, with a table's or list's element types (``dict[str,int]``)."""
    if isinstance(value, dict):
        return "dict[" + ",".join(sorted({f"str,{_kind(v)}" for v in value.values()})) + "]"
    if isinstance(value, list):
        return "list[" + ",".join(sorted({_kind(v) for v in value})) + "]"
    if isinstance(value, bool | str) or value is None:
        return type(value).__name__
    return "number"


def test_coordinator_restart_mid_run_resumes_and_matches_the_simulator(
    certs: Path, mlp: object, tmp_path: Path
) -> None:
    run = Run(
        workload=mlp,
        num_sites=3,
        rounds=5,
        seed=2,
        algorithm=AlgorithmConfig(inner_steps=3, uplink_codec="int8", downlink_codec="int8"),
    )
    checkpoints = tmp_path / "checkpoints"
    metrics = tmp_path / "metrics.jsonl"
    overrides = {"checkpoint_dir": str(checkpoints), "metrics_path": str(metrics)}
    round_one = threading.Event()
    first = run.start_coordinator(certs, on_round_end=on_round(1, round_one), **overrides)
    threads = [AgentThread(run.agent(certs, first.port, k)) for k in range(run.num_sites)]
    second: CoordinatorServer | None = None
    try:
        for t in threads:
            t.start()
        wait_for(round_one)
        first.stop(grace=0)  # as abrupt as a graceful stop gets: open calls are cancelled
        stopped_at = first.rounds.round
        second = run.start_coordinator(certs, port=first.port, **overrides)
        assert second.session_id != first.session_id
        assert second.rounds.round == stopped_at  # resumed from the checkpoint of that round
        summaries = [t.finish() for t in threads]
        assert second.wait_until_finished(30)
    finally:
        first.stop(grace=0)
        if second is not None:
            second.stop(grace=0)
    assert {s.weights_digest for s in summaries} == {second.rounds.digest_hex}
    assert relative_difference(second.rounds.weights, run.simulate()) <= 1e-6
    records = read_metrics(metrics)
    assert [r["round"] for r in records] == list(range(run.rounds))
    assert {r["session_id"] for r in records} == {first.session_id, second.session_id}


def test_site_joining_at_round_three_catches_up_and_contributes(
    certs: Path, mlp: object
) -> None:
    run = Run(workload=mlp, num_sites=3, rounds=5, seed=1)
    round_two = threading.Event()
    server = run.start_coordinator(certs, min_sites=2, on_round_end=on_round(2, round_two))
    late_results: list[RoundResult] = []
    threads = [AgentThread(run.agent(certs, server.port, k)) for k in range(2)]
    try:
        for t in threads:
            t.start()
        wait_for(round_two)
        late = AgentThread(run.agent(certs, server.port, 2, late_results))
        late.start()
        summaries = [t.finish() for t in [*threads, late]]
        assert server.wait_until_finished(30)
    finally:
        server.stop(grace=0)
    assert {s.weights_digest for s in summaries} == {server.rounds.digest_hex}
    first_round = late_results[0].round
    assert first_round >= 3, "the newcomer should start from the round the run had reached"
    assert [r.round for r in late_results] == list(range(first_round, run.rounds))
    assert all(r.included for r in late_results)

"""Every round's per-phase breakdown, from a real run (gRPC over loopback, mutual TLS).

The coordinator's phases are disjoint in time, so they must sum to at most the round's wall
time; each site's phases arrive with its uploads (the transfers of the round before, see
``geoloco.protos.round_phases``) and reach both ``metrics.jsonl`` and the status page's JSON.
"""

from __future__ import annotations

import json
import ssl
import time
import urllib.request
from pathlib import Path

import pytest
from _cluster import AgentThread, Run, make_certs

from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.http_status import HTTPStatusConfig
from geoloco.coordinator.metrics import read_metrics
from geoloco.protos.round_phases import (
    COORDINATOR_PHASES,
    SITE_PHASES,
    SITE_PHASES_BEFORE_UPLOAD,
)
from geoloco.protos.transport_tls import TLSFiles
from geoloco.scenarios.workloads import build_workload

ROUNDS = 3
SLOW_SNAPSHOT_S = 0.6


def _status(url: str, certs: Path) -> dict:
    context = None
    if url.startswith("https://"):
        context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        files = TLSFiles.from_dir(certs, "0")
        context.load_cert_chain(str(files.cert), str(files.key))
    with urllib.request.urlopen(url + "api/status", timeout=10, context=context) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict]:
    tmp = tmp_path_factory.mktemp("phases")
    certs = make_certs(tmp / "certs", ["0"])
    run = Run(build_workload("mlp"), num_sites=1, rounds=ROUNDS, algorithm=AlgorithmConfig(inner_steps=2))
    server = run.start_coordinator(
        certs, checkpoint_dir=str(tmp / "checkpoints"), metrics_path=str(tmp / "metrics.jsonl"),
        http=HTTPStatusConfig(enabled=True, port=0),
    )
    try:
        agent = AgentThread(run.agent(certs, server.port, 0))
        agent.start()
        summary = agent.finish()
        assert server.wait_until_finished(30)
        assert server.status_url is not None
        status = _status(server.status_url, certs)
    finally:
        server.stop(grace=0)
    assert summary.run_finished and summary.rounds_included == ROUNDS
    return read_metrics(tmp / "metrics.jsonl"), status


def test_coordinator_records_every_phase_within_the_round_wall_time(finished_run: tuple[list[dict], dict]) -> None:
    records, _ = finished_run
    assert [r["round"] for r in records] == list(range(ROUNDS))
    for record in records:
        phases = record["phases_s"]
        assert set(phases) == set(COORDINATOR_PHASES)
        assert all(seconds >= 0 for seconds in phases.values()), phases
        # Each round received, verified and added an upload, stepped and wrote a checkpoint.
        for phase in ("receive", "verify", "add", "outer_step", "downlink_encode", "checkpoint"):
            assert phases[phase] > 0, (record["round"], phase, phases)
        wall = record["round_wall_s"]
        assert wall > 0
        assert sum(phases.values()) <= wall + 1e-6, (phases, wall)


def test_waiting_for_the_previous_snapshot_counts_as_checkpoint_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow disk: each background snapshot takes 0.6 s, longer than the site's round, so every
    close waits for the previous round's snapshot. That wait is checkpoint time, counted once:
    the outer step stays small and the phases still sum to at most the round's wall time."""
    from geoloco.coordinator import round_log

    real_save = round_log.save_checkpoint

    def slow_save(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(SLOW_SNAPSHOT_S)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(round_log, "save_checkpoint", slow_save)
    certs = make_certs(tmp_path / "certs", ["0"])
    run = Run(build_workload("mlp"), num_sites=1, rounds=ROUNDS, algorithm=AlgorithmConfig(inner_steps=2))
    server = run.start_coordinator(
        certs, checkpoint_dir=str(tmp_path / "checkpoints"), metrics_path=str(tmp_path / "metrics.jsonl")
    )
    try:
        agent = AgentThread(run.agent(certs, server.port, 0))
        agent.start()
        assert agent.finish().run_finished
        assert server.wait_until_finished(30)
    finally:
        server.stop(grace=0)
    records = read_metrics(tmp_path / "metrics.jsonl")
    waited = [r for r in records if r["phases_s"]["checkpoint"] > SLOW_SNAPSHOT_S / 2]
    assert waited, [r["phases_s"] for r in records]  # some close did wait for a snapshot
    for record in waited:
        phases = record["phases_s"]
        assert phases["outer_step"] < SLOW_SNAPSHOT_S / 2, phases
        assert sum(phases.values()) <= record["round_wall_s"] + 1e-6, (phases, record["round_wall_s"])
        # aggregate_time_s runs from the close to the publication: every phase after the close.
        after_close = sum(phases[p] for p in ("checkpoint", "outer_step", "downlink_encode", "broadcast"))
        assert after_close <= record["aggregate_time_s"] + 1e-6 <= record["round_wall_s"] + 2e-6, record


def test_site_phases_arrive_with_the_uploads(finished_run: tuple[list[dict], dict]) -> None:
    records, _ = finished_run
    first, *later = records
    # The first upload has no round before it: only its own training phases.
    assert set(first["site_phases_s"]["0"]) == set(SITE_PHASES_BEFORE_UPLOAD)
    for record in later:
        phases = record["site_phases_s"]["0"]
        assert set(phases) == set(SITE_PHASES), record["round"]
        assert all(seconds >= 0 for seconds in phases.values()), phases
        assert phases["upload"] > 0 and phases["verify"] > 0


def test_status_page_json_carries_the_breakdown(finished_run: tuple[list[dict], dict]) -> None:
    """Every round's coordinator phases, and the latest round's per-site phases (the page shows
    those; keeping every round's per-site table made the status grow with sites times rounds)."""
    records, status = finished_run
    rounds = {r["round"]: r for r in status["rounds"]}
    assert set(rounds) == set(range(ROUNDS))
    for record in records:
        shown = rounds[record["round"]]
        assert shown["phases_s"] == pytest.approx(record["phases_s"])
        assert shown["round_wall_s"] == pytest.approx(record["round_wall_s"])
    latest = records[-1]
    assert status["site_phases"]["round"] == latest["round"]
    assert set(status["site_phases"]["sites"]) == {"0"}
    assert status["site_phases"]["sites"]["0"] == pytest.approx(latest["site_phases_s"]["0"])

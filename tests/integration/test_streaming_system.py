"""Streaming DiLoCo through the real system: gRPC, mutual TLS, the round state machine, processes.

* Threads (``_cluster``): two site agents against a coordinator with ``[algorithm.streaming]``
  (3 fragments, H = 6, overlap 1 step, mix 0.25) end with the simulator's weights bit for bit;
  every round uploads and broadcasts one fragment, named in the manifest and in the metrics.
  A coordinator stopped mid-run resumes from its checkpoint (per-fragment outer state and
  downlink residuals) and still matches the uninterrupted simulator bitwise.
* Processes (``_processes``): ``geoloco coordinator`` and two ``geoloco site`` processes; site "1"
  is SIGKILLed mid-round, the round closes at its deadline without it, the same command brings it
  back, it re-joins, fetches the global weights and contributes again; every replica ends on the
  coordinator's digest.
* With an adaptive deadline and a straggler, the real coordinator and the simulator leave out the
  same site, adapt the same deadline and end on the same weights.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from _cluster import AgentThread, Run, make_certs, on_round, wait_for
from _processes import COORDINATOR_END, COORDINATOR_ROUND, LISTENING, SITE_END, SITE_ROUND, Processes, names

from geoloco.algorithms.deadline import AdaptiveDeadlineConfig
from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.simulation.clock import SiteConfig
from geoloco.algorithms.simulation.simulator import SimulationConfig, Simulator, SimulatorConfig
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.algorithms.streaming import FragmentPartition, StreamingConfig
from geoloco.coordinator.metrics import read_metrics
from geoloco.coordinator.server import CoordinatorServer
from geoloco.protos.round_phases import SITE_PHASES, SITE_PHASES_BEFORE_UPLOAD
from geoloco.scenarios.workloads import build_workload
from geoloco.site_agent.config import RoundResult

STREAMING = StreamingConfig(enabled=True, fragments=3, overlap_steps=1, mix=0.25)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"), ["0", "1", "2"])


@pytest.fixture(scope="module")
def mlp() -> object:
    return build_workload("mlp")


def _run(mlp: object, rounds: int) -> Run:
    return Run(
        workload=mlp,
        num_sites=2,
        rounds=rounds,
        seed=4,
        algorithm=AlgorithmConfig(
            inner_steps=6, uplink_codec="int8", downlink_codec="int8", streaming=STREAMING
        ),
    )


def test_streaming_sites_end_with_the_simulators_weights(
    certs: Path, mlp: object, tmp_path: Path
) -> None:
    run = _run(mlp, rounds=7)
    metrics = tmp_path / "metrics.jsonl"
    server = run.start_coordinator(certs, metrics_path=str(metrics))
    results: list[RoundResult] = []
    threads = [AgentThread(run.agent(certs, server.port, k, results)) for k in range(2)]
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

    model = mlp.build_model(0)  # type: ignore[attr-defined]
    partition = FragmentPartition.from_layout(ParamLayout.from_model(model), 3)
    records = read_metrics(metrics)
    assert [r["fragment"] for r in records] == [r % 3 for r in range(run.rounds)]
    for record in records:
        fragment = partition[record["fragment"]]
        # An int8 fragment is about a byte per element: a fragment's worth, not the model's.
        assert record["downlink_bytes"] < fragment.numel + 2048
        assert record["downlink_bytes"] < partition.numel
    assert all(r.inner_steps == 2 for r in results)
    # Each fragment's upload carries its site's phases, as a plain site's does: this round's
    # training and encoding, and the previous fragment's transfers and merge.
    first, *later = records
    for site in ("0", "1"):
        assert set(first["site_phases_s"][site]) == set(SITE_PHASES_BEFORE_UPLOAD)
        for record in later:
            phases = record["site_phases_s"][site]
            assert set(phases) == set(SITE_PHASES), (record["round"], phases)
            assert all(seconds >= 0 for seconds in phases.values()), phases
            assert phases["upload"] > 0 and phases["verify"] > 0 and phases["train"] > 0, phases


def test_streaming_rounds_weighted_by_steps_carry_each_fragments_steps(
    certs: Path, mlp: object, tmp_path: Path
) -> None:
    """``weighting = "steps"`` needs every fragment upload to say how many steps it covers."""
    run = Run(
        workload=mlp, num_sites=2, rounds=3, seed=4,
        algorithm=AlgorithmConfig(
            inner_steps=6, uplink_codec="int8", weighting="steps", streaming=STREAMING
        ),
    )
    metrics = tmp_path / "metrics.jsonl"
    server = run.start_coordinator(certs, metrics_path=str(metrics))
    threads = [AgentThread(run.agent(certs, server.port, k, [])) for k in range(2)]
    try:
        for t in threads:
            t.start()
        summaries = [t.finish() for t in threads]
        assert server.wait_until_finished(30)
    finally:
        server.stop(grace=0)
    assert all(s.run_finished and s.rounds_included == run.rounds for s in summaries)
    records = read_metrics(metrics)
    assert [sorted(r["participants"]) for r in records] == [["0", "1"]] * run.rounds
    assert all(r["sample_weights"] == {"0": 2.0, "1": 2.0} for r in records)


def test_streaming_coordinator_resumes_from_its_checkpoint(
    certs: Path, mlp: object, tmp_path: Path
) -> None:
    run = _run(mlp, rounds=6)
    checkpoints = tmp_path / "checkpoints"
    overrides = {"checkpoint_dir": str(checkpoints)}
    round_two = threading.Event()
    first = run.start_coordinator(certs, on_round_end=on_round(2, round_two), **overrides)
    threads = [AgentThread(run.agent(certs, first.port, k)) for k in range(2)]
    second: CoordinatorServer | None = None
    try:
        for t in threads:
            t.start()
        wait_for(round_two)
        first.stop(grace=0)
        stopped_at = first.rounds.round
        second = run.start_coordinator(certs, port=first.port, **overrides)
        assert second.rounds.round == stopped_at
        summaries = [t.finish() for t in threads]
        assert second.wait_until_finished(30)
    finally:
        first.stop(grace=0)
        if second is not None:
            second.stop(grace=0)
    assert {s.weights_digest for s in summaries} == {second.rounds.digest_hex}
    assert torch.equal(second.rounds.weights, run.simulate())


class HoldUpload(grpc.StreamUnaryClientInterceptor):
    """Holds a site's Upload for round ``round_number`` until ``release`` is set."""

    def __init__(self, round_number: int) -> None:
        self.round_number = round_number
        self.held = threading.Event()
        self.release = threading.Event()

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Iterator[Any]) -> Any:
        if not details.method.endswith("/Upload"):
            return continuation(details, requests)
        requests = iter(requests)
        first = next(requests)
        if first.manifest.round == self.round_number and not self.release.is_set():
            self.held.set()
            wait_for(self.release)

        def replay() -> Iterator[Any]:
            yield first
            yield from requests

        return continuation(details, replay())


def test_a_fragment_uploaded_before_a_coordinator_restart_is_sent_again(
    certs: Path, mlp: object, tmp_path: Path
) -> None:
    """Site 0's fragment of round 3 reached the coordinator, site 1's did not, and the
    coordinator restarted from its checkpoint at round 3, without either. A plain site re-sends
    its update after the re-join; a streaming site only waited for the broadcast, and the round,
    which waits for every site here, never closed. Now it re-sends, and the run still ends on the
    simulator's weights bit for bit."""
    run = _run(mlp, rounds=6)
    overrides = {"checkpoint_dir": str(tmp_path / "checkpoints")}
    first = run.start_coordinator(certs, **overrides)
    hold = HoldUpload(3)
    threads = [
        AgentThread(run.agent(certs, first.port, 0)),
        AgentThread(run.agent(certs, first.port, 1, interceptors=[hold])),
    ]
    second: CoordinatorServer | None = None
    try:
        for t in threads:
            t.start()
        wait_for(hold.held)
        deadline = time.monotonic() + 60
        while first.rounds.status()["contributed"] != ["0"]:
            assert time.monotonic() < deadline, first.rounds.status()
            time.sleep(0.02)
        assert first.rounds.round == 3
        first.stop(grace=0)
        second = run.start_coordinator(certs, port=first.port, **overrides)
        assert second.rounds.round == 3 and second.rounds.status()["contributed"] == []
        hold.release.set()
        summaries = [t.finish(60) for t in threads]
        assert second.wait_until_finished(30)
    finally:
        hold.release.set()
        first.stop(grace=0)
        if second is not None:
            second.stop(grace=0)
    assert {s.weights_digest for s in summaries} == {second.rounds.digest_hex}
    assert torch.equal(second.rounds.weights, run.simulate())


STREAMING_KILL_CONFIG = """
total_rounds = {rounds}
seed = 3
min_sites = 1
round_deadline_s = 2.0
allowed_sites = ["0", "1"]
heartbeat_interval_s = 0.5
heartbeat_timeout_s = 120.0
drain_timeout_s = 20.0
metrics_path = "{metrics}"

[workload]
name = "mlp"

[algorithm]
inner_steps = 6
uplink_codec = "int8"
downlink_codec = "int8"

[algorithm.streaming]
enabled = true
fragments = 3
overlap_steps = 2
mix = 0.0

[inner_optimizer]
lr = 3e-3
"""


def test_streaming_site_killed_and_restarted_over_processes(certs: Path, tmp_path: Path) -> None:
    rounds = 30
    metrics = tmp_path / "metrics.jsonl"
    config = tmp_path / "coordinator.toml"
    config.write_text(STREAMING_KILL_CONFIG.format(rounds=rounds, metrics=metrics))
    with Processes(tmp_path) as processes:
        coordinator = processes.start(
            "coordinator", "coordinator", "--config", str(config), "--certs", str(certs),
            "--http-port", "0",
        )
        _, listening = coordinator.wait_line(LISTENING, what="the listening line")
        port = int(listening["port"])

        def site(label: str, name: str):
            return processes.start(
                label, "site", "--coordinator", f"localhost:{port}", "--name", name,
                "--certs", str(certs), "--device", "cpu", "--backoff-max", "0.5",
            )

        steady = site("site-0", "0")
        victim = site("site-1", "1")
        _, trained = victim.wait_line(
            SITE_ROUND, where=lambda m: int(m["round"]) >= 2, what="site 1 after round 2"
        )
        # overlap_steps = H/P: all of a round's steps ran while the previous fragment travelled,
        # and the round's loss is theirs.
        assert math.isfinite(float(trained["loss"])), trained.string
        victim.kill(signal.SIGKILL)
        assert victim.wait_exit() == -signal.SIGKILL
        excluded_at, excluded = coordinator.wait_line(
            COORDINATOR_ROUND, where=lambda m: "1" in names(m["excluded"]), what="site 1 excluded"
        )
        restarted = site("site-1-again", "1")
        _, back = coordinator.wait_line(
            COORDINATOR_ROUND, start=excluded_at + 1,
            where=lambda m: "1" in names(m["participants"]), what="site 1 contributing again",
        )
        assert int(back["round"]) > int(excluded["round"])
        assert coordinator.wait_exit() == 0, coordinator.describe()
        _, end = coordinator.wait_line(COORDINATOR_END, what="the coordinator's final line")
        assert end["how"] == "finished" and end["round"] == str(rounds)
        digests = set()
        for process in (steady, restarted):
            assert process.wait_exit() == 0, process.describe()
            _, site_end = process.wait_line(SITE_END, what="the final line")
            assert site_end["run_finished"] == "yes"
            digests.add(site_end["digest"])
        assert digests == {end["digest"]}
    records = read_metrics(metrics)
    assert [r["fragment"] for r in records] == [r % 3 for r in range(rounds)]


class _SlowSite:
    """The workload with site "2" sleeping before each batch: it misses every round's deadline."""

    def __init__(self, workload: object, slow_site: int, sleep_s: float) -> None:
        self.workload = workload
        self.slow_site = slow_site
        self.sleep_s = sleep_s

    def __getattr__(self, name: str) -> object:
        return getattr(self.workload, name)

    def site_batches(self, site: int, num_sites: int, seed: int):  # type: ignore[no-untyped-def]
        batches = self.workload.site_batches(site, num_sites, seed)  # type: ignore[attr-defined]
        for batch in batches:
            if site == self.slow_site:
                time.sleep(self.sleep_s)
            yield batch


def test_streaming_adaptive_deadline_straggler_agrees_with_the_simulator(
    certs: Path, mlp: object, tmp_path: Path
) -> None:
    """Streaming (P = 2) with an adaptive deadline and a straggler: the real coordinator (its
    real clock) and the simulator (its virtual clock) run the same ``RoundPolicy``, so both leave
    the slow site out of every round, adapt the deadline the same way (margin x quantile, clipped
    to ``max_s``) and end on the same weights bit for bit (two contributors: the sum is exact)."""
    adaptive = AdaptiveDeadlineConfig(enabled=True, window=3, margin=3.0, min_s=0.8, max_s=2.0)
    algorithm = AlgorithmConfig(
        inner_steps=4, uplink_codec="int8", downlink_codec="int8",
        streaming=StreamingConfig(enabled=True, fragments=2, overlap_steps=1),
    )
    rounds = 4
    run = Run(workload=_SlowSite(mlp, slow_site=2, sleep_s=2.0), num_sites=3, rounds=rounds, seed=6,
              algorithm=algorithm)
    metrics = tmp_path / "metrics.jsonl"
    server = run.start_coordinator(
        certs, metrics_path=str(metrics), min_sites=2, round_deadline_s=1.0, adaptive_deadline=adaptive
    )
    threads = [AgentThread(run.agent(certs, server.port, k)) for k in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.finish(timeout_s=120)
        assert server.wait_until_finished(30)
    finally:
        server.stop(grace=0)
    real = read_metrics(metrics)

    sim_config = SimulatorConfig(
        algorithm=algorithm,
        inner_optimizer=run.inner,
        sites=[SiteConfig(), SiteConfig(), SiteConfig(speed_factor=1e-4)],
        simulation=SimulationConfig(
            rounds=rounds, seed=run.seed, device="cpu", eval_every=10**6, step_time_s=0.01,
            min_sites=2, round_deadline_s=1.0, adaptive_deadline=adaptive,
        ),
    )
    simulator = Simulator(sim_config, mlp)
    predicted = list(simulator.run())

    assert [r["excluded"] for r in real] == [["2"]] * rounds
    assert [r.excluded for r in predicted] == [["2"]] * rounds
    assert [r["deadline_s"] for r in real] == [r.deadline_s for r in predicted] == [1.0, 2.0, 2.0, 2.0]
    assert [r["fragment"] for r in real] == [r.fragment for r in predicted] == [0, 1, 0, 1]
    assert torch.equal(server.rounds.weights, simulator.global_flat)

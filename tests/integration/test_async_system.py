"""Asynchronous (decoupled) DiLoCo through the real system: gRPC, mutual TLS, threads per site.

Three site agents against a coordinator with ``[algorithm.asynchronous]`` (quorum 1, no grace
window), one site ten times slower than the others (a pause per batch): nobody waits at a
barrier, so the fast sites enter more merges than the slow one, the slow site's updates arrive
computed from older versions and enter with the staleness discount the records state, and every
replica ends on the coordinator's weights.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from _cluster import AgentThread, Run, make_certs, poison_update, run_to_end

from geoloco.algorithms.async_merge import AsyncConfig
from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
from geoloco.algorithms.simulation.async_sim import DecoupledSimulator
from geoloco.algorithms.simulation.clock import SiteConfig
from geoloco.algorithms.simulation.sim_config import SimulationConfig, SimulatorConfig
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.algorithms.streaming import StreamingConfig
from geoloco.coordinator.metrics import read_metrics
from geoloco.coordinator.server import CoordinatorServer
from geoloco.scenarios.workloads import build_workload
from geoloco.site_agent.agent import SiteAgent, SiteRunSummary
from geoloco.site_agent.async_rounds import REBASED_AT_STEP
from geoloco.site_agent.persist import SiteStateStore

SLOW_PAUSE_S = 0.03
"""Seconds the slow site pauses per batch (its phase of 4 steps takes about 0.12 s longer)."""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"), ["0", "1", "2"])


def _run_sites(
    run: Run, certs: Path, metrics: Path, pauses: Sequence[float], *,
    prepare: Callable[[list[SiteAgent]], None] | None = None, **coordinator: Any,
) -> tuple[list[SiteRunSummary], list[dict[str, Any]], CoordinatorServer]:
    """The coordinator and one agent thread per site (site ``k`` pausing ``pauses[k]`` seconds
    per batch) until the run ends: the sites' summaries, the coordinator's records, the server.
    ``prepare``: called with the agents before they start (a test's hooks)."""
    server = run.start_coordinator(certs, metrics_path=str(metrics), **coordinator)
    agents = [run.agent(certs, server.port, k, pause_s=pause) for k, pause in enumerate(pauses)]
    if prepare is not None:
        prepare(agents)
    return run_to_end(server, agents, finish_s=120), read_metrics(metrics), server


def test_sites_never_wait_for_each_other_and_stale_updates_are_discounted(certs: Path, tmp_path: Path) -> None:
    merge = AsyncConfig(enabled=True, min_quorum=1, max_staleness=6, discount_per_version=0.5)
    run = Run(
        workload=build_workload("mlp"), num_sites=3, rounds=12, seed=3,
        algorithm=AlgorithmConfig(inner_steps=4, uplink_codec="int8", asynchronous=merge),
    )
    summaries, records, server = _run_sites(
        run, certs, tmp_path / "metrics.jsonl", [0.0, 0.0, SLOW_PAUSE_S], min_sites=1
    )
    assert [r["round"] for r in records] == list(range(run.rounds))
    assert all(s.run_finished for s in summaries)
    assert {s.weights_digest for s in summaries} == {server.rounds.digest_hex}

    entered = Counter(site for r in records for site in r["participants"])
    assert entered["0"] + entered["1"] > 2 * entered["2"], entered
    for record in records:
        staleness = record["staleness"]
        assert set(staleness) == set(record["participants"])
        for site, behind in staleness.items():
            assert 0 <= behind <= merge.max_staleness
            # uniform weighting: every update weighs 1 before the discount
            assert record["sample_weights"][site] == pytest.approx(0.5**behind)
    assert any(behind > 0 for r in records for behind in r["staleness"].values())
    assert all(r["excluded"] == [] for r in records)  # a site that has not sent is not left out


def test_what_asynchronous_merges_refuse_is_named(certs: Path) -> None:
    merge = AsyncConfig(enabled=True)
    run = Run(workload=build_workload("mlp"), num_sites=2, rounds=2)
    with pytest.raises(ConfigError, match="cohort"):
        run.coordinator_config(
            certs, algorithm=AlgorithmConfig(asynchronous=merge),
            privacy=PrivacyConfig(secure_aggregation=True, clip_norm=1.0),
        )
    with pytest.raises(ConfigError, match="relays"):
        run.coordinator_config(
            certs, algorithm=AlgorithmConfig(asynchronous=merge), relays={"eu": ["0", "1"]},
        )
    with pytest.raises(ConfigError, match="round deadline"):
        run.coordinator_config(certs, algorithm=AlgorithmConfig(asynchronous=merge), round_deadline_s=5.0)
    with pytest.raises(ConfigError, match="asynchronous.enabled.*Streaming"):
        AlgorithmConfig(asynchronous=merge, streaming=StreamingConfig(enabled=True, fragments=2))


def test_a_fixed_arrival_order_ends_on_the_simulators_weights_bit_for_bit(certs: Path, tmp_path: Path) -> None:
    """Two sites of equal speed, every merge waits for both (min_quorum 2): the first merge takes
    both updates computed from version 0, each later one both updates computed one merge back
    (a site goes on from the model it holds while its update travels and the merge runs). That
    is the order the event-driven simulator derives for real links, and both end on the same
    weights bit for bit. A phase (4 steps, 25 ms pause each) outlasts an upload, a merge and a
    broadcast on loopback; the test checks the order the coordinator recorded before it
    compares weights."""
    merge = AsyncConfig(enabled=True, min_quorum=2)
    algorithm = AlgorithmConfig(inner_steps=4, uplink_codec="int8", downlink_codec="int8", asynchronous=merge)
    run = Run(workload=build_workload("mlp"), num_sites=2, rounds=6, seed=5, algorithm=algorithm)
    summaries, records, server = _run_sites(run, certs, tmp_path / "metrics.jsonl", [0.025, 0.025])
    assert [r["staleness"] for r in records] == [{"0": 0, "1": 0}] + [{"0": 1, "1": 1}] * (run.rounds - 1)
    assert {s.weights_digest for s in summaries} == {server.rounds.digest_hex}

    config = SimulatorConfig(
        algorithm=algorithm, inner_optimizer=run.inner, sites=[SiteConfig() for _ in range(2)],
        simulation=SimulationConfig(rounds=run.rounds, seed=run.seed, device="cpu", eval_every=10**6),
    )
    simulator = DecoupledSimulator(config, run.workload)
    simulated = list(simulator.run())
    assert [r.staleness for r in simulated] == [r["staleness"] for r in records]
    assert [r.weights_digest for r in simulated] == [r["weights_digest"] for r in records]
    assert torch.equal(server.rounds.weights, simulator.global_flat)


def test_with_rebase_merges_enter_running_phases_as_the_simulator_takes_them_in(certs: Path, tmp_path: Path) -> None:
    """``rebase``, two sites of equal speed, merges of both: a merge's broadcast reaches each
    site during the first step of its next phase (0.4 s per step, far longer than an upload, a
    merge and a broadcast on loopback), so each site takes it in before its second step and its
    update is measured from the model it is merged into: no update is stale, where without
    rebase every later one is one merge stale (the test above). The simulator takes the
    broadcast in at the same step boundary and ends on the same weights bit for bit. The test
    checks the step boundaries the sites reported before it compares weights."""
    merge = AsyncConfig(enabled=True, min_quorum=2, rebase=True)
    algorithm = AlgorithmConfig(inner_steps=3, uplink_codec="int8", downlink_codec="int8", asynchronous=merge)
    run = Run(workload=build_workload("mlp"), num_sites=2, rounds=4, seed=5, algorithm=algorithm)
    summaries, records, server = _run_sites(run, certs, tmp_path / "metrics.jsonl", [0.4, 0.4])
    assert [r["staleness"] for r in records] == [{"0": 0, "1": 0}] * run.rounds
    rebased = [{site: m.get(REBASED_AT_STEP) for site, m in r["site_metrics"].items()} for r in records]
    assert rebased == [{"0": None, "1": None}] + [{"0": 1.0, "1": 1.0}] * (run.rounds - 1)
    assert {s.weights_digest for s in summaries} == {server.rounds.digest_hex}

    config = SimulatorConfig(
        algorithm=algorithm, inner_optimizer=run.inner, sites=[SiteConfig() for _ in range(2)],
        simulation=SimulationConfig(rounds=run.rounds, seed=run.seed, device="cpu", eval_every=10**6,
                                    step_time_s=0.4),
    )
    simulator = DecoupledSimulator(config, run.workload)
    simulated = list(simulator.run())
    assert [r.staleness for r in simulated] == [r["staleness"] for r in records]
    assert [r.weights_digest for r in simulated] == [r["weights_digest"] for r in records]


def test_dynamic_local_updates_size_each_sites_phases_by_its_speed(certs: Path, tmp_path: Path) -> None:
    """With ``dynamic_local_updates`` every broadcast carries the fastest site's seconds per step
    and a site four or more times slower runs about H/4 steps per phase once it measured itself
    (its first phase is a full H)."""
    merge = AsyncConfig(enabled=True, min_quorum=1, dynamic_local_updates=True)
    run = Run(
        workload=build_workload("mlp"), num_sites=2, rounds=16, seed=3,
        algorithm=AlgorithmConfig(inner_steps=8, asynchronous=merge),
    )
    summaries, records, server = _run_sites(run, certs, tmp_path / "metrics.jsonl", [0.002, 0.04], min_sites=1)
    assert {s.weights_digest for s in summaries} == {server.rounds.digest_hex}
    steps = [(r["round"], r["inner_steps"]) for r in records]
    slow = [n["1"] for _, n in steps if "1" in n]
    fast = [n["0"] for _, n in steps if "0" in n]
    assert slow[0] == 8 and len(slow) >= 2 and max(slow[1:]) <= 4, steps
    assert max(fast) == 8, steps


def test_a_restarted_asynchronous_site_resumes_from_its_saved_state(certs: Path, tmp_path: Path) -> None:
    """With a ``state_dir`` an asynchronous site saves its state (weights, inner optimizer, data
    position, residual) after a hand-off, at most every few seconds, and when it stops; a new
    process of it resumes from there instead of from the first batch, and ends on the
    coordinator's weights."""
    merge = AsyncConfig(enabled=True, min_quorum=1)
    run = Run(
        workload=build_workload("mlp"), num_sites=1, rounds=8, seed=2,
        algorithm=AlgorithmConfig(inner_steps=4, uplink_codec="int8", asynchronous=merge),
    )
    server = run.start_coordinator(certs, min_sites=1)
    state_dir = tmp_path / "site-state"

    try:
        first = run.agent(certs, server.port, 0, state_dir=state_dir).run(max_rounds=3)
        assert not first.run_finished
        saved = SiteStateStore(state_dir).load()
        assert saved is not None and saved.meta["runner"]["uplink"] is not None
        assert saved.meta["trainer"]["batches_drawn"] >= 12  # at least three phases of 4 steps
        second = AgentThread(run.agent(certs, server.port, 0, state_dir=state_dir))
        second.start()
        summary = second.finish(60)
        assert server.wait_until_finished(30)
    finally:
        server.stop(grace=0)
    assert summary.run_finished and summary.weights_digest == server.rounds.digest_hex


def test_an_update_the_guard_refuses_is_dropped_and_the_site_counts_again(certs: Path, tmp_path: Path) -> None:
    """Site 1's first update is far beyond the update guard's norm floor and is refused. The
    site used to keep it in its error-feedback residual, so every later update carried it and
    was refused too: the site never counted again. It now drops it with the residual, as the
    simulator does, and its next updates enter merges."""
    merge = AsyncConfig(enabled=True, min_quorum=1)
    run = Run(
        workload=build_workload("mlp"), num_sites=3, rounds=10, seed=3,
        algorithm=AlgorithmConfig(inner_steps=4, uplink_codec="int8", asynchronous=merge),
    )
    summaries, records, server = _run_sites(
        run, certs, tmp_path / "metrics.jsonl", [0.01] * 3, min_sites=1,
        prepare=lambda agents: poison_update(agents[1], 1e7),
    )
    assert {s.weights_digest for s in summaries} == {server.rounds.digest_hex}
    # (A refusal may leave no trace on its merge's record: the site's next update may enter the
    # same merge, which then counts it.) Kept, the refused update went up inside every later one.
    assert any("1" in r["participants"] for r in records), [r["rejected"] for r in records]
    assert float(server.rounds.weights.abs().max()) < 10.0

"""Heterogeneous sites over real gRPC + mutual TLS on loopback (coordinator on port 0, agents in
threads): time-budget rounds weighted by steps, late updates folded into the next round, and the
adaptive deadline in the metrics."""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from _agent_helpers import AgentThread, FakeClock, make_agent, make_certs, start_coordinator, wait_until
from torch import nn

from geoloco.algorithms.deadline import AdaptiveDeadlineConfig
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.algorithms.time_budget import run_inner_steps_within, steps_in_budget
from geoloco.coordinator.metrics import read_metrics
from geoloco.scenarios.throttle import ComputeThrottle
from geoloco.scenarios.workloads import build_workload
from geoloco.site_agent import trainer as trainer_module
from geoloco.site_agent.client import CoordinatorClient, RoundClosed
from geoloco.site_agent.config import RoundResult, SiteHooks

SITES = ["fast", "slow"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"), SITES)


@pytest.fixture(scope="module")
def mlp() -> Any:
    return build_workload("mlp")


STEP_S = 0.007
"""Virtual compute seconds of one inner step at 1x (see ``ThreadClocks``)."""
BUDGET_S = 0.3


class ThreadClocks:
    """A virtual clock per thread. Two site threads sharing a loaded machine's cores run at
    whatever pace the scheduler gives them, so steps counted against the wall clock say more
    about the machine than about the sites; on these clocks a step costs ``STEP_S`` (charged by
    the loss) and a throttle's sleep advances the clock instead of waiting."""

    def __init__(self) -> None:
        self._local = threading.local()

    def now(self) -> float:
        return float(getattr(self._local, "now", 0.0))

    def advance(self, seconds: float) -> None:
        self._local.now = self.now() + seconds

    def charged(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def loss(*args: Any, **kwargs: Any) -> torch.Tensor:
            self.advance(STEP_S)
            return loss_fn(*args, **kwargs)

        return loss


def test_time_budget_rounds_weight_sites_by_steps(
    certs: Path, mlp: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1x and a 0.25x site (``ComputeThrottle``, as ``geoloco site --speed-factor``) train for
    a 0.3 s budget per round; each reports its steps and the coordinator weights by them. The
    adaptive deadline starts at max_s and is re-planned from the arrivals."""
    clocks = ThreadClocks()
    # The budget is measured on the site thread's virtual clock (the trainer's default is wall time).
    monkeypatch.setattr(trainer_module, "run_inner_steps_within", partial(run_inner_steps_within, clock=clocks.now))
    metrics_path = tmp_path / "metrics.jsonl"
    server = start_coordinator(
        certs,
        mlp.build_model(0),
        algorithm=AlgorithmConfig(
            inner_steps=1000, uplink_codec="int8", weighting="steps", round_time_budget_s=BUDGET_S
        ),
        # min_s far above what a round takes even on a loaded machine: the re-planned deadline is min_s.
        adaptive_deadline=AdaptiveDeadlineConfig(enabled=True, min_s=30.0, max_s=120.0),
        total_rounds=3,
        min_sites=2,
        heartbeat_timeout_s=600.0,
        metrics_path=str(metrics_path),
    )
    results: dict[str, list[RoundResult]] = {site: [] for site in SITES}
    throttles = {site: ComputeThrottle(1.0 if site == "fast" else 0.25, clock=clocks.now, sleep=clocks.advance)
                 for site in SITES}
    threads = []
    try:
        for index, site in enumerate(SITES):
            throttle = throttles[site]
            agent = make_agent(
                mlp, server, certs, site, index=index, num_sites=2, seed=0,
                hooks=SiteHooks(on_round_end=results[site].append),
                loss_fn=throttle.wrap_loss(clocks.charged(mlp.loss)),
            )
            throttle.attach(agent.optimizer)
            threads.append(AgentThread(agent))
        for t in threads:
            t.start()
        summaries = {t.agent.site: t.finish(120) for t in threads}
        assert server.wait_until_finished(30)
    finally:
        server.stop(grace=0)
    assert {s.weights_digest for s in summaries.values()} == {server.rounds.digest_hex}
    # As many steps as fit in the budget: 0.3 s of 7 ms steps at 1x, of 28 ms steps at 0.25x
    # (the throttle sleeps 3x each step's compute).
    expected = {"fast": 42, "slow": 10}
    assert expected == {"fast": steps_in_budget(BUDGET_S, STEP_S), "slow": steps_in_budget(BUDGET_S, 4 * STEP_S)}
    assert throttles["slow"].slept_s == pytest.approx(3 * throttles["slow"].compute_s)
    records = read_metrics(metrics_path)
    assert [r["round"] for r in records] == [0, 1, 2]
    for record in records:
        assert sorted(record["participants"]) == SITES
        assert record["inner_steps"] == expected
        # The weight of each update is the number of inner steps its site reported.
        assert record["sample_weights"] == {site: float(n) for site, n in expected.items()}
    for site in SITES:
        assert [r.inner_steps for r in results[site]] == [expected[site]] * 3
        assert throttles[site].steps == 3 * expected[site]
    # Round 0 runs under max_s (nothing observed yet); later rounds under the learnt deadline,
    # bounded below by min_s.
    assert records[0]["deadline_s"] == 120.0
    assert records[1]["deadline_s"] == 30.0 and records[0]["next_deadline_s"] == 30.0
    assert all(set(r["arrival_s"]) == set(SITES) for r in records)


def test_late_update_is_folded_into_the_next_round(certs: Path, mlp: Any, tmp_path: Path) -> None:
    """Round 0 closes at its deadline without "slow"; its update, one round late, enters round 1
    with weight 1 x staleness_discount, and its round-0 result says it was included."""
    clock = FakeClock()
    metrics_path = tmp_path / "metrics.jsonl"
    server = start_coordinator(
        certs,
        mlp.build_model(0),
        algorithm=AlgorithmConfig(
            inner_steps=3, uplink_codec="int8", late_updates="fold", staleness_discount=0.5
        ),
        total_rounds=2,
        min_sites=1,
        round_deadline_s=10.0,
        heartbeat_timeout_s=600.0,
        metrics_path=str(metrics_path),
        clock=clock,
    )
    release = threading.Event()

    def slow_loss(model: nn.Module, batch: Any) -> torch.Tensor:
        release.wait(60)  # held in round 0 until the coordinator closed it without us
        return mlp.loss(model, batch)

    results: dict[str, list[RoundResult]] = {site: [] for site in SITES}
    threads = []
    try:
        for index, site in enumerate(SITES):
            agent = make_agent(
                mlp, server, certs, site, index=index, num_sites=2, seed=0,
                hooks=SiteHooks(on_round_end=results[site].append),
                loss_fn=slow_loss if site == "slow" else None,
            )
            threads.append(AgentThread(agent))
        for t in threads:
            t.start()
        wait_until(lambda: server.rounds.status()["contributed"] == ["fast"], server)
        clock.now += 11.0  # past round 0's deadline
        server.rounds.wake()
        wait_until(lambda: server.rounds.round >= 1, server)
        release.set()
        summaries = {t.agent.site: t.finish() for t in threads}
        assert server.wait_until_finished(30)
    finally:
        release.set()
        server.stop(grace=0)
    records = read_metrics(metrics_path)
    assert records[0]["excluded"] == ["slow"] and records[0]["deadline_hit"]
    assert records[0]["folded_late"] == {}
    assert records[1]["folded_late"] == {"slow": 0.5}
    assert sorted(records[1]["participants"]) == SITES
    # Folded, the update is not also put back into the residual: the site counts it included.
    assert [r.included for r in results["slow"]] == [True, True]
    assert summaries["slow"].rounds_included == 2
    assert {s.weights_digest for s in summaries.values()} == {server.rounds.digest_hex}


def test_a_late_update_arriving_while_its_round_aggregates_is_folded_once_the_next_opens(
    certs: Path, mlp: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The usual straggler finishes while the coordinator is still aggregating the round it
    missed (here held inside the checkpoint write): refused then, it is offered again once that
    round's broadcast shows the next round open, and folded in."""
    clock = FakeClock()
    metrics_path = tmp_path / "metrics.jsonl"
    server = start_coordinator(
        certs,
        mlp.build_model(0),
        algorithm=AlgorithmConfig(
            inner_steps=3, uplink_codec="int8", late_updates="fold", staleness_discount=0.5
        ),
        total_rounds=2,
        min_sites=1,
        round_deadline_s=10.0,
        heartbeat_timeout_s=600.0,
        metrics_path=str(metrics_path),
        checkpoint_dir=str(tmp_path / "ck"),
        clock=clock,
    )
    rounds = server.rounds
    save = rounds.phases.make_durable
    in_checkpoint, leave_checkpoint = threading.Event(), threading.Event()

    def slow_save(round_number: int, *args: Any, **kwargs: Any) -> Any:
        if round_number == 0:  # the checkpoint taken while aggregating round 0
            in_checkpoint.set()
            leave_checkpoint.wait(60)
        return save(round_number, *args, **kwargs)

    rounds.phases.make_durable = slow_save  # type: ignore[method-assign]
    release = threading.Event()
    # "slow"'s upload refused as too late: it keeps the update to fold in once round 0's
    # broadcast (held in the checkpoint write) shows round 1 open.
    refused_late = threading.Event()
    upload = CoordinatorClient.upload

    def watched_upload(self: CoordinatorClient, **kwargs: Any) -> Any:
        try:
            return upload(self, **kwargs)
        except RoundClosed:
            if self.site == "slow":
                refused_late.set()
            raise

    monkeypatch.setattr(CoordinatorClient, "upload", watched_upload)

    def slow_loss(model: nn.Module, batch: Any) -> torch.Tensor:
        release.wait(60)
        return mlp.loss(model, batch)

    results: dict[str, list[RoundResult]] = {site: [] for site in SITES}
    agents = {
        site: make_agent(
            mlp, server, certs, site, index=index, num_sites=2, seed=0,
            hooks=SiteHooks(on_round_end=results[site].append),
            loss_fn=slow_loss if site == "slow" else None,
        )
        for index, site in enumerate(SITES)
    }
    threads = [AgentThread(agent) for agent in agents.values()]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: rounds.status()["contributed"] == ["fast"], server)
        clock.now += 11.0  # past round 0's deadline: it closes without "slow"
        rounds.wake()
        assert in_checkpoint.wait(30), "round 0 never reached its checkpoint"
        release.set()  # "slow" finishes and uploads while round 0 is still aggregating
        assert refused_late.wait(30), "\"slow\"'s upload was never refused as late"
        leave_checkpoint.set()
        summaries = {t.agent.site: t.finish() for t in threads}
        assert server.wait_until_finished(30)
    finally:
        release.set()
        leave_checkpoint.set()
        server.stop(grace=0)
    records = read_metrics(metrics_path)
    assert records[0]["excluded"] == ["slow"]
    assert records[1]["folded_late"] == {"slow": 0.5}
    assert [r.included for r in results["slow"]] == [True, True]
    assert {s.weights_digest for s in summaries.values()} == {server.rounds.digest_hex}

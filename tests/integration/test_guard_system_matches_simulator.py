"""A poisoned site against the update guard: the real coordinator (gRPC over loopback, mutual TLS)
and the simulator run the same round engine, so the simulator predicts the rounds the
coordinator aborts, and both end on the same weights bit for bit.

The real site agent has no attack setting (a research hook of the simulator only), so the
poisoned site here is an honest agent whose uplink scales its pseudo-gradient before encoding,
exactly what the simulator's ``attack = "scale:F"`` does to a site's upload.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _cluster import Run, make_certs, poison_update, run_to_end

from geoloco.algorithms.simulation.clock import SiteConfig
from geoloco.algorithms.simulation.simulator import SimulationConfig, Simulator, SimulatorConfig
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.algorithms.update_guard import UpdateGuardConfig
from geoloco.coordinator.metrics import read_metrics
from geoloco.scenarios.workloads import build_workload
from geoloco.site_agent.agent import SiteAgent
from geoloco.site_agent.config import JoinInfo

FACTOR = 1000.0
"""The poisoned site's scale: its update stays under the norm floor but its mean pushes the
weights beyond ``max_abs_weight``."""
GUARD = UpdateGuardConfig(max_abs_weight=2.0)


def poison(agent: SiteAgent, factor: float) -> None:
    """Make ``agent`` upload ``factor`` times its pseudo-gradient from its first round on."""

    def on_join(info: JoinInfo) -> None:
        uplink = agent._rounds.uplink  # type: ignore[union-attr]
        encode = uplink.encode
        if getattr(encode, "poisoned", False):
            return

        def scaled(update: torch.Tensor, **kwargs: object) -> object:
            return encode(update * factor, **kwargs)

        scaled.poisoned = True  # type: ignore[attr-defined]
        uplink.encode = scaled  # type: ignore[method-assign]

    agent.hooks.on_join = on_join


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"), ["0", "1"])


@pytest.fixture(scope="module")
def certs3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs3"), ["0", "1", "2"])


def _two_site_run(rounds: int) -> Run:
    """Two sites of the small MLP, dense both ways and without error feedback, so an update the
    guard refuses or a round it aborts leaves nothing behind in a residual."""
    return Run(
        workload=build_workload("mlp"),
        num_sites=2,
        rounds=rounds,
        seed=5,
        algorithm=AlgorithmConfig(inner_steps=3, uplink_codec="none", downlink_codec="none", error_feedback=False),
    )


def _guarded_simulator(run: Run, sites: list[SiteConfig]) -> Simulator:
    """The simulator of ``run`` on ``sites`` under the coordinator's guard (``GUARD``)."""
    config = SimulatorConfig(
        algorithm=run.algorithm,
        inner_optimizer=run.inner,
        sites=sites,
        simulation=SimulationConfig(rounds=run.rounds, seed=run.seed, device="cpu", eval_every=10**6),
        update_guard=GUARD,
    )
    return Simulator(config, run.workload)


def test_rounds_the_guard_aborts_are_aborted_by_the_simulator_too(certs: Path, tmp_path: Path) -> None:
    run = _two_site_run(rounds=3)
    metrics = tmp_path / "metrics.jsonl"
    server = run.start_coordinator(certs, metrics_path=str(metrics), update_guard=GUARD)
    initial = server.rounds.weights.clone()
    agents = [run.agent(certs, server.port, k) for k in range(2)]
    poison(agents[1], FACTOR)
    summaries = run_to_end(server, agents)
    assert {s.weights_digest for s in summaries} == {server.rounds.digest_hex}
    records = read_metrics(metrics)

    simulator = _guarded_simulator(run, [SiteConfig(), SiteConfig(attack=f"scale:{FACTOR}")])
    predicted = list(simulator.run())

    assert [r["aborted"] is not None for r in records] == [r.aborted is not None for r in predicted] == [True] * 3
    for real, sim in zip(records, predicted, strict=True):
        # The same reason; how the outer state was rewound is each host's own clause.
        assert real["aborted"].split(";")[0] == sim.aborted.split(";")[0]
        assert "beyond max_abs_weight" in sim.aborted
        assert real["participants"] == sim.participants == []
    # Every round aborted: the model is unchanged, on both, bit for bit.
    assert torch.equal(server.rounds.weights, simulator.global_flat)
    assert torch.equal(simulator.global_flat, initial)


def test_without_the_guards_bound_the_same_rounds_go_through() -> None:
    """The control: with the default bounds the poisoned updates pass, so the weights move (the
    abort above is the guard's doing, not an artefact of the set-up)."""
    workload = build_workload("mlp")
    config = SimulatorConfig(
        algorithm=AlgorithmConfig(inner_steps=3, uplink_codec="none", downlink_codec="none", error_feedback=False),
        sites=[SiteConfig(), SiteConfig(attack=f"scale:{FACTOR}")],
        simulation=SimulationConfig(rounds=1, seed=5, device="cpu", eval_every=10**6),
    )
    simulator = Simulator(config, workload)
    before = simulator.global_flat.clone()
    (record,) = list(simulator.run())
    assert record.aborted is None and record.participants == ["0", "1"]
    assert not torch.equal(simulator.global_flat, before)
    assert float(simulator.global_flat.abs().max()) > GUARD.max_abs_weight


class _RoundScaled:
    """The simulator's uplinks with ``site``'s update of round ``at`` scaled by ``factor`` (what
    ``poison_update`` does to a real site's update number ``at + 1``); everything else delegated."""

    def __init__(self, inner: Any, site: str, factor: float, at: int = 0) -> None:
        self.inner, self.site, self.factor, self.at = inner, site, factor, at

    def encode(self, site: str, update: torch.Tensor, plan: Any, aggregation: Any) -> Any:
        if site == self.site and plan.round == self.at:
            update = update * self.factor
        return self.inner.encode(site, update, plan, aggregation)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_refused_update_is_dropped_and_an_aborted_rounds_updates_are_kept_as_the_simulator_does(
    certs3: Path, tmp_path: Path
) -> None:
    """Error feedback decides what becomes of an update its round did not aggregate. Site 1's
    first update is far beyond the guard's norm floor: refused, and with every site needed
    (min_sites = 3) the round aborts, so sites 0 and 2 counted for nothing. The real site kept
    every update that was not aggregated in its residual, the refused one too, and sent it again
    inside the next one, refused again, round after round (every round aborted); the simulator
    dropped the refused update but kept what int8 left of it in the residual, and dropped the
    aborted round's counted ones. Now both drop the refused update with its residual
    (``BroadcastHeader.refused``) and keep the aborted round's others, and end on the same
    weights bit for bit."""
    run = Run(
        workload=build_workload("mlp"),
        num_sites=3,
        rounds=3,
        seed=5,
        algorithm=AlgorithmConfig(inner_steps=3, uplink_codec="int8", downlink_codec="none"),
    )
    factor = 1e7
    metrics = tmp_path / "metrics.jsonl"
    server = run.start_coordinator(certs3, metrics_path=str(metrics))
    agents = [run.agent(certs3, server.port, k) for k in range(3)]
    poison_update(agents[1], factor)
    summaries = run_to_end(server, agents, wait_s=60)
    assert {s.weights_digest for s in summaries} == {server.rounds.digest_hex}
    records = read_metrics(metrics)

    config = SimulatorConfig(
        algorithm=run.algorithm,
        inner_optimizer=run.inner,
        sites=[SiteConfig() for _ in range(3)],
        simulation=SimulationConfig(rounds=run.rounds, seed=run.seed, device="cpu", eval_every=10**6, min_sites=3),
    )
    simulator = Simulator(config, run.workload)
    simulator.uplinks = _RoundScaled(simulator.uplinks, "1", factor)  # type: ignore[assignment]
    predicted = list(simulator.run())

    assert [r["aborted"] is not None for r in records] == [r.aborted is not None for r in predicted]
    assert [r.aborted is not None for r in predicted] == [True, False, False]
    assert records[0]["rejected"] == predicted[0].rejected == ["1"]
    for real, sim in zip(records[1:], predicted[1:], strict=True):
        assert sorted(real["participants"]) == sorted(sim.participants) == ["0", "1", "2"]
    assert torch.equal(server.rounds.weights, simulator.global_flat)
    # Nothing of the refused update is left: its residual (what int8 dropped of 1e7 times the
    # update) was dropped with it.
    assert float(server.rounds.weights.abs().max()) < 10.0


@pytest.mark.parametrize("checkpoints", [True, False], ids=["checkpointed", "without-checkpoints"])
def test_a_step_thrown_away_rewinds_the_outer_state_alike_on_every_host(
    certs: Path, tmp_path: Path, checkpoints: bool
) -> None:
    """Round 0 moves the weights and gives the outer momentum a value; site 1's second update
    pushes round 1's new weights beyond ``max_abs_weight``, so that step is thrown away after it
    ran and the momentum goes back to what it was with the unchanged weights: from the
    coordinator's checkpoint of them, or without checkpoints (and in the simulator) from the
    copy the round engine kept across the step. The simulator predicts the rounds after it, bit
    for bit."""
    run = _two_site_run(rounds=4)
    metrics = tmp_path / "metrics.jsonl"
    server = run.start_coordinator(
        certs, metrics_path=str(metrics), update_guard=GUARD,
        checkpoint_dir=str(tmp_path / "checkpoints") if checkpoints else None,
    )
    agents = [run.agent(certs, server.port, k) for k in range(2)]
    poison_update(agents[1], FACTOR, nth=2)
    summaries = run_to_end(server, agents)
    assert {s.weights_digest for s in summaries} == {server.rounds.digest_hex}
    records = read_metrics(metrics)

    simulator = _guarded_simulator(run, [SiteConfig(), SiteConfig()])
    simulator.uplinks = _RoundScaled(simulator.uplinks, "1", FACTOR, at=1)  # type: ignore[assignment]
    predicted = list(simulator.run())

    assert [r["aborted"] is not None for r in records] == [r.aborted is not None for r in predicted]
    assert [r.aborted is not None for r in predicted] == [False, True, False, False]
    assert torch.equal(server.rounds.weights, simulator.global_flat)
    assert "beyond max_abs_weight" in predicted[1].aborted
    rewound = "restored from the checkpoint" if checkpoints else "put back as it was before the step"
    assert rewound in records[1]["aborted"]
    assert "put back as it was before the step" in predicted[1].aborted

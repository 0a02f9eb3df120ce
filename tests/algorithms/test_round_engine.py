"""The round engine on its own (no socket, no clock): admission with the guard's reasons, a
pluggable close policy, late folding, the guarded step with abort and rewind; and the simulator
driving it (a poisoned site's update rejected by the norm bound, as the coordinator rejects it)."""

from __future__ import annotations

from collections.abc import Collection

import pytest
import torch

from geoloco.algorithms.aggregation import RunningSum
from geoloco.algorithms.engine import NOT_FINITE, UNSCREENED, RoundEngine, Screen
from geoloco.algorithms.round import CloseDecision, Round, RoundPolicy
from geoloco.algorithms.simulation.clock import SiteConfig
from geoloco.algorithms.simulation.simulator import SimulationConfig, Simulator, SimulatorConfig
from geoloco.algorithms.strategy import AlgorithmConfig, Strategy, build_strategy
from geoloco.algorithms.update_guard import UpdateGuard, UpdateGuardConfig
from geoloco.scenarios.workloads import build_workload

NUMEL = 8


def strategy() -> Strategy:
    return build_strategy(AlgorithmConfig(uplink_codec="none", downlink_codec="none"), numel=NUMEL, seed=0)


def engine(guard: UpdateGuardConfig | None = None, **policy: object) -> RoundEngine:
    return RoundEngine(
        strategy(), RoundPolicy(**policy), UpdateGuard(guard or UpdateGuardConfig()),  # type: ignore[arg-type]
        fresh_strategy=strategy,
    )


def test_admission_rejects_with_the_reason_and_the_rejection_counts_for_the_close() -> None:
    e = engine(UpdateGuardConfig(norm_floor=5.0))
    round_ = e.open(0, RunningSum(NUMEL), 0.0)
    assert e.maybe_start(round_, 0.0, members=3)
    ok = e.admit(round_, "a", torch.ones(NUMEL), 1.0, screen=Screen.of(torch.ones(NUMEL)), now=1.0)
    huge = torch.full((NUMEL,), 10.0)
    big = e.admit(round_, "b", huge, 1.0, screen=Screen.of(huge), now=2.0)
    nan = torch.full((NUMEL,), float("nan"))
    bad = e.admit(round_, "c", nan, 1.0, screen=Screen.of(nan), now=3.0)
    assert ok.verdict == "accepted" and big.verdict == bad.verdict == "rejected"
    assert big.reason is not None and "exceeds the bound 5" in big.reason and bad.reason == NOT_FINITE
    assert round_.rejected == {"b": big.reason, "c": NOT_FINITE}
    # Every member has answered (one accepted, two rejected): the round closes.
    assert e.decide(round_, now=3.0, expected=["a", "b", "c"]).close
    outcome = e.close(round_, now=3.0, expected=["a", "b", "c"])
    assert outcome.contributors == ("a",) and outcome.rejected == round_.rejected and outcome.excluded == ()


def test_a_weight_beyond_the_bound_is_refused_before_any_bytes() -> None:
    e = engine(UpdateGuardConfig(max_sample_weight=10.0))
    why = e.screen(UNSCREENED, weights=[("sample_weight", 11.0)])
    assert why is not None and "max_sample_weight" in why
    assert e.screen(UNSCREENED, weights=[("sample_weight", 10.0)]) is None


class EveryoneOrNothing:
    """A close rule of the test's own: the engine takes it without changing."""

    def may_start(self, members: int) -> bool:
        return members >= 2

    def decide_round(self, round_: Round, *, now: float, expected: Collection[str]) -> CloseDecision:
        return CloseDecision(close=set(round_.contributed) >= set(expected))


def test_a_close_policy_plugs_in_without_touching_the_engine() -> None:
    e = RoundEngine(strategy(), RoundPolicy(), None, close=EveryoneOrNothing())
    round_ = e.open(0, RunningSum(NUMEL), 0.0)
    assert not e.maybe_start(round_, 0.0, members=1) and not round_.started
    assert e.maybe_start(round_, 1.0, members=2) and round_.started
    e.admit(round_, "a", torch.ones(NUMEL), 1.0, screen=UNSCREENED, now=2.0)
    assert not e.decide(round_, now=100.0, expected=["a", "b"]).close
    e.admit(round_, "b", torch.ones(NUMEL), 1.0, screen=UNSCREENED, now=3.0)
    assert e.decide(round_, now=3.0, expected=["a", "b"]).close


def test_late_updates_fold_once_with_the_discount_and_only_one_round_late() -> None:
    e = engine(late_updates="fold", staleness_discount=0.25)
    assert e.late_foldable(3, 4, counted=False)
    assert not e.late_foldable(3, 4, counted=True) and not e.late_foldable(2, 4, counted=False)
    assert not engine().late_foldable(3, 4, counted=False), "drop: nothing is folded"
    round_ = e.open(4, RunningSum(NUMEL), 0.0)
    folded = e.fold_late(round_, "slow", torch.ones(NUMEL), 4.0, screen=Screen.of(torch.ones(NUMEL)))
    assert folded.verdict == "folded" and folded.weight == 1.0 and round_.folded == {"slow": 1.0}
    assert round_.contributed == {}, "a folded update does not count towards the quorum"


@pytest.mark.parametrize("host_restores", [False, True], ids=["own-copy", "host-without-checkpoint"])
def test_an_aborted_step_leaves_the_weights_and_rewinds_the_outer_state(host_restores: bool) -> None:
    """Without a host's rewind the engine puts back the state it copied before the step (the
    momentum of round 0, as a coordinator's checkpoint of those weights holds it); a host whose
    rewind finds nothing (a coordinator without checkpoints) gets a fresh state."""
    e = engine(UpdateGuardConfig(max_abs_weight=1.0))
    if host_restores:
        e.restore_outer = lambda weights: None
    weights = torch.zeros(NUMEL)
    # A first round inside the bounds gives the outer optimizer momentum.
    first = e.open(0, RunningSum(NUMEL), 0.0)
    e.admit(first, "a", torch.full((NUMEL,), -0.1), 1.0, screen=UNSCREENED, now=0.0)
    plan = e.strategy.configure_round(0, ["a"])  # type: ignore[union-attr]
    stepped = e.step(first, weights, plan, ["a"])
    assert stepped.aborted is None
    weights = stepped.result.update.global_flat
    assert e.strategy is not None and e.strategy.state_tensors(), "the step left momentum"
    after_first = {k: v.clone() for k, v in e.strategy.state_tensors().items()}
    fresh = strategy().state_tensors()
    assert not _same(after_first, fresh)
    # The next round's mean pushes a weight past max_abs_weight: aborted, nothing changes.
    second = e.open(1, RunningSum(NUMEL), 1.0)
    e.admit(second, "a", torch.full((NUMEL,), -100.0), 1.0, screen=UNSCREENED, now=1.0)
    stepped = e.step(second, weights, e.strategy.configure_round(1, ["a"]), ["a"])
    assert stepped.aborted is not None and "beyond max_abs_weight" in stepped.aborted
    assert torch.equal(stepped.result.update.global_flat, weights)
    expected = fresh if host_restores else after_first
    assert ("reset" if host_restores else "put back as it was before the step") in stepped.aborted
    assert _same(e.strategy.state_tensors(), expected)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(v, b[k]) for k, v in a.items())


def test_the_simulator_rejects_a_poisoned_update_as_the_coordinator_does() -> None:
    config = SimulatorConfig(
        algorithm=AlgorithmConfig(inner_steps=2, uplink_codec="int8", downlink_codec="none"),
        sites=[SiteConfig(), SiteConfig(), SiteConfig(attack="scale:1e9")],
        simulation=SimulationConfig(rounds=2, seed=1, device="cpu", eval_every=10**6),
    )
    records = list(Simulator(config, build_workload("mlp")).run())
    for record in records:
        assert record.participants == ["0", "1"] and record.aborted is None
        assert record.rejected == ["2"] and "exceeds the bound" in record.rejected_reasons["2"]


def test_the_simulator_aborts_a_round_whose_quorum_a_rejection_makes_unreachable() -> None:
    """As the coordinator does: with min_sites = every site, a refused update cannot be replaced
    this round, so the round aborts instead of waiting."""
    config = SimulatorConfig(
        algorithm=AlgorithmConfig(inner_steps=2, uplink_codec="none", downlink_codec="none"),
        sites=[SiteConfig(), SiteConfig(), SiteConfig(attack="scale:1e9")],
        simulation=SimulationConfig(rounds=2, seed=1, device="cpu", eval_every=10**6, min_sites=3),
    )
    simulator = Simulator(config, build_workload("mlp"))
    before = simulator.global_flat.clone()
    for record in simulator.run():
        assert record.rejected == ["2"] and record.participants == []
        assert record.aborted is not None and "quorum of 3 updates can no longer be met" in record.aborted
    assert torch.equal(simulator.global_flat, before)

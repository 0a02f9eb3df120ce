"""``[update_guard]`` without sockets: the norm bound's history, aborts after a checkpoint,
config validation, and an aggregation that fails midway. The wire-level behaviour (status codes,
metrics.jsonl, the status page, a still-running driver) is in ``test_update_guard_grpc``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _round_helpers import FakeClock, join, tiny_weights, upload, wait_broadcast

from geoloco.algorithms.aggregation import RunningSum
from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.algorithms.update_guard import UpdateGuard, UpdateGuardConfig
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.rounds import RoundStateMachine
from geoloco.protos.errors import InvalidUpdateError, UpdateRejectedError, WrongRoundError


def make(tmp_path: Path | None = None, **overrides: object) -> RoundStateMachine:
    settings: dict[str, object] = {
        "algorithm": AlgorithmConfig(inner_steps=1),
        "insecure": True,
        "total_rounds": 10,
    }
    if tmp_path is not None:
        settings["checkpoint_dir"] = str(tmp_path / "checkpoints")
    settings.update(overrides)
    weights, layout = tiny_weights()
    return RoundStateMachine(CoordinatorConfig(**settings), weights, layout, clock=FakeClock())  # type: ignore[arg-type]


def unit(numel: int, norm: float, seed: int = 0) -> torch.Tensor:
    u = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    return u * (norm / float(torch.linalg.vector_norm(u)))


def round_of(rounds: RoundStateMachine, updates: dict[str, torch.Tensor]) -> dict[str, object]:
    for site, update in updates.items():
        assert upload(rounds, site, update).complete
    record = rounds.poll()
    assert record is not None
    return record


def test_norm_bound_is_the_floor_until_rounds_are_aggregated_then_follows_their_median() -> None:
    guard = UpdateGuard(UpdateGuardConfig(norm_floor=5.0, norm_factor=10.0, norm_window=2))
    assert guard.norm_bound() == 5.0
    guard.accepted(0, "a", 1.0)
    guard.accepted(0, "b", 3.0)
    guard.accepted(0, "c", 100.0)
    guard.round_done(0, ["a", "b"])  # c's update did not count: its norm is not history
    assert guard.norm_bound() == 20.0
    guard.accepted(1, "a", 1000.0)
    guard.round_done(1, None)  # aborted: nothing learnt
    assert guard.norm_bound() == 20.0
    guard.accepted(2, "a", 4.0)
    guard.round_done(2, ["a"])
    assert guard.norm_bound() == 30.0  # median of 1, 3, 4
    guard.accepted(3, "a", 10.0)
    guard.round_done(3, ["a"])  # the window is 2 rounds: round 0 drops out
    assert guard.norm_bound() == 70.0
    restored = UpdateGuard(guard.config)
    restored.load_state(guard.state())
    assert restored.norm_bound() == 70.0


def _aggregate(guard: UpdateGuard, round_number: int, updates: dict[str, tuple[float, float]]) -> dict[str, str]:
    """One round through ``guard``: each site's ``(norm, weight)`` screened as the engine does,
    the accepted ones aggregated; returns the refused sites with their reasons."""
    refused: dict[str, str] = {}
    for site, (norm, weight) in updates.items():
        why = guard.check_site_weight(site, weight) or guard.check_norm(norm, site=site)
        if why is None:
            guard.accepted(round_number, site, norm, weight=weight)
        else:
            refused[site] = why
    guard.round_done(round_number, [s for s in updates if s not in refused])
    return refused


def test_with_two_sites_a_norm_growing_every_round_no_longer_drifts_its_own_bound() -> None:
    """The pooled median of two sites is half the growing site's: at 1.4x a round it never met
    norm_factor x median (2,296x the honest norm after 24 rounds). Against the other site's
    norms alone it is refused once it passes norm_factor x the honest norm, and stays refused."""
    guard = UpdateGuard(UpdateGuardConfig(norm_floor=1.0, norm_factor=100.0, norm_window=10))
    first_refused = None
    for t in range(24):
        refused = _aggregate(guard, t, {"honest": (0.1, 1.0), "hostile": (0.1 * 1.4**t, 1.0)})
        assert "honest" not in refused
        if "hostile" in refused:
            if first_refused is None:  # later, the pooled median (now mostly honest) refuses it too
                assert "set by the other sites" in refused["hostile"], refused
                first_refused = t
        else:
            assert first_refused is None, f"accepted again in round {t} after a refusal"
            assert 0.1 * 1.4**t <= 100 * 0.1
    assert first_refused == 14  # 0.1 x 1.4^14 = 11.1 > 100 x 0.1; 1.4^13 = 79 was still within
    assert guard.peer_bound("hostile", "norm") == pytest.approx(10.0)


def test_a_site_cannot_lock_another_out_by_reporting_tiny_values() -> None:
    """With two sites "the others" is one site: one that reports tiny norms and weights does not
    make the other's usual values refusable, since what a site had accepted stays allowed."""
    guard = UpdateGuard(UpdateGuardConfig(norm_floor=1.0, norm_factor=10.0, weight_factor=10.0, norm_window=3))
    assert _aggregate(guard, 0, {"a": (0.5, 800.0), "b": (0.5, 800.0)}) == {}
    for t in range(1, 8):  # a's norm 5 is above the floor: only its own history allows it
        refused = _aggregate(guard, t, {"a": (5.0, 800.0), "b": (1e-9, 1e-9)})
        assert refused == {}, (t, refused)
    # ...but it cannot grow past what it had: 10x the other's (tiny) values or its own largest.
    refused = _aggregate(guard, 8, {"a": (6.0, 900.0)})
    assert "a" in refused and "weight" in refused["a"]


def test_a_weight_is_bounded_by_the_other_sites_weights_from_the_first_arrival_of_a_round() -> None:
    guard = UpdateGuard(UpdateGuardConfig(weight_factor=10.0))
    # Round 0: no history, only max_sample_weight bounds a weight.
    assert guard.check_site_weight("hostile", 1e11) is None
    assert _aggregate(guard, 0, {"a": (1.0, 100.0), "b": (1.0, 300.0)}) == {}
    # Round 1: the bound is set by the closed rounds, the same for every arrival of the round.
    why = guard.check_site_weight("hostile", 1e12)
    assert why is not None and "weight_factor 10" in why and "exceeds 2000" in why, why
    assert guard.check_site_weight("a", 3000.0) == guard.check_site_weight("a", 3000.0) is None  # 10 x 300
    assert guard.check_site_weight("a", 3001.0) is not None
    assert guard.check_site_weight("b", 1000.0) is None and guard.check_site_weight("b", 1001.0) is not None


def test_norm_and_weight_history_round_trips_through_a_checkpoint_and_reads_the_old_form() -> None:
    guard = UpdateGuard(UpdateGuardConfig(norm_floor=10.0, norm_factor=10.0, weight_factor=10.0))
    assert _aggregate(guard, 0, {"a": (2.0, 100.0), "b": (4.0, 50.0)}) == {}
    restored = UpdateGuard(guard.config)
    restored.load_state(json.loads(json.dumps(guard.state())))  # as checkpoint metadata travels
    assert restored.state() == guard.state()
    assert restored.peer_bound("a", "norm") == 40.0 and restored.peer_bound("a", "weight") == 500.0
    # A checkpoint from before the history named its sites: norms only, nobody's own.
    old = UpdateGuard(guard.config)
    old.load_state([[2.0, 4.0], [float("nan"), -1.0]])
    assert old.norm_bound() == 30.0 and old.peer_bound("a", "norm") == 30.0
    assert old.peer_bound("a", "weight") is None


def test_an_update_far_above_recent_rounds_is_rejected_and_the_history_survives_a_restart(
    tmp_path: Path,
) -> None:
    rounds = make(tmp_path, update_guard=UpdateGuardConfig(norm_floor=10.0, norm_factor=20.0))
    sessions = {site: join(rounds, site).session_id for site in "ab"}
    record = round_of(rounds, {"a": unit(rounds.numel, 1.0, 1), "b": unit(rounds.numel, 2.0, 2)})
    assert record.aborted is None
    # The bound is now max(10, 20 x median(1, 2)) = 30, no longer the floor's 10.
    assert upload(rounds, "a", unit(rounds.numel, 25.0, 3)).complete
    with pytest.raises(InvalidUpdateError, match="norm 40 exceeds the bound 30"):
        upload(rounds, "b", unit(rounds.numel, 40.0, 4))
    with pytest.raises(UpdateRejectedError, match="norm 40"):
        upload(rounds, "b", unit(rounds.numel, 1.0, 5))
    record = rounds.poll()
    assert record is not None and record.participants == ["a"] and record.rejected == ["b"]
    # The broadcast tells b its update was refused (it drops it, with its residual), not
    # merely left out (it would keep it for the next round).
    for site, refused in (("a", False), ("b", True)):
        header = wait_broadcast(rounds, site, sessions[site], 1, timeout_s=1).header
        assert header is not None and header.refused is refused and header.included is not refused
    rounds.close()
    # The norm history is in the checkpoint: a restarted coordinator keeps the same bound.
    again = make(tmp_path, update_guard=UpdateGuardConfig(norm_floor=10.0, norm_factor=20.0))
    assert again.round == 2
    assert again.engine.guard.norm_bound() == pytest.approx(20.0 * 2.0)  # median of 1, 2, 25
    # And still tells b, asking again after the restart, that round 1 refused its update.
    session = join(again, "b").session_id
    header = wait_broadcast(again, "b", session, 1, timeout_s=1).header
    assert header is not None and header.refused and not header.included
    again.close()


def test_an_abort_after_the_outer_step_rewinds_the_optimizer_to_the_checkpoint(tmp_path: Path) -> None:
    rounds = make(tmp_path, update_guard=UpdateGuardConfig(max_abs_weight=5.0))
    join(rounds, "a")
    round_of(rounds, {"a": unit(rounds.numel, 0.1, 1)})
    theta = rounds.weights.clone()
    momentum = {k: v.clone() for k, v in rounds.strategy.state_tensors().items()}
    record = round_of(rounds, {"a": torch.full((rounds.numel,), 50.0)})
    assert "max_abs_weight" in str(record.aborted) and "restored from the checkpoint" in str(record.aborted)
    assert torch.equal(rounds.weights, theta)
    state = rounds.strategy.state_tensors()
    assert state.keys() == momentum.keys() and all(torch.equal(state[k], momentum[k]) for k in state)
    # The refused step left no momentum behind: a small update is an ordinary round again.
    assert round_of(rounds, {"a": unit(rounds.numel, 0.1, 2)}).aborted is None
    rounds.close()


def test_an_abort_rewinds_through_the_round_log_when_the_checkpoint_is_older(tmp_path: Path) -> None:
    """Full checkpoints only every 100 rounds: the state of the unchanged weights is the newest
    checkpoint's plus the logged rounds after it, redone."""
    rounds = make(tmp_path, update_guard=UpdateGuardConfig(max_abs_weight=5.0), checkpoint_every=100)
    join(rounds, "a")
    for seed in (1, 2, 3):
        round_of(rounds, {"a": unit(rounds.numel, 0.1, seed)})
    theta = rounds.weights.clone()
    momentum = {k: v.clone() for k, v in rounds.strategy.state_tensors().items()}
    record = round_of(rounds, {"a": torch.full((rounds.numel,), 50.0)})
    assert "checkpoint of round 1 and 2 logged round(s)" in str(record.aborted), record.aborted
    assert torch.equal(rounds.weights, theta)
    state = rounds.strategy.state_tensors()
    assert state.keys() == momentum.keys() and all(torch.equal(state[k], momentum[k]) for k in state)
    rounds.close()


def test_an_aggregation_that_fails_midway_rejects_the_update_and_aborts_the_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rounds = make()
    for site in "ab":
        join(rounds, site)
    theta = rounds.weights.clone()
    original = RunningSum.add

    def failing(self: RunningSum, update: torch.Tensor, weight: float = 1.0, *, site: str, stale: bool = False) -> None:
        if site == "b":
            raise RuntimeError("simulated failure inside the sum")
        original(self, update, weight, site=site, stale=stale)

    monkeypatch.setattr(RunningSum, "add", failing)
    assert upload(rounds, "a", unit(rounds.numel, 0.1, 1)).complete
    with pytest.raises(InvalidUpdateError, match="could not be added"):
        upload(rounds, "b", unit(rounds.numel, 0.1, 2))
    record = rounds.poll()  # b is rejected, not waited for: the round closes
    assert record is not None and record.rejected == ["b"]
    assert "adding the update of b failed" in str(record.aborted) and record.participants == []
    assert torch.equal(rounds.weights, theta)
    monkeypatch.setattr(RunningSum, "add", original)
    assert round_of(rounds, {"a": unit(rounds.numel, 0.1, 3), "b": unit(rounds.numel, 0.1, 4)}).aborted is None
    rounds.close()


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ({"norm_floor": 0}, "update_guard.norm_floor"),
        ({"norm_factor": 0.5}, "update_guard.norm_factor"),
        ({"norm_window": 0}, "update_guard.norm_window"),
        ({"max_sample_weight": float("inf")}, "update_guard.max_sample_weight"),
        ({"max_abs_weight": -1.0}, "update_guard.max_abs_weight"),
        ({"max_norm": 1.0}, "update_guard.max_norm"),
    ],
)
def test_update_guard_config_errors_name_the_key(table: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        CoordinatorConfig.from_dict({"insecure": True, "update_guard": table})
    assert key in str(info.value)


def test_update_guard_defaults_round_trip_through_the_config_file_form() -> None:
    config = CoordinatorConfig.from_dict({"insecure": True, "update_guard": {"norm_floor": 50.0}})
    assert config.update_guard == UpdateGuardConfig(norm_floor=50.0)
    assert CoordinatorConfig.from_dict(config.to_dict()).update_guard == config.update_guard


def test_the_bounds_equal_the_medians_of_the_window_bit_for_bit() -> None:
    """The bounds come from sorted windows by bisection (each upload costs a few bisections, not
    a pass over every site's history): the same floats as ``statistics.median`` of the other
    sites' values and of all of them, ties and repeated values included."""
    import random
    import statistics

    from geoloco.algorithms.update_guard import UpdateGuard, UpdateGuardConfig

    rng = random.Random(7)
    guard = UpdateGuard(UpdateGuardConfig(norm_window=4, norm_floor=1e-9, norm_factor=3.0, weight_factor=2.0))
    sites = [f"s{k}" for k in range(9)]
    history: list[dict[str, tuple[float, float]]] = []
    for number in range(12):
        counted = rng.sample(sites, rng.randint(1, len(sites)))
        values = {
            s: (float(rng.choice([1, 2, 2, 3, 5])) * rng.choice([1.0, 0.5]), float(rng.randint(1, 4))) for s in counted
        }
        for site, (norm, weight) in values.items():
            guard.accepted(number, site, norm, weight=weight)
        guard.round_done(number, counted)
        history = (history + [values])[-4:]
        for site in [*sites, "new"]:
            for kind, factor, index in (("norm", 3.0, 0), ("weight", 2.0, 1)):
                others = [v[index] for r in history for s, v in r.items() if s != site]
                own = [v[index] for r in history for s, v in r.items() if s == site]
                expected = max(factor * statistics.median(others), max(own, default=0.0)) if others else None
                assert guard.peer_bound(site, kind) == expected  # type: ignore[arg-type]
        pooled = [v[0] for r in history for v in r.values()]
        assert guard.norm_bound() == max(1e-9, 3.0 * statistics.median(pooled))


def test_an_update_its_round_refused_is_not_folded_into_the_next_one(tmp_path: Path) -> None:
    """With late_updates = "fold" a site may offer an update that missed its round to the next
    one. A site whose update its round refused did not miss it: its next offer for that round
    is refused as late, not folded, as the simulator folds only stragglers."""
    rounds = make(
        algorithm=AlgorithmConfig(inner_steps=1, late_updates="fold"),
        update_guard=UpdateGuardConfig(norm_floor=10.0),
    )
    for site in "ab":
        join(rounds, site)
    assert upload(rounds, "a", unit(rounds.numel, 1.0, 1)).complete
    with pytest.raises(InvalidUpdateError, match="exceeds the bound 10"):
        upload(rounds, "b", unit(rounds.numel, 40.0, 2))
    record = rounds.poll()
    assert record is not None and record.rejected == ["b"]
    with pytest.raises(WrongRoundError):
        upload(rounds, "b", unit(rounds.numel, 1.0, 3), round_number=0)
    rounds.close()

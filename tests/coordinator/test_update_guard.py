"""``[update_guard]`` without sockets: the norm bound's history, aborts after a checkpoint,
config validation, and an aggregation that fails midway. The wire-level behaviour (status codes,
metrics.jsonl, the status page, a still-running driver) is in ``test_update_guard_grpc``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _round_helpers import FakeClock, join, tiny_weights, upload

from geoloco.algorithms.aggregation import RunningSum
from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.algorithms.update_guard import UpdateGuard, UpdateGuardConfig
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.errors import InvalidUpdateError, UpdateRejectedError
from geoloco.coordinator.rounds import RoundStateMachine


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


def test_an_update_far_above_recent_rounds_is_rejected_and_the_history_survives_a_restart(
    tmp_path: Path,
) -> None:
    rounds = make(tmp_path, update_guard=UpdateGuardConfig(norm_floor=10.0, norm_factor=20.0))
    for site in "ab":
        join(rounds, site)
    record = round_of(rounds, {"a": unit(rounds.numel, 1.0, 1), "b": unit(rounds.numel, 2.0, 2)})
    assert record["aborted"] is None
    # The bound is now max(10, 20 x median(1, 2)) = 30, no longer the floor's 10.
    assert upload(rounds, "a", unit(rounds.numel, 25.0, 3)).complete
    with pytest.raises(InvalidUpdateError, match="norm 40 exceeds the bound 30"):
        upload(rounds, "b", unit(rounds.numel, 40.0, 4))
    with pytest.raises(UpdateRejectedError, match="norm 40"):
        upload(rounds, "b", unit(rounds.numel, 1.0, 5))
    record = rounds.poll()
    assert record is not None and record["participants"] == ["a"] and record["rejected"] == ["b"]
    rounds.close()
    # The norm history is in the checkpoint: a restarted coordinator keeps the same bound.
    again = make(tmp_path, update_guard=UpdateGuardConfig(norm_floor=10.0, norm_factor=20.0))
    assert again.round == 2
    assert again.engine.guard.norm_bound() == pytest.approx(20.0 * 2.0)  # median of 1, 2, 25
    again.close()


def test_an_abort_after_the_outer_step_rewinds_the_optimizer_to_the_checkpoint(tmp_path: Path) -> None:
    rounds = make(tmp_path, update_guard=UpdateGuardConfig(max_abs_weight=5.0))
    join(rounds, "a")
    round_of(rounds, {"a": unit(rounds.numel, 0.1, 1)})
    theta = rounds.weights.clone()
    momentum = {k: v.clone() for k, v in rounds.strategy.state_tensors().items()}
    record = round_of(rounds, {"a": torch.full((rounds.numel,), 50.0)})
    assert "max_abs_weight" in str(record["aborted"]) and "restored from the checkpoint" in str(record["aborted"])
    assert torch.equal(rounds.weights, theta)
    state = rounds.strategy.state_tensors()
    assert state.keys() == momentum.keys() and all(torch.equal(state[k], momentum[k]) for k in state)
    # The refused step left no momentum behind: a small update is an ordinary round again.
    assert round_of(rounds, {"a": unit(rounds.numel, 0.1, 2)})["aborted"] is None
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
    assert record is not None and record["rejected"] == ["b"]
    assert "adding the update of b failed" in str(record["aborted"]) and record["participants"] == []
    assert torch.equal(rounds.weights, theta)
    monkeypatch.setattr(RunningSum, "add", original)
    assert round_of(rounds, {"a": unit(rounds.numel, 0.1, 3), "b": unit(rounds.numel, 0.1, 4)})["aborted"] is None
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

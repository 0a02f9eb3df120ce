"""The coordinator's rounds run on the round core: policy-driven close, late updates folded with
the policy's staleness weight, the adaptive deadline across a restart, and the metrics record's
keys (the canonical names the simulator adopts, and the ones the report and status page read)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _round_helpers import FakeClock, join, tiny_weights, upload, upload_status

from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.deadline import AdaptiveDeadlineConfig
from geoloco.algorithms.device import resolve_device
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.rounds import RoundStateMachine

CANONICAL_KEYS = {"excluded", "participants", "folded_late", "weights_digest"}
"""Record keys shared with the simulator's round records."""
REPORT_KEYS = {
    "session_id", "round", "fragment", "sample_weights", "rejected", "departed", "partial_uploads",
    "members", "bytes_up", "bytes_down", "bytes_up_total", "bytes_down_total", "downlink_bytes",
    "round_time_s", "wait_for_quorum_s", "aggregate_time_s", "deadline_s", "deadline_hit",
    "next_deadline_s", "arrival_s", "inner_steps", "update_norm", "eval_loss", "site_metrics",
    "run_finished",
}
"""Keys the run report and the status page read today."""


def make(clock: FakeClock, **overrides: object) -> RoundStateMachine:
    settings: dict[str, object] = {"insecure": True, "total_rounds": 10, "heartbeat_timeout_s": 600.0}
    settings.update(overrides)
    weights, layout = tiny_weights()
    return RoundStateMachine(CoordinatorConfig(**settings), weights, layout, clock=clock)  # type: ignore[arg-type]


def update(seed: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def test_metrics_record_has_canonical_and_report_keys() -> None:
    rounds = make(FakeClock())
    join(rounds, "a")
    upload(rounds, "a", update(1, rounds.numel))
    record = rounds.poll()
    assert record is not None
    assert set(record.to_dict()) >= CANONICAL_KEYS | REPORT_KEYS
    assert record.participants == ["a"] and record.excluded == [] and record.folded_late == {}
    assert record.weights_digest == rounds.digest_hex


def test_late_update_is_folded_with_the_policys_staleness_weight() -> None:
    clock = FakeClock()
    rounds = make(
        clock, round_deadline_s=10.0,
        algorithm=AlgorithmConfig(
            inner_steps=2, weighting="samples", late_updates="fold", staleness_discount=0.25
        ),
    )
    session = join(rounds, "fast").session_id
    join(rounds, "slow")
    upload(rounds, "fast", update(1, rounds.numel), sample_weight=2.0)
    clock.advance(11.0)
    first = rounds.poll()
    assert first is not None and first.excluded == ["slow"] and first.deadline_hit
    # Round 1 is open; slow's round-0 update arrives now and is folded into round 1.
    response = upload(rounds, "slow", update(2, rounds.numel), round_number=0, sample_weight=4.0)
    assert response.complete and response.folded_late
    status = upload_status(rounds, "slow", session, 0, 0)
    assert status.known and status.complete and status.folded_late
    assert rounds.status()["contributed"] == [], "a folded update does not count towards the quorum"
    upload(rounds, "fast", update(3, rounds.numel))
    upload(rounds, "slow", update(4, rounds.numel))
    second = rounds.poll()
    assert second is not None
    assert second.folded_late == {"slow": rounds.policy.stale_weight(4.0)} == {"slow": 1.0}
    assert second.participants == ["fast", "slow"]


def test_adaptive_deadline_history_survives_a_restart(tmp_path: Path) -> None:
    clock = FakeClock()
    overrides = {
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "adaptive_deadline": AdaptiveDeadlineConfig(enabled=True, min_s=1.0, max_s=100.0),
    }
    first = make(clock, **overrides)
    join(first, "a")
    for r in range(2):
        clock.advance(3.0 + r)
        upload(first, "a", update(r, first.numel))
        assert first.poll() is not None
    learned = first.policy.deadline_s()
    assert first.policy.state() and learned != 100.0
    first.close()  # stopped, as a restarted coordinator's predecessor is: its checkpoint is done
    second = make(clock, **overrides)
    assert second.policy.state() == first.policy.state()
    assert second.policy.deadline_s() == learned


def test_resolve_device_names_the_key_and_the_allowed_values() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in ("cpu", "cuda")
    with pytest.raises(ConfigError) as err:
        resolve_device("tpu", "simulation.device")
    assert err.value.key == "simulation.device"
    assert "allowed: auto, cpu, cuda" in err.value.message
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            resolve_device("cuda")


def test_new_global_weights_are_hashed_once_per_round(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The strategy hashes θ_{t+1} once; the checkpoint, the broadcast and the served weights reuse
    that digest (a billion-parameter model must not be hashed three times a round)."""
    import geoloco.algorithms.params as params
    import geoloco.algorithms.strategy as strategy
    import geoloco.coordinator.phases as phases

    rounds = make(FakeClock(), checkpoint_dir=str(tmp_path))
    join(rounds, "a")
    upload(rounds, "a", update(1, rounds.numel))
    calls: list[str] = []

    def counting(flat: torch.Tensor) -> str:
        calls.append("digest")
        return params.weights_digest(flat)

    monkeypatch.setattr(strategy, "weights_digest", counting)
    monkeypatch.setattr(phases, "weights_digest", counting)
    record = rounds.poll()
    assert record is not None
    assert any(tmp_path.iterdir()), "the round wrote no checkpoint"
    assert calls == ["digest"]
    assert record.weights_digest == rounds.digest_hex == params.weights_digest(rounds.weights)

"""The round state machine without sockets: quorum, deadlines, stragglers, membership, resume.

Time is a fake clock, so deadlines and heartbeat timeouts are crossed by assignment, not sleeps.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from _round_helpers import FakeClock, heartbeat, join, tiny_weights, upload, wait_broadcast

from geoloco.algorithms.strategy import AlgorithmConfig, build_strategy
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.rounds import RoundPhase, RoundStateMachine
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.errors import (
    InvalidUpdateError,
    NotAMemberError,
    RunFinishedError,
    StaleSessionError,
    UpdateRejectedError,
    WrongRoundError,
)
from geoloco.protos.protocol_version import PROTOCOL_VERSION


def make(clock: FakeClock | None = None, **overrides: object) -> RoundStateMachine:
    settings: dict[str, object] = {
        "algorithm": AlgorithmConfig(inner_steps=2),
        "insecure": True,
        "total_rounds": 10,
    }
    settings.update(overrides)
    weights, layout = tiny_weights()
    return RoundStateMachine(
        CoordinatorConfig(**settings),  # type: ignore[arg-type]
        weights,
        layout,
        clock=clock or FakeClock(),
    )


def update(seed: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def expected_weights(
    rounds: RoundStateMachine, start: torch.Tensor, updates: list[torch.Tensor], round_number: int = 0
) -> torch.Tensor:
    """The same round done directly with the strategy (fresh outer state: first round only)."""
    strategy = build_strategy(rounds.config.algorithm, numel=rounds.numel, seed=rounds.config.seed)
    aggregator = strategy.new_aggregator(round_number)
    for k, u in enumerate(updates):
        aggregator.add(u, 1.0, site=str(k))
    plan = strategy.configure_round(round_number, [str(k) for k in range(len(updates))])
    return strategy.aggregate_round(start, aggregator, plan).global_flat


def test_round_waits_for_quorum_then_closes_when_every_expected_site_uploaded() -> None:
    rounds = make(min_sites=2)
    theta0 = rounds.weights.clone()
    join(rounds, "a")
    assert rounds.phase is RoundPhase.WAITING_FOR_QUORUM
    a, b = update(1, rounds.numel), update(2, rounds.numel)
    # Uploads are accepted while the quorum assembles; one upload is not a quorum.
    assert upload(rounds, "a", a).complete
    assert rounds.poll() is None and rounds.round == 0
    join(rounds, "b")
    assert rounds.phase is RoundPhase.RUNNING
    assert rounds.poll() is None  # b is expected and has not uploaded
    assert upload(rounds, "b", b).complete
    metrics = rounds.poll()
    assert metrics is not None and metrics.participants == ["a", "b"]
    assert metrics.excluded == [] and not metrics.deadline_hit
    assert rounds.round == 1 and rounds.phase is RoundPhase.RUNNING
    assert torch.equal(rounds.weights, expected_weights(rounds, theta0, [a, b]))
    for site in ("a", "b"):
        result = wait_broadcast(rounds, site, rounds.session_id, 0, timeout_s=0)
        assert result.header is not None
        assert result.header.action == pb.BROADCAST_ACTION_APPLY_DELTA
        assert result.header.included and result.header.num_contributors == 2
        assert result.header.next_round.round == 1
        assert result.header.weights_digest.digest.hex() == rounds.digest_hex


def test_deadline_excludes_straggler_and_refuses_its_late_upload() -> None:
    clock = FakeClock()
    rounds = make(clock, min_sites=1, round_deadline_s=10.0)
    theta0 = rounds.weights.clone()
    join(rounds, "fast")
    join(rounds, "slow")
    a = update(1, rounds.numel)
    upload(rounds, "fast", a)
    clock.advance(5.0)
    assert rounds.poll() is None, "closed before the deadline although 'slow' is expected"
    clock.advance(5.5)
    metrics = rounds.poll()
    assert metrics is not None
    assert metrics.participants == ["fast"] and metrics.excluded == ["slow"]
    assert metrics.deadline_hit
    after = rounds.weights.clone()
    assert torch.equal(after, expected_weights(rounds, theta0, [a]))

    with pytest.raises(WrongRoundError) as late:
        upload(rounds, "slow", update(2, rounds.numel), round_number=0)
    assert late.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert late.value.reason == pb.ERROR_REASON_WRONG_ROUND
    assert torch.equal(rounds.weights, after), "a late upload changed the global weights"
    assert rounds.status()["contributed"] == []
    # The straggler still holds theta_0 and can catch up with round 0's delta.
    result = wait_broadcast(rounds, "slow", rounds.session_id, 0, timeout_s=0)
    assert result.header is not None and result.header.action == pb.BROADCAST_ACTION_APPLY_DELTA
    assert not result.header.included


def test_quorum_holds_a_round_open_past_its_deadline() -> None:
    clock = FakeClock()
    rounds = make(clock, min_sites=2, round_deadline_s=10.0, heartbeat_timeout_s=600.0)
    join(rounds, "a")
    join(rounds, "b")
    upload(rounds, "a", update(1, rounds.numel))
    clock.advance(60.0)
    assert rounds.poll() is None and rounds.round == 0
    upload(rounds, "b", update(2, rounds.numel))
    metrics = rounds.poll()
    assert metrics is not None and sorted(metrics.participants) == ["a", "b"]


def test_site_joining_mid_run_fetches_current_round_and_is_waited_for() -> None:
    rounds = make(min_sites=2)
    join(rounds, "a")
    join(rounds, "b")
    upload(rounds, "a", update(1, rounds.numel))
    upload(rounds, "b", update(2, rounds.numel))
    assert rounds.poll() is not None
    response = join(rounds, "late")
    assert response.round.round == 1 and response.must_fetch_model
    assert response.weights_digest.digest.hex() == rounds.digest_hex
    snapshot = rounds.model_snapshot("late", response.session_id)
    assert snapshot.round == 1 and torch.equal(snapshot.weights, rounds.weights)
    # Joining with the current weights needs no fetch.
    again = join(
        rounds, "late", has_weights=True, weights_digest=response.weights_digest
    )
    assert not again.must_fetch_model
    # A member that joined during the round is waited for like the others.
    upload(rounds, "a", update(4, rounds.numel))
    upload(rounds, "b", update(5, rounds.numel))
    assert rounds.status()["pending"] == ["late"]
    assert rounds.poll() is None
    upload(rounds, "late", update(3, rounds.numel))
    metrics = rounds.poll()
    assert metrics is not None and metrics.participants == ["a", "b", "late"]


def test_silent_site_is_dropped_and_the_round_closes_without_it() -> None:
    clock = FakeClock()
    rounds = make(clock, min_sites=1, heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0)
    session = join(rounds, "alive").session_id
    join(rounds, "silent")
    upload(rounds, "alive", update(1, rounds.numel))
    assert rounds.poll() is None
    clock.advance(3.0)
    assert not heartbeat(rounds, "alive", session).rejoin_required
    clock.advance(3.0)
    metrics = rounds.poll()  # silent for 6 s > 5 s: dropped, nothing left to wait for
    assert rounds.members == ["alive"]
    assert metrics is not None and metrics.participants == ["alive"]
    assert metrics.departed == ["silent"] and metrics.excluded == []
    assert heartbeat(rounds, "silent", session).rejoin_required
    with pytest.raises(NotAMemberError) as err:
        upload(rounds, "silent", update(2, rounds.numel))
    assert err.value.reason == pb.ERROR_REASON_NOT_A_MEMBER


def test_a_heartbeat_waiting_for_the_round_lock_keeps_its_site_alive() -> None:
    """A long secure stage or aggregation holds the round's lock; a heartbeat that arrived
    meanwhile is a sign of life from its arrival, even when the silence scan runs first."""
    clock = FakeClock()
    rounds = make(clock, min_sites=1, heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0)
    session = join(rounds, "waiting").session_id
    join(rounds, "silent")
    heartbeat(rounds, "silent", session)
    upload(rounds, "waiting", update(1, rounds.numel))
    heartbeat(rounds, "waiting", session)
    clock.advance(4.0)
    waiter: threading.Thread | None = None
    with rounds._cond:  # what a long stage does: hold the lock
        waiter = threading.Thread(target=heartbeat, args=(rounds, "waiting", session), daemon=True)
        waiter.start()
        deadline = time.monotonic() + 10.0
        while not rounds.membership._arrivals and time.monotonic() < deadline:
            time.sleep(0.005)
        clock.advance(2.0)  # 6 s since either site was recorded: past the 5 s timeout
        rounds.membership.drop_silent(clock())
        assert sorted(rounds.members) == ["waiting"]  # arrived 2 s ago: alive; "silent" dropped
    waiter.join(timeout=10.0)
    assert not waiter.is_alive()
    assert rounds.membership._arrivals == {}  # recorded, so no longer noted
    # A noted heartbeat of another session or another process is not a sign of life of the member.
    rounds.membership.note_arrival("waiting", "an-old-session", "", clock())
    rounds.membership.note_arrival("waiting", session, "a-replaced-process", clock())
    clock.advance(5.5)
    rounds.membership.drop_silent(clock())
    assert rounds.members == []


def test_leave_adapts_the_quorum_round() -> None:
    rounds = make(min_sites=1)
    session = join(rounds, "a").session_id
    join(rounds, "b")
    upload(rounds, "a", update(1, rounds.numel))
    assert rounds.poll() is None
    rounds.leave("b", session, "done")
    assert rounds.poll() is not None and rounds.round == 1


def test_stale_session_is_refused_with_its_reason() -> None:
    rounds = make()
    join(rounds, "a")
    with pytest.raises(StaleSessionError) as err:
        rounds.model_snapshot("a", "an-old-session")
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.reason == pb.ERROR_REASON_STALE_SESSION
    assert heartbeat(rounds, "a", "an-old-session").rejoin_required


def test_non_finite_update_is_rejected_for_the_round_and_changes_nothing() -> None:
    rounds = make(min_sites=1)
    theta0 = rounds.weights.clone()
    join(rounds, "good")
    join(rounds, "bad")
    poisoned = update(1, rounds.numel)
    poisoned[3] = float("nan")
    with pytest.raises(InvalidUpdateError) as err:
        upload(rounds, "bad", poisoned)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert torch.equal(rounds.weights, theta0)
    with pytest.raises(UpdateRejectedError):
        upload(rounds, "bad", update(2, rounds.numel))
    good = update(3, rounds.numel)
    upload(rounds, "good", good)
    metrics = rounds.poll()  # the rejected site is not waited for
    assert metrics is not None and metrics.rejected == ["bad"]
    assert torch.equal(rounds.weights, expected_weights(rounds, theta0, [good]))


def test_duplicate_complete_upload_is_idempotent() -> None:
    rounds = make(min_sites=1)
    theta0 = rounds.weights.clone()
    join(rounds, "a")
    join(rounds, "b")
    u = update(1, rounds.numel)
    assert upload(rounds, "a", u).complete
    assert upload(rounds, "a", u).complete  # same manifest again: already counted
    assert rounds.status()["contributed"] == ["a"]
    upload(rounds, "b", update(2, rounds.numel))
    rounds.poll()
    assert torch.equal(rounds.weights, expected_weights(rounds, theta0, [u, update(2, rounds.numel)]))


def test_site_more_than_one_round_behind_is_told_to_resync() -> None:
    rounds = make(min_sites=1)
    session = join(rounds, "a").session_id
    for r in range(2):
        upload(rounds, "a", update(r, rounds.numel))
        assert rounds.poll() is not None
    old = wait_broadcast(rounds, "a", session, 0, timeout_s=0)
    assert old.header is not None and old.header.action == pb.BROADCAST_ACTION_RESYNC
    assert old.header.included  # the contributor history still knows
    assert old.header.next_round.round == 2
    with pytest.raises(WrongRoundError):
        wait_broadcast(rounds, "a", session, 5, timeout_s=0)
    waiting = wait_broadcast(rounds, "a", session, 2, timeout_s=0)
    assert waiting.progress is not None and waiting.progress.round == 2


def test_run_finishes_after_total_rounds_and_drains_when_sites_leave() -> None:
    rounds = make(min_sites=1, total_rounds=1)
    session = join(rounds, "a").session_id
    upload(rounds, "a", update(1, rounds.numel))
    metrics = rounds.poll()
    assert metrics is not None and metrics.run_finished
    assert rounds.finished and rounds.round == 1
    final = wait_broadcast(rounds, "a", session, 0, timeout_s=0)
    assert final.header is not None and final.header.run_finished
    with pytest.raises(RunFinishedError):
        upload(rounds, "a", update(2, rounds.numel))
    assert not rounds.drained()
    rounds.leave("a", session)
    assert rounds.drained()


def test_restart_resumes_from_checkpoint_with_a_new_session(tmp_path: Path) -> None:
    overrides = {
        "min_sites": 1,
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "algorithm": AlgorithmConfig(inner_steps=2, downlink_codec="int8"),
    }
    first = make(**overrides)
    join(first, "a")
    for r in range(2):
        upload(first, "a", update(r, first.numel))
        assert first.poll() is not None
    momentum = first.strategy.state_tensors()
    assert momentum, "expected outer momentum and a downlink residual to checkpoint"

    # The restart gets a copy of the folder as the first left it (its background checkpoint
    # done): both go on below, and two live coordinators never share one folder.
    first.wait_for_snapshot()
    shutil.copytree(tmp_path / "ckpt", tmp_path / "ckpt-copy")
    second = make(**{**overrides, "checkpoint_dir": str(tmp_path / "ckpt-copy")})
    assert second.session_id != first.session_id
    assert second.round == 2
    assert torch.equal(second.weights, first.weights)
    restored = second.strategy.state_tensors()
    assert restored.keys() == momentum.keys()
    for name, tensor in momentum.items():
        assert torch.equal(restored[name].cpu(), tensor.cpu()), name
    # The restarted coordinator still knows who counted in the rounds before it: a site that
    # asks for round 1's broadcast is told it was included (else it would resend the update).
    join(second, "a")
    assert wait_broadcast(second, "a", second.session_id, 1, timeout_s=0).header.included
    # Both continue identically from here.
    for rounds in (first, second):
        upload(rounds, "a", update(7, rounds.numel))
        rounds.poll()
    assert torch.equal(first.weights, second.weights)


def test_a_round_below_its_quorum_says_who_is_missing_at_growing_intervals(caplog: pytest.LogCaptureFixture) -> None:
    """A coordinator waiting for its quorum logs who joined and who did not, after 30 s and then
    at doubling intervals, and nothing once the round started (an operator looking at a silent
    coordinator cannot tell a wait from a hang)."""
    clock = FakeClock()
    rounds = make(clock, allowed_sites=["a", "b", "c"], min_sites=3, heartbeat_timeout_s=1000.0)
    caplog.set_level("WARNING", logger="geoloco.coordinator.phases")
    session = join(rounds, "a").session_id
    waits = [r for r in caplog.records if "waits for its quorum" in r.getMessage()]
    assert waits == []
    for _ in range(100):  # 100 s of polls, one per second
        clock.advance(1.0)
        heartbeat(rounds, "a", session)
        rounds.poll()
    waits = [r.getMessage() for r in caplog.records if "waits for its quorum" in r.getMessage()]
    assert len(waits) == 2, waits  # after 30 s and after 60 s (next: 120 s)
    assert "1 of min_sites = 3 sites joined (a); not joined: b, c; waiting for 30 s" in waits[0]
    assert "waiting for 60 s" in waits[1]
    join(rounds, "b")
    join(rounds, "c")
    rounds.poll()
    caplog.clear()
    clock.advance(300.0)
    for site in "abc":
        heartbeat(rounds, site, session)
    rounds.poll()
    assert not [r for r in caplog.records if "waits for its quorum" in r.getMessage()]


def test_a_site_failing_over_from_its_relay_to_the_coordinator_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """A relay failover left no line at the coordinator: a site whose calls came through relay
    "eu" and now arrive directly is logged at WARNING once, and its way back at INFO."""
    clock = FakeClock()
    rounds = make(clock, min_sites=2, heartbeat_timeout_s=1000.0)
    caplog.set_level("INFO", logger="geoloco.coordinator.membership")
    session = rounds.join("a", protocol_version=PROTOCOL_VERSION, via="eu").session_id
    for _ in range(3):
        rounds.heartbeat("a", session, via="eu")
    assert not [r for r in caplog.records if "reaches the coordinator" in r.getMessage()]
    for _ in range(3):
        rounds.heartbeat("a", session)
    direct = [r for r in caplog.records if "reaches the coordinator directly" in r.getMessage()]
    assert len(direct) == 1 and direct[0].levelname == "WARNING"
    assert "was through relay eu" in direct[0].getMessage() and "failed over" in direct[0].getMessage()
    rounds.heartbeat("a", session, via="eu")
    back = [r for r in caplog.records if "through relay eu" in r.getMessage() and r.levelname == "INFO"]
    assert len(back) == 1 and "(was directly)" in back[0].getMessage()


def test_a_process_joining_twice_before_any_other_call_is_not_logged_as_a_rejoin(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`geoloco site` joins once to read the run's config and its agent joins again: the CLI
    site's first join used to log "joined" then "re-joined at round 0". A re-join after the
    process made calls (a reconnect) is still said."""
    rounds = make(FakeClock(), min_sites=2, heartbeat_timeout_s=1000.0)
    caplog.set_level("INFO", logger="geoloco.coordinator.membership")
    instance = "ab" * 16
    session = rounds.join("a", protocol_version=PROTOCOL_VERSION, instance=instance).session_id
    rounds.join("a", protocol_version=PROTOCOL_VERSION, instance=instance)
    assert not [r for r in caplog.records if "re-joined" in r.getMessage()]
    rounds.heartbeat("a", session, instance=instance)
    rounds.join("a", protocol_version=PROTOCOL_VERSION, instance=instance)
    assert len([r for r in caplog.records if "re-joined" in r.getMessage()]) == 1


def test_a_quorum_wait_of_many_sites_names_twenty_and_counts_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    """With hundreds of sites a line naming every one is unreadable: the wait names the first
    20 joined and the first 20 missing, and says how many more there are of each."""
    clock = FakeClock()
    names = [f"s{i:02d}" for i in range(50)]
    rounds = make(clock, allowed_sites=names, min_sites=50, max_sites=50, heartbeat_timeout_s=1000.0)
    caplog.set_level("WARNING", logger="geoloco.coordinator.phases")
    for name in names[:25]:
        join(rounds, name)
    for _ in range(31):
        clock.advance(1.0)
        rounds.poll()
    (wait,) = [r.getMessage() for r in caplog.records if "waits for its quorum" in r.getMessage()]
    assert f"25 of min_sites = 50 sites joined ({', '.join(names[:20])} and 5 more)" in wait
    assert f"not joined: {', '.join(names[25:45])} and 5 more;" in wait

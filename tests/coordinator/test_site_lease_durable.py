"""A site name as a lease of one process, without sockets (``test_site_lease_grpc`` has the wire).

Replaced processes stay refused across a coordinator restart. A site process that another one
of its name replaced and that keeps running must not come back when the coordinator is killed and
resumed from its checkpoint folder: the resumed session is new, so every site joins again, and
without the record the replaced process would join as a fresh site and take the name back from
its successor. The record is part of the durable state, as of the last durable round, whether a
full checkpoint or a round-log entry made it durable.

And a process replaced while its SecureStage call waits for the stage to close is refused when the
call wakes, instead of sending its message again in the name its successor holds.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from _round_helpers import FakeClock, heartbeat, join, tiny_weights, upload

from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
from geoloco.algorithms.privacy.secagg_messages import STAGE_CONSISTENCY
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.checkpoint import load_latest_checkpoint
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.membership import DURABLE_REPLACED_PER_SITE
from geoloco.coordinator.phases import HISTORY_KEY
from geoloco.coordinator.round_log import RoundLog
from geoloco.coordinator.rounds import RoundStateMachine
from geoloco.protos.errors import SiteReplacedError

OLD, NEW = "0ld0ld0ld0ld", "n3wn3wn3wn3w"
"""Instance ids of two processes of site "a"."""


def _machine(folder: Path) -> RoundStateMachine:
    """A coordinator on ``folder``; a second one on the same folder is the first restarted after
    ``kill -9`` (the first is dropped without ``close``)."""
    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(inner_steps=2), insecure=True, total_rounds=20, min_sites=1,
        checkpoint_dir=str(folder), checkpoint_every=100,
    )
    weights, layout = tiny_weights()
    return RoundStateMachine(config, weights, layout, clock=FakeClock())


def _round(machine: RoundStateMachine, r: int) -> None:
    upload(machine, "a", torch.randn(machine.numel, generator=torch.Generator().manual_seed(r)))
    assert machine.poll() is not None


def _refused(machine: RoundStateMachine, instance: str) -> str:
    with pytest.raises(SiteReplacedError) as info:
        join(machine, "a", instance=instance)
    return str(info.value)


@pytest.mark.parametrize("durable_by", ["checkpoint", "round log"])
def test_a_resumed_coordinator_refuses_a_process_replaced_before_the_restart(tmp_path: Path, durable_by: str) -> None:
    first = _machine(tmp_path)
    join(first, "a", instance=OLD)
    if durable_by == "round log":
        _round(first, 0)  # the session's first round is made durable by a full checkpoint
    join(first, "a", instance=NEW, peer="ipv4:10.0.0.7:5000")
    _round(first, first.round)
    if durable_by == "round log":
        assert [e.round for e in RoundLog(tmp_path).entries(1)] == [1]
    else:
        checkpoint = load_latest_checkpoint(tmp_path)
        assert checkpoint is not None and checkpoint.metadata[HISTORY_KEY]["replaced"][0]["instance"] == OLD

    second = _machine(tmp_path)  # restarted: a new session, no members
    assert second.round == first.round
    message = _refused(second, OLD)  # the replaced process, still running, joins again first
    assert "ipv4:10.0.0.7:5000" in message and NEW[:8] in message and OLD[:8] in message, message
    session = join(second, "a", instance=NEW).session_id
    assert not heartbeat(second, "a", session, instance=NEW).rejoin_required
    _refused(second, OLD)
    # A process the restarted one replaces is refused by the next restart alike.
    join(second, "a", instance="n3xtn3xtn3xt")
    _round(second, second.round)
    third = _machine(tmp_path)
    _refused(third, OLD)
    _refused(third, NEW)
    join(third, "a", instance="n3xtn3xtn3xt")
    for machine in (first, second, third):
        machine.close()


def test_the_newest_replaced_processes_of_each_name_are_kept(tmp_path: Path) -> None:
    machine = _machine(tmp_path)
    instances = [f"a-process-{i}" for i in range(DURABLE_REPLACED_PER_SITE + 3)]
    for instance in instances:
        join(machine, "a", instance=instance)
    join(machine, "b", instance="b-process-0")
    join(machine, "b", instance="b-process-1")
    state = machine.membership.state()
    assert [(e["site"], e["instance"]) for e in state] == [
        *(("a", i) for i in instances[-1 - DURABLE_REPLACED_PER_SITE:-1]), ("b", "b-process-0")
    ]
    restarted = _machine(tmp_path / "other")
    restarted.membership.load_state(state)
    assert restarted.membership.state() == state
    machine.close()
    restarted.close()


def test_a_checkpoint_written_before_replaced_processes_were_kept_resumes_with_none(tmp_path: Path) -> None:
    machine = _machine(tmp_path)
    join(machine, "a", instance=OLD)
    join(machine, "a", instance=NEW)
    history: dict[str, object] = {"contributors": {}, "folded": {}, "deadline": [], "update_norms": []}
    machine.phases.restore_state({HISTORY_KEY: history})
    assert machine.membership.state() == []
    machine.close()


class _StageClock(FakeClock):
    """Tells when the stage call's thread first reads the clock: past the call's membership
    check (``Membership.member`` stamps the call as a sign of life), about to wait."""

    def __init__(self) -> None:
        super().__init__()
        self.caller: threading.Thread | None = None
        self.called = threading.Event()

    def __call__(self) -> float:
        if threading.current_thread() is self.caller:
            self.called.set()
        return super().__call__()


def test_a_process_replaced_while_its_secure_stage_call_waits_is_refused_when_it_wakes() -> None:
    config = CoordinatorConfig(
        insecure=True, min_sites=3, total_rounds=2,
        privacy=PrivacyConfig(secure_aggregation=True, clip_norm=1.0),
    )
    weights, layout = tiny_weights()
    clock = _StageClock()  # never moves: the call waits until something else ends it
    machine = RoundStateMachine(config, weights, layout, clock=clock)
    session = join(machine, "a", instance=OLD).session_id
    outcome: list[object] = []

    def stage_call() -> None:
        try:
            outcome.append(
                machine.secure_stage("a", session, 0, STAGE_CONSISTENCY, None, wait_s=60.0, instance=OLD)
            )
        except SiteReplacedError as err:
            outcome.append(err)

    caller = clock.caller = threading.Thread(target=stage_call, daemon=True)
    caller.start()
    try:
        assert clock.called.wait(10)
        join(machine, "a", instance=NEW)  # the round waits for 3 sites: the call is still waiting
        caller.join(10)
        assert not caller.is_alive(), "the replaced process's stage call went on waiting"
        assert len(outcome) == 1 and isinstance(outcome[0], SiteReplacedError), outcome
        assert NEW[:8] in str(outcome[0])
    finally:
        machine.close()
        caller.join(10)

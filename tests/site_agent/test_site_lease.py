"""One process per site name, one process per state folder: real site agents over gRPC with
mutual TLS on a loopback port.

* Two agents holding the same certificate: the newer one's join takes the name, the older one
  learns it at its next heartbeat or call, stops without leaving (the name is the newer one's)
  and ``run`` raises ``SiteReplaced`` saying when and from where the other joined. It reports no
  round after the newer one joined, so it cannot claim an update the newer one sent; the newer
  one trains to the end and every one of its rounds counts.
* A second agent on a state folder in use is refused, naming the holder's pid and host; a lock
  left by a process gone from this host is taken over with a warning.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _agent_helpers import AgentThread, make_agent, make_certs, start_coordinator, wait_until

from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.scenarios.workloads import MLPWorkload
from geoloco.site_agent.client import SiteReplaced
from geoloco.site_agent.config import JoinInfo, RoundResult, SiteAgentConfig, SiteHooks
from geoloco.site_agent.persist import LOCK_NAME, SiteStateError

ROUNDS = 8


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"), ["a"])


class Seen:
    """What one agent's hooks saw: the round it joined at, the rounds it reported."""

    def __init__(self) -> None:
        self.joined: list[int] = []
        self.rounds: list[RoundResult] = []

    def hooks(self) -> SiteHooks:
        def on_join(info: JoinInfo) -> None:
            self.joined.append(info.round)

        return SiteHooks(on_join=on_join, on_round_end=self.rounds.append)


def test_a_second_agent_with_the_same_name_replaces_the_first_which_stops(
    certs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mlp = MLPWorkload()
    server = start_coordinator(
        certs, mlp.build_model(0), total_rounds=ROUNDS, min_sites=1, seed=0,
        heartbeat_interval_s=0.2, algorithm=AlgorithmConfig(inner_steps=2),
    )
    caplog.set_level(logging.INFO, logger="geoloco.coordinator.membership")
    old_seen, new_seen = Seen(), Seen()
    try:
        older = make_agent(mlp, server, certs, "a", index=0, num_sites=1, seed=0, hooks=old_seen.hooks())
        old_thread = AgentThread(older)
        old_thread.start()
        wait_until(lambda: server.rounds.round >= 2, server)
        newer = make_agent(mlp, server, certs, "a", index=0, num_sites=1, seed=1, hooks=new_seen.hooks())
        new_thread = AgentThread(newer)
        new_thread.start()
        old_thread.join(60)
        assert not old_thread.is_alive(), "the replaced agent did not stop"
        summary = new_thread.finish()
    finally:
        server.stop(grace=0)

    assert isinstance(old_thread.error, SiteReplaced), old_thread.error or old_thread.summary
    message = str(old_thread.error)
    assert "another process joined as site 'a' at " in message and " from ip" in message, message
    assert newer.instance_id[:8] in message and older.instance_id[:8] in message, message
    assert "this one" in message and "stops" in message

    # The older agent reported only rounds broadcast before the newer one joined; the newer one
    # trained every round from there to the end, and each counted. A newer process that joins
    # while the round it joins at is already closing (the older one's update in it) trains from
    # the next round: which of the two happens is the machine's timing.
    taken_at = new_seen.joined[0]
    assert all(r.round < taken_at for r in old_seen.rounds), ([r.round for r in old_seen.rounds], taken_at)
    trained = [r.round for r in new_seen.rounds]
    assert trained in (list(range(taken_at, ROUNDS)), list(range(taken_at + 1, ROUNDS))), (trained, taken_at)
    assert all(r.included for r in new_seen.rounds)
    assert summary.run_finished and summary.rounds_included == summary.rounds_trained == len(trained)

    messages = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "geoloco.coordinator.membership"]
    replaced = [m for level, m in messages if level == logging.WARNING]
    assert len(replaced) == 1 and older.instance_id[:8] in replaced[0] and newer.instance_id[:8] in replaced[0]
    assert [m for _, m in messages if " left" in m] == [m for _, m in messages if "site a left" in m]
    assert len([m for _, m in messages if "site a left" in m]) == 1, messages  # the newer one only


def _config(state_dir: Path) -> SiteAgentConfig:
    return SiteAgentConfig(device="cpu", backoff_initial_s=0.05, backoff_max_s=0.5, state_dir=str(state_dir))


def test_a_second_agent_on_a_state_folder_in_use_is_refused_naming_the_holder(certs: Path, tmp_path: Path) -> None:
    mlp = MLPWorkload()
    state_dir = tmp_path / "state"
    server = start_coordinator(certs, mlp.build_model(0), total_rounds=2, min_sites=1, seed=0)
    try:
        first = make_agent(mlp, server, certs, "a", index=0, num_sites=1, seed=0, config=_config(state_dir))
        with pytest.raises(SiteStateError) as info:
            make_agent(mlp, server, certs, "a", index=0, num_sites=1, seed=0, config=_config(state_dir))
        message = str(info.value)
        assert "\n" not in message and f"{state_dir} is in use by another site process" in message, message
        assert f"pid {os.getpid()} on {socket.gethostname()}" in message and "site a" in message, message
        assert "--state-dir" in message
        thread = AgentThread(first, 1)
        thread.start()
        assert thread.finish().final_round == 1
        assert not (state_dir / LOCK_NAME).exists()  # released when its run ended
        again = make_agent(mlp, server, certs, "a", index=0, num_sites=1, seed=0, config=_config(state_dir))
        assert again.held_round == 1
        again.run(max_rounds=1)  # holds the folder again until it is done
        assert not (state_dir / LOCK_NAME).exists()
    finally:
        server.stop(grace=0)


def test_a_lock_left_by_a_process_that_is_gone_is_taken_over_with_a_warning(
    certs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    pid = int(gone.stdout)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / LOCK_NAME).write_text(f"pid {pid} on {socket.gethostname()}, since 2025-01-01 00:00:00 UTC, site a\n")
    mlp = MLPWorkload()
    server = start_coordinator(certs, mlp.build_model(0), total_rounds=1, min_sites=1, seed=0)
    try:
        caplog.set_level(logging.WARNING, logger="geoloco.site_agent")
        agent = make_agent(mlp, server, certs, "a", index=0, num_sites=1, seed=0, config=_config(state_dir))
        assert (state_dir / LOCK_NAME).read_text().startswith(f"pid {os.getpid()} on {socket.gethostname()}, since ")
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        assert f"pid {pid} on {socket.gethostname()}" in warnings[0] and "no longer running" in warnings[0]
        assert "took over the lock" in warnings[0] and str(state_dir) in warnings[0]
        agent.run()
    finally:
        server.stop(grace=0)

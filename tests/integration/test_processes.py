"""Real processes: ``geoloco coordinator`` and ``geoloco site`` on loopback with mutual TLS.

Every coordinator and site is its own ``python -m geoloco.scenarios.cli`` process (port 0, read
back from stdout; temporary certificates and folders; the tiny MLP workload). Faults are real:
``kill -9`` of a site mid-round and of the coordinator mid-round, then the same command again.

* ``test_killed_site_is_excluded_a_late_site_catches_up_and_the_restarted_site_rejoins``: site "1"
  is killed right after finishing a round, so it dies in the middle of the next one. The quorum
  (``min_sites = 2``) holds that round open until a brand-new site "2" joins (at round >= 3),
  fetches the weights and uploads; the round then closes without "1", which the metrics list as
  excluded. While "1" is dead but still a member, each round closes at its 2 s deadline; the
  restarted "1" re-joins, fetches the current weights and contributes again. Every process ends
  holding the coordinator's final weights (digests compared).
* ``test_coordinator_killed_mid_round_restarts_from_its_checkpoint_and_matches_the_simulator``:
  site "1" is frozen (SIGSTOP) after round 2, so the coordinator holds the next round open with
  site "0"'s update in it; the coordinator is killed there, restarted with the same command (plus
  the port it had printed), resumes from its checkpoint; site "1" is thawed (SIGCONT) and both
  sites reconnect, re-join and re-send by themselves. With two sites the final weights equal the
  uninterrupted simulator's bitwise (a sum of two updates does not depend on their order; see
  test_real_system_matches_simulator.py).
* ``test_coordinator_killed_between_checkpoint_and_metrics_replays_the_lost_record``: the
  coordinator kills itself (SIGKILL, from a listener on its own round events, so at exactly that
  moment) right after the checkpoint that follows round 3 is on disk, before round 3's metrics
  record is written or its broadcast installed. The same command resumes; metrics.jsonl ends with
  every round exactly once (round 3 replayed from the checkpoint) and the final weights equal the
  uninterrupted simulator's bitwise.

Waits are on stdout lines (conditions with timeouts). Where a fault is injected right after a line
(site "1" killed after round 2), the run has many rounds left, so the test reacting late changes
which round is hit, never whether the scenario happens.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import torch
from _cluster import make_certs
from _processes import (
    COORDINATOR_END,
    COORDINATOR_ROUND,
    LISTENING,
    SITE_END,
    SITE_JOINED,
    SITE_ROUND,
    STARTING,
    Process,
    Processes,
    names,
)

from geoloco.algorithms.optimizers import InnerOptimizerConfig
from geoloco.algorithms.simulation.clock import SiteConfig
from geoloco.algorithms.simulation.simulator import SimulationConfig, Simulator, SimulatorConfig
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.checkpoint import load_latest_checkpoint
from geoloco.coordinator.metrics import read_metrics
from geoloco.coordinator.round_log import RoundLog
from geoloco.scenarios.workloads import build_workload


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"), ["0", "1", "2"])


KILLED_AT = [sys.executable, str(Path(__file__).with_name("_coordinator_killed_at.py"))]
"""``geoloco coordinator`` that SIGKILLs itself at a round event (EVENT ROUND before its args)."""


def _coordinator(
    processes: Processes, label: str, config: Path, certs: Path, *extra: str,
    kill_at: tuple[str, int] | tuple[str, int, str] | None = None,
) -> tuple[Process, int]:
    moment = [] if kill_at is None else [str(part) for part in kill_at]
    process = processes.start(
        label, *moment, "coordinator", "--config", str(config), "--certs", str(certs), "--http-port", "0", *extra,
        command=None if kill_at is None else KILLED_AT,
    )
    _, match = process.wait_line(LISTENING, what="the listening line")
    return process, int(match["port"])


def _site(processes: Processes, label: str, name: str, port: int, certs: Path, *extra: str) -> Process:
    return processes.start(
        label, "site", "--coordinator", f"localhost:{port}", "--name", name, "--certs", str(certs),
        "--device", "cpu", "--backoff-max", "0.5", *extra,
    )


def _finished_digest(process: Process) -> str:
    """The digest in a site's final line, after checking it exited 0 with the run finished."""
    assert process.wait_exit() == 0, process.describe()
    _, end = process.wait_line(SITE_END, what="the final line")
    assert end["how"] == "finished" and end["run_finished"] == "yes", process.describe()
    return end["digest"]


KILLED_SITE_CONFIG = """
total_rounds = {rounds}
seed = 3
min_sites = 2
round_deadline_s = 2.0
allowed_sites = ["0", "1", "2"]
heartbeat_interval_s = 0.5
heartbeat_timeout_s = 120.0
drain_timeout_s = 20.0
metrics_path = "{metrics}"

[workload]
name = "mlp"

[algorithm]
inner_steps = 3
uplink_codec = "int8"
downlink_codec = "int8"

[inner_optimizer]
lr = 3e-3
"""


def test_killed_site_is_excluded_a_late_site_catches_up_and_the_restarted_site_rejoins(
    certs: Path, tmp_path: Path
) -> None:
    rounds = 30
    metrics = tmp_path / "metrics.jsonl"
    config = tmp_path / "coordinator.toml"
    config.write_text(KILLED_SITE_CONFIG.format(rounds=rounds, metrics=metrics))
    with Processes(tmp_path) as processes:
        coordinator, port = _coordinator(processes, "coordinator", config, certs)
        steady = _site(processes, "site-0", "0", port, certs)
        victim = _site(processes, "site-1", "1", port, certs)

        # Kill "1" the moment it has finished round 2: it dies in the middle of round 3.
        victim.wait_line(SITE_ROUND, where=lambda m: int(m["round"]) >= 2, what="site 1 finishing round 2")
        victim.kill(signal.SIGKILL)
        assert victim.wait_exit() == -signal.SIGKILL

        # A new site joins the running run, catches up and is included.
        late = _site(processes, "site-2", "2", port, certs)
        _, first = late.wait_line(SITE_ROUND, what="the late site's first round")
        assert int(first["round"]) >= 3, "the late site should start at the round the run reached"
        assert first["included"] == "yes", "its upload completes the quorum, so it counts"
        _, same_round = coordinator.wait_line(
            COORDINATOR_ROUND, where=lambda m: m["round"] == first["round"], what="the late site's round"
        )
        assert first["digest"] == same_round["digest"], "the late site is out of sync"

        # The round that closed without the dead site lists it as excluded.
        excluded_at, excluded = coordinator.wait_line(
            COORDINATOR_ROUND, where=lambda m: "1" in names(m["excluded"]), what="site 1 excluded"
        )
        assert "1" not in names(excluded["participants"])

        # The same command brings "1" back: it re-joins, fetches the weights and contributes.
        restarted = _site(processes, "site-1-again", "1", port, certs)
        _, back = coordinator.wait_line(
            COORDINATOR_ROUND,
            start=excluded_at + 1,
            where=lambda m: "1" in names(m["participants"]),
            what="site 1 contributing again",
        )
        assert int(back["round"]) > int(excluded["round"])

        assert coordinator.wait_exit() == 0, coordinator.describe()
        _, end = coordinator.wait_line(COORDINATOR_END, what="the coordinator's final line")
        assert end["how"] == "finished" and end["round"] == str(rounds)
        digests = {p.label: _finished_digest(p) for p in (steady, late, restarted)}
        assert set(digests.values()) == {end["digest"]}, f"replicas differ: {digests}"

    records = read_metrics(metrics)
    assert [r["round"] for r in records] == list(range(rounds))
    assert len({r["session_id"] for r in records}) == 1
    rejoined = [r for r in records if r["round"] >= int(back["round"])]
    assert all("1" in r["members"] for r in rejoined)
    assert any(r["bytes_up"].get("2", 0) > 0 for r in records)


KILLED_COORDINATOR_CONFIG = """
total_rounds = {rounds}
seed = {seed}
min_sites = 2
heartbeat_interval_s = 0.5
heartbeat_timeout_s = 30.0
drain_timeout_s = 20.0
checkpoint_dir = "{checkpoints}"
metrics_path = "{metrics}"

[workload]
name = "mlp"

[algorithm]
inner_steps = {inner_steps}
uplink_codec = "int8"
downlink_codec = "int8"

[inner_optimizer]
lr = {lr}
"""


def _simulate(rounds: int, seed: int, inner_steps: int, lr: float) -> torch.Tensor:
    config = SimulatorConfig(
        algorithm=AlgorithmConfig(inner_steps=inner_steps, uplink_codec="int8", downlink_codec="int8"),
        inner_optimizer=InnerOptimizerConfig(lr=lr),
        sites=[SiteConfig(), SiteConfig()],
        simulation=SimulationConfig(rounds=rounds, seed=seed, device="cpu", eval_every=10**6),
    )
    simulator = Simulator(config, build_workload("mlp"))
    for _ in simulator.run():
        pass
    return simulator.global_flat


def test_coordinator_killed_mid_round_restarts_from_its_checkpoint_and_matches_the_simulator(
    certs: Path, tmp_path: Path
) -> None:
    rounds, seed, inner_steps, lr = 12, 4, 3, 3e-3
    checkpoints = tmp_path / "checkpoints"
    metrics = tmp_path / "metrics.jsonl"
    config = tmp_path / "coordinator.toml"
    config.write_text(
        KILLED_COORDINATOR_CONFIG.format(
            rounds=rounds, seed=seed, inner_steps=inner_steps, lr=lr,
            checkpoints=checkpoints, metrics=metrics,
        )
    )
    with Processes(tmp_path) as processes:
        first, port = _coordinator(processes, "coordinator", config, certs)
        sites = [_site(processes, f"site-{k}", str(k), port, certs) for k in range(2)]

        # Freeze site 1 after round 2: the coordinator holds the next round open (site 0's update
        # in, site 1's missing) until site 1 comes back. kill -9 it right there.
        sites[1].wait_line(SITE_ROUND, where=lambda m: m["round"] == "2", what="site 1 finishing round 2")
        sites[1].kill(signal.SIGSTOP)
        first.wait_line(COORDINATOR_ROUND, where=lambda m: m["round"] == "2", what="round 2")
        first.kill(signal.SIGKILL)
        assert first.wait_exit() == -signal.SIGKILL

        # The same command (with the port it printed, so the sites find it) resumes.
        second, second_port = _coordinator(
            processes, "coordinator-again", config, certs, "--port", str(port)
        )
        assert second_port == port
        _, starting = second.wait_line(STARTING, what="the starting line")
        assert 3 <= int(starting["round"]) < rounds and "resumed from checkpoint" in starting["how"]
        sites[1].kill(signal.SIGCONT)
        for site in sites:  # the sites reconnect and re-join by themselves
            site.wait_line(
                SITE_ROUND, where=lambda m: int(m["round"]) >= int(starting["round"]),
                what="a round after the restart",
            )

        assert second.wait_exit() == 0, second.describe()
        _, end = second.wait_line(COORDINATOR_END, what="the coordinator's final line")
        assert end["how"] == "finished" and end["round"] == str(rounds)
        digests = [_finished_digest(site) for site in sites]
        assert set(digests) == {end["digest"]}, f"replicas differ: {digests} vs {end['digest']}"
        for site in sites:
            sessions = {m["session"] for line in site.lines if (m := SITE_JOINED.match(line))}
            assert len(sessions) == 2, f"{site.label} should have joined both coordinator sessions"

    checkpoint = load_latest_checkpoint(checkpoints)
    assert checkpoint is not None and checkpoint.round == rounds
    assert torch.equal(checkpoint.tensors["weights"], _simulate(rounds, seed, inner_steps, lr))
    records = read_metrics(metrics)
    assert records[-1]["round"] == rounds - 1 and records[-1]["run_finished"]
    assert len({r["session_id"] for r in records}) == 2


def _resume_and_finish(
    processes: Processes, config: Path, certs: Path, port: int, sites: list[Process], *, start: int, rounds: int
) -> None:
    """The killed coordinator's command again (on its port): it resumes at round ``start``,
    finishes the run, and every site ends on its final digest."""
    second, _ = _coordinator(processes, "coordinator-again", config, certs, "--port", str(port))
    _, starting = second.wait_line(STARTING, what="the starting line")
    assert starting["round"] == str(start) and "resumed from checkpoint" in starting["how"]
    assert second.wait_exit() == 0, second.describe()
    _, end = second.wait_line(COORDINATOR_END, what="the coordinator's final line")
    assert end["how"] == "finished" and end["round"] == str(rounds)
    digests = [_finished_digest(site) for site in sites]
    assert set(digests) == {end["digest"]}, f"replicas differ: {digests} vs {end['digest']}"


def test_coordinator_killed_between_checkpoint_and_metrics_replays_the_lost_record(
    certs: Path, tmp_path: Path
) -> None:
    rounds, seed, inner_steps, lr, lost = 6, 5, 3, 3e-3, 3
    checkpoints = tmp_path / "checkpoints"
    metrics = tmp_path / "metrics.jsonl"
    config = tmp_path / "coordinator.toml"
    config.write_text(
        KILLED_COORDINATOR_CONFIG.format(
            rounds=rounds, seed=seed, inner_steps=inner_steps, lr=lr,
            checkpoints=checkpoints, metrics=metrics,
        )
    )
    with Processes(tmp_path) as processes:
        # The checkpoint written after round `lost` is for round `lost + 1`.
        first, port = _coordinator(processes, "coordinator", config, certs, kill_at=("checkpoint_saved", lost + 1))
        sites = [_site(processes, f"site-{k}", str(k), port, certs) for k in range(2)]
        assert first.wait_exit() == -signal.SIGKILL, first.describe()
        # Killed at the chosen moment: round `lost` is durable (in the round log, beside the
        # checkpoint of the round before: its own snapshot is written after the broadcast), its
        # record is not written.
        checkpoint = load_latest_checkpoint(checkpoints)
        assert checkpoint is not None and checkpoint.round == lost
        assert RoundLog(checkpoints).newest_round() == lost
        assert [r["round"] for r in read_metrics(metrics)] == list(range(lost))

        _resume_and_finish(processes, config, certs, port, sites, start=lost + 1, rounds=rounds)

    records = read_metrics(metrics)
    assert [r["round"] for r in records] == list(range(rounds)), "every round exactly once"
    replayed = records[lost]
    assert replayed.get("replayed") is True and replayed["session_id"] == records[0]["session_id"]
    assert set(replayed["participants"]) == {"0", "1"} and replayed["eval_loss"] is not None
    assert all(r["replayed"] is False for i, r in enumerate(records) if i != lost)
    checkpoint = load_latest_checkpoint(checkpoints)
    assert checkpoint is not None and checkpoint.round == rounds
    assert torch.equal(checkpoint.tensors["weights"], _simulate(rounds, seed, inner_steps, lr))


def test_coordinator_killed_mid_broadcast_replays_its_round_log_and_matches_the_simulator(
    certs: Path, tmp_path: Path
) -> None:
    """Killed while round `mid`'s broadcast is on its way: the sites may hold weights that no
    full checkpoint has, only the round log (here every round after the first: snapshots only
    every 100 rounds). The restarted coordinator replays the log to exactly those weights, and
    the run ends on the uninterrupted run's."""
    rounds, seed, inner_steps, lr, mid = 7, 6, 3, 3e-3, 3
    checkpoints = tmp_path / "checkpoints"
    metrics = tmp_path / "metrics.jsonl"
    config = tmp_path / "coordinator.toml"
    text = KILLED_COORDINATOR_CONFIG.format(
        rounds=rounds, seed=seed, inner_steps=inner_steps, lr=lr, checkpoints=checkpoints, metrics=metrics,
    )
    config.write_text(text.replace("checkpoint_dir =", "checkpoint_every = 100\ncheckpoint_dir =", 1))
    with Processes(tmp_path) as processes:
        first, port = _coordinator(
            processes, "coordinator", config, certs, kill_at=("checkpoint_saved", mid + 1, "bytes_sent")
        )
        sites = [_site(processes, f"site-{k}", str(k), port, certs) for k in range(2)]
        assert first.wait_exit() == -signal.SIGKILL, first.describe()
        snapshot = load_latest_checkpoint(checkpoints)
        assert snapshot is not None and snapshot.round == 1, "only round 0 has a full checkpoint"
        assert [e.round for e in RoundLog(checkpoints).entries(1)] == list(range(1, mid + 1))

        _resume_and_finish(processes, config, certs, port, sites, start=mid + 1, rounds=rounds)

    records = read_metrics(metrics)
    assert [r["round"] for r in records] == list(range(rounds)), "every round exactly once"
    checkpoint = load_latest_checkpoint(checkpoints)
    assert checkpoint is not None and checkpoint.round == rounds
    assert torch.equal(checkpoint.tensors["weights"], _simulate(rounds, seed, inner_steps, lr))
    assert RoundLog(checkpoints).entries(0) == [], "the final checkpoint leaves no round log behind"

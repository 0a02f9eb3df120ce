"""A site killed with ``kill -9`` and restarted with the same ``--state-dir`` ends on the weights
of an uninterrupted run, bit for bit.

Real processes (``geoloco coordinator`` and two ``geoloco site``, mutual TLS, the tiny MLP), with
``min_sites = 2`` and no round deadline, so every round waits for both sites and the run is
deterministic: its final weights equal the simulator's uninterrupted run exactly (a sum of two
updates does not depend on their order; see test_real_system_matches_simulator.py). Site "1" is
killed three times, each time at a different moment of a round, and restarted with the same
command:

1. **mid-training** (right after it says it started round 2's inner steps; its steps are slowed
   by ``--speed-factor``): it restarts from the state saved after round 1's broadcast and trains
   round 2 again, from the same optimizer state, residual and data position;
2. **after its upload, before the broadcast** (site "0" frozen with SIGSTOP while it waits for
   round 4's broadcast, so round 5 stays open holding site "1"'s update): it restarts with the
   saved update and re-sends the same bytes, which the coordinator recognises;
3. **while the broadcast is on its way** (both frozen once site "1" uploaded round 7, site "0"
   thawed: the round closes and is broadcast to the frozen site "1", which is then killed): the
   restarted site finds the coordinator a round ahead and takes round 7's broadcast, which says
   its saved update was aggregated.

Without the saved state the restarted site would start its inner optimizer and error feedback
from zero and read its data from the first batch again, and the final weights would differ.
"""

from __future__ import annotations

import re
import signal
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
    Process,
    Processes,
)

from geoloco.algorithms.optimizers import InnerOptimizerConfig
from geoloco.algorithms.simulation.clock import SiteConfig
from geoloco.algorithms.simulation.simulator import SimulationConfig, Simulator, SimulatorConfig
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.checkpoint import load_latest_checkpoint
from geoloco.scenarios.workloads import build_workload

ROUNDS, SEED, INNER_STEPS, LR = 10, 6, 3, 3e-3

CONFIG = """
total_rounds = {rounds}
seed = {seed}
min_sites = 2
heartbeat_interval_s = 0.5
heartbeat_timeout_s = 120.0
drain_timeout_s = 20.0
checkpoint_dir = "{checkpoints}"

[workload]
name = "mlp"

[algorithm]
inner_steps = {inner_steps}
uplink_codec = "int8"
downlink_codec = "int8"

[inner_optimizer]
name = "adamw"
lr = {lr}
"""

TRAINING = re.compile(r"^geoloco-site (?P<site>\S+) round (?P<round>\d+) training$")
UPLOAD_COMPLETE = re.compile(r"^geoloco-coordinator round (?P<round>\d+) upload complete: (?P<site>\S+)$")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"), ["0", "1"])


def _simulate() -> torch.Tensor:
    config = SimulatorConfig(
        algorithm=AlgorithmConfig(inner_steps=INNER_STEPS, uplink_codec="int8", downlink_codec="int8"),
        inner_optimizer=InnerOptimizerConfig(name="adamw", lr=LR),
        sites=[SiteConfig(), SiteConfig()],
        simulation=SimulationConfig(rounds=ROUNDS, seed=SEED, device="cpu", eval_every=10**6),
    )
    simulator = Simulator(config, build_workload("mlp"))
    for _ in simulator.run():
        pass
    return simulator.global_flat


def _site_args(name: str, port: int, certs: Path, state_dir: Path, *extra: str) -> list[str]:
    return [
        "site", "--coordinator", f"localhost:{port}", "--name", name, "--certs", str(certs),
        "--device", "cpu", "--backoff-max", "0.5", "--state-dir", str(state_dir), *extra,
    ]


def _kill(process: Process) -> None:
    process.kill(signal.SIGKILL)
    assert process.wait_exit() == -signal.SIGKILL


def test_site_killed_at_three_moments_of_a_round_ends_on_the_uninterrupted_weights(
    certs: Path, tmp_path: Path
) -> None:
    checkpoints = tmp_path / "checkpoints"
    config = tmp_path / "coordinator.toml"
    config.write_text(
        CONFIG.format(rounds=ROUNDS, seed=SEED, inner_steps=INNER_STEPS, lr=LR, checkpoints=checkpoints)
    )
    state_dir = tmp_path / "site-1-state"
    with Processes(tmp_path) as processes:
        coordinator = processes.start(
            "coordinator", "coordinator", "--config", str(config), "--certs", str(certs), "--http-port", "0"
        )
        _, listening = coordinator.wait_line(LISTENING, what="the listening line")
        port = int(listening["port"])
        site0 = processes.start("site-0", *_site_args("0", port, certs, tmp_path / "site-0-state"))
        # Site 1's inner steps are slowed (100x): a kill on its "training" line lands
        # mid-training, and site 0 (full speed) uploads first in every round.
        site1_args = _site_args("1", port, certs, state_dir, "--speed-factor", "0.01")
        site1 = processes.start("site-1", *site1_args)

        def uploaded(round_number: int, site: str) -> None:
            coordinator.wait_line(
                UPLOAD_COMPLETE, where=lambda m: m["round"] == str(round_number) and m["site"] == site,
                what=f"site {site}'s upload of round {round_number}",
            )

        # 1. Mid-training.
        site1.wait_line(TRAINING, where=lambda m: m["round"] == "2", what="site 1 training round 2")
        _kill(site1)
        site1 = processes.start("site-1-again", *site1_args)
        site1.wait_line(SITE_ROUND, where=lambda m: int(m["round"]) >= 2, what="site 1 finishing round 2")

        # 2. After its upload, before the broadcast. Site 0 is frozen while it waits for round
        # 4's broadcast, so round 5 stays open once site 1 uploaded to it.
        uploaded(4, "0")
        site0.kill(signal.SIGSTOP)
        uploaded(5, "1")
        _kill(site1)
        site1 = processes.start("site-1-third", *site1_args)
        site1.wait_line(SITE_JOINED, what="site 1 joining again")
        site0.kill(signal.SIGCONT)
        _, fifth = site1.wait_line(SITE_ROUND, what="site 1's first round after the restart")
        assert fifth["round"] == "5" and fifth["included"] == "yes", site1.describe()

        # 3. While the broadcast is on its way: site 0 frozen again (round 7 open with site 1's
        # update), site 1 frozen too, site 0 thawed: round 7 closes and is broadcast to a frozen
        # site 1, which is killed before it could read it.
        uploaded(6, "0")
        site0.kill(signal.SIGSTOP)
        uploaded(7, "1")
        site1.kill(signal.SIGSTOP)
        site0.kill(signal.SIGCONT)
        coordinator.wait_line(COORDINATOR_ROUND, where=lambda m: m["round"] == "7", what="round 7 closing")
        _kill(site1)
        site1 = processes.start("site-1-fourth", *site1_args)
        _, seventh = site1.wait_line(SITE_ROUND, what="site 1's first round after the restart")
        assert seventh["round"] == "7" and seventh["included"] == "yes", site1.describe()

        assert coordinator.wait_exit() == 0, coordinator.describe()
        _, end = coordinator.wait_line(COORDINATOR_END, what="the coordinator's final line")
        assert end["how"] == "finished" and end["round"] == str(ROUNDS)
        for site in (site0, site1):
            assert site.wait_exit() == 0, site.describe()
            _, site_end = site.wait_line(SITE_END, what="the final line")
            assert site_end["digest"] == end["digest"], site.describe()
        included = [m for line in site1.lines if (m := SITE_ROUND.match(line))]
        assert all(m["included"] == "yes" for m in included), site1.describe()
        # A restarted site resends its saved update with the manifest it was first sent with
        # (its phase times included): the coordinator never sees another manifest for it.
        refused = [p.label for p in processes.started if "different manifest" in p.stderr_path.read_text()]
        assert not refused, refused

    checkpoint = load_latest_checkpoint(checkpoints)
    assert checkpoint is not None and checkpoint.round == ROUNDS
    assert torch.equal(checkpoint.tensors["weights"], _simulate())

"""The emulator's pure parts without processes: fault timing, the metrics tail, child commands."""

from __future__ import annotations

import json
from pathlib import Path

from geoloco.scenarios.child_commands import coordinator_table, site_command
from geoloco.scenarios.fault_schedule import RESTORE_COORDINATOR, RESTORE_SITE, FaultEvent, FaultSchedule
from geoloco.scenarios.run_metrics import MetricsTail
from geoloco.scenarios.scenario import Fault, parse_scenario


def test_faults_fire_in_order_after_their_round_and_restorations_come_due() -> None:
    late = Fault(kind="kill_coordinator", at_round=1, after_s=2.0)
    early = Fault(kind="kill_site", at_round=0, after_s=1.0, site="a")
    upload = Fault(kind="kill_site", at_round=1, site="b", after_upload=True)
    schedule = FaultSchedule([late, upload, early])
    started = {0: 10.0}
    uploads: dict[tuple[int, str], float] = {}
    seen = lambda r, s: uploads.get((r, s))  # noqa: E731
    assert schedule.due_faults(10.5, started, seen) == []
    assert schedule.due_faults(11.0, started, seen) == [early]
    started[1] = 20.0
    assert schedule.due_faults(21.0, started, seen) == []  # waits for b's upload in round 1
    uploads[(1, "b")] = 21.5
    assert schedule.due_faults(22.0, started, seen) == [upload, late]
    assert schedule.due_faults(99.0, started, seen) == []

    event = FaultEvent(fault=late, fired_s=22.0, fired_round=1)
    schedule.restore_at(27.0, RESTORE_COORDINATOR, event)
    schedule.restore_at(25.0, RESTORE_SITE, event, "a")
    assert schedule.coordinator_down
    assert schedule.due_restorations(26.0) == [(RESTORE_SITE, "a", event)]
    assert schedule.coordinator_down
    assert schedule.due_restorations(27.0) == [(RESTORE_COORDINATOR, None, event)]
    assert not schedule.coordinator_down and schedule.due_restorations(99.0) == []


def test_metrics_tail_reads_complete_lines_as_they_grow(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    clock = [5.0]
    tail = MetricsTail(path, lambda: clock[0])
    tail.read()  # no file yet
    first = {"round": 0, "eval_loss": 2.0, "site_metrics": {"a": {"train_loss": 3.0}, "b": {"train_loss": 1.0}}}
    second = json.dumps({"round": 1, "run_finished": True, "site_metrics": {"a": {"train_loss": 2.0}}})
    path.write_text(json.dumps(first) + "\n" + second[:10])
    tail.read()
    assert [r["round"] for r in tail.records] == [0] and tail.records[0]["observed_s"] == 5.0
    assert tail.rounds_done == 1 and tail.round_started_s == {1: 5.0} and not tail.run_finished
    clock[0] = 7.0
    with path.open("a") as f:
        f.write(second[10:] + "\n")
    tail.read()
    assert tail.rounds_done == 2 and tail.round_started_s == {1: 5.0, 2: 7.0} and tail.run_finished
    losses = tail.losses()
    assert losses.per_site == {"a": 2.0, "b": 1.0} and losses.train == 2.0 and losses.eval == 2.0


def test_child_commands_carry_the_scenario(tmp_path: Path) -> None:
    scenario = parse_scenario(
        {
            "workload": {"name": "mlp", "hidden_dim": 8},
            "run": {"rounds": 3},
            "sites": [{"name": "a"}, {"name": "b", "speed_factor": 0.5, "data_shard": 0}],
        }
    )
    table = coordinator_table(
        scenario, certs_dir=tmp_path / "certs", checkpoint_dir=tmp_path / "ck", metrics_path=tmp_path / "m.jsonl"
    )
    assert table["workload"] == {"name": "mlp", "hidden_dim": 8}
    assert table["allowed_sites"] == ["a", "b"] and table["run"]["rounds"] == 3 and table["run"]["min_sites"] == 2
    command = site_command(scenario, 1, coordinator="127.0.0.1:9", certs_dir=tmp_path, log_level="INFO")
    assert command[command.index("--speed-factor") + 1] == "0.5"
    assert command[command.index("--site-index") + 1] == "0"
    assert "--speed-factor" not in site_command(
        scenario, 0, coordinator="127.0.0.1:9", certs_dir=tmp_path, log_level="INFO"
    )

"""``geoloco site --sharding {none,fsdp}`` (and ``--offload``): a 2-rank FSDP site started with
torchrun through the CLI trains a whole run against a real coordinator (mutual TLS, port 0),
and flags a sharded site does not take are refused at start with exit status 2.

The refusals run the CLI in-process (no torchrun: they are checked before any process group or
connection); the run is real processes (torchrun, gloo on CPU).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from _torchrun import kill_group, torchrun

from geoloco.algorithms.config import config_from_dict
from geoloco.algorithms.optimizers import InnerOptimizerConfig
from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.metrics import read_metrics
from geoloco.coordinator.server import CoordinatorServer
from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_site
from geoloco.scenarios.cli import main
from geoloco.scenarios.config_file import ConfigFileError
from geoloco.scenarios.sharded_site_cmd import check_sharded_run
from geoloco.scenarios.workloads import build_workload

pytest.importorskip("torch.distributed.fsdp")

LAUNCH_TIMEOUT_S = 300.0
"""Upper bound for one torchrun launch (tens of seconds when idle); only a hang gets near it."""
ROUNDS = 2
INNER_STEPS = 3
WORKLOAD = {"name": "mlp", "hidden_dim": 16, "num_classes": 5}
"""5 classes: the last layer's 5 rows split 3 + 2 over the two ranks, FSDP2's uneven case."""
BASE = ["site", "--coordinator", "localhost:1", "--name", "0", "--insecure"]


def _torchrun_site(port: int, stderr: Any, *flags: str) -> subprocess.Popen[str]:
    """``geoloco site --sharding fsdp`` as 2 torchrun ranks on CPU, in its own process group."""
    command = [
        "-m", "geoloco.scenarios.cli", "site", "--coordinator", f"localhost:{port}", "--name", "0",
        "--sharding", "fsdp", "--device", "cpu", *flags,
    ]
    return torchrun(command, stderr=stderr)


@pytest.fixture(autouse=True)
def _no_reexec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEOLOCO_NO_MALLOC_REEXEC", "1")


def test_help_names_the_choice_and_the_offload(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["site", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for expected in ("--sharding {none,fsdp}", "'none' (default) = data-parallel", "--nproc_per_node >= 2",
                     "--offload", "with --sharding fsdp"):
        assert expected in text, expected


@pytest.mark.parametrize(
    ("flags", "world_size", "line"),
    [
        (
            ["--sharding", "fsdp", "--metrics-port", "0"], "2",
            "geoloco site: error: command line: --metrics-port: sharded sites serve no /metrics yet",
        ),
        (
            ["--offload"], "2",
            "geoloco site: error: command line: --offload: only applies with --sharding fsdp",
        ),
        (
            ["--sharding", "fsdp"], None,
            "geoloco site: error: command line: --sharding: fsdp shards the model over the site's ranks, "
            "but this process is alone (world size 1); start it with torchrun --nproc_per_node=N",
        ),
        (
            ["--sharding", "fsdp"], "1",
            "geoloco site: error: command line: --sharding: fsdp shards the model over the site's ranks, "
            "but this process is alone (world size 1)",
        ),
    ],
)
def test_flags_a_sharded_site_does_not_take_exit_2_saying_what_to_use(
    flags: list[str], world_size: str | None, line: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Refused before anything starts: no process group, no connection (the coordinator address
    is unreachable; a flag that got past the check would wait on it instead of exiting 2)."""
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    assert main([*BASE, *flags]) == 2
    err = capsys.readouterr().err
    assert line in err, err
    assert "Traceback" not in err


def test_an_unknown_sharding_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*BASE, "--sharding", "zero3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--sharding: invalid choice: 'zero3'" in err and "none" in err and "fsdp" in err, err


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ({"min_sites": 3, "privacy": {"secure_aggregation": True, "clip_norm": 1.0}}, "privacy.secure_aggregation"),
        ({"algorithm": {"streaming": {"enabled": True, "fragments": 2}}}, "algorithm.streaming.fragments"),
        ({"algorithm": {"partial_updates": {"enabled": True}}}, "algorithm.partial_updates.enabled"),
    ],
)
def test_a_run_sharded_sites_do_not_combine_with_is_refused_naming_the_setting(
    table: dict[str, object], key: str
) -> None:
    """Read from what the coordinator advertises: its whole config, ``CoordinatorConfig.to_dict()``."""
    with pytest.raises(ConfigFileError) as refused:
        check_sharded_run(config_from_dict(CoordinatorConfig, {"insecure": True, **table}).to_dict())
    assert refused.value.key == key
    assert "--sharding none" in str(refused.value)
    check_sharded_run(CoordinatorConfig(insecure=True).to_dict())  # the defaults combine


def test_fsdp_site_under_torchrun_finishes_the_run_as_one_site_and_prints_the_contract(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    init_ca(certs)
    issue_coordinator(certs)
    issue_site(certs, "0")
    metrics = tmp_path / "metrics.jsonl"
    workload = build_workload(WORKLOAD["name"], **{k: v for k, v in WORKLOAD.items() if k != "name"})
    model = workload.build_model(0)
    layout = ParamLayout.from_model(model)
    server = CoordinatorServer(
        CoordinatorConfig(
            certs_dir=str(certs), metrics_path=str(metrics), min_sites=1, total_rounds=ROUNDS,
            workload=dict(WORKLOAD),
            algorithm=AlgorithmConfig(inner_steps=INNER_STEPS, uplink_codec="int8", weighting="samples"),
            inner_optimizer=InnerOptimizerConfig(lr=3e-3, schedule="cosine", warmup_steps=2),
        ),
        layout.flatten(model), layout,
    )
    server.start()
    state = tmp_path / "state"
    proc = _torchrun_site(server.port, subprocess.PIPE, "--certs", str(certs), "--offload", "--state-dir", str(state))
    try:
        try:
            stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            stdout, stderr = "(timed out)", ""
        final_digest = server.rounds.digest_hex
    finally:
        kill_group(proc)
        server.stop(grace=0)
    assert proc.returncode == 0, f"{stdout}\n{stderr[-6000:]}"

    records = read_metrics(metrics)
    assert [r["round"] for r in records] == list(range(ROUNDS)), records
    # One site, counted once per round, with the weight of both ranks' batches.
    assert [r["participants"] for r in records] == [["0"]] * ROUNDS
    batch = workload.config.batch_size
    assert all(r["sample_weights"]["0"] == 2 * INNER_STEPS * batch for r in records), records

    # The stdout contract, from rank 0 only (each line once).
    lines = stdout.splitlines()
    joined = [line for line in lines if " joined session " in line]
    assert len(joined) == 1 and joined[0].startswith("geoloco-site 0 joined session ") and joined[0].endswith(
        " at round 0"
    ), lines
    for r in range(ROUNDS):
        assert lines.count(f"geoloco-site 0 round {r} training") == 1, lines
        done = [line for line in lines if line.startswith(f"geoloco-site 0 round {r}: ")]
        assert len(done) == 1, lines
        assert re.fullmatch(
            rf"geoloco-site 0 round {r}: loss=[0-9.e+-]+ included=yes contributors=1 next_round={r + 1} "
            r"digest=[0-9a-f]{64}",
            done[0],
        ), done[0]
        # The loss printed is the one the coordinator recorded for the site (sent with the upload).
        printed = float(re.search(r"loss=(\S+)", done[0])[1])  # type: ignore[index]
        assert records[r]["site_metrics"]["0"]["train_loss"] == pytest.approx(printed, rel=1e-4), records[r]
    finished = [line for line in lines if " finished: " in line]
    assert finished == [
        f"geoloco-site 0 finished: final_round={ROUNDS} rounds_trained={ROUNDS} rounds_included={ROUNDS} "
        f"run_finished=yes digest={final_digest}"
    ], lines
    # --state-dir: every rank saved its int8 residual at the last round boundary.
    for rank in range(2):
        pointer = json.loads((state / f"rank-{rank}-of-2" / "site-state.json").read_text())
        assert pointer["meta"]["round"] == ROUNDS and pointer["meta"]["shard"] == [rank, 2, "dim0"]


def test_sigterm_stops_every_rank_at_the_same_round_boundary_and_the_site_leaves(tmp_path: Path) -> None:
    """SIGTERM to the torchrun job mid-round (torchrun passes it on to every rank): the ranks
    finish the round, agree to stop before the next (one rank leaving alone would leave the other
    waiting in a collective), rank 0 leaves the run and prints the ``stopped`` line. torchrun's
    own exit status reports that it was signalled, so only the site's lines are checked."""
    workload = build_workload("mlp")
    model = workload.build_model(0)
    layout = ParamLayout.from_model(model)
    server = CoordinatorServer(
        CoordinatorConfig(
            insecure=True, min_sites=1, total_rounds=1000, metrics_path=str(tmp_path / "m.jsonl"),
            workload={"name": "mlp"}, algorithm=AlgorithmConfig(inner_steps=50),
        ),
        layout.flatten(model), layout,
    )
    server.start()
    with (tmp_path / "stderr.txt").open("w") as stderr:
        proc = _torchrun_site(server.port, stderr, "--insecure")
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.strip())
            if line.startswith("geoloco-site 0 round 2 training"):
                os.killpg(proc.pid, signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        members = list(server.rounds.members)
    finally:
        kill_group(proc)
        server.stop(grace=0)
    lines += rest.splitlines()
    # Every round that started training finished and was reported (the test may read the line
    # late on a loaded machine, so which round the signal lands in is not fixed).
    started = [int(m[1]) for line in lines if (m := re.fullmatch(r"geoloco-site 0 round (\d+) training", line))]
    reported = [int(m[1]) for line in lines if (m := re.match(r"geoloco-site 0 round (\d+): loss=", line))]
    assert started == reported == list(range(len(started))) and len(started) >= 3, lines
    stopped = [line for line in lines if " stopped " in line]
    assert len(stopped) == 1, lines
    assert stopped[0].startswith(
        f"geoloco-site 0 stopped (SIGTERM): final_round={len(started)} rounds_trained={len(started)} "
    ), lines
    assert members == [], "the site should have left the run"

"""``run(config) -> RunResult``: provenance, curves by steps, totals, targets, folder round trips."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch

from geoloco.scenarios.cli import main
from geoloco.scenarios.config_file import ConfigFileError
from geoloco.scenarios.research import SUMMARY_FILE, RunResult, _git, is_finished, run

ROOT = Path(__file__).resolve().parents[2]

BASE: dict[str, Any] = {
    "workload": {"name": "mlp", "batch_size": 8, "hidden_dim": 8, "eval_size": 64},
    "algorithm": {"name": "diloco", "inner_steps": 5, "uplink_codec": "int8"},
    "inner_optimizer": {"lr": 0.01},
    "sites": {"count": 2},
    "simulation": {"total_inner_steps": 30, "eval_every_steps": 10, "device": "cpu"},
}


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Tiny models on a shared machine: one thread avoids spinning on contended cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _head() -> str | None:
    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else None


def test_run_returns_curves_by_steps_totals_and_provenance(tmp_path: Path) -> None:
    result = run(BASE)
    assert result.version == metadata.version("geoloco")
    assert result.commit == _head()
    assert result.config["simulation"]["total_inner_steps"] == 30 and result.config["run_rounds"] == 6
    curve = result.curve
    assert [p.inner_steps for p in curve] == [10, 20, 30]
    assert [p.round for p in curve] == [1, 3, 5]
    assert [p.bytes_up for p in curve] == sorted(p.bytes_up for p in curve) and curve[0].bytes_up > 0
    assert [p.time_s for p in curve] == sorted(p.time_s for p in curve) and curve[0].time_s > 0
    totals = result.totals
    assert totals["rounds"] == 6 and totals["inner_steps"] == 30
    assert totals["bytes_up"] == curve[-1].bytes_up and totals["bytes_down"] == curve[-1].bytes_down
    assert totals["final_eval_loss"] == curve[-1].eval_loss == result.final_eval_loss
    assert totals["weights_digest"] == result.records[-1]["weights_digest"]
    assert totals["reached_target"] is None


def test_time_and_bytes_to_a_loss_are_the_first_evaluation_reaching_it() -> None:
    result = run(BASE)
    curve = result.curve
    best = min(range(len(curve)), key=lambda i: curve[i].eval_loss)
    first = next(i for i, p in enumerate(curve) if p.eval_loss <= curve[best].eval_loss)
    assert result.time_to(curve[best].eval_loss) == curve[first].time_s
    assert result.bytes_to(curve[best].eval_loss) == curve[first].bytes_up
    assert result.bytes_to(curve[best].eval_loss, "both") == curve[first].bytes_up + curve[first].bytes_down
    assert result.steps_to(curve[best].eval_loss) == curve[first].inner_steps
    assert result.time_to(curve[best].eval_loss - 1.0) is None
    assert result.bytes_to(curve[best].eval_loss - 1.0) is None
    assert result.time_to(float("inf")) == curve[0].time_s
    with pytest.raises(ValueError, match="direction"):
        result.bytes_to(1.0, "sideways")


def test_run_result_round_trips_through_its_folder(tmp_path: Path) -> None:
    result = run(BASE, out=tmp_path / "a")
    assert is_finished(tmp_path / "a")
    loaded = RunResult.load(tmp_path / "a")
    assert loaded == result
    assert loaded.curve == result.curve and loaded.totals == result.totals
    assert loaded.runtime_s == pytest.approx(result.runtime_s)
    # save() writes the same folder from an in-memory result.
    loaded.save(tmp_path / "b")
    again = RunResult.load(tmp_path / "b")
    assert again == result and again.folder == tmp_path / "b"
    summary = json.loads((tmp_path / "b" / SUMMARY_FILE).read_text())
    assert summary["commit"] == result.commit and summary["totals"]["inner_steps"] == 30


def test_an_unfinished_folder_is_not_loaded(tmp_path: Path) -> None:
    run(BASE, out=tmp_path / "run")
    (tmp_path / "run" / SUMMARY_FILE).unlink()
    assert not is_finished(tmp_path / "run")
    with pytest.raises(ValueError, match=SUMMARY_FILE):
        RunResult.load(tmp_path / "run")


def test_an_override_of_one_run_length_key_replaces_the_others() -> None:
    base = {**BASE, "run": {"rounds": 2, "eval_every": 1}, "simulation": {"device": "cpu"}}
    result = run(base, overrides=["run.total_inner_steps=15", "run.eval_every_steps=15"])
    assert [p.inner_steps for p in result.curve] == [15]
    with pytest.raises(ConfigFileError) as info:
        run(base, overrides=["run.rounds=3", "run.total_inner_steps=15"])
    assert info.value.key == "run.total_inner_steps" and "not both" in info.value.message


def test_commit_is_none_outside_a_git_checkout(tmp_path: Path) -> None:
    assert _git(tmp_path, "rev-parse", "HEAD") is None


def test_simulate_writes_version_commit_and_a_loadable_run_folder(tmp_path: Path, capsys: Any) -> None:
    config = tmp_path / "sim.toml"
    config.write_text(
        '[workload]\nname = "mlp"\nbatch_size = 8\n[algorithm]\ninner_steps = 4\n'
        '[simulation]\ntotal_inner_steps = 12\neval_every_steps = 12\ndevice = "cpu"\n'
    )
    assert main(["simulate", "--config", str(config), "--out", str(tmp_path / "out")]) == 0
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["version"] == metadata.version("geoloco") and written["commit"] == _head()
    loaded = RunResult.load(tmp_path / "out")
    assert [p.inner_steps for p in loaded.curve] == [12] and loaded.totals["rounds"] == 3
    assert "inner steps per site" in capsys.readouterr().out


def test_the_rounds_flag_replaces_the_files_total_inner_steps(tmp_path: Path) -> None:
    import argparse

    from geoloco.scenarios.simulate_cmd import load_config

    config = tmp_path / "sim.toml"
    config.write_text('[workload]\nname = "mlp"\n[simulation]\ntotal_inner_steps = 40\neval_every_steps = 20\n')
    args = argparse.Namespace(config=config, workload=None, rounds=3, sites=None, seed=None, device=None, overrides=[])
    _, sim_config = load_config(args)
    assert sim_config.simulation.rounds == 3 and sim_config.simulation.total_inner_steps is None
    assert sim_config.simulation.eval_every_steps == 20 and sim_config.run_rounds == 3

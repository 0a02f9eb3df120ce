"""TensorBoard scalars beside metrics.jsonl: the simulator's (``research.run``, ``geoloco simulate
--tensorboard``) read back with TensorBoard's own reader equal the file's values."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from geoloco.protos.tensorboard import record_scalars
from geoloco.scenarios.cli import main
from geoloco.scenarios.config_file import ConfigFileError
from geoloco.scenarios.research import METRICS_FILE, run

BASE: dict[str, Any] = {
    "workload": {"name": "mlp", "batch_size": 8, "hidden_dim": 8, "eval_size": 64},
    "algorithm": {"name": "diloco", "inner_steps": 5, "uplink_codec": "int8"},
    "sites": {"count": 3},
    "simulation": {"total_inner_steps": 15, "eval_every_steps": 5, "device": "cpu"},
    "privacy": {"dp": "central", "clip_norm": 1.0, "noise_multiplier": 0.5},
}


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def read_scalars(logdir: Path, require_extra: Callable[[str, str], ModuleType]) -> dict[str, list[tuple[int, float]]]:
    """Tag -> ``[(step, value)]`` of every event file under ``logdir``, as TensorBoard reads them."""
    require_extra("tensorboard", "tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def f32(value: float) -> float:
    """What TensorBoard keeps of a scalar: a 32-bit float."""
    return float(np.float32(value))


def expected_from_metrics(path: Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars computed by hand from the simulator's metrics.jsonl, one step per record."""
    expected: dict[str, list[tuple[int, float]]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        step = record["inner_steps_total"]
        shares = list(record["utilization"].values())
        values = {
            "loss/eval": record["eval_loss"],
            "loss/train": record["train_loss"],
            "bytes/up_total": record["bytes_up_total"],
            "bytes/down_total": record["bytes_down_total"],
            "bytes/up_round": sum(record["bytes_up"].values()),
            "privacy/epsilon": record["epsilon"],
            "utilization/mean": sum(shares) / len(shares),
            "utilization/min": min(shares),
            "time/wall_clock_s": record["wall_clock_s"],
        }
        for tag, value in values.items():
            if value is not None:
                expected.setdefault(tag, []).append((step, f32(value)))
    return expected


def test_the_simulators_tensorboard_scalars_equal_metrics_jsonl(
    require_extra: Callable[[str, str], ModuleType], tmp_path: Path
) -> None:
    require_extra("tensorboard", "tensorboard")
    result = run(BASE, out=tmp_path / "run", tensorboard=tmp_path / "run" / "tb")
    scalars = read_scalars(tmp_path / "run" / "tb", require_extra)
    expected = expected_from_metrics(tmp_path / "run" / METRICS_FILE)
    assert set(expected) >= {"loss/eval", "loss/train", "bytes/up_total", "privacy/epsilon", "utilization/mean"}
    for tag, series in expected.items():
        assert scalars[tag] == series, tag
    assert [s for s, _ in scalars["loss/eval"]] == [c.inner_steps for c in result.curve] == [5, 10, 15]
    assert scalars["privacy/epsilon"][-1][1] == f32(result.totals["epsilon"]) and result.totals["epsilon"] > 0


def test_simulate_tensorboard_flag_writes_beside_the_metrics(
    require_extra: Callable[[str, str], ModuleType], tmp_path: Path, capsys: Any
) -> None:
    require_extra("tensorboard", "tensorboard")
    config = tmp_path / "sim.toml"
    config.write_text(
        '[workload]\nname = "mlp"\nbatch_size = 8\nhidden_dim = 8\n[algorithm]\ninner_steps = 5\n'
        '[sites]\ncount = 2\n[simulation]\ntotal_inner_steps = 10\neval_every_steps = 5\ndevice = "cpu"\n'
    )
    out = tmp_path / "out"
    assert main(["simulate", "--config", str(config), "--out", str(out), "--tensorboard"]) == 0
    assert "TensorBoard events in" in capsys.readouterr().out
    scalars = read_scalars(out / "tensorboard", require_extra)
    assert scalars["loss/eval"] == expected_from_metrics(out / METRICS_FILE)["loss/eval"]
    assert "privacy/epsilon" not in scalars, "no DP: no epsilon"


def test_without_tensorboard_the_error_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigFileError, match=r"pip install 'geoloco\[tensorboard\]'"):
        run(BASE, out=tmp_path / "run", tensorboard=tmp_path / "tb")
    assert not (tmp_path / "run").exists(), "refused before the run started"


def test_record_scalars_leave_out_what_a_record_lacks() -> None:
    coordinator_record = {
        "round": 3, "eval_loss": None, "participants": ["a", "b"], "bytes_up": {"a": 10, "b": 30},
        "site_metrics": {"a": {"train_loss": 1.0}, "b": {"train_loss": 2.0}}, "epsilon": float("inf"),
        "round_time_s": 0.5,
    }
    assert record_scalars(coordinator_record) == {
        "loss/train": 1.5, "bytes/up_round": 40.0, "sites/participants": 2.0, "time/round_s": 0.5,
    }


def test_a_sweep_writes_each_runs_scalars_into_its_folder(
    require_extra: Callable[[str, str], ModuleType], tmp_path: Path
) -> None:
    require_extra("tensorboard", "tensorboard")
    from geoloco.scenarios.sweep import sweep

    base = {**BASE, "privacy": {}, "simulation": {**BASE["simulation"], "total_inner_steps": 10}}
    out = tmp_path / "sweep"
    sweep(base, grid={"algorithm.uplink_codec": ["none", "int8"]}, out=out, plots=False, tensorboard=True)
    folders = sorted((out / "runs").iterdir())
    assert len(folders) == 2
    for folder in folders:
        scalars = read_scalars(folder / "tensorboard", require_extra)
        expected = expected_from_metrics(folder / METRICS_FILE)
        assert scalars["loss/eval"] == expected["loss/eval"] and scalars["bytes/up_total"] == expected["bytes/up_total"]
    stamps = [sorted(p.stat().st_mtime_ns for p in (f / "tensorboard").iterdir()) for f in folders]
    again = sweep(base, grid={"algorithm.uplink_codec": ["none", "int8"]}, out=out, plots=False, tensorboard=True)
    assert again.resumed == 2
    assert [sorted(p.stat().st_mtime_ns for p in (f / "tensorboard").iterdir()) for f in folders] == stamps

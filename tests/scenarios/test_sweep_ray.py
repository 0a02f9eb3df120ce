"""The sweep's Ray backend on a local two-CPU Ray instance: runs happen in Ray's worker processes,
the driver writes the folders, results equal a local run bit for bit, and resume holds."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from geoloco.scenarios.cli import main
from geoloco.scenarios.config_file import ConfigFileError
from geoloco.scenarios.research import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, run
from geoloco.scenarios.sweep import sweep
from geoloco.scenarios.sweep_ray import WORKER_FILE

BASE: dict[str, Any] = {
    "workload": {"name": "mlp", "batch_size": 8, "hidden_dim": 8, "eval_size": 64},
    "algorithm": {"name": "diloco", "inner_steps": 5},
    "inner_optimizer": {"lr": 0.01},
    "sites": {"count": 2},
    "simulation": {"total_inner_steps": 10, "eval_every_steps": 5, "device": "cpu"},
}
GRID = {"algorithm.uplink_codec": ["none", "int8"]}


@pytest.fixture(scope="module")
def ray_cluster(require_extra: Callable[[str, str], ModuleType]) -> Iterator[ModuleType]:
    """One local Ray instance with two CPUs for the whole module (Ray starts slowly). Started
    again, up to three times and after a pause that lets the failed start's processes end, if a
    start times out: Ray gives its raylet a fixed 30 s to register, which a busy 2-core machine
    has missed in CI runs, once twice in a row ("The current node timed out during startup");
    that is Ray's start-up, not what these tests check."""
    ray = require_extra("ray", "ray")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no usage report: the test machine is offline
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for attempt in (1, 2, 3):
        try:
            ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 1024 * 1024,
                     logging_level="WARNING")
            break
        except Exception as err:  # Ray raises a bare Exception for this
            ray.shutdown()
            if attempt == 3 or "timed out during startup" not in str(err):
                raise
            time.sleep(5)
    yield ray
    ray.shutdown()
    for sig, handler in kept.items():  # ray.init's handlers would outlive it in this process
        signal.signal(sig, handler)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _folders(out: Path) -> dict[str, Path]:
    return {p.name: p for p in sorted((out / "runs").iterdir())}


def test_a_ray_sweep_runs_in_ray_workers_and_equals_a_local_sweep_bitwise(
    ray_cluster: ModuleType, one_torch_thread: None, tmp_path: Path
) -> None:
    on_ray = sweep(BASE, grid=GRID, seeds=[0, 1], out=tmp_path / "ray", ray_address="local", plots=False)
    assert (on_ray.ran, on_ray.resumed, on_ray.failed) == (4, 0, 0)
    assert json.loads((tmp_path / "ray" / "sweep.json").read_text())["backend"] == "ray"
    local = sweep(BASE, grid=GRID, seeds=[0, 1], out=tmp_path / "local", plots=False)
    ray_folders, local_folders = _folders(tmp_path / "ray"), _folders(tmp_path / "local")
    assert sorted(ray_folders) == sorted(local_folders) and len(ray_folders) == 4

    workers = [json.loads((f / WORKER_FILE).read_text()) for f in ray_folders.values()]
    assert {w["backend"] for w in workers} == {"ray"}
    assert os.getpid() not in {w["pid"] for w in workers}, "the runs must happen in Ray's workers"
    for name, folder in ray_folders.items():
        for file in (CONFIG_FILE, METRICS_FILE):
            assert (folder / file).read_bytes() == (local_folders[name] / file).read_bytes(), (name, file)
        ray_totals = json.loads((folder / SUMMARY_FILE).read_text())["totals"]
        assert ray_totals == json.loads((local_folders[name] / SUMMARY_FILE).read_text())["totals"]
    assert on_ray.table() == local.table()

    # Resume: nothing runs again, on Ray or locally, and the finished folders are untouched.
    stamps = {n: (f / SUMMARY_FILE).stat().st_mtime_ns for n, f in ray_folders.items()}
    again = sweep(BASE, grid=GRID, seeds=[0, 1], out=tmp_path / "ray", ray_address="local", plots=False)
    assert (again.ran, again.resumed) == (0, 4)
    assert {n: (f / SUMMARY_FILE).stat().st_mtime_ns for n, f in ray_folders.items()} == stamps


def test_a_plugin_not_on_the_workers_path_is_shipped_to_them(
    ray_cluster: ModuleType, example_plugin: Path, tmp_path: Path
) -> None:
    """The plug-in's folder is on this process's sys.path only: Ray's workers import it because
    the backend ships it with each task, and the run equals one in this process byte for byte."""
    base = {**BASE, "research": {"plugins": ["signsgd_plugin"]}, "outer_optimizer": {"name": "signsgd"}}
    on_ray = sweep(base, seeds=[0], out=tmp_path / "ray", ray_address="local", plots=False)
    assert (on_ray.ran, on_ray.failed) == (1, 0), list((tmp_path / "ray" / "runs").glob("*/error.txt"))
    (folder,) = _folders(tmp_path / "ray").values()
    assert json.loads((folder / WORKER_FILE).read_text())["pid"] != os.getpid()
    run(base, overrides=["simulation.seed=0"], out=tmp_path / "here")
    for file in (CONFIG_FILE, METRICS_FILE):
        assert (folder / file).read_bytes() == (tmp_path / "here" / file).read_bytes(), file


def test_the_sweep_command_takes_ray_and_reports_a_failing_run(
    ray_cluster: ModuleType, one_torch_thread: None, tmp_path: Path, capsys: Any
) -> None:
    config = tmp_path / "base.toml"
    config.write_text(
        '[workload]\nname = "mlp"\nbatch_size = 8\nhidden_dim = 8\n[algorithm]\ninner_steps = 5\n'
        '[sites]\ncount = 2\n[simulation]\ntotal_inner_steps = 5\neval_every_steps = 5\ndevice = "cpu"\n'
    )
    out = tmp_path / "out"
    # A device that cannot exist here fails in the worker; the other run still finishes.
    bad_device = "cpu" if torch.cuda.is_available() else "cuda"
    argv = ["sweep", str(config), "--grid", f"simulation.device=cpu,{bad_device}", "--ray", "local",
            "--jobs", "2", "--out", str(out), "--no-plots"]
    assert main(argv) == (0 if bad_device == "cpu" else 1)
    text = capsys.readouterr().out
    if bad_device == "cuda":
        assert "1 runs ran, 0 were already finished, 1 failed" in text
        (error,) = (out / "runs").glob("*/error.txt")
        assert "simulation.device" in error.read_text()
        assert json.loads((error.parent / WORKER_FILE).read_text())["pid"] != os.getpid()


def test_without_ray_installed_the_error_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` sees where it is not installed
    with pytest.raises(ConfigFileError, match=r"pip install 'geoloco\[ray\]'") as info:
        sweep(BASE, seeds=[0], out=tmp_path / "x", ray_address="auto", plots=False)
    assert info.value.key == "--ray"
    assert not (tmp_path / "x").exists()


def test_a_ray_instance_started_by_a_sweep_leaves_the_programs_signal_handlers() -> None:
    """``ray.init`` installs SIGTERM/SIGINT handlers that ``ray.shutdown`` leaves behind; a sweep
    that started Ray puts the program's own back (checked without starting Ray: the handlers
    installed inside stand for Ray's)."""
    from geoloco.scenarios.sweep_ray import _own_signal_handlers

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with _own_signal_handlers():
        signal.signal(signal.SIGTERM, lambda *_: None)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert {sig: signal.getsignal(sig) for sig in before} == before

"""The sweep runner: grid parsing and expansion, resume, the table and plots, the CLI."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from geoloco.scenarios.cli import main
from geoloco.scenarios.config_file import ConfigFileError
from geoloco.scenarios.research import SUMMARY_FILE
from geoloco.scenarios.sweep import GridAxis, expand_grid, parse_grid, parse_seeds, sweep

BASE: dict[str, Any] = {
    "workload": {"name": "mlp", "batch_size": 8, "hidden_dim": 8, "eval_size": 64},
    "algorithm": {"name": "diloco", "inner_steps": 5},
    "inner_optimizer": {"lr": 0.01},
    "sites": {"count": 2},
    "simulation": {"total_inner_steps": 20, "eval_every_steps": 10, "device": "cpu"},
}


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Tiny models on a shared machine: one thread avoids spinning on contended cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_parse_grid_reads_commas_pipes_and_toml_arrays() -> None:
    assert parse_grid("algorithm.inner_steps=10, 25,50") == GridAxis("algorithm.inner_steps", ("10", "25", "50"))
    assert parse_grid("algorithm.uplink_codec=none,int8,topk:0.01|int4").values == ("none", "int8", "topk:0.01|int4")
    axis = parse_grid('algorithm.uplink_codec=["int4:block=128,stochastic", "none"]')
    assert axis.values == ("int4:block=128,stochastic", "none")
    assert parse_grid("inner_optimizer.lr=[0.01, 0.1]").values == ("0.01", "0.1")


@pytest.mark.parametrize(
    ("text", "words"),
    [("algorithm.inner_steps=", "non-empty"), ("algorithm.inner_steps=1,,2", "non-empty"),
     ("algorithm.inner_steps=1,1", "twice"), ("nokeyvalue", "KEY=VALUE"), ("a.b=[1,", "TOML array")],
)
def test_parse_grid_errors_say_what_is_expected(text: str, words: str) -> None:
    with pytest.raises(ConfigFileError, match=words):
        parse_grid(text)


def test_expand_grid_is_the_product_first_axis_slowest() -> None:
    axes = [GridAxis("a.h", ("1", "2", "3")), GridAxis("a.c", ("x", "y"))]
    points = expand_grid(axes)
    assert len(points) == 6
    assert points[:3] == [(("a.h", "1"), ("a.c", "x")), (("a.h", "1"), ("a.c", "y")), (("a.h", "2"), ("a.c", "x"))]
    assert expand_grid([]) == [()]
    with pytest.raises(ConfigFileError, match="twice"):
        expand_grid([GridAxis("a.h", ("1",)), GridAxis("a.h", ("2",))])


def test_parse_seeds() -> None:
    assert parse_seeds("0,1,2") == [0, 1, 2]
    assert parse_seeds("3-5") == [3, 4, 5]
    for bad in ("", "a", "1,1"):
        with pytest.raises(ConfigFileError, match="--seeds"):
            parse_seeds(bad)


def _summaries(out: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in (out / "runs").glob(f"*/{SUMMARY_FILE}")}


def test_sweep_runs_every_point_and_seed_then_resumes_without_rerunning(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    grid = {"algorithm.inner_steps": [5, 10], "algorithm.uplink_codec": ["none", "int8"]}
    first = sweep(BASE, grid=grid, seeds=[0, 1], out=out)
    assert (first.ran, first.resumed, first.failed) == (8, 0, 0)
    assert [p.label for p in first.points] == [
        "inner_steps=5 uplink_codec=none", "inner_steps=5 uplink_codec=int8",
        "inner_steps=10 uplink_codec=none", "inner_steps=10 uplink_codec=int8",
    ]
    for p in first.points:
        assert sorted(r.config["simulation"]["seed"] for r in p.runs) == [0, 1]
        assert all([c.inner_steps for c in r.curve] == [10, 20] for r in p.runs)
    by_label = {p.label: p for p in first.points}
    none_bytes = by_label["inner_steps=5 uplink_codec=none"].stat("bytes_up")
    int8_bytes = by_label["inner_steps=5 uplink_codec=int8"].stat("bytes_up")
    assert none_bytes is not None and int8_bytes is not None and int8_bytes[0] < none_bytes[0] / 3
    table = (out / "table.md").read_text()
    assert table.count("\n") == 2 + 4 and "`int8`" in table and "final eval loss" in table
    for name in ("pareto.png", "loss_vs_steps.png", "loss_vs_bytes.png", "loss_vs_time.png", "summary.json"):
        assert (out / name).stat().st_size > 0

    before = _summaries(out)
    assert len(before) == 8
    again = sweep(BASE, grid=grid, seeds=[0, 1], out=out, plots=False)
    assert (again.ran, again.resumed) == (0, 8)
    assert _summaries(out) == before, "a finished run must not run again"
    assert again.table() == first.table()

    # An interrupted run (no summary yet) is the only one run again.
    victim = sorted(before)[3]
    victim.unlink()
    third = sweep(BASE, grid=grid, seeds=[0, 1], out=out, plots=False)
    assert (third.ran, third.resumed) == (1, 7)
    assert {p: t for p, t in _summaries(out).items() if p != victim} == {p: t for p, t in before.items() if p != victim}


def test_a_changed_base_config_gets_new_run_folders(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    sweep(BASE, seeds=[0], out=out, plots=False)
    changed = {**BASE, "inner_optimizer": {"lr": 0.02}}
    result = sweep(changed, seeds=[0], out=out, plots=False)
    assert (result.ran, result.resumed) == (1, 0)
    assert len(list((out / "runs").iterdir())) == 2


def test_a_bad_grid_value_fails_before_any_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError) as info:
        sweep(BASE, grid={"algorithm.inner_steps": [5, 0]}, out=tmp_path / "sweep")
    assert info.value.key == "algorithm.inner_steps"
    assert not (tmp_path / "sweep").exists()


# Worker processes (jobs=2) against one process, byte for byte, with a plug-in that only exists in a
# worker once it imported it: tests/scenarios/test_plugins.py.


def test_sweep_command(tmp_path: Path, capsys: Any) -> None:
    config = tmp_path / "base.toml"
    config.write_text(
        '[workload]\nname = "mlp"\nbatch_size = 8\nhidden_dim = 8\n[algorithm]\ninner_steps = 5\n'
        '[sites]\ncount = 2\n[simulation]\ntotal_inner_steps = 10\neval_every_steps = 5\ndevice = "cpu"\n'
    )
    argv = ["sweep", str(config), "--grid", "algorithm.uplink_codec=none,topk:0.1|int4", "--seeds", "0,1",
            "--out", str(tmp_path / "out"), "--no-plots"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "4 runs ran, 0 were already finished" in text and "`topk:0.1\\|int4`" in text
    assert main(argv) == 0
    assert "0 runs ran, 4 were already finished" in capsys.readouterr().out
    assert main([*argv[:-1], "--grid", "algorithm.inner_steps=x"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a run that fails: device cuda without CUDA")
def test_a_failing_run_is_reported_and_the_others_finish(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    result = sweep(BASE, grid={"simulation.device": ["cpu", "cuda"]}, seeds=[0], out=out, plots=False)
    assert (result.ran, result.failed) == (1, 1)
    ok, bad = result.points
    assert len(ok.runs) == 1 and ok.failed == [] and bad.runs == [] and bad.failed == [0]
    errors = list((out / "runs").glob("*/error.txt"))
    assert len(errors) == 1 and "simulation.device" in errors[0].read_text()
    assert "0 (1 failed)" in (out / "table.md").read_text()
    again = sweep(BASE, grid={"simulation.device": ["cpu", "cuda"]}, seeds=[0], out=out, plots=False)
    assert (again.resumed, again.failed) == (1, 1), "a failed run is not finished: it runs again"


def test_target_loss_tabulates_what_reaching_it_cost(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "sweep"
    first = sweep(BASE, grid={"algorithm.inner_steps": [5, 10]}, seeds=[0, 1], out=out, plots=False)
    # A loss every run reached at its first evaluation, and one none reached.
    easy = max(c.eval_loss for p in first.points for r in p.runs for c in r.curve if c.eval_loss is not None) + 1
    result = sweep(BASE, grid={"algorithm.inner_steps": [5, 10]}, seeds=[0, 1], out=out, plots=False,
                   target_loss=easy)
    assert result.ran == 0
    for p in result.points:
        assert p.reached(easy) == 2
        cost = p.to_target(easy)
        assert cost["steps"] == (10, 10, 10)  # the first evaluation, at 10 inner steps
        first_bytes = [r.curve[0].bytes_up for r in p.runs]
        assert cost["bytes_up"] is not None and cost["bytes_up"][1:] == (min(first_bytes), max(first_bytes))
    assert f"reached {easy:g}" in result.table() and "| 2/2 |" in result.table()
    never = sweep(BASE, grid={"algorithm.inner_steps": [5]}, seeds=[0], out=out, plots=False, target_loss=-1.0)
    (point,) = never.points
    assert point.reached(-1.0) == 0 and point.to_target(-1.0) == {"steps": None, "bytes_up": None, "time_s": None}
    assert "| 0/1 | n/a | n/a | n/a |" in never.table()

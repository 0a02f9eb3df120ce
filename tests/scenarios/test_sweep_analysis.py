"""A sweep's statistics on real runs of a tiny workload: per-point stats and paired differences in
``stats.md`` and ``summary.json``, unpaired points, the runs and per-round records as CSV (and
pandas / Parquet with the ``analysis`` extra), and the command's ``--baseline`` and ``--export``."""

from __future__ import annotations

import csv
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from geoloco.scenarios.cli import main
from geoloco.scenarios.config_file import ConfigFileError
from geoloco.scenarios.sweep import PointSummary, SweepResult, sweep
from geoloco.scenarios.sweep_export import Table
from geoloco.scenarios.sweep_stats import t_quantile

BASE: dict[str, Any] = {
    "workload": {"name": "mlp", "batch_size": 8, "hidden_dim": 8, "eval_size": 64},
    "algorithm": {"name": "diloco", "inner_steps": 5},
    "inner_optimizer": {"lr": 0.01},
    "sites": {"count": 2},
    "simulation": {"total_inner_steps": 10, "eval_every_steps": 5, "device": "cpu"},
}
GRID = {"algorithm.uplink_codec": ["none", "int8"], "inner_optimizer.lr": [0.01, 0.1]}
SEEDS = [0, 1]


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> SweepResult:
    """Four points of the tiny MLP, two seeds each, against ``uplink_codec=none lr=0.01``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return sweep(BASE, grid=GRID, seeds=SEEDS, out=tmp_path_factory.mktemp("sweep"), plots=False,
                     baseline="uplink_codec=none lr=0.01", export=["csv"])
    finally:
        torch.set_num_threads(threads)


def _by_seed(point: PointSummary, key: str) -> dict[int, float]:
    return {r.config["simulation"]["seed"]: float(r.totals[key]) for r in point.runs}


def test_per_point_statistics_over_the_seeds(swept: SweepResult) -> None:
    summary = json.loads((swept.out / "summary.json").read_text())
    assert summary["format"] == 2 and summary["confidence"] == 0.95
    assert summary["baseline"] == "uplink_codec=none lr=0.01"
    for point, written in zip(swept.points, summary["points"]):
        losses = [float(r.totals["final_eval_loss"]) for r in point.runs]
        st = written["stats"]["final_eval_loss"]
        half = t_quantile(1) * statistics.stdev(losses) / 2 ** 0.5
        assert st["n"] == 2 and st["mean"] == pytest.approx(statistics.fmean(losses), rel=1e-12)
        assert st["std"] == pytest.approx(statistics.stdev(losses), rel=1e-9)
        assert (st["ci_low"], st["ci_high"]) == (pytest.approx(st["mean"] - half), pytest.approx(st["mean"] + half))
        assert written["values"]["final_eval_loss"] == losses and written["seeds"] == SEEDS
        # Layout 1's keys are still there, unchanged: [mean, min, max].
        assert written["final_eval_loss"] == [pytest.approx(st["mean"]), min(losses), max(losses)]
        assert written["stats"]["epsilon"] is None  # no DP: nothing to summarize
    stats_md = (swept.out / "stats.md").read_text()
    assert "| `uplink_codec=int8 lr=0.1` | final eval loss | 2 |" in stats_md and "95 % interval" in stats_md
    assert "epsilon" not in stats_md


def test_paired_differences_against_the_baseline_seed_by_seed(swept: SweepResult) -> None:
    summary = json.loads((swept.out / "summary.json").read_text())
    base = swept.points[0]
    assert [p["is_baseline"] for p in summary["points"]] == [True, False, False, False]
    assert summary["points"][0]["vs_baseline"] is None
    for point, written in zip(swept.points[1:], summary["points"][1:]):
        mine, theirs = _by_seed(point, "final_eval_loss"), _by_seed(base, "final_eval_loss")
        differences = [mine[s] - theirs[s] for s in SEEDS]
        paired = written["vs_baseline"]["final_eval_loss"]
        assert paired["seeds"] == SEEDS and paired["unpaired"] is None
        assert paired["difference"]["mean"] == pytest.approx(statistics.fmean(differences), abs=1e-12)
        half = t_quantile(1) * statistics.stdev(differences) / 2 ** 0.5
        assert paired["difference"]["ci_high"] == pytest.approx(paired["difference"]["mean"] + half, abs=1e-12)
        assert "epsilon" not in written["vs_baseline"]
    # int8 sends fewer bytes than none on every seed: a negative difference with a tight interval.
    int8 = summary["points"][2]["vs_baseline"]["bytes_up"]["difference"]
    assert int8["ci_high"] < 0 and int8["std"] == 0.0
    paired_md = swept.paired_table()
    assert paired_md is not None and "Paired differences against `uplink_codec=none lr=0.01`" in paired_md
    assert paired_md in (swept.out / "stats.md").read_text()


def test_a_point_missing_a_seed_of_the_baseline_is_unpaired(swept: SweepResult) -> None:
    base, other = swept.points[0], swept.points[1]
    lost = PointSummary(point=other.point, runs=other.runs[:1], failed=[1])  # as if seed 1 had failed
    result = SweepResult(out=swept.out, axes=swept.axes, seeds=SEEDS, points=[base, lost], baseline=0)
    diff = result.paired(lost)["final_eval_loss"]
    assert diff.stats is None
    assert diff.unpaired == "no value for seed 1 of the baseline (failed here: seed 1, see error.txt)"
    assert "unpaired: no value for seed 1 of the baseline" in (result.paired_table() or "")
    entry = result.summary()["points"][1]["vs_baseline"]["final_eval_loss"]
    assert entry == {"seeds": SEEDS, "unpaired": diff.unpaired}
    with pytest.raises(ValueError, match="no baseline"):
        SweepResult(out=swept.out, axes=swept.axes, seeds=SEEDS, points=[base]).paired(base)


def test_the_pareto_front_is_in_the_summary(swept: SweepResult) -> None:
    summary = json.loads((swept.out / "summary.json").read_text())
    front = [p.label for p in swept.pareto_front()]
    assert front and [p["label"] for p in summary["points"] if p["on_pareto_front"]] == sorted(
        front, key=[p.label for p in swept.points].index
    )
    assert summary["pareto_objectives"] == ["bytes_up", "final_eval_loss"]
    cheapest = min(swept.points, key=lambda p: (p.stat("bytes_up") or (0.0,))[0])
    assert swept.pareto_front()[0].stat("bytes_up") == cheapest.stat("bytes_up")


def _csv_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def _as_csv(value: Any) -> str:
    return "" if value is None else str(value)


def test_runs_and_curves_round_trip_through_csv(swept: SweepResult) -> None:
    assert {swept.out / "runs.csv", swept.out / "curves.csv"} <= set(swept.files)
    for table, name in ((swept.runs_table(), "runs.csv"), (swept.curves_table(), "curves.csv")):
        columns, rows = _csv_rows(swept.out / name)
        assert columns == table.columns
        assert rows == [{c: _as_csv(row.get(c)) for c in table.columns} for row in table.rows]
    runs = swept.runs_table()
    assert len(runs.rows) == 4 * len(SEEDS)
    assert runs.columns[:5] == ["algorithm.uplink_codec", "inner_optimizer.lr", "label", "seed", "folder"]
    first = runs.rows[0]
    assert (first["algorithm.uplink_codec"], first["inner_optimizer.lr"], first["seed"]) == ("none", 0.01, 0)
    _, read_back = _csv_rows(swept.out / "runs.csv")
    assert float(read_back[0]["final_eval_loss"]) == first["final_eval_loss"], "floats read back exactly"
    curves = swept.curves_table()
    assert len(curves.rows) == sum(len(r.records) for p in swept.points for r in p.runs)
    assert {"round", "phase", "eval_loss", "bytes_up_total", "wall_clock_s"} <= set(curves.columns)
    assert not {"inner_steps", "bytes_up", "participants"} & set(curves.columns), "per-site tables stay out"


def test_dataframes_and_parquet_with_the_analysis_extra(
    swept: SweepResult, require_extra: Callable[[str, str], ModuleType]
) -> None:
    pandas = require_extra("pandas", "analysis")
    require_extra("pyarrow", "analysis")
    runs = swept.to_dataframe()
    assert list(runs.columns) == swept.runs_table().columns and len(runs) == 4 * len(SEEDS)
    baseline = swept.points[0].stats("final_eval_loss")
    assert baseline is not None
    assert runs.groupby("label")["final_eval_loss"].mean()["uplink_codec=none lr=0.01"] == pytest.approx(baseline.mean)
    curves = swept.to_dataframe("curves")
    assert len(curves) == len(swept.curves_table().rows)
    written = swept.export(["parquet"])
    assert written == [swept.out / "runs.parquet", swept.out / "curves.parquet"]
    back = pandas.read_parquet(swept.out / "runs.parquet")
    assert back["final_eval_loss"].tolist() == runs["final_eval_loss"].tolist()
    assert back["inner_optimizer.lr"].tolist() == [0.01, 0.01, 0.1, 0.1] * 2


def test_without_pandas_the_errors_name_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec

    def without_pyarrow(name: str, *args: Any) -> Any:
        return None if name == "pyarrow" else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_pyarrow)
    with pytest.raises(ConfigFileError, match=r"pip install 'geoloco\[analysis\]'") as info:
        sweep(BASE, out=tmp_path / "sweep", export=["parquet"])
    assert info.value.key == "--export" and "pyarrow" in info.value.message
    assert not (tmp_path / "sweep").exists(), "refused before any run"
    monkeypatch.setitem(sys.modules, "pandas", None)  # `import pandas` now fails
    with pytest.raises(ImportError, match=r"pip install 'geoloco\[analysis\]'"):
        Table(columns=["a"], rows=[{"a": 1}]).to_dataframe()
    with pytest.raises(ConfigFileError, match="allowed: csv, parquet"):
        sweep(BASE, out=tmp_path / "sweep", export=["xlsx"])


def test_a_baseline_that_names_no_point_fails_before_any_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError, match="matches no point") as info:
        sweep(BASE, grid=GRID, out=tmp_path / "sweep", baseline="uplink_codec=topk")
    assert info.value.key == "--baseline" and not (tmp_path / "sweep").exists()


def test_the_sweep_command_takes_baseline_and_export(tmp_path: Path, capsys: Any) -> None:
    config = tmp_path / "base.toml"
    config.write_text(
        '[workload]\nname = "mlp"\nbatch_size = 8\nhidden_dim = 8\n[algorithm]\ninner_steps = 5\n'
        '[sites]\ncount = 2\n[simulation]\ntotal_inner_steps = 5\neval_every_steps = 5\ndevice = "cpu"\n'
    )
    out = tmp_path / "out"
    argv = ["sweep", str(config), "--grid", "algorithm.uplink_codec=none,int8", "--seeds", "0,1",
            "--out", str(out), "--no-plots"]
    assert main([*argv, "--baseline", "uplink_codec=none", "--export", "csv"]) == 0
    text = capsys.readouterr().out
    assert "Paired differences against `uplink_codec=none`" in text
    assert "| `uplink_codec=int8` | uplink bytes | 2 |" in text
    assert str(out / "runs.csv") in text and (out / "curves.csv").exists()
    assert main([*argv, "--baseline", "uplink_codec=int4"]) == 2
    assert "--baseline" in capsys.readouterr().err

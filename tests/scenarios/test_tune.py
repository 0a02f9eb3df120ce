"""``geoloco tune``: parameter ranges, optuna trials pruned on intermediate eval losses, best
params from the ranges, the files, resume, and the command."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from geoloco.scenarios.cli import main
from geoloco.scenarios.config_file import ConfigFileError
from geoloco.scenarios.research import SUMMARY_FILE, RunResult
from geoloco.scenarios.tune import TuneParam, parse_param, tune

BASE: dict[str, Any] = {
    "workload": {"name": "mlp", "batch_size": 8, "hidden_dim": 8, "eval_size": 64},
    "algorithm": {"name": "diloco", "inner_steps": 5},
    "inner_optimizer": {"lr": 0.003},
    "sites": {"count": 2},
    "simulation": {"total_inner_steps": 20, "eval_every_steps": 5, "device": "cpu"},
}
LR = TuneParam("outer_optimizer.lr", 0.005, 1.0, log=True)
MOMENTUM = TuneParam("outer_optimizer.momentum", 0.5, 0.95)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def optuna(require_extra: Callable[[str, str], ModuleType]) -> ModuleType:
    return require_extra("optuna", "optuna")


def test_parse_param_reads_ranges_and_flags() -> None:
    assert parse_param("outer_optimizer.lr=0.1:1.0:log") == TuneParam("outer_optimizer.lr", 0.1, 1.0, log=True)
    assert parse_param("algorithm.error_feedback_decay=0.8:1") == TuneParam("algorithm.error_feedback_decay", 0.8, 1.0)
    assert parse_param("algorithm.inner_steps=5:50:int:log") == TuneParam(
        "algorithm.inner_steps", 5, 50, log=True, integer=True
    )
    assert parse_param("algorithm.inner_steps=5:50:int").value_text(12.0) == "12"
    assert LR.value_text(0.25) == "0.25"


@pytest.mark.parametrize(
    ("text", "words"),
    [("a.b=1", "KEY=LOW:HIGH"), ("a.b=1:2:cubic", "KEY=LOW:HIGH"), ("a.b=x:2", "KEY=LOW:HIGH"),
     ("a.b=2:1", "below HIGH"), ("a.b=0:1:log", "LOW > 0"), ("a.b=1.5:3:int", "KEY=LOW:HIGH")],
)
def test_parse_param_errors_say_what_is_expected(text: str, words: str) -> None:
    with pytest.raises(ConfigFileError, match=words):
        parse_param(text)


def test_a_range_the_config_refuses_fails_before_any_trial(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError) as info:
        tune(BASE, params=[TuneParam("outer_optimizer.momentum", 0.5, 1.5)], trials=2, out=tmp_path / "t")
    assert info.value.key == "outer_optimizer.momentum"
    assert not (tmp_path / "t").exists()


def test_without_optuna_the_error_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "optuna", None)
    with pytest.raises(ConfigFileError, match=r"pip install 'geoloco\[optuna\]'"):
        tune(BASE, params=[LR], trials=1, out=tmp_path / "t")


def test_a_clearly_bad_trial_is_pruned_and_the_best_params_come_from_the_ranges(
    optuna: ModuleType, tmp_path: Path
) -> None:
    out = tmp_path / "tune"
    good, bad = {LR.key: 0.7, MOMENTUM.key: 0.9}, {LR.key: 0.005, MOMENTUM.key: 0.5}
    result = tune(BASE, params=[LR, MOMENTUM], trials=4, out=out, seed=3,
                  pruner=optuna.pruners.MedianPruner(n_startup_trials=1), enqueue=[good, bad])
    assert (result.ran, result.resumed) == (4, 0)
    first, second = result.trials[:2]
    assert (first.params, first.state) == (good, "complete")
    # An outer lr of 0.005 barely moves the model: at the first evaluation it is behind the
    # completed trial, so the median pruner stops it there.
    assert (second.params, second.state) == (bad, "pruned")
    assert second.curve[0][0] == 5 and second.curve[0][1] > first.curve[0][1]
    assert len(second.curve) < len(first.curve) == 4
    assert not (out / "trials" / "001" / SUMMARY_FILE).exists(), "a pruned run is not a finished run"
    assert len(RunResult.load(out / "trials" / "000").curve) == 4

    assert result.best is not None
    assert result.best.value == min(t.value for t in result.trials if t.value is not None)
    best = json.loads((out / "best.json").read_text())
    assert best["trial"] == result.best.number and best["params"] == result.best.params
    assert LR.low <= best["params"][LR.key] <= LR.high
    assert MOMENTUM.low <= best["params"][MOMENTUM.key] <= MOMENTUM.high
    assert best["set"] == [f"{p.key}={p.value_text(best['params'][p.key])}" for p in (LR, MOMENTUM)]
    for t in result.trials:
        assert LR.low <= t.params[LR.key] <= LR.high and MOMENTUM.low <= t.params[MOMENTUM.key] <= MOMENTUM.high
    table = (out / "trials.md").read_text()
    assert table.count("\n") == 2 + 4 and "| 1 | pruned |" in table and "(best)" in table
    assert (out / "tune.png").stat().st_size > 0

    # Resume: only the missing trial runs.
    again = tune(BASE, params=[LR, MOMENTUM], trials=5, out=out, seed=3, plots=False)
    assert (again.ran, again.resumed, len(again.trials)) == (1, 4, 5)
    assert [t.params for t in again.trials[:4]] == [t.params for t in result.trials]


def test_the_tune_command_and_a_mismatched_resume(optuna: ModuleType, tmp_path: Path, capsys: Any) -> None:
    config = tmp_path / "base.toml"
    config.write_text(
        '[workload]\nname = "mlp"\nbatch_size = 8\nhidden_dim = 8\n[algorithm]\ninner_steps = 5\n'
        'uplink_codec = "int8"\n[sites]\ncount = 2\n'
        '[simulation]\ntotal_inner_steps = 10\neval_every_steps = 5\ndevice = "cpu"\n'
    )
    out = tmp_path / "out"
    argv = ["tune", str(config), "--param", "algorithm.error_feedback_decay=0.8:1.0", "--trials", "2",
            "--pruner", "none", "--out", str(out), "--no-plots", "--set", "algorithm.error_feedback=true"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "2 trials ran, 0 were already finished, 0 pruned" in text and "--set algorithm.error_feedback_decay=" in text
    decay = json.loads((out / "best.json").read_text())["params"]["algorithm.error_feedback_decay"]
    assert 0.8 <= decay <= 1.0
    other = [*argv[:3], "algorithm.error_feedback_decay=0.5:1.0", *argv[4:]]
    assert main(other) == 2
    assert "--out" in capsys.readouterr().err


def test_a_trial_left_running_by_an_interrupted_process_is_failed_and_replaced(
    optuna: ModuleType, tmp_path: Path
) -> None:
    out = tmp_path / "tune"
    tune(BASE, params=[LR], trials=1, out=out, plots=False)
    study = optuna.load_study(study_name="geoloco-tune", storage=f"sqlite:///{out / 'study.db'}")
    study.ask()  # what a process killed mid-trial leaves: a trial that stays RUNNING
    result = tune(BASE, params=[LR], trials=2, out=out, plots=False)
    assert (result.ran, result.resumed) == (1, 1)
    assert [t.state for t in result.trials] == ["complete", "fail", "complete"]
    assert "| 1 | fail |" in result.table()

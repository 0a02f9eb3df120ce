"""``geoloco simulate`` runs the event-driven simulator for ``[algorithm.asynchronous]`` and
``[simulation.chaos]`` (in process, the shipped ``async_chaos.toml`` made tiny)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from geoloco.scenarios.cli import main

ASYNC_CHAOS = Path(__file__).resolve().parents[2] / "scenarios" / "async_chaos.toml"
TINY = [
    "--set", "sites.count=4", "--set", "algorithm.asynchronous.min_quorum=2",
    "--set", "simulation.max_wall_clock_s=4.0", "--set", "simulation.chaos.mtbf_s=3.0",
    "--set", "simulation.eval_every=5",
]


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_simulate_runs_the_event_driven_simulator(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], asynchronous: bool
) -> None:
    out = tmp_path / "out"
    flags = [] if asynchronous else [
        "--set", "algorithm.asynchronous.enabled=false", "--set", "outer_optimizer.momentum_period=1",
    ]
    assert main(["simulate", "--config", str(ASYNC_CHAOS), *TINY, *flags, "--out", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "goodput" in summary and "global downtime" in summary
    assert ("asynchronous: min_quorum 2" if asynchronous else "synchronous rounds, on failure: exclude") in summary
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert last["wall_clock_s"] <= 4.0 and last["eval_loss"] is not None
    assert last["global_downtime_s"] is not None and 0 <= last["goodput"] <= 1
    merges = [r for r in records if r["participants"]]
    assert merges and all(set(r["staleness"]) == set(r["participants"]) for r in merges)
    assert json.loads((out / "summary.json").read_text())["totals"]["final_eval_loss"] == last["eval_loss"]


def test_research_run_and_sweeps_run_the_event_driven_simulator_too(tmp_path: Path) -> None:
    """``research.run`` (what ``geoloco sweep`` and ``tune`` run per point) builds the simulator
    the config needs, as ``geoloco simulate`` does: an asynchronous study in a sweep used to run
    the round-by-round simulator and ignore ``[algorithm.asynchronous]``."""
    from geoloco.scenarios import research

    overrides = [pair for pair in TINY if pair != "--set"]
    result = research.run(ASYNC_CHAOS, overrides=overrides, out=tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records and records[-1]["goodput"] is not None and records[-1]["global_downtime_s"] is not None
    assert any(r["staleness"] for r in records)
    assert result.totals["final_eval_loss"] == records[-1]["eval_loss"]

"""Asynchronous against synchronous DiLoCo as real processes: ``geoloco emulate scenarios/async.toml``.

    python benchmarks/bench_async_emulated.py [--seeds 0 1 2] [--out DIR]

Per seed, four runs of the same scenario (three sites at 1x, 0.5x and 0.25x compute speed, the
coordinator and the sites as processes over shaped links with mutual TLS):

    async      the file as shipped: merges of 2 updates after an adaptive grace window, Delayed
               Nesterov (period 2), Dynamic Local Updates, merges taken into running phases
               (``rebase``), outer lr 0.4
    no-rebase  as async with ``rebase = false`` (the file as shipped before 2026-12-03)
    sync       the same file with [algorithm.asynchronous] off and plain Nesterov (lr 0.4)
    sync07     as sync with synchronous DiLoCo's usual outer lr 0.7

The columns: each site's compute utilization between start-up and wind-down (summary.md), the
run's inner steps, and the eval loss of the global model at the async run's last evaluation time
(seconds since the emulation began; a synchronous run's latest evaluation at or before it),
mean ± std over the seeds. Writes ``results/async-emulated.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).resolve().parent / "results"
SCENARIO = ROOT / "scenarios" / "async.toml"
RULES: dict[str, list[str]] = {
    "async": [],
    "no-rebase": ["algorithm.asynchronous.rebase=false"],
    "sync": ["algorithm.asynchronous.enabled=false", "outer_optimizer.momentum_period=1", "run.rounds=24",
             "run.eval_every=2"],
    "sync07": ["algorithm.asynchronous.enabled=false", "outer_optimizer.momentum_period=1", "outer_optimizer.lr=0.7",
               "run.rounds=24", "run.eval_every=2"],
}
_ROW = re.compile(r"^\| (\w+) \|.*\| ([\d.]+) % \(([\d.]+) %\) \|")


def emulate(rule: str, seed: int, out: Path) -> dict[str, Any]:
    """Run one emulation; its evaluations (seconds since start, loss), utilization and steps."""
    folder = out / f"{rule}-seed{seed}"
    command = [sys.executable, "-m", "geoloco.scenarios.cli", "emulate", str(SCENARIO), "--out", str(folder),
               "--set", f"run.seed={seed}"]
    for setting in RULES[rule]:
        command += ["--set", setting]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    observed = {
        row["round"]: float(row["observed_s"])
        for row in map(json.loads, (folder / "rounds.jsonl").read_text().splitlines())
    }
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    evals = [(observed[r["round"]], float(r["eval_loss"])) for r in records if r.get("eval_loss") is not None]
    steady = {
        match.group(1): float(match.group(3)) / 100
        for line in (folder / "summary.md").read_text().splitlines()
        if (match := _ROW.match(line)) and match.group(1) != "total"
    }
    steps = sum(sum(r["inner_steps"].values()) for r in records)
    return {"rule": rule, "seed": seed, "evals": evals, "steady_utilization": steady, "inner_steps": steps}


def loss_at(evals: list[tuple[float, float]], t: float) -> float:
    """The latest evaluation at or before ``t`` (the first one if none was that early)."""
    before = [loss for when, loss in evals if when <= t + 1e-9]
    return before[-1] if before else evals[0][1]


def _mean_std(values: Sequence[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def table(runs: list[dict[str, Any]], seeds: Sequence[int]) -> str:
    at = {seed: next(r for r in runs if r["rule"] == "async" and r["seed"] == seed)["evals"][-1][0] for seed in seeds}
    lines = [
        "| rule | steady compute utilization fast / half / quarter | inner steps (all sites) "
        "| eval loss at the async run's end |",
        "|---|---|---|---|",
    ]
    for rule in RULES:
        rows = [r for r in runs if r["rule"] == rule]
        utilization = " / ".join(
            f"{100 * statistics.mean(r['steady_utilization'].get(site, 0.0) for r in rows):.1f} %"
            for site in ("fast", "half", "quarter")
        )
        steps = statistics.mean(r["inner_steps"] for r in rows)
        losses = [loss_at(r["evals"], at[r["seed"]]) for r in rows]
        lines.append(f"| {rule} | {utilization} | {steps:.0f} | {_mean_std(losses)} |")
    times = ", ".join(f"{at[s]:.1f} s" for s in seeds)
    return "\n".join(lines) + f"\n\nEvaluation time per seed (the async run's last evaluation): {times}.\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=Path("runs/bench_async_emulated"))
    args = parser.parse_args(argv)
    runs = []
    for seed in args.seeds:
        for rule in RULES:
            runs.append(emulate(rule, seed, args.out))
            print(f"seed {seed} {rule}: done", flush=True)
    text = table(runs, args.seeds)
    print(text)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "async-emulated.md").write_text(text)
    (RESULTS_DIR / "async-emulated.json").write_text(json.dumps(runs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

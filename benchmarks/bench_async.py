"""Decoupled (asynchronous) DiLoCo against synchronous rounds, on the same failures (issue 28).

    python benchmarks/bench_async.py [--quick] [--seeds 0 1 2] [--scale-sites 10000]
                                     [--only failures speeds uniform scale]

Everything runs in the event-driven simulator (``geoloco.algorithms.simulation.async_sim``) on the tiny MLP
workload (1,732 parameters, non-IID sites), 1 Gbit/s links with 50 ms latency, DiLoCo with
AdamW inner steps. Four studies, each seed ``s`` seeding the model, the data and the failure
schedule alike, so every rule of a row set meets the same failures:

1. **Failures** — 32 identical sites, ``H = 5`` steps of 0.2 s (a 1 s phase); every site fails
   with mean time between failures ``MTBF_S`` and is repaired after ``REPAIR_S`` on average
   (exponential, ``[simulation.chaos]``); 60 virtual seconds. Rows: synchronous rounds with the
   coordinator's rule (a failed site leaves the round, ``exclude``) and with the lock-step rule
   (a failure voids the round for everyone, ``restart``); asynchronous merges (quorum of half the
   sites, adaptive grace window, Dynamic Local Updates) with plain Nesterov ("naive") and with
   Delayed Nesterov (period 2 = sites / quorum).
2. **Speeds** — 6 sites at 1x, 0.5x, 0.25x compute (two of each), no failures, ``H = 10`` steps
   of 0.1 s, 60 virtual seconds: synchronous rounds (they wait for the 0.25x sites), naive
   asynchronous, asynchronous with Delayed Nesterov, and with Dynamic Local Updates on top.
3. **Uniform** — 4 identical sites, no failures, at *equal inner steps*: 60 synchronous rounds
   against asynchronous merges of the same total steps (merges of every site, of half of them
   with Delayed Nesterov, and two other outer settings); the eval loss at the end.
4. **Scale** — ``--scale-sites`` sites (10,000) asynchronous with failures for a short run:
   real time, peak memory (the process's maximum RSS) and memory per site.

Columns: goodput (share of computed inner steps that reached the global model), global downtime
(virtual seconds nobody computed useful steps), eval loss of the global model at the equal
virtual wall-clock, merges. Mean ± std over the seeds. Writes ``results/async[-quick].md`` and
``.json``; the numbers and the command are recorded in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from geoloco.algorithms.simulation.async_sim import DecoupledSimulator
from geoloco.algorithms.simulation.sim_config import SimulatorConfig
from geoloco.scenarios.workloads import build_workload

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MTBF_S = 30.0
"""Mean virtual seconds a site stays up (study 1): 30 phases."""
REPAIR_S = 5.0
WALL_S = 60.0
FAILURE_SITES = 32
SPEEDS = (1.0, 0.5, 0.25)


@dataclass(slots=True)
class Outcome:
    study: str
    row: str
    seed: int
    goodput: float
    downtime_s: float
    eval_loss: float
    merges: int
    useful_steps: int
    lost_steps: int
    staleness: float
    seconds: float


def asynchronous(
    config: dict[str, Any], *, sites: int, delayed: bool, dylu: bool = True, rebase: bool = False
) -> None:
    """The asynchronous rule of these studies: a quorum of half the sites, an adaptive grace
    window, Dynamic Local Updates; Delayed Nesterov with period sites / quorum, or plain; with
    ``rebase``, merges taken into the running phases."""
    quorum = max(1, sites // 2)
    config.setdefault("algorithm", {})["asynchronous"] = {
        "enabled": True, "min_quorum": quorum, "adaptive_grace": True, "grace_arrivals": 2.0,
        "dynamic_local_updates": dylu, "rebase": rebase,
    }
    if delayed:
        config["outer_optimizer"] = {"name": "nesterov", "momentum_period": max(1, sites // quorum)}


Rows = list[tuple[str, Callable[[dict[str, Any]], None]]]
"""A study's rules: a label and the change it makes to the study's base config."""


def failure_study(seed: int, wall_s: float) -> tuple[dict[str, Any], Rows]:
    base = {
        "algorithm": {"inner_steps": 5},
        "sites": {"count": FAILURE_SITES, "latency_s": 0.05},
        "run": {"seed": seed, "rounds": 1_000_000, "eval_every": 1_000_000, "max_wall_clock_s": wall_s},
        "simulation": {
            "step_time_s": 0.2,
            "chaos": {"enabled": True, "seed": seed, "mtbf_s": MTBF_S, "repair_s": REPAIR_S},
        },
    }
    rows: Rows = [
        ("sync, failed site excluded", lambda c: None),
        ("sync, lock-step restart", lambda c: c["simulation"]["chaos"].update(sync_on_failure="restart")),
        ("async, Nesterov (naive)", lambda c: asynchronous(c, sites=FAILURE_SITES, delayed=False)),
        ("async, Delayed Nesterov", lambda c: asynchronous(c, sites=FAILURE_SITES, delayed=True)),
        ("async + rebase, Nesterov", lambda c: asynchronous(c, sites=FAILURE_SITES, delayed=False, rebase=True)),
        ("async + rebase, Delayed Nesterov",
         lambda c: asynchronous(c, sites=FAILURE_SITES, delayed=True, rebase=True)),
    ]
    return base, rows


def speed_study(seed: int, wall_s: float) -> tuple[dict[str, Any], Rows]:
    sites = 2 * len(SPEEDS)
    base = {
        "algorithm": {"inner_steps": 10},
        "sites": [{"speed_factor": SPEEDS[k % len(SPEEDS)], "latency_s": 0.05} for k in range(sites)],
        "run": {"seed": seed, "rounds": 1_000_000, "eval_every": 1_000_000, "max_wall_clock_s": wall_s},
        "simulation": {"step_time_s": 0.1, "chaos": {"enabled": True, "seed": seed}},
    }
    rows: Rows = [
        ("sync", lambda c: None),
        ("async, Nesterov (naive)", lambda c: asynchronous(c, sites=sites, delayed=False)),
        ("async, Delayed Nesterov, fixed H", lambda c: asynchronous(c, sites=sites, delayed=True, dylu=False)),
        ("async, Delayed Nesterov + DyLU", lambda c: asynchronous(c, sites=sites, delayed=True)),
        ("async + rebase, Nesterov + DyLU", lambda c: asynchronous(c, sites=sites, delayed=False, rebase=True)),
        ("async + rebase, Delayed Nesterov + DyLU",
         lambda c: asynchronous(c, sites=sites, delayed=True, rebase=True)),
    ]
    return base, rows


UNIFORM_SITES = 4
UNIFORM_ROUNDS = 60


def uniform_study(seed: int, wall_s: float) -> tuple[dict[str, Any], Rows]:
    """Identical sites, no failures, at equal inner steps: ``UNIFORM_ROUNDS`` synchronous rounds
    of every site's H steps against asynchronous merges of the same total (merges of every site:
    as many merges; merges of half the sites: twice as many). ``wall_s`` is not used."""
    base = {
        "algorithm": {"inner_steps": 10},
        "sites": {"count": UNIFORM_SITES, "latency_s": 0.05},
        "run": {"seed": seed, "rounds": UNIFORM_ROUNDS, "eval_every": 1_000_000},
        "simulation": {"step_time_s": 0.1, "chaos": {"enabled": True, "seed": seed}},
    }

    def merges_of(quorum: int, *, rebase: bool = False, **outer: float) -> Callable[[dict[str, Any]], None]:
        def change(config: dict[str, Any]) -> None:
            # No grace window: a merge takes exactly its quorum, so the step counts are equal.
            config.setdefault("algorithm", {})["asynchronous"] = {
                "enabled": True, "min_quorum": quorum, "rebase": rebase,
            }
            if outer.get("momentum") == 0.0:
                config["outer_optimizer"] = {"name": "sgd", "lr": outer.get("lr", 1.0)}
            else:
                config["outer_optimizer"] = {
                    "name": "nesterov", "momentum_period": UNIFORM_SITES // quorum, **outer,
                }
            config["run"]["rounds"] = UNIFORM_ROUNDS * UNIFORM_SITES // quorum
        return change

    rows: Rows = [
        ("sync", lambda c: None),
        (f"async, merges of {UNIFORM_SITES} (Nesterov)", merges_of(UNIFORM_SITES)),
        (f"async, merges of {UNIFORM_SITES // 2}, Delayed Nesterov", merges_of(UNIFORM_SITES // 2)),
        (f"async, merges of {UNIFORM_SITES}, outer lr 0.4", merges_of(UNIFORM_SITES, lr=0.4)),
        (f"async, merges of {UNIFORM_SITES}, outer momentum 0.6", merges_of(UNIFORM_SITES, momentum=0.6)),
        (f"async, merges of {UNIFORM_SITES}, outer lr 0.5, momentum 0.6",
         merges_of(UNIFORM_SITES, lr=0.5, momentum=0.6)),
        (f"async, merges of {UNIFORM_SITES}, outer lr 0.8, momentum 0.3",
         merges_of(UNIFORM_SITES, lr=0.8, momentum=0.3)),
        (f"async, merges of {UNIFORM_SITES}, outer SGD lr 1.0 (no momentum)",
         merges_of(UNIFORM_SITES, lr=1.0, momentum=0.0)),
        (f"async + rebase, merges of {UNIFORM_SITES} (Nesterov)", merges_of(UNIFORM_SITES, rebase=True)),
        (f"async + rebase, merges of {UNIFORM_SITES}, outer lr 0.5, momentum 0.6",
         merges_of(UNIFORM_SITES, rebase=True, lr=0.5, momentum=0.6)),
        (f"async + rebase, merges of {UNIFORM_SITES // 2}, Delayed Nesterov",
         merges_of(UNIFORM_SITES // 2, rebase=True)),
    ]
    return base, rows


def run_one(
    study: str, row: str, seed: int, config: dict[str, Any], workload: Any
) -> tuple[Outcome, DecoupledSimulator]:
    started = time.perf_counter()
    simulator = DecoupledSimulator(SimulatorConfig.from_dict(config), workload)
    records = list(simulator.run())
    last = records[-1]
    staleness = [v for r in records for v in (r.staleness or {}).values()]
    assert last.eval_loss is not None and last.global_downtime_s is not None
    outcome = Outcome(
        study=study, row=row, seed=seed, goodput=simulator.ledger.goodput, downtime_s=last.global_downtime_s,
        eval_loss=last.eval_loss, merges=sum(1 for r in records if r.participants),
        useful_steps=simulator.ledger.useful_steps, lost_steps=simulator.ledger.lost_steps,
        staleness=sum(staleness) / len(staleness) if staleness else 0.0, seconds=time.perf_counter() - started,
    )
    return outcome, simulator


def mean_std(values: Sequence[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ± {format(statistics.stdev(values), fmt)}"


def table(outcomes: list[Outcome], study: str) -> list[str]:
    rows = list(dict.fromkeys(o.row for o in outcomes if o.study == study))
    equal = "equal inner steps" if study == "uniform" else "equal wall-clock"
    lines = [
        f"| rule | goodput | global downtime (s) | eval loss at {equal} | merges | useful steps "
        "| mean staleness |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        mine = [o for o in outcomes if o.study == study and o.row == row]
        lines.append(
            f"| {row} | {mean_std([100 * o.goodput for o in mine], '.1f')} % "
            f"| {mean_std([o.downtime_s for o in mine], '.2f')} "
            f"| {mean_std([o.eval_loss for o in mine], '.4f')} "
            f"| {mean_std([float(o.merges) for o in mine], '.0f')} "
            f"| {mean_std([float(o.useful_steps) for o in mine], '.0f')} "
            f"| {mean_std([o.staleness for o in mine], '.2f')} |"
        )
    return lines


def rss_mb() -> float:
    """The process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def scale_study(sites: int, workload: Any) -> dict[str, Any]:
    """``sites`` asynchronous sites with failures for a short run: time and memory."""
    config = {
        "algorithm": {"inner_steps": 2},
        "sites": {"count": sites, "latency_s": 0.05},
        "run": {"seed": 0, "rounds": 1_000_000, "eval_every": 1_000_000, "max_wall_clock_s": 2.5},
        "simulation": {
            "step_time_s": 0.5, "chaos": {"enabled": True, "seed": 0, "mtbf_s": MTBF_S, "repair_s": REPAIR_S},
        },
    }
    asynchronous(config, sites=sites, delayed=True)
    before = rss_mb()
    outcome, simulator = run_one("scale", f"{sites} sites", 0, config, workload)
    after = rss_mb()
    memory = simulator.memory()
    return {
        "sites": sites, "seconds": outcome.seconds, "merges": outcome.merges, "goodput": outcome.goodput,
        "downtime_s": outcome.downtime_s, "useful_steps": outcome.useful_steps, "lost_steps": outcome.lost_steps,
        "eval_loss": outcome.eval_loss, "rss_before_mb": before, "rss_peak_mb": after,
        "per_site_kb": (after - before) * 1024 / sites, **memory,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one seed, 20 virtual seconds, 1,000 sites at scale")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--scale-sites", type=int, default=10_000)
    parser.add_argument("--only", nargs="+", choices=["failures", "speeds", "uniform", "scale"],
                        help="run these studies only (default: all)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    seeds = args.seeds[:1] if args.quick else args.seeds
    wall_s = 20.0 if args.quick else WALL_S
    scale_sites = min(args.scale_sites, 1000) if args.quick else args.scale_sites
    workload = build_workload("mlp")
    outcomes: list[Outcome] = []
    studies = (("failures", failure_study), ("speeds", speed_study), ("uniform", uniform_study))
    for study, build in studies:
        if args.only and study not in args.only:
            continue
        for seed in seeds:
            base, rows = build(seed, wall_s)
            for row, change in rows:
                config = copy.deepcopy(base)
                change(config)
                outcome, _ = run_one(study, row, seed, config, workload)
                outcomes.append(outcome)
                print(f"{study:8s} seed {seed} {row:34s} goodput {100 * outcome.goodput:5.1f} % downtime "
                      f"{outcome.downtime_s:6.2f} s eval {outcome.eval_loss:.4f} merges {outcome.merges:4d} "
                      f"({outcome.seconds:.1f} s)", file=sys.stderr, flush=True)
    if args.only and "scale" not in args.only:
        print("\n".join(
            line for study in ("failures", "speeds", "uniform") if not args.only or study in args.only
            for line in (f"## {study}", "", *table(outcomes, study), "")
        ))
        return 0
    scale = scale_study(scale_sites, workload)
    print(f"scale: {json.dumps(scale)}", file=sys.stderr, flush=True)

    command = "python benchmarks/bench_async.py" + (" --quick" if args.quick else "")
    lines = [
        f"# Decoupled DiLoCo vs synchronous rounds (`{command}`)",
        "",
        f"Seeds {', '.join(map(str, seeds))}; {wall_s:g} virtual seconds; mlp workload; torch "
        f"{torch.__version__}, {platform.machine()}, 1 thread.",
        "",
        f"## Failures: {FAILURE_SITES} sites, MTBF {MTBF_S:g} s, repair {REPAIR_S:g} s (a phase is 1 s)",
        "",
        *table(outcomes, "failures"),
        "",
        "## Speeds 1x / 0.5x / 0.25x (6 sites, no failures)",
        "",
        *table(outcomes, "speeds"),
        "",
        f"## Equal inner steps: {UNIFORM_SITES} identical sites, no failures, {UNIFORM_ROUNDS} rounds' worth",
        "",
        *table(outcomes, "uniform"),
        "",
        f"## Scale: {scale['sites']} asynchronous sites with failures, 2.5 virtual seconds",
        "",
        f"{scale['seconds']:.1f} s real, {scale['merges']} merges, goodput {100 * scale['goodput']:.1f} %, "
        f"downtime {scale['downtime_s']:.2f} s; peak RSS {scale['rss_peak_mb']:.0f} MB "
        f"({scale['rss_before_mb']:.0f} MB before the run): {scale['per_site_kb']:.1f} KiB per site in all, of "
        f"which {scale['site_state_bytes'] / 1024:.1f} KiB optimizer state and residual tensors; "
        f"{scale['peak_site_states']} sites held state at once, {scale['peak_versions']} global versions, "
        f"{scale['peak_uploads_in_flight']} uploads in flight at the peak.",
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    RESULTS_DIR.mkdir(exist_ok=True)
    stem = "async-quick" if args.quick else "async"
    (RESULTS_DIR / f"{stem}.md").write_text(report)
    (RESULTS_DIR / f"{stem}.json").write_text(
        json.dumps({"outcomes": [asdict(o) for o in outcomes], "scale": scale}, indent=2) + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

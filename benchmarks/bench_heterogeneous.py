"""Heterogeneous sites: fixed-H rounds against time-budget rounds, at equal wall-clock.

    python benchmarks/bench_heterogeneous.py [--quick] [--wall S] [--size tiny|small]

Three sites train the byte-level GPT of ``geoloco.scenarios.workloads`` (non-IID: each on its own
top-level modules of the standard library) in the simulator, at 1x, 0.5x and 0.25x compute speed
(``speed_factor`` 1, 0.5, 0.25; a 1x step is ``STEP_TIME_S`` virtual seconds), each on a
100 Mbit/s link with 40 ms one-way latency, int8 uplink with error feedback. Variants:

    (a) fixed H: every site runs H steps per round; the round waits for the 0.25x site
    (b) time budget B = H x STEP_TIME_S per round, updates weighted by inner steps
    (c) as (b) with uniform weighting (every site's pseudo-gradient counts the same)
    (d) as (a) plus the adaptive deadline (quantile 0.5: plan for the median site) and late
        updates folded into the next round at half weight

Every variant runs until the virtual wall-clock passes ``--wall`` seconds; the columns are each
site's compute utilization (its inner-step time over the wall-clock), inner steps per site, and
the eval loss of the global weights then, with ratios to (a) side by side. Writes
``results/heterogeneous[-quick].md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from geoloco.algorithms.simulation.simulator import Simulator, SimulatorConfig
from geoloco.scenarios.workloads import build_workload

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SPEEDS = (1.0, 0.5, 0.25)
"""Compute speed of each site relative to the reference (``speed_factor``)."""
STEP_TIME_S = 0.1
"""Virtual seconds per inner step of the 1x site."""
LINK_BPS = 100e6
LATENCY_S = 0.040


@dataclass(slots=True)
class Variant:
    key: str
    label: str
    algorithm: dict[str, Any]
    simulation: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Outcome:
    variant: Variant
    wall_clock_s: float
    rounds: int
    eval_loss: float
    utilization: list[float]
    site_steps: list[int]
    folded: int
    stragglers: int
    deadlines: list[float | None]
    seconds: float


def variants(h: int) -> list[Variant]:
    budget = h * STEP_TIME_S
    base = {"name": "diloco", "inner_steps": h, "uplink_codec": "int8", "downlink_codec": "int8"}
    return [
        Variant("a", f"fixed H={h}", base),
        Variant("b", f"time budget {budget:g} s, weighting=steps",
                {**base, "round_time_budget_s": budget, "weighting": "steps"}),
        Variant("c", f"time budget {budget:g} s, weighting=uniform",
                {**base, "round_time_budget_s": budget, "weighting": "uniform"}),
        Variant("d", f"fixed H={h}, adaptive deadline q=0.5, late folded",
                {**base, "late_updates": "fold", "staleness_discount": 0.5},
                {"min_sites": 2, "adaptive_deadline": {
                    "enabled": True, "quantile": 0.5, "margin": 1.2, "window": 3,
                    "min_s": 0.5, "max_s": 600.0}}),
    ]


def run(variant: Variant, *, size: str, wall_s: float, seed: int) -> Outcome:
    workload = build_workload("gpt", size=size, seq_len=64, batch_size=16, eval_batches=4)
    config = SimulatorConfig.from_dict({
        "algorithm": variant.algorithm,
        "inner_optimizer": {"name": "adamw", "lr": 3e-3, "grad_clip_norm": 1.0},
        "sites": [
            {"name": f"{speed:g}x", "speed_factor": speed, "uplink_bps": LINK_BPS,
             "downlink_bps": LINK_BPS, "latency_s": LATENCY_S}
            for speed in SPEEDS
        ],
        "run": {"rounds": 100_000, "eval_every": 100_000, "seed": seed, **variant.simulation},
        "simulation": {"device": "cpu", "step_time_s": STEP_TIME_S},
    })
    t0 = time.perf_counter()
    sim = Simulator(config, workload)
    compute = [0.0] * len(SPEEDS)
    steps = [0] * len(SPEEDS)
    folded = stragglers = rounds = 0
    deadlines: list[float | None] = []
    wall = 0.0
    for record in sim.run():
        rounds += 1
        wall = record.wall_clock_s
        for k in range(len(SPEEDS)):
            compute[k] += list(record.compute_s.values())[k]
            steps[k] += list(record.inner_steps.values())[k]
        folded += len(record.folded_late)
        stragglers += len(record.excluded)
        deadlines.append(record.deadline_s)
        if wall >= wall_s:
            break
    sim.layout.load_(sim.model, sim.global_flat)
    sim.model.eval()
    with torch.no_grad():
        eval_loss = float(workload.eval_loss(sim.model))
    return Outcome(
        variant=variant, wall_clock_s=wall, rounds=rounds, eval_loss=eval_loss,
        utilization=[c / wall for c in compute], site_steps=steps, folded=folded,
        stragglers=stragglers, deadlines=deadlines, seconds=time.perf_counter() - t0,
    )


def table(outcomes: Sequence[Outcome]) -> str:
    base = outcomes[0]
    speeds = " / ".join(f"{s:g}x" for s in SPEEDS)
    lines = [
        f"| variant | rounds | wall-clock (virtual) | utilization {speeds} | mean util. (vs a) "
        f"| inner steps {speeds} | total steps (vs a) | eval loss (vs a) | late folded / stragglers |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        mean_u = sum(o.utilization) / len(o.utilization)
        base_u = sum(base.utilization) / len(base.utilization)
        total, base_total = sum(o.site_steps), sum(base.site_steps)
        lines.append(
            f"| ({o.variant.key}) {o.variant.label} | {o.rounds} | {o.wall_clock_s:.1f} s "
            f"| {' / '.join(f'{u:.0%}' for u in o.utilization)} | {mean_u:.0%} ({mean_u / base_u:.2f}x) "
            f"| {' / '.join(str(s) for s in o.site_steps)} | {total} ({total / base_total:.2f}x) "
            f"| {o.eval_loss:.4f} ({o.eval_loss / base.eval_loss:.3f}) | {o.folded} / {o.stragglers} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny preset, short wall-clock: a smoke run")
    parser.add_argument("--wall", type=float, default=None, help="virtual wall-clock per variant (s)")
    parser.add_argument("--size", default=None, help="GPT preset (default small; quick: tiny)")
    parser.add_argument("--inner-steps", type=int, default=32, help="H of the fixed variant")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    size = args.size or ("tiny" if args.quick else "small")
    wall_s = args.wall or (30.0 if args.quick else 300.0)
    h = 8 if args.quick else args.inner_steps
    outcomes = []
    for variant in variants(h):
        outcome = run(variant, size=size, wall_s=wall_s, seed=args.seed)
        print(f"({variant.key}) {variant.label}: {outcome.rounds} rounds, eval loss "
              f"{outcome.eval_loss:.4f}, {outcome.seconds:.0f} s", file=sys.stderr, flush=True)
        outcomes.append(outcome)
    text = table(outcomes)
    command = "python benchmarks/bench_heterogeneous.py" + (" --quick" if args.quick else "")
    header = (
        f"`{command}` — GPT {size!r}, 3 sites at {', '.join(f'{s:g}x' for s in SPEEDS)} speed, "
        f"1x step = {STEP_TIME_S:g} virtual s, {LINK_BPS / 1e6:g} Mbit/s links, "
        f"{LATENCY_S * 1000:g} ms one way, int8 uplink/downlink, seed {args.seed}; every variant "
        f"runs until {wall_s:g} virtual s. ({platform.machine()}, torch {torch.__version__})\n\n"
    )
    print(header + text)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "heterogeneous-quick" if args.quick else "heterogeneous"
    (args.out / f"{name}.md").write_text(header + text + "\n")
    (args.out / f"{name}.json").write_text(json.dumps(
        [{"variant": o.variant.key, "label": o.variant.label, "algorithm": o.variant.algorithm,
          "simulation": o.variant.simulation, "rounds": o.rounds, "wall_clock_s": o.wall_clock_s,
          "eval_loss": o.eval_loss, "utilization": o.utilization, "site_steps": o.site_steps,
          "folded": o.folded, "stragglers": o.stragglers, "deadlines": o.deadlines}
         for o in outcomes], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The planner's prediction against an emulated run of the same scenario (``geoloco emulate``).

Usage: ``python benchmarks/bench_plan_vs_emulator.py SCENARIO.toml RUN_DIR [--step-time S]``
after ``geoloco emulate SCENARIO.toml --out RUN_DIR``. Prints, side by side, the emulator's
measured round time (rounds 1.., round 0 holds start-up) and bytes per round against two
predictions: with the step time measured by the emulator's own sites (mean ``inner_time_s`` /
``inner_steps`` of the speed-1 sites: isolates the clock model), and with ``--step-time`` (e.g.
what ``geoloco plan --step-time measure`` timed alone on the machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.simulation.planner import Plan, plan
from geoloco.scenarios.scenario import Scenario, load_scenario


def _predict(scenario: Scenario, layout: ParamLayout, step_time_s: float, rounds: int) -> Plan:
    training = dataclasses.replace(scenario.training, rounds=rounds)
    return plan(
        training, numel=layout.numel, sites=[s.clock_site() for s in scenario.sites],
        step_time_s=step_time_s, layout=layout,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("scenario", type=Path)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--step-time", type=float, help="a second step time to predict with")
    args = parser.parse_args()
    scenario = load_scenario(args.scenario)
    records = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines()]
    layout = ParamLayout.from_model(scenario.workload.build().build_model(scenario.run.seed))
    reference = {s.name for s in scenario.sites if s.speed_factor == 1.0}
    per_step = [
        m["inner_time_s"] / m["inner_steps"]
        for r in records for name, m in r["site_metrics"].items()
        if name in reference and m.get("inner_steps")
    ]
    emulator_step = sum(per_step) / len(per_step)
    steady = records[1:]
    measured_round = sum(r["round_time_s"] for r in steady) / len(steady)
    names = [s.name for s in scenario.sites]
    measured_up = sum(sum(r["bytes_up"].values()) for r in steady) / (len(steady) * len(names))
    measured_down = sum(r["downlink_bytes"] for r in steady) / len(steady)
    print(f"{args.scenario.name}: {len(records)} rounds, {layout.numel:,} parameters")
    print(f"  emulator: mean round (rounds 1..) {measured_round:.2f} s, step time of speed-1 sites "
          f"{emulator_step:.3f} s, up/site/round {measured_up:,.0f} B, broadcast {measured_down:,.0f} B")
    steps = [("emulator's step time", emulator_step)]
    if args.step_time is not None:
        steps.append(("given step time", args.step_time))
    for label, step in steps:
        predicted = _predict(scenario, layout, step, len(records))
        train = predicted.train_rounds[1:]
        mean = sum(r.round_time_s for r in train) / len(train)
        up = train[0].bytes_up[0]
        down = train[0].bytes_down[0]
        print(
            f"  plan ({label} {step:.3f} s): mean round {mean:.2f} s (error "
            f"{(mean - measured_round) / measured_round:+.1%}), up/site/round {up:,} B "
            f"({(up - measured_up) / measured_up:+.2%}), broadcast {down:,} B "
            f"({(down - measured_down) / measured_down:+.2%})"
        )


if __name__ == "__main__":
    main()

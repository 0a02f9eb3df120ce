"""The planner's prediction against emulated runs of the same scenarios (``geoloco emulate``).

Two ways to use it:

- ``python benchmarks/bench_plan_vs_emulator.py SCENARIO.toml --run-dir RUN_DIR [--step-time S]``
  after ``geoloco emulate SCENARIO.toml --out RUN_DIR``: compare one finished run;
- ``python benchmarks/bench_plan_vs_emulator.py SCENARIO.toml [SCENARIO.toml ...] --runs 3``: as a
  user would, for each scenario and run, first ``geoloco plan SCENARIO --step-time measure``
  (which times the steps the way the emulator runs the sites), then ``geoloco emulate``, then
  the comparison; a table of every run and the largest error at the end.

Each comparison prints the emulator's measured round time (rounds 1.., round 0 holds start-up)
and bytes per round against two predictions: with the step time the emulator's own sites
measured (mean unthrottled ``inner_time_s`` / ``inner_steps`` over every site: isolates the clock
model) and with the step time given or measured before the run (the planner as a user runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.simulation.planner import Plan, plan
from geoloco.scenarios.child_commands import geoloco_command
from geoloco.scenarios.scenario import Scenario, load_scenario


@dataclass(frozen=True, slots=True)
class Comparison:
    scenario: str
    rounds: int
    measured_round_s: float
    emulator_step_s: float
    own_step_error: float
    given_step_s: float | None
    given_step_error: float | None
    up_error: float | None
    """None with regions: the coordinator sees the relays' partial sums, not the sites' uploads."""
    down_error: float


def _predict(scenario: Scenario, layout: ParamLayout, step_time_s: float, rounds: int) -> Plan:
    training = dataclasses.replace(scenario.training, rounds=rounds)
    return plan(
        training, numel=layout.numel, sites=[s.clock_site() for s in scenario.sites],
        step_time_s=step_time_s, layout=layout, tiers=scenario.tier_clock(),
    )


def compare(scenario_path: Path, run_dir: Path, given_step_s: float | None) -> Comparison:
    scenario = load_scenario(scenario_path)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    layout = ParamLayout.from_model(scenario.workload.build().build_model(scenario.run.seed))
    # ``inner_time_s`` holds the throttle's sleep; at speed f it is compute / f.
    factors = {s.name: s.speed_factor for s in scenario.sites}
    per_step = [
        m["inner_time_s"] * factors[name] / m["inner_steps"]
        for r in records for name, m in r["site_metrics"].items()
        if name in factors and m.get("inner_steps")
    ]
    emulator_step = sum(per_step) / len(per_step)
    steady = records[1:]
    # From the round's opening to its broadcast: the round's period, as the plan's round is
    # (a secure round's unmasking comes after its uploads close, where ``round_time_s`` ends).
    measured_round = sum(r["round_wall_s"] for r in steady) / len(steady)
    names = [s.name for s in scenario.sites]
    measured_up = sum(sum(r["bytes_up"].values()) for r in steady) / (len(steady) * len(names))
    # Per site and round, as measured (a secure round's protocol messages come down too); with
    # regions the coordinator counts its bytes to each relay, so the broadcast is compared.
    if scenario.regions:
        measured_down = sum(r["downlink_bytes"] for r in steady) / len(steady)
    else:
        measured_down = sum(sum(r["bytes_down"][n] for n in names) for r in steady) / (len(steady) * len(names))

    def error(step: float) -> tuple[float, float, float]:
        predicted = _predict(scenario, layout, step, len(records))
        train = predicted.train_rounds[1:]
        mean = sum(r.round_time_s for r in train) / len(train)
        # Per site and round, as measured: adaptive uplink codecs differ by site and round.
        up = sum(sum(r.bytes_up) for r in train) / (len(train) * len(names))
        down = (
            sum(r.bytes_down[0] for r in train) / len(train) if scenario.regions
            else sum(sum(r.bytes_down) for r in train) / (len(train) * len(names))
        )
        return (mean - measured_round) / measured_round, up, down

    own, up, down = error(emulator_step)
    given = error(given_step_s)[0] if given_step_s is not None else None
    return Comparison(
        scenario=scenario_path.stem, rounds=len(records), measured_round_s=measured_round,
        emulator_step_s=emulator_step, own_step_error=own, given_step_s=given_step_s,
        given_step_error=given, up_error=None if scenario.regions else (up - measured_up) / measured_up,
        down_error=(down - measured_down) / measured_down,
    )


def _measured_step(scenario: Path) -> float:
    """``geoloco plan SCENARIO --step-time measure``, as a user runs it before a run."""
    answer = subprocess.run(
        geoloco_command("plan", str(scenario), "--step-time", "measure", "--json"),
        check=True, capture_output=True, text=True,
    )
    return float(json.loads(answer.stdout)["step_time_s"])


def _row(c: Comparison, wall_s: float | None = None) -> str:
    given = "" if c.given_step_error is None else f"{c.given_step_s:.3f} s: **{c.given_step_error:+.1%}**"
    wall = "" if wall_s is None else f"{wall_s:.0f} s"
    up = "n/a (relays' partials)" if c.up_error is None else f"{c.up_error:+.2%}"
    return (
        f"| {c.scenario} | {c.rounds} | {c.measured_round_s:.2f} s | {c.emulator_step_s:.3f} s: "
        f"{c.own_step_error:+.1%} | {given} | {up} | {c.down_error:+.2%} | {wall} |"
    )


HEADER = (
    "| scenario | rounds | measured round (1..) | plan with the emulator's own step time | "
    "plan with the step time measured before the run | upload bytes | broadcast bytes | emulate wall |\n"
    "|---|---:|---:|---|---|---:|---:|---:|"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", type=Path, nargs="+")
    parser.add_argument("--run-dir", type=Path, help="compare this finished run of the (one) scenario")
    parser.add_argument("--step-time", type=float, help="with --run-dir: a second step time to predict with")
    parser.add_argument("--runs", type=int, default=3, help="emulated runs per scenario (without --run-dir)")
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temporary folder)")
    parser.add_argument(
        "--without-faults", action="store_true",
        help="emulate without the scenario's [[faults]] (--set faults=[]): the plan leaves them out",
    )
    args = parser.parse_args()
    if args.run_dir is not None:
        if len(args.scenarios) != 1:
            parser.error("--run-dir compares one scenario's run")
        print(HEADER)
        print(_row(compare(args.scenarios[0], args.run_dir, args.step_time)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        base = args.out or Path(tmp)
        results: list[Comparison] = []
        print(HEADER, flush=True)
        for scenario in args.scenarios:
            for run in range(args.runs):
                step = _measured_step(scenario)
                out = base / f"{scenario.stem}-{run}"
                started = time.monotonic()
                faults = ["--set", "faults=[]"] if args.without_faults else []
                subprocess.run(
                    geoloco_command("emulate", str(scenario), "--out", str(out), *faults),
                    check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )
                result = compare(scenario, out, step)
                results.append(result)
                print(_row(result, time.monotonic() - started), flush=True)
        worst = max(results, key=lambda c: abs(c.given_step_error or 0.0))
        within = sum(abs(c.given_step_error or 0.0) <= 0.10 for c in results)
        print(f"\n{within} of {len(results)} runs within +-10 % with the step time measured before the run; "
              f"the largest error {worst.given_step_error:+.1%} ({worst.scenario})")


if __name__ == "__main__":
    main()

"""Streaming DiLoCo against plain DiLoCo: compute utilization, eval loss, peak bytes in flight.

    OMP_NUM_THREADS=1 python benchmarks/bench_streaming.py [--quick] [--steps T] [--step-time S]

Runs in the single-process simulator (``geoloco.algorithms.simulation.simulator``) with the links of the two
shipped scenarios it compares against:

* ``transatlantic``: us-east (1 Gbit/s, 2 ms) and eu-west (10 Mbit/s, 80 ms each way), H = 20,
  int8 up and down (``scenarios/transatlantic.toml`` / ``scenarios/streaming.toml``);
* ``heterogeneous``: three sites at 1x, 0.5x and 0.25x compute speed (step time factors 1, 2, 4)
  on 100 Mbit/s, 30 ms links, H = 10 (``scenarios/heterogeneous.toml``).

Workload: the byte-level GPT ("small" preset, 484K parameters, 16 x 64-byte windows per batch),
each site on its own stdlib modules. Every configuration runs the same ``T`` inner steps per site
(plain: T/H rounds; streaming: T/(H/P) fragment rounds). The virtual step time is ``--step-time``
seconds (default 0.15, about the measured single-thread step time of this model on the 2-core
development machine), times each site's factor.

Columns: eval loss after ``T`` inner steps (equal inner steps) and its ratio to plain DiLoCo; the
eval loss at equal wall-clock (each run's last evaluation no later than the shorter run's end);
virtual wall-clock; compute utilization (each site's compute seconds over the run's wall-clock,
mean and min over sites); the largest single transfer per site (peak bytes in flight).

Outputs ``results/streaming.md`` and ``results/streaming.json``. ``--quick`` is a smoke run of a
few steps of the "tiny" preset; its numbers mean nothing.

    python benchmarks/bench_streaming.py --emulated runs/transatlantic runs/streaming

compares two ``geoloco emulate`` runs (plain first) instead: per site, the steady-state compute
utilization (inner-step seconds the site reported with its uploads of rounds 1..R-1, over the
wall-clock between the aggregation of round 0 and of the last round: process start-up, torch
import and the first fetch are left out, they are the same for both), the final eval loss (equal
inner steps when both ran the same steps) and the eval loss at equal wall-clock (seconds since the
emulation started, from ``rounds.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from geoloco.algorithms.optimizers import InnerOptimizerConfig
from geoloco.algorithms.simulation.clock import SiteConfig
from geoloco.algorithms.simulation.simulator import SimulationConfig, Simulator, SimulatorConfig
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.algorithms.streaming import StreamingConfig
from geoloco.scenarios.workloads import build_workload

RESULTS_DIR = Path(__file__).resolve().parent / "results"

TRANSATLANTIC = [
    SiteConfig(name="us-east", uplink_bps=1e9, downlink_bps=1e9, latency_s=0.002),
    SiteConfig(name="eu-west", uplink_bps=1e7, downlink_bps=1e7, latency_s=0.08),
]
HETEROGENEOUS = [
    SiteConfig(name=f"{speed}x", uplink_bps=1e8, downlink_bps=1e8, latency_s=0.03,
               speed_factor=1.0 / factor)
    for speed, factor in (("1", 1.0), ("0.5", 2.0), ("0.25", 4.0))
]


@dataclass(slots=True)
class Case:
    scenario: str
    label: str
    sites: list[SiteConfig]
    inner_steps: int
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    step_scale: float = 1.0
    """The case's step time is ``--step-time`` times this (0.01: a GPU-like step)."""


def _adaptive(**bounds: int) -> StreamingConfig:
    return StreamingConfig(enabled=True, fragments=4, overlap_steps=5, adaptive_overlap=True, **bounds)


GPU = 0.01
STARTUP_ROUNDS = 3
"""Rounds left out of the steady-state utilization: round 0 and 1 run the configured overlap
(nothing measured yet, then only the start-up transfer), round 2's choice shapes round 3."""
"""GPU-like cases: the step time 100x shorter than ``--step-time``."""


def cases() -> list[Case]:
    return [
        Case("transatlantic", "plain DiLoCo H=20", TRANSATLANTIC, 20),
        Case("transatlantic", "streaming P=4, tau=0", TRANSATLANTIC, 20,
             StreamingConfig(enabled=True, fragments=4)),
        Case("transatlantic", "streaming P=4, tau=5, mix 0", TRANSATLANTIC, 20,
             StreamingConfig(enabled=True, fragments=4, overlap_steps=5)),
        Case("transatlantic", "streaming P=4, tau=5, mix 0.5", TRANSATLANTIC, 20,
             StreamingConfig(enabled=True, fragments=4, overlap_steps=5, mix=0.5)),
        Case("transatlantic", "streaming P=4, adaptive tau <= 5", TRANSATLANTIC, 20, _adaptive()),
        Case("transatlantic", "streaming P=4, adaptive, rounds <= 20", TRANSATLANTIC, 20,
             _adaptive(interval_steps_max=20)),
        Case("gpu-like", "plain DiLoCo H=20", TRANSATLANTIC, 20, step_scale=GPU),
        Case("gpu-like", "streaming P=4, tau=5", TRANSATLANTIC, 20,
             StreamingConfig(enabled=True, fragments=4, overlap_steps=5), step_scale=GPU),
        Case("gpu-like", "streaming P=4, adaptive, rounds <= 1000", TRANSATLANTIC, 20,
             _adaptive(interval_steps_max=1000), step_scale=GPU),
        Case("heterogeneous", "plain DiLoCo H=10", HETEROGENEOUS, 10),
        Case("heterogeneous", "streaming P=2, tau=5, mix 0", HETEROGENEOUS, 10,
             StreamingConfig(enabled=True, fragments=2, overlap_steps=5)),
    ]


def run_case(case: Case, *, steps: int, step_time_s: float, workload: Any, seed: int) -> dict[str, Any]:
    """Runs until every site has trained at least ``steps`` inner steps (adaptive rounds may
    stretch, so the last round can go past it; its evaluation is at its actual step count)."""
    per_round = case.inner_steps // (case.streaming.fragments if case.streaming.enabled else 1)
    rounds = -(-steps // per_round)
    config = SimulatorConfig(
        algorithm=AlgorithmConfig(
            inner_steps=case.inner_steps, uplink_codec="int8", downlink_codec="int8",
            streaming=case.streaming,
        ),
        inner_optimizer=InnerOptimizerConfig(lr=3e-3, grad_clip_norm=1.0),
        sites=case.sites,
        # One evaluation every H inner steps in every run (and at the last round).
        simulation=SimulationConfig(
            rounds=rounds, eval_every_steps=case.inner_steps, seed=seed, device="cpu",
            step_time_s=step_time_s * case.step_scale,
        ),
    )
    started = time.perf_counter()
    compute = [0.0] * len(case.sites)
    peak = 0
    evals: list[tuple[int, float, float]] = []
    last = None
    done_steps = 0
    steady_compute = [0.0] * len(case.sites)
    steady_span = [0.0] * len(case.sites)
    for record in Simulator(config, workload).run():
        compute = [c + r for c, r in zip(compute, record.compute_s.values())]
        if record.round >= STARTUP_ROUNDS:
            for k, (c, u) in enumerate(zip(record.compute_s.values(), record.utilization.values())):
                steady_compute[k] += c
                steady_span[k] += c / u if u > 0 else 0.0
        peak = max([peak, *(record.peak_bytes_in_flight or {}).values()])
        done_steps += max(record.inner_steps.values())
        if record.eval_loss is not None:
            evals.append((done_steps, record.wall_clock_s, record.eval_loss))
        last = record
        if done_steps >= steps and record.eval_loss is not None:
            break
    assert last is not None
    utilization = [c / last.wall_clock_s for c in compute]
    steady = [c / span if span > 0 else None for c, span in zip(steady_compute, steady_span)]
    return {
        "scenario": case.scenario,
        "label": case.label,
        "inner_steps": case.inner_steps,
        "streaming": case.streaming.to_dict(),
        "rounds": rounds,
        "steps": done_steps,
        "eval_loss": evals[-1][2],
        "evals": evals,
        "wall_clock_s": last.wall_clock_s,
        "utilization": utilization,
        "steady_utilization": steady,
        "last_round_steps": last.inner_steps,
        "peak_bytes_in_flight": peak,
        "bytes_up_total": last.bytes_up_total,
        "runtime_s": time.perf_counter() - started,
    }


def loss_at(result: dict[str, Any], wall_clock_s: float) -> float | None:
    """The last evaluation no later than ``wall_clock_s``."""
    points = [loss for _, t, loss in result["evals"] if t <= wall_clock_s + 1e-9]
    return points[-1] if points else None


def loss_at_steps(result: dict[str, Any], steps: int) -> float:
    """The last evaluation at no more than ``steps`` inner steps."""
    return [loss for done, _, loss in result["evals"] if done <= steps][-1]


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| scenario | configuration | eval loss @ T steps (vs plain at equal steps) | eval loss @ "
        "equal wall-clock | virtual wall-clock | compute utilization mean / min | after start-up "
        "per site | steps of the last round | peak bytes in flight per site (vs plain) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for scenario in dict.fromkeys(r["scenario"] for r in results):
        group = [r for r in results if r["scenario"] == scenario]
        plain = group[0]
        for r in group:
            equal_time = min(r["wall_clock_s"], plain["wall_clock_s"])
            ours, theirs = loss_at(r, equal_time), loss_at(plain, equal_time)
            at_time = (
                f"{ours:.4f} vs plain {theirs:.4f} at {equal_time:.1f} s"
                if r is not plain and ours is not None and theirs is not None
                else "-"
            )
            steady = " / ".join("-" if u is None else f"{100 * u:.1f} %" for u in r["steady_utilization"])
            # Equal inner steps: this run's last evaluation within plain's steps, against
            # plain's evaluation at (up to H below) the same step count.
            within = [(d, loss) for d, _, loss in r["evals"] if d <= plain["steps"]]
            if within:
                done, loss = within[-1]
                at_steps = f"{loss:.4f} @ {done} ({loss / loss_at_steps(plain, done):.3f}x)"
            else:
                at_steps = f"{r['eval_loss']:.4f} @ {r['steps']} (plain ran {plain['steps']})"
            lines.append(
                f"| {scenario} | {r['label']} | {at_steps} | {at_time} | "
                f"{r['wall_clock_s']:.1f} s | {100 * sum(r['utilization']) / len(r['utilization']):.1f} % / "
                f"{100 * min(r['utilization']):.1f} % | {steady} | {r['last_round_steps']} | "
                f"{r['peak_bytes_in_flight'] / 1e3:.1f} kB "
                f"({plain['peak_bytes_in_flight'] / r['peak_bytes_in_flight']:.2f}x fewer) |"
            )
    return "\n".join(lines)


def emulated(run_dir: Path) -> dict[str, Any]:
    """Steady-state utilization per site and eval points of one ``geoloco emulate`` run."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    observed = {
        int(o["round"]): float(o["observed_s"])
        for o in map(json.loads, (run_dir / "rounds.jsonl").read_text().splitlines())
    }
    span = observed[records[-1]["round"]] - observed[records[0]["round"]]
    sites = sorted({site for r in records for site in r.get("site_metrics", {})})
    utilization = {
        site: sum(r["site_metrics"].get(site, {}).get("inner_time_s", 0.0) for r in records[1:]) / span
        for site in sites
    }
    evals = [(observed[r["round"]], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    return {"dir": str(run_dir), "rounds": len(records), "utilization": utilization,
            "evals": evals, "span_s": span}


def emulated_table(plain: dict[str, Any], streaming: dict[str, Any]) -> str:
    end = min(plain["evals"][-1][0], streaming["evals"][-1][0])

    def at(run: dict[str, Any]) -> float:
        return [loss for t, loss in run["evals"] if t <= end + 1e-9][-1]

    lines = [
        "| run | rounds | steady-state compute utilization per site | final eval loss | "
        f"eval loss at {end:.1f} s |",
        "|---|---|---|---|---|",
    ]
    for run in (plain, streaming):
        util = ", ".join(f"{site} {100 * u:.1f} %" for site, u in run["utilization"].items())
        lines.append(
            f"| {run['dir']} | {run['rounds']} | {util} | {run['evals'][-1][1]:.4f} "
            f"({run['evals'][-1][1] / plain['evals'][-1][1]:.4f}x) | {at(run):.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="inner steps per site (T)")
    parser.add_argument("--step-time", type=float, default=0.15, help="virtual seconds per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu-steps", type=int, default=2000,
                        help="inner steps per site of the GPU-like cases (100x shorter steps)")
    parser.add_argument("--only", default="",
                        help="comma-separated scenarios to run (transatlantic, heterogeneous, gpu-like)")
    parser.add_argument("--skip", default="",
                        help="comma-separated substrings of configuration labels not to run")
    parser.add_argument("--name", default="streaming", help="results/NAME.md and NAME.json")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 40 steps")
    parser.add_argument("--emulated", nargs=2, type=Path, metavar=("PLAIN_RUN", "STREAMING_RUN"),
                        help="compare two `geoloco emulate` output folders instead")
    args = parser.parse_args(argv)
    if args.emulated:
        print(emulated_table(*(emulated(d) for d in args.emulated)))
        return 0
    torch.set_num_threads(1)
    size = "tiny" if args.quick else "small"
    steps = 40 if args.quick else args.steps
    workload = build_workload("gpt", size=size, seq_len=64, batch_size=16, eval_batches=4)
    results = []
    only = {name for name in args.only.split(",") if name}
    for case in cases():
        if (only and case.scenario not in only) or any(
            part and part in case.label for part in args.skip.split(",")
        ):
            continue
        case_steps = (40 if args.quick else args.gpu_steps) if case.step_scale != 1.0 else steps
        result = run_case(case, steps=case_steps, step_time_s=args.step_time, workload=workload, seed=args.seed)
        print(
            f"{case.scenario:14s} {case.label:32s} eval {result['eval_loss']:.4f}  wall "
            f"{result['wall_clock_s']:7.1f} s  util {100 * min(result['utilization']):5.1f} %  "
            f"peak {result['peak_bytes_in_flight'] / 1e3:7.1f} kB  ({result['runtime_s']:.0f} s)",
            flush=True,
        )
        results.append(result)
    text = table(results)
    print(text)
    if not args.quick:
        RESULTS_DIR.mkdir(exist_ok=True)
        (RESULTS_DIR / f"{args.name}.md").write_text(
            f"Command: `OMP_NUM_THREADS=1 python benchmarks/bench_streaming.py --steps {steps} "
            f"--step-time {args.step_time} --gpu-steps {args.gpu_steps}"
            f"{' --only ' + args.only if args.only else ''}"
            f"{' --skip ' + repr(args.skip) if args.skip else ''} --name {args.name}`\n\n{text}\n"
        )
        (RESULTS_DIR / f"{args.name}.json").write_text(json.dumps({
            "steps": steps, "step_time_s": args.step_time, "seed": args.seed,
            "machine": platform.platform(), "python": sys.version.split()[0],
            "torch": torch.__version__, "results": results,
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

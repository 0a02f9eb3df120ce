"""Partial Parameter Updates against plain DiLoCo at equal inner steps: bytes, optimizer memory, loss.

    python benchmarks/bench_partial.py [--rounds R] [--inner-steps H] [--sites N] [--size tiny]

Every row runs the same simulated sites (non-IID byte-level GPT, AdamW inner optimizer, the same
seed, R rounds of H inner steps) in one process and reports, side by side:

- the parameters each site trains (the mean over sites) and the values it uploads per round;
- uplink bytes per round (all sites, exactly what the simulator counts: the encoded subset);
- inner-optimizer state per site (AdamW's ``exp_avg`` / ``exp_avg_sq`` / ``step`` tensors that
  exist after the run, summed; frozen tensors never get state);
- real seconds per inner step (measured here, on a shared machine: indicative only);
- the eval loss after the last round.

Rows: (a) DiLoCo, (b) PPU by blocks, (c) PPU by layers, (d) SparseLoCo's fixed-tile variant
(``sparseloco-tiles``, what ``sparseloco`` meant when pages/partial.md was recorded; the authors'
``sparseloco`` clips to the median norm, which partial updates cannot combine with), (e) (d) + PPU
by blocks. Ratios are against (a) of the same run.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from geoloco.algorithms.simulation.simulator import Simulator, SimulatorConfig
from geoloco.scenarios.workloads import build_workload

ROWS: dict[str, dict[str, Any]] = {
    "(a) diloco": {"name": "diloco"},
    "(b) diloco + PPU blocks/2": {"name": "diloco", "partial_updates": {"enabled": True, "groups": 2}},
    "(c) diloco + PPU layers/2": {
        "name": "diloco", "partial_updates": {"enabled": True, "groups": 2, "mode": "layers"},
    },
    "(d) sparseloco-tiles": {"name": "sparseloco-tiles"},
    "(e) sparseloco-tiles + PPU blocks/2": {
        "name": "sparseloco-tiles", "partial_updates": {"enabled": True, "groups": 2},
    },
}


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )


def run_row(algorithm: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    workload = build_workload("gpt", size=args.size)
    config = SimulatorConfig.from_dict({
        "algorithm": {"inner_steps": args.inner_steps, **algorithm},
        "inner_optimizer": {"lr": 2e-3},
        "sites": {"count": args.sites},
        "run": {"rounds": args.rounds, "eval_every": args.rounds, "seed": 0},
        "simulation": {"device": "cpu", "step_time_s": 0.07},
    })
    sim = Simulator(config, workload)
    started = time.perf_counter()
    records = list(sim.run())
    elapsed = time.perf_counter() - started
    partial = sim.strategy.partial
    trained = [
        partial.partial_numel(partial.site_group(s.name)) if partial is not None else sim.layout.numel
        for s in sim.sites
    ]
    states = [optimizer_state_bytes(s.optimizer) for s in sim.sites if s.optimizer is not None]
    return {
        "params": sim.layout.numel,
        "trained": sum(trained) / len(trained),
        "bytes_round": sum(records[-1].bytes_up.values()),
        "state_site": sum(states) / len(states),
        "step_s": elapsed / (args.rounds * args.inner_steps * args.sites),
        "eval_loss": float(records[-1].eval_loss or float("nan")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--sites", type=int, default=4)
    parser.add_argument("--size", default="tiny")
    args = parser.parse_args()
    results = {label: run_row(algorithm, args) for label, algorithm in ROWS.items()}
    base = results["(a) diloco"]
    print(
        f"GPT {args.size!r} ({base['params']:,} parameters), {args.sites} non-IID sites, "
        f"{args.rounds} rounds x H={args.inner_steps}, AdamW lr 2e-3, seed 0, "
        f"{torch.get_num_threads()} threads\n"
    )
    print("| row | trained params / site | uplink bytes / round | vs (a) | optimizer state / site | vs (a) "
          "| s / inner step | vs (a) | eval loss |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, r in results.items():
        print(
            f"| {label} | {r['trained']:,.0f} ({r['trained'] / r['params']:.0%}) | {r['bytes_round']:,} "
            f"| {r['bytes_round'] / base['bytes_round']:.3f}x | {r['state_site']:,.0f} "
            f"| {r['state_site'] / base['state_site']:.2f}x | {r['step_s'] * 1e3:.1f} ms "
            f"| {r['step_s'] / base['step_s']:.2f}x | {r['eval_loss']:.4f} |"
        )


if __name__ == "__main__":
    main()

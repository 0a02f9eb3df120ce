"""Uneven links: one codec for all against per-site adaptive codecs, at equal wall-clock.

    python benchmarks/bench_uneven_links.py [--quick] [--wall S] [--size tiny|small] [--inner-steps H]

Four sites train the byte-level GPT of ``geoloco.scenarios.workloads`` (non-IID) in the
simulator: site ``slow`` behind a 10 Mbit/s link (both directions), sites ``fast1..3`` on
1 Gbit/s, 10 ms one-way latency each, a GPU-like step (``STEP_TIME_S`` virtual seconds, so the
links matter), int8 downlink. Variants (``scenarios/uneven_links.toml`` is variant b):

    (a) fixed codec: int8 uplink for every site
    (b) adaptive: ``[algorithm.adaptive_uplink]`` gives each site its codec per round (int8 for
        the fast links, ``topk:D|int8`` with D from the measured throughput for the slow one)
    (c) time budget: ``round_time_budget_s = H x STEP_TIME_S``, weighting by steps (the existing
        time-budget rounds; they budget compute, not transfers)

Every variant runs until the virtual wall-clock passes ``--wall`` seconds; the table gives the
rounds, each site's mean upload time per round (after the first round, which every variant
sends in int8), the slow / fast ratio and the eval loss then, with ratios to (a). Writes
``results/uneven_links[-quick].md``, ``.json`` and ``.png`` (per-site upload time per round).
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
STEP_TIME_S = 0.01
"""Virtual seconds per inner step (a GPU-like step: the transfers are the round's bulk)."""
LATENCY_S = 0.010
LINKS = {"slow": 10e6, "fast1": 1e9, "fast2": 1e9, "fast3": 1e9}
"""Site -> uplink and downlink bits per second."""


@dataclass(slots=True)
class Variant:
    key: str
    label: str
    algorithm: dict[str, Any]


@dataclass(slots=True)
class Outcome:
    variant: Variant
    wall_clock_s: float
    rounds: int
    eval_loss: float
    upload_s: dict[str, list[float]] = field(default_factory=dict)
    """Site -> its upload time of every round (latency + bytes / uplink)."""
    seconds: float = 0.0

    def mean_upload_s(self, site: str) -> float:
        later = self.upload_s[site][1:] or self.upload_s[site]
        return sum(later) / len(later)

    def slow_ratio(self) -> float:
        fast = [self.mean_upload_s(s) for s in LINKS if s != "slow"]
        return self.mean_upload_s("slow") / (sum(fast) / len(fast))


def variants(h: int) -> list[Variant]:
    base = {"name": "diloco", "inner_steps": h, "uplink_codec": "int8", "downlink_codec": "int8"}
    return [
        Variant("a", "fixed codec int8", base),
        Variant("b", "adaptive codec (min_density 0.001)",
                {**base, "adaptive_uplink": {"enabled": True, "min_density": 0.001}}),
        Variant("c", f"time budget {h * STEP_TIME_S:g} s, weighting=steps",
                {**base, "round_time_budget_s": h * STEP_TIME_S, "weighting": "steps"}),
    ]


def run(variant: Variant, *, size: str, wall_s: float, seed: int) -> Outcome:
    workload = build_workload("gpt", size=size, seq_len=64, batch_size=16, eval_batches=4)
    config = SimulatorConfig.from_dict({
        "algorithm": variant.algorithm,
        "inner_optimizer": {"name": "adamw", "lr": 3e-3, "grad_clip_norm": 1.0},
        "sites": [
            {"name": name, "uplink_bps": bps, "downlink_bps": bps, "latency_s": LATENCY_S}
            for name, bps in LINKS.items()
        ],
        "run": {"rounds": 100_000, "eval_every": 100_000, "seed": seed},
        "simulation": {"device": "cpu", "step_time_s": STEP_TIME_S},
    })
    t0 = time.perf_counter()
    sim = Simulator(config, workload)
    outcome = Outcome(variant=variant, wall_clock_s=0.0, rounds=0, eval_loss=float("nan"),
                      upload_s={name: [] for name in LINKS})
    for record in sim.run():
        outcome.rounds += 1
        outcome.wall_clock_s = record.wall_clock_s
        for k, (name, bps) in enumerate(LINKS.items()):  # the simulator names sites by index
            outcome.upload_s[name].append(LATENCY_S + 8 * record.bytes_up[str(k)] / bps)
        if record.wall_clock_s >= wall_s:
            break
    sim.layout.load_(sim.model, sim.global_flat)
    sim.model.eval()
    with torch.no_grad():
        outcome.eval_loss = float(workload.eval_loss(sim.model))
    outcome.seconds = time.perf_counter() - t0
    return outcome


def table(outcomes: Sequence[Outcome]) -> str:
    base = outcomes[0]
    lines = [
        "| variant | rounds | wall-clock (virtual) | mean upload s/round slow / fast1 / fast2 / fast3 "
        "| slow / fast upload | eval loss (vs a) |",
        "|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        uploads = " / ".join(f"{o.mean_upload_s(s):.3f}" for s in LINKS)
        lines.append(
            f"| ({o.variant.key}) {o.variant.label} | {o.rounds} | {o.wall_clock_s:.1f} s | {uploads} "
            f"| {o.slow_ratio():.2f}x | {o.eval_loss:.4f} ({o.eval_loss / base.eval_loss:.3f}) |"
        )
    return "\n".join(lines)


def plot(outcomes: Sequence[Outcome], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(outcomes), figsize=(5 * len(outcomes), 3.6), sharey=True)
    for ax, o in zip(axes, outcomes, strict=True):
        for name, times in o.upload_s.items():
            ax.plot(range(len(times)), times, label=name, linewidth=2.2 if name == "slow" else 1.0)
        ax.set_title(f"({o.variant.key}) {o.variant.label}", fontsize=9)
        ax.set_xlabel("round")
        ax.set_yscale("log")
    axes[0].set_ylabel("upload time per round (virtual s)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short wall-clock: a smoke run")
    parser.add_argument("--wall", type=float, default=None, help="virtual wall-clock per variant (s)")
    parser.add_argument("--size", default="tiny", help="GPT preset (tiny: the 2-core machine's budget)")
    parser.add_argument("--inner-steps", type=int, default=8, help="H")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one site trains at a time: more threads only contend
    size = args.size
    wall_s = args.wall or (2.0 if args.quick else 6.0)
    h = args.inner_steps
    outcomes = []
    for variant in variants(h):
        outcome = run(variant, size=size, wall_s=wall_s, seed=args.seed)
        print(f"({variant.key}) {variant.label}: {outcome.rounds} rounds, eval loss "
              f"{outcome.eval_loss:.4f}, {outcome.seconds:.0f} s", file=sys.stderr, flush=True)
        outcomes.append(outcome)
    text = table(outcomes)
    command = " ".join(["python benchmarks/bench_uneven_links.py", *(argv if argv is not None else sys.argv[1:])])
    header = (
        f"`{command}` — GPT {size!r}, 4 sites: slow at 10 Mbit/s, fast1..3 at 1 Gbit/s (both "
        f"directions), {LATENCY_S * 1000:g} ms one way, H={h}, step {STEP_TIME_S:g} virtual s, "
        f"int8 downlink, seed {args.seed}; every variant runs until {wall_s:g} virtual s. "
        f"({platform.machine()}, torch {torch.__version__})\n\n"
    )
    print(header + text)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "uneven_links" + ("" if size == "tiny" else f"-{size}") + ("-quick" if args.quick else "")
    (args.out / f"{name}.md").write_text(header + text + "\n")
    (args.out / f"{name}.json").write_text(json.dumps(
        [{"variant": o.variant.key, "label": o.variant.label, "algorithm": o.variant.algorithm,
          "rounds": o.rounds, "wall_clock_s": o.wall_clock_s, "eval_loss": o.eval_loss,
          "upload_s": o.upload_s, "slow_over_fast": o.slow_ratio()}
         for o in outcomes], indent=1) + "\n")
    plot(outcomes, args.out / f"{name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

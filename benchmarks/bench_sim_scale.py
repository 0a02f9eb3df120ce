"""How far the single-process simulator scales: peak memory and time per round against site count.

    python benchmarks/bench_sim_scale.py [--sites 4,16,64] [--rounds R] [--inner-steps H] [--quick]

For each site count N, one fresh subprocess runs ``R`` DiLoCo rounds of ``H`` inner steps of the
"small" byte-level GPT (~484K parameters, batch 16 x 128 per site, AdamW inner optimizer, int8
uplink with error feedback so every site also holds a residual) in
``geoloco.algorithms.simulation.simulator`` and reports its peak resident memory (``ru_maxrss`` of that
process, which includes the Python interpreter, torch and the corpus) and the real seconds per
round. A subprocess per N keeps one run's peak from hiding the next one's. The simulator keeps
one model and per site only the inner-optimizer state, the error-feedback residual and the data
stream, so memory should grow by a few MB per site while time grows linearly (sites run one
after another). Target: 64 sites within 8 GB.

``--quick`` uses the "tiny" preset, 1 round of 2 steps and 4 and 16 sites (a few seconds).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TARGET_BYTES_64_SITES = 8 * 2**30
"""The issue's memory target for 64 sites."""


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def child(sites: int, rounds: int, inner_steps: int, size: str, codec: str) -> dict[str, object]:
    """Run the simulation in this process and return its measurements."""
    import torch

    from geoloco.algorithms.simulation.clock import SiteConfig
    from geoloco.algorithms.simulation.simulator import SimulationConfig, Simulator, SimulatorConfig
    from geoloco.algorithms.strategy import AlgorithmConfig
    from geoloco.scenarios.workloads import build_workload

    workload = build_workload("gpt", size=size)
    before_build = peak_rss_bytes()
    config = SimulatorConfig(
        algorithm=AlgorithmConfig(name="diloco", inner_steps=inner_steps, uplink_codec=codec),
        sites=[SiteConfig(uplink_bps=1e8, downlink_bps=1e8, latency_s=0.04) for _ in range(sites)],
        simulation=SimulationConfig(rounds=rounds, eval_every=rounds, step_time_s=0.07, device="cpu"),
    )
    started = time.perf_counter()
    simulator = Simulator(config, workload)
    build_s = time.perf_counter() - started
    round_s = []
    eval_loss = None
    last = time.perf_counter()
    for record in simulator.run():
        now = time.perf_counter()
        round_s.append(now - last)
        last = now
        eval_loss = record.eval_loss
    # The last round includes the one evaluation; report the mean of the others when there are.
    train_rounds = round_s[:-1] if len(round_s) > 1 else round_s
    return {
        "sites": sites,
        "parameters": simulator.layout.numel,
        "peak_rss_bytes": peak_rss_bytes(),
        "rss_before_simulator_bytes": before_build,
        "build_s": build_s,
        "round_s": sum(train_rounds) / len(train_rounds),
        "step_s": sum(train_rounds) / len(train_rounds) / (sites * inner_steps),
        "eval_loss": eval_loss,
        "threads": torch.get_num_threads(),
    }


def parse_sites(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"--sites takes comma-separated positive integers such as 4,16,64, got {text!r}"
        )
    return values


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sites", type=parse_sites, default=None, help="site counts (default 4,16,64)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per run (default 3)")
    parser.add_argument("--inner-steps", type=int, default=None, help="H (default 5)")
    parser.add_argument("--size", default=None, help="GPT preset (default small; quick: tiny)")
    parser.add_argument("--codec", default="int8", help="uplink codec (default int8, with error feedback)")
    parser.add_argument("--quick", action="store_true", help="tiny preset, 1 round of 2 steps, 4 and 16 sites")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for sim_scale.{md,json}")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sites = args.sites or ([4, 16] if args.quick else [4, 16, 64])
    rounds = args.rounds or (1 if args.quick else 3)
    inner_steps = args.inner_steps or (2 if args.quick else 5)
    size = args.size or ("tiny" if args.quick else "small")
    if rounds < 1 or inner_steps < 1:
        parser.error("--rounds and --inner-steps must be >= 1")

    if args.child:
        print(json.dumps(child(sites[0], rounds, inner_steps, size, args.codec)))
        return 0

    results = []
    for n in sites:
        command = [
            sys.executable, str(Path(__file__).resolve()), "--child", "--sites", str(n),
            "--rounds", str(rounds), "--inner-steps", str(inner_steps), "--size", size,
            "--codec", args.codec,
        ]
        print(f"{n} sites ...", file=sys.stderr, flush=True)
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            raise SystemExit(f"the {n}-site run failed with exit status {done.returncode}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))

    base = results[0]
    lines = [
        f"GPT '{size}' ({base['parameters']:,} parameters), DiLoCo H={inner_steps}, {rounds} "
        f"rounds, uplink `{args.codec}` + error feedback, CPU, {base['threads']} threads",
        "",
        "| sites | peak RSS | RSS before simulator | MB per extra site | s per round | ms per site-step | eval loss |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        extra = (
            f"{(r['peak_rss_bytes'] - base['peak_rss_bytes']) / 2**20 / (r['sites'] - base['sites']):.2f}"
            if r["sites"] != base["sites"] else "-"
        )
        lines.append(
            f"| {r['sites']} | {r['peak_rss_bytes'] / 2**30:.2f} GiB | "
            f"{r['rss_before_simulator_bytes'] / 2**30:.2f} GiB | {extra} | {r['round_s']:.2f} | "
            f"{1000 * r['step_s']:.1f} | {r['eval_loss']:.4f} |"
        )
    largest = results[-1]
    if largest["sites"] >= 64:
        ok = largest["peak_rss_bytes"] <= TARGET_BYTES_64_SITES
        lines += ["", f"- [{'x' if ok else ' '}] {largest['sites']} sites within 8 GiB "
                      f"({largest['peak_rss_bytes'] / 2**30:.2f} GiB)"]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "sim_scale-quick" if args.quick else "sim_scale"
    (args.out / f"{stem}.md").write_text(text)
    (args.out / f"{stem}.json").write_text(
        json.dumps({"platform": platform.platform(), "rounds": rounds, "inner_steps": inner_steps,
                    "size": size, "codec": args.codec, "results": results}, indent=1) + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

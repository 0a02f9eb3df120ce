"""Robust aggregation against one poisoned site, and what each option costs on a clean run.

    python benchmarks/bench_robust.py [--sites N] [--rounds R] [--inner-steps H] [--numel M] [--quick]

Quality (the simulator, ``geoloco.algorithms.simulation.simulator``): the built-in MLP workload, N non-IID
sites, DiLoCo with H inner steps for R rounds, uplink uncompressed. Site N-1 is honest in the
clean run and poisoned in the others (``SiteConfig.attack``): its update scaled by 100
(``scale:100``), sign-flipped (``sign_flip``) or replaced by Gaussian noise (``noise:S``). Each of
four aggregations runs every case:

- ``mean``: the plain mean (today's default);
- ``clip``: the mean after clipping every update to 2x the round's median update norm;
- ``trimmed``: coordinate-wise trimmed mean, 25% dropped at each end;
- ``median``: coordinate-wise median.

For each run it reports the final eval loss and the distance of the final weights from the clean
plain-mean run's, ``||θ − θ_clean|| / ||θ_clean − θ_0||`` (1.0 = as far off as the whole clean
run travelled), all in one table.

Cost, on the clean run, beside the plain mean's in the same run: the real seconds per simulated
round (the fastest round of the run: other jobs on a shared machine only add time; aggregation is
a small part of a simulated round of this tiny model), and an aggregation-only measurement at
coordinator scale: in a fresh subprocess per option (each run twice, interleaved, fastest kept),
N updates of M float32 values arrive one after another (each generated, added, dropped, as
uploads do) and the round's result is taken, ``REPEATS`` times; it reports the fastest seconds of
``add`` + ``take_result``, the bytes the aggregation holds at the close (its buffer, or the held
updates) and the peak resident memory (``VmHWM``, reset before the first update) above the level
before it (which includes the incoming update and memory the allocator keeps after a free). The
robust options hold every update of the round: expect about N x M x 4 bytes instead of M x 4.

``--quick``: 4 sites, 3 rounds of 4 steps, M = 1M (well under a minute).
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
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPEATS = 3
"""Aggregation rounds per option and subprocess; the fastest is reported (see the module doc)."""

OPTIONS: dict[str, dict[str, Any]] = {
    "mean": {},
    "clip": {"clip_to_median_norm": 2.0},
    "trimmed": {"aggregation": "trimmed_mean", "trim_fraction": 0.25},
    "median": {"aggregation": "median"},
}
"""Aggregation name in the table -> ``[algorithm]`` keys."""

NOISE_STD = 0.5
"""Per-coordinate std of the noise attack: an upload of norm about 21 (0.5 x sqrt(1732) values) on
the MLP (0.05 moved the plain mean by only 0.42 of the clean run's travel)."""

ATTACKS: dict[str, str | None] = {
    "clean": None,
    "x100": "scale:100",
    "sign flip": "sign_flip",
    f"noise {NOISE_STD}": f"noise:{NOISE_STD}",
}


def peak_rss_bytes() -> int:
    """Peak resident set size of this process: ``VmHWM`` (which ``reset_peak_rss`` can reset),
    else ``ru_maxrss`` (KiB on Linux, bytes on macOS)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def simulate(
    options: dict[str, Any], attack: str | None, *, sites: int, rounds: int, inner_steps: int
) -> dict[str, Any]:
    """One simulated run: its final weights, eval loss and real seconds per round."""
    from geoloco.algorithms.simulation.simulator import Simulator, SimulatorConfig
    from geoloco.scenarios.workloads import build_workload

    site_tables: list[dict[str, Any]] = [{} for _ in range(sites)]
    if attack is not None:
        site_tables[-1] = {"attack": attack}
    config = SimulatorConfig.from_dict({
        "algorithm": {"inner_steps": inner_steps, **options},
        "inner_optimizer": {"lr": 3e-3},
        "sites": site_tables,
        "run": {"rounds": rounds, "seed": 0, "eval_every": rounds},
        "simulation": {"device": "cpu"},
    })
    simulator = Simulator(config, build_workload("mlp"))
    start = simulator.global_flat.clone()
    eval_loss = None
    round_s = []
    last = time.perf_counter()
    for record in simulator.run():
        now = time.perf_counter()
        round_s.append(now - last)
        last = now
        eval_loss = record.eval_loss
    # The fastest round (the last one also evaluates): other jobs on a shared machine only ever
    # add time, so the minimum is the least disturbed estimate.
    return {"weights": simulator.global_flat, "start": start, "eval_loss": eval_loss,
            "round_s": min(round_s[:-1] or round_s)}


def aggregation_child(option: str, sites: int, numel: int) -> dict[str, Any]:
    """Aggregate ``sites`` random updates of ``numel`` values with ``option``; time and memory."""
    import torch

    from geoloco.algorithms.aggregation import new_aggregation
    from geoloco.algorithms.strategy import AlgorithmConfig

    torch.set_num_threads(1)
    rule = AlgorithmConfig(**OPTIONS[option]).robust_rule
    generator = torch.Generator().manual_seed(0)
    before = reset_peak_rss()
    times = []
    for _ in range(REPEATS):
        aggregation = new_aggregation(numel, robust=rule)
        seconds = 0.0
        for k in range(sites):
            update = torch.randn(numel, generator=generator)
            if k == sites - 1:
                update.mul_(100.0)  # one poisoned site, so clipping has something to do
            t0 = time.perf_counter()
            aggregation.add(update, 1.0, site=str(k))
            seconds += time.perf_counter() - t0
            del update
        held = getattr(aggregation, "held_bytes", numel * 4)  # a running sum: its one buffer
        t0 = time.perf_counter()
        result = aggregation.take_result()
        seconds += time.perf_counter() - t0
        assert result.numel() == numel
        del result, aggregation
        times.append(seconds)
    return {"option": option, "seconds": min(times), "held_bytes": held,
            "peak_above_bytes": peak_rss_bytes() - before}


def reset_peak_rss() -> int:
    """Reset the peak RSS to the current RSS where Linux allows it (``/proc/self/clear_refs``),
    so that importing torch does not hide the aggregation's peak; returns the level to subtract."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return peak_rss_bytes()
    return peak_rss_bytes()


def relative_distance(weights: Any, clean: Any, start: Any) -> float:
    return float((weights - clean).norm() / (clean - start).norm())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sites", type=int, default=None, help="N sites (default 8; quick: 4)")
    parser.add_argument("--rounds", type=int, default=None, help="R rounds (default 8; quick: 3)")
    parser.add_argument("--inner-steps", type=int, default=None, help="H (default 5; quick: 4)")
    parser.add_argument("--numel", type=int, default=None, help="M values per update for the cost part (default 4M)")
    parser.add_argument("--quick", action="store_true", help="a smoke run well under a minute")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for robust.{md,json}")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sites = args.sites or (4 if args.quick else 8)
    rounds = args.rounds or (3 if args.quick else 8)
    inner_steps = args.inner_steps or (4 if args.quick else 5)
    numel = args.numel or ((1 << 20) if args.quick else (1 << 22))
    if min(sites, rounds, inner_steps, numel) < 1 or sites < 4:
        parser.error("--sites must be >= 4 (the trimmed mean drops 25% per end) and the rest >= 1")

    if args.child is not None:
        print(json.dumps(aggregation_child(args.child, sites, numel)))
        return 0

    import torch

    torch.set_num_threads(1)  # a 1.7K-parameter model: threads only add contention on a shared machine
    simulate({}, None, sites=sites, rounds=1, inner_steps=1)  # warm-up: lazy initialisation off the clock
    runs: dict[tuple[str, str], dict[str, Any]] = {}
    for option, keys in OPTIONS.items():
        for attack, spec in ATTACKS.items():
            print(f"{option} / {attack} ...", file=sys.stderr, flush=True)
            runs[(option, attack)] = simulate(keys, spec, sites=sites, rounds=rounds, inner_steps=inner_steps)
    reference = runs[("mean", "clean")]
    clean, start = reference["weights"], reference["start"]

    costs: dict[str, dict[str, Any]] = {}
    for option in [*OPTIONS, *OPTIONS]:  # twice, interleaved: load that comes and goes hits all alike
        command = [sys.executable, str(Path(__file__).resolve()), "--child", option,
                   "--sites", str(sites), "--numel", str(numel)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            raise SystemExit(f"the {option} aggregation run failed with exit status {done.returncode}")
        cost = json.loads(done.stdout.strip().splitlines()[-1])
        if option not in costs or cost["seconds"] < costs[option]["seconds"]:
            costs[option] = cost

    lines = [
        f"MLP workload, {sites} non-IID sites, DiLoCo H={inner_steps}, {rounds} rounds, uplink fp32, "
        f"seed 0; site {sites - 1} poisoned in the attack columns. Distance: ||θ − θ_clean|| / "
        "||θ_clean − θ_0|| from the clean plain-mean run (1.0 = as far as the clean run travelled).",
        "",
        "| aggregation | " + " | ".join(f"{a}: loss / distance" for a in ATTACKS) + " |",
        "|---|" + "---:|" * len(ATTACKS),
    ]
    results = []
    for option in OPTIONS:
        cells = []
        for attack in ATTACKS:
            run = runs[(option, attack)]
            distance = relative_distance(run["weights"], clean, start)
            cells.append(f"{run['eval_loss']:.4f} / {distance:.3f}")
            results.append({"option": option, "attack": attack, "eval_loss": run["eval_loss"],
                            "distance": distance, "round_s": run["round_s"]})
        lines.append(f"| {option} | " + " | ".join(cells) + " |")
    base_cost = costs["mean"]
    lines += [
        "",
        f"Cost on the clean run. Simulated round: real seconds per round (all {sites} sites train "
        f"in turn). Aggregation only: {sites} updates of {numel:,} fp32 values ({numel * 4 / 2**20:.0f} "
        "MiB each), add + take_result, 1 thread, fastest of 2 x 3; held: the aggregation's buffers at "
        "the close; peak: RSS above the level before the first update.",
        "",
        "| aggregation | s per simulated round | vs mean | aggregation s | vs mean | held at the close | "
        "peak memory | vs mean |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for option in OPTIONS:
        round_s = runs[(option, "clean")]["round_s"]
        cost = costs[option]
        lines.append(
            f"| {option} | {round_s:.3f} | {round_s / reference['round_s']:.2f}x | {cost['seconds']:.3f} | "
            f"{cost['seconds'] / base_cost['seconds']:.1f}x | {cost['held_bytes'] / 2**20:.0f} MiB | "
            f"{cost['peak_above_bytes'] / 2**20:.0f} MiB | "
            f"{cost['peak_above_bytes'] / max(base_cost['peak_above_bytes'], 1):.1f}x |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "robust-quick" if args.quick else "robust"
    (args.out / f"{stem}.md").write_text(text)
    (args.out / f"{stem}.json").write_text(json.dumps({
        "platform": platform.platform(), "sites": sites, "rounds": rounds, "inner_steps": inner_steps,
        "numel": numel, "runs": results, "aggregation_costs": costs,
    }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

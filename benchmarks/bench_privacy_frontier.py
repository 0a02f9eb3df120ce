"""The privacy-utility frontier: final eval loss against epsilon for 64 to 1,024 sites per round.

    python benchmarks/bench_privacy_frontier.py [--out runs/privacy_frontier] [--jobs 2]
        [--plot docs/privacy_frontier.png]

Three sweeps of ``scenarios/privacy_frontier.toml`` through the sweep runner (``geoloco.scenarios
.sweep.sweep``, the same as ``geoloco sweep``), one seed each:

1. **frontier**: sites per round x noise multiplier x clip, on exact sums with central Gaussian
   noise (secure aggregation off: the simulator's protocol costs O(sites^2) signature checks a
   round, too slow for 1,024 sites here);
2. **no DP**: the same site counts without noise or clipping (the loss privacy is measured against);
3. **secure**: 64 sites with secure aggregation and distributed (Skellam) noise, noise multiplier
   x clip as in (1), to check that (1) stands for what the secure runs release.

Prints the markdown tables (per point: loss, epsilon at delta 1e-5, the loss cost against no DP)
and draws loss against epsilon, one line per site count (the best clip at each noise multiplier),
with each count's no-DP loss as a dotted line. Finished runs are reused (the sweeps resume).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from geoloco.scenarios.sweep import PointSummary, SweepResult, sweep

BASE = Path(__file__).resolve().parent.parent / "scenarios" / "privacy_frontier.toml"
SITES = ("64", "256", "1024")
NOISE = ("0.7", "1.5", "3")
CLIPS = ("0.1", "0.5")
EXACT_SUMS = ("privacy.secure_aggregation=false", "privacy.dp=central")
NO_DP = ("privacy.secure_aggregation=false", "privacy.dp=off")


def _loss(p: PointSummary) -> float:
    stat = p.stat("final_eval_loss")
    return float("nan") if stat is None else stat[0]


def _epsilon(p: PointSummary) -> float:
    stat = p.stat("epsilon")
    return float("nan") if stat is None else stat[0]


def frontier_rows(frontier: SweepResult, baseline: dict[str, float]) -> list[str]:
    """Markdown rows: sites, noise multiplier, clip, epsilon, loss, loss cost against no DP."""
    rows = ["| sites | noise multiplier | clip | epsilon (delta 1e-5) | final eval loss | vs no DP |",
            "|---:|---:|---:|---:|---:|---:|"]
    for p in frontier.points:
        point = dict(p.point)
        sites = point["sites.count"]
        loss = _loss(p)
        cost = 100 * (loss / baseline[sites] - 1)
        rows.append(f"| {sites} | {point['privacy.noise_multiplier']} | {point['privacy.clip_norm']} | "
                    f"{_epsilon(p):.1f} | {loss:.4f} | {cost:+.1f} % |")
    return rows


def best_per_noise(frontier: SweepResult, sites: str) -> list[tuple[float, float, str]]:
    """``(epsilon, loss, clip)`` of the best clip at each noise multiplier for ``sites``."""
    best: dict[str, tuple[float, float, str]] = {}
    for p in frontier.points:
        point = dict(p.point)
        if point["sites.count"] != sites:
            continue
        z, loss = point["privacy.noise_multiplier"], _loss(p)
        if z not in best or loss < best[z][1]:
            best[z] = (_epsilon(p), loss, point["privacy.clip_norm"])
    return sorted(best.values())


def plot(frontier: SweepResult, baseline: dict[str, float], secure: SweepResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, sites in enumerate(SITES):
        colour = f"C{k}"
        points = best_per_noise(frontier, sites)
        ax.plot([e for e, _, _ in points], [loss for _, loss, _ in points], "o-", color=colour,
                label=f"{sites} sites per round (best clip)")
        ax.axhline(baseline[sites], color=colour, linestyle=":", linewidth=1)
    secure_points = best_per_noise(secure, "64")
    ax.plot([e for e, _, _ in secure_points], [loss for _, loss, _ in secure_points], "x--", color="C0",
            markersize=8, label="64 sites, secure aggregation + Skellam noise (best clip)")
    ax.axvline(8.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("epsilon at delta 1e-5, whole run (5 rounds)")
    ax.set_ylabel("final eval loss")
    ax.set_title("Privacy-utility frontier, MLP (1,732 parameters)\n(dotted: each site count without DP)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/privacy_frontier"))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--plot", type=Path, default=Path("docs/privacy_frontier.png"))
    args = parser.parse_args()
    started = time.perf_counter()
    grid = {"privacy.noise_multiplier": NOISE, "privacy.clip_norm": CLIPS}
    frontier = sweep(BASE, grid={"sites.count": SITES, **grid}, overrides=EXACT_SUMS,
                     out=args.out / "frontier", jobs=args.jobs, plots=False)
    no_dp = sweep(BASE, grid={"sites.count": SITES}, overrides=NO_DP, out=args.out / "no_dp",
                  jobs=args.jobs, plots=False)
    secure = sweep(BASE, grid={"sites.count": ("64",), **grid}, out=args.out / "secure", jobs=args.jobs,
                   plots=False)
    elapsed = time.perf_counter() - started
    baseline = {dict(p.point)["sites.count"]: _loss(p) for p in no_dp.points}
    print("\n".join(frontier_rows(frontier, baseline)))
    print()
    print("| sites | no DP: final eval loss |\n|---:|---:|")
    for sites in SITES:
        print(f"| {sites} | {baseline[sites]:.4f} |")
    print()
    print("Secure aggregation + distributed DP, 64 sites, against exact sums + central noise:")
    print("| noise multiplier | clip | secure: epsilon | secure: loss | exact sums: epsilon | exact sums: loss |")
    print("|---:|---:|---:|---:|---:|---:|")
    exact = {(dict(p.point)["privacy.noise_multiplier"], dict(p.point)["privacy.clip_norm"]): p
             for p in frontier.points if dict(p.point)["sites.count"] == "64"}
    for p in secure.points:
        point = dict(p.point)
        twin = exact[(point["privacy.noise_multiplier"], point["privacy.clip_norm"])]
        print(f"| {point['privacy.noise_multiplier']} | {point['privacy.clip_norm']} | {_epsilon(p):.2f} | "
              f"{_loss(p):.4f} | {_epsilon(twin):.2f} | {_loss(twin):.4f} |")
    plot(frontier, baseline, secure, args.plot)
    runs = sum(r.ran for r in (frontier, no_dp, secure))
    print(f"\n{runs} runs in {elapsed:.0f} s (others reused); plot: {args.plot}")


if __name__ == "__main__":
    main()

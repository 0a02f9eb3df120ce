"""SparseLoCo as its authors run it against the earlier tiles variant and DiLoCo, over many rounds.

    OMP_NUM_THREADS=1 python benchmarks/bench_sparseloco.py --seeds 0,1,2 --jobs 2 --out runs/sparseloco

Issue #27: the headline (``bench_headline.py``) runs SparseLoCo for 10 rounds, far from the paper's
regime of many rounds. Every row here is one ``geoloco sweep`` of ``scenarios/headline.toml``
(the tiny GPT, 4 non-IID sites) with ``REGIME`` (more, shorter rounds) and the row's overrides,
into ``OUT/<row>/`` (resumable). All rows train the same inner steps per site on the same batches.
The table gives the final eval loss as the seed mean with its 95 % Student t-interval
(``geoloco.scenarios.sweep_stats``), the paired differences against DiLoCo and against the
earlier tiles variant (same seed, same batches, so most seed noise cancels), and the uplink
bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from geoloco.algorithms.algorithm_config import PRESETS
from geoloco.scenarios.progress import human_bytes
from geoloco.scenarios.sweep import parse_seeds, sweep
from geoloco.scenarios.sweep_stats import SeedStats, paired_difference, seed_stats

BASE = Path(__file__).resolve().parent.parent / "scenarios" / "headline.toml"

REGIME = ["algorithm.inner_steps=10", "run.total_inner_steps=2000", "run.eval_every_steps=250"]
"""H = 10 inner steps, 200 rounds per run (the headline: H = 50, 10 rounds)."""

OUTER_SGD = ["outer_optimizer.name=sgd", "outer_optimizer.lr=1.0", "outer_optimizer.momentum=0.0"]
"""SparseLoCo's outer step, spelled out because the base file names Nesterov."""


def _preset(name: str) -> list[str]:
    """A preset's keys as overrides: the base file sets ``uplink_codec`` itself, so the preset
    would not fill it in."""
    keys = [
        f"algorithm.{key}={str(value).lower() if isinstance(value, bool) else value}"
        for key, value in PRESETS[name].items()
    ]
    return [f"algorithm.name={name}", *keys, *OUTER_SGD]


ROWS: dict[str, tuple[str, list[str]]] = {
    "diloco": ("DiLoCo, dense fp32, outer Nesterov lr 0.7 m 0.9 (paper)", []),
    "sparseloco": (
        "SparseLoCo (authors'): `tiletopk:0.015625,tile=64,divisors\\|int2mean`, EF 0.95, median-norm clip, SGD lr 1",
        _preset("sparseloco"),
    ),
    "sparseloco-k16": (
        "(sparseloco) keeping 16 per chunk: `tiletopk:0.00390625,tile=64,divisors\\|int2mean`, 1.8 % of this model",
        [*_preset("sparseloco"), "algorithm.uplink_codec=tiletopk:0.00390625,tile=64,divisors|int2mean"],
    ),
    "sparseloco-tiles": (
        "SparseLoCo tiles (earlier preset): `tiletopk:0.03,tile=64\\|int2`, EF 0.95, SGD lr 1",
        _preset("sparseloco-tiles"),
    ),
}
"""Row key -> (what it is, its ``--set`` overrides on top of ``REGIME``). DiLoCo is first: the
others are paired against it."""


def run_rows(seeds: list[int], jobs: int, out: Path) -> dict[str, dict[str, Any]]:
    """Sweep each row (resuming) and return its per-seed final eval loss, bytes and time."""
    rows: dict[str, dict[str, Any]] = {}
    for key, (_, overrides) in ROWS.items():
        result = sweep(BASE, seeds=seeds, overrides=[*REGIME, *overrides], out=out / key, jobs=jobs, plots=False)
        point = result.points[0]
        finished = [r for r in point.runs if r.totals.get("final_eval_loss") is not None]
        rows[key] = {
            "loss": {int(r.config["simulation"]["seed"]): float(r.totals["final_eval_loss"]) for r in finished},
            "bytes_up": [float(r.totals["bytes_up"]) for r in finished],
            "time_s": [float(r.totals["time_s"]) for r in finished],
            "failed": point.failed,
        }
    return rows


def _interval(stats: SeedStats | None, fmt: str = "{:.4f}") -> str:
    if stats is None:
        return "n/a"
    if stats.ci_low is None or stats.ci_high is None:
        return f"{fmt.format(stats.mean)} (one seed)"
    half = (stats.ci_high - stats.ci_low) / 2
    return f"{fmt.format(stats.mean)} ± {fmt.format(half)} [{fmt.format(stats.ci_low)}, {fmt.format(stats.ci_high)}]"


def table(rows: dict[str, dict[str, Any]]) -> str:
    baseline = rows["diloco"]
    dense = statistics.fmean(baseline["bytes_up"])
    lines = [
        "| row | configuration | seeds | eval loss @T, mean ± 95 % CI [interval] "
        "| minus DiLoCo, paired | minus sparseloco-tiles, paired | uplink bytes | fewer than DiLoCo |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key, row in rows.items():
        stats = seed_stats(list(row["loss"].values()))
        paired = "—" if key == "diloco" else _interval(paired_difference(row["loss"], baseline["loss"]).stats)
        tiles = rows["sparseloco-tiles"]["loss"]
        vs_tiles = (
            "—" if key in ("diloco", "sparseloco-tiles") else _interval(paired_difference(row["loss"], tiles).stats)
        )
        sent = statistics.fmean(row["bytes_up"]) if row["bytes_up"] else float("nan")
        lines.append(
            f"| {key} | {ROWS[key][0]} | {len(row['loss'])} | {_interval(stats)} | {paired} | {vs_tiles} "
            f"| {human_bytes(sent)} | {dense / sent:.1f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/sparseloco"))
    args = parser.parse_args()
    rows = run_rows(parse_seeds(args.seeds), args.jobs, args.out)
    print(table(rows))
    (args.out / "sparseloco.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()

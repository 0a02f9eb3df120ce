"""``geoloco sweep``: a grid of simulator runs over several seeds, resumable, with table and plots.

    geoloco sweep base.toml --grid algorithm.inner_steps=10,25,50 \\
        --grid algorithm.uplink_codec=none,int8,'topk:0.01|int4' --seeds 0,1,2 --jobs 2 --out DIR

The same from Python: ``geoloco.scenarios.sweep.sweep``. See that module for the folder layout;
``--ray ADDRESS`` runs on a Ray cluster instead (``geoloco.scenarios.sweep_ray``).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from geoloco.scenarios.config_file import ConfigFileError, positive_int, report_config_error
from geoloco.scenarios.overrides import add_set_argument
from geoloco.scenarios.plugins import add_plugin_argument
from geoloco.scenarios.sweep_export import EXPORT_FORMATS

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "sweep",
        help="run a grid of simulations over several seeds; table, Pareto and loss plots",
        description=(
            "Run `geoloco simulate` for every combination of the --grid values and every seed, "
            "in parallel processes. A finished run is never run again (rerun the same command to "
            "resume). Writes DIR/runs/<run>/ (one simulate run folder each), DIR/table.md (mean "
            "and min..max over seeds), DIR/stats.md (per point: n, mean, std and a 95% t-interval "
            "over seeds; with --baseline, paired differences per seed), DIR/summary.json (the same "
            "under labelled keys), DIR/pareto.png (final loss vs uplink bytes, with the Pareto "
            "front) and DIR/loss_vs_{steps,bytes,time}.png."
        ),
    )
    parser.add_argument("config", type=Path, help="base simulate TOML file (see simulate.toml)")
    parser.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="a swept key and its values, as for --set (algorithm.inner_steps=10,25,50); a TOML "
        "array when a value holds a comma (algorithm.uplink_codec='[\"int4:block=128,stochastic\"]'); "
        "repeat for more axes (every combination runs)",
    )
    parser.add_argument("--seeds", default="0", help="simulation seeds: 0,1,2 or 0-4 (default: %(default)s)")
    parser.add_argument(
        "--jobs", type=positive_int,
        help="runs in parallel (default: 1 here; with --ray, as many as the cluster has free CPUs)",
    )
    parser.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run on a Ray cluster (needs `pip install 'geoloco[ray]'`): auto (the running "
        "cluster), local (start one on this machine), HOST:PORT or ray://HOST:PORT. Workers send "
        "results back and this process writes --out, so no shared file system is needed",
    )
    parser.add_argument("--out", type=Path, required=True, help="sweep folder (reused to resume)")
    parser.add_argument("--no-plots", action="store_true", help="write the table only")
    parser.add_argument(
        "--tensorboard", action="store_true",
        help="also write each run's scalars as TensorBoard events into DIR/runs/<run>/tensorboard "
        "(view them all with `tensorboard --logdir DIR/runs`); needs `pip install 'geoloco[tensorboard]'`",
    )
    parser.add_argument(
        "--target-loss",
        type=float,
        metavar="LOSS",
        help="also tabulate, per point, the inner steps, uplink bytes and virtual time until the "
        "eval loss first reached LOSS (over the seeds that reached it)",
    )
    parser.add_argument(
        "--baseline",
        metavar="POINT",
        help="compare every point with this one, seed by seed: its label as the table prints it "
        "('inner_steps=10 uplink_codec=none') or KEY=VALUE pairs naming one point "
        "('uplink_codec=none' when that leaves one); adds paired differences (mean and 95%% "
        "t-interval of point minus baseline over the baseline's seeds) to DIR/stats.md and DIR/summary.json",
    )
    parser.add_argument(
        "--export",
        action="append",
        default=[],
        choices=EXPORT_FORMATS,
        help="also write the runs (one row per run: point, seed, totals) and their per-round "
        "records as DIR/runs.FORMAT and DIR/curves.FORMAT; parquet needs `pip install "
        "'geoloco[analysis]'` (pandas, pyarrow); repeat for both. On a finished sweep, rerun "
        "the same command with --export: nothing runs again",
    )
    add_set_argument(parser)
    add_plugin_argument(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ConfigFileError as err:
        return report_config_error("sweep", err)


def _run(args: argparse.Namespace) -> int:
    from geoloco.scenarios.sweep import parse_grid, parse_seeds, sweep

    axes = [parse_grid(text) for text in args.grid]
    result = sweep(
        args.config, grid=axes, seeds=parse_seeds(args.seeds), overrides=args.overrides,
        out=args.out, jobs=args.jobs, ray_address=args.ray, plots=not args.no_plots,
        target_loss=args.target_loss, tensorboard=args.tensorboard, plugins=args.plugins,
        baseline=args.baseline, export=list(dict.fromkeys(args.export)),
    )
    print(f"geoloco sweep: {result.ran} runs ran, {result.resumed} were already finished, {result.failed} failed")
    print(result.table())
    paired = result.paired_table()
    if paired is not None:
        print()
        print(paired)
    print("files: " + ", ".join(str(p) for p in result.files))
    return 1 if result.failed else 0

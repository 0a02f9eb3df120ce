"""``geoloco tune``: search a few continuous knobs of a simulate config with optuna, pruning bad
trials on their intermediate eval losses.

    geoloco tune scenarios/sweep.toml --param outer_optimizer.lr=0.1:1.0:log \\
        --param outer_optimizer.momentum=0.5:0.95 --trials 20 --out runs/tune

See ``geoloco.scenarios.tune`` for the search, the pruning and the folder layout.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from geoloco.scenarios.config_file import ConfigFileError, positive_int, report_config_error
from geoloco.scenarios.overrides import add_set_argument
from geoloco.scenarios.plugins import add_plugin_argument


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "tune",
        help="tune a few continuous knobs (outer lr, momentum, error-feedback decay) with optuna",
        description=(
            "Search the --param ranges with optuna (seeded TPE sampler) for the lowest final eval "
            "loss, one simulate run per trial. Each evaluation is reported to the trial and the "
            "pruner stops trials that fall behind the earlier ones at the same inner step. Rerun the "
            "same command to resume. Writes DIR/best.json, DIR/trials.md, DIR/tune.png, "
            "DIR/trials/NNN/ (run folders) and DIR/study.db. Needs `pip install 'geoloco[optuna]'`."
        ),
    )
    parser.add_argument("config", type=Path, help="base simulate TOML file (see simulate.toml)")
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        required=True,
        metavar="KEY=LOW:HIGH[:log][:int]",
        help="a tuned key and its range, dotted as for --set (outer_optimizer.lr=0.1:1.0:log, "
        "algorithm.error_feedback_decay=0.8:1.0); repeat for more keys",
    )
    parser.add_argument("--trials", type=positive_int, required=True, help="finished trials wanted in DIR")
    parser.add_argument("--out", type=Path, required=True, help="study folder (reused to resume)")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed (default: %(default)s)")
    parser.add_argument(
        "--pruner", choices=["median", "none"], default="median",
        help="median: stop a trial whose eval loss is worse than the median of earlier trials at "
        "the same step (after 2 trials); none: run every trial to the end (default: %(default)s)",
    )
    parser.add_argument("--no-plots", action="store_true", help="write the table and best.json only")
    add_set_argument(parser)
    add_plugin_argument(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ConfigFileError as err:
        return report_config_error("tune", err)


def _run(args: argparse.Namespace) -> int:
    from geoloco.scenarios.tune import parse_param, tune

    params = [parse_param(text) for text in args.param]
    result = tune(
        args.config, params=params, trials=args.trials, out=args.out, overrides=args.overrides,
        seed=args.seed, pruner=args.pruner, plots=not args.no_plots, plugins=args.plugins,
    )
    pruned = sum(1 for t in result.trials if t.state == "pruned")
    print(f"geoloco tune: {result.ran} trials ran, {result.resumed} were already finished, {pruned} pruned in all")
    print(result.table())
    if result.best is not None:
        best = " ".join(f"--set {p.key}={p.value_text(result.best.params[p.key])}" for p in params)
        print(f"best: trial {result.best.number}, final eval loss {result.best.value:.4f}: {best}")
    print("files: " + ", ".join(str(p) for p in result.files))
    return 0 if result.best is not None else 1

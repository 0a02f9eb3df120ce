"""Sweeps: one base simulate config, a grid of overrides, several seeds, one folder of results.

A grid point is a set of ``--set`` overrides (``geoloco.scenarios.overrides``) applied to the
base config, so every key of a simulate file can be swept with the checks and error messages of
``geoloco simulate``. Each (point, seed) is one run folder (``geoloco.scenarios.research``) named
by its overrides and a hash of the base config and the overrides: a folder whose summary exists
is a finished run and is never run again, so an interrupted sweep resumes where it stopped, and
a changed base config gets new folders instead of stale results. The hash also covers what the
config's text does not say (``research.run_identity``): the torch thread count the run computes
with, the source of its plug-ins and a workload object, so a resumed sweep never mixes runs of
two thread counts or of two versions of a plug-in.

Runs go through a backend (``BACKENDS``): in this process (``jobs = 1``), in a pool of worker
processes, or on a Ray cluster (``geoloco.scenarios.sweep_ray``: the workers send each run's
records back and this process writes the folder, so the cluster needs no shared file system).
A backend only has to turn ``RunTask`` objects into finished run folders.

The results: ``table.md`` (mean and min..max over seeds), ``stats.md`` (per point and metric:
n, mean, sample std and a 95 % t-interval over the seeds; with a ``baseline`` point, each
point's paired differences against it, seed by seed: ``geoloco.scenarios.sweep_stats``),
``summary.json`` (the same numbers under labelled keys, ``SWEEP_SUMMARY_FORMAT``), the plots
(``geoloco.scenarios.sweep_plots``) and, on request, the runs and their per-round records as CSV
or Parquet tables (``geoloco.scenarios.sweep_export``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import re
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from geoloco.scenarios.config_file import COMMAND_LINE, ConfigFileError
from geoloco.scenarios.config_kinds import SIMULATE, read_config
from geoloco.scenarios.overrides import parse_override, parse_value
from geoloco.scenarios.plugins import workload_identity
from geoloco.scenarios.progress import human_bytes
from geoloco.scenarios.research import (
    ResearchConfig,
    RunResult,
    is_finished,
    prepare_run,
    require_tensorboard,
    run_identity,
    with_plugins,
)
from geoloco.scenarios.sweep_export import EXPORT_FORMATS, Table, curve_table, missing_for, run_table
from geoloco.scenarios.sweep_plots import PARETO_OBJECTIVES, pareto_indices
from geoloco.scenarios.sweep_stats import CONFIDENCE, PairedDifference, SeedStats, paired_difference, seed_stats
from geoloco.scenarios.sweep_tasks import Backend, BackendOptions, RunTask, run_in_processes

__all__ = [
    "BACKENDS",
    "BackendOptions",
    "GridAxis",
    "PointSummary",
    "RunTask",
    "SweepResult",
    "expand_grid",
    "find_point",
    "parse_grid",
    "parse_seeds",
    "sweep",
]

logger = logging.getLogger(__name__)

RUNS_DIR = "runs"
ERROR_FILE = "error.txt"
SWEEP_FILE = "sweep.json"
TABLE_FILE = "table.md"
STATS_FILE = "stats.md"
SUMMARY_FILE = "summary.json"
TENSORBOARD_DIR = "tensorboard"
RUNS_TABLE = "runs"
CURVES_TABLE = "curves"
SWEEP_SUMMARY_FORMAT = 2
"""Version of the sweep's ``summary.json`` layout. 2 added ``format``, ``confidence``,
``baseline``, ``pareto_objectives`` and, per point, ``stats``, ``values``, ``on_pareto_front``,
``is_baseline`` and ``vs_baseline``; a summary without ``format`` is layout 1, whose keys 2 keeps
unchanged (``points[].final_eval_loss`` and the other totals as ``[mean, min, max]``)."""

METRICS = ("final_eval_loss", "bytes_up", "bytes_down", "time_s", "inner_steps", "epsilon")
"""The run totals a point summarizes over its seeds (``RunResult.totals`` keys)."""
METRIC_LABELS = {
    "final_eval_loss": "final eval loss", "bytes_up": "uplink bytes", "bytes_down": "downlink bytes",
    "time_s": "virtual time (s)", "inner_steps": "inner steps", "epsilon": "epsilon",
}
METRIC_FORMATS: dict[str, str | None] = {
    "final_eval_loss": "{:.4g}", "bytes_up": None, "bytes_down": None, "time_s": "{:.4g}",
    "inner_steps": "{:.0f}", "epsilon": "{:.3g}",
}
"""How ``stats.md`` shows each metric (``None``: ``human_bytes``); ``summary.json`` keeps full precision."""


# -- the grid --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GridAxis:
    """One swept key and its values, as ``--set`` value texts."""

    key: str
    values: tuple[str, ...]


def parse_grid(text: str) -> GridAxis:
    """``KEY=V1,V2,...`` (or ``KEY=[TOML array]`` when a value holds a comma, such as
    ``int4:block=128,stochastic``) into an axis."""
    key, value_text = parse_override(text)
    if value_text.startswith("["):
        try:
            items = parse_value(value_text, strict=True)
        except ValueError as err:
            raise ConfigFileError(COMMAND_LINE, "--grid", f"{key}: bad TOML array {value_text!r}: {err}") from None
        values = tuple(_value_text(v) for v in items)
    else:
        values = tuple(v.strip() for v in value_text.split(","))
    if not values or any(v == "" for v in values):
        raise ConfigFileError(
            COMMAND_LINE, "--grid", f"expected KEY=V1,V2,... with non-empty values, got {text!r}"
        )
    if len(set(values)) != len(values):
        raise ConfigFileError(COMMAND_LINE, "--grid", f"{key}: a value is listed twice in {text!r}")
    return GridAxis(key, values)


def _value_text(value: Any) -> str:
    """A Python value as ``--set`` text: strings as typed, the rest as TOML literals."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)


def parse_seeds(text: str) -> list[int]:
    """``0,1,2`` or ``0-4`` (inclusive) into seeds."""
    try:
        if re.fullmatch(r"\s*\d+\s*-\s*\d+\s*", text):
            lo, hi = (int(p) for p in text.split("-"))
            seeds = list(range(lo, hi + 1))
        else:
            seeds = [int(p) for p in text.split(",")]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigFileError(COMMAND_LINE, "--seeds", f"expected distinct integers like 0,1,2 or 0-4, got {text!r}")
    return seeds


def expand_grid(axes: Sequence[GridAxis]) -> list[tuple[tuple[str, str], ...]]:
    """Every combination of the axes' values, as ``((key, value), ...)`` in axis order (the
    first axis varies slowest); no axes: one empty point."""
    keys = [a.key for a in axes]
    if len(set(keys)) != len(keys):
        raise ConfigFileError(COMMAND_LINE, "--grid", f"a key is swept twice: {keys}")
    return [tuple(zip(keys, combo, strict=True)) for combo in itertools.product(*(a.values for a in axes))]


def point_label(point: Sequence[tuple[str, str]]) -> str:
    """Short human label: the last part of each key and its value (``inner_steps=10 uplink_codec=int8``)."""
    return " ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in point) or "base"


def find_point(
    points: Sequence[Sequence[tuple[str, str]]], spec: str | Mapping[str, Any], key: str = "--baseline"
) -> int:
    """The index of the one point ``spec`` names: its label (``inner_steps=10 uplink_codec=none``,
    ``base`` without a grid), or ``KEY=VALUE`` pairs (space-separated text, or a mapping) whose
    keys are swept keys, dotted or by their last part. Pairs may name fewer keys than are swept
    when that leaves one point. Anything else: ``ConfigFileError`` on ``key`` listing the points."""
    labels = [point_label(p) for p in points]
    listing = "; ".join(repr(label) for label in labels)
    if isinstance(spec, str) and labels.count(spec) == 1:
        return labels.index(spec)
    if isinstance(spec, str):
        pairs: list[tuple[str, str]] = []
        for word in spec.split():
            name, sep, value = word.partition("=")
            if not sep or not name:
                raise ConfigFileError(
                    COMMAND_LINE, key,
                    f"{spec!r} is neither a point's label nor KEY=VALUE pairs; the points: {listing}",
                )
            pairs.append((name, value))
    else:
        pairs = [(name, _value_text(value)) for name, value in spec.items()]
    if not pairs:
        raise ConfigFileError(COMMAND_LINE, key, f"names no point; the points: {listing}")
    swept = {k for p in points for k, _ in p}
    for name, _ in pairs:
        if not any(name in (k, k.rsplit(".", 1)[-1]) for k in swept):
            raise ConfigFileError(
                COMMAND_LINE, key, f"{name} is not a swept key; swept: {', '.join(sorted(swept)) or 'none'}"
            )
    matches = [
        i for i, p in enumerate(points)
        if all(any(name in (k, k.rsplit(".", 1)[-1]) and _same_value(v, value) for k, v in p) for name, value in pairs)
    ]
    if len(matches) != 1:
        found = "no point" if not matches else f"{len(matches)} points ({'; '.join(labels[i] for i in matches)})"
        raise ConfigFileError(
            COMMAND_LINE, key, f"{spec!r} matches {found}; name one of: {listing}"
        )
    return matches[0]


def _same_value(a: str, b: str) -> bool:
    """Two ``--set`` value texts that mean the same value (``0.10`` and ``0.1``; ``1`` is not ``true``)."""
    if a == b:
        return True
    x, y = parse_value(a), parse_value(b)
    if isinstance(x, bool) or isinstance(y, bool):
        return x is y
    return bool(x == y)


def _slug(point: Sequence[tuple[str, str]], seed: int) -> str:
    text = "_".join(f"{k.rsplit('.', 1)[-1]}-{v}" for k, v in point)
    text = re.sub(r"[^A-Za-z0-9.=-]+", "_", text).strip("_")[:80]
    return f"{text}_seed-{seed}" if text else f"seed-{seed}"


# -- tasks and backends ----------------------------------------------------------------------------


def run_on_ray(tasks: Sequence[RunTask], options: BackendOptions) -> Iterator[tuple[Path, str | None]]:
    """Backend ``"ray"`` (``geoloco.scenarios.sweep_ray``, imported only when used)."""
    from geoloco.scenarios.sweep_ray import run_on_ray as run_tasks

    yield from run_tasks(tasks, options)


BACKENDS: dict[str, Backend] = {"local": run_in_processes, "ray": run_on_ray}
"""Backend name -> function running tasks (finished folders, or errors) in completion order."""


# -- results ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class PointSummary:
    """One grid point over its seeds."""

    point: tuple[tuple[str, str], ...]
    runs: list[RunResult] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    """Seeds whose run failed (see the run folder's ``error.txt``)."""

    @property
    def label(self) -> str:
        return point_label(self.point)

    def _values(self, key: str) -> list[float]:
        return [float(r.totals[key]) for r in self.runs if r.totals[key] is not None]

    def stat(self, key: str) -> tuple[float, float, float] | None:
        """``(mean, min, max)`` of a total (``final_eval_loss``, ``bytes_up``, ``time_s``, ...)
        over the seeds; ``None`` without finished runs."""
        values = self._values(key)
        if not values:
            return None
        return statistics.fmean(values), min(values), max(values)

    def seed_values(self, key: str) -> dict[int, float]:
        """Seed -> the total ``key`` of that seed's finished run (runs without a value left out):
        what paired differences pair by."""
        return {
            int(r.config["simulation"]["seed"]): float(r.totals[key]) for r in self.runs if r.totals[key] is not None
        }

    def stats(self, key: str, confidence: float = CONFIDENCE) -> SeedStats | None:
        """n, mean, sample std and the t-interval of the mean of a total over the seeds
        (``geoloco.scenarios.sweep_stats.seed_stats``); ``None`` without a value."""
        return seed_stats(self._values(key), confidence)

    def to_target(self, loss: float) -> dict[str, tuple[float, float, float] | None]:
        """``(mean, min, max)`` over the seeds that reached eval ``loss`` of the inner steps, uplink
        bytes and virtual time it took them (``None`` where no seed reached it)."""
        reached: dict[str, list[float]] = {"steps": [], "bytes_up": [], "time_s": []}
        for r in self.runs:
            steps, sent, took = r.steps_to(loss), r.bytes_to(loss), r.time_to(loss)
            if steps is not None and sent is not None and took is not None:
                reached["steps"].append(steps)
                reached["bytes_up"].append(sent)
                reached["time_s"].append(took)
        return {
            key: (statistics.fmean(v), min(v), max(v)) if v else None for key, v in reached.items()
        }

    def reached(self, loss: float) -> int:
        """How many seeds' runs reached eval ``loss``."""
        return sum(1 for r in self.runs if r.steps_to(loss) is not None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "point": dict(self.point),
            "label": self.label,
            "seeds": [r.config.get("simulation", {}).get("seed") for r in self.runs],
            "failed_seeds": self.failed,
            "folders": [str(r.folder) for r in self.runs],
            **{key: self.stat(key) for key in METRICS},
            "stats": {key: None if (st := self.stats(key)) is None else st.to_dict() for key in METRICS},
            "values": {key: [r.totals[key] for r in self.runs] for key in METRICS},
        }


@dataclass(slots=True)
class SweepResult:
    """What ``sweep`` produced: per-point summaries, and how many runs it ran vs found done."""

    out: Path
    axes: list[GridAxis]
    seeds: list[int]
    points: list[PointSummary]
    ran: int = 0
    resumed: int = 0
    failed: int = 0
    files: list[Path] = field(default_factory=list)
    target_loss: float | None = None
    """With a target, the table also says what reaching that eval loss cost each point."""
    baseline: int | None = None
    """Index in ``points`` of the point the others are compared with, seed by seed (``paired``)."""

    @property
    def baseline_point(self) -> PointSummary | None:
        return None if self.baseline is None else self.points[self.baseline]

    def paired(self, point: PointSummary, confidence: float = CONFIDENCE) -> dict[str, PairedDifference]:
        """Each metric of ``point`` minus the baseline's, paired by seed
        (``geoloco.scenarios.sweep_stats.paired_difference``): the mean difference over the
        baseline's seeds and its t-interval, or why the point is unpaired. Metrics that neither
        has (``epsilon`` without DP) are left out."""
        base = self.baseline_point
        if base is None:
            raise ValueError("this sweep has no baseline point: sweep(..., baseline=LABEL) or --baseline")
        result: dict[str, PairedDifference] = {}
        for key in METRICS:
            mine, reference = point.seed_values(key), base.seed_values(key)
            if not mine and not reference:
                continue
            diff = paired_difference(mine, reference, confidence)
            if diff.unpaired is not None and point.failed:
                failed = ", ".join(str(seed) for seed in point.failed)
                diff = replace(diff, unpaired=f"{diff.unpaired} (failed here: seed {failed}, see error.txt)")
            result[key] = diff
        return result

    def pareto_front(self) -> list[PointSummary]:
        """The points no other point beats on both mean uplink bytes and mean final eval loss
        (``PARETO_OBJECTIVES``; what ``pareto.png`` draws as its front), fewest bytes first."""
        return [self.points[i] for i in pareto_indices(self.points)]

    def summary(self) -> dict[str, Any]:
        """``summary.json`` (layout ``SWEEP_SUMMARY_FORMAT``): the counts, then per point its
        seeds and folders, ``[mean, min, max]`` of each total (layout 1's keys), ``stats`` (n,
        mean, std, ``ci_low``/``ci_high`` at ``confidence``), the per-seed ``values`` in the order
        of ``seeds``, ``on_pareto_front`` and, with a baseline, ``vs_baseline``: per metric the
        paired seeds, the ``difference`` statistics (point − baseline) or why it is ``unpaired``."""
        target = self.target_loss
        front = set(pareto_indices(self.points))
        base = self.baseline_point
        points = []
        for i, p in enumerate(self.points):
            entry = {**p.to_dict(), **({"to_target": p.to_target(target)} if target is not None else {})}
            entry["on_pareto_front"] = i in front
            entry["is_baseline"] = p is base
            entry["vs_baseline"] = (
                None if base is None or p is base else {k: d.to_dict() for k, d in self.paired(p).items()}
            )
            points.append(entry)
        return {
            "format": SWEEP_SUMMARY_FORMAT,
            "runs": len(self.points) * len(self.seeds), "ran": self.ran, "resumed": self.resumed,
            "failed": self.failed, "target_loss": target,
            "confidence": CONFIDENCE,
            "interval": "Student t: mean +- t(1 - (1 - confidence) / 2, n - 1) * std / sqrt(n), std with ddof=1",
            "baseline": None if base is None else base.label,
            "pareto_objectives": list(PARETO_OBJECTIVES),
            "points": points,
        }

    def stats_table(self) -> str:
        """``stats.md``: ``seeds_table`` and, with a baseline, ``paired_table``."""
        paired = self.paired_table()
        return self.seeds_table() + ("" if paired is None else "\n\n" + paired)

    def seeds_table(self) -> str:
        """Markdown: per point and metric the seeds counted, mean, sample std and the 95 %
        t-interval of the mean (metrics no run has, such as ``epsilon`` without DP, left out)."""
        pct = f"{CONFIDENCE * 100:g} %"
        metrics = [k for k in METRICS if any(p.stats(k) is not None for p in self.points)]
        header = ["point", "metric", "n", "mean", "std", f"{pct} interval"]
        lines = [f"## Over seeds: mean, sample std, {pct} t-interval of the mean", "",
                 "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for p in self.points:
            for key in metrics:
                st = p.stats(key)
                cells = [_label_cell(p.label), METRIC_LABELS[key]]
                cells += ["0", "n/a", "n/a", "n/a"] if st is None else [str(st.n), *_stats_cells(st, key)]
                lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def paired_table(self) -> str | None:
        """Markdown: per point and metric the mean difference to the baseline over its seeds,
        paired by seed, with the std and the 95 % t-interval of the differences, or why the point
        is unpaired; ``None`` without a baseline."""
        base = self.baseline_point
        if base is None:
            return None
        pct = f"{CONFIDENCE * 100:g} %"
        header = ["point", "metric", "seeds paired", "mean difference", "std", f"{pct} interval"]
        lines = [f"## Paired differences against {_label_cell(base.label)} (point − baseline, same seed)", "",
                 "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for p in self.points:
            if p is base:
                continue
            for key, diff in self.paired(p).items():
                cells = [_label_cell(p.label), METRIC_LABELS[key]]
                if diff.stats is None:
                    cells += ["0", f"unpaired: {diff.unpaired}", "n/a", "n/a"]
                else:
                    cells += [str(diff.stats.n), *_stats_cells(diff.stats, key, signed=True)]
                lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def runs_table(self) -> Table:
        """One row per finished run (``geoloco.scenarios.sweep_export.run_table``)."""
        return run_table(self.points)

    def curves_table(self) -> Table:
        """One row per round record of every finished run (``sweep_export.curve_table``)."""
        return curve_table(self.points)

    def to_dataframe(self, rows: Literal["runs", "curves"] = "runs") -> Any:
        """A ``pandas.DataFrame`` (needs the ``analysis`` extra): one row per run (``runs``), or
        one per round record of every run (``curves``)."""
        if rows not in ("runs", "curves"):
            raise ValueError(f"rows must be 'runs' or 'curves', got {rows!r}")
        return (self.runs_table() if rows == "runs" else self.curves_table()).to_dataframe()

    def export(self, formats: Sequence[str] = ("csv",)) -> list[Path]:
        """Write ``runs.<format>`` and ``curves.<format>`` into ``out`` for each of ``formats``
        (``EXPORT_FORMATS``: ``csv``, or ``parquet`` with the ``analysis`` extra); their paths."""
        written: list[Path] = []
        for fmt in formats:
            for name, table in ((RUNS_TABLE, self.runs_table()), (CURVES_TABLE, self.curves_table())):
                written.append(table.write(self.out / f"{name}.{fmt}", fmt))
        return written

    def table(self) -> str:
        """Markdown table: each point's final eval loss, uplink bytes and virtual time as mean
        and min..max over the seeds (and, with ``target_loss``, the inner steps, uplink bytes and
        virtual time to reach it, over the seeds that did). When any run accounted DP, an
        ``epsilon`` column gives the whole run's epsilon at ``privacy.delta``."""
        keys = [a.key.rsplit(".", 1)[-1] for a in self.axes]
        header = [*keys, "seeds", "final eval loss", "uplink bytes", "virtual time (s)", "inner steps"]
        private = any(p.stat("epsilon") is not None for p in self.points)
        if private:
            header.append("epsilon")
        target = self.target_loss
        if target is not None:
            header += [f"reached {target:g}", "steps to it", "uplink bytes to it", "virtual time to it (s)"]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for p in self.points:
            cells = [f"`{v}`".replace("|", "\\|") for _, v in p.point]  # a codec's | is no column
            seeds = f"{len(p.runs)}" + (f" ({len(p.failed)} failed)" if p.failed else "")
            cells += [
                seeds,
                _stat_text(p.stat("final_eval_loss"), "{:.4f}"),
                _stat_text(p.stat("bytes_up"), None),
                _stat_text(p.stat("time_s"), "{:.1f}"),
                _stat_text(p.stat("inner_steps"), "{:.0f}"),
            ]
            if private:
                cells.append(_stat_text(p.stat("epsilon"), "{:.3g}"))
            if target is not None:
                cost = p.to_target(target)
                cells += [
                    f"{p.reached(target)}/{len(p.runs)}",
                    _stat_text(cost["steps"], "{:.0f}"),
                    _stat_text(cost["bytes_up"], None),
                    _stat_text(cost["time_s"], "{:.1f}"),
                ]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _label_cell(label: str) -> str:
    return f"`{label}`".replace("|", "\\|")  # a codec's | is no column


def _stats_cells(st: SeedStats, key: str, *, signed: bool = False) -> list[str]:
    """``[mean, std, interval]`` cells of ``stats.md`` in the metric's format."""
    fmt = METRIC_FORMATS[key]
    plain: Callable[[float], str] = human_bytes if fmt is None else fmt.format

    def show(value: float) -> str:
        text = plain(value)
        return f"+{text}" if signed and value > 0 else text

    if st.std is None or st.ci_low is None or st.ci_high is None:
        return [show(st.mean), "n/a", "n/a (one value)"]
    return [show(st.mean), plain(st.std), f"[{show(st.ci_low)}, {show(st.ci_high)}]"]


def _stat_text(stat: tuple[float, float, float] | None, fmt: str | None) -> str:
    if stat is None:
        return "n/a"
    show: Callable[[float], str] = human_bytes if fmt is None else fmt.format
    mean, lo, hi = stat
    if math.isclose(lo, hi, rel_tol=1e-12, abs_tol=0.0):
        return show(mean)
    return f"{show(mean)} ({show(lo)}..{show(hi)})"


# -- the sweep -------------------------------------------------------------------------------------


def sweep(
    base: Mapping[str, Any] | Path | str,
    *,
    grid: Sequence[GridAxis] | Mapping[str, Sequence[Any]] = (),
    seeds: Sequence[int] = (0,),
    overrides: Sequence[str] = (),
    out: Path,
    jobs: int | None = None,
    backend: str = "local",
    ray_address: str | None = None,
    plots: bool = True,
    target_loss: float | None = None,
    tensorboard: bool = False,
    workload: Any = None,
    plugins: Sequence[str] = (),
    baseline: str | Mapping[str, Any] | None = None,
    export: Sequence[str] = (),
) -> SweepResult:
    """Run every grid point for every seed (skipping finished runs), then write ``table.md``,
    ``stats.md``, ``summary.json`` and the plots under ``out``.

    ``grid`` is a list of ``GridAxis`` (``parse_grid``) or ``{key: [values]}``; ``overrides``
    apply to every run (before the grid's). Every run's config is checked before any runs, so a
    bad value fails the sweep at once (``ConfigFileError``). ``target_loss`` adds what reaching
    that eval loss cost each point to the table and the summary.

    ``ray_address`` (``"auto"``, ``"local"`` or a cluster's ``HOST:PORT``) runs on Ray (backend
    ``"ray"``); ``jobs`` then caps the runs in flight (default: as many as the cluster has free
    CPUs). The folders, table and plots are the same whichever backend ran them.

    ``tensorboard`` writes each finished run's scalars into its folder's ``tensorboard/`` (from
    its records, here, whichever backend ran it), so ``tensorboard --logdir OUT/runs`` compares
    the runs.

    ``workload`` trains an object implementing ``geoloco.algorithms.workload.Workload`` in every
    run (the base config then has no ``[workload]`` table); it is pickled to worker processes, so
    its class must be importable there. ``plugins`` adds modules to ``[research] plugins``: they
    are imported here and in every worker before a config is read.

    ``baseline`` names the point the others are compared with, seed by seed (``find_point``: a
    label such as ``"inner_steps=10 uplink_codec=none"``, or ``{key: value}``): ``stats.md``
    and ``summary.json`` then hold each point's paired differences against it. ``export``
    writes the runs and their per-round records as tables (``"csv"``, ``"parquet"``:
    ``SweepResult.export``). Both are checked before any run starts."""
    if ray_address is not None:
        backend = "ray"
    if backend not in BACKENDS:
        raise ConfigFileError(COMMAND_LINE, "--backend", f"unknown backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    if jobs is not None and jobs < 1:
        raise ConfigFileError(COMMAND_LINE, "--jobs", f"must be >= 1, got {jobs}")
    source = str(base) if isinstance(base, (str, Path)) else COMMAND_LINE
    raw = read_config(Path(base), (SIMULATE,))[0] if isinstance(base, (str, Path)) else dict(base)
    raw = with_plugins(raw, plugins)
    axes = list(grid) if not isinstance(grid, Mapping) else [
        GridAxis(k, tuple(_value_text(v) for v in values)) for k, values in grid.items()
    ]
    points = expand_grid(axes)
    baseline_index = None if baseline is None else find_point(points, baseline)
    _check_export(export)
    runs_dir = out / RUNS_DIR
    base_hash = hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()
    tasks: list[tuple[int, int, RunTask]] = []
    for i, point in enumerate(points):
        for seed in seeds:
            texts = (*overrides, *(f"{k}={v}" for k, v in point), f"run.seed={seed}")
            research = _check_config(raw, texts, source, workload)
            identity = json.dumps(run_identity(research, workload), sort_keys=True, default=str)
            digest = hashlib.sha256("\n".join([base_hash, *texts, identity]).encode()).hexdigest()[:10]
            tasks.append((i, seed, RunTask(
                raw, tuple(texts), runs_dir / f"{_slug(point, seed)}-{digest}",
                threads=research.threads, plugins=tuple(research.plugins), workload=workload,
            )))
    if tensorboard:
        require_tensorboard(COMMAND_LINE, "--tensorboard")
    if backend == "ray":
        from geoloco.scenarios.sweep_ray import require_ray

        require_ray()  # a missing extra fails before any folder is made
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / SWEEP_FILE, {
        "base": source, "grid": {a.key: list(a.values) for a in axes}, "seeds": list(seeds),
        "overrides": list(overrides), "backend": backend,
        "workload": None if workload is None else workload_identity(workload),
        "runs": [str(t.folder.relative_to(out)) for _, _, t in tasks],
    })
    todo = [t for _, _, t in tasks if not is_finished(t.folder)]
    resumed = len(tasks) - len(todo)
    logger.info("sweep: %d runs (%d points x %d seeds), %d already finished", len(tasks), len(points),
                len(seeds), resumed)
    errors = _run_tasks(todo, BackendOptions(jobs=jobs, address=ray_address), BACKENDS[backend])
    summaries = [PointSummary(point=p) for p in points]
    for i, seed, task in tasks:
        if task.folder in errors or not is_finished(task.folder):
            summaries[i].failed.append(seed)
        else:
            summaries[i].runs.append(RunResult.load(task.folder))
    result = SweepResult(out=out, axes=axes, seeds=list(seeds), points=summaries,
                         ran=len(todo) - len(errors), resumed=resumed, failed=len(errors),
                         target_loss=target_loss, baseline=baseline_index)
    (out / TABLE_FILE).write_text(result.table() + "\n")
    (out / STATS_FILE).write_text(result.stats_table() + "\n")
    _write_json(out / SUMMARY_FILE, result.summary())
    result.files = [out / TABLE_FILE, out / STATS_FILE, out / SUMMARY_FILE]
    result.files += result.export(export)
    if tensorboard:
        _write_tensorboard([r for s in summaries for r in s.runs])
    if plots:
        from geoloco.scenarios.sweep_plots import write_sweep_plots

        result.files += write_sweep_plots(out, summaries, len(seeds))
    return result


def _check_export(formats: Sequence[str]) -> None:
    """Refuse an unknown export format, or one whose packages are missing, before any run."""
    for fmt in formats:
        if fmt not in EXPORT_FORMATS:
            raise ConfigFileError(
                COMMAND_LINE, "--export", f"unknown format {fmt!r}; allowed: {', '.join(EXPORT_FORMATS)}"
            )
        problem = missing_for(fmt)
        if problem is not None:
            raise ConfigFileError(COMMAND_LINE, "--export", problem)


def _write_tensorboard(runs: Sequence[RunResult]) -> None:
    """Each run's scalars into ``<run folder>/tensorboard``, unless an earlier sweep wrote them."""
    from geoloco.protos.tensorboard import TensorBoardWriter

    for result in runs:
        assert result.folder is not None  # loaded from its folder
        board = result.folder / TENSORBOARD_DIR
        if board.exists():
            continue
        writer = TensorBoardWriter(board, step_key="inner_steps_total")
        try:
            for record in result.records:
                writer.write(record)
        finally:
            writer.close()


def _check_config(raw: dict[str, Any], texts: Sequence[str], source: str, workload: Any) -> ResearchConfig:
    """Read one run's config as the run will (plug-ins imported here first); its ``[research]``."""
    return prepare_run(raw, texts, source, workload=workload).research


def _run_tasks(tasks: Sequence[RunTask], options: BackendOptions, backend: Backend) -> dict[Path, str]:
    from tqdm import tqdm

    errors: dict[Path, str] = {}
    if not tasks:  # a resumed sweep with nothing left to run needs no cluster
        return errors
    with tqdm(total=len(tasks), unit="run", desc="sweep") as progress:
        for folder, error in backend(tasks, options):
            if error is not None:
                errors[folder] = error
                folder.mkdir(parents=True, exist_ok=True)
                (folder / ERROR_FILE).write_text(error)
                logger.error("run %s failed: %s", folder.name, error.strip().splitlines()[-1])
            progress.update(1)
    return errors


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
from geoloco.scenarios.sweep_tasks import Backend, BackendOptions, RunTask, run_in_processes

__all__ = [
    "BACKENDS",
    "BackendOptions",
    "GridAxis",
    "PointSummary",
    "RunTask",
    "SweepResult",
    "expand_grid",
    "parse_grid",
    "parse_seeds",
    "sweep",
]

logger = logging.getLogger(__name__)

RUNS_DIR = "runs"
ERROR_FILE = "error.txt"
SWEEP_FILE = "sweep.json"
TABLE_FILE = "table.md"
TENSORBOARD_DIR = "tensorboard"


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
            **{
                key: self.stat(key)
                for key in ("final_eval_loss", "bytes_up", "bytes_down", "time_s", "inner_steps", "epsilon")
            },
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
) -> SweepResult:
    """Run every grid point for every seed (skipping finished runs), then write ``table.md``,
    ``summary.json`` and the plots under ``out``.

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
    are imported here and in every worker before a config is read."""
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
    runs_dir = out / RUNS_DIR
    base_hash = hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()
    tasks: list[tuple[int, int, RunTask]] = []
    for i, point in enumerate(points):
        for seed in seeds:
            texts = (*overrides, *(f"{k}={v}" for k, v in point), f"simulation.seed={seed}")
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
                         target_loss=target_loss)
    (out / TABLE_FILE).write_text(result.table() + "\n")
    _write_json(out / "summary.json", {
        "runs": len(tasks), "ran": result.ran, "resumed": resumed, "failed": result.failed,
        "target_loss": target_loss,
        "points": [
            {**s.to_dict(), **({"to_target": s.to_target(target_loss)} if target_loss is not None else {})}
            for s in summaries
        ],
    })
    result.files = [out / TABLE_FILE, out / "summary.json"]
    if tensorboard:
        _write_tensorboard([r for s in summaries for r in s.runs])
    if plots:
        from geoloco.scenarios.sweep_plots import write_sweep_plots

        result.files += write_sweep_plots(out, summaries, len(seeds))
    return result


def _write_tensorboard(runs: Sequence[RunResult]) -> None:
    """Each run's scalars into ``<run folder>/tensorboard``, unless an earlier sweep wrote them."""
    from geoloco.coordinator.tensorboard import TensorBoardWriter

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

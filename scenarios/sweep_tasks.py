"""The sweep's unit of work and the local backends: a run task, and running tasks in this
process or in a pool of worker processes.

Kept apart from ``sweep`` so that other backends (``sweep_ray``) and the tuner can run tasks
without importing the sweep's grid and tables (and without an import cycle).
"""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from geoloco.scenarios.config_file import ConfigFileError
from geoloco.scenarios.research import RunResult, run

__all__ = ["Backend", "BackendOptions", "RunTask", "execute_task", "run_guarded", "run_in_processes"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RunTask:
    """One run of the sweep: the base config, its overrides, and the folder it fills."""

    base: dict[str, Any]
    overrides: tuple[str, ...]
    folder: Path
    threads: int = 1
    """The run's ``research.threads`` (read by the sweep; the run sets it itself): what a backend
    reserves for it, and what ``run_in_processes`` checks against the CPUs."""
    plugins: tuple[str, ...] = ()
    """The run's ``research.plugins`` (already in ``base``): what the Ray backend ships."""
    workload: Any = None
    """A workload object to train instead of the config's ``[workload]`` (pickled to workers)."""


@dataclass(frozen=True, slots=True)
class BackendOptions:
    """How a backend may run the tasks."""

    jobs: int | None = None
    """Most runs at once; ``None``: the backend's own default (one locally, every free CPU of a
    Ray cluster)."""
    address: str | None = None
    """Where the backend's cluster is (``ray.init``'s address: ``auto``, ``local``, ``HOST:PORT``)."""


def run_guarded(task: RunTask, out: Path | None) -> tuple[RunResult | None, str | None]:
    """Run one task (writing its folder when ``out`` is given); returns ``(result, None)`` or
    ``(None, error text)``. Never raises for a run's own failure: one bad point must not end the
    sweep."""
    try:
        return run(task.base, overrides=task.overrides, out=out, workload=task.workload), None
    except ConfigFileError as err:
        return None, f"{err.source}: {err.key}: {err.message}"
    except Exception:  # noqa: BLE001 - reported per run, the other runs go on
        return None, traceback.format_exc()


def execute_task(task: RunTask) -> tuple[Path, str | None]:
    """Run one task to a finished folder; returns ``(folder, error text or None)``."""
    return task.folder, run_guarded(task, task.folder)[1]


def run_in_process(tasks: Sequence[RunTask]) -> Iterator[tuple[Path, str | None]]:
    """Backend ``"local"`` with one job: the runs one after another in this process."""
    for task in tasks:
        yield execute_task(task)


def run_in_processes(tasks: Sequence[RunTask], options: BackendOptions) -> Iterator[tuple[Path, str | None]]:
    """Backend ``"local"``: ``jobs`` worker processes (spawned: torch and fork do not mix);
    results in completion order. Each run computes with its own ``research.threads`` (1 unless
    set), in a worker as in this process, so a point gives the same bytes with any ``jobs``;
    a worker inherits this process's ``sys.path``, so the plug-ins import there as here."""
    jobs = options.jobs or 1
    if jobs <= 1 or len(tasks) <= 1:
        yield from run_in_process(tasks)
        return
    workers = min(jobs, len(tasks))
    cpus = os.cpu_count() or 1
    if workers * max(t.threads for t in tasks) > cpus:
        logger.warning(
            "sweep: %d runs at once with up to %d torch threads each exceed the %d CPUs; they will "
            "contend (slower, same results): lower --jobs or research.threads",
            workers, max(t.threads for t in tasks), cpus,
        )
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        pending: set[Future[tuple[Path, str | None]]] = {pool.submit(execute_task, t) for t in tasks}
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                yield future.result()


Backend = Callable[[Sequence[RunTask], BackendOptions], Iterator[tuple[Path, str | None]]]
"""A backend: tasks and options in, ``(folder, error text or None)`` out in completion order."""

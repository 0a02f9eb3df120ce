"""The sweep's Ray backend: runs go to a Ray cluster's workers, results come back to the driver.

A worker runs the simulation in memory and returns the resolved config, the round records and
the host and process it ran in; the driver (the ``geoloco sweep`` process) writes the run folder
(``worker.json`` first, then ``config.json``, ``metrics.jsonl`` and ``summary.json`` last, the
same files a local run writes). So ``--out`` only has to exist on the driver's machine: a
cluster of several machines needs no shared file system, and resume works as locally (a folder
with a summary is never sent to the cluster again). The workers need geoloco installed (the
same version: the run's config records the version and commit each worker ran).

Plug-ins (``[research] plugins``, and a workload object's module) go with the tasks: the source of
a plug-in that is not installed is put into Ray's object store once and unpacked on each worker
before its run (``geoloco.scenarios.plugins.pack_modules``); an installed one must be installed on
the workers too, in the same version: a worker that ran another source than this process has is
reported as a failed run. Each task reserves as many Ray CPUs as its run has torch threads
(``research.threads``, 1 unless set).

Ray is an optional extra (``pip install 'geoloco[ray]'``), imported only by this module.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from geoloco.scenarios.config_file import COMMAND_LINE, ConfigFileError
from geoloco.scenarios.plugins import (
    ShippedModule,
    module_provenance,
    pack_modules,
    plugin_modules,
    unpack_modules,
)
from geoloco.scenarios.research import RunResult
from geoloco.scenarios.sweep_tasks import BackendOptions, RunTask, run_guarded

__all__ = ["WORKER_FILE", "require_ray", "run_on_ray"]

logger = logging.getLogger(__name__)

WORKER_FILE = "worker.json"
"""Where a run ran: ``{"backend": "ray", "host", "pid", "node_id"}``."""


SHIPPED_DIR = "geoloco-plugins"
"""Where a worker unpacks shipped plug-ins, under its machine's temporary folder."""


def run_remote(task: RunTask, shipped: list[ShippedModule]) -> dict[str, Any]:
    """What a Ray worker runs: the simulation, in memory (with its own thread count), after the
    shipped plug-ins are made importable; returns the result as plain data."""
    import ray

    unpack_modules(shipped, Path(tempfile.gettempdir()) / SHIPPED_DIR)
    result, error = run_guarded(task, None)
    worker = {
        "backend": "ray",
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "node_id": ray.get_runtime_context().get_node_id(),
    }
    if result is None:
        return {"error": error, "worker": worker}
    return {"config": result.config, "records": result.records, "runtime_s": result.runtime_s, "worker": worker}


def require_ray() -> Any:
    """The ``ray`` module, or a config error saying which extra installs it."""
    try:
        import ray
    except ImportError:
        raise ConfigFileError(
            COMMAND_LINE, "--ray", "needs the `ray` package: pip install 'geoloco[ray]'"
        ) from None
    return ray


def connect(address: str | None) -> bool:
    """Join the Ray cluster at ``address`` (``auto``: the running one, ``local``: start one in
    this process, ``HOST:PORT`` or ``ray://HOST:PORT``; ``None``: ``RAY_ADDRESS`` or Ray's own
    default); an already connected process keeps its connection. True when this call connected."""
    ray = require_ray()
    if ray.is_initialized():
        logger.info("sweep: using the Ray cluster this process is already connected to")
        return False
    # A Ray instance started here does not send Ray's usage statistics unless the user asked for
    # it (the variable set): a sweep should make no connection beyond its own cluster.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise ConfigFileError(
            COMMAND_LINE, "--ray", f"cannot reach a Ray cluster at {address!r} ({err}); allowed: "
            "auto (a running cluster), local (start one here), HOST:PORT or ray://HOST:PORT"
        ) from None
    return True


@contextmanager
def _own_signal_handlers() -> Iterator[None]:
    """Keep this process's SIGTERM and SIGINT handlers across a Ray instance started and shut
    down here: ``ray.init`` installs its own and ``ray.shutdown`` leaves them, so a sweep run
    from a user's program would otherwise change how that program stops."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread sets handlers, Ray's included
        return
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in kept.items():
            if handler is not None:
                signal.signal(sig, handler)


def run_on_ray(tasks: Sequence[RunTask], options: BackendOptions) -> Iterator[tuple[Path, str | None]]:
    """Backend ``"ray"``: every task as a Ray task (at most ``options.jobs`` in flight when set,
    else Ray schedules them onto its free CPUs); folders written here, in completion order."""
    ray = require_ray()
    with _own_signal_handlers():
        yield from _run_tasks(ray, tasks, options)


def _run_tasks(ray: Any, tasks: Sequence[RunTask], options: BackendOptions) -> Iterator[tuple[Path, str | None]]:
    started = connect(options.address)
    remote = ray.remote(max_retries=0)(run_remote)
    waiting = list(tasks)
    in_flight: dict[Any, RunTask] = {}
    limit = options.jobs or len(tasks)
    sources: dict[tuple[str, ...], tuple[Any, dict[str, str | None]]] = {}
    cpus = ray.cluster_resources().get("CPU", 0)
    if tasks and max(t.threads for t in tasks) > cpus:
        logger.warning(
            "sweep: a run asks for %d CPUs (research.threads) but the Ray cluster has %g in all: it waits "
            "until the cluster grows", max(t.threads for t in tasks), cpus,
        )
    try:
        while waiting or in_flight:
            while waiting and len(in_flight) < limit:
                task = waiting.pop(0)
                modules = tuple(plugin_modules(task.plugins, task.workload))
                if modules not in sources:  # one copy in the object store, however many tasks
                    expected = {name: module_provenance(name)["source_sha256"] for name in modules}
                    sources[modules] = ray.put(pack_modules(modules)), expected
                shipped, _ = sources[modules]
                in_flight[remote.options(num_cpus=task.threads).remote(task, shipped)] = task
            (ref,), _ = ray.wait(list(in_flight), num_returns=1)
            task = in_flight.pop(ref)
            try:
                outcome = ray.get(ref)
            except ray.exceptions.RayError as err:  # the worker died, or the task could not run
                yield task.folder, f"ray: {type(err).__name__}: {err}"
                continue
            expected = sources[tuple(plugin_modules(task.plugins, task.workload))][1]
            yield task.folder, write_outcome(task.folder, outcome, expected)
    finally:
        for ref in in_flight:
            ray.cancel(ref)
        if started:
            ray.shutdown()


def write_outcome(
    folder: Path, outcome: dict[str, Any], expected: Mapping[str, str | None] | None = None
) -> str | None:
    """Write a worker's result as the run folder (``None``), or return its error text: the run's
    own error, or a plug-in whose source (``expected``: module -> hash here) differed there."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / WORKER_FILE).write_text(json.dumps(outcome["worker"], indent=2) + "\n")
    if outcome.get("error") is not None:
        return str(outcome["error"])
    ran = {p["module"]: p["source_sha256"] for p in outcome["config"].get("plugins", [])}
    for module, digest in (expected or {}).items():
        if ran.get(module) != digest:
            return (
                f"the Ray worker ran plug-in module {module!r} from source {ran.get(module)}, this process has "
                f"{digest}: install the same version on the workers (only plug-ins that are not installed "
                "are shipped)"
            )
    RunResult(config=outcome["config"], records=outcome["records"], runtime_s=outcome["runtime_s"]).save(folder)
    return None

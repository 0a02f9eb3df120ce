"""The seconds an inner step of a config file's workload takes on this machine, for ``geoloco plan
--step-time measure``.

The planner's error against a real run is mostly its step-time input (``benchmarks/pages/
planner.md``). Timed alone on one thread, a step is what one site gets from an idle core; the
emulator runs every site as a process on this machine, each on one thread, so they share its
cores, and a site slowed by ``speed_factor`` sleeps part of each step and leaves more for the
others. For an emulate scenario the steps are therefore timed the way the emulator will run them:
one process per site, all at once, each throttled by its own speed factor
(``geoloco.scenarios.throttle``). The result is the unthrottled compute time per step (the
planner's step time at speed 1: it divides by each site's factor itself), averaged over the sites.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from geoloco.scenarios.throttle import ComputeThrottle

if TYPE_CHECKING:
    from multiprocessing.synchronize import Barrier

    from geoloco.algorithms.training import TrainingConfig
    from geoloco.scenarios.workloads import WorkloadSpec

__all__ = ["StepTiming", "time_steps_alone", "time_steps_together"]

WARMUP_STEPS = 2
"""Steps run before the clock starts (the first ones allocate and warm caches)."""
MIN_TIMED_S = 1.0
"""Seconds the timed steps span at least, beyond the steps asked for: eight 10-ms steps were 80
ms of a shared machine, and the measured step moved by 15-40 % from one measurement to the next
(``benchmarks/pages/planner.md``)."""
_START_TIMEOUT_S = 300.0
"""How long the processes may take to build their workloads before the measurement gives up."""


@dataclass(frozen=True, slots=True)
class StepTiming:
    """A measured step time and how it was measured (``geoloco plan`` prints both)."""

    seconds: float
    """Unthrottled seconds per inner step (the planner's step time at speed 1)."""
    how: str
    """In words, for the plan's header."""
    per_site_s: tuple[float, ...] = ()
    """Each site's own mean (concurrent measurement only), in the sites' order."""


class _SleepMeter:
    """The throttle's sleep, timed: what it asked for is less than it got (timer slack), and on
    millisecond steps the difference would be counted as compute."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._clock = clock
        self._sleep = sleep
        self.slept_s = 0.0

    def __call__(self, seconds: float) -> None:
        started = self._clock()
        self._sleep(seconds)
        self.slept_s += self._clock() - started

    def take(self) -> float:
        """Seconds slept since the last call."""
        slept, self.slept_s = self.slept_s, 0.0
        return slept


@dataclass(slots=True)
class _Site:
    """One site's model, optimizer and batches, built before any step is timed."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batches: Iterator[Any]
    loss: Callable[..., torch.Tensor]
    sleep: _SleepMeter | None
    """The throttle's sleep (None at speed 1)."""


def _prepare(workload: WorkloadSpec, training: TrainingConfig, site: int, num_sites: int,
             speed_factor: float = 1.0) -> _Site:
    seed = training.seed
    built = workload.build()
    model = built.build_model(seed)
    optimizer = training.inner_optimizer.build(model.parameters())
    if speed_factor == 1.0:
        return _Site(model, optimizer, built.site_batches(site, num_sites, seed), built.loss, None)
    sleep = _SleepMeter()
    throttle = ComputeThrottle(speed_factor, sleep=sleep)
    throttle.attach(optimizer)
    return _Site(model, optimizer, built.site_batches(site, num_sites, seed), throttle.wrap_loss(built.loss), sleep)


def _time_steps(site: _Site, steps: int, barrier: Barrier | None = None, min_s: float = 0.0) -> float:
    """Mean unthrottled seconds of at least ``steps`` inner steps (after the warm-up), and of as
    many more as it takes to span ``min_s`` seconds of wall clock; with ``barrier`` the timed
    steps start when every process is ready."""
    elapsed = 0.0
    timed = 0
    started = 0.0
    step = 0
    while step < WARMUP_STEPS or timed < steps or time.perf_counter() - started < min_s:
        if step == WARMUP_STEPS:
            if barrier is not None:
                barrier.wait(timeout=_START_TIMEOUT_S)
            started = time.perf_counter()
        t0 = time.perf_counter()
        site.optimizer.zero_grad(set_to_none=True)
        site.loss(site.model, next(site.batches)).backward()
        site.optimizer.step()
        compute = time.perf_counter() - t0
        if site.sleep is not None:  # the throttle slept after the step's compute, inside the timer
            compute -= site.sleep.take()
        if step >= WARMUP_STEPS:
            elapsed += compute
            timed += 1
        step += 1
    return elapsed / timed


def _site_threads() -> int:
    """Compute threads of an emulated site process: ``OMP_NUM_THREADS`` as the user set it, else 1
    (what ``geoloco emulate`` gives its sites, ``Emulation._child_env``)."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


def time_steps_alone(workload: WorkloadSpec, training: TrainingConfig, num_sites: int, steps: int = 5) -> StepTiming:
    """One site's steps here, with a site process's threads: for sites that will each have a
    machine of this kind to themselves."""
    before = torch.get_num_threads()
    threads = _site_threads()
    torch.set_num_threads(threads)
    try:
        seconds = _time_steps(_prepare(workload, training, 0, num_sites), steps, min_s=MIN_TIMED_S)
    finally:
        torch.set_num_threads(before)
    return StepTiming(
        seconds, f"timed here, one site alone on {threads} thread(s), {steps}+ steps over {MIN_TIMED_S:g}+ s"
    )


def _worker(workload: WorkloadSpec, training: TrainingConfig, site: int, num_sites: int, steps: int,
            speed_factor: float, barrier: Barrier, results: multiprocessing.Queue[tuple[int, float | str]]) -> None:
    torch.set_num_threads(_site_threads())
    try:
        prepared = _prepare(workload, training, site, num_sites, speed_factor)
        results.put((site, _time_steps(prepared, steps, barrier, min_s=MIN_TIMED_S)))
    except BaseException as err:  # noqa: BLE001 (reported to the parent, which names the site)
        barrier.abort()
        results.put((site, f"{type(err).__name__}: {err}"))


def time_steps_together(
    workload: WorkloadSpec, training: TrainingConfig, speed_factors: list[float], steps: int = 8,
) -> StepTiming:
    """Every site's steps at once, one process per site with a site process's threads, each
    throttled by its speed factor: the contention ``geoloco emulate`` runs them under here."""
    context = multiprocessing.get_context("spawn")  # torch and fork do not mix
    num_sites = len(speed_factors)
    barrier = context.Barrier(num_sites)
    results: multiprocessing.Queue[tuple[int, float | str]] = context.Queue()
    processes = [
        context.Process(
            target=_worker, args=(workload, training, site, num_sites, steps, factor, barrier, results), daemon=True,
        )
        for site, factor in enumerate(speed_factors)
    ]
    for process in processes:
        process.start()
    answers: dict[int, float | str] = {}
    try:
        limit_s = _START_TIMEOUT_S + 60.0 * steps
        deadline = time.monotonic() + limit_s
        while len(answers) < num_sites:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"timing the steps took longer than {limit_s:.0f} s; {len(answers)} of "
                                   f"{num_sites} sites reported")
            try:
                site, answer = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in processes):
                    raise RuntimeError("a step-timing process died; run with --step-time SECONDS instead") from None
                continue
            answers[site] = answer
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
    failed = {site: a for site, a in answers.items() if isinstance(a, str)}
    if failed:
        site, why = min(failed.items())
        raise RuntimeError(f"timing site {site}'s steps failed: {why}")
    per_site = tuple(float(answers[site]) for site in range(num_sites))
    return StepTiming(
        sum(per_site) / num_sites,
        f"timed here as the emulator runs the sites: {num_sites} processes at once, {_site_threads()} "
        f"thread(s) each, each at its speed factor, {steps}+ steps over {MIN_TIMED_S:g}+ s",
        per_site,
    )

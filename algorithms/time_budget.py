"""Time-budget rounds: a site runs as many inner steps as fit in ``round_time_budget_s``.

With a fixed ``H`` every site of a synchronous round waits for the slowest: a 1x site finishes
its H steps in a quarter of the time a 0.25x site needs and then idles. With a time budget ``B``
every site computes for about ``B`` seconds and reports how many steps it ran; the coordinator
weights the updates by work done (``geoloco.algorithms.weighting``). Fast sites stop idling,
slow sites stop holding the round.

The stopping rule ("as many as fit"): after ``n`` steps taking ``e`` seconds, run another one
only if ``e + e / n`` (one more step at the mean pace so far) stays within ``B``; the first step
always runs, so every site contributes. For a constant step time ``τ`` that is exactly
``floor(B / τ)`` steps (``steps_in_budget``), which is what the simulator's virtual clock uses; a
real site measures its steps, speed throttling (``geoloco site --speed-factor``) included.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

from geoloco.algorithms.diloco import InnerResult, LossFn, run_inner_steps
from geoloco.algorithms.lr_schedule import InnerLRSchedule
from geoloco.algorithms.workload import Batch

__all__ = ["TimeBudget", "run_inner_steps_within", "steps_in_budget"]

_EPS = 1e-9
"""Slack for float round-off: 0.3 / 0.1 must give 3 steps, not 2."""


def steps_in_budget(budget_s: float, step_time_s: float, *, max_steps: int | None = None) -> int:
    """Inner steps of ``step_time_s`` seconds each that fit in ``budget_s`` (at least 1)."""
    if not (math.isfinite(budget_s) and budget_s > 0):
        raise ValueError(f"time budget must be > 0 seconds, got {budget_s}")
    if step_time_s < 0:
        raise ValueError(f"step time must be >= 0 seconds, got {step_time_s}")
    if step_time_s == 0:
        if max_steps is None:
            raise ValueError("a zero step time fits unboundedly many steps; give max_steps")
        return max_steps
    steps = max(1, math.floor(budget_s / step_time_s * (1 + _EPS)))
    return steps if max_steps is None else min(steps, max_steps)


class TimeBudget:
    """The stopping rule of one time-budget round (see the module docstring)."""

    def __init__(self, budget_s: float, *, max_steps: int | None = None) -> None:
        if not (math.isfinite(budget_s) and budget_s > 0):
            raise ValueError(f"time budget must be > 0 seconds, got {budget_s}")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {max_steps}")
        self.budget_s = budget_s
        self.max_steps = max_steps

    def another_step_fits(self, steps_done: int, elapsed_s: float) -> bool:
        """Whether step ``steps_done + 1`` should run, ``elapsed_s`` seconds into the round."""
        if steps_done == 0:
            return True
        if self.max_steps is not None and steps_done >= self.max_steps:
            return False
        return elapsed_s + elapsed_s / steps_done <= self.budget_s * (1 + _EPS)


def run_inner_steps_within(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[Batch],
    budget: TimeBudget,
    loss_fn: LossFn,
    *,
    grad_clip_norm: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
    time_scale: float = 1.0,
    agree: Callable[[float], float] | None = None,
    sync: Callable[[], None] | None = None,
    lr_schedule: InnerLRSchedule | None = None,
) -> tuple[InnerResult, float]:
    """Inner steps until the budget is spent; returns the result and the seconds it counted.

    ``time_scale`` multiplies measured time (``1 / speed_factor`` of a simulated site in ``measure``
    mode). ``agree(elapsed) -> elapsed`` makes every rank of a multi-GPU site take the same
    decision (an all-reduce ``max``), since they must run the same number of DDP steps. ``sync``
    waits for the device (CUDA is asynchronous: without it a step would seem to take no time).
    Each step is ``run_inner_steps`` with one step, the function fixed-H rounds use.
    """
    losses: list[float] = []
    samples = 0
    start = clock()
    elapsed = 0.0
    while budget.another_step_fits(len(losses), elapsed):
        result = run_inner_steps(
            model, optimizer, batches, 1, loss_fn, grad_clip_norm=grad_clip_norm,
            lr_schedule=lr_schedule,
        )
        if sync is not None:
            sync()
        losses.extend(result.losses)
        samples += result.samples
        elapsed = (clock() - start) * time_scale
        if agree is not None:
            elapsed = agree(elapsed)
    return InnerResult(losses=losses, samples=samples), elapsed

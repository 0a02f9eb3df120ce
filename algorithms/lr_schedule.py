"""Inner learning-rate schedules: linear warm-up, then constant, cosine or linear decay to a floor.

DiLoCo (Douillard et al. 2023) and its follow-ups run the inner AdamW with a linear warm-up and a
cosine decay. The schedule is a pure function of the site's cumulative inner-step count
(``lr_multiplier``), so the simulator (one schedule per simulated site) and a real site agent
that ran the same steps set the same learning rate; a site that restarts or joins at round ``r``
resumes it at step ``r × inner_steps`` (exact for fixed-H rounds, an estimate for time-budget
rounds, whose step counts vary).

``InnerLRSchedule`` drives a ``torch.optim.lr_scheduler.LambdaLR`` whose multiplier is that
function: call ``step()`` after every ``optimizer.step()`` (``run_inner_steps`` does, given
``lr_scheduler=schedule.scheduler``) and ``seek(n)`` to jump to step ``n``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from geoloco.algorithms.config import ConfigError

__all__ = [
    "LR_SCHEDULES",
    "InnerLRSchedule",
    "lr_multiplier",
    "resolve_decay_steps",
]

CONSTANT = "constant"


def _constant(progress: float, min_lr_ratio: float) -> float:
    return 1.0


def _cosine(progress: float, min_lr_ratio: float) -> float:
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _linear(progress: float, min_lr_ratio: float) -> float:
    return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)


LR_SCHEDULES: dict[str, Callable[[float, float], float]] = {
    CONSTANT: _constant,
    "cosine": _cosine,
    "linear": _linear,
}
"""Schedule name -> decay shape ``(progress in [0, 1], min_lr_ratio) -> multiplier`` after warm-up."""


def lr_multiplier(
    step: int,
    *,
    schedule: str = CONSTANT,
    warmup_steps: int = 0,
    decay_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> float:
    """The factor on the base lr for inner step ``step`` (0-based: the steps already taken).

    Warm-up is linear from ``1 / warmup_steps`` (not 0, which would waste a step) to 1 over the
    first ``warmup_steps`` steps; the decay then runs from 1 at step ``warmup_steps`` to
    ``min_lr_ratio`` at step ``decay_steps`` (the horizon counts the warm-up) and stays there.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; valid names: {', '.join(LR_SCHEDULES)}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == CONSTANT:
        return 1.0
    if decay_steps is None:
        raise ValueError(f"the {schedule!r} schedule needs decay_steps")
    span = decay_steps - warmup_steps
    progress = 1.0 if span <= 0 else min(1.0, (step - warmup_steps) / span)
    return LR_SCHEDULES[schedule](progress, min_lr_ratio)


def resolve_decay_steps(
    schedule: str,
    decay_steps: int | None,
    *,
    total_rounds: int | None,
    inner_steps: int | None,
) -> int | None:
    """``decay_steps``, or for a decaying schedule without one, ``total_rounds × inner_steps``.

    Raises ``ConfigError("decay_steps", ...)`` when the run length is unknown (a coordinator
    with ``total_rounds = 0`` runs until stopped); callers nest the key (``err.under(...)``).
    """
    if schedule == CONSTANT or decay_steps is not None:
        return decay_steps
    if not total_rounds or not inner_steps:
        raise ConfigError(
            "decay_steps",
            f"the {schedule!r} schedule needs a horizon and the run length "
            f"is unknown (rounds {total_rounds or 'unbounded'}, inner_steps {inner_steps}); set "
            "decay_steps (inner steps per site) or a fixed number of rounds"
        )
    return total_rounds * inner_steps


class InnerLRSchedule:
    """A ``LambdaLR`` over an inner optimizer, positioned by the site's cumulative step count.

    The base lr is each param group's lr when the schedule is built (the config's ``lr``);
    ``seek`` rebuilds the scheduler at another step (torch's documented way to resume:
    ``initial_lr`` in the groups and ``last_epoch = step - 1``), so no lr is written by hand.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        schedule: str,
        warmup_steps: int = 0,
        decay_steps: int | None = None,
        min_lr_ratio: float = 0.0,
        start_step: int = 0,
    ) -> None:
        # Fails early (unknown name, missing horizon) rather than at the first inner step.
        lr_multiplier(0, schedule=schedule, warmup_steps=warmup_steps,
                      decay_steps=decay_steps, min_lr_ratio=min_lr_ratio)
        self.optimizer = optimizer
        self.schedule = schedule
        self.warmup_steps = warmup_steps
        self.decay_steps = decay_steps
        self.min_lr_ratio = min_lr_ratio
        self.base_lrs = [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]
        self.scheduler: torch.optim.lr_scheduler.LambdaLR
        self.seek(start_step)

    def multiplier(self, step: int) -> float:
        return lr_multiplier(
            step, schedule=self.schedule, warmup_steps=self.warmup_steps,
            decay_steps=self.decay_steps, min_lr_ratio=self.min_lr_ratio,
        )

    @property
    def step_count(self) -> int:
        """Inner steps taken so far: the next step runs at ``multiplier(step_count)``."""
        return int(self.scheduler.last_epoch)

    def seek(self, step: int) -> None:
        """Set the lr for inner step ``step`` (after a restart, a late join, a loaded state)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        # Loading optimizer state replaces the param groups (and their initial_lr); restore it.
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["initial_lr"] = base
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, self.multiplier, last_epoch=step - 1
        )

    def step(self) -> None:
        """Advance one inner step (call after ``optimizer.step()``)."""
        self.scheduler.step()

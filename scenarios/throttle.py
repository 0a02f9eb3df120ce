"""Slower hardware, reproduced: stretch every inner step of a site by a speed factor.

A site with ``speed_factor = 0.25`` should take four times as long per inner step as this
machine does. ``ComputeThrottle`` measures each step — from the forward pass (the first call of
the loss function) to the end of ``optimizer.step()`` (a post-step hook) — and then sleeps
``(1 / speed_factor − 1)`` times that long. Measuring every step, rather than assuming a fixed
step time, keeps the ratio right when this machine is busy (several sites share its cores).

``geoloco site --speed-factor F`` wires it in; it touches neither the model nor the math.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ComputeThrottle"]


class ComputeThrottle:
    """Sleeps after each optimizer step so that steps run at ``speed_factor`` of full speed."""

    def __init__(
        self,
        speed_factor: float,
        *,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not 0 < speed_factor <= 1:
            raise ValueError(
                f"speed_factor must be in (0, 1] (1 = this machine's speed, 0.5 = half), got {speed_factor}"
            )
        self.speed_factor = speed_factor
        self._clock = clock
        self._sleep = sleep
        self._step_started: float | None = None
        self.steps = 0
        self.compute_s = 0.0
        """Measured (unthrottled) seconds of the throttled steps."""
        self.slept_s = 0.0

    def wrap_loss(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``loss_fn`` that marks the start of a step at its first call."""

        def loss(*args: Any, **kwargs: Any) -> torch.Tensor:
            if self._step_started is None:
                self._step_started = self._clock()
            return loss_fn(*args, **kwargs)

        return loss

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Sleep after every ``optimizer.step()`` in proportion to the step just measured."""
        optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        started, self._step_started = self._step_started, None
        if started is None:
            return
        elapsed = self._clock() - started
        extra = elapsed * (1.0 / self.speed_factor - 1.0)
        self.steps += 1
        self.compute_s += elapsed
        if extra > 0:
            self._sleep(extra)
            self.slept_s += extra

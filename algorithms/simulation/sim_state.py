"""The simulator's sites and the one model they take turns on.

Scaling choice: there is ONE model instance for all sites. Before a site's inner steps its
starting weights are loaded into it; what each site owns is only its inner-optimizer state (one
torch optimizer per site over the same shared parameters, each keeping its own state), its
uplink error-feedback residual and its data stream. Sites run one after another within a round,
so memory is ``model + N × (optimizer state + residual)``, plus, with error feedback, the round's
encoded uploads until its outer step (an aborted round gives them back to the residuals, as the
real sites keep theirs: ``sim_uplinks.keep_aborted``).

``SimTrainer`` runs a site's inner steps on that model and converts them to virtual seconds
(``step_time_s / speed_factor`` per step, or the measured wall time with
``step_time_s = "measure"``); plain and streaming rounds both use it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from geoloco.algorithms.diloco import InnerResult, run_inner_steps
from geoloco.algorithms.lr_schedule import InnerLRSchedule
from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.partial import PartialAssignment
from geoloco.algorithms.simulation.clock import SiteConfig
from geoloco.algorithms.simulation.sim_config import MEASURE
from geoloco.algorithms.streaming import FragmentUplink
from geoloco.algorithms.time_budget import TimeBudget, run_inner_steps_within, steps_in_budget
from geoloco.algorithms.workload import Workload
from geoloco.compression import Encoded

__all__ = ["LateUpdate", "SimSite", "SimTrainer"]


@dataclass(frozen=True, slots=True)
class LateUpdate:
    """An update that missed its round's deadline, to fold into the next round."""

    encoded: Encoded
    weight: float
    arrival_s: float
    """When it arrived on the virtual clock (folded only if before the next round aggregates)."""
    fragment: int
    nbytes: int
    upload_s: float
    """Its size and its transfer's seconds, which the coordinator measures of the link when it
    folds it."""


@dataclass(slots=True)
class SimSite:
    """One simulated site: its link and speed, data, optimizer state and virtual clock."""

    index: int
    name: str
    """The site's identity in plans, seeds and aggregation: ``str(index)``."""
    config: SiteConfig
    batches: Iterator[Any]
    optimizer: torch.optim.Optimizer | None
    """Its inner optimizer over the shared model's parameters (None for the ddp baseline)."""
    uplink: FragmentUplink | None = None
    """Its uplink encoders (error feedback per fragment); None in secure rounds, whose private
    encoders live with the secure aggregation."""
    lr_schedule: InnerLRSchedule | None = None
    """The inner lr schedule over ``optimizer``, positioned by this site's cumulative inner steps."""
    ready_s: float = 0.0
    """Virtual time at which this site holds the current global weights."""
    late: LateUpdate | None = None
    """Its last round's update that missed the deadline, kept to be folded into the next round
    (``late_updates = "fold"``)."""


class SimTrainer:
    """Inner steps of any site on the shared model, timed on the virtual clock."""

    def __init__(
        self,
        model: nn.Module,
        layout: ParamLayout,
        workload: Workload,
        *,
        device: torch.device,
        step_time_s: float | str,
        grad_clip_norm: float | None,
        partial: PartialAssignment | None = None,
    ) -> None:
        self.partial = partial
        """Partial Parameter Updates: a site trains only its group's tensors (the others are
        frozen during its steps, so backward and its optimizer skip them)."""
        self.model = model
        self.layout = layout
        self.workload = workload
        self.device = device
        self.step_time_s = step_time_s
        self.grad_clip_norm = grad_clip_norm

    def load(self, flat: torch.Tensor) -> None:
        self.layout.load_(self.model, flat)

    def flatten(self) -> torch.Tensor:
        return self.layout.flatten(self.model)

    def sync_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step_seconds(self, site: SimSite, steps: int, measured_s: float) -> float:
        """Virtual seconds of ``steps`` inner steps of ``site``."""
        base = measured_s if self.step_time_s == MEASURE else steps * float(self.step_time_s)
        return base / site.config.speed_factor

    @contextmanager
    def _training(self, site: SimSite) -> Iterator[None]:
        """Freeze the tensors ``site`` does not train (partial updates) for the block."""
        if self.partial is None:
            yield
            return
        params = list(self.model.parameters())
        self.partial.freeze(params, self.partial.site_group(site.name))
        try:
            yield
        finally:
            self.partial.unfreeze(params)

    def steps(self, site: SimSite, steps: int) -> tuple[InnerResult | None, float]:
        """``steps`` inner steps of ``site`` on the model as loaded: the result (None for zero
        steps) and the virtual seconds they took."""
        if steps == 0:
            return None, 0.0
        assert site.optimizer is not None
        self.sync_device()
        t0 = time.perf_counter()
        with self._training(site):
            result = run_inner_steps(
                self.model, site.optimizer, site.batches, steps, self.workload.loss,
                grad_clip_norm=self.grad_clip_norm, lr_schedule=site.lr_schedule,
            )
        self.sync_device()
        return result, self.step_seconds(site, steps, time.perf_counter() - t0)

    def steps_within(self, site: SimSite, budget_s: float) -> tuple[InnerResult, float]:
        """As many inner steps as fit in ``budget_s`` virtual seconds (at least one)."""
        assert site.optimizer is not None
        if self.step_time_s == MEASURE:
            with self._training(site):
                return run_inner_steps_within(
                    self.model, site.optimizer, site.batches, TimeBudget(budget_s),
                    self.workload.loss, grad_clip_norm=self.grad_clip_norm, lr_schedule=site.lr_schedule,
                    time_scale=1.0 / site.config.speed_factor, sync=self.sync_device,
                )
        step_s = float(self.step_time_s) / site.config.speed_factor
        count = steps_in_budget(budget_s, step_s, max_steps=None if step_s > 0 else 1)
        result, seconds = self.steps(site, count)
        assert result is not None
        return result, seconds

    def evaluate(self, flat: torch.Tensor) -> float:
        """Held-out loss of ``flat`` (the model is left holding it)."""
        self.load(flat)
        self.model.eval()
        try:
            with torch.no_grad():
                return float(self.workload.eval_loss(self.model))
        finally:
            self.model.train()

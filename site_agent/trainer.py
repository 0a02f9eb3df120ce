"""A site's inner training: the user's model, optimizer, data and loss, on every rank.

``SiteTrainer`` runs inner steps with the simulator's own functions (``run_inner_steps``,
``run_inner_steps_within`` for time-budget rounds), keeps the inner lr schedule at the right
step, feeds batches (moved to the device, bf16 autocast when configured) and, on a multi-rank
(``torchrun``) site, keeps the other ranks in step: the leader tells them each round's inner
steps and sends them the global weights to start from; they train the same steps through DDP
(``follow``) until the leader tells them to stop, handing over the final weights.

It knows nothing about the coordinator: the round runners (``geoloco.site_agent.rounds``)
decide which weights to train from and what to do with the result.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from geoloco.algorithms.diloco import run_inner_steps
from geoloco.algorithms.lr_schedule import InnerLRSchedule
from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.time_budget import TimeBudget, run_inner_steps_within
from geoloco.site_agent.client import AgentStopped, SiteAgentError
from geoloco.site_agent.config import SiteAgentConfig
from geoloco.site_agent.distributed import IntraSiteGroup, unwrap_model
from geoloco.site_agent.persist import load_optimizer_state, optimizer_state, prefixed, unprefixed

__all__ = ["ACTION_STOP", "ACTION_TRAIN", "FollowerOutcome", "LossFn", "RoundTraining", "SiteTrainer"]

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""``loss_fn(model, batch) -> scalar loss`` (the batch is already on the model's device)."""

ACTION_TRAIN = "train"
ACTION_STOP = "stop"
"""Control messages the leader rank sends to the other ranks of a multi-GPU site."""


@dataclass(frozen=True, slots=True)
class RoundTraining:
    """What one round's inner steps did, summed over the site's ranks."""

    loss: float
    """Mean training loss over the steps (NaN when none ran)."""
    samples: int
    """Samples trained on (all ranks)."""
    seconds: float
    """Wall time of the steps."""
    steps: int
    """Inner steps run (every rank runs the same number)."""


@dataclass(frozen=True, slots=True)
class StepsTraining:
    """A single-rank run of inner steps: per-step losses, samples, seconds."""

    losses: list[float]
    samples: int
    seconds: float


@dataclass(frozen=True, slots=True)
class FollowerOutcome:
    """How a follower rank's loop ended (the leader's stop message)."""

    weights: torch.Tensor | None
    """The final global weights (None: the leader never held any)."""
    round: int
    rounds_trained: int
    finished: bool
    rounds_included: int


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple):
        return tuple(_to_device(b, device) for b in batch)
    if isinstance(batch, list):
        return [_to_device(b, device) for b in batch]
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


class SiteTrainer:
    """Inner steps, lr schedule, batches, loss and follower ranks (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        data: Iterable[Any],
        loss_fn: LossFn,
        *,
        site: str,
        config: SiteAgentConfig,
        device: torch.device,
        group: IntraSiteGroup | None,
        lr_schedule: InnerLRSchedule | None,
        stop: threading.Event,
    ) -> None:
        self.site = site
        self.config = config
        self.group = group
        self.device = device
        self.module = unwrap_model(model).to(device)
        # Multi-rank sites train through DDP (gradients averaged every step); a model the user
        # already wrapped is used as is.
        needs_wrap = self.is_distributed and model is self.module
        self.train_model = group.wrap_model(model) if needs_wrap and group is not None else model
        self.layout = ParamLayout.from_model(self.module)
        self.optimizer = inner_optimizer
        self.lr_schedule = lr_schedule
        self.loss_fn = loss_fn
        self._lr_round: int | None = None
        """The round the lr schedule's position belongs to (``None``: not positioned yet)."""
        self._data = iter(data)
        self._stop = stop
        self._steps_done = 0
        self._followers_reset = False
        """The leader reset its optimizer's state: the other ranks reset theirs before their next
        round (``tell_followers_to_train``)."""

    @property
    def is_distributed(self) -> bool:
        """More than one rank trains this site."""
        return self.group is not None and self.group.is_distributed

    @property
    def steps_done(self) -> int:
        """Batches taken so far (reported with heartbeats)."""
        return self._steps_done

    # ---------------------------------------------------------------------------------------
    # The model's weights

    def load_(self, flat: torch.Tensor) -> None:
        """Set the model's parameters to the flat vector ``flat``."""
        self.layout.load_(self.module, flat)

    def flatten(self) -> torch.Tensor:
        """The model's parameters as one flat fp32 vector (a copy)."""
        return self.layout.flatten(self.module)

    def reset_optimizer_state(self) -> None:
        """Forget the inner optimizer's state (AdamW's moments, step counts): after a step with
        NaN/Inf values it holds them, and every later step would too. The other ranks of a
        multi-rank site (whose gradients were averaged with the bad ones) reset theirs with
        their next round. The lr schedule is the site's step count and stays."""
        self.optimizer.state.clear()
        self._followers_reset = self.is_distributed

    def train_only(self, trained: Sequence[bool] | None) -> None:
        """Partial Parameter Updates: train only the tensors marked True (layout order), as the
        simulator does: the others get ``requires_grad`` off, so backward computes no weight
        gradient for them and the inner optimizer (which skips tensors without a gradient)
        never creates state for them. ``None``: train every tensor again."""
        params = list(self.module.parameters())
        if trained is None:
            trained = [True] * len(params)
        if len(trained) != len(params):
            raise SiteAgentError(f"train_only got {len(trained)} flags for {len(params)} parameter tensors")
        if self.is_distributed and not all(trained):
            raise SiteAgentError(
                "partial parameter updates are not supported on a multi-rank site yet (DDP fixes "
                "the trained parameters when it wraps the model); run the site on one rank"
            )
        for p, on in zip(params, trained, strict=True):
            p.requires_grad_(on)
            if not on:
                p.grad = None

    # ---------------------------------------------------------------------------------------
    # Training

    def train_round(
        self, start: torch.Tensor, round_number: int, inner_steps: int, budget_s: float | None = None,
        *, before_step: Callable[[int], None] | None = None,
    ) -> RoundTraining:
        """Round ``round_number``'s inner steps on every rank, from the global weights ``start``
        (the leader's are sent to the other ranks): ``inner_steps`` of them, or as many as fit
        in ``budget_s`` seconds (time-budget rounds; every rank runs the same number).
        ``before_step``: ``run_inner_steps``' hook at each step boundary (fixed-H rounds)."""
        group = self.group
        if group is not None:
            group.broadcast_flat_(start)
        self.load_(start)
        self.position_lr_schedule(round_number, inner_steps)
        t0 = time.perf_counter()
        if budget_s is not None:
            result, _ = run_inner_steps_within(
                self.train_model, self.optimizer, self._batches(), TimeBudget(budget_s), self._loss,
                grad_clip_norm=self.config.grad_clip_norm, agree=self._agree_elapsed,
                sync=self._sync_device, lr_schedule=self.lr_schedule,
            )
        else:
            result = run_inner_steps(
                self.train_model,
                self.optimizer,
                self._batches(),
                inner_steps,
                self._loss,
                grad_clip_norm=self.config.grad_clip_norm,
                lr_schedule=self.lr_schedule,
                before_step=before_step,
            )
        self.lr_schedule_reached(round_number + 1)
        self._sync_device()
        elapsed = time.perf_counter() - t0
        stats = torch.tensor(
            [sum(result.losses), float(len(result.losses)), float(result.samples)], dtype=torch.float64
        )
        if group is not None:
            group.all_reduce_(stats, "sum")
        loss = float(stats[0] / stats[1]) if stats[1] > 0 else float("nan")
        return RoundTraining(loss=loss, samples=int(stats[2]), seconds=elapsed, steps=len(result.losses))

    def train_steps(self, steps: int) -> StepsTraining:
        """``steps`` inner steps on the model as it is (the site's own weights; one rank)."""
        t0 = time.perf_counter()
        result = run_inner_steps(
            self.train_model, self.optimizer, self._batches(), steps, self._loss,
            grad_clip_norm=self.config.grad_clip_norm, lr_schedule=self.lr_schedule,
        )
        self._sync_device()
        return StepsTraining(result.losses, result.samples, time.perf_counter() - t0)

    def position_lr_schedule(self, round_number: int, inner_steps: int) -> None:
        """Resume the lr schedule at ``round_number × inner_steps`` unless the site trained the
        round before this one (then its cumulative count is already right). Exact for fixed-H
        rounds; with time-budget rounds (step counts vary) ``inner_steps`` is the nominal H, an
        estimate. Every rank calls it with the leader's round and H, so all ranks agree."""
        if self.lr_schedule is None or self._lr_round == round_number:
            return
        step = round_number * inner_steps
        logger.info("site %s: inner lr schedule at step %d (round %d)", self.site, step, round_number)
        self.lr_schedule.seek(step)
        self._lr_round = round_number

    def lr_schedule_reached(self, round_number: int) -> None:
        """The steps run so far bring the lr schedule to the start of ``round_number``."""
        self._lr_round = round_number

    def _agree_elapsed(self, elapsed_s: float) -> float:
        """The slowest rank's elapsed time, so every rank of a site stops after the same step."""
        if self.group is None or not self.group.is_distributed:
            return elapsed_s
        return float(self.group.all_reduce_(torch.tensor([elapsed_s], dtype=torch.float64), "max")[0])

    def _sync_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _batches(self) -> Iterator[Any]:
        # A single-process site stops between two inner steps, so SIGTERM does not wait for a
        # whole round of training. The ranks of a multi-GPU site finish the round together: one
        # rank leaving mid-round would leave the others waiting in a collective.
        interruptible = not self.is_distributed
        while True:
            if interruptible and self._stop.is_set():
                raise AgentStopped()
            try:
                batch = next(self._data)
            except StopIteration:
                raise SiteAgentError(
                    "the site's data iterator is exhausted; pass an endless iterator (e.g. "
                    "itertools.cycle over a DataLoader)"
                ) from None
            self._steps_done += 1
            yield _to_device(batch, self.device)

    def _loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if self.config.autocast_bf16:
            with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16):
                return self.loss_fn(model, batch)
        return self.loss_fn(model, batch)

    # ---------------------------------------------------------------------------------------
    # Saving and restoring (``geoloco.site_agent.persist``)

    def snapshot(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What the site's next inner steps depend on besides the global weights: the inner
        optimizer, the model's buffers, the data position, the lr schedule and torch's RNG."""
        optimizer_tensors, optimizer_meta = optimizer_state(self.optimizer)
        tensors = prefixed("optimizer.", optimizer_tensors)
        tensors.update(prefixed("buffer.", dict(self.module.named_buffers())))
        tensors["rng.cpu"] = torch.get_rng_state()
        if self.device.type == "cuda":
            tensors["rng.cuda"] = torch.cuda.get_rng_state(self.device)
        meta = {
            "optimizer": optimizer_meta,
            "batches_drawn": self._steps_done,
            "lr_schedule": None if self.lr_schedule is None else {
                "step": self.lr_schedule.step_count, "round": self._lr_round,
            },
        }
        return tensors, meta

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Take a ``snapshot`` back: the data stream is replayed to the batches drawn (a
        deterministic iterator then continues exactly where the saved site was)."""
        load_optimizer_state(self.optimizer, unprefixed("optimizer.", tensors), meta["optimizer"])
        buffers = dict(self.module.named_buffers())
        for name, saved in unprefixed("buffer.", tensors).items():
            if name in buffers:
                buffers[name].copy_(saved)
        torch.set_rng_state(tensors["rng.cpu"])
        if self.device.type == "cuda" and "rng.cuda" in tensors:
            torch.cuda.set_rng_state(tensors["rng.cuda"], self.device)
        schedule = meta.get("lr_schedule")
        if self.lr_schedule is not None and schedule is not None:
            self.lr_schedule.seek(int(schedule["step"]))
            self._lr_round = None if schedule["round"] is None else int(schedule["round"])
        drawn = int(meta["batches_drawn"])
        for index in range(drawn):
            try:
                next(self._data)
            except StopIteration:
                raise SiteAgentError(
                    f"the site's data iterator ended after {index} batches while replaying it to the "
                    f"saved position ({drawn} batches); pass the same endless iterator as the run "
                    "that saved the state"
                ) from None
        self._steps_done = drawn
        logger.info("site %s: data stream replayed to batch %d", self.site, drawn)

    # ---------------------------------------------------------------------------------------
    # Follower ranks of a multi-rank site

    def tell_followers_to_train(self, round_number: int, inner_steps: int, budget_s: float | None) -> None:
        """The leader, before ``train_round``: the other ranks train the same round."""
        if self.is_distributed and self.group is not None and self.group.is_leader:
            self.group.broadcast_object(
                {"action": ACTION_TRAIN, "round": round_number, "inner_steps": inner_steps,
                 "time_budget_s": budget_s, "reset_optimizer": self._followers_reset}
            )
            self._followers_reset = False

    def stop_followers(
        self, weights: torch.Tensor | None, *, round_number: int, finished: bool, rounds_included: int
    ) -> None:
        """The leader, at the end: tell the other ranks to stop, handing them the final weights."""
        if self.group is None or not self.group.is_distributed:
            return
        self.group.broadcast_object(
            {"action": ACTION_STOP, "weights": weights is not None, "round": round_number,
             "finished": finished, "rounds_included": rounds_included}
        )
        if weights is not None:
            self.group.broadcast_flat_(weights)

    def follow(self) -> FollowerOutcome:
        """Loop of a non-leader rank: train when the leader says so, from its weights."""
        group = self.group
        assert group is not None
        start: torch.Tensor | None = None
        rounds_trained = 0
        while True:
            control = group.broadcast_object(None)
            if control["action"] == ACTION_STOP:
                weights = None
                if control["weights"]:
                    weights = torch.empty(self.layout.numel, dtype=torch.float32, device=self.device)
                    group.broadcast_flat_(weights)
                    self.load_(weights)
                return FollowerOutcome(
                    weights=weights, round=int(control["round"]), rounds_trained=rounds_trained,
                    finished=bool(control["finished"]), rounds_included=int(control["rounds_included"]),
                )
            if start is None:
                start = torch.empty(self.layout.numel, dtype=torch.float32, device=self.device)
            if control.get("reset_optimizer"):
                self.optimizer.state.clear()
            self.train_round(start, int(control["round"]), int(control["inner_steps"]),
                             control.get("time_budget_s"))
            rounds_trained += 1

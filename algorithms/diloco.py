"""The math of one synchronous DiLoCo round (DESIGN.md, "The round"), as pure functions.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023.

Site side: ``run_inner_steps`` (H local steps) -> ``pseudo_gradient(θ_t, θ_k)`` ->
``UpdateEncoder.encode`` (error feedback + uplink codec). Coordinator side:
``StreamingAggregator.add`` one decoded upload at a time -> ``OuterOptimizer.step`` ->
``encode_downlink`` (error feedback + downlink codec, ``θ_{t+1} = θ_t + D(d_t)``). Site again:
``apply_downlink(θ_t, d_t)`` gives the same ``θ_{t+1}`` bit for bit, checked with
``weights_digest``. The simulator and the real coordinator / site agent call these same functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from geoloco.algorithms.lr_schedule import InnerLRSchedule
from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.workload import Batch
from geoloco.compression import Codec, Encoded, ErrorFeedback, decode, parse_codec

__all__ = [
    "InnerResult",
    "StreamingAggregator",
    "UpdateEncoder",
    "apply_delta",
    "apply_downlink",
    "batch_size",
    "compute_gradient",
    "encode_downlink",
    "pseudo_gradient",
    "run_inner_steps",
]

LossFn = Callable[[nn.Module, Batch], torch.Tensor]


# --------------------------------------------------------------------------------------------
# Site side


@dataclass(slots=True)
class InnerResult:
    """What a site's inner loop reports: per-step losses and the samples it consumed."""

    losses: list[float]
    """Training loss of each inner step (before that step's update)."""
    samples: int
    """Samples seen in these steps (dim 0 of each batch); the weight for ``weighting = "samples"``."""

    @property
    def mean_loss(self) -> float:
        return sum(self.losses) / len(self.losses) if self.losses else float("nan")


def batch_size(batch: Batch) -> int:
    """Samples in a batch: dim 0 of its first tensor (tuples, lists and dicts are searched)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            if isinstance(item, torch.Tensor) and item.dim() > 0:
                return int(item.shape[0])
    return 1


def run_inner_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[Batch],
    steps: int,
    loss_fn: LossFn,
    *,
    grad_clip_norm: float | None = None,
    lr_schedule: InnerLRSchedule | None = None,
) -> InnerResult:
    """Run ``steps`` optimizer steps of ``model`` on the next ``steps`` batches.

    Losses are collected as tensors and read back once at the end, so a CUDA device is
    synchronised once per call, not once per step. ``lr_schedule`` advances after every
    ``optimizer.step()``, so the inner lr follows the site's cumulative step count.
    """
    model.train()
    losses: list[torch.Tensor] = []
    samples = 0
    for _ in range(steps):
        batch = next(batches)
        samples += batch_size(batch)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        if grad_clip_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), grad_clip_norm)
        optimizer.step()
        if lr_schedule is not None:
            lr_schedule.step()
        losses.append(loss.detach())
    values = torch.stack(losses).float().cpu().tolist() if losses else []
    return InnerResult(losses=values, samples=samples)


def compute_gradient(
    model: nn.Module, layout: ParamLayout, batch: Batch, loss_fn: LossFn
) -> tuple[torch.Tensor, float]:
    """One batch's gradient as a flat fp32 vector and the loss (for data-parallel sites)."""
    model.train()
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    grad = layout.flatten_grads(model)
    model.zero_grad(set_to_none=True)
    return grad, float(loss.detach())


def pseudo_gradient(global_flat: torch.Tensor, local_flat: torch.Tensor) -> torch.Tensor:
    """``g_k = θ_t − θ_k``: how far a site moved, pointing the way a gradient would (downhill is −g)."""
    if global_flat.shape != local_flat.shape:
        raise ValueError(
            f"global weights {tuple(global_flat.shape)} and local weights "
            f"{tuple(local_flat.shape)} differ in shape"
        )
    return global_flat.to(torch.float32) - local_flat.to(global_flat.device, torch.float32)


# --------------------------------------------------------------------------------------------
# Encoding with error feedback (both directions)


LOSSLESS_SPEC = "none"
"""Canonical spec of the lossless codec, whose error-feedback residual would always be zero."""


@contextlib.contextmanager
def _seeded_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Run a block with torch's default generators (CPU and ``device``) seeded, then restore them."""
    index = (device.index if device.index is not None else torch.cuda.current_device()) if (
        device.type == "cuda"
    ) else None
    with torch.random.fork_rng(devices=[] if index is None else [index], device_type="cuda"):
        torch.default_generator.manual_seed(seed)
        if index is not None:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


class UpdateEncoder:
    """A codec plus optional error feedback: ``u = x + e``, ``c = C(u)``, ``e ← u − D(c)``.

    Sites use one per site for the uplink (``e_k``); the coordinator uses one for the downlink
    (``e_down``). Error feedback is skipped for the lossless ``"none"`` codec, whose residual is
    always zero, so 64 simulated sites don't hold 64 zero vectors.
    """

    def __init__(
        self, codec: Codec | str, *, error_feedback: bool = True, decay: float = 1.0
    ) -> None:
        self.codec = parse_codec(codec) if isinstance(codec, str) else codec
        self.spec = self.codec.spec
        self.error_feedback: ErrorFeedback | None = None
        if error_feedback and self.spec != LOSSLESS_SPEC:
            self.error_feedback = ErrorFeedback(self.codec, decay=decay)

    @property
    def residual(self) -> torch.Tensor | None:
        """What compression has lost so far (``None`` without error feedback or before any encode)."""
        return None if self.error_feedback is None else self.error_feedback.residual

    def encode(self, update: torch.Tensor, *, seed: int) -> Encoded:
        """Encode ``update`` (+ the residual) and keep what the codec lost for next time.

        The result is a function of ``(update, residual, seed)`` only: codecs that draw from
        torch's default generator (stochastic rounding) run under a generator forked and seeded
        with ``seed``, so neither other code's use of the global RNG nor the order in which sites
        encode changes the bytes.
        """
        with _seeded_rng(seed, update.device):
            if self.error_feedback is None:
                return self.codec.encode(update, seed=seed)
            return self.error_feedback.encode(update, seed=seed)

    def restore(self, encoded: Encoded) -> None:
        """The upload ``encoded`` was not aggregated (a straggler): keep all of it for next time.

        After ``encode``, ``e = u − D(c)``; adding ``D(c)`` back makes the residual the whole
        ``u``, so the site's work reaches the global model one round late instead of never.
        Without error feedback the update is dropped.
        """
        if self.error_feedback is None:
            return
        residual = self.error_feedback.residual
        if residual is None:
            raise ValueError("restore() needs a preceding encode() of the same update")
        decoded = decode(encoded, device=residual.device).reshape(residual.shape)
        residual.add_(decoded.to(residual.dtype))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        if self.error_feedback is None:
            return {}
        return {
            k: v for k, v in self.error_feedback.state_dict().items() if isinstance(v, torch.Tensor)
        }

    def state_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"codec": self.spec, "error_feedback": self.error_feedback is not None}
        if self.error_feedback is not None:
            meta["state"] = {
                k: v
                for k, v in self.error_feedback.state_dict().items()
                if not isinstance(v, torch.Tensor)
            }
        return meta

    def load_state(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        if self.error_feedback is None:
            return
        self.error_feedback.load_state_dict({**meta.get("state", {}), **tensors})


# --------------------------------------------------------------------------------------------
# Coordinator side


@dataclass(slots=True)
class StreamingAggregator:
    """``ĝ = Σ w_k D(c_k) / Σ w_k`` accumulated one upload at a time into one fp32 buffer.

    Coordinator memory is one vector however many sites report; uploads can be added the moment
    they arrive and decoded uploads are dropped right after. Adding the same site twice is an
    error (uploads are idempotent at the transport layer, so a duplicate is a bug).
    ``take_result()`` turns the sum into the mean in place and hands the buffer over, so the
    coordinator's outer step needs no second vector for the mean.
    """

    numel: int
    """Length of the flat update vectors."""
    device: torch.device | str | None = None
    """Where the buffer lives."""
    total_weight: float = field(default=0.0, init=False)
    """Σ w_k of the uploads added so far."""
    sites: list[int] = field(default_factory=list, init=False)
    """Sites added so far, in arrival order."""
    stale_sites: list[int] = field(default_factory=list, init=False)
    """Sites whose previous round's update was folded in late (``add(..., stale=True)``)."""
    _buffer: torch.Tensor | None = field(default=None, init=False, repr=False)
    _taken: bool = field(default=False, init=False, repr=False)

    def add(
        self, update: Encoded | torch.Tensor, weight: float = 1.0, *, site: int, stale: bool = False
    ) -> None:
        """Decode (if encoded) and add ``weight * update`` to the running sum.

        ``stale=True``: the site's update of an earlier round, folded in late (a site may have
        one fresh and one stale update in the same round; each only once).
        """
        if self._taken:
            raise ValueError(
                f"site {site}: this round's mean was already taken (take_result); "
                "start a new aggregator for the next round"
            )
        added = self.stale_sites if stale else self.sites
        if site in added:
            raise ValueError(
                f"site {site} was already aggregated this round{' (late update)' if stale else ''}"
            )
        if not weight > 0:
            raise ValueError(f"site {site}: aggregation weight must be > 0, got {weight}")
        if self._buffer is None:
            self._buffer = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        value = (
            update
            if isinstance(update, torch.Tensor)
            else decode(update, device=self._buffer.device)
        )
        value = value.reshape(-1)
        if value.numel() != self.numel:
            raise ValueError(
                f"site {site} sent {value.numel()} values; the model has {self.numel}"
            )
        self._buffer.add_(value.to(self._buffer), alpha=float(weight))
        self.total_weight += float(weight)
        added.append(site)

    @property
    def count(self) -> int:
        return len(self.sites)

    def result(self) -> torch.Tensor:
        """The weighted mean of everything added (a new tensor; more uploads may follow)."""
        return self._sum() / self.total_weight

    def take_result(self) -> torch.Tensor:
        """The weighted mean, computed in the aggregator's own buffer and handed over.

        No second model-sized vector: the sum is divided in place (the same values as
        ``result()``) and the aggregator keeps no reference, so the mean is freed as soon as the
        caller drops it (``aggregate_round`` frees it right after the outer step). The
        aggregator is spent afterwards: ``add``, ``result`` and ``take_result`` raise.
        """
        mean = self._sum().div_(self.total_weight)
        self._buffer = None
        self._taken = True
        return mean

    def _sum(self) -> torch.Tensor:
        if self._taken:
            raise ValueError("this aggregator's mean was already taken (take_result); start a new one")
        if self._buffer is None:
            raise ValueError("no uploads were aggregated this round; cannot take a mean of nothing")
        return self._buffer


def apply_delta(global_flat: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``θ_{t+1} = θ_t + delta`` as a new fp32 tensor (the one addition every replica performs)."""
    return global_flat + delta.to(global_flat.device, torch.float32).reshape(global_flat.shape)


def apply_downlink(global_flat: torch.Tensor, encoded: Encoded) -> torch.Tensor:
    """What a site does with a broadcast: ``θ_{t+1} = θ_t + D(d_t)``.

    The sum is written into the freshly decoded delta when it is an fp32 vector of the right
    size (the usual case), so applying a broadcast costs one model-sized vector, not two; the
    values are those of ``apply_delta``.
    """
    delta = decode(encoded, device=global_flat.device)
    if (
        delta.dtype != torch.float32
        or global_flat.dtype != torch.float32
        or delta.numel() != global_flat.numel()
    ):
        return apply_delta(global_flat, delta)
    delta = delta.view(global_flat.shape)
    return torch.add(global_flat, delta, out=delta)


def encode_downlink(
    encoder: UpdateEncoder,
    global_flat: torch.Tensor,
    new_flat: torch.Tensor,
    *,
    seed: int,
    consume_new_flat: bool = False,
) -> tuple[Encoded, torch.Tensor]:
    """``d_t = C_down(θ' − θ_t + e_down)`` and the coordinator's own ``θ_{t+1} = θ_t + D(d_t)``.

    The coordinator does not keep ``θ'``: it applies the same decoded bytes the sites receive
    (through ``apply_downlink``, the sites' own code path), so every replica is bit-identical.
    ``consume_new_flat=True`` computes ``θ' − θ_t`` in ``new_flat``'s own memory (same values,
    one model-sized vector fewer) for a caller that drops ``θ'`` afterwards.
    """
    if consume_new_flat and new_flat.dtype == global_flat.dtype and new_flat.shape == global_flat.shape:
        delta = new_flat.sub_(global_flat)
    else:
        delta = new_flat - global_flat
    del new_flat
    encoded = encoder.encode(delta, seed=seed)
    del delta
    return encoded, apply_downlink(global_flat, encoded)

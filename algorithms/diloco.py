"""The math of one synchronous DiLoCo round (docs/architecture.md, "One round"), as pure functions.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023.

Site side: ``run_inner_steps`` (H local steps) -> ``pseudo_gradient(θ_t, θ_k)`` ->
``UpdateEncoder.encode`` (error feedback + uplink codec). Coordinator side:
``RunningSum.add`` (``geoloco.algorithms.aggregation``) one decoded upload at a time -> ``OuterOptimizer.step`` ->
``encode_downlink`` (error feedback + downlink codec, ``θ_{t+1} = θ_t + D(d_t)``). Site again:
``apply_downlink(θ_t, d_t)`` gives the same ``θ_{t+1}`` bit for bit, checked with
``weights_digest``. The simulator and the real coordinator / site agent call these same functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from geoloco.algorithms.lr_schedule import InnerLRSchedule
from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.workload import Batch
from geoloco.compression import Codec, Encoded, ErrorFeedback, decode, parse_codec

__all__ = [
    "InnerResult",
    "UpdateEncoder",
    "apply_delta",
    "apply_downlink",
    "batch_size",
    "compute_gradient",
    "encode_downlink",
    "pseudo_gradient",
    "pseudo_gradient_into_local",
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
    before_step: Callable[[int], None] | None = None,
) -> InnerResult:
    """Run ``steps`` optimizer steps of ``model`` on the next ``steps`` batches.

    Losses are collected as tensors and read back once at the end, so a CUDA device is
    synchronised once per call, not once per step. ``lr_schedule`` advances after every
    ``optimizer.step()``, so the inner lr follows the site's cumulative step count.
    ``before_step(k)`` runs before step ``k`` (0-based) at the step boundary, where a caller
    may change the weights (an asynchronous site taking in a merge: ``rebase_local``).
    """
    model.train()
    losses: list[torch.Tensor] = []
    samples = 0
    for step in range(steps):
        if before_step is not None:
            before_step(step)
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


def rebase_local(local_flat: torch.Tensor, old_global: torch.Tensor, new_global: torch.Tensor) -> None:
    """Move a running local model from ``old_global`` onto ``new_global`` in place, keeping what
    its inner steps since ``old_global`` learned: ``θ_local += θ_new − θ_old``. An asynchronous
    site does this when a merge arrives mid-phase, so its update is then measured against the
    newer model (less stale) and its remaining steps start from a point that holds the merge.
    One formula for the simulator and the site, so both round alike."""
    change = new_global.to(torch.float32) - old_global.to(torch.float32)
    local_flat.add_(change.to(local_flat.device, local_flat.dtype))


def pseudo_gradient_into_local(global_flat: torch.Tensor, local_flat: torch.Tensor) -> torch.Tensor:
    """``pseudo_gradient`` (bit for bit) computed in the memory of ``local_flat``, a fresh copy
    the caller drops: one model-sized vector fewer on a site."""
    if (
        local_flat.dtype == torch.float32 and global_flat.dtype == torch.float32
        and local_flat.device == global_flat.device and local_flat.shape == global_flat.shape
    ):
        return torch.sub(global_flat, local_flat, out=local_flat)
    return pseudo_gradient(global_flat, local_flat)


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

    def encode_added(
        self, pieces: Callable[[], Iterator[tuple[int, torch.Tensor]]], numel: int, *,
        device: torch.device, seed: int,
    ) -> Encoded | None:
        """``encode`` of an update given piece by piece, formed in the error-feedback residual
        (``ErrorFeedback.encode_added``, same bits, no model-sized update vector); None where
        only ``encode`` applies (no error feedback, or the residual refused the pieces)."""
        if self.error_feedback is None:
            return None
        with _seeded_rng(seed, device):
            return self.error_feedback.encode_added(pieces, numel, device=device, seed=seed)

    def restore(self, encoded: Encoded) -> None:
        """The upload ``encoded`` was not aggregated (a straggler): keep all of it for next time.

        After ``encode``, ``e = u − D(c)``; adding ``D(c)`` back makes the residual the whole
        ``u``, so the site's work reaches the global model one round late instead of never.
        Without error feedback the update is dropped; so is one whose residual was reset since it
        was encoded (a later update was refused or not finite: the reset drops what was pending).
        """
        if self.error_feedback is None:
            return
        residual = self.error_feedback.residual
        if residual is None:
            return
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

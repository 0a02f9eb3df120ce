"""Peak-memory estimates per process for the training-time planner (``geoloco.algorithms.simulation.planner``).

An estimate of the tensors each process holds at its peak, from the parameter count and the
configured optimizers and codecs, in bytes (every vector is fp32, 4 bytes per element). It counts
what geoloco allocates per parameter; it leaves out activations (they depend on batch size and
sequence length: add them from your framework's numbers), the CUDA context and allocator slack.

A site (DiLoCo family):

- ``weights``: the model it trains, ``4N``;
- ``gradients``: one gradient per parameter during a step, ``4N``;
- ``inner_optimizer``: AdamW's two moments ``8N``; SGD with momentum ``4N``; plain SGD 0;
- ``global_copy``: ``θ_t``, kept to form the pseudo-gradient ``θ_t − θ_k``, ``4N``;
- ``uplink_residual``: error feedback of a lossy uplink codec, ``4N`` (over all fragments);
- ``transient``: the round's pseudo-gradient (``4F``, ``F`` the largest fragment's elements, ``N``
  without streaming) plus its encoded upload and the encoded broadcast.

A ddp site holds only weights, gradients and the transient (the shared optimizer state lives at the
coordinator, which applies the step).

The coordinator:

- ``weights``: the global model, ``4N``;
- ``outer_optimizer``: Nesterov/SGD momentum ``4N``, FedAdam/FedYogi/Adam ``8N``, plain SGD 0
  (for ddp: the shared inner optimizer's state);
- ``downlink_residual``: error feedback of a lossy downlink codec, ``4N``;
- ``aggregation``: one running-sum buffer ``4F`` (a robust rule holds every site's update:
  ``sites × 4F``);
- ``transient``: the outer step's new fragment ``4F``, one decoded upload ``4F``, every site's
  encoded upload in flight at once (the worst case) and the encoded broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from geoloco.algorithms.algorithm_config import DEFAULT_OUTER_OPTIMIZERS
from geoloco.algorithms.diloco import LOSSLESS_SPEC
from geoloco.algorithms.simulation.planner_sizes import encoded_nbytes
from geoloco.algorithms.training import TrainingConfig
from geoloco.compression import parse_codec

__all__ = ["FP32", "MemoryEstimate", "estimate_memory"]

FP32 = 4
"""Bytes per element of every vector geoloco keeps (weights, states, residuals)."""

ADAPTIVE_OUTER = ("fedadam", "fedyogi", "adam")
"""Outer optimizers with two moment vectors."""


@dataclass(slots=True)
class MemoryEstimate:
    """Bytes per process at its peak, by what holds them (see the module docstring)."""

    site: dict[str, int]
    coordinator: dict[str, int]

    @property
    def site_total(self) -> int:
        return sum(self.site.values())

    @property
    def coordinator_total(self) -> int:
        return sum(self.coordinator.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "site": {**self.site, "total": self.site_total},
            "coordinator": {**self.coordinator, "total": self.coordinator_total},
        }


def _inner_state(training: TrainingConfig, numel: int) -> int:
    inner = training.inner_optimizer
    if inner.name == "adamw":
        return 2 * FP32 * numel
    return FP32 * numel if inner.momentum > 0 else 0


def _outer_state(training: TrainingConfig, numel: int) -> int:
    algo = training.algorithm
    if algo.name == "ddp":
        return _inner_state(training, numel)
    outer = training.outer_optimizer.resolved(DEFAULT_OUTER_OPTIMIZERS.get(algo.name, "nesterov"))
    if outer.name in ADAPTIVE_OUTER:
        return 2 * FP32 * numel
    return FP32 * numel if (outer.momentum or 0) > 0 else 0


def _residual(training: TrainingConfig, spec: str, numel: int) -> int:
    lossy = parse_codec(spec).spec != LOSSLESS_SPEC
    return FP32 * numel if training.algorithm.error_feedback and lossy else 0


def estimate_memory(
    training: TrainingConfig, *, numel: int, fragment_numel: int, num_sites: int
) -> MemoryEstimate:
    """Peak bytes of one site process and of the coordinator for a model of ``numel`` elements
    whose largest synchronised piece (a Streaming DiLoCo fragment, else the model) is
    ``fragment_numel``."""
    algo = training.algorithm
    up = encoded_nbytes(algo.uplink_codec, fragment_numel)
    down = encoded_nbytes(algo.downlink_codec, fragment_numel)
    vector = FP32 * numel
    piece = FP32 * fragment_numel
    if algo.name == "ddp":
        site = {"weights": vector, "gradients": vector, "transient": piece + up + down}
    else:
        site = {
            "weights": vector,
            "gradients": vector,
            "inner_optimizer": _inner_state(training, numel),
            "global_copy": vector,
            "uplink_residual": _residual(training, algo.uplink_codec, numel),
            "transient": piece + up + down,
        }
    held = num_sites if algo.robust_rule.enabled else 1
    coordinator = {
        "weights": vector,
        "outer_optimizer": _outer_state(training, numel),
        "downlink_residual": _residual(training, algo.downlink_codec, numel),
        "aggregation": held * piece,
        "transient": 2 * piece + num_sites * up + down,
    }
    return MemoryEstimate(site=site, coordinator=coordinator)

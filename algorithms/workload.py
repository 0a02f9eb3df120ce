"""The contract between training math and a concrete model + data.

The simulator (here, in ``algorithms``) and the site agent both train through this protocol, so
the built-in workloads in ``geoloco.scenarios.workloads`` and a user's own model are
interchangeable. It lives in ``algorithms`` because the dependency rule forbids ``algorithms``
from importing ``scenarios``; workloads implement it structurally.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

Batch = Any
"""Whatever ``loss`` accepts; for the built-in workloads a tuple of tensors ``(inputs, targets)``."""


@runtime_checkable
class Workload(Protocol):
    """A model family, a per-site data stream and a held-out evaluation."""

    name: str

    def build_model(self, seed: int) -> nn.Module:
        """A freshly initialised model; the same seed gives bit-identical weights."""
        ...

    def site_batches(self, site: int, num_sites: int, seed: int) -> Iterator[Batch]:
        """An endless, deterministic stream of training batches for one site of ``num_sites``.

        Different sites see different (non-IID where the workload has a natural split) data.
        """
        ...

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Scalar training loss of ``model`` on ``batch`` (moves the batch to the model's device)."""
        ...

    def eval_loss(self, model: nn.Module) -> float:
        """Mean loss on a fixed held-out set, identical for every caller (no randomness)."""
        ...

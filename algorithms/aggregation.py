"""Aggregation buffers: the plain weighted running sum every round's uploads are added into.

The coordinator and the simulator both add each decoded upload the moment it arrives; the round
(``geoloco.algorithms.round``) owns one buffer and hands it to the strategy's outer step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from geoloco.compression import Encoded, decode

__all__ = ["RunningSum"]


@dataclass(slots=True)
class RunningSum:
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
    sites: list[str] = field(default_factory=list, init=False)
    """Sites added so far, in arrival order."""
    stale_sites: list[str] = field(default_factory=list, init=False)
    """Sites whose previous round's update was folded in late (``add(..., stale=True)``)."""
    _buffer: torch.Tensor | None = field(default=None, init=False, repr=False)
    _taken: bool = field(default=False, init=False, repr=False)

    def add(
        self, update: Encoded | torch.Tensor, weight: float = 1.0, *, site: str, stale: bool = False
    ) -> None:
        """Decode (if encoded) and add ``weight * update`` to the running sum.

        ``stale=True``: the site's update of an earlier round, folded in late (a site may have
        one fresh and one stale update in the same round; each only once).
        """
        if self._taken:
            raise ValueError(
                f"site {site!r}: this round's mean was already taken (take_result); "
                "start a new aggregator for the next round"
            )
        added = self.stale_sites if stale else self.sites
        if site in added:
            raise ValueError(
                f"site {site!r} was already aggregated this round{' (late update)' if stale else ''}"
            )
        if not weight > 0:
            raise ValueError(f"site {site!r}: aggregation weight must be > 0, got {weight}")
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
                f"site {site!r} sent {value.numel()} values; the model has {self.numel}"
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

"""Aggregations: what a round adds its updates into and takes the mean update from.

Every aggregation has the same interface (``Aggregation``): ``add(update, weight, site=...)``
as updates arrive and ``take_result()`` once at the close, so the round above it
(``geoloco.algorithms.round``) and the strategy's outer step never branch on privacy:

- ``RunningSum``: the plain weighted mean, one fp32 buffer however many sites report.
- ``CentralDPSum``: central differential privacy with a trusted aggregator: each update clipped
  to ``clip_norm``, Gaussian noise added once to the sum.
- ``RobustAggregation`` (``geoloco.algorithms.robust``): clipping to a multiple of the median
  norm, coordinate-wise trimmed mean or median; holds the round's updates until the close.
- the secure (masked) sum, ``geoloco.algorithms.privacy.secure_sum.InMemorySecureSum`` in the simulator;
  the coordinator runs the same protocol over gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from geoloco.algorithms.fixed_point import clip_l2, secure_generator
from geoloco.algorithms.partial import PartialAssignment, PartialMean
from geoloco.algorithms.robust import RobustAggregation, RobustRule
from geoloco.compression import Encoded, add_decoded_into, decode

__all__ = ["Aggregation", "CentralDPSum", "CountingAggregation", "RunningSum", "add_gaussian_noise", "new_aggregation"]


class Aggregation(Protocol):
    """What a round needs of an aggregation."""

    @property
    def sites(self) -> list[str]:
        """Sites added so far, in arrival order."""
        ...

    def add(
        self, update: Encoded | torch.Tensor, weight: float = 1.0, *, site: str, stale: bool = False
    ) -> None: ...

    def take_result(self) -> torch.Tensor:
        """The mean update, handed over once at the close."""
        ...


class CountingAggregation:
    """Who arrived, without tensors: the aggregation of a host that only counts arrivals (the
    planner's rounds, which close by the same engine as the simulator's)."""

    def __init__(self) -> None:
        self._sites: list[str] = []

    @property
    def sites(self) -> list[str]:
        return list(self._sites)

    def add(self, update: Encoded | torch.Tensor, weight: float = 1.0, *, site: str, stale: bool = False) -> None:
        self._sites.append(site)

    def take_result(self) -> torch.Tensor:
        raise ValueError("a counting aggregation holds no updates: its round cannot be stepped")


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
        """Add ``weight * update`` to the running sum; an encoded update is decoded into it
        piece by piece (``geoloco.compression.add_decoded_into``).

        ``stale=True``: the site's update of an earlier round, folded in late (a site may have
        one fresh and one stale update in the same round; each only once).
        """
        added = self._check_new(site, weight, stale)
        numel = update.numel() if isinstance(update, torch.Tensor) else update.numel
        if numel != self.numel:
            raise ValueError(f"site {site!r} sent {numel} values; the model has {self.numel}")
        if self._buffer is None:
            self._buffer = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        if isinstance(update, torch.Tensor):
            self._buffer.add_(update.reshape(-1).to(self._buffer), alpha=float(weight))
        else:
            # Decoded piece by piece into the sum (sparse codecs: only their coordinates), the
            # same numbers as decoding first: no dense copy of the update besides the buffer.
            add_decoded_into(update, self._buffer, scale=float(weight))
        self.total_weight += float(weight)
        added.append(site)

    def add_rows(self, rows: list[tuple[int, Encoded | torch.Tensor]], weight: float = 1.0, *, site: str) -> None:
        """Add ``weight * update`` for an update given as pieces ``(offset, values)`` that tile
        the vector once (a sharded site's shards, ``geoloco.coordinator.shards``): each piece
        straight into its rows of the sum, the same numbers as ``add`` of the assembled vector
        with no model-sized vector assembled. The tiling is checked before anything is added."""
        self._check_new(site, weight, stale=False)
        at = 0
        for offset, length in sorted((offset, _numel(values)) for offset, values in rows):
            if offset != at:  # a gap or an overlap (or a piece outside the vector)
                raise ValueError(
                    f"site {site!r}: its pieces do not cover every value of the update exactly once "
                    f"(a piece starts at {offset}, the previous ones end at {at})"
                )
            at = offset + length
        if at != self.numel:
            raise ValueError(f"site {site!r}: its pieces end at {at}; the model has {self.numel} values")
        if self._buffer is None:
            self._buffer = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        for offset, values in rows:
            piece = self._buffer[offset : offset + _numel(values)]
            if isinstance(values, Encoded):  # decoded piece by piece into the sum, as ``add``
                add_decoded_into(values, piece, scale=float(weight))
            else:
                piece.add_(values.reshape(-1).to(self._buffer), alpha=float(weight))
        self.total_weight += float(weight)
        self.sites.append(site)

    def _check_new(self, site: str, weight: float, stale: bool) -> list[str]:
        """The list ``site`` joins; an error when it may not be added now."""
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
        return added

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


class CentralDPSum:
    """Central DP with a trusted aggregator: ``(Σ clip(u_k) + N(0, (z·C)²)) / n``.

    Each decoded update is clipped to L2 norm ``clip_norm`` (its sensitivity) and added to one
    buffer; Gaussian noise of std ``noise_multiplier · clip_norm`` is added to the sum once, at
    the close, from a CSPRNG-seeded generator (noise must be unpredictable). Weighting is uniform:
    DP configs refuse other weightings and folded late updates.
    """

    def __init__(
        self,
        numel: int,
        *,
        clip_norm: float,
        noise_multiplier: float,
        device: torch.device | str | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self.numel = numel
        self.clip_norm = clip_norm
        self.noise_multiplier = noise_multiplier
        self.device = device
        self.generator = generator
        self._sites: list[str] = []
        self._total: torch.Tensor | None = None
        self.norms: dict[str, float] = {}
        """site -> L2 norm of its update before clipping (for metrics)."""

    @property
    def sites(self) -> list[str]:
        return list(self._sites)

    def add(
        self, update: Encoded | torch.Tensor, weight: float = 1.0, *, site: str, stale: bool = False
    ) -> None:
        if stale:
            raise ValueError("differential privacy does not fold late updates (each site enters once)")
        if site in self._sites:
            raise ValueError(f"site {site!r} was already aggregated this round")
        if self._total is None:
            self._total = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        value = update if isinstance(update, torch.Tensor) else decode(update, device=self._total.device)
        value = value.reshape(-1)
        if value.numel() != self.numel:
            raise ValueError(f"site {site!r} sent {value.numel()} values; the round needs {self.numel}")
        clipped, norm = clip_l2(value, self.clip_norm)
        self._total += clipped.to(self._total)
        self.norms[site] = norm
        self._sites.append(site)

    def take_result(self) -> torch.Tensor:
        if self._total is None:
            raise ValueError("no uploads were aggregated this round; cannot take a mean of nothing")
        total, self._total = self._total, None
        return add_gaussian_noise(total, self.noise_multiplier * self.clip_norm, self.generator) / len(self._sites)


def _numel(values: Encoded | torch.Tensor) -> int:
    return values.numel() if isinstance(values, torch.Tensor) else values.numel


def add_gaussian_noise(total: torch.Tensor, std: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """``total + N(0, std²)`` per coordinate, as a new tensor on ``total``'s device. The noise
    comes from a CSPRNG-seeded CPU generator unless one is given (DP noise must be
    unpredictable, so never from the shared round seeds)."""
    generator = generator if generator is not None else secure_generator()
    noise = torch.randn(total.shape, generator=generator, dtype=total.dtype)
    return total + std * noise.to(total.device)


def new_aggregation(
    numel: int,
    *,
    central_dp: tuple[float, float] | None = None,
    robust: RobustRule | None = None,
    device: torch.device | str | None = None,
    partial: PartialAssignment | None = None,
) -> Aggregation:
    """The aggregation of a round whose updates the aggregator sees one by one (not masked):
    a ``RunningSum``, with ``central_dp = (clip_norm, noise_multiplier)`` a ``CentralDPSum``,
    with an enabled ``robust`` rule a ``RobustAggregation``, with partial updates a
    ``PartialMean`` (each coordinate over the sites that trained it; configuration refuses it
    with the other two). The coordinator's plain intake and the simulator both build their
    rounds' sums here."""
    if partial is not None:
        if central_dp is not None or (robust is not None and robust.enabled):
            raise ValueError("partial updates combine with neither central DP nor robust aggregation")
        return PartialMean(partial, device=device)
    if robust is not None and robust.enabled:
        if central_dp is not None:
            raise ValueError(
                "robust aggregation does not compose with central DP (configuration refuses it: "
                "see geoloco.algorithms.robust.check_robust_privacy)"
            )
        return RobustAggregation(numel=numel, rule=robust, device=device)
    if central_dp is None:
        return RunningSum(numel=numel, device=device)
    clip_norm, noise_multiplier = central_dp
    return CentralDPSum(numel, clip_norm=clip_norm, noise_multiplier=noise_multiplier, device=device)


"""Robust aggregation: a round's mean that one poisoned site cannot drag arbitrarily far.

A plain mean ``Σ w_k u_k / Σ w_k`` follows any single update to infinity: a site that scales its
pseudo-gradient by 100 moves the model 100/N times as far as an honest one. When the coordinator
sees every update (secure aggregation off), it can bound that influence. Three options, set in
``[algorithm]``:

- ``clip_to_median_norm = c`` (c >= 1): before combining, every update whose L2 norm exceeds
  ``c`` times the median norm of the round's updates is scaled down to that norm. A scaled-up
  update then counts no more than an honest one of ``c`` times the typical size; honest updates
  of ordinary size pass unchanged. Works with any weighting (the mean stays weighted).
- ``aggregation = "trimmed_mean"``: per coordinate, the ``⌊trim_fraction · n⌋`` largest and as
  many smallest values are dropped and the rest averaged (Yin et al., 2018). Tolerates up to that
  many poisoned sites per side.
- ``aggregation = "median"``: per coordinate, the median of the ``n`` values (the mean of the two
  middle ones for even ``n``). Tolerates just under half of the sites being poisoned, at the
  price of more noise than a mean when every site is honest.

Cost. A running sum adds each update and forgets it (one model-sized buffer); all three options
need every update of the round at once (the norms' median before any update can be clipped; the
order statistics per coordinate), so the aggregation *holds* the round's decoded fp32 updates
until the close: ``n × model`` bytes instead of ``1 × model``, plus the result and a bounded
chunk of coordinates (``CHUNK_ELEMENTS``) sorted at a time. Clipping is applied as a factor
while combining, so a held update is never modified (no copy of a caller's tensor is needed).

Weights. The trimmed mean and the median are unweighted (every update counts once, a folded late
update too): configuration refuses them with a non-uniform ``weighting`` or ``late_updates =
"fold"``. The clipped mean keeps ``w_k``.

Order. The result does not depend on the order updates arrived in: held updates are combined
in site-name order (fresh before late ones), so the coordinator, whose uploads arrive in any
order, and the simulator, which adds sites by index, compute bitwise the same aggregate.

Robust aggregation needs the individual updates, so it cannot combine with secure aggregation
(the coordinator only sees the masked sum) nor with central DP (which already clips each update
to ``privacy.clip_norm`` and whose sensitivity analysis assumes the plain sum of clipped
updates): ``check_robust_privacy`` refuses both with what is allowed instead.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from geoloco.algorithms.config import ConfigError, require
from geoloco.compression import Encoded, decode

__all__ = [
    "CHUNK_ELEMENTS",
    "ROBUST_AGGREGATIONS",
    "RobustAggregation",
    "RobustRule",
    "check_robust_config",
    "check_robust_privacy",
    "clip_scales",
    "combine",
    "median_of",
]

logger = logging.getLogger(__name__)

ROBUST_AGGREGATIONS: tuple[str, ...] = ("mean", "trimmed_mean", "median")
"""The values ``[algorithm] aggregation`` takes; ``"mean"`` is the plain (weighted) mean."""

CHUNK_ELEMENTS = 1 << 20
"""Values (updates × coordinates) stacked and sorted at once by the trimmed mean and median:
bounds their temporary memory to about 16 MiB (the fp32 stack, its sorted values and the int64
sort indices) whatever the model."""


@dataclass(frozen=True, slots=True)
class RobustRule:
    """How a round's updates are combined when the coordinator sees each of them."""

    aggregation: str = "mean"
    """One of ``ROBUST_AGGREGATIONS``."""
    trim_fraction: float = 0.25
    """``"trimmed_mean"``: share of the updates dropped at each end, per coordinate."""
    clip_to_median_norm: float | None = None
    """Clip every update to this multiple of the round's median update norm; None: no clipping."""

    @property
    def enabled(self) -> bool:
        """Whether anything differs from the plain running mean."""
        return self.aggregation != "mean" or self.clip_to_median_norm is not None

    @property
    def weighted(self) -> bool:
        """Whether site weights enter the result (only the mean, clipped or not)."""
        return self.aggregation == "mean"

    def trimmed(self, count: int) -> int:
        """Updates dropped at each end of every coordinate for a round of ``count`` updates."""
        return math.floor(self.trim_fraction * count) if self.aggregation == "trimmed_mean" else 0


def check_robust_config(
    rule: RobustRule, *, algorithm: str, weighting: str, late_updates: str
) -> None:
    """The ``[algorithm]`` rules of robust aggregation (keys as in ``[algorithm]``)."""
    require(
        rule.aggregation in ROBUST_AGGREGATIONS,
        "aggregation",
        f"got {rule.aggregation!r}; allowed values: {', '.join(ROBUST_AGGREGATIONS)}",
    )
    require(
        math.isfinite(rule.trim_fraction) and 0 <= rule.trim_fraction < 0.5,
        "trim_fraction",
        f"must be in [0, 0.5) (the share dropped at each end), got {rule.trim_fraction}",
    )
    c = rule.clip_to_median_norm
    require(
        c is None or (math.isfinite(c) and c >= 1),
        "clip_to_median_norm",
        f"must be a multiple >= 1 of the median update norm (a multiple below 1 would shrink "
        f"every typical honest update too; 2 to 3 is usual) or unset, got {c}",
    )
    if not rule.enabled:
        return
    require(
        algorithm != "ddp",
        "aggregation" if rule.aggregation != "mean" else "clip_to_median_norm",
        "robust aggregation applies to pseudo-gradient rounds; the ddp baseline averages every "
        "step's gradients plainly: use diloco, fedavg or fedopt, or aggregation = \"mean\" "
        "without clip_to_median_norm",
    )
    if not rule.weighted:
        require(
            weighting == "uniform",
            "weighting",
            f"aggregation = {rule.aggregation!r} counts every update once (order statistics per "
            "coordinate have no weights); set weighting = \"uniform\", or use aggregation = "
            "\"mean\" with clip_to_median_norm, which keeps the weights",
        )
        require(
            late_updates == "drop",
            "late_updates",
            f"aggregation = {rule.aggregation!r} is unweighted, so a folded late update could not "
            "carry its staleness discount; set late_updates = \"drop\", or use aggregation = "
            "\"mean\" with clip_to_median_norm",
        )


def check_robust_privacy(
    rule: RobustRule, *, secure_aggregation: bool, dp: str, num_sites: int | None
) -> None:
    """The rules that need ``[privacy]`` and the number of sites beside ``[algorithm]``."""
    if rule.enabled and secure_aggregation:
        raise ConfigError(
            "algorithm.aggregation" if rule.aggregation != "mean" else "algorithm.clip_to_median_norm",
            "robust aggregation needs each site's update, but with secure aggregation the "
            "coordinator only sees the masked sum; set aggregation = \"mean\" and unset "
            "clip_to_median_norm (privacy.clip_norm already bounds every update's norm), or turn "
            "secure_aggregation off",
        )
    if rule.enabled and dp != "off":
        raise ConfigError(
            "algorithm.aggregation" if rule.aggregation != "mean" else "algorithm.clip_to_median_norm",
            f"robust aggregation does not compose with dp = {dp!r}: its noise is calibrated to the "
            "plain sum of updates clipped to privacy.clip_norm (which already bounds what one "
            "site can add), and a data-dependent clip or an order statistic changes that "
            "sensitivity; set aggregation = \"mean\" and unset clip_to_median_norm, or set "
            "dp = \"off\"",
        )
    if rule.aggregation == "trimmed_mean" and num_sites is not None:
        require(
            rule.trimmed(num_sites) >= 1,
            "algorithm.trim_fraction",
            f"{rule.trim_fraction} of {num_sites} sites trims nothing (⌊{rule.trim_fraction} · "
            f"{num_sites}⌋ = 0), so the trimmed mean would be the plain mean; set trim_fraction "
            f">= {1 / num_sites:.4g} (at least one site per end), or use aggregation = \"median\"",
        )


def median_of(values: Sequence[float]) -> float:
    """The median; the mean of the two middle values for an even count."""
    if not values:
        raise ValueError("the median of no values is undefined")
    ordered = sorted(values)
    n = len(ordered)
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


def clip_scales(norms: Sequence[float], multiple: float) -> tuple[list[float], float]:
    """Per update, the factor that brings its norm down to ``multiple × median(norms)`` (1 for
    those within it), and that threshold."""
    threshold = multiple * median_of(norms)
    scales = [threshold / n if n > threshold else 1.0 for n in norms]
    return scales, threshold


def combine(
    updates: Sequence[torch.Tensor],
    weights: Sequence[float],
    rule: RobustRule,
    *,
    scales: Sequence[float] | None = None,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> torch.Tensor:
    """The robust aggregate of ``updates`` (equal-length flat fp32 vectors, not modified) as a
    new tensor: their weighted mean, trimmed mean or median by ``rule``, each update first
    multiplied by its ``scales`` factor (clipping). Pure; the order of ``updates`` is the order
    the mean adds them in."""
    n = len(updates)
    if n == 0:
        raise ValueError("no uploads were aggregated this round; cannot take a mean of nothing")
    factors = [1.0] * n if scales is None else list(scales)
    numel = updates[0].numel()
    result = torch.zeros(numel, dtype=torch.float32, device=updates[0].device)
    if rule.weighted:
        total = 0.0
        for update, weight, factor in zip(updates, weights, factors, strict=True):
            result.add_(update, alpha=float(weight) * factor)
            total += float(weight)
        return result.div_(total)
    k = rule.trimmed(n)
    step = max(1, chunk_elements // n)
    column = torch.tensor(factors, dtype=torch.float32, device=result.device).unsqueeze(1)
    for start in range(0, numel, step):
        stop = min(numel, start + step)
        block = torch.stack([u[start:stop] for u in updates])
        if scales is not None:
            block.mul_(column)
        ordered = block.sort(dim=0).values
        del block
        if rule.aggregation == "median":
            result[start:stop] = (ordered[(n - 1) // 2] + ordered[n // 2]) / 2
        else:
            result[start:stop] = ordered[k : n - k].mean(dim=0)
    return result


@dataclass(slots=True)
class RobustAggregation:
    """An ``Aggregation`` that holds the round's decoded updates and combines them at the close
    by ``rule`` (see the module docstring for the memory this costs)."""

    numel: int
    """Length of the flat update vectors."""
    rule: RobustRule
    device: torch.device | str | None = None
    """Where the held updates and the result live."""
    sites: list[str] = field(default_factory=list, init=False)
    """Sites added so far, in arrival order."""
    stale_sites: list[str] = field(default_factory=list, init=False)
    """Sites whose previous round's update was folded in late (``add(..., stale=True)``)."""
    norms: dict[str, float] = field(default_factory=dict, init=False)
    """site -> L2 norm of its (fresh) update, once the round closed with clipping on."""
    clip_threshold: float | None = field(default=None, init=False)
    """The norm updates were clipped to in the closed round (None: clipping off)."""
    clipped: list[str] = field(default_factory=list, init=False)
    """Sites whose update was scaled down in the closed round."""
    _held: dict[tuple[bool, str], tuple[torch.Tensor, float]] = field(
        default_factory=dict, init=False, repr=False
    )
    _taken: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.rule.enabled:
            raise ValueError("RobustAggregation needs a robust rule; the plain mean is a RunningSum")

    @property
    def count(self) -> int:
        return len(self.sites)

    @property
    def held_bytes(self) -> int:
        """Bytes of the decoded updates held for the close."""
        return sum(t.numel() * t.element_size() for t, _ in self._held.values())

    def add(
        self, update: Encoded | torch.Tensor, weight: float = 1.0, *, site: str, stale: bool = False
    ) -> None:
        """Hold a site's decoded update until the close (a late one with ``stale=True``)."""
        if self._taken:
            raise ValueError(
                f"site {site!r}: this round's aggregate was already taken (take_result); "
                "start a new aggregator for the next round"
            )
        if stale and not self.rule.weighted:
            raise ValueError(
                f"site {site!r}: aggregation {self.rule.aggregation!r} is unweighted and cannot "
                "fold a late update with its staleness discount (late_updates must be \"drop\")"
            )
        added = self.stale_sites if stale else self.sites
        if site in added:
            raise ValueError(
                f"site {site!r} was already aggregated this round{' (late update)' if stale else ''}"
            )
        if not weight > 0:
            raise ValueError(f"site {site!r}: aggregation weight must be > 0, got {weight}")
        value = update if isinstance(update, torch.Tensor) else decode(update, device=self.device)
        value = value.reshape(-1)
        if value.numel() != self.numel:
            raise ValueError(f"site {site!r} sent {value.numel()} values; the model has {self.numel}")
        self._held[(stale, site)] = (value.to(dtype=torch.float32, device=self.device), float(weight))
        added.append(site)

    def take_result(self) -> torch.Tensor:
        """The robust aggregate; the held updates are released and the aggregator is spent."""
        if self._taken:
            raise ValueError("this aggregator's result was already taken (take_result); start a new one")
        if not self._held:
            raise ValueError("no uploads were aggregated this round; cannot take a mean of nothing")
        keys = sorted(self._held)  # site-name order, fresh before late: arrival order cannot matter
        updates = [self._held[key][0] for key in keys]
        weights = [self._held[key][1] for key in keys]
        scales = None
        multiple = self.rule.clip_to_median_norm
        if multiple is not None:
            # fp32 norms: a threshold needs no more precision, and a float64 copy of every
            # update would cost as much time as the rest of the aggregation.
            norms = [float(torch.linalg.vector_norm(u)) for u in updates]
            scales, self.clip_threshold = clip_scales(norms, multiple)
            self.norms = {site: norm for (stale, site), norm in zip(keys, norms, strict=True) if not stale}
            self.clipped = [site for (_, site), s in zip(keys, scales, strict=True) if s < 1.0]
            if self.clipped:
                logger.info(
                    "robust aggregation: clipped %s to %.4g (%.3g x the median norm)",
                    ", ".join(self.clipped), self.clip_threshold, multiple,
                )
        result = combine(updates, weights, self.rule, scales=scales)
        del updates
        self._held.clear()
        self._taken = True
        return result

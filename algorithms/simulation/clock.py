"""The simulator's virtual clock: compute time from a speed factor, links as latency + bytes/bandwidth.

One synchronous round ``t`` on the clock (all times in seconds, ``k`` a site):

- ``s_k``: site ``k`` holds ``θ_t`` (0 for the first round; else its previous download end).
- ``c_k = s_k + H · step_time_s / speed_factor_k``: it has finished its inner steps.
- ``a_k = c_k + latency_k + 8 · upload_bytes_k / uplink_bps_k``: its upload has fully arrived.
- ``O_t``: the coordinator opened the round (sent ``θ_t``); ``O_1 = 0``, ``O_{t+1} = A_t``.
- Participants and ``A_t`` (aggregation): the round closes by the same ``RoundPolicy`` as the real
  coordinator's (``geoloco.algorithms.round.close_time``): when everyone made it, at ``max a_k``;
  otherwise at the deadline ``O_t + D`` — or, if fewer than ``min_sites`` arrived by then, at the
  ``min_sites``-th arrival — taking everyone who arrived by that time.
- ``r_k = max(A_t, a_k) + latency_k + 8 · download_bytes / downlink_bps_k``: site ``k`` holds
  ``θ_{t+1}`` (a straggler gets it after its own late upload) and starts round ``t + 1``.
- The round ends at ``E_t = max_k r_k`` (every site has the new weights): that is the reported
  virtual wall-clock; a site's utilization is ``(c_k − s_k) / (r_k − s_k)``, the share of its own
  round it spent computing.

Aggregation and the outer step take no virtual time; links are full duplex and independent per
site (no shared bottleneck at the coordinator).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from geoloco.algorithms.config import ConfigError, config_to_dict, require
from geoloco.algorithms.simulation.robust_attack import parse_attack

__all__ = [
    "SiteConfig",
    "download_ends",
    "transfer_time",
    "upload_arrivals",
]


@dataclass(kw_only=True, slots=True)
class SiteConfig:
    """One simulated site: its link to the coordinator and its compute speed."""

    name: str | None = None
    """Label in reports; unset = ``site-<index>``."""
    uplink_bps: float = 1e9
    """Site -> coordinator bandwidth in bits per second (1e9 = 1 Gbit/s)."""
    downlink_bps: float = 1e9
    """Coordinator -> site bandwidth in bits per second."""
    latency_s: float = 0.05
    """One-way latency in seconds, paid once per transfer in each direction."""
    speed_factor: float = 1.0
    """Compute speed relative to the reference site: 0.5 is half as fast (each inner step takes
    ``step_time_s / speed_factor``), 2.0 twice as fast; the same name and meaning as a scenario
    site's ``speed_factor``."""
    attack: str | None = None
    """Research hook (simulator only): upload a poisoned update instead of the honest one,
    ``"scale:F"``, ``"sign_flip"`` or ``"noise:S"`` (``geoloco.algorithms.simulation.robust_attack``);
    unset = an honest site."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        require(self.uplink_bps > 0, "uplink_bps", f"must be > 0 bits/s, got {self.uplink_bps}")
        require(
            self.downlink_bps > 0, "downlink_bps", f"must be > 0 bits/s, got {self.downlink_bps}"
        )
        require(self.latency_s >= 0, "latency_s", f"must be >= 0 seconds, got {self.latency_s}")
        require(
            math.isfinite(self.speed_factor) and self.speed_factor > 0,
            "speed_factor",
            f"must be > 0 (1.0 = the reference site's speed), got {self.speed_factor}",
        )
        if self.attack is not None:
            try:
                parse_attack(self.attack)
            except ValueError as err:
                raise ConfigError("attack", str(err)) from None

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


def transfer_time(nbytes: int, bandwidth_bps: float, latency_s: float) -> float:
    """Seconds to move ``nbytes`` over one link direction: ``latency + 8 · bytes / bandwidth``."""
    return latency_s + 8.0 * nbytes / bandwidth_bps


def upload_arrivals(
    starts: Sequence[float],
    compute_s: Sequence[float],
    upload_bytes: Sequence[int],
    sites: Sequence[SiteConfig],
) -> list[float]:
    """``a_k = s_k + compute_k + latency_k + 8 · bytes_k / uplink_bps_k`` for every site."""
    return [
        start + compute + transfer_time(nbytes, site.uplink_bps, site.latency_s)
        for start, compute, nbytes, site in zip(starts, compute_s, upload_bytes, sites, strict=True)
    ]


def download_ends(
    aggregate_s: float,
    arrivals: Sequence[float],
    download_bytes: int | Sequence[int],
    sites: Sequence[SiteConfig],
) -> list[float]:
    """``r_k = max(A_t, a_k) + latency_k + 8 · bytes / downlink_bps_k`` for every site."""
    sizes = (
        [download_bytes] * len(sites) if isinstance(download_bytes, int) else list(download_bytes)
    )
    return [
        max(aggregate_s, arrival) + transfer_time(nbytes, site.downlink_bps, site.latency_s)
        for arrival, nbytes, site in zip(arrivals, sizes, sites, strict=True)
    ]

"""Two tiers on a virtual clock: sites -> regional relay -> coordinator, against the same sites
flat, with the coordinator's own link shared by every transfer that crosses it.

``geoloco.algorithms.clock`` gives every site its own independent link to the coordinator, so
the number of sites never slows a round there; relays only pay off when the coordinator's link
is the bottleneck. This module adds that link and the relay tier (pure arithmetic, seconds and
bytes; the real relay is ``geoloco.relay``):

- A transfer over a path of links in series takes ``latency + 8 · bytes / bps`` of its slowest
  private link, and also queues for the one shared link (the coordinator's ingress for uploads,
  its egress for broadcasts), which serves transfers one at a time in the order they become ready
  (FIFO, each at the shared link's full rate): it ends at the later of the two.
- Flat: site ``k`` finishes computing at ``c_k``; its upload crosses its own uplink and the
  coordinator's ingress; the round aggregates when every upload is in (no deadline); the
  coordinator sends every site the broadcast through its egress, then down the site's link.
- Relayed: site ``k``'s upload crosses its link to its region's relay (``SiteConfig`` links are
  the intra-region links here); a relay forwards one partial sum of ``partial_bytes`` once all
  its sites are in, over the region's link and the coordinator's ingress; the coordinator sends
  one broadcast per relay through its egress and the region's downlink, and each relay sends it on
  to its sites over their links.

Relay processing (decode and sum) takes no virtual time, as aggregation takes none in the clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from geoloco.algorithms.clock import SiteConfig, transfer_time
from geoloco.algorithms.config import require

__all__ = ["CoordinatorLink", "RegionConfig", "TierRound", "flat_round", "relayed_round", "shared_fifo"]


@dataclass(kw_only=True, slots=True)
class CoordinatorLink:
    """The coordinator's own network link, shared by all its transfers."""

    ingress_bps: float = 1e9
    egress_bps: float = 1e9

    def __post_init__(self) -> None:
        require(self.ingress_bps > 0, "ingress_bps", f"must be > 0 bits/s, got {self.ingress_bps}")
        require(self.egress_bps > 0, "egress_bps", f"must be > 0 bits/s, got {self.egress_bps}")


@dataclass(kw_only=True, slots=True)
class RegionConfig:
    """One region: its sites (indices into the run's sites) and its relay's link upward."""

    name: str
    sites: list[int] = field(default_factory=list)
    uplink_bps: float = 1e9
    """Relay -> coordinator bandwidth, bits per second."""
    downlink_bps: float = 1e9
    latency_s: float = 0.05

    def __post_init__(self) -> None:
        require(len(self.sites) > 0, "sites", f"region {self.name!r} needs at least one site")
        require(self.uplink_bps > 0 and self.downlink_bps > 0, "uplink_bps", "link bandwidths must be > 0 bits/s")
        require(self.latency_s >= 0, "latency_s", f"must be >= 0 seconds, got {self.latency_s}")


@dataclass(frozen=True, slots=True)
class TierRound:
    """One round on the clock."""

    aggregate_s: float
    """When the coordinator had every upload (or partial sum)."""
    ends: list[float]
    """Per site: when it holds the new weights."""
    coordinator_bytes_in: int
    coordinator_bytes_out: int

    @property
    def end_s(self) -> float:
        return max(self.ends)


def shared_fifo(ready: Sequence[float], nbytes: Sequence[int], bps: float) -> list[float]:
    """When each transfer is through one shared link that serves them one at a time, in the order
    they become ready (ties in index order), each at the link's full rate."""
    done = [0.0] * len(ready)
    free = float("-inf")
    for k in sorted(range(len(ready)), key=lambda i: (ready[i], i)):
        free = max(ready[k], free) + 8.0 * nbytes[k] / bps
        done[k] = free
    return done


def _through(
    ready: Sequence[float], nbytes: Sequence[int], private: Sequence[tuple[float, float]], shared_bps: float
) -> list[float]:
    """Transfers ready at ``ready`` over their private link ``(bps, latency)`` and one shared link:
    each ends at the later of its private-link time and its turn on the shared link."""
    starts = [t + latency for t, (_, latency) in zip(ready, private, strict=True)]
    queued = shared_fifo(starts, nbytes, shared_bps)
    return [
        max(q, s + 8.0 * n / bps) for q, s, n, (bps, _) in zip(queued, starts, nbytes, private, strict=True)
    ]


def flat_round(
    computed_s: Sequence[float],
    upload_bytes: Sequence[int],
    download_bytes: int,
    sites: Sequence[SiteConfig],
    link: CoordinatorLink,
) -> TierRound:
    """Every site straight to the coordinator (module doc)."""
    arrivals = _through(computed_s, upload_bytes, [(s.uplink_bps, s.latency_s) for s in sites], link.ingress_bps)
    aggregate = max(arrivals)
    ends = _through(
        [aggregate] * len(sites), [download_bytes] * len(sites),
        [(s.downlink_bps, s.latency_s) for s in sites], link.egress_bps,
    )
    return TierRound(
        aggregate_s=aggregate, ends=ends, coordinator_bytes_in=sum(upload_bytes),
        coordinator_bytes_out=download_bytes * len(sites),
    )


def relayed_round(
    computed_s: Sequence[float],
    upload_bytes: Sequence[int],
    download_bytes: int,
    partial_bytes: int,
    sites: Sequence[SiteConfig],
    regions: Sequence[RegionConfig],
    link: CoordinatorLink,
) -> TierRound:
    """The same sites behind one relay per region (module doc); every site in exactly one region."""
    covered = sorted(k for r in regions for k in r.sites)
    require(covered == list(range(len(sites))), "regions", "every site must be in exactly one region")
    at_relay = [
        c + transfer_time(n, s.uplink_bps, s.latency_s) for c, n, s in zip(computed_s, upload_bytes, sites, strict=True)
    ]
    relay_ready = [max(at_relay[k] for k in r.sites) for r in regions]
    arrivals = _through(
        relay_ready, [partial_bytes] * len(regions), [(r.uplink_bps, r.latency_s) for r in regions], link.ingress_bps
    )
    aggregate = max(arrivals)
    at_relays = _through(
        [aggregate] * len(regions), [download_bytes] * len(regions),
        [(r.downlink_bps, r.latency_s) for r in regions], link.egress_bps,
    )
    ends = [0.0] * len(sites)
    for r, got in zip(regions, at_relays, strict=True):
        for k in r.sites:
            ends[k] = got + transfer_time(download_bytes, sites[k].downlink_bps, sites[k].latency_s)
    return TierRound(
        aggregate_s=aggregate, ends=ends, coordinator_bytes_in=partial_bytes * len(regions),
        coordinator_bytes_out=download_bytes * len(regions),
    )

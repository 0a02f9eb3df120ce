"""Two tiers on a virtual clock: sites -> regional relay -> coordinator, against the same sites
flat, with the coordinator's own link shared by every transfer that crosses it.

``geoloco.algorithms.simulation.clock`` gives every site its own independent link to the coordinator, so
the number of sites never slows a round there; relays only pay off when the coordinator's link
is the bottleneck. This module adds that link and the relay tier (pure arithmetic, seconds and
bytes; the real relay is ``geoloco.relay``):

- A transfer over a path of links in series starts ``latency`` after it is ready and moves its
  bytes at the rate its private link and the one shared link (the coordinator's ingress for
  uploads, its egress for broadcasts) allow together: the shared link is divided fairly among the
  transfers crossing it at each moment (max-min: a transfer its private link holds below an
  equal share takes only what that link carries, the others share the rest), as TCP flows through
  one bottleneck, and as the emulator's shared token bucket, serving every connection's segments
  in turn, does. (Serving one transfer at a time at the full rate, as this clock did until
  2026-12-05, let one region start its next round a whole transfer early and put the planner 17-24 %
  short of the emulated regions scenario.)
- Flat: site ``k`` finishes computing at ``c_k``; its upload crosses its own uplink and the
  coordinator's ingress; the round aggregates when every upload is in (no deadline); the
  coordinator sends every site the broadcast through its egress, then down the site's link.
- Relayed: site ``k``'s upload crosses its link to its region's relay (``SiteConfig`` links are
  the intra-region links here); a relay forwards one partial sum of ``partial_bytes`` once all
  its sites are in, over the region's link and the coordinator's ingress; the coordinator sends
  one broadcast per relay through its egress and the region's downlink, and each relay sends it on
  to its sites over their links.
- Secure rounds (``[privacy] secure_aggregation``, with or without DP): a site's upload is every
  message it sends in the protocol (keys, shares, masked vector, signature, unmask answers), as
  flat. What its relay sends upward is what ``geoloco.relay`` sends: the ring sum of its sites'
  masked vectors, one masked vector's bytes whatever the ``upward_codec``, plus each site's stage
  messages passed on unchanged (``TwoTierClock.partial_bytes``). As flat, a round's messages are
  charged as one transfer per site (per relay), not stage by stage.

Relay processing (decode and sum) takes no virtual time, as aggregation takes none in the clock.

The declaration a run file makes (``[[regions]]`` with site names, ``[coordinator_link]``) is
``RegionSpec`` / ``CoordinatorLinkSpec``: ``geoloco emulate`` starts relays from it and
``geoloco simulate`` charges the same two tiers through ``TwoTierClock``, per round, in place of
``clock.upload_arrivals`` / ``clock.download_ends``. Both take and refuse what the coordinator
takes and refuses with ``[relays]`` (``check_regions``): plain and secure rounds, with DP when
secure.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from geoloco.algorithms.algorithm_config import AlgorithmConfig
from geoloco.algorithms.config import ConfigError, config_to_dict, require
from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
from geoloco.algorithms.simulation.clock import SiteConfig, transfer_time

__all__ = [
    "CoordinatorLink",
    "CoordinatorLinkSpec",
    "RegionConfig",
    "RegionSpec",
    "TierRound",
    "TwoTierClock",
    "check_regions",
    "check_relayed_round",
    "fair_rates",
    "flat_round",
    "relayed_round",
    "shared_fair",
]

RELAY_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
"""A relay's name becomes a certificate and a file name: the site-name rule
(``geoloco.protos.identity``)."""
UPWARD_CODECS = ("none", "uplink")
"""A relay's codecs for its partial sum (``geoloco.relay.config.UPWARD_CODECS``): ``none`` sends
float32, ``uplink`` the run's uplink codec (about one site's upload)."""


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


def fair_rates(caps: Sequence[float], shared_bps: float) -> list[float]:
    """Max-min fair shares of ``shared_bps`` among transfers each capped at ``caps[k]`` bit/s."""
    rates = [0.0] * len(caps)
    left, count = shared_bps, len(caps)
    for k in sorted(range(len(caps)), key=lambda i: caps[i]):
        share = left / count
        rates[k] = min(caps[k], share)
        left -= rates[k]
        count -= 1
    return rates


def shared_fair(
    starts: Sequence[float], nbytes: Sequence[int], caps: Sequence[float], shared_bps: float
) -> list[float]:
    """When each transfer, moving ``nbytes[k]`` from ``starts[k]`` at most at ``caps[k]`` bit/s
    (its private link), is through one shared link of ``shared_bps`` divided max-min fairly among
    the transfers on it at each moment (module doc)."""
    n = len(starts)
    if math.isinf(shared_bps):
        return [s + 8.0 * b / c for s, b, c in zip(starts, nbytes, caps, strict=True)]
    done = [0.0] * n
    left = [8.0 * b for b in nbytes]
    waiting = sorted(range(n), key=lambda i: (starts[i], i))
    active: list[int] = []
    now = starts[waiting[0]] if waiting else 0.0
    w = 0
    while w < n or active:
        while w < n and starts[waiting[w]] <= now:
            k = waiting[w]
            w += 1
            if left[k] <= 0.0:
                done[k] = starts[k]
            else:
                active.append(k)
        if not active:
            if w == n:
                break
            now = starts[waiting[w]]
            continue
        rates = fair_rates([caps[k] for k in active], shared_bps)
        finish = min(left[k] / r for k, r in zip(active, rates, strict=True))
        step = max(0.0, min(finish, starts[waiting[w]] - now) if w < n else finish)
        now += step
        still: list[int] = []
        for k, r in zip(active, rates, strict=True):
            if left[k] / r <= step:  # this one's last bit went within the step
                done[k] = now
            else:
                left[k] = max(0.0, left[k] - r * step)
                still.append(k)
        active = still
    return done


def _through(
    ready: Sequence[float], nbytes: Sequence[int], private: Sequence[tuple[float, float]], shared_bps: float
) -> list[float]:
    """Transfers ready at ``ready`` over their private link ``(bps, latency)`` and one shared link
    (``shared_fair``)."""
    starts = [t + latency for t, (_, latency) in zip(ready, private, strict=True)]
    return shared_fair(starts, nbytes, [bps for bps, _ in private], shared_bps)


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


# -- the declaration a run file makes --------------------------------------------------------------


def _bandwidth(value: float | None, key: str) -> None:
    require(
        value is None or (math.isfinite(value) and value >= 1000),
        key,
        f"must be a bandwidth >= 1000 bits/s (e.g. 1e8 for 100 Mbit/s) or unset, got {value}",
    )


@dataclass(kw_only=True, slots=True)
class RegionSpec:
    """``[[regions]]``: one relay, the sites behind it (by name) and its link to the coordinator.
    A listed site's own link is then its link to the relay."""

    name: str
    """The relay's name (its certificate, the coordinator's ``[relays]`` key, ``relay:NAME`` in
    the metrics)."""
    sites: list[str] = field(default_factory=list)
    """Names of the sites behind this relay."""
    uplink_bps: float = 1e8
    """Relay -> coordinator bandwidth in bits per second."""
    downlink_bps: float = 1e8
    """Coordinator -> relay bandwidth in bits per second."""
    latency_s: float = 0.05
    """One-way latency between the relay and the coordinator."""
    upward_codec: str = "none"
    """Codec of the relay's partial sum: ``none`` (float32, the flat result) or ``uplink`` (the
    run's uplink codec, with the relay's own error feedback)."""
    max_wait_s: float = 30.0
    """The relay sends its partial once every site that joined through it uploaded, or this long
    after the round's first upload (emulator only: the clock waits for every site)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        require(
            RELAY_NAME_RE.fullmatch(self.name) is not None,
            "name",
            f"invalid relay name {self.name!r}: 1-63 letters, digits, '.', '_', '-', starting with a letter or digit",
        )
        require(len(self.sites) > 0, "sites", f"region {self.name!r} needs at least one site")
        _bandwidth(self.uplink_bps, "uplink_bps")
        _bandwidth(self.downlink_bps, "downlink_bps")
        require(0 <= self.latency_s <= 10, "latency_s", f"must be in 0..10 seconds, got {self.latency_s}")
        require(
            self.upward_codec in UPWARD_CODECS,
            "upward_codec",
            f"got {self.upward_codec!r}; allowed: {', '.join(UPWARD_CODECS)}",
        )
        require(self.max_wait_s > 0, "max_wait_s", f"must be > 0 seconds, got {self.max_wait_s}")

    def clock_region(self, site_names: Sequence[str]) -> RegionConfig:
        """The clock's view of this region (site names to indices into ``site_names``)."""
        names = list(site_names)
        return RegionConfig(
            name=self.name, sites=[names.index(s) for s in self.sites], uplink_bps=self.uplink_bps,
            downlink_bps=self.downlink_bps, latency_s=self.latency_s,
        )

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


@dataclass(kw_only=True, slots=True)
class CoordinatorLinkSpec:
    """``[coordinator_link]``: the coordinator's own link, shared by every site (flat) or relay
    that crosses it; an unset direction is not shaped (infinitely fast on the clock)."""

    ingress_bps: float | None = None
    """Bits per second into the coordinator (uploads, partial sums)."""
    egress_bps: float | None = None
    """Bits per second out of the coordinator (broadcasts, model fetches)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _bandwidth(self.ingress_bps, "ingress_bps")
        _bandwidth(self.egress_bps, "egress_bps")

    @property
    def shaped(self) -> bool:
        return self.ingress_bps is not None or self.egress_bps is not None

    def clock_link(self) -> CoordinatorLink:
        return CoordinatorLink(
            ingress_bps=self.ingress_bps if self.ingress_bps is not None else math.inf,
            egress_bps=self.egress_bps if self.egress_bps is not None else math.inf,
        )

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


def check_regions(
    regions: Sequence[RegionSpec], site_names: Sequence[str], *, privacy: PrivacyConfig, algorithm: AlgorithmConfig
) -> None:
    """Every site in exactly one region, relay names unique and none a site's, and a round a
    relay can carry (``check_relayed_round``); raises ``ConfigError`` naming the key
    (``regions[i]...``, ``privacy.dp``, ``algorithm...``) and what is allowed."""
    if not regions:
        return
    owner: dict[str, str] = {}
    for i, region in enumerate(regions):
        key = f"regions[{i}]"
        if any(r.name == region.name for r in regions[:i]):
            raise ConfigError(f"{key}.name", f"region {region.name!r} is declared twice")
        require(
            region.name != "coordinator" and region.name not in site_names,
            f"{key}.name",
            f"{region.name!r} is the coordinator's or a site's name; a relay needs its own",
        )
        for j, site in enumerate(region.sites):
            require(site in site_names, f"{key}.sites[{j}]", f"no site named {site!r}; sites: {', '.join(site_names)}")
            require(
                site not in owner,
                f"{key}.sites[{j}]",
                f"site {site!r} is already in region {owner.get(site)!r}; a site belongs to one region",
            )
            owner[site] = region.name
    missing = [s for s in site_names if s not in owner]
    require(
        not missing,
        "regions",
        f"every site must be in a region once [[regions]] are declared; not in any: {', '.join(missing)}",
    )
    check_relayed_round(privacy, algorithm)


def check_relayed_round(privacy: PrivacyConfig, algorithm: AlgorithmConfig) -> None:
    """What the coordinator refuses with ``[relays]`` (``CoordinatorConfig``), refused alike by
    ``geoloco simulate`` and ``geoloco emulate`` with ``[[regions]]``: a relay sends a partial sum
    (plain rounds) or a masked ring sum (secure rounds, with or without DP), never a site's own
    update."""
    require(
        privacy.unmasked_central_dp is None,
        "privacy.dp",
        "dp = 'central' without secure aggregation clips and noises each site's update at the "
        "coordinator, which sees only a relay's partial sum; with [[regions]] allowed: 'off', or "
        "'central' / 'distributed' with secure_aggregation = true (the sites clip); or drop [[regions]]",
    )
    require(
        algorithm.aggregation == "mean",
        "algorithm.aggregation",
        f"got {algorithm.aggregation!r}; with [[regions]] allowed: 'mean' (robust rules need every "
        "site's own update, a relay sends a partial sum); or drop [[regions]]",
    )
    require(
        algorithm.clip_to_median_norm is None,
        "algorithm.clip_to_median_norm",
        "must be unset with [[regions]] (the median norm needs every site's own update, a relay "
        "sends a partial sum); or drop [[regions]]",
    )
    require(
        algorithm.late_updates == "drop",
        "algorithm.late_updates",
        f"got {algorithm.late_updates!r}; with [[regions]] allowed: 'drop' (late updates are not "
        "folded through relays); or drop [[regions]]",
    )
    require(
        not algorithm.partial_updates.enabled,
        "algorithm.partial_updates.enabled",
        "must be false with [[regions]] (each site uploads only its own group's parameters, a "
        "relay adds updates of one shape); or drop [[regions]]",
    )


# -- the clock a simulated run uses ----------------------------------------------------------------


@dataclass(slots=True)
class TwoTierClock:
    """Per round: when each site's update reaches the coordinator, and when each site holds the
    new weights, over the shared coordinator link and (with regions) the relay tier."""

    sites: list[SiteConfig]
    link: CoordinatorLink
    regions: list[RegionConfig]
    upward_codecs: list[str]

    @classmethod
    def from_specs(
        cls, sites: Sequence[SiteConfig], names: Sequence[str], regions: Sequence[RegionSpec], link: CoordinatorLinkSpec
    ) -> TwoTierClock:
        return cls(
            list(sites), link.clock_link(), [r.clock_region(names) for r in regions], [r.upward_codec for r in regions]
        )

    def partial_bytes(
        self, region: int, upload_bytes: Sequence[int], numel: int, masked_bytes: Sequence[int | None] | None = None
    ) -> int:
        """Bytes a region's relay sends upward in a round: its partial sum, float32 (``none``) or
        its largest site upload (``uplink``). In a secure round (``masked_bytes``: per site, the
        bytes of its masked vector within its upload) the ring sum, one masked vector, plus the
        rest of each site's protocol messages, which the relay passes on unchanged (module doc)."""
        sites = self.regions[region].sites
        if masked_bytes is not None:
            masked = [m for k in sites if (m := masked_bytes[k]) is not None]
            if len(masked) == len(sites):
                return max(masked) + sum(upload_bytes[k] for k in sites) - sum(masked)
        if self.upward_codecs[region] == "none":
            return 4 * numel
        return max(upload_bytes[k] for k in sites)

    def arrivals(
        self,
        finished_s: Sequence[float],
        upload_bytes: Sequence[int],
        numel: int,
        masked_bytes: Sequence[int | None] | None = None,
    ) -> list[float]:
        """When each site's update is at the coordinator: its own upload (flat) or its region's
        partial sum, which leaves once every site of the region reached the relay.
        ``masked_bytes``: a secure round's masked vectors within the uploads (``partial_bytes``);
        None, or None for a site, in a plain round."""
        sites = self.sites
        if not self.regions:
            private = [(s.uplink_bps, s.latency_s) for s in sites]
            return _through(finished_s, upload_bytes, private, self.link.ingress_bps)
        at_relay = [
            f + transfer_time(n, s.uplink_bps, s.latency_s)
            for f, n, s in zip(finished_s, upload_bytes, sites, strict=True)
        ]
        ready = [max(at_relay[k] for k in r.sites) for r in self.regions]
        partials = [self.partial_bytes(i, upload_bytes, numel, masked_bytes) for i in range(len(self.regions))]
        up = _through(ready, partials, [(r.uplink_bps, r.latency_s) for r in self.regions], self.link.ingress_bps)
        result = [0.0] * len(sites)
        for r, arrival in zip(self.regions, up, strict=True):
            for k in r.sites:
                result[k] = arrival
        return result

    def ends(self, aggregate_s: float, download_bytes: int) -> list[float]:
        """When each site holds the round's broadcast (sent once per relay with regions)."""
        sites = self.sites
        if not self.regions:
            return _through(
                [aggregate_s] * len(sites), [download_bytes] * len(sites),
                [(s.downlink_bps, s.latency_s) for s in sites], self.link.egress_bps,
            )
        at_relays = _through(
            [aggregate_s] * len(self.regions), [download_bytes] * len(self.regions),
            [(r.downlink_bps, r.latency_s) for r in self.regions], self.link.egress_bps,
        )
        ends = [0.0] * len(sites)
        for r, got in zip(self.regions, at_relays, strict=True):
            for k in r.sites:
                ends[k] = got + transfer_time(download_bytes, sites[k].downlink_bps, sites[k].latency_s)
        return ends

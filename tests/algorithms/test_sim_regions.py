"""The two-tier virtual clock (``geoloco.algorithms.simulation.sim_regions``): its shared coordinator link,
its agreement with the plain clock when that link is not a bottleneck, and the issue's target
for 64 sites in 4 regions."""

from __future__ import annotations

import pytest

from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.simulation.clock import SiteConfig, download_ends, upload_arrivals
from geoloco.algorithms.simulation.planner_sizes import encoded_nbytes
from geoloco.algorithms.simulation.sim_regions import (
    CoordinatorLink,
    RegionConfig,
    fair_rates,
    flat_round,
    relayed_round,
    shared_fair,
)

INF = float("inf")


def test_a_shared_link_is_divided_fairly_among_the_transfers_on_it() -> None:
    # 1000 bytes = 8000 bits; alone at 8000 bit/s a transfer takes 1 s.
    assert shared_fair([0.0, 0.0], [1000, 1000], [INF, INF], 8000) == [2.0, 2.0]
    # The first has the link alone for 0.5 s (half its bits), then both share it: the first ends at
    # 1.5 s; the second sent 4000 bits by then and ends alone 0.5 s later; the third is alone.
    assert shared_fair([0.0, 0.5, 5.0], [1000, 1000, 1000], [INF, INF, INF], 8000) == [1.5, 2.0, 6.0]
    assert shared_fair([2.0, 0.0], [1000, 1000], [INF, INF], 8000) == [3.0, 1.0]
    assert shared_fair([1.0], [0], [INF], 8000) == [1.0]


def test_a_transfer_held_below_its_share_by_its_own_link_leaves_the_rest_to_the_others() -> None:
    assert fair_rates([2000.0, INF, INF], 8000) == [2000.0, 3000.0, 3000.0]
    assert fair_rates([5000.0, 5000.0], 8000) == [4000.0, 4000.0]
    # 2000 bit/s private link: 4 s whatever the others do; the other takes 6000 bit/s meanwhile.
    done = shared_fair([0.0, 0.0], [1000, 1000], [2000.0, INF], 8000)
    assert done == pytest.approx([4.0, 8000 / 6000])


def test_an_unshaped_shared_link_leaves_each_transfer_its_own_link() -> None:
    assert shared_fair([0.5, 1.0], [1000, 3000], [8000.0, 16000.0], INF) == [1.5, 2.5]


def test_flat_with_an_idle_coordinator_link_is_the_plain_clock() -> None:
    sites = [SiteConfig(uplink_bps=1e6 * (k + 1), downlink_bps=2e6, latency_s=0.01 * k) for k in range(3)]
    computed, up, down = [1.0, 2.0, 1.5], [10_000, 20_000, 30_000], 50_000
    fast = CoordinatorLink(ingress_bps=1e15, egress_bps=1e15)
    got = flat_round(computed, up, down, sites, fast)
    arrivals = upload_arrivals(computed, [0.0] * 3, up, sites)
    assert got.aggregate_s == pytest.approx(max(arrivals))
    assert got.ends == pytest.approx(download_ends(max(arrivals), arrivals, down, sites))


def test_64_sites_in_4_regions_relayed_round_is_under_a_quarter_of_flat() -> None:
    """The issue's simulator scenario: coordinator link 1 Gbit/s, intra-region 10 Gbit/s, a
    100M-parameter model's bytes with int8 up and down; relays send a float32 partial."""
    numel = 100_000_000
    up = encoded_nbytes("int8", numel)
    sites = [SiteConfig(uplink_bps=10e9, downlink_bps=10e9, latency_s=0.005) for _ in range(64)]
    regions = [
        RegionConfig(name=f"r{r}", sites=list(range(16 * r, 16 * r + 16)), uplink_bps=1e9, downlink_bps=1e9)
        for r in range(4)
    ]
    link = CoordinatorLink(ingress_bps=1e9, egress_bps=1e9)
    computed = [0.0] * 64
    flat = flat_round(computed, [up] * 64, up, sites, link)
    relayed = relayed_round(computed, [up] * 64, up, 4 * numel, sites, regions, link)
    assert relayed.end_s <= flat.end_s / 4
    assert relayed.coordinator_bytes_out * 16 == flat.coordinator_bytes_out  # relays / sites
    assert relayed.coordinator_bytes_in < flat.coordinator_bytes_in


def test_regions_must_cover_every_site_once() -> None:
    sites = [SiteConfig() for _ in range(3)]
    with pytest.raises(ConfigError, match="exactly one region"):
        relayed_round([0.0] * 3, [1] * 3, 1, 1, sites, [RegionConfig(name="a", sites=[0, 1])], CoordinatorLink())

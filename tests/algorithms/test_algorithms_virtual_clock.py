"""The simulator's virtual clock on hand-checked numbers."""

from __future__ import annotations

import pytest

from geoloco.algorithms.config import ConfigError, config_from_dict
from geoloco.algorithms.privacy.secagg_in_memory import SiteTraffic
from geoloco.algorithms.round import RoundPolicy
from geoloco.algorithms.simulation.clock import SiteConfig, download_ends, transfer_time, upload_arrivals
from geoloco.algorithms.simulation.secure_clock import masked_arrivals, unmasked_at


def _round(*, open_s, starts, compute_s, upload_bytes, download_bytes, sites, deadline_s=None, min_sites=1):
    """One round on the virtual clock: arrivals, the policy's close, downloads, utilization."""
    arrivals = upload_arrivals(starts, compute_s, upload_bytes, sites)
    policy = RoundPolicy(min_sites=min_sites, round_deadline_s=deadline_s)
    closed = policy.close_time(arrivals, start_s=open_s, deadline_s=policy.deadline_s())
    ends = download_ends(closed, arrivals, download_bytes, sites)
    included = tuple(k for k, a in enumerate(arrivals) if a <= closed)
    utilization = [c / (e - s) for c, e, s in zip(compute_s, ends, starts, strict=True)]
    return included, arrivals, closed, ends, utilization


def test_transfer_time_is_latency_plus_bits_over_bandwidth() -> None:
    # 1 MB over 8 Mbit/s = 1 s, plus 50 ms latency.
    assert transfer_time(1_000_000, 8e6, 0.05) == pytest.approx(1.05)


def test_round_hand_checked() -> None:
    """Two sites, 10 inner steps of 0.1 s; site 1 is twice as slow and has a thinner uplink.

    site 0: compute 10·0.1·1 = 1.0 s; upload 0.01 + 8·1e6/8e7 = 0.11 s -> arrives 1.11
    site 1: compute 10·0.1·2 = 2.0 s; upload 0.02 + 8·1e6/4e7 = 0.22 s -> arrives 2.22
    A = 2.22; download 0.5 MB: site 0 0.01 + 8·5e5/1.6e8 = 0.035 -> 2.255;
                               site 1 0.02 + 8·5e5/8e6  = 0.52  -> 2.74
    utilization: site 0 1.0/2.255, site 1 2.0/2.74; round ends at 2.74.
    """
    sites = [
        SiteConfig(uplink_bps=8e7, downlink_bps=1.6e8, latency_s=0.01),
        SiteConfig(uplink_bps=4e7, downlink_bps=8e6, latency_s=0.02, speed_factor=0.5),
    ]
    included, arrivals, closed, ends, utilization = _round(
        open_s=0.0,
        starts=[0.0, 0.0],
        compute_s=[10 * 0.1 / s.speed_factor for s in sites],
        upload_bytes=[1_000_000, 1_000_000],
        download_bytes=500_000,
        sites=sites,
    )
    assert included == (0, 1)
    assert arrivals == pytest.approx([1.11, 2.22])
    assert closed == pytest.approx(2.22)
    assert ends == pytest.approx([2.255, 2.74])
    assert max(ends) == pytest.approx(2.74)
    assert utilization == pytest.approx([1.0 / 2.255, 2.0 / 2.74])


def test_next_round_starts_from_each_sites_download() -> None:
    sites = [SiteConfig(latency_s=0.0, uplink_bps=8.0, downlink_bps=8.0)] * 2
    # 1 byte at 8 bit/s = 1 s per transfer.
    _, arrivals, closed, ends, utilization = _round(
        open_s=5.0, starts=[5.5, 6.0], compute_s=[1.0, 1.0], upload_bytes=[1, 1], download_bytes=1, sites=sites
    )
    assert arrivals == [7.5, 8.0]
    assert closed == 8.0
    assert ends == [9.0, 9.0]
    assert utilization[0] == pytest.approx(1.0 / 3.5)


def test_deadline_excludes_straggler_and_waits_until_deadline() -> None:
    policy = RoundPolicy(round_deadline_s=3.0)
    assert policy.close_time([1.0, 1.5, 9.0], start_s=0.0, deadline_s=3.0) == 3.0
    # Everyone on time: no waiting for the deadline.
    assert policy.close_time([1.0, 1.5], start_s=0.0, deadline_s=3.0) == 1.5
    # Quorum of 2 not met by the deadline: wait for the 2nd arrival (everyone arrived by then counts).
    quorum = RoundPolicy(min_sites=2, round_deadline_s=3.0)
    assert quorum.close_time([1.0, 5.0, 5.0, 9.0], start_s=0.0, deadline_s=3.0) == 5.0
    # No deadline: wait for everyone.
    assert RoundPolicy().close_time([1.0, 5.0, 9.0], start_s=0.0, deadline_s=None) == 9.0


def test_straggler_downloads_after_its_late_upload() -> None:
    sites = [SiteConfig(latency_s=0.0, uplink_bps=8.0, downlink_bps=8.0)] * 2
    included, _, closed, ends, _ = _round(
        open_s=0.0, starts=[0.0, 0.0], compute_s=[1.0, 10.0], upload_bytes=[1, 1], download_bytes=1,
        sites=sites, deadline_s=4.0,
    )
    assert included == (0,)
    assert closed == 4.0
    assert ends == [5.0, 12.0]


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"uplink_bps": 0}, "sites[1].uplink_bps"),
        ({"latency_s": -1.0}, "sites[1].latency_s"),
        ({"speed": 2}, "sites[1].speed"),
        ({"speed_factor": "slow"}, "sites[1].speed_factor"),
        ({"speed_factor": 0.0}, "sites[1].speed_factor"),
    ],
)
def test_site_config_errors(data, key) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(SiteConfig, data, prefix="sites[1]")
    assert info.value.key == key


def test_the_old_step_time_factor_key_says_what_replaced_it() -> None:
    from geoloco.algorithms.simulation.simulator import SimulatorConfig

    with pytest.raises(ConfigError) as err:
        SimulatorConfig.from_dict({"sites": [{}, {"step_time_factor": 2.0}]})
    assert err.value.key == "sites[1].step_time_factor"
    assert "speed_factor = 1 / step_time_factor" in str(err.value)


def test_secure_round_hand_checked() -> None:
    """Two sites on 8 Mbit/s links (1 kB = 1 ms), latencies 10 and 50 ms; per site 1 kB of
    advertisement up, 2 kB of advertisements down, 3 kB of shares up, 4 kB down, a 100 kB masked
    vector, an empty survivor list and signature, a 5 kB unmask request and a 6 kB answer.

    keys: K1 = max(0.011, 0.051) = 0.051; K2 = max(0.051 + 0.012 + 0.013, 0.051 + 0.052 + 0.053)
          = 0.156; shares held at 0.170 (site 0) and 0.210 (site 1).
    masked: site 0 trains until 0.5 -> 0.5 + 0.11 = 0.61; site 1 trains until 0.2 but holds its
          shares only at 0.21 -> 0.21 + 0.15 = 0.36. The uploads close at 0.61.
    unmask: survivor lists at max(0.61, 0.61 + 0.02) + 0.01 = 0.64 and max(0.61, 0.36 + 0.10) +
          0.05 = 0.66; signatures at 0.65 and 0.71; requests back at 0.71 + 0.015 / 0.055, answers
          at 0.741 and 0.821: M = 0.821. With site 0 alone in the sum, 0.65 + 0.031 = 0.681.
    """
    sites = [SiteConfig(uplink_bps=8e6, downlink_bps=8e6, latency_s=lat) for lat in (0.01, 0.05)]
    traffic = SiteTraffic(
        advertise_up=1000, advertise_down=2000, share_up=3000, share_down=4000, masked_up=100_000,
        request_down=5000, response_up=6000,
    )
    arrivals = masked_arrivals([0.0, 0.0], [0.5, 0.2], [traffic, traffic], sites)
    assert arrivals == pytest.approx([0.61, 0.36])
    assert unmasked_at(0.61, arrivals, [traffic, traffic], sites, [0, 1]) == pytest.approx(0.821)
    assert unmasked_at(0.61, arrivals, [traffic, traffic], sites, [0]) == pytest.approx(0.681)
    assert unmasked_at(0.61, arrivals, [traffic, traffic], sites, []) == 0.61

"""``geoloco simulate`` with ``[[regions]]`` / ``[coordinator_link]``: the simulator's round clock is
the two-tier clock (``geoloco.algorithms.simulation.sim_regions``), the training math is unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.simulation.clock import SiteConfig
from geoloco.algorithms.simulation.planner_sizes import encoded_nbytes
from geoloco.algorithms.simulation.sim_regions import CoordinatorLink, RegionConfig, relayed_round
from geoloco.algorithms.simulation.simulator import SimulatorConfig, simulate
from geoloco.scenarios.research import load_run_config, prepare_raw

NAMES = ["e1", "e2", "u1", "u2"]
SITES = [{"name": n, "uplink_bps": 5e7, "downlink_bps": 5e7, "latency_s": 0.005} for n in NAMES]
REGIONS = [
    {"name": "eu", "sites": ["e1", "e2"], "uplink_bps": 2e7, "downlink_bps": 2e7, "latency_s": 0.02,
     "upward_codec": "uplink"},
    {"name": "us", "sites": ["u1", "u2"], "uplink_bps": 2e7, "downlink_bps": 2e7, "latency_s": 0.03,
     "upward_codec": "uplink"},
]
SLOW_COORDINATOR = {"ingress_bps": 1e4, "egress_bps": 1e4}


def _config(**extra: object) -> SimulatorConfig:
    return SimulatorConfig.from_dict({
        "algorithm": {"inner_steps": 3, "uplink_codec": "int8", "downlink_codec": "int8"},
        "inner_optimizer": {"lr": 0.02},
        "sites": SITES,
        "simulation": {"rounds": 3, "eval_every": 3, "device": "cpu", "step_time_s": 0.1},
        **extra,
    })


def test_regions_change_the_clock_not_the_training(make_workload) -> None:
    flat = list(simulate(_config(coordinator_link=SLOW_COORDINATOR), make_workload(hidden=8)))
    relayed = list(simulate(_config(coordinator_link=SLOW_COORDINATOR, regions=REGIONS), make_workload(hidden=8)))
    assert [r.weights_digest for r in relayed] == [r.weights_digest for r in flat]
    # Behind a slow shared coordinator link, 2 partials and 2 broadcasts beat 4 of each.
    for f, r in zip(flat, relayed, strict=True):
        assert r.round_time_s < f.round_time_s
    # Each round is the two-tier clock's relayed round for the same compute and bytes.
    sites = [SiteConfig(name=s["name"], uplink_bps=5e7, downlink_bps=5e7, latency_s=0.005) for s in SITES]
    regions = [
        RegionConfig(name="eu", sites=[0, 1], uplink_bps=2e7, downlink_bps=2e7, latency_s=0.02),
        RegionConfig(name="us", sites=[2, 3], uplink_bps=2e7, downlink_bps=2e7, latency_s=0.03),
    ]
    link = CoordinatorLink(ingress_bps=1e4, egress_bps=1e4)
    ready = [0.0] * len(SITES)  # each site starts its next round once it holds the weights
    for record in relayed:
        up = list(record.bytes_up.values())
        down = next(iter(record.bytes_down.values()))
        computed = [t + c for t, c in zip(ready, record.compute_s.values(), strict=True)]
        expected = relayed_round(computed, up, down, max(up), sites, regions, link)
        assert record.wall_clock_s == pytest.approx(expected.end_s)
        ready = expected.ends


@pytest.mark.parametrize("dp", ["distributed", "central"])
def test_secure_rounds_through_regions_charge_one_masked_vector_per_relay(make_workload, dp: str) -> None:
    """Secure aggregation (with distributed or central DP) through relays: the math is the flat
    secure round's (same sites, same accountant: the same epsilon), and each relay's partial is
    what ``geoloco.relay`` sends up: one masked vector (the ring sum of its sites', whatever the
    ``upward_codec``) plus its sites' other protocol messages, passed on unchanged."""
    secure = {
        "algorithm": {"inner_steps": 3, "uplink_codec": "none", "downlink_codec": "int8", "weighting": "uniform"},
        "privacy": {"secure_aggregation": True, "clip_norm": 10.0, "dp": dp, "noise_multiplier": 0.5},
        "simulation": {"rounds": 2, "eval_every": 2, "device": "cpu", "step_time_s": 0.1},
    }
    workload = make_workload(hidden=8)
    numel = sum(p.numel() for p in workload.build_model(0).parameters())
    flat = list(simulate(_config(coordinator_link=SLOW_COORDINATOR, **secure), workload))
    relayed = list(simulate(_config(coordinator_link=SLOW_COORDINATOR, regions=REGIONS, **secure), workload))
    assert [r.epsilon for r in relayed] == [r.epsilon for r in flat] and relayed[-1].epsilon is not None
    assert [sorted(r.participants) for r in relayed] == [sorted(r.participants) for r in flat]
    sites = [SiteConfig(name=s["name"], uplink_bps=5e7, downlink_bps=5e7, latency_s=0.005) for s in SITES]
    regions = [
        RegionConfig(name="eu", sites=[0, 1], uplink_bps=2e7, downlink_bps=2e7, latency_s=0.02),
        RegionConfig(name="us", sites=[2, 3], uplink_bps=2e7, downlink_bps=2e7, latency_s=0.03),
    ]
    link = CoordinatorLink(ingress_bps=1e4, egress_bps=1e4)
    masked = 4 * numel  # one masked vector: numel values in Z_2^32
    ready = [0.0] * len(SITES)
    for record in relayed:
        up = list(record.bytes_up.values())  # every message a site sent in the protocol
        assert min(up) > masked
        partials = {r.name: masked + sum(up[k] - masked for k in r.sites) for r in regions}
        assert partials["eu"] == partials["us"]  # the same messages' sizes at every site
        down = encoded_nbytes("int8", numel)  # the broadcast; the protocol's messages come down too
        assert min(record.bytes_down.values()) > down
        computed = [t + c for t, c in zip(ready, record.compute_s.values(), strict=True)]
        expected = relayed_round(computed, up, down, partials["eu"], sites, regions, link)
        assert record.wall_clock_s == pytest.approx(expected.end_s)
        ready = expected.ends


def test_an_unshaped_coordinator_link_without_regions_is_the_plain_clock(make_workload) -> None:
    plain = list(simulate(_config(), make_workload(hidden=8)))
    declared = list(simulate(_config(coordinator_link={}), make_workload(hidden=8)))
    assert [r.wall_clock_s for r in declared] == [r.wall_clock_s for r in plain]


@pytest.mark.parametrize(
    ("extra", "key", "words"),
    [
        ({"regions": [{"name": "eu", "sites": ["e1", "e2"]}]}, "regions", "not in any: u1, u2"),
        ({"regions": REGIONS, "simulation": {"rounds": 3, "round_deadline_s": 5.0}}, "regions", "wait for every site"),
        ({"regions": [{"name": "eu", "sites": NAMES, "upward_codec": "topk"}]}, "regions[0].upward_codec", "allowed"),
        # What the coordinator refuses with [relays]: a relay never forwards a site's own update.
        ({"regions": REGIONS, "privacy": {"dp": "central", "clip_norm": 1.0}}, "privacy.dp",
         "allowed: 'off', or 'central' / 'distributed' with secure_aggregation = true"),
        ({"regions": REGIONS, "algorithm": {"aggregation": "median"}}, "algorithm.aggregation", "allowed: 'mean'"),
        ({"regions": REGIONS, "algorithm": {"clip_to_median_norm": 2.0}}, "algorithm.clip_to_median_norm",
         "must be unset with [[regions]]"),
        ({"regions": REGIONS, "algorithm": {"late_updates": "fold"}}, "algorithm.late_updates", "allowed: 'drop'"),
        ({"regions": REGIONS, "algorithm": {"partial_updates": {"enabled": True}}},
         "algorithm.partial_updates.enabled", "must be false with [[regions]]"),
    ],
)
def test_a_bad_regions_declaration_names_the_key(extra: dict, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        _config(**extra)
    assert err.value.key == key and words in err.value.message


@pytest.mark.parametrize("dp", ["off", "central", "distributed"])
def test_regions_take_secure_aggregation_with_or_without_dp(dp: str) -> None:
    config = _config(
        regions=REGIONS,
        algorithm={"uplink_codec": "none", "weighting": "uniform"},
        privacy={"secure_aggregation": True, "clip_norm": 1.0, "dp": dp},
    )
    assert config.tier_clock() is not None and config.privacy.secure_aggregation


def test_a_simulate_file_takes_the_shipped_scenarios_regions_tables() -> None:
    """``geoloco simulate`` reads the same ``[[regions]]`` / ``[coordinator_link]`` tables as the
    emulator's ``scenarios/regions.toml``."""
    shipped = tomllib.loads((Path(__file__).resolve().parents[2] / "scenarios" / "regions.toml").read_text())
    raw = {
        "workload": {"name": "mlp"},
        "sites": [{"name": s["name"], "uplink_bps": s["uplink_bps"]} for s in shipped["sites"]],
        "regions": shipped["regions"],
        "coordinator_link": shipped["coordinator_link"],
    }
    _, config = load_run_config(prepare_raw(raw, [], "sim.toml"), "sim.toml")
    clock = config.tier_clock()
    assert clock is not None and [r.sites for r in clock.regions] == [[0, 1, 2], [3, 4, 5]]
    assert clock.link.egress_bps == 2e6 and clock.upward_codecs == ["uplink", "uplink"]

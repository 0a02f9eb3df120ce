"""Regions in the emulator: ``[[regions]]`` start a relay per region behind shaped links, every
site reaches the coordinator through its relay, and the coordinator's traffic per round is per
relay, not per site."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from geoloco.scenarios.child_commands import coordinator_table
from geoloco.scenarios.coordinator_cmd import parse_config
from geoloco.scenarios.emulation import Emulation
from geoloco.scenarios.region_tier import COORDINATOR_LINK
from geoloco.scenarios.report import fidelity, write_report
from geoloco.scenarios.scenario import ScenarioError, load_scenario, parse_scenario

ROOT = Path(__file__).resolve().parents[2]
MESSAGE_OVERHEAD = 512
"""Bytes of a broadcast message beyond its payload (header, digest, framing): generous."""

SITES = ["e1", "e2", "u1", "u2"]
SMALL: dict[str, Any] = {
    "workload": {"name": "mlp"},
    "algorithm": {"name": "diloco", "inner_steps": 3, "uplink_codec": "int8", "downlink_codec": "int8"},
    "run": {"rounds": 3, "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 10.0, "timeout_s": 240.0},
    "coordinator_link": {"ingress_bps": 4e6, "egress_bps": 4e6},
    "regions": [
        {"name": "eu", "sites": ["e1", "e2"], "uplink_bps": 2e7, "downlink_bps": 2e7, "latency_s": 0.02,
         "upward_codec": "uplink"},
        {"name": "us", "sites": ["u1", "u2"], "uplink_bps": 2e7, "downlink_bps": 2e7, "latency_s": 0.02,
         "upward_codec": "uplink"},
    ],
    "sites": [{"name": n, "uplink_bps": 5e7, "downlink_bps": 5e7, "latency_s": 0.005} for n in SITES],
}


def test_the_shipped_regions_scenario_loads_and_reaches_the_coordinators_relays_table() -> None:
    scenario = load_scenario(ROOT / "scenarios" / "regions.toml")
    assert [r.name for r in scenario.regions] == ["eu", "us"]
    assert len(scenario.sites) == 6 and scenario.coordinator_link.shaped
    table = coordinator_table(scenario, certs_dir=Path("c"), checkpoint_dir=Path("k"), metrics_path=Path("m"))
    assert table["relays"] == {"eu": ["eu-1", "eu-2", "eu-3"], "us": ["us-1", "us-2", "us-3"]}


@pytest.mark.parametrize(
    ("change", "key", "words"),
    [
        ({"regions": [{"name": "eu", "sites": ["e1", "e2", "u1"]}, {"name": "us", "sites": ["u1", "u2"]}]},
         "regions[1].sites[0]", "already in region 'eu'"),
        ({"regions": [{"name": "eu", "sites": ["e1", "e2", "zz"]}]}, "regions[0].sites[2]", "no site named 'zz'"),
        ({"regions": [{"name": "eu", "sites": ["e1", "e2"]}]}, "regions", "not in any: u1, u2"),
        ({"regions": [{"name": "e1", "sites": SITES}]}, "regions[0].name", "a relay needs its own"),
        ({"regions": [{"name": "eu", "sites": SITES, "upward_codec": "topk"}]}, "regions[0].upward_codec", "allowed"),
        ({"coordinator_link": {"egress_bps": 10.0}}, "coordinator_link.egress_bps", ">= 1000 bits/s"),
    ],
)
def test_a_bad_regions_declaration_names_the_key(change: dict[str, Any], key: str, words: str) -> None:
    with pytest.raises(ScenarioError) as err:
        parse_scenario({**SMALL, **change}, "r.toml")
    assert err.value.key == key and words in err.value.message


@pytest.mark.parametrize("dp", ["off", "central", "distributed"])
def test_regions_take_secure_aggregation_and_the_coordinator_takes_the_table(dp: str) -> None:
    """Relays carry secure rounds (with or without DP): a scenario with [[regions]] takes the same
    [privacy] the coordinator takes with [relays], and the coordinator's file it becomes parses."""
    secure = {
        "algorithm": {**SMALL["algorithm"], "uplink_codec": "none", "weighting": "uniform"},
        "privacy": {"secure_aggregation": True, "clip_norm": 1.0, "dp": dp},
    }
    scenario = parse_scenario({**SMALL, **secure}, "r.toml")
    table = coordinator_table(scenario, certs_dir=Path("c"), checkpoint_dir=Path("k"), metrics_path=Path("m"))
    config, _ = parse_config(table, "coordinator.toml")
    assert config.relays == {"eu": ["e1", "e2"], "us": ["u1", "u2"]}
    assert config.privacy.secure_aggregation and config.privacy.dp == dp


@pytest.mark.parametrize(
    ("change", "key", "words"),
    [
        ({"privacy": {"dp": "central", "clip_norm": 1.0}}, "privacy.dp",
         "allowed: 'off', or 'central' / 'distributed' with secure_aggregation = true"),
        ({"algorithm": {**SMALL["algorithm"], "aggregation": "median"}}, "algorithm.aggregation", "allowed: 'mean'"),
        ({"algorithm": {**SMALL["algorithm"], "late_updates": "fold"}}, "algorithm.late_updates", "allowed: 'drop'"),
    ],
)
def test_regions_refuse_what_the_coordinator_refuses_with_relays(change: dict[str, Any], key: str, words: str) -> None:
    with pytest.raises(ScenarioError) as err:
        parse_scenario({**SMALL, **change}, "r.toml")
    assert err.value.key == key and words in err.value.message


def test_two_regions_run_through_their_relays_and_the_coordinator_sends_per_relay(tmp_path: Path) -> None:
    scenario = parse_scenario(SMALL, "small-regions.toml")
    result = Emulation(scenario, tmp_path / "run").run()
    assert result.status == "completed", result.reason
    rounds = [r for r in result.records if r.get("participants")]
    assert [int(r["round"]) for r in rounds] == [0, 1, 2]
    for record in rounds:
        # Every round counted every site, and only the relays crossed the coordinator's link.
        assert sorted(record["participants"]) == SITES, record
        assert sorted(record["bytes_up"]) == ["relay:eu", "relay:us"], record
        assert sorted(record["bytes_down"]) == ["relay:eu", "relay:us"], record
    for record in rounds[1:]:
        # One broadcast per relay, not per site: flat, the coordinator sends len(SITES) of them
        # (round 0 also carries each site's first full-weights fetch, passed through per site).
        one = int(record["downlink_bytes"])
        for link, nbytes in record["bytes_down"].items():
            assert one <= nbytes <= one + MESSAGE_OVERHEAD, (link, record)
        relayed_egress = sum(int(v) for v in record["bytes_down"].values())
        assert relayed_egress <= (2 / len(SITES)) * (len(SITES) * (one + MESSAGE_OVERHEAD)), record
    # Each relay forwarded its own two sites' updates every round, and the coordinator took them.
    for relay, sites in (("eu", ["e1", "e2"]), ("us", ["u1", "u2"])):
        forwarded = [r for r in result.relay_records[relay] if r["counted_by_coordinator"]]
        assert sorted(int(r["round"]) for r in forwarded) == [0, 1, 2], result.relay_records[relay]
        assert all(sorted(r["partial"]) == sites for r in forwarded), forwarded
    # Bytes really went through every tier: the sites' links, the relays' links, the coordinator's.
    assert set(result.tier_bytes) == {COORDINATOR_LINK, "relay:eu", "relay:us"}
    for name in ("relay:eu", "relay:us"):
        up, down = result.tier_bytes[name]
        assert up > 0 and down > 0
    assert result.tier_bytes[COORDINATOR_LINK][1] == sum(result.tier_bytes[n][1] for n in ("relay:eu", "relay:us"))
    assert all(result.wire_bytes[s][0] > 0 for s in SITES)
    # The fidelity check covers both tiers: every site's link to its relay and every relay's link.
    fid = fidelity(result)
    assert fid.skipped is None, fid.skipped
    assert {s.name for s in fid.sites} == {*SITES, "relay:eu", "relay:us", "coordinator link"}
    summary, _ = write_report(result)
    text = summary.read_text()
    assert "relay:eu" in text and "coordinator link" in text and "relays/NAME.jsonl" in text

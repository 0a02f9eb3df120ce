"""End to end: an emulated streaming run with adaptive overlap (real processes, shaped links) and
its report's emulator-vs-simulator check of the overlap rule."""

from __future__ import annotations

from pathlib import Path

from geoloco.scenarios.emulation import Emulation
from geoloco.scenarios.overlap_fidelity import overlap_fidelity
from geoloco.scenarios.report import write_report
from geoloco.scenarios.scenario import parse_scenario

SCENARIO = {
    "workload": {"name": "mlp"},
    "algorithm": {
        "name": "diloco", "inner_steps": 6, "uplink_codec": "int8", "downlink_codec": "int8",
        "streaming": {"enabled": True, "fragments": 2, "overlap_steps": 1, "adaptive_overlap": True,
                      "interval_steps_max": 30},
    },
    "run": {"rounds": 8, "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 5.0, "timeout_s": 180.0},
    "sites": [
        {"name": "near", "uplink_bps": 1e8, "downlink_bps": 1e8, "latency_s": 0.005},
        {"name": "far", "uplink_bps": 2e6, "downlink_bps": 2e6, "latency_s": 0.05},
    ],
}


def test_emulated_sites_follow_the_rule_and_the_report_checks_it(tmp_path: Path) -> None:
    scenario = parse_scenario(SCENARIO, "adaptive.toml")
    result = Emulation(scenario, tmp_path / "run").run()
    assert result.ok, result.reason
    fid = overlap_fidelity(scenario, result.records)
    assert fid.skipped is None
    # Every site's every choice is what the pure rule makes of what the site reported.
    assert [(s.name, s.replayed, s.rounds) for s in fid.sites] == [("near", 8, 8), ("far", 8, 8)]
    # Rounds 0 and 1 run the configured 3 steps, then the rule sizes them.
    for site in ("near", "far"):
        steps = [int(r["site_metrics"][site]["inner_steps"]) for r in result.records]
        assert steps[:2] == [3, 3] and all(3 <= n <= 30 for n in steps)
    summary, _ = write_report(result)
    text = summary.read_text()
    assert "Adaptive overlap" in text and "| far | 8/8 |" in text

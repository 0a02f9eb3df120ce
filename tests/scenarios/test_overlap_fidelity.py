"""The adaptive-overlap fidelity check (emulator vs simulator), on records of known content."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from geoloco.algorithms.simulation.streaming_clock import overlap_clock
from geoloco.algorithms.streaming_overlap import OverlapBounds
from geoloco.scenarios.overlap_fidelity import overlap_fidelity
from geoloco.scenarios.scenario import Scenario, load_scenario

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 12
UP, DOWN = 137_880, 137_525
"""A fragment's int8 upload and broadcast of the small GPT (as in an emulated run)."""


def _records(scenario: Scenario, step_s: list[float], overhead_s: float) -> list[dict[str, Any]]:
    """Coordinator records as a run whose sites behaved exactly like the clock would write them."""
    algorithm = scenario.algorithm
    bounds = OverlapBounds.from_config(algorithm.inner_steps, algorithm.streaming)
    names = [s.name for s in scenario.sites]
    clock = overlap_clock(
        bounds, sites=[s.clock_site() for s in scenario.sites],
        step_s=step_s, upload_bytes=[[UP] * len(names)] * ROUNDS, download_bytes=[DOWN] * ROUNDS,
        aggregate_overhead_s=overhead_s,
    )
    records = []
    for r in range(ROUNDS):
        metrics = {}
        for k, name in enumerate(names):
            seen_step, seen_transfer = clock[k].step_s[r], clock[k].transfer_s[r]
            metrics[name] = {
                "inner_steps": float(clock[k].steps[r]),
                "inner_time_s": clock[k].steps[r] * step_s[k],
                "step_s": -1.0 if seen_step is None else seen_step,
                "transfer_s": -1.0 if seen_transfer is None else seen_transfer,
                "overlap_steps": float(clock[k].choices[r].overlap_steps),
                "next_round_steps": float(clock[k].choices[r].round_steps),
            }
        records.append({
            "round": r, "site_metrics": metrics, "bytes_up": dict.fromkeys(names, UP),
            "downlink_bytes": DOWN, "phases_s": {"receive": 0.4, "outer_step": overhead_s},
        })
    return records


def test_a_run_that_follows_the_rule_agrees() -> None:
    scenario = load_scenario(ROOT / "scenarios" / "streaming.toml")
    assert scenario.algorithm.streaming.adaptive_overlap
    # A GPU-like step: the rule must stretch the rounds well past H/P = 5 steps.
    records = _records(scenario, step_s=[0.01, 0.01], overhead_s=0.05)
    fid = overlap_fidelity(scenario, records)
    assert fid.skipped is None and fid.ok, fid.lines()
    assert [s.replayed for s in fid.sites] == [ROUNDS, ROUNDS]
    assert all(s.predicted_steps > 10 for s in fid.sites)
    assert any("| eu-west | 12/12 |" in line for line in fid.lines())


def test_a_choice_the_rule_would_not_make_is_named() -> None:
    scenario = load_scenario(ROOT / "scenarios" / "streaming.toml")
    records = _records(scenario, step_s=[0.01, 0.01], overhead_s=0.05)
    wrong = copy.deepcopy(records)
    wrong[6]["site_metrics"]["eu-west"]["overlap_steps"] -= 1
    fid = overlap_fidelity(scenario, wrong)
    eu = next(s for s in fid.sites if s.name == "eu-west")
    us = next(s for s in fid.sites if s.name == "us-east")
    assert eu.mismatches == [6] and eu.replayed == ROUNDS - 1 and not eu.ok
    assert us.ok and not fid.ok


def test_round_steps_far_from_the_clocks_disagree() -> None:
    scenario = load_scenario(ROOT / "scenarios" / "streaming.toml")
    records = _records(scenario, step_s=[0.01, 0.01], overhead_s=0.05)
    # Sites that reported 0.01 s steps but ran 3 more steps per round than the rule allows.
    for record in records[3:]:
        for metrics in record["site_metrics"].values():
            metrics["inner_steps"] += 3
    fid = overlap_fidelity(scenario, records)
    assert not fid.ok and all(not s.ok for s in fid.sites)


def test_skipped_without_adaptive_overlap() -> None:
    scenario = load_scenario(ROOT / "scenarios" / "transatlantic.toml")
    assert overlap_fidelity(scenario, []).skipped == "the scenario does not use adaptive_overlap"


def test_skipped_with_secure_aggregation(tmp_path: Path) -> None:
    """A secure round's stage calls are on the streaming simulator's clock, not this one's: a
    prediction without them would mark a faithful run as off."""
    text = (ROOT / "scenarios" / "streaming.toml").read_text().replace('uplink_codec = "int8"', 'uplink_codec = "none"')
    text += (
        '\n[[sites]]\nname = "ap-south"\nlatency_s = 0.05\n'
        '\n[privacy]\nsecure_aggregation = true\nclip_norm = 1.0\n'
    )
    path = tmp_path / "secure_streaming.toml"
    path.write_text(text.replace("[algorithm]\n", '[algorithm]\nweighting = "uniform"\n', 1))
    secure = load_scenario(path)
    assert secure.privacy.secure_aggregation and secure.algorithm.streaming.adaptive_overlap
    records = _records(secure, [0.05] * len(secure.sites), 0.01)
    assert overlap_fidelity(secure, records).skipped == "secure aggregation's stage calls are not on the overlap clock"

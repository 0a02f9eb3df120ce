"""Adaptive overlap for Streaming DiLoCo: the pure rule, the meter, the config, the simulator."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from geoloco.algorithms.config import ConfigError, config_from_dict
from geoloco.algorithms.simulation import streaming_sim
from geoloco.algorithms.simulation.simulator import Simulator, SimulatorConfig
from geoloco.algorithms.simulation.streaming_clock import overlap_clock
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.algorithms.streaming_overlap import (
    OverlapBounds,
    OverlapChoice,
    OverlapMeter,
    choose_overlap,
)

# --------------------------------------------------------------------------------------------
# The rule, against hand-computed cases (binary-exact numbers: no rounding at the ceil)


def _bounds(**values: Any) -> OverlapBounds:
    return OverlapBounds(**{"interval": 8, "overlap_steps": 2, "adaptive": True, "margin": 0.5, **values})


@pytest.mark.parametrize(
    ("bounds", "expected"),
    [
        # needed = ceil(0.5 × 1.5 / 0.125) = 6 fits in the round of 8 steps.
        ({}, OverlapChoice(overlap_steps=6, round_steps=8, needed_steps=6)),
        # Rounds of 4 steps and a fixed cadence: τ stops at the round, the transfer is not hidden.
        ({"interval": 4}, OverlapChoice(overlap_steps=4, round_steps=4, needed_steps=6)),
        # The user allows rounds up to 10 steps: the round stretches to τ + the configured
        # 4 - 2 steps after the merge.
        ({"interval": 4, "interval_max": 10}, OverlapChoice(6, 8, 6)),
        ({"interval": 4, "interval_max": 7}, OverlapChoice(6, 7, 6)),
        # Configured τ = s: no steps after the merge to keep, the round is all overlap.
        ({"interval": 4, "overlap_steps": 4, "interval_max": 10}, OverlapChoice(6, 6, 6)),
        # ...up to 5 only: the bound wins.
        ({"interval": 4, "interval_max": 5}, OverlapChoice(5, 5, 6)),
        # τ's own cap.
        ({"overlap_max": 3}, OverlapChoice(3, 8, 6)),
        # τ's floor above what is needed.
        ({"overlap_min": 7}, OverlapChoice(7, 8, 6)),
        # No margin: 0.5 / 0.125 = 4.
        ({"margin": 0.0}, OverlapChoice(4, 8, 4)),
    ],
)
def test_rule_hand_computed(bounds: dict[str, Any], expected: OverlapChoice) -> None:
    assert choose_overlap(_bounds(**bounds), step_s=0.125, transfer_s=0.5) == expected


def test_rule_gpu_like_step_stretches_the_round_when_allowed() -> None:
    # A 1/1024 s step against a 0.375 s transfer: 384 steps to hide it.
    gpu = _bounds(interval=5, overlap_steps=5, margin=0.0, interval_max=500)
    choice = choose_overlap(gpu, step_s=1 / 1024, transfer_s=0.375)
    assert choice == OverlapChoice(384, 384, 384) and choice.hidden
    fixed_cadence = choose_overlap(_bounds(interval=5, margin=0.0), step_s=1 / 1024, transfer_s=0.375)
    assert fixed_cadence == OverlapChoice(5, 5, 384) and not fixed_cadence.hidden


def test_rule_falls_back_to_the_configured_values() -> None:
    configured = OverlapChoice(overlap_steps=2, round_steps=8)
    assert choose_overlap(_bounds(adaptive=False), step_s=0.125, transfer_s=0.5) == configured
    assert choose_overlap(_bounds(), step_s=None, transfer_s=0.5) == configured
    assert choose_overlap(_bounds(), step_s=0.125, transfer_s=None) == configured
    assert choose_overlap(_bounds(), step_s=0.0, transfer_s=0.5) == configured
    # A transfer that takes no time needs no overlap: τ falls to its floor.
    assert choose_overlap(_bounds(), step_s=0.125, transfer_s=0.0) == OverlapChoice(0, 8, 0)


def test_meter_skips_the_start_up_transfer_and_lets_its_peak_decay() -> None:
    meter = OverlapMeter()
    assert meter.step_s is None and meter.transfer_s is None
    meter.record_transfer(30.0)  # round 0: waited for the other sites to start
    assert meter.transfer_s is None
    meter.record_transfer(1.0)
    assert meter.transfer_s == 1.0
    meter.record_transfer(2.0)  # a longer one counts at once
    assert meter.transfer_s == 2.0
    meter.record_transfer(0.5)  # a shorter one: the peak decays by TRANSFER_DECAY = 0.9
    assert meter.transfer_s == pytest.approx(1.8)
    meter.record_transfer(0.5)
    assert meter.transfer_s == pytest.approx(1.62)
    meter.record_transfer(1.7)
    assert meter.transfer_s == pytest.approx(1.7)
    for _ in range(30):
        meter.record_transfer(0.25)
    assert meter.transfer_s == pytest.approx(0.25)  # down to what is measured now, no lower
    meter.reset_transfers()
    meter.record_transfer(9.0)  # the first after a re-join is skipped too
    assert meter.transfer_s is None
    meter.record_transfer(0.25)
    assert meter.transfer_s == 0.25


def test_meter_step_time_is_seconds_over_steps_of_recent_rounds() -> None:
    meter = OverlapMeter()
    meter.record_steps(0, 5.0)  # no steps: nothing to learn
    assert meter.step_s is None
    meter.record_steps(4, 1.0)
    meter.record_steps(12, 2.0)
    assert meter.step_s == pytest.approx(3.0 / 16)
    for _ in range(4):  # the window holds the last four rounds
        meter.record_steps(2, 1.0)
    assert meter.step_s == pytest.approx(0.5)
    assert meter.choose(_bounds(margin=0.0)) == OverlapChoice(2, 8)  # no transfer yet


# --------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize(
    ("streaming", "key", "allowed"),
    [
        ({"overlap_steps_max": 3}, "overlap_steps_max", "adaptive_overlap = true"),
        ({"interval_steps_max": 10}, "interval_steps_max", "adaptive_overlap = true"),
        ({"adaptive_overlap": True, "overlap_steps_min": 3, "overlap_steps_max": 2},
         "overlap_steps_min", "<= overlap_steps_max = 2"),
        ({"adaptive_overlap": True, "overlap_steps": 4, "overlap_steps_max": 2},
         "overlap_steps", "[overlap_steps_min, overlap_steps_max] = [0, 2]"),
        ({"adaptive_overlap": True, "overlap_steps": 1, "overlap_steps_min": 2},
         "overlap_steps", ">= overlap_steps_min = 2"),
        ({"adaptive_overlap": True, "interval_steps_max": 3}, "interval_steps_max", ">= inner_steps / fragments = 5"),
        ({"adaptive_overlap": True, "overlap_steps_min": 6, "overlap_steps": 6},
         "overlap_steps", "<= inner_steps / fragments = 5"),
        ({"adaptive_overlap": True, "overlap_steps_min": 9, "overlap_steps": 5, "interval_steps_max": 8},
         "overlap_steps", ">= overlap_steps_min = 9"),
        ({"adaptive_overlap": True, "overlap_margin": -0.1}, "overlap_margin", "[0, 10]"),
        ({"adaptive_overlap": True, "overlap_steps_max": -1}, "overlap_steps_max", ">= 0"),
    ],
)
def test_adaptive_config_errors_name_the_key_and_what_is_allowed(
    streaming: dict[str, Any], key: str, allowed: str
) -> None:
    values = {"inner_steps": 20, "streaming": {"enabled": True, "fragments": 4, **streaming}}
    with pytest.raises(ConfigError) as info:
        config_from_dict(AlgorithmConfig, values, prefix="algorithm")
    assert info.value.key == f"algorithm.streaming.{key}"
    assert allowed in info.value.message


def test_adaptive_config_accepts_bounds_and_round_trips() -> None:
    values = {
        "inner_steps": 20,
        "streaming": {"enabled": True, "fragments": 4, "overlap_steps": 5, "adaptive_overlap": True,
                      "overlap_steps_min": 1, "overlap_steps_max": 40, "interval_steps_max": 40},
    }
    config = config_from_dict(AlgorithmConfig, values, prefix="algorithm")
    bounds = OverlapBounds.from_config(config.inner_steps, config.streaming)
    assert bounds == OverlapBounds(interval=5, overlap_steps=5, adaptive=True, overlap_min=1,
                                   overlap_max=40, interval_max=40, margin=0.1)
    assert config_from_dict(AlgorithmConfig, config.to_dict(), prefix="algorithm") == config


# --------------------------------------------------------------------------------------------
# Simulator: the same rule on the virtual clock


def _model(dim: int, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(dim, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return model


@pytest.fixture
def deep(make_workload):
    class DeepWorkload(make_workload):
        def build_model(self, seed: int) -> nn.Module:
            return _model(self.dim, seed)

    return DeepWorkload


SLOW = {"uplink_bps": 2e4, "downlink_bps": 2e4, "latency_s": 0.05}
FAST = {"uplink_bps": 1e9, "downlink_bps": 1e9, "latency_s": 0.001}


def _config(streaming: dict[str, Any], rounds: int = 12, step_time_s: float = 0.01) -> SimulatorConfig:
    return SimulatorConfig.from_dict({
        "algorithm": {"inner_steps": 4, "uplink_codec": "int8", "downlink_codec": "int8",
                      "streaming": {"enabled": True, "fragments": 2, "overlap_steps": 1, **streaming}},
        "inner_optimizer": {"lr": 0.02},
        "sites": [FAST, SLOW],
        "simulation": {"rounds": rounds, "eval_every": 4, "device": "cpu", "step_time_s": step_time_s},
    })


ADAPTIVE = {"adaptive_overlap": True, "interval_steps_max": 400}


def test_simulator_adaptive_choices_follow_the_rule_on_the_virtual_clock(deep) -> None:
    """Each site's choice is ``choose_overlap`` of its own virtual step time and the transfers it
    had seen come back when its upload started (round 0's, start-up, left out)."""
    sim = Simulator(_config(ADAPTIVE), deep())
    records = list(sim.run())
    assert sim.streaming is not None
    bounds = sim.streaming.bounds
    for k, stream in enumerate(sim.streaming.streams):
        site = sim.sites[k]
        steps = [r.inner_steps[site.name] for r in records]
        assert len(stream.choices) == len(stream.seen) == len(records)
        for choice, (step_s, transfer_s) in zip(stream.choices, stream.seen, strict=True):
            assert choice == choose_overlap(bounds, step_s=step_s, transfer_s=transfer_s)
            assert step_s == pytest.approx(0.01 / site.config.speed_factor)
        # Rounds 0 and 1 run the configured values: nothing came back yet / only start-up.
        assert stream.seen[0][1] is None and stream.seen[1][1] is None
        assert stream.choices[0] == bounds.fixed and stream.choices[1] == bounds.fixed
        # A fragment is away at least its upload and its broadcast over the slow link (which
        # the fast site waits for too).
        assert all(t is not None and t > 0.1 for _, t in stream.seen[2:])
        # Round r runs the steps chosen at round r-1's upload.
        assert steps[1:] == [c.round_steps for c in stream.choices[:-1]]
        assert all(c.hidden for c in stream.choices[2:]), stream.choices


def test_simulator_adaptive_overlap_hides_the_transfer_after_start_up(deep) -> None:
    fixed = list(Simulator(_config({}), deep()).run())
    adaptive = list(Simulator(_config(ADAPTIVE), deep()).run())
    # Fixed τ = 1 of 2-step rounds cannot hide a ~1 s transfer behind 0.01 s steps.
    assert max(fixed[-1].utilization.values()) < 0.2
    # Adaptive: from round 3 on (two transfers to learn from), every site computes through its
    # rounds; stalls are zero up to float rounding.
    for record in adaptive[3:]:
        assert min(record.utilization.values()) > 0.999, record.utilization
    assert max(adaptive[-1].inner_steps.values()) > 2


def test_simulator_adaptive_without_stretch_keeps_the_cadence(deep) -> None:
    records = list(Simulator(_config({"adaptive_overlap": True}), deep()).run())
    assert all(set(r.inner_steps.values()) == {2} for r in records)


def test_simulator_adaptive_merges_after_the_chosen_overlap(monkeypatch, deep) -> None:
    """A site merges round r's fragment after exactly its steps through round r plus the τ it
    chose at round r's upload."""
    sim = Simulator(_config(ADAPTIVE, rounds=6), deep())
    steps_taken = [0] * len(sim.sites)
    current: dict[str, int] = {}
    for site in sim.sites:
        def counting(batches=site.batches, k=site.index):
            for batch in batches:
                steps_taken[k] += 1
                current["site"] = k
                yield batch
        site.batches = counting()
    merges: list[tuple[int, int]] = []
    real_merge = streaming_sim.merge_fragment_

    def spy(local, global_flat, fragment, mix):
        merges.append((current["site"], steps_taken[current["site"]]))
        return real_merge(local, global_flat, fragment, mix)

    monkeypatch.setattr(streaming_sim, "merge_fragment_", spy)
    records = list(sim.run())
    assert sim.streaming is not None
    for k, stream in enumerate(sim.streaming.streams):
        name = sim.sites[k].name
        done = 0
        expected = []
        for r in range(len(records) - 1):
            done += records[r].inner_steps[name]
            expected.append(done + stream.choices[r].overlap_steps)
        assert [step for site, step in merges if site == k] == expected


def test_clock_model_chooses_what_the_simulator_chose(deep) -> None:
    """``overlap_clock`` (the clock alone, for the emulator's fidelity check) follows the
    simulator's rounds: same steps, same choices, round by round, for the same transfer sizes."""
    config = _config(ADAPTIVE, step_time_s=1 / 64)
    sim = Simulator(config, deep())
    start = [site.ready_s for site in sim.sites]
    records = list(sim.run())
    assert sim.streaming is not None
    names = [site.name for site in sim.sites]
    clock = overlap_clock(
        sim.streaming.bounds, sites=[site.config for site in sim.sites],
        step_s=[1 / 64] * len(names),
        upload_bytes=[[r.bytes_up[name] for name in names] for r in records],
        download_bytes=[r.bytes_down[names[0]] for r in records],
        start_s=start,
    )
    for k, name in enumerate(names):
        assert clock[k].steps == [r.inner_steps[name] for r in records]
        assert clock[k].choices == sim.streaming.streams[k].choices
        assert clock[k].utilization == pytest.approx([r.utilization[name] for r in records])
    assert len({c.round_steps for c in clock[1].choices}) > 1, "the rule must have acted"

"""Run length and evaluation points in inner steps: the same meaning for every H and algorithm."""

from __future__ import annotations

from typing import Any

import pytest

from geoloco.algorithms.config import ConfigError, config_from_dict
from geoloco.algorithms.simulation.simulator import SimulationConfig, SimulatorConfig, simulate


def _config(algorithm: dict[str, Any], simulation: dict[str, Any]) -> SimulatorConfig:
    return SimulatorConfig.from_dict({
        "algorithm": {"uplink_codec": "none", **algorithm},
        "inner_optimizer": {"lr": 0.02},
        "sites": {"count": 2},
        "simulation": {"device": "cpu", "step_time_s": 0.1, **simulation},
    })


def test_defaults_are_rounds_and_eval_every_when_neither_pair_member_is_set() -> None:
    sim = SimulationConfig()
    assert (sim.rounds, sim.total_inner_steps, sim.eval_every, sim.eval_every_steps) == (100, None, 10, None)
    steps = SimulationConfig(total_inner_steps=200, eval_every_steps=50)
    assert steps.rounds is None and steps.eval_every is None
    # The resolved dict reads back unchanged (a saved config.json is loadable).
    assert config_from_dict(SimulationConfig, steps.to_dict()) == steps


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"rounds": 4, "total_inner_steps": 40}, "total_inner_steps"),
        ({"eval_every": 2, "eval_every_steps": 20}, "eval_every_steps"),
        ({"total_inner_steps": 0}, "total_inner_steps"),
        ({"eval_every_steps": 0}, "eval_every_steps"),
    ],
)
def test_both_or_bad_values_name_the_key(values: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        SimulatorConfig.from_dict({"simulation": values})
    assert info.value.key == f"simulation.{key}"
    if len(values) == 2:
        assert "not both" in info.value.message


@pytest.mark.parametrize("h", [5, 10, 20])
def test_total_inner_steps_derives_rounds_and_evaluates_at_the_same_steps(make_workload, h: int) -> None:
    config = _config({"inner_steps": h}, {"total_inner_steps": 40, "eval_every_steps": 20})
    assert config.run_rounds == 40 // h
    records = list(simulate(config, make_workload()))
    assert [r.inner_steps_total for r in records] == [h * (k + 1) for k in range(40 // h)]
    assert [r.inner_steps_total for r in records if r.eval_loss is not None] == [20, 40]


def test_ddp_counts_each_synchronous_step_once(make_workload) -> None:
    config = _config({"name": "ddp", "inner_steps": 4}, {"total_inner_steps": 12, "eval_every_steps": 4})
    records = list(simulate(config, make_workload()))
    assert config.run_rounds == 3
    assert [r.inner_steps_total for r in records] == [4, 8, 12]
    assert all(r.eval_loss is not None for r in records)
    # Each site sent one fp32 gradient (5 values + header) per step: 2 sites x 4 steps per record.
    per_gradient = records[0].bytes_up_total / (2 * 4)
    assert per_gradient >= 5 * 4 and per_gradient == int(per_gradient)
    assert records[-1].bytes_up_total == 3 * records[0].bytes_up_total


def test_warmup_counts_towards_the_total_and_rounds_round_up(make_workload) -> None:
    config = _config({"inner_steps": 10, "warmup_steps": 5}, {"total_inner_steps": 30, "eval_every": 1})
    assert config.run_rounds == 3  # 25 steps after the warm-up need 3 rounds of 10: at least T
    records = list(simulate(config, make_workload()))
    assert [(r.phase, r.inner_steps_total) for r in records] == [
        ("warmup", 5), ("train", 15), ("train", 25), ("train", 35)
    ]


def test_streaming_rounds_are_fragment_syncs(make_workload) -> None:
    config = _config(
        {"inner_steps": 4, "streaming": {"enabled": True, "fragments": 2}},
        {"total_inner_steps": 8, "eval_every_steps": 8},
    )
    assert config.steps_per_round == 2 and config.run_rounds == 4
    records = list(simulate(config, make_workload(hidden=4)))
    assert [r.inner_steps_total for r in records] == [2, 4, 6, 8]
    assert [r.eval_loss is not None for r in records] == [False, False, False, True]


def test_rounds_keep_their_meaning_and_count_steps(make_workload) -> None:
    config = _config({"inner_steps": 3}, {"rounds": 3, "eval_every": 2})
    records = list(simulate(config, make_workload()))
    assert [r.inner_steps_total for r in records] == [3, 6, 9]
    assert [r.eval_loss is not None for r in records] == [False, True, True]


@pytest.mark.parametrize(
    ("algorithm", "simulation", "key", "words"),
    [
        ({"round_time_budget_s": 1.0}, {"total_inner_steps": 40}, "simulation.total_inner_steps",
         "round_time_budget_s"),
        ({"round_time_budget_s": 1.0}, {"rounds": 2, "eval_every_steps": 4}, "simulation.eval_every_steps",
         "round_time_budget_s"),
        ({"warmup_steps": 10}, {"total_inner_steps": 10}, "simulation.total_inner_steps", "warmup_steps"),
    ],
)
def test_step_run_length_rejects_what_it_cannot_mean(
    algorithm: dict[str, Any], simulation: dict[str, Any], key: str, words: str
) -> None:
    with pytest.raises(ConfigError) as info:
        _config({"inner_steps": 4, **algorithm}, simulation)
    assert info.value.key == key and words in info.value.message

"""Inner lr schedules: the multiplier, config errors, and the simulator's sites following it."""

from __future__ import annotations

import math

import pytest
import torch

from geoloco.algorithms.config import ConfigError, config_from_dict
from geoloco.algorithms.lr_schedule import InnerLRSchedule, lr_multiplier, resolve_decay_steps
from geoloco.algorithms.optimizers import InnerOptimizerConfig
from geoloco.algorithms.simulation.simulator import Simulator, SimulatorConfig


def test_warmup_is_linear_from_one_over_warmup_to_one() -> None:
    assert [lr_multiplier(s, schedule="constant", warmup_steps=4) for s in range(6)] == [
        0.25, 0.5, 0.75, 1.0, 1.0, 1.0
    ]
    assert [lr_multiplier(s) for s in (0, 7, 10_000)] == [1.0, 1.0, 1.0]


def test_cosine_decays_from_one_after_warmup_to_the_floor_and_stays() -> None:
    kw = {"schedule": "cosine", "warmup_steps": 2, "decay_steps": 12, "min_lr_ratio": 0.1}
    assert lr_multiplier(0, **kw) == 0.5 and lr_multiplier(1, **kw) == 1.0
    assert lr_multiplier(2, **kw) == pytest.approx(1.0)
    assert lr_multiplier(7, **kw) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way: cos(pi/2) = 0
    assert lr_multiplier(4, **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.2)))
    assert lr_multiplier(12, **kw) == pytest.approx(0.1)
    assert lr_multiplier(500, **kw) == pytest.approx(0.1)
    values = [lr_multiplier(s, **kw) for s in range(2, 13)]
    assert values == sorted(values, reverse=True)


def test_linear_decays_in_equal_steps_to_the_floor() -> None:
    kw = {"schedule": "linear", "decay_steps": 4, "min_lr_ratio": 0.2}
    assert [lr_multiplier(s, **kw) for s in range(6)] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.2])
    assert lr_multiplier(2, schedule="linear", decay_steps=4) == pytest.approx(0.5)


def test_unknown_schedule_and_missing_horizon_say_what_is_allowed() -> None:
    with pytest.raises(ValueError, match="valid names: constant, cosine, linear"):
        lr_multiplier(0, schedule="step")
    with pytest.raises(ConfigError, match="decay_steps.*set decay_steps") as err:
        resolve_decay_steps("cosine", None, total_rounds=0, inner_steps=10)
    assert err.value.key == "decay_steps"
    assert resolve_decay_steps("cosine", None, total_rounds=5, inner_steps=10) == 50
    assert resolve_decay_steps("linear", 7, total_rounds=None, inner_steps=None) == 7
    assert resolve_decay_steps("constant", None, total_rounds=None, inner_steps=None) is None


@pytest.mark.parametrize(
    ("fields", "key", "message"),
    [
        ({"schedule": "exp"}, "schedule", "valid names: constant, cosine, linear"),
        ({"warmup_steps": -1}, "warmup_steps", ">= 0"),
        ({"warmup_steps": 5, "decay_steps": 5}, "decay_steps", "> warmup_steps"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio", r"\[0, 1\]"),
    ],
)
def test_config_errors_name_the_key(fields: dict, key: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        config_from_dict(InnerOptimizerConfig, fields, prefix="inner_optimizer")
    assert err.value.key == f"inner_optimizer.{key}"


def test_schedule_resumes_at_a_step_and_survives_a_loaded_optimizer_state() -> None:
    config = InnerOptimizerConfig(lr=0.5, schedule="cosine", warmup_steps=2, decay_steps=10)
    assert InnerOptimizerConfig(lr=0.5).build_schedule(torch.optim.SGD([torch.zeros(1)], lr=0.5)) is None
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = config.build([param])
    schedule = config.build_schedule(optimizer, start_step=6)
    assert isinstance(schedule, InnerLRSchedule) and schedule.step_count == 6
    expected = 0.5 * lr_multiplier(6, schedule="cosine", warmup_steps=2, decay_steps=10)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected)
    # Loading another optimizer's state replaces the param groups (lr included); seek restores.
    other = InnerOptimizerConfig(lr=0.01).build([torch.nn.Parameter(torch.zeros(3))])
    optimizer.load_state_dict(other.state_dict())
    schedule.seek(1)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5)
    with pytest.raises(ConfigError, match="decay_steps"):
        InnerOptimizerConfig(schedule="linear").build_schedule(optimizer)


def _sim_config(algorithm: dict, **inner: object) -> SimulatorConfig:
    return SimulatorConfig.from_dict({
        "algorithm": {"uplink_codec": "none", "downlink_codec": "none", **algorithm},
        "inner_optimizer": {"name": "sgd", "lr": 0.05, **inner},
        "sites": {"count": 2},
        "simulation": {"rounds": 3, "eval_every": 3, "device": "cpu", "step_time_s": 0.1},
    })


def _record_lrs(optimizer: torch.optim.Optimizer, seen: list[float]) -> None:
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(opt.param_groups[0]["lr"]))


@pytest.mark.parametrize("name", ["diloco", "ddp"])
def test_simulated_sites_follow_the_schedule_over_their_cumulative_steps(make_workload, name) -> None:
    kw = {"schedule": "cosine", "warmup_steps": 3, "min_lr_ratio": 0.1}
    sim = Simulator(_sim_config({"name": name, "inner_steps": 4}, **kw), make_workload())
    optimizers = (
        [sim.strategy.outer.optimizer] if sim.data_parallel  # type: ignore[attr-defined]
        else [site.optimizer for site in sim.sites]
    )
    seen: list[list[float]] = [[] for _ in optimizers]
    for optimizer, lrs in zip(optimizers, seen):
        _record_lrs(optimizer, lrs)
    records = list(sim.run())
    assert len(records) == 3
    # Horizon derived from the run: 3 rounds x 4 inner steps.
    expected = [0.05 * lr_multiplier(s, decay_steps=12, **kw) for s in range(12)]
    for lrs in seen:
        assert lrs == pytest.approx(expected)
    assert expected[-1] < 0.05 * 0.2 and expected[0] == pytest.approx(0.05 / 3)


def test_simulator_with_an_explicit_horizon_and_constant_default(make_workload) -> None:
    sim = Simulator(_sim_config({"inner_steps": 2}, schedule="linear", decay_steps=4), make_workload())
    seen: list[float] = []
    _record_lrs(sim.sites[0].optimizer, seen)
    list(sim.run())
    assert seen == pytest.approx([0.05, 0.0375, 0.025, 0.0125, 0.0, 0.0])
    plain = Simulator(_sim_config({"inner_steps": 2}), make_workload())
    assert all(site.lr_schedule is None for site in plain.sites)

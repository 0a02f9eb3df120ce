"""Poisoned sites in the simulator (``SiteConfig.attack``) and robust aggregation keeping the model
near the clean run while the plain mean does not, in plain and Streaming DiLoCo rounds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.simulation.robust_attack import Attack, parse_attack
from geoloco.algorithms.simulation.simulator import Simulator, SimulatorConfig

NUM_SITES = 5


def _run(make_workload: Callable[..., Any], attack: str | None = None, **algorithm: Any) -> torch.Tensor:
    sites: list[dict[str, Any]] = [{} for _ in range(NUM_SITES)]
    if attack is not None:
        sites[-1] = {"attack": attack}
    config = SimulatorConfig.from_dict({
        "algorithm": {"inner_steps": 4, **algorithm},
        "inner_optimizer": {"lr": 0.01},
        "sites": sites,
        "simulation": {"rounds": 4, "seed": 2, "device": "cpu", "eval_every": 4},
    })
    simulator = Simulator(config, make_workload(dim=6, hidden=4))
    for _ in simulator.run():
        pass
    return simulator.global_flat


def _initial(make_workload: Callable[..., Any]) -> torch.Tensor:
    model = make_workload(dim=6, hidden=4).build_model(2)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _distance(weights: torch.Tensor, clean: torch.Tensor, start: torch.Tensor) -> float:
    """Distance from the clean run's weights, in units of how far the clean run moved."""
    return float((weights - clean).norm() / (clean - start).norm())


def test_parse_attack_forms_and_errors() -> None:
    assert parse_attack("scale:100") == Attack("scale", 100.0)
    assert parse_attack("sign_flip") == Attack("sign_flip")
    assert parse_attack("noise:0.5") == Attack("noise", 0.5)
    for bad, message in (("scale:x", "needs a number"), ("noise:0", "> 0"), ("flip", "unknown attack"),
                         ("sign_flip:2", "unknown attack"), ("scale:inf", "finite")):
        with pytest.raises(ValueError, match=message):
            parse_attack(bad)
    update = torch.tensor([1.0, -2.0])
    assert torch.equal(Attack("scale", 100.0).apply(update, round_seed=1, site="a"), torch.tensor([100.0, -200.0]))
    assert torch.equal(Attack("sign_flip").apply(update, round_seed=1, site="a"), -update)
    noise = Attack("noise", 2.0)
    first = noise.apply(torch.zeros(10_000), round_seed=1, site="a")
    assert torch.equal(first, noise.apply(torch.zeros(10_000), round_seed=1, site="a"))
    assert not torch.equal(first, noise.apply(torch.zeros(10_000), round_seed=2, site="a"))
    assert 1.9 < float(first.std()) < 2.1


def test_attack_config_errors_name_the_site() -> None:
    with pytest.raises(ConfigError, match="unknown attack") as err:
        SimulatorConfig.from_dict({"sites": [{}, {"attack": "boom"}]})
    assert err.value.key == "sites[1].attack"
    with pytest.raises(ConfigError, match="ddp baseline") as err:
        SimulatorConfig.from_dict({"algorithm": {"name": "ddp"}, "sites": [{"attack": "sign_flip"}]})
    assert err.value.key == "sites[0].attack"


def test_the_attack_hook_changes_only_the_poisoned_upload(make_workload: Callable[..., Any]) -> None:
    clean = _run(make_workload)
    assert torch.equal(_run(make_workload, "scale:1"), clean)
    assert not torch.equal(_run(make_workload, "sign_flip"), clean)
    assert torch.equal(_run(make_workload, "noise:1.0"), _run(make_workload, "noise:1.0"))


@pytest.mark.parametrize("attack", ["scale:100", "noise:1.0"])
def test_robust_options_stay_near_the_clean_run_where_the_mean_does_not(
    make_workload: Callable[..., Any], attack: str
) -> None:
    start = _initial(make_workload)
    clean = _run(make_workload)
    assert _distance(_run(make_workload, attack), clean, start) > 2.0
    for options in (
        {"clip_to_median_norm": 2.0},
        {"aggregation": "trimmed_mean", "trim_fraction": 0.2},
        {"aggregation": "median"},
    ):
        assert _distance(_run(make_workload, attack, **options), clean, start) < 0.5, options


def test_streaming_rounds_aggregate_robustly(make_workload: Callable[..., Any]) -> None:
    streaming = {"enabled": True, "fragments": 2, "overlap_steps": 1}
    start = _initial(make_workload)
    clean = _run(make_workload, streaming=streaming)
    assert _distance(_run(make_workload, "scale:100", streaming=streaming), clean, start) > 2.0
    median = _run(make_workload, "scale:100", streaming=streaming, aggregation="median")
    assert _distance(median, clean, start) < 0.5

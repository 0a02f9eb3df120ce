"""Partial Parameter Updates: frozen parameters stay put, only the trained subset travels, and the
coordinator averages each coordinate over the sites that trained it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.partial import PartialAssignment, PartialMean, PartialUpdatesConfig
from geoloco.algorithms.simulation.simulator import Simulator, SimulatorConfig
from geoloco.compression import parse_codec

# LinearRegressionWorkload(hidden=8): 0.weight (32), 0.bias (8), 2.weight (8), 2.bias (1).
SIZES = {"0.weight": 32, "0.bias": 8, "2.weight": 8, "2.bias": 1}


def _config(partial: dict | None = None, sites: int = 2, **algorithm) -> SimulatorConfig:
    return SimulatorConfig.from_dict({
        "algorithm": {"inner_steps": 3, "partial_updates": partial or {"enabled": True}, **algorithm},
        "inner_optimizer": {"lr": 0.02},
        "sites": {"count": sites},
        "simulation": {"rounds": 2, "eval_every": 1, "device": "cpu", "step_time_s": 0.1},
    })


def _layout(workload) -> ParamLayout:
    return ParamLayout.from_model(workload.build_model(0))


def test_blocks_cut_whole_tensors_into_runs_and_layers_use_the_layer_number(make_workload) -> None:
    layout = _layout(make_workload(hidden=8))
    blocks = PartialAssignment.build(PartialUpdatesConfig(enabled=True, groups=2), layout)
    # numel 49, half 24.5: the first run closes after 0.weight (32 values).
    assert blocks.tensor_group == (0, 1, 1, 1)
    assert (blocks.partial_numel(0), blocks.partial_numel(1)) == (32, 17)
    assert blocks.index(1).tolist() == list(range(32, 49))
    assert [blocks.site_group(s) for s in ("0", "1", "2", "3")] == [0, 1, 0, 1]
    # Layers 0 and 2 both fall in group 0 of 2: group 1 would train nothing.
    with pytest.raises(ConfigError, match=r"group\(s\) \[1\] without a parameter tensor"):
        PartialAssignment.build(PartialUpdatesConfig(enabled=True, groups=2, mode="layers"), layout)
    model = nn.Sequential(nn.Embedding(5, 2), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    layers = PartialAssignment.build(
        PartialUpdatesConfig(enabled=True, groups=2, mode="layers"), ParamLayout.from_model(model)
    )
    # "0.weight" is layer 0; "1.0.weight" / "1.1.weight" are layer 1 (the first number).
    assert layers.tensor_group == (0, 1, 1, 1, 1)
    model = nn.ModuleDict({"emb": nn.Embedding(3, 2), "blocks": nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])})
    shared = PartialAssignment.build(
        PartialUpdatesConfig(enabled=True, groups=2, mode="layers"), ParamLayout.from_model(model)
    )
    assert shared.tensor_group == (None, 0, 0, 1, 1)  # the embedding: trained by every site
    assert shared.trained(0)[0] and shared.trained(1)[0]


def test_partial_mean_averages_each_coordinate_over_the_sites_that_trained_it(make_workload) -> None:
    assignment = PartialAssignment.build(PartialUpdatesConfig(enabled=True, groups=2), _layout(make_workload(hidden=8)))
    agg = PartialMean(assignment)
    agg.add(torch.full((32,), 1.0), 1.0, site="0")   # group 0
    agg.add(torch.full((17,), 4.0), 2.0, site="1")   # group 1
    agg.add(torch.full((32,), 4.0), 3.0, site="2")   # group 0
    mean = agg.take_result()
    assert mean[:32].tolist() == [pytest.approx((1 * 1.0 + 3 * 4.0) / 4)] * 32
    assert mean[32:].tolist() == [4.0] * 17
    lonely = PartialMean(assignment)
    lonely.add(torch.full((17,), 2.0), 1.0, site="1")
    assert lonely.take_result().tolist() == [0.0] * 32 + [2.0] * 17  # nobody trained group 0
    with pytest.raises(ValueError, match="sent 32 values; its group 1 trains 17"):
        PartialMean(assignment).add(torch.zeros(32), site="1")


def test_frozen_parameters_are_unchanged_by_local_steps_and_hold_no_optimizer_state(make_workload) -> None:
    sim = Simulator(_config(), make_workload(hidden=8))
    start = sim.global_flat.clone()
    site = sim.sites[1]  # group 1: 0.bias, 2.weight, 2.bias
    sim.trainer.load(start)
    sim.trainer.steps(site, 3)
    after = sim.trainer.flatten()
    assert torch.equal(after[:32], start[:32])
    assert not torch.equal(after[32:], start[32:])
    params = list(sim.model.parameters())
    assert site.optimizer is not None
    assert [p in site.optimizer.state for p in params] == [False, True, True, True]
    assert all(p.requires_grad for p in params)  # unfrozen again after the site's steps


def test_a_round_uploads_only_each_sites_subset_and_counts_its_bytes(make_workload) -> None:
    records = list(Simulator(_config(sites=3), make_workload(hidden=8)).run())
    codec = parse_codec("none")
    expected = {"0": codec.encoded_nbytes((32,)), "1": codec.encoded_nbytes((17,)), "2": codec.encoded_nbytes((32,))}
    assert all(r.bytes_up == expected for r in records)
    plain = list(Simulator(_config(partial={"enabled": False}, sites=3), make_workload(hidden=8)).run())
    assert all(r.bytes_up == dict.fromkeys("012", codec.encoded_nbytes((49,))) for r in plain)
    assert records[-1].eval_loss < make_workload(hidden=8).eval_loss(make_workload(hidden=8).build_model(0))


def test_partial_updates_with_an_error_feedback_codec_keep_a_subset_residual(make_workload) -> None:
    sim = Simulator(_config(uplink_codec="int8"), make_workload(hidden=8))
    list(sim.run())
    residuals = [s.uplink.encoders[0].residual for s in sim.sites]
    assert [r.numel() for r in residuals] == [32, 17]


@pytest.mark.parametrize(
    ("sections", "key", "message"),
    [
        ({"sites": 1}, "algorithm.partial_updates.groups", "2 groups need at least as many sites"),
        ({"aggregation": "median"}, "algorithm.partial_updates.enabled", "use aggregation"),
        ({"name": "ddp"}, "algorithm.partial_updates.enabled", "ddp baseline"),
        ({"partial": {"enabled": True, "groups": 1}}, "algorithm.partial_updates.groups", "must be >= 2"),
    ],
)
def test_refused_combinations_name_the_key(make_workload, sections, key, message) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        Simulator(_config(**sections), make_workload(hidden=8))
    assert err.value.key == key


def test_the_coordinator_runs_partial_updates_but_not_with_privacy() -> None:
    """The real system runs them (tests/integration/test_partial_updates_system.py); like the
    simulator, not combined with [privacy]."""
    from geoloco.coordinator.config import CoordinatorConfig

    config = CoordinatorConfig.from_dict({"insecure": True, "algorithm": {"partial_updates": {"enabled": True}}})
    assert config.algorithm.partial_updates.enabled
    with pytest.raises(ConfigError, match="not combined with \\[privacy\\]") as err:
        CoordinatorConfig.from_dict({
            "insecure": True, "algorithm": {"partial_updates": {"enabled": True}},
            "privacy": {"secure_aggregation": True, "clip_norm": 1.0},
        })
    assert err.value.key == "algorithm.partial_updates.enabled"

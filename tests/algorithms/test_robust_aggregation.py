"""Robust aggregation (``geoloco.algorithms.robust``) against small hand-computed cases, and the
configuration rules that refuse what it cannot serve."""

from __future__ import annotations

import random

import pytest
import torch

from geoloco.algorithms.aggregation import RunningSum, new_aggregation
from geoloco.algorithms.config import ConfigError, config_from_dict
from geoloco.algorithms.robust import RobustAggregation, RobustRule, clip_scales, combine, median_of
from geoloco.algorithms.simulation.sim_config import SimulatorConfig
from geoloco.algorithms.strategy import AlgorithmConfig

MEDIAN = RobustRule(aggregation="median")


def _aggregate(rule: RobustRule, updates: list[list[float]], weights: list[float] | None = None) -> torch.Tensor:
    agg = new_aggregation(len(updates[0]), robust=rule)
    assert isinstance(agg, RobustAggregation)
    for k, values in enumerate(updates):
        agg.add(torch.tensor(values), 1.0 if weights is None else weights[k], site=f"s{k}")
    return agg.take_result()


def test_coordinate_median_odd_and_even() -> None:
    odd = [[1.0, 10.0, -3.0], [2.0, -1.0, 5.0], [30.0, 0.0, 4.0]]
    assert torch.equal(_aggregate(MEDIAN, odd), torch.tensor([2.0, 0.0, 4.0]))
    even = [[1.0, 0.0], [2.0, 4.0], [3.0, 8.0], [100.0, -100.0]]
    # sorted per coordinate: (1, 2, 3, 100) -> (2 + 3) / 2; (-100, 0, 4, 8) -> (0 + 4) / 2
    assert torch.equal(_aggregate(MEDIAN, even), torch.tensor([2.5, 2.0]))


def test_trimmed_mean_drops_floor_fraction_at_each_end() -> None:
    updates = [[1.0, 5.0], [2.0, -7.0], [3.0, 1.0], [4.0, 2.0], [1000.0, 3.0]]
    # 0.2 of 5 -> one dropped at each end: (2, 3, 4) and (1, 2, 3)
    rule = RobustRule(aggregation="trimmed_mean", trim_fraction=0.2)
    assert torch.equal(_aggregate(rule, updates), torch.tensor([3.0, 2.0]))
    # 0.39 of 5 -> still one per end (floor); 0.4 -> two: the median of five
    assert torch.equal(
        _aggregate(RobustRule(aggregation="trimmed_mean", trim_fraction=0.39), updates), torch.tensor([3.0, 2.0])
    )
    assert torch.equal(
        _aggregate(RobustRule(aggregation="trimmed_mean", trim_fraction=0.4), updates), torch.tensor([3.0, 2.0])
    )
    # nothing trimmed below 1/n: the plain (unweighted) mean
    plain = _aggregate(RobustRule(aggregation="trimmed_mean", trim_fraction=0.1), updates)
    assert torch.allclose(plain, torch.tensor([1010.0 / 5, 4.0 / 5]))


def test_clip_to_median_norm_scales_only_the_outlier_and_keeps_weights() -> None:
    updates = [[3.0, 4.0], [0.0, 1.0], [6.0, 8.0], [0.0, 100.0]]  # norms 5, 1, 10, 100
    rule = RobustRule(clip_to_median_norm=2.0)  # median 7.5 -> threshold 15: only [0, 100] -> [0, 15]
    assert torch.allclose(_aggregate(rule, updates), torch.tensor([9.0 / 4, 28.0 / 4]))
    weighted = _aggregate(rule, updates, weights=[1.0, 1.0, 2.0, 1.0])
    assert torch.allclose(weighted, torch.tensor([15.0 / 5, 36.0 / 5]))
    scales, threshold = clip_scales([5.0, 1.0, 10.0, 100.0], 2.0)
    assert threshold == 15.0 and scales == [1.0, 1.0, 1.0, 0.15]


def test_clip_then_median_and_the_record_of_who_was_clipped() -> None:
    agg = RobustAggregation(numel=2, rule=RobustRule(aggregation="median", clip_to_median_norm=1.0))
    for site, values in {"a": [3.0, 4.0], "b": [0.0, 1.0], "c": [0.0, -20.0]}.items():
        agg.add(torch.tensor(values), site=site)
    # norms 5, 1, 20: threshold 5, c -> [0, -5]; medians (0, 3, 0) -> 0 and (4, 1, -5) -> 1
    assert torch.equal(agg.take_result(), torch.tensor([0.0, 1.0]))
    assert agg.clip_threshold == 5.0 and agg.clipped == ["c"]
    assert agg.norms == {"a": 5.0, "b": 1.0, "c": 20.0}


def test_result_does_not_depend_on_arrival_order_and_inputs_are_not_modified() -> None:
    g = torch.Generator().manual_seed(0)
    updates = {f"site-{k}": torch.randn(1000, generator=g) * (k + 1) for k in range(6)}
    originals = {k: v.clone() for k, v in updates.items()}
    for rule in (
        RobustRule(clip_to_median_norm=1.5),
        RobustRule(aggregation="trimmed_mean", trim_fraction=0.2, clip_to_median_norm=2.0),
        MEDIAN,
    ):
        results = []
        for order_seed in range(3):
            names = list(updates)
            random.Random(order_seed).shuffle(names)
            agg = RobustAggregation(numel=1000, rule=rule)
            for name in names:
                agg.add(updates[name], 1.0 + int(name[-1]) if rule.weighted else 1.0, site=name)
            results.append(agg.take_result())
        assert all(torch.equal(results[0], r) for r in results[1:]), rule
    assert all(torch.equal(updates[k], originals[k]) for k in updates)


def test_chunking_over_coordinates_gives_the_same_values() -> None:
    g = torch.Generator().manual_seed(1)
    updates = [torch.randn(257, generator=g) for _ in range(5)]
    for rule in (MEDIAN, RobustRule(aggregation="trimmed_mean", trim_fraction=0.2)):
        whole = combine(updates, [1.0] * 5, rule, scales=[1.0, 0.5, 1.0, 1.0, 0.25])
        chunked = combine(updates, [1.0] * 5, rule, scales=[1.0, 0.5, 1.0, 1.0, 0.25], chunk_elements=17)
        assert torch.equal(whole, chunked)


def test_median_of_and_errors() -> None:
    assert median_of([3.0, 1.0, 2.0]) == 2.0 and median_of([4.0, 1.0, 2.0, 3.0]) == 2.5
    with pytest.raises(ValueError, match="no values"):
        median_of([])
    agg = RobustAggregation(numel=2, rule=MEDIAN)
    with pytest.raises(ValueError, match="nothing"):
        agg.take_result()
    agg.add(torch.zeros(2), site="a")
    with pytest.raises(ValueError, match="already aggregated"):
        agg.add(torch.zeros(2), site="a")
    with pytest.raises(ValueError, match="sent 3 values; the model has 2"):
        agg.add(torch.zeros(3), site="b")
    with pytest.raises(ValueError, match="late_updates must be"):
        agg.add(torch.zeros(2), site="b", stale=True)
    assert agg.held_bytes == 8
    agg.take_result()
    assert agg.held_bytes == 0
    with pytest.raises(ValueError, match="already taken"):
        agg.add(torch.zeros(2), site="b")


def test_new_aggregation_default_is_the_running_sum_and_dp_is_refused() -> None:
    assert isinstance(new_aggregation(4), RunningSum)
    assert isinstance(new_aggregation(4, robust=RobustRule()), RunningSum)
    assert isinstance(new_aggregation(4, robust=MEDIAN), RobustAggregation)
    with pytest.raises(ValueError, match="central DP"):
        new_aggregation(4, robust=MEDIAN, central_dp=(1.0, 1.0))


def test_default_algorithm_config_keeps_the_plain_mean() -> None:
    config = AlgorithmConfig()
    assert config.aggregation == "mean" and not config.robust_rule.enabled
    assert config.to_dict()["aggregation"] == "mean"


@pytest.mark.parametrize(
    ("algorithm", "key", "message"),
    [
        ({"aggregation": "krum"}, "algorithm.aggregation", "allowed values"),
        ({"aggregation": "trimmed_mean", "trim_fraction": 0.5}, "algorithm.trim_fraction", r"\[0, 0.5\)"),
        ({"clip_to_median_norm": 0.5}, "algorithm.clip_to_median_norm", ">= 1"),
        ({"aggregation": "median", "weighting": "samples"}, "algorithm.weighting", "counts every update once"),
        ({"aggregation": "median", "late_updates": "fold"}, "algorithm.late_updates", "drop"),
        ({"name": "ddp", "clip_to_median_norm": 2.0}, "algorithm.clip_to_median_norm", "ddp baseline"),
        ({"aggregation": "trimmed_mean", "trim_fraction": 0.2}, "algorithm.trim_fraction", "trims nothing"),
    ],
)
def test_config_errors_name_the_key_and_what_is_allowed(algorithm: dict, key: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        SimulatorConfig.from_dict({"algorithm": algorithm, "sites": {"count": 4}})
    assert err.value.key == key


def test_clipped_mean_keeps_weights_and_folding() -> None:
    config = SimulatorConfig.from_dict(
        {"algorithm": {"clip_to_median_norm": 2.0, "weighting": "samples", "late_updates": "fold"}}
    )
    assert config.algorithm.robust_rule.enabled


@pytest.mark.parametrize(
    ("privacy", "message"),
    [
        ({"secure_aggregation": True, "clip_norm": 1.0}, "only sees the masked sum"),
        ({"dp": "central", "clip_norm": 1.0, "noise_multiplier": 0.5}, "does not compose with dp"),
    ],
)
def test_robust_aggregation_is_refused_with_secure_aggregation_and_dp(privacy: dict, message: str) -> None:
    for algorithm, key in (
        ({"aggregation": "median"}, "algorithm.aggregation"),
        ({"clip_to_median_norm": 3.0}, "algorithm.clip_to_median_norm"),
    ):
        with pytest.raises(ConfigError, match=message) as err:
            config_from_dict(SimulatorConfig, {"algorithm": algorithm, "privacy": privacy})
        assert err.value.key == key

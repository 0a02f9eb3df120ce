"""Presets that mean the paper: ``algorithm.name = "sparseloco"`` (the authors' method) and
``"sparseloco-tiles"`` (what ``sparseloco`` meant before #27) against hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from geoloco.algorithms.algorithm_config import DEFAULT_OUTER_OPTIMIZERS, AlgorithmConfig
from geoloco.algorithms.config import ConfigError, config_from_dict
from geoloco.algorithms.optimizers import OuterOptimizerConfig
from geoloco.algorithms.strategy import ALGORITHMS, Strategy, build_strategy


def test_sparseloco_resolves_to_the_authors_settings() -> None:
    config = config_from_dict(AlgorithmConfig, {"name": "sparseloco", "inner_steps": 15})
    assert config.uplink_codec == "tiletopk:0.015625,tile=64,divisors|int2mean"
    assert config.error_feedback is True
    assert config.error_feedback_decay == 0.95
    assert config.clip_to_median_norm == 1.0
    assert config.robust_rule.enabled and config.robust_rule.weighted
    assert config.inner_steps == 15
    assert ALGORITHMS["sparseloco"] is Strategy
    outer = OuterOptimizerConfig().resolved(DEFAULT_OUTER_OPTIMIZERS["sparseloco"])
    assert (outer.name, outer.lr, outer.momentum) == ("sgd", 1.0, 0.0)
    assert AlgorithmConfig.preset("sparseloco") == config_from_dict(AlgorithmConfig, {"name": "sparseloco"})


def test_sparseloco_tiles_keeps_the_earlier_preset() -> None:
    config = config_from_dict(AlgorithmConfig, {"name": "sparseloco-tiles"})
    assert (config.uplink_codec, config.error_feedback, config.error_feedback_decay, config.clip_to_median_norm) == (
        "tiletopk:0.03,tile=64|int2", True, 0.95, None
    )
    assert ALGORITHMS["sparseloco-tiles"] is Strategy
    assert DEFAULT_OUTER_OPTIMIZERS["sparseloco-tiles"] == "sgd"
    # A config that spells the earlier codec under the old name still validates.
    explicit = AlgorithmConfig.preset("sparseloco", uplink_codec="tiletopk:0.03,tile=64|int2")
    assert explicit.uplink_codec == "tiletopk:0.03,tile=64|int2"


def test_explicit_keys_override_the_preset() -> None:
    config = config_from_dict(
        AlgorithmConfig,
        {"name": "sparseloco", "uplink_codec": "topk:0.01|int4", "error_feedback_decay": 0.9},
    )
    assert (config.uplink_codec, config.error_feedback_decay, config.error_feedback) == ("topk:0.01|int4", 0.9, True)


def test_sparseloco_without_a_top_k_codec_says_how_to_get_the_preset() -> None:
    with pytest.raises(ConfigError, match=r"uplink_codec.*sparseloco sends chunked top-k.*preset"):
        AlgorithmConfig(name="sparseloco")
    with pytest.raises(ConfigError, match="algorithm.uplink_codec"):
        config_from_dict(AlgorithmConfig, {"name": "sparseloco", "uplink_codec": "int8"}, prefix="algorithm")
    with pytest.raises(ConfigError, match=r"sparseloco-tiles sends chunked top-k.*tiletopk:0.03,tile=64\|int2"):
        AlgorithmConfig(name="sparseloco-tiles")


def test_sparseloco_with_partial_updates_names_the_variant_without_clipping() -> None:
    with pytest.raises(ConfigError, match="partial_updates.enabled.*sparseloco-tiles"):
        AlgorithmConfig.preset("sparseloco", partial_updates={"enabled": True})
    assert AlgorithmConfig.preset("sparseloco-tiles", partial_updates={"enabled": True}).partial_updates.enabled


def _int2_single(x: float) -> float:
    """What 2-bit codes carry of a block holding one value ``x``: the grid is ``(2j - 3) s`` with
    ``s = |x| / 3`` rounded *up* to a bfloat16 (8 significant bits), so ``x`` comes back as ``±3 s``."""
    scale = torch.tensor(abs(x), dtype=torch.float32) / 3
    exponent = math.floor(math.log2(float(scale)))
    step = 2.0 ** (exponent - 7)
    return (1.0 if x > 0 else -1.0) * 3 * math.ceil(float(scale) / step) * step


def test_sparseloco_tiles_two_rounds_by_hand() -> None:
    """Two sites, 8 weights (no layout: one 1-D tensor): top-k keeps ceil(0.03 * 8) = 1 value each,
    2-bit codes carry it as ``±3 s`` (exact for 3 and -6), outer SGD lr 1 subtracts the mean;
    round 2 adds 0.95 times the residual to the new update. (This pinned ``sparseloco`` before
    #27 made that name the authors' method; the earlier preset lives on as ``sparseloco-tiles``.)"""
    strategy = build_strategy(AlgorithmConfig.preset("sparseloco-tiles"), numel=8, seed=1)
    sites = ["a", "b"]
    uplinks = {s: strategy.build_uplink() for s in sites}
    theta = torch.zeros(8)

    def round_(index: int, updates: dict[str, list[float]]) -> torch.Tensor:
        plan = strategy.configure_round(index, sites)
        agg = strategy.new_aggregator(index)
        for s in sites:
            update = torch.tensor(updates[s], dtype=torch.float32)
            agg.add(uplinks[s].encode(update, seed=plan.uplink_seed(s)), 1.0, site=s)
        return strategy.aggregate_round(theta, agg, plan).global_flat

    theta = round_(0, {"a": [0, 0, 3, 0, 0, 0, 0.5, 0], "b": [1, 0, 0, 0, 0, 0, 0, -6]})
    # a sends 3 at 2 (keeps 0.5 at 6), b sends -6 at 7 (keeps 1 at 0); mean [0,0,1.5,...,-3]; θ = 0 - mean.
    assert theta.tolist() == [0, 0, -1.5, 0, 0, 0, 0, 3]
    assert uplinks["a"].encoders[0].residual.tolist() == [0, 0, 0, 0, 0, 0, 0.5, 0]
    assert uplinks["b"].encoders[0].residual.tolist() == [1, 0, 0, 0, 0, 0, 0, 0]
    theta = round_(1, {"a": [0, 3, 0, 0, 0, 0, 0, 0], "b": [0, 0, 0, 0, 0, 0, 0, 0.5]})
    # a: u = x + 0.95 e = [0, 3, ..., 0.475, 0] -> sends 3 at 1, keeps 0.475 at 6;
    # b: u = [0.95, 0, ..., 0.5] -> sends 0.95 at 0 (|0.95| > 0.5) as 3 * bf16(0.95 / 3).
    sent_b = _int2_single(0.95)
    assert sent_b != pytest.approx(0.95, abs=1e-4)  # the 2-bit rounding is visible
    assert theta.tolist() == pytest.approx([-sent_b / 2, -1.5, -1.5, 0, 0, 0, 0, 3], abs=1e-6)
    residual_a = uplinks["a"].encoders[0].residual
    assert residual_a.tolist() == pytest.approx([0, 0, 0, 0, 0, 0, 0.95 * 0.5, 0], abs=1e-7)
    residual_b = uplinks["b"].encoders[0].residual
    assert residual_b.tolist() == pytest.approx([0.95 - sent_b, 0, 0, 0, 0, 0, 0, 0.5], abs=1e-6)


def test_sparseloco_round_clips_every_update_to_the_median_norm_by_hand() -> None:
    """Three sites, 8 weights (one 1-D tensor: one chunk of 8, all kept since 64 >= 8). Each
    update is one constant, which ``int2mean`` carries exactly (σ = 0: every value in one bin whose
    mean is the constant). Norms are 1, 2 and 10 times sqrt(8): the median is 2 sqrt(8), so the
    third update is scaled to 2 per weight and the others pass; the mean is (1 + 2 + 2) / 3, and
    outer SGD lr 1 subtracts it. Nothing is lost, so every residual is zero."""
    from geoloco.algorithms.aggregation import new_aggregation

    config = AlgorithmConfig.preset("sparseloco")
    strategy = build_strategy(config, numel=8, seed=1)
    sites = ["a", "b", "c"]
    uplinks = {s: strategy.build_uplink() for s in sites}
    plan = strategy.configure_round(0, sites)
    agg = new_aggregation(8, robust=config.robust_rule)  # as the coordinator and the simulator build it
    for site, value in zip(sites, (1.0, 2.0, 10.0), strict=True):
        agg.add(uplinks[site].encode(torch.full((8,), value), seed=plan.uplink_seed(site)), 1.0, site=site)
    theta = strategy.aggregate_round(torch.zeros(8), agg, plan).global_flat
    assert theta.tolist() == pytest.approx([-5 / 3] * 8, rel=1e-6)
    for site in sites:
        assert uplinks[site].encoders[0].residual.count_nonzero() == 0


def test_sparseloco_chunks_each_tensor_by_divisors() -> None:
    """With the model's layout (a 128x128 weight, a bias of 100), the authors' chunking cuts the
    weight into four 64x64 chunks keeping 64 each (1/64 of 4096) and the bias into two chunks of
    50 (largest divisor of 100 <= 64), each keeping min(64, 50) = 50: the bias is sent whole."""
    from geoloco.algorithms.params import ParamEntry, ParamLayout
    from geoloco.compression import decode

    layout = ParamLayout(entries=(ParamEntry("w", (128, 128), 0), ParamEntry("b", (100,), 16384)), numel=16484)
    update = torch.randn(16484, generator=torch.Generator().manual_seed(0))
    strategy = build_strategy(AlgorithmConfig.preset("sparseloco"), numel=layout.numel, layout=layout, seed=1)
    dense = decode(strategy.build_uplink("0").encode(update, seed=0, fragment=0)).view(-1)
    weight = dense[:16384].view(128, 128)
    counts = [int(weight[r : r + 64, c : c + 64].count_nonzero()) for r in (0, 64) for c in (0, 64)]
    assert counts == [64, 64, 64, 64]
    assert int(dense[16384:].count_nonzero()) == 100


def test_sparseloco_tiles_each_tensor_of_the_model() -> None:
    """With the model's layout (a 128x128 weight, a bias of 100), the uplink keeps 123 values per
    64x64 tile (ceil(0.03 * 4096)) and ceil(0.03 * 100) = 3 of the bias; the flat-chunk codec of
    earlier versions, still accepted, keeps a different set (its chunks are 32-row strips)."""
    from geoloco.algorithms.params import ParamEntry, ParamLayout
    from geoloco.compression import decode

    layout = ParamLayout(entries=(ParamEntry("w", (128, 128), 0), ParamEntry("b", (100,), 16384)), numel=16484)
    update = torch.randn(16484, generator=torch.Generator().manual_seed(0))
    counts = {}
    for codec in ("tiletopk:0.03,tile=64|int2", "topk:0.03,chunk=4096|int2"):
        config = AlgorithmConfig.preset("sparseloco-tiles", uplink_codec=codec)
        strategy = build_strategy(config, numel=layout.numel, layout=layout, seed=1)
        encoded = strategy.build_uplink("0").encode(update, seed=0, fragment=0)
        dense = decode(encoded).view(-1)
        weight = dense[:16384].view(128, 128)
        counts[codec] = [
            int(weight[r : r + 64, c : c + 64].count_nonzero()) for r in (0, 64) for c in (0, 64)
        ] + [int(dense[16384:].count_nonzero())]
    assert counts["tiletopk:0.03,tile=64|int2"] == [123, 123, 123, 123, 3]
    assert counts["topk:0.03,chunk=4096|int2"] != counts["tiletopk:0.03,tile=64|int2"]


def test_print_config_shows_the_resolved_preset(capsys: pytest.CaptureFixture[str]) -> None:
    from geoloco.scenarios.cli import main
    from geoloco.scenarios.config_file import tomllib

    code = main([
        "simulate", "--print-config", "--set", "workload.name=mlp", "--set", "algorithm.name=sparseloco",
        "--set", "algorithm.error_feedback_decay=0.9", "--device", "cpu",
    ])
    assert code == 0
    resolved = tomllib.loads(capsys.readouterr().out)
    algorithm = resolved["algorithm"]
    assert (algorithm["name"], algorithm["uplink_codec"], algorithm["error_feedback"]) == (
        "sparseloco", "tiletopk:0.015625,tile=64,divisors|int2mean", True,
    )
    assert algorithm["clip_to_median_norm"] == 1.0
    assert algorithm["error_feedback_decay"] == 0.9  # the explicit key wins
    outer = resolved["outer_optimizer"]
    assert (outer["name"], outer["lr"], outer["momentum"]) == ("sgd", 1.0, 0.0)


def test_the_coordinator_runs_sparseloco_and_a_site_reads_back_the_same_config() -> None:
    from geoloco.coordinator.config import CoordinatorConfig

    coordinator = CoordinatorConfig.from_dict(
        {"insecure": True, "algorithm": {"name": "sparseloco", "inner_steps": 15}}
    )
    assert coordinator.algorithm == AlgorithmConfig.preset("sparseloco", inner_steps=15)
    # What a site rebuilds from the coordinator's config_json (site_agent.state).
    assert config_from_dict(AlgorithmConfig, coordinator.algorithm.to_dict()) == coordinator.algorithm

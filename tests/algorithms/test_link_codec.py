"""The per-site uplink codec rule (``geoloco.algorithms.link_codec``) on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from geoloco.algorithms.algorithm_config import AlgorithmConfig
from geoloco.algorithms.config import ConfigError, config_from_dict
from geoloco.algorithms.diloco import UpdateEncoder
from geoloco.algorithms.link_codec import (
    AdaptiveUplinkConfig,
    CodecPlans,
    LinkMeter,
    choose_codecs,
    codec_nbytes,
    sparse_spec,
    switch_codec,
)
from geoloco.compression import decode, parse_codec

INT8 = parse_codec("int8").spec
"""The canonical spelling (with the default block) that plans and ``Encoded.spec`` carry."""
GBIT = 125e6
"""1 Gbit/s in bytes per second."""
MBIT10 = 1.25e6


def _toy_nbytes(spec: str, numel: int) -> int:
    """A size model that is easy to compute by hand: int8 is 1 byte per value, top-k 5 bytes
    (an int8 value and a 4-byte index) per kept value."""
    if spec == INT8:
        return numel
    assert spec.startswith("topk:") and spec.endswith("|" + INT8), spec
    density = _density(spec)
    return 5 * math.ceil(density * numel)


def _density(spec: str) -> float:
    """The top-k density of ``spec`` (0 for a dense codec)."""
    return float(spec.split(":")[1].split(",")[0]) if spec.startswith("topk:") else 0.0


def _choose(rates: dict[str, float], **bounds: float) -> dict[str, str]:
    """The rule's arithmetic on 1 MB uploads at Gbit/s (8 ms, under the default noise floor
    ``min_upload_s``, which is off here unless given; its own tests are below)."""
    return choose_codecs(
        rates, sorted(rates), numel=1_000_000, base_codec="int8",
        config=AdaptiveUplinkConfig(enabled=True, **{"min_upload_s": 0.0, **bounds}), nbytes=_toy_nbytes,
    )


def test_slow_site_gets_the_density_that_fits_the_fast_sites_time() -> None:
    # t_ref = 1e6 B / 125e6 B/s = 8 ms; the slow site's budget: 1.25e6 B/s * 8 ms = 10_000 B
    # = 5 B * 2000 kept values -> density 0.002.
    codecs = _choose({"a": GBIT, "b": GBIT, "c": GBIT, "slow": MBIT10})
    assert codecs["a"] == codecs["b"] == codecs["c"] == INT8
    assert codecs["slow"] == sparse_spec(0.002, "int8")
    assert codecs["slow"].startswith("topk:0.002")


def test_density_is_rounded_down_to_two_digits_within_the_budget() -> None:
    # budget: 3e6 B/s * 8 ms = 24_000 B = 4800 values -> 0.0048; at 3.1e6: 24_800 B -> 0.00496,
    # two digits down -> 0.0049 (0.005 would be 25_000 B, over budget).
    assert _density(_choose({"a": GBIT, "b": GBIT, "s": 3e6})["s"]) == 0.0048
    assert _density(_choose({"a": GBIT, "b": GBIT, "s": 3.1e6})["s"]) == 0.0049


def test_bounds_clamp_the_density() -> None:
    # The budget of a 10 Mbit/s site is density 0.002; min_density 0.01 lifts it (the site then
    # takes longer), and a 0.001 max_density caps it.
    assert _density(_choose({"a": GBIT, "b": GBIT, "s": MBIT10}, min_density=0.01)["s"]) == 0.01
    capped = _choose({"a": GBIT, "b": GBIT, "s": MBIT10}, min_density=0.0005, max_density=0.001)
    assert _density(capped["s"]) == 0.001


def test_sites_within_tolerance_and_unmeasured_sites_send_the_dense_codec() -> None:
    # 0.9 Gbit/s: dense upload 8.9 ms <= 1.25 * 8 ms -> int8; 0.5 Gbit/s: 16 ms -> top-k
    # (budget 62.5e6 * 8 ms = 500_000 B -> density 0.1).
    codecs = choose_codecs(
        {"a": GBIT, "b": GBIT, "near": 0.9 * GBIT, "half": 0.5 * GBIT, "broken": float("nan")},
        ["a", "b", "near", "half", "new", "broken"], numel=1_000_000, base_codec="int8",
        config=AdaptiveUplinkConfig(enabled=True, min_upload_s=0.0), nbytes=_toy_nbytes,
    )
    assert codecs["near"] == INT8 and codecs["new"] == INT8 and codecs["broken"] == INT8
    assert _density(codecs["half"]) == 0.1


def test_tolerance_one_sparsifies_every_site_slower_than_the_median() -> None:
    # 0.7 Gbit/s: dense 11.4 ms > 8 ms; budget 87.5e6 B/s * 8 ms = 700_000 B -> density 0.14.
    codecs = _choose({"a": GBIT, "b": GBIT, "c": 0.7 * GBIT}, max_density=1.0, tolerance=1.0)
    assert _density(codecs["c"]) == 0.14 and codecs["a"] == codecs["b"] == INT8
    assert set(_choose({"a": GBIT, "b": GBIT}, max_density=1.0, tolerance=1.0).values()) == {INT8}


def test_no_measurement_means_the_run_codec_for_everyone() -> None:
    assert _choose({}) == {}
    assert choose_codecs(
        {}, ["a", "b"], numel=10, base_codec="int8", config=AdaptiveUplinkConfig(enabled=True)
    ) == {"a": INT8, "b": INT8}


def test_real_codec_sizes_make_the_slow_upload_about_as_long() -> None:
    numel = 2_000_000
    codecs = choose_codecs(
        {"a": GBIT, "b": GBIT, "c": GBIT, "slow": MBIT10}, ["a", "b", "c", "slow"], numel=numel,
        base_codec="int8", config=AdaptiveUplinkConfig(enabled=True),
    )
    fast_s = codec_nbytes(codecs["a"], numel) / GBIT
    slow_s = codec_nbytes(codecs["slow"], numel) / MBIT10
    assert codecs["slow"] != INT8
    assert slow_s <= 1.0 * fast_s  # within the budget
    assert slow_s >= 0.5 * fast_s  # and not far below it


def test_uploads_too_short_to_time_keep_the_dense_codec() -> None:
    """On loopback the same 100-byte upload takes 0.2 ms or 0.9 ms by the scheduler's whim; the
    2-4x spread of such times must not give honest sites top-k codecs: below ``min_upload_s``
    (10 ms by default) no upload time is told apart from another."""
    plans = CodecPlans(AdaptiveUplinkConfig(enabled=True), "int8")
    numel = 60
    size = codec_nbytes(INT8, numel)
    for site, seconds in (("a", 0.0002), ("b", 0.0009), ("c", 0.0003), ("d", 0.0004)):
        plans.observe_upload(site, size, seconds)
    assert plans.plan(1, numel) == dict.fromkeys("abcd", INT8)


def test_a_slow_site_among_sites_under_the_noise_floor_fits_the_floor() -> None:
    # Fast sites' 1 MB int8 uploads take 1 ms (under the 10 ms floor); the 10 Mbit/s site's
    # budget is its rate over the floor, 1.25e6 B/s * 10 ms = 12_500 B -> density 0.0025, not the
    # 1 ms budget (density 0.00025, below min_density).
    rates = {"a": 1e9, "b": 1e9, "slow": MBIT10}

    def choose(**floor: float) -> dict[str, str]:
        config = AdaptiveUplinkConfig(enabled=True, min_density=0.0001, **floor)
        return choose_codecs(
            rates, sorted(rates), numel=1_000_000, base_codec="int8", config=config, nbytes=_toy_nbytes
        )

    codecs = choose()
    assert codecs["a"] == codecs["b"] == INT8
    assert _density(codecs["slow"]) == 0.0025
    assert _density(choose(min_upload_s=0.0)["slow"]) == 0.00025


def test_link_meter_averages_and_ignores_unmeasurable_transfers() -> None:
    meter = LinkMeter(smoothing=0.5)
    meter.observe_up("a", 1000, 1.0)
    meter.observe_up("a", 3000, 1.0)
    meter.observe_up("a", 10, 0.0)  # too short to say anything
    meter.observe_up("a", 0, 1.0)
    assert meter.up == {"a": 2000.0}


def test_switching_codec_keeps_the_residual_so_nothing_is_lost() -> None:
    torch.manual_seed(0)
    updates = [torch.randn(1000) for _ in range(4)]
    encoder = UpdateEncoder("none", error_feedback=True)  # lossless: no residual at first
    sent = torch.zeros(1000)
    for update, spec in zip(updates, ["none", "topk:0.01|int8", "int8", "none"], strict=True):
        encoder = switch_codec(encoder, spec, error_feedback=True)
        assert encoder.spec.startswith(spec.split("|")[0].split(":")[0])
        sent += decode(encoder.encode(update, seed=0))
    residual = encoder.residual if encoder.residual is not None else torch.zeros(1000)
    # Error feedback: what was sent plus what is kept is everything (the last lossless send
    # flushed the residual).
    torch.testing.assert_close(sent + residual, torch.stack(updates).sum(0), rtol=0, atol=1e-4)
    assert float(residual.abs().max()) < 1e-5


def test_switch_to_the_same_codec_keeps_the_encoder() -> None:
    encoder = UpdateEncoder("int8")
    assert switch_codec(encoder, "int8", error_feedback=True) is encoder


def test_config_is_validated_with_clear_errors() -> None:
    with pytest.raises(ConfigError, match="min_density"):
        AdaptiveUplinkConfig(min_density=0)
    with pytest.raises(ConfigError, match="max_density"):
        AdaptiveUplinkConfig(min_density=0.1, max_density=0.01)
    with pytest.raises(ConfigError, match="target"):
        AdaptiveUplinkConfig(target="fastest")  # type: ignore[arg-type]
    for bad in (-0.001, float("nan")):
        with pytest.raises(ConfigError, match="min_upload_s.*seconds >= 0"):
            AdaptiveUplinkConfig(min_upload_s=bad)
    with pytest.raises(ConfigError, match="uplink_codec.*value codec"):
        config_from_dict(AlgorithmConfig, {"uplink_codec": "topk:0.1|int8", "adaptive_uplink": {"enabled": True}})
    with pytest.raises(ConfigError, match="adaptive_uplink.unknown"):
        config_from_dict(AlgorithmConfig, {"adaptive_uplink": {"enabled": True, "unknown": 1}})
    config = config_from_dict(
        AlgorithmConfig, {"uplink_codec": "int8", "adaptive_uplink": {"enabled": True, "min_density": 0.01}}
    )
    assert config.adaptive_uplink.min_density == 0.01

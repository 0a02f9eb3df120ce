"""Top-k keeps exactly the largest magnitudes per chunk; random-k is a pure function of the seed."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geoloco.compression import decode, parse_codec, random_indices

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def kept_per_chunk(fraction: float, length: int) -> int:
    return math.ceil(Fraction(repr(fraction)) * length)


@SETTINGS
@given(
    numel=st.integers(0, 3000),
    chunk=st.integers(1, 700),
    fraction=st.sampled_from([0.001, 0.01, 0.07, 0.25, 0.5, 1.0]),
    ties=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_topk_keeps_exactly_the_largest_per_chunk(
    numel: int, chunk: int, fraction: float, ties: bool, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=generator)
    if ties:  # few distinct magnitudes, both signs
        x = torch.randint(-3, 4, (numel,), generator=generator).float()
    y = decode(parse_codec(f"topk:{fraction},chunk={chunk}").encode(x).to_bytes())
    assert bool(((y == x) | (y == 0)).all()), "top-k must send chosen values exactly and zeros elsewhere"
    for start in range(0, numel, chunk):
        part_x, part_y = x[start : start + chunk], y[start : start + chunk]
        keep = kept_per_chunk(fraction, part_x.numel())
        # The kept magnitudes are the `keep` largest ones (as a multiset, so ties are fine).
        expected = part_x.abs().sort(descending=True).values[:keep]
        chosen = part_y.abs().sort(descending=True).values[:keep]
        assert torch.equal(chosen, expected)
        assert int((part_y != 0).sum()) <= keep


def test_topk_keeps_exact_count_on_constant_input() -> None:
    x = torch.full((10_000,), 2.5)
    y = parse_codec("topk:0.01,chunk=1000").decode(parse_codec("topk:0.01,chunk=1000").encode(x))
    assert int((y != 0).sum()) == 100
    assert [int((y[i : i + 1000] != 0).sum()) for i in range(0, 10_000, 1000)] == [10] * 10


def test_topk_pipeline_quantizes_only_the_kept_values() -> None:
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    sparse = decode(parse_codec("topk:0.05,chunk=500").encode(x))
    quantized = decode(parse_codec("topk:0.05,chunk=500|int4:block=16").encode(x))
    assert torch.equal(sparse != 0, quantized != 0)
    kept = sparse != 0
    assert float((quantized[kept] - sparse[kept]).abs().max()) <= float(sparse.abs().max()) / 14 * (1 + 2**-7)


def test_topk_works_on_any_shape() -> None:
    x = torch.randn(3, 50, 7)
    y = decode(parse_codec("topk:0.1,chunk=2000").encode(x))
    assert y.shape == x.shape
    assert int((y != 0).sum()) == kept_per_chunk(0.1, x.numel())
    assert torch.equal(y.flatten().abs().topk(105).values, x.flatten().abs().topk(105).values)


@pytest.mark.parametrize("fraction", [0.01, 0.3, 0.9, 1.0])
def test_randk_sends_the_values_at_the_seeded_indices(fraction: float) -> None:
    x = torch.randn(2000, dtype=torch.float64)
    codec = parse_codec(f"randk:{fraction}")
    y = decode(codec.encode(x, seed=77).to_bytes())
    index = random_indices(77, 2000, kept_per_chunk(fraction, 2000))
    assert torch.equal(index, torch.unique(index)), "indices are distinct and sorted"
    assert torch.equal(y[index], x[index])
    mask = torch.ones(2000, dtype=torch.bool)
    mask[index] = False
    assert bool((y[mask] == 0).all())


def test_randk_same_seed_same_coordinates_different_seed_different() -> None:
    codec = parse_codec("randk:0.01")  # lossless values: nonzero exactly where chosen
    x, z = torch.randn(100_000), torch.randn(100_000)
    same_a = decode(codec.encode(x, seed=5)) != 0
    same_b = decode(codec.encode(z, seed=5)) != 0
    other = decode(codec.encode(x, seed=6)) != 0
    assert torch.equal(same_a, same_b)
    assert not torch.equal(same_a, other)
    assert torch.equal(random_indices(5, 100_000, 1000), random_indices(5, 100_000, 1000))
    assert not torch.equal(random_indices(5, 100_000, 1000), random_indices(6, 100_000, 1000))


def test_randk_indices_are_a_fixed_function_of_the_seed() -> None:
    # Golden values: these must never change, or sites running different builds would disagree
    # on the coordinates of a round. They do not depend on torch's RNG.
    assert random_indices(2024, 100, 10).tolist() == [4, 16, 19, 31, 33, 39, 42, 48, 68, 78]
    assert random_indices(2**64 - 1, 10**6, 8).tolist() == [
        161764, 242940, 583466, 591164, 651429, 767325, 865812, 879445,
    ]
    assert random_indices(7, 20, 15).tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 15, 17, 18]


@pytest.mark.parametrize("numel, count", [(20, 5), (20, 15), (7, 1)])
def test_randk_coordinates_are_uniform(numel: int, count: int) -> None:
    seeds = 2000
    hits = torch.zeros(numel)
    for seed in range(seeds):
        index = random_indices(seed, numel, count)
        assert index.numel() == count and torch.unique(index).numel() == count
        hits[index] += 1
    expected = seeds * count / numel
    # Each coordinate's hit count is binomial(seeds, count/numel); allow 5 standard deviations.
    sigma = math.sqrt(seeds * (count / numel) * (1 - count / numel))
    assert float((hits - expected).abs().max()) < 5 * sigma


def test_randk_unbiased_flag_scales_to_an_unbiased_estimate() -> None:
    x = torch.linspace(-1, 1, 40, dtype=torch.float64)
    codec = parse_codec("randk:0.25,unbiased")
    seeds = 1000
    total = sum(decode(codec.encode(x, seed=seed)) for seed in range(seeds))
    mean = total / seeds
    # Per coordinate: value * 4 with probability 1/4, else 0 -> variance 3 x^2.
    tolerance = 5 * math.sqrt(3) * x.abs() / math.sqrt(seeds) + 1e-12
    assert bool(((mean - x).abs() <= tolerance).all())
    plain = decode(parse_codec("randk:0.25").encode(x, seed=1))
    assert set(plain[plain != 0].tolist()) <= set(x.tolist())


def test_randk_rejects_bad_seeds() -> None:
    codec = parse_codec("randk:0.5")
    for seed in (-1, 2**64):
        with pytest.raises(ValueError, match="seed"):
            codec.encode(torch.ones(4), seed=seed)

"""Stochastic rounding is unbiased: the mean of many independent decodes converges to the input."""

from __future__ import annotations

import math

import pytest
import torch

from geoloco.compression import decode, parse_codec

# One grid step as a multiple of the block's absolute maximum (see quantize.py).
STEP = {8: 1 / 127, 4: 1 / 7, 2: 2 / 3, 1: 2.0}
REPEATS = 4000


def block_of_test_values() -> torch.Tensor:
    """256 values spanning the grid: both extremes, zeros, and points between grid levels."""
    generator = torch.Generator().manual_seed(3)
    values = torch.rand(256, generator=generator) * 2 - 1
    values[0], values[1], values[2], values[3] = 1.0, -1.0, 0.0, 0.5
    values[4:12] = torch.tensor([1e-4, -1e-4, 0.999, -0.999, 1 / 3, -1 / 3, 0.12345, -0.6789])
    return values * 3.0  # absmax 3


@pytest.mark.parametrize("bits", [8, 4, 2, 1])
def test_stochastic_rounding_is_unbiased(bits: int) -> None:
    x = block_of_test_values()
    absmax = float(x.abs().max())
    tiled = x.repeat(REPEATS)  # every block holds the same values, hence the same scale
    torch.manual_seed(1234)
    decoded = decode(parse_codec(f"int{bits}:block=256,stochastic").encode(tiled)).view(REPEATS, 256)
    step = STEP[bits] * absmax * (1 + 2**-7)
    # Rounding noise per decode has variance <= step^2 / 4; 5 standard errors of the mean, plus
    # the documented 2^-17-step resolution of the 16-bit noise.
    tolerance = 5 * step / (2 * math.sqrt(REPEATS)) + step * 2**-16
    bias = (decoded.double().mean(dim=0) - x.double()).abs()
    assert float(bias.max()) <= tolerance, f"int{bits}: bias {float(bias.max()):.3g} > {tolerance:.3g}"
    # Every decode lies on one of the two grid points around x.
    assert float((decoded - x).abs().max()) < step

    # The test has power: round-to-nearest is biased by far more than the tolerance here.
    nearest = decode(parse_codec(f"int{bits}:block=256").encode(x))
    assert float((nearest.double() - x.double()).abs().max()) > 4 * tolerance


def test_stochastic_rounding_follows_the_global_seed() -> None:
    codec = parse_codec("int4:stochastic")
    x = torch.randn(1000)
    torch.manual_seed(7)
    first = codec.encode(x)
    torch.manual_seed(7)
    again = codec.encode(x)
    different = codec.encode(x)
    assert first == again
    assert first != different

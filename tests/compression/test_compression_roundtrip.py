"""Round-trip error bounds of every value codec, as property tests over shapes, dtypes and values.

Bounds checked (A = absolute maximum of the value's block, x and x̂ compared in float64):

- ``none``: bit-exact. ``fp32``/``bf16``/``fp16``: equal to torch's own cast of the (saturated) value.
- ``intB`` deterministic: ``|x - x̂| <= A * c_B * (1 + 2**-7) + slack`` with
  ``c_8 = 1/254, c_4 = 1/14, c_2 = 1/3, c_1 = 1``; stochastic: ``c = 1/127, 1/7, 2/3, 2`` (one
  grid step). ``(1 + 2**-7)`` is the bfloat16 scale rounding; ``slack`` covers rounding the
  result to the output dtype (``2 * eps_dtype * A``) and the ``2**-126`` scale floor.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geoloco.compression import decode, parse_codec

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
KINDS = ("normal", "zeros", "tiny", "huge", "constant", "mixed", "sparse")
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

shapes = st.one_of(
    st.integers(0, 1100).map(lambda n: (n,)),
    st.lists(st.integers(0, 9), min_size=0, max_size=4).map(tuple),
)


def make_tensor(shape: tuple[int, ...], dtype: torch.dtype, kind: str, seed: int) -> torch.Tensor:
    """Deterministic test values of one kind, representable in ``dtype``."""
    generator = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    base = torch.randn(numel, generator=generator, dtype=torch.float64)
    half = dtype == torch.float16
    if kind == "normal":
        values = base
    elif kind == "zeros":
        values = torch.zeros(numel, dtype=torch.float64)
    elif kind == "tiny":
        values = base * (1e-6 if half else 1e-30)
    elif kind == "huge":
        values = base / (float(base.abs().max()) if numel else 1.0) * (6.0e4 if half else 1e30)
    elif kind == "constant":
        values = torch.full((numel,), -3.25, dtype=torch.float64)
    elif kind == "mixed":
        span = 4 if half else 20  # decades either side of 1
        exponents = torch.rand(numel, generator=generator, dtype=torch.float64) * (2 * span) - span
        values = base * 10.0**exponents
    else:
        values = base * (torch.rand(numel, generator=generator, dtype=torch.float64) < 0.1)
    return values.to(dtype).reshape(shape)


def roundtrip(spec: str, x: torch.Tensor) -> torch.Tensor:
    codec = parse_codec(spec)
    encoded = codec.encode(x, seed=11)
    wire = encoded.to_bytes()
    assert len(wire) == encoded.nbytes == codec.encoded_nbytes(x.shape, x.dtype)
    y = decode(wire)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(codec.decode(encoded), y, rtol=0, atol=0, equal_nan=False)
    return y


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per element, the absolute maximum of its block (in float64)."""
    flat = x.reshape(-1).double().abs()
    padded = torch.nn.functional.pad(flat, (0, (-flat.numel()) % block))
    return padded.view(-1, block).amax(dim=1).repeat_interleave(block)[: flat.numel()]


def unit_roundoff(dtype: torch.dtype) -> float:
    # float64 inputs are quantized in float32, which rounds them once.
    return torch.finfo(torch.float32 if dtype == torch.float64 else dtype).eps / 2


examples = st.tuples(shapes, st.sampled_from(DTYPES), st.sampled_from(KINDS), st.integers(0, 2**16))


@SETTINGS
@given(example=examples)
def test_none_is_bit_exact(example: tuple) -> None:
    x = make_tensor(*example)
    y = roundtrip("none", x)
    assert torch.equal(y.reshape(-1).view(torch.uint8), x.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("spec, target", [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
@SETTINGS
@given(example=examples)
def test_casts_round_to_nearest_and_saturate(spec: str, target: torch.dtype, example: tuple) -> None:
    x = make_tensor(*example)
    y = roundtrip(spec, x)
    limit = torch.finfo(target).max
    expected = x.double().clamp(-limit, limit).to(target).to(x.dtype)
    assert torch.equal(y, expected)


def quantizer_bound(x: torch.Tensor, bits: int, block: int, stochastic: bool) -> torch.Tensor:
    stochastic_factor = {8: 1 / 127, 4: 1 / 7, 2: 2 / 3, 1: 2.0}
    nearest_factor = {8: 1 / 254, 4: 1 / 14, 2: 1 / 3, 1: 1.0}
    factor = (stochastic_factor if stochastic else nearest_factor)[bits]
    absmax = block_absmax(x, block)
    finfo = torch.finfo(x.dtype)
    return absmax * (factor * (1 + 2**-7) + 2 * unit_roundoff(x.dtype)) + 2.0**-126 + finfo.smallest_normal * finfo.eps


@pytest.mark.parametrize("bits", [8, 4, 2, 1])
@pytest.mark.parametrize("stochastic", [False, True])
@SETTINGS
@given(example=examples, block=st.sampled_from([8, 16, 256]))
def test_quantizer_error_bound(bits: int, stochastic: bool, example: tuple, block: int) -> None:
    x = make_tensor(*example)
    spec = f"int{bits}:block={block}" + (",stochastic" if stochastic else "")
    y = roundtrip(spec, x)
    error = (x.double() - y.double()).reshape(-1).abs()
    bound = quantizer_bound(x, bits, block, stochastic)
    worst = int(torch.argmax(error - bound)) if error.numel() else 0
    assert bool((error <= bound).all()), (
        f"{spec}: |x - x̂| = {error[worst]:.6g} > {bound[worst]:.6g} at {worst} (x = {x.reshape(-1)[worst]})"
    )
    if bits in (8, 4):  # grids with a zero level keep zeros exact
        assert bool((y.reshape(-1)[x.reshape(-1) == 0] == 0).all())


@SETTINGS
@given(example=examples, block=st.sampled_from([8, 256]))
def test_int1_is_sign_times_block_mean_magnitude(example: tuple, block: int) -> None:
    x = make_tensor(*example)
    y = roundtrip(f"int1:block={block}", x).reshape(-1).double()
    flat = x.reshape(-1).double()
    nonzero = y != 0
    assert bool(((flat >= 0) == (y > 0))[nonzero].all()), "decoded sign differs from the input's"
    for start in range(0, flat.numel(), block):
        magnitude = flat[start : start + block].abs().mean()
        decoded = y[start : start + block].abs()
        tolerance = magnitude * (2**-8 + 2 * unit_roundoff(x.dtype)) + torch.finfo(x.dtype).smallest_normal
        assert bool(((decoded - magnitude).abs() <= tolerance).all())


def test_int2_uses_four_levels_without_zero() -> None:
    x = torch.tensor([-3.0, -1.0, 0.4, 1.0, 3.0, 2.1, -2.1, 0.0])
    y = roundtrip("int2:block=8", x)
    assert y.tolist() == [-3.0, -1.0, 1.0, 1.0, 3.0, 3.0, -3.0, 1.0]


def test_huge_and_tiny_blocks_get_their_own_scales() -> None:
    x = torch.cat([torch.full((256,), 1e30), torch.full((256,), -1e-30), torch.zeros(256)])
    y = roundtrip("int8", x)
    torch.testing.assert_close(y, x, rtol=1 / 200, atol=0)


def test_float64_beyond_float32_range_is_rejected_by_lossy_codecs_only() -> None:
    x = torch.tensor([1e300, -2.0, 3.0], dtype=torch.float64)
    assert torch.equal(roundtrip("none", x), x)
    assert torch.equal(roundtrip("topk:0.5", x), torch.tensor([1e300, 0.0, 3.0], dtype=torch.float64))
    for spec in ("int8", "fp32", "bf16", "topk:0.5|int4"):
        with pytest.raises(ValueError, match="float32"):
            parse_codec(spec).encode(x)


def test_fp16_saturates_instead_of_overflowing() -> None:
    x = torch.tensor([1e6, -7e4, 65504.0, 1.0])
    assert roundtrip("fp16", x).tolist() == [65504.0, -65504.0, 65504.0, 1.0]
    assert torch.isfinite(roundtrip("bf16", torch.tensor([3.4e38, -3.4e38]))).all()

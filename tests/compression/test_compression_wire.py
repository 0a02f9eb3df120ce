"""Exact wire sizes, and decode-side failures: truncated, corrupted or mismatched data."""

from __future__ import annotations

import math
import struct
import zlib
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geoloco.compression import CodecError, Encoded, decode, parse_codec

HEADER = 21  # magic 4, version 1, dtype 1, ndim 1, spec length 2, payload length 8, CRC 4

SPECS = (
    "none",
    "fp32",
    "bf16",
    "fp16",
    "int8",
    "int4:block=8",
    "int2:block=128,stochastic",
    "int1",
    "int1:block=16,stochastic",
    "topk:0.01",
    "topk:0.1,chunk=1000|int4:block=16",
    "topk:0.3,chunk=7|bf16",
    "randk:0.05|int8",
    "randk:0.5,unbiased|int2:block=8",
)


def value_payload(stage: str, count: int, dtype: torch.dtype) -> int:
    """The stated payload formula of a value codec, written independently of the implementation."""
    name, _, args = stage.partition(":")
    if name == "none":
        return count * torch.empty(0, dtype=dtype).element_size()
    if name == "fp32":
        return 4 * count
    if name in ("bf16", "fp16"):
        return 2 * count
    bits = int(name[3:])
    block = int(dict(arg.split("=") for arg in args.split(",") if "=" in arg)["block"])
    return 2 * math.ceil(count / block) + math.ceil(count * bits / 8)


def expected_nbytes(canonical: str, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = math.prod(shape)
    stages = canonical.split("|")
    if len(stages) == 1:
        payload = value_payload(stages[0], numel, dtype)
    else:
        sparsifier, values = stages
        name, _, args = sparsifier.partition(":")
        fraction = Fraction(args.split(",")[0])
        if name == "topk":
            chunk = int(args.split("chunk=")[1])
            kept = (numel // chunk) * math.ceil(fraction * chunk) + math.ceil(fraction * (numel % chunk))
            index_bits = max(1, math.ceil(math.log2(chunk)))
            payload = math.ceil(math.ceil(kept * index_bits / 8) / 8) * 8 + value_payload(values, kept, dtype)
        else:
            payload = 8 + value_payload(values, math.ceil(fraction * numel), dtype)
    return HEADER + len(canonical) + 8 * len(shape) + payload


@pytest.mark.parametrize("spec", SPECS)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.lists(st.integers(0, 70), min_size=0, max_size=3).map(tuple),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
)
def test_nbytes_is_exact_and_matches_the_stated_formula(spec: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    codec = parse_codec(spec)
    x = torch.randn(shape, dtype=torch.float64).to(dtype)
    encoded = codec.encode(x, seed=5)
    assert encoded.nbytes == len(encoded.to_bytes())
    assert encoded.nbytes == expected_nbytes(codec.spec, shape, dtype)
    assert codec.encoded_nbytes(shape, dtype) == encoded.nbytes


def test_nbytes_worked_examples() -> None:
    # int4, 1000 values, block 256: 21 + len("int4:block=256") + 8 + ceil(1000/2) + 2*ceil(1000/256)
    assert parse_codec("int4").encode(torch.randn(1000)).nbytes == 21 + 14 + 8 + 500 + 8
    # top-1% of 1000 values: 10 kept, 12-bit indices -> 15 bytes padded to 16, 10 float32 values
    topk = parse_codec("topk:0.01")
    assert topk.spec == "topk:0.01,chunk=4096|none"
    assert topk.encode(torch.randn(1000)).nbytes == 21 + 25 + 8 + 16 + 40
    # 64M values: int8 is 8.0625 bits per value plus the header
    assert parse_codec("int8").encoded_nbytes((2**26,)) == 21 + 14 + 8 + 2**26 + 2 * 2**18


def small_encoding(spec: str = "int4:block=8") -> tuple[bytes, Encoded]:
    encoded = parse_codec(spec).encode(torch.randn(3, 7), seed=3)
    return encoded.to_bytes(), encoded


def test_from_bytes_round_trips() -> None:
    wire, encoded = small_encoding()
    parsed = Encoded.from_bytes(wire)
    assert parsed == encoded
    assert Encoded.from_bytes(bytearray(wire)) == encoded
    assert Encoded.from_bytes(memoryview(wire)) == encoded
    torch.testing.assert_close(decode(wire), parse_codec("int4:block=8").decode(encoded))


@pytest.mark.parametrize("spec", ["int4:block=8", "topk:0.2|int8", "randk:0.3", "none"])
def test_every_truncation_is_rejected(spec: str) -> None:
    wire, _ = small_encoding(spec)
    for length in range(len(wire)):
        with pytest.raises(CodecError):
            decode(wire[:length])
    with pytest.raises(CodecError, match="trailing"):
        decode(wire + b"\x00")


@pytest.mark.parametrize("spec", ["int4:block=8", "topk:0.2|int8", "randk:0.3"])
def test_every_single_bit_flip_is_rejected(spec: str) -> None:
    wire, _ = small_encoding(spec)
    for position in range(len(wire)):
        for bit in (0, 7):
            corrupted = bytearray(wire)
            corrupted[position] ^= 1 << bit
            with pytest.raises(CodecError):
                decode(bytes(corrupted))


def reseal(body: bytes) -> bytes:
    """Header+payload with a fresh, valid CRC: corruption the CRC cannot see."""
    return body + struct.pack("<I", zlib.crc32(body))


def test_bad_magic_and_version_are_named() -> None:
    wire, _ = small_encoding()
    body = wire[:-4]
    with pytest.raises(CodecError, match="magic"):
        decode(reseal(b"XXXX" + body[4:]))
    with pytest.raises(CodecError, match="version 9"):
        decode(reseal(body[:4] + b"\x09" + body[5:]))
    with pytest.raises(CodecError, match="dtype code"):
        decode(reseal(body[:5] + b"\x63" + body[6:]))


def test_wrong_codec_is_rejected() -> None:
    _, encoded = small_encoding("int4:block=8")
    with pytest.raises(CodecError, match="int4:block=8"):
        parse_codec("int8").decode(encoded)
    # A non-canonical spelling of the same codec is accepted.
    _, dense = small_encoding("int8")
    respelled = Encoded("int8", dense.shape, dense.dtype, dense.payload)
    assert torch.equal(parse_codec("int8").decode(respelled), decode(dense))


def test_payload_that_does_not_fit_the_spec_is_rejected() -> None:
    _, encoded = small_encoding("int8")
    for payload in (encoded.payload[:-1], torch.cat([encoded.payload, encoded.payload[:1]])):
        mismatched = Encoded(encoded.spec, encoded.shape, encoded.dtype, payload)
        with pytest.raises(CodecError, match="payload has"):
            decode(mismatched)
        with pytest.raises(CodecError):
            decode(mismatched.to_bytes())  # valid container, wrong contents
    wider = Encoded(encoded.spec, (4, 7), encoded.dtype, encoded.payload)
    with pytest.raises(CodecError):
        decode(wider)


def test_unknown_codec_in_data_is_a_codec_error() -> None:
    _, encoded = small_encoding("int8")
    foreign = Encoded("zstd:level=3", encoded.shape, encoded.dtype, encoded.payload)
    with pytest.raises(CodecError, match="zstd"):
        decode(foreign.to_bytes())


def test_out_of_range_topk_index_is_rejected() -> None:
    codec = parse_codec("topk:0.5,chunk=1000")
    encoded = codec.encode(torch.randn(1000))
    payload = encoded.payload.clone()
    payload[:10] = 0xFF  # 10-bit indices of 1023 > chunk
    with pytest.raises(CodecError, match="index"):
        decode(Encoded(encoded.spec, encoded.shape, encoded.dtype, payload))


def test_non_finite_scale_is_rejected() -> None:
    encoded = parse_codec("int8:block=8").encode(torch.randn(16))
    payload = encoded.payload.clone()
    payload[0:2] = torch.tensor([0x80, 0x7F], dtype=torch.uint8)  # bfloat16 +Inf
    with pytest.raises(CodecError, match="scale"):
        decode(Encoded(encoded.spec, encoded.shape, encoded.dtype, payload))


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=120))
def test_random_bytes_raise_codec_error_only(data: bytes) -> None:
    with pytest.raises(CodecError):
        decode(data)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.sampled_from(SPECS), numel=st.integers(0, 300), seed=st.integers(0, 2**32))
def test_random_payload_of_the_right_size_decodes_or_raises_codec_error(spec: str, numel: int, seed: int) -> None:
    codec = parse_codec(spec)
    size = codec.encode(torch.zeros(numel), seed=1).payload.numel()
    payload = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    try:
        result = decode(Encoded(codec.spec, (numel,), torch.float32, payload))
    except CodecError:
        return
    assert result.shape == (numel,)


def test_header_fields_are_validated() -> None:
    payload = torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="dtype"):
        Encoded("none", (1,), torch.int32, payload)
    with pytest.raises(ValueError, match="uint8"):
        Encoded("none", (1,), torch.float32, torch.zeros(1))
    with pytest.raises(ValueError, match="shape"):
        Encoded("none", (-1,), torch.float32, payload)
    encoded = Encoded("none", torch.Size([1]), torch.float32, payload)
    assert encoded.shape == (1,) and isinstance(encoded.shape, tuple)
    assert "nbytes=37" in repr(encoded)  # 21 + len("none") + 8 + 4

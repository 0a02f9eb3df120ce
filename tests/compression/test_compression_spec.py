"""Spec parsing: canonical forms, the registry, and errors that name the bad token."""

from __future__ import annotations

import pytest
import torch

from geoloco.compression import CODEC_NAMES, Codec, describe_codecs, parse_codec


@pytest.mark.parametrize(
    "spec, canonical",
    [
        ("none", "none"),
        ("bf16", "bf16"),
        ("int8", "int8:block=256"),
        ("int4:block=64", "int4:block=64"),
        ("int2:block=128,stochastic", "int2:block=128,stochastic"),
        ("int2:stochastic,block=128", "int2:block=128,stochastic"),
        ("int1:stochastic", "int1:block=256,stochastic"),
        ("topk:0.01", "topk:0.01,chunk=4096|none"),
        ("topk:0.01|int4", "topk:0.01,chunk=4096|int4:block=256"),
        ("topk:fraction=0.1,chunk=77|fp16", "topk:0.1,chunk=77|fp16"),
        ("topk:0.001", "topk:0.001,chunk=32768|none"),
        ("topk:1", "topk:1.0,chunk=1024|none"),
        ("topk:1e-6", "topk:1e-06,chunk=1048576|none"),
        ("randk:0.05|int8", "randk:0.05|int8:block=256"),
        ("randk:0.5,unbiased", "randk:0.5,unbiased|none"),
        (" topk : 0.01 , chunk=512 | int8 : block = 64 ", "topk:0.01,chunk=512|int8:block=64"),
    ],
)
def test_canonical_spec(spec: str, canonical: str) -> None:
    codec = parse_codec(spec)
    assert isinstance(codec, Codec)
    assert codec.spec == canonical
    assert parse_codec(canonical).spec == canonical
    assert parse_codec(canonical) == codec
    assert codec.encode(torch.ones(3)).spec == canonical


def test_registry_lists_every_codec() -> None:
    assert set(CODEC_NAMES) == {
        "none", "fp32", "bf16", "fp16", "int8", "int4", "int2", "int1", "int2mean", "topk", "randk", "tiletopk"
    }
    help_text = describe_codecs()
    for name in CODEC_NAMES:
        assert f"\n{name}: " in help_text
    assert "block=N" in help_text and "stochastic" in help_text and "chunk=N" in help_text


@pytest.mark.parametrize(
    "spec, fragments",
    [
        ("foo", ["'foo'", "accepted codecs", "int8", "topk", "randk"]),
        ("int3", ["'int3'", "int4"]),
        ("int16:block=8", ["'int16'"]),
        ("topk:0", ["'0'", "(0, 1]"]),
        ("topk:1.5", ["'1.5'", "(0, 1]"]),
        ("topk:-1", ["'-1'"]),
        ("topk:abc", ["'abc'"]),
        ("randk:nan", ["'nan'"]),
        ("randk:inf|int8", ["'inf'"]),
        ("topk", ["'topk'", "needs a fraction"]),
        ("randk:unbiased", ["needs a fraction"]),
        ("int8:block=abc", ["block='abc'", "not an integer"]),
        ("int8:block=100", ["block=100", "multiple of 8"]),
        ("int8:block=0", ["block=0"]),
        ("int8:block=-8", ["block='-8'"]),
        ("int8:block=4194304", ["block=4194304", "out of range"]),
        ("int8:blk=8", ["'blk'", "block=N", "stochastic"]),
        ("int8:0.5", ["'0.5'", "block=N"]),
        ("int8:stochastic=1", ["'stochastic'", "takes no value"]),
        ("int4:block=8,block=16", ["'block'", "twice"]),
        ("topk:0.1,0.2", ["'fraction'", "twice"]),
        ("topk:0.1,chunk=0", ["chunk=0"]),
        ("topk:0.1,chnk=5", ["'chnk'", "chunk=N"]),
        ("randk:0.1,unbiased=yes", ["'unbiased'", "takes no value"]),
        ("none:x", ["'x'", "takes no arguments"]),
        ("bf16:block=8", ["'block'", "takes no arguments"]),
        ("int8|int4", ["'int8'", "last stage"]),
        ("int8|topk:0.1", ["'int8'", "last stage"]),
        ("topk:0.1|randk:0.1", ["'randk'", "first stage"]),
        ("topk:0.1|randk:0.1|int8", ["'randk'", "first stage"]),
        ("", ["empty stage"]),
        ("int8|", ["empty stage"]),
        ("|int8", ["empty stage"]),
        ("int8:", ["empty argument", "'int8:'"]),
        ("int8:block=8,", ["empty argument"]),
    ],
)
def test_malformed_spec_names_the_token(spec: str, fragments: list[str]) -> None:
    with pytest.raises(ValueError) as raised:
        parse_codec(spec)
    message = str(raised.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from: {message}"


def test_spec_must_be_a_string() -> None:
    with pytest.raises(TypeError, match="string"):
        parse_codec(8)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool, torch.complex64])
def test_non_float_tensors_are_rejected(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match="floating-point"):
        parse_codec("int8").encode(torch.zeros(4, dtype=dtype))


@pytest.mark.parametrize(
    "spec", ["none", "fp32", "bf16", "fp16", "int8", "int4", "int2", "int1", "int1:stochastic", "int8:stochastic",
             "topk:0.01", "topk:0.5|int2", "randk:0.3|int4", "randk:0.9"],
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize(("numel", "position"), [(1030, 0), (1030, 700), (1030, 1029), (4096, 300), (70000, 69999)])
def test_non_finite_input_is_rejected(spec: str, bad: float, numel: int, position: int) -> None:
    # Many full blocks (4096, 70000): torch's vectorised max over several rows returns a NaN
    # whose bit pattern the bfloat16 rounding of the scale used to turn into zero.
    x = torch.randn(numel)
    x[position] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        parse_codec(spec).encode(x)

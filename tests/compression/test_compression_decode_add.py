"""Decoding an update straight into a sum (``add_decoded_into``) and its norm (``decoded_norm``)
give exactly what decoding first gives, for every codec, without a dense decoded tensor."""

from __future__ import annotations

import math

import pytest
import torch

from geoloco.compression import (
    CodecError,
    Encoded,
    PipelineCodec,
    add_decoded_into,
    decode,
    decoded_norm,
    parse_codec,
    stages,
)

SPECS = [
    "none",
    "fp32",
    "bf16",
    "fp16",
    "int8",
    "int4",
    "int2",
    "int1",
    "int8:block=64,stochastic",
    "topk:0.01|int4",
    "topk:0.05,chunk=1000|int8",
    "topk:0.3",
    "randk:0.02|int8",
    "randk:0.1,unbiased|int4",
    "randk:0.05,shared|none",
]

# Sizes with a tail block / chunk and, at the largest, several decode pieces (2**20 values each).
SIZES = [1, 1000, 4099, (1 << 20) * 2 + 777]


def _update(numel: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=generator) * 1e-3


def _reference(base: torch.Tensor, encoded: Encoded, weight: float) -> torch.Tensor:
    """What ``RunningSum.add`` did before: decode into a dense tensor, then one ``add_``."""
    out = base.clone()
    out.add_(decode(encoded).reshape(-1).to(out), alpha=weight)
    return out


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("numel", SIZES)
def test_add_decoded_into_is_bitwise_decode_then_add(spec: str, numel: int) -> None:
    codec = parse_codec(spec)
    base = torch.zeros(numel)
    # Two sites added in turn: the second lands on a non-zero sum, as in a round.
    for site, weight in enumerate((0.75, 1.3)):
        encoded = codec.encode(_update(numel, site), seed=11 + site)
        expected = _reference(base, encoded, weight)
        add_decoded_into(encoded, base, scale=weight)
        assert torch.equal(base.view(torch.int32), expected.view(torch.int32)), (spec, numel, site)


@pytest.mark.parametrize("spec", SPECS)
def test_decoded_norm_matches_dense_norm(spec: str) -> None:
    numel = (1 << 20) + 4099
    encoded = parse_codec(spec).encode(_update(numel, 3), seed=5)
    norm, finite = decoded_norm(encoded)
    dense = float(torch.linalg.vector_norm(decode(encoded).double()))
    assert finite
    assert norm == pytest.approx(dense, rel=1e-9)
    # The float32 norm of the whole tensor (what the guard computed before) is within 1e-4.
    assert norm == pytest.approx(float(torch.linalg.vector_norm(decode(encoded))), rel=1e-4)


def test_decoded_norm_reports_non_finite_values() -> None:
    values = _update(5000, 1)
    values[4321] = math.inf
    encoded = Encoded("none", (5000,), torch.float32, values.view(torch.uint8).clone())
    norm, finite = decoded_norm(encoded)
    assert not finite and not math.isfinite(norm)
    values[4321] = math.nan
    assert decoded_norm(Encoded("none", (5000,), torch.float32, values.view(torch.uint8).clone()))[1] is False


def test_decoded_norm_of_large_finite_values_is_their_true_norm() -> None:
    """Squares beyond float32's range are summed in float64, like ``update_guard.update_norm``."""
    values = torch.full((3000,), 1e30)
    norm, finite = decoded_norm(parse_codec("none").encode(values))
    assert finite and norm == pytest.approx(1e30 * math.sqrt(3000), rel=1e-6)


@pytest.mark.parametrize("spec", ["topk:0.01|int4", "randk:0.01|int8"])
def test_sparse_add_touches_only_selected_coordinates(spec: str) -> None:
    """A sparse upload is added at its k coordinates: no dense value piece is ever produced."""
    numel = 200_000
    codec = parse_codec(spec)
    assert isinstance(codec, PipelineCodec) and codec.sparsifier is not None
    encoded = codec.encode(_update(numel, 2), seed=9)
    pieces = list(codec._pieces(encoded, torch.device("cpu")))
    assert len(pieces) == 1
    index, values = pieces[0]
    kept = codec.sparsifier.num_selected(numel)
    assert isinstance(index, torch.Tensor) and index.numel() == values.numel() == kept < numel // 50
    assert torch.unique(index).numel() == kept
    dense = decode(encoded)
    assert torch.equal(dense[index], values) and int(torch.count_nonzero(dense)) <= kept


def test_dense_pieces_stay_small() -> None:
    """Quantized and cast payloads decode through buffers of at most PIECE_ELEMENTS values."""
    numel = 3 * stages.PIECE_ELEMENTS + 5
    for spec in ("int8", "int4", "none", "bf16"):
        codec = parse_codec(spec)
        assert isinstance(codec, PipelineCodec)
        encoded = codec.encode(_update(numel, 4))
        sizes = [values.numel() for _, values in codec._pieces(encoded, torch.device("cpu"))]
        assert sum(sizes) == numel and max(sizes) <= stages.PIECE_ELEMENTS, spec


def test_corrupted_sparse_payload_raises_before_the_sum_changes() -> None:
    numel = 10_000
    encoded = parse_codec("topk:0.01,chunk=1000|int8").encode(_update(numel, 5))
    payload = encoded.payload.clone()
    payload[:16] = 0xFF  # packed 10-bit indices of 1023 > chunk 1000
    broken = Encoded(encoded.spec, encoded.shape, encoded.dtype, payload)
    out = torch.ones(numel)
    with pytest.raises(CodecError, match="beyond its chunk"):
        add_decoded_into(broken, out)
    with pytest.raises(CodecError, match="beyond its chunk"):
        decoded_norm(broken)
    assert torch.equal(out, torch.ones(numel))


def test_non_float32_originals_fall_back_to_decode_then_add() -> None:
    """A bfloat16 original decodes to bfloat16 first (a rounding step): the fallback keeps it."""
    values = _update(3000, 6).to(torch.bfloat16)
    encoded = parse_codec("int8").encode(values)
    out = torch.zeros(3000)
    add_decoded_into(encoded, out, scale=0.5)
    assert torch.equal(out, torch.zeros(3000).add_(decode(encoded).to(torch.float32), alpha=0.5))

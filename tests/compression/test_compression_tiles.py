"""``tiletopk``: top-k per fixed 64x64 tile of each tensor (the ``sparseloco-tiles`` variant; the
authors' divisor chunking, ``divisors``, is in test_compression_sparseloco.py), against
hand-computed cases, and its decode-and-add path against decode-then-add."""

from __future__ import annotations

import math

import pytest
import torch

from geoloco.compression import CodecError, Encoded, add_decoded_into, decode, decoded_norm, parse_codec


def _tile_counts(dense: torch.Tensor, tile: int) -> list[int]:
    rows, cols = dense.shape
    return [
        int(dense[r : r + tile, c : c + tile].count_nonzero())
        for r in range(0, rows, tile)
        for c in range(0, cols, tile)
    ]


def test_128x128_keeps_exactly_k_per_tile_and_the_known_largest() -> None:
    """Each of the four 64x64 tiles keeps ceil(0.03 * 4096) = 123 values: the 123 planted large
    ones, even when one tile's planted values are all smaller than another tile's."""
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(128, 128, generator=generator) * 1e-3 + 1e-4  # small, nonzero, distinct
    planted = torch.zeros(128, 128, dtype=torch.bool)
    for tile, (top, left) in enumerate([(0, 0), (0, 64), (64, 0), (64, 64)]):
        positions = torch.randperm(4096, generator=generator)[:123]
        r, c = top + positions // 64, left + positions % 64
        planted[r, c] = True
        x[r, c] = (10.0**tile) * (1 + torch.arange(123, dtype=torch.float32)) * (-1) ** torch.arange(123)
    encoded = parse_codec("tiletopk:0.03,tile=64").encode(x)
    dense = decode(encoded)
    assert dense.shape == (128, 128)
    assert _tile_counts(dense, 64) == [123, 123, 123, 123]
    assert torch.equal(dense != 0, planted)
    assert torch.equal(dense[planted], x[planted])
    # The flat chunking of ``topk`` (4096 consecutive values = 32 rows spanning two tiles) does not.
    flat = decode(parse_codec("topk:0.03,chunk=4096").encode(x))
    assert _tile_counts(flat, 64) != [123, 123, 123, 123]


def test_edge_tiles_and_1d_chunks_per_tensor() -> None:
    """A bound codec tiles each tensor of the flat vector: 100x70 -> tiles 64x64, 64x6, 36x64,
    36x6; a 1-D tensor of 5000 -> chunks of 4096 and 904. At F = 0.03 they keep
    123, 12, 70, 7, 123 and 28 values: 363 in all."""
    codec = parse_codec("tiletopk:0.03|none").with_shapes([(100, 70), (5000,)])
    generator = torch.Generator().manual_seed(1)
    flat = torch.randn(7000 + 5000, generator=generator)
    encoded = codec.encode(flat)
    dense = decode(encoded)
    matrix, vector = dense[:7000].view(100, 70), dense[7000:]
    assert _tile_counts(matrix, 64) == [123, 12, 70, 7]
    assert [int(vector[:4096].count_nonzero()), int(vector[4096:].count_nonzero())] == [123, 28]
    # Each kept value is its tile's largest: the 12 kept of the 64x6 tile are its top 12.
    edge = flat[:7000].view(100, 70)[:64, 64:]
    kept = matrix[:64, 64:]
    assert torch.equal(kept.abs().flatten().sort().values[-12:], edge.abs().flatten().sort().values[-12:])
    # Payload: header 8 + 2 x 8, indices roundup8(ceil(363 * 12 / 8)) = 552, values 363 x 4.
    assert encoded.payload.numel() == 24 + 552 + 363 * 4
    assert encoded.nbytes == codec.encoded_nbytes((12000,))
    assert encoded.spec == "tiletopk:0.03,tile=64|none"


def test_unbound_flat_vector_is_one_1d_tensor() -> None:
    flat = torch.randn(10000, generator=torch.Generator().manual_seed(2))
    dense = decode(parse_codec("tiletopk:0.5,tile=64").encode(flat))
    assert [int(dense[:4096].count_nonzero()), int(dense[4096:8192].count_nonzero())] == [2048, 2048]
    assert int(dense[8192:].count_nonzero()) == math.ceil(0.5 * (10000 - 8192))


def test_bound_codec_refuses_a_vector_of_another_size() -> None:
    codec = parse_codec("tiletopk:0.1").with_shapes([(10, 10)])
    with pytest.raises(ValueError, match="100 values"):
        codec.encode(torch.ones(101))


@pytest.mark.parametrize("spec", ["tiletopk:0.03|int2", "tiletopk:0.1,tile=8|int8", "tiletopk:0.3"])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_add_decoded_into_and_norm_are_bitwise_decode_then_add(spec: str, scale: float) -> None:
    shapes = [(300, 130), (130,), (7, 5, 3), (4099,)]
    numel = sum(math.prod(s) for s in shapes)
    generator = torch.Generator().manual_seed(3)
    encoded = parse_codec(spec).with_shapes(shapes).encode(torch.randn(numel, generator=generator) * 1e-3)
    base = torch.randn(numel, generator=generator)
    expected = base.clone().add_(decode(encoded).reshape(-1), alpha=scale)
    out = base.clone()
    add_decoded_into(encoded, out, scale=scale)
    assert torch.equal(out, expected)
    norm, finite = decoded_norm(encoded)
    assert finite
    assert norm == pytest.approx(float(torch.linalg.vector_norm(decode(encoded).double())), rel=1e-12)


def test_corrupted_header_is_a_codec_error_and_leaves_out_untouched() -> None:
    encoded = parse_codec("tiletopk:0.1|int8").with_shapes([(64, 64), (64,)]).encode(torch.randn(4160))
    payload = encoded.payload.clone()
    payload[8] ^= 0x01  # first tensor's rows: 64 -> 65, so the shapes no longer add up
    broken = Encoded(encoded.spec, encoded.shape, encoded.dtype, payload)
    out = torch.ones(4160)
    with pytest.raises(CodecError, match="tensors hold"):
        add_decoded_into(broken, out)
    assert torch.equal(out, torch.ones(4160))
    with pytest.raises(CodecError):
        decode(broken)

"""Element slices of encoded tensors (``geoloco.compression.slicing``): a rank of a sharded site
gets its rows of a broadcast delta as an encoding of their own, the very values a whole-delta
site decodes."""

from __future__ import annotations

import pytest
import torch

from geoloco.compression import CodecError, Encoded, decode, parse_codec
from geoloco.compression.slicing import element_nbytes, sliced_parts

RANGES = [(3, 5), (20, 0), (40, 17), (99, 1)]


def _reader(data: bytes):  # type: ignore[no-untyped-def]
    return lambda offset, size: data[offset : offset + size]


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16"])
def test_slice_decodes_to_the_decoded_rows_bit_for_bit(spec: str) -> None:
    values = torch.randn(100, generator=torch.Generator().manual_seed(1)) * 3
    encoded = parse_codec(spec).encode(values)
    whole = decode(encoded).reshape(-1)
    sliced = Encoded.from_bytes(b"".join(sliced_parts(_reader(encoded.to_bytes()), RANGES)))
    rows = torch.cat([whole[o : o + n] for o, n in RANGES])
    assert sliced.spec == encoded.spec and sliced.shape == (rows.numel(),)
    assert torch.equal(decode(sliced), rows)  # CRC checked by from_bytes as well


def test_codecs_without_element_slices_are_named() -> None:
    assert element_nbytes("none", torch.float32) == 4
    assert element_nbytes("fp16", torch.float32) == 2
    assert element_nbytes("int8", torch.float32) is None
    assert element_nbytes("topk:0.1", torch.float32) is None
    data = parse_codec("int8").encode(torch.randn(64)).to_bytes()
    with pytest.raises(CodecError, match="not elementwise"):
        list(sliced_parts(_reader(data), [(0, 4)]))


def test_a_range_outside_the_tensor_is_refused_before_anything_is_yielded() -> None:
    data = parse_codec("none").encode(torch.randn(10)).to_bytes()
    parts = sliced_parts(_reader(data), [(0, 2), (8, 3)])
    with pytest.raises(CodecError, match=r"8\.\.11 lies outside the tensor's 10 elements"):
        next(parts)


def test_large_ranges_come_in_pieces_and_still_decode() -> None:
    import geoloco.compression.slicing as slicing

    values = torch.arange(5000, dtype=torch.float32)
    data = parse_codec("none").encode(values).to_bytes()
    old = slicing._PIECE_BYTES
    slicing._PIECE_BYTES = 1000
    try:
        parts = list(sliced_parts(_reader(data), [(10, 4000)]))
    finally:
        slicing._PIECE_BYTES = old
    assert len(parts) > 10
    assert torch.equal(decode(Encoded.from_bytes(b"".join(parts))), values[10:4010])

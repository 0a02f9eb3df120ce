"""Element slices of encoded tensors (``geoloco.compression.slicing``): a rank of a sharded site
gets its rows of a broadcast delta as an encoding of their own, the very values a whole-delta
site decodes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import geoloco.compression.slicing as slicing
from geoloco.compression import CodecError, Encoded, decode, parse_codec
from geoloco.compression.slicing import covering_runs, row_positions, slice_block, sliced_parts

NUMEL = 1000
RANGES = [(3, 5), (20, 0), (40, 17), (57, 300), (999, 1)]
"""Uneven, touching (40..57 and 57..357) and ending at the tensor's last element."""


def _reader(data: bytes) -> Callable[[int, int], bytes]:
    return lambda offset, size: data[offset : offset + size]


def _rows_from_slice(spec: str, values: torch.Tensor, ranges: list[tuple[int, int]]) -> tuple[torch.Tensor, int]:
    """(the ranges' values as a receiver of the slice picks them, decoded elements served)."""
    encoded = parse_codec(spec).encode(values)
    sliced = Encoded.from_bytes(b"".join(sliced_parts(_reader(encoded.to_bytes()), ranges)))  # CRC checked
    assert sliced.spec == encoded.spec
    served = decode(sliced).reshape(-1)
    block = slice_block(spec)
    assert block is not None
    positions = row_positions(ranges, block, values.numel())
    return torch.cat([served[p : p + n] for (_, n), p in zip(ranges, positions, strict=True)]), served.numel()


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "int8", "int4:block=64", "int2:block=32", "int1"])
def test_slice_gives_the_rows_of_the_whole_decode_bit_for_bit(spec: str) -> None:
    values = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1)) * 3
    whole = decode(parse_codec(spec).encode(values)).reshape(-1)
    rows, served = _rows_from_slice(spec, values, RANGES)
    assert torch.equal(rows, torch.cat([whole[o : o + n] for o, n in RANGES]))
    needed = sum(n for _, n in RANGES)
    block = slice_block(spec)
    assert block is not None
    # Elementwise codecs serve exactly the rows; quantizers at most a block more per range end.
    assert needed <= served <= needed + 2 * (block - 1) * len(RANGES)
    if block == 1:
        assert served == needed


def test_covering_runs_merge_where_blocks_touch() -> None:
    assert covering_runs([(3, 5), (40, 17), (57, 300)], 1, NUMEL) == [(3, 5), (40, 317)]
    assert covering_runs([(3, 5), (40, 17), (300, 10)], 64, NUMEL) == [(0, 64), (256, 64)]
    assert covering_runs([(990, 10)], 64, NUMEL) == [(960, 40)]  # the short last block
    assert row_positions([(3, 5), (40, 17), (300, 10)], 64, NUMEL) == [3, 40, 64 + 44]


def test_sparse_codecs_cannot_be_sliced() -> None:
    assert slice_block("none") == 1 and slice_block("fp16") == 1 and slice_block("int8") == 256
    assert slice_block("topk:0.1") is None and slice_block("randk:0.1|int8") is None
    data = parse_codec("topk:0.1").encode(torch.randn(64)).to_bytes()
    with pytest.raises(CodecError, match="cannot be sliced"):
        list(sliced_parts(_reader(data), [(0, 4)]))


def test_a_range_outside_the_tensor_is_refused_before_anything_is_yielded() -> None:
    data = parse_codec("none").encode(torch.randn(10)).to_bytes()
    parts = sliced_parts(_reader(data), [(0, 2), (8, 3)])
    with pytest.raises(CodecError, match=r"8\.\.11 lies outside the tensor's 10 elements"):
        next(parts)


def test_large_ranges_come_in_pieces_and_still_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    values = torch.arange(5000, dtype=torch.float32)
    data = parse_codec("none").encode(values).to_bytes()
    monkeypatch.setattr(slicing, "_PIECE_BYTES", 1000)
    parts = list(sliced_parts(_reader(data), [(10, 4000)]))
    assert len(parts) > 10
    assert torch.equal(decode(Encoded.from_bytes(b"".join(parts))), values[10:4010])

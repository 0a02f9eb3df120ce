"""Element ranges of an encoded tensor, as an encoding of their own, without decoding it.

A rank of a sharded site needs only its rows of a broadcast delta. Codecs without a sparsifier
encode independent *units* in element order, so the rows' encoding is made of byte ranges of
the payload, with a new header and CRC, and decodes to the very values a whole-delta receiver
gets (so a rank adds exactly what the coordinator added):

* ``none`` and the casts: one fixed-size value per element, the unit is one element;
* the block quantizers (``int8`` ...): a bfloat16 scale per block, then the blocks' packed
  codes; the unit is one block, so a range is served as the whole blocks that cover it (the
  *covering runs*, merged where they touch) and the receiver picks its rows out of them
  (``row_positions``), at most two partial blocks per range more than it needs.

Sparsifiers (indices into the whole tensor) have no such slices: ``slice_block`` says None.

The source is read through a callable (``read(offset, size)``), so a delta served from a file
is read range by range, never whole.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator, Sequence

import torch

from geoloco.compression.casts import Cast, Lossless
from geoloco.compression.codec import PipelineCodec, parse_codec
from geoloco.compression.encoded import (
    PREFIX_NBYTES,
    CodecError,
    Encoded,
    header_nbytes_needed,
    read_wire_header,
    wire_header,
    wire_trailer,
)
from geoloco.compression.quantize import BlockQuantizer

__all__ = ["covering_runs", "element_pieces", "row_positions", "slice_block", "sliced_parts"]

Reader = Callable[[int, int], bytes]
"""``read(offset, size)``: ``size`` bytes of the encoded data from ``offset``."""

Ranges = Sequence[tuple[int, int]]
"""(offset, count) element ranges, in increasing order, not overlapping."""

_PIECE_BYTES = 8 << 20
"""Largest byte range read at once: a model-sized range is yielded in pieces of this size."""


def slice_block(spec: str) -> int | None:
    """Elements per independently decodable unit of codec ``spec``'s payload: 1 for ``none`` and
    the casts, the block size for block quantizers, None for codecs that cannot be sliced."""
    codec = parse_codec(spec)
    if not isinstance(codec, PipelineCodec) or codec.sparsifier is not None:
        return None
    if isinstance(codec.values, Lossless | Cast):
        return 1
    if isinstance(codec.values, BlockQuantizer):
        return codec.values.block
    return None


def element_pieces(encoded: Encoded, lengths: Sequence[int]) -> list[Encoded] | None:
    """``encoded`` cut into consecutive pieces of ``lengths`` elements, each an encoding of its
    own that views the payload (no copy), for ``none`` and the casts; None for other codecs.
    A receiver adds the pieces where they belong without decoding the whole first."""
    if slice_block(encoded.spec) != 1 or sum(lengths) != encoded.numel:
        return None
    codec = parse_codec(encoded.spec)
    assert isinstance(codec, PipelineCodec)
    item = codec.payload_nbytes(1, encoded.dtype)
    pieces: list[Encoded] = []
    at = 0
    for length in lengths:
        payload = encoded.payload[at * item : (at + length) * item]
        pieces.append(Encoded(encoded.spec, (length,), encoded.dtype, payload))
        at += length
    return pieces


def covering_runs(ranges: Ranges, block: int, numel: int) -> list[tuple[int, int]]:
    """The whole units (``block`` elements; the tensor's last one may be short) that cover
    ``ranges``, as (offset, count) runs, merged where they touch or overlap."""
    runs: list[tuple[int, int]] = []
    for offset, count in ranges:
        if count <= 0:
            continue
        start = offset // block * block
        stop = min(numel, -(-(offset + count) // block) * block)
        if runs and start <= runs[-1][0] + runs[-1][1]:
            first, length = runs[-1]
            runs[-1] = (first, max(first + length, stop) - first)
        else:
            runs.append((start, stop - start))
    return runs


def row_positions(ranges: Ranges, block: int, numel: int) -> list[int]:
    """Where each range's first element sits in the decoded covering runs (concatenated)."""
    runs = covering_runs(ranges, block, numel)
    positions: list[int] = []
    run, base = 0, 0
    for offset, count in ranges:
        if count <= 0:
            positions.append(base)
            continue
        while runs[run][0] + runs[run][1] <= offset:
            base += runs[run][1]
            run += 1
        positions.append(base + offset - runs[run][0])
    return positions


def sliced_parts(read: Reader, ranges: Ranges) -> Iterator[bytes]:
    """The wire bytes (in pieces) of the covering runs of ``ranges`` of the encoded tensor
    ``read`` serves, as one flat encoding of their concatenation (for ``none`` and the casts:
    exactly the ranges' elements).

    Raises :class:`CodecError` when the data's codec cannot be sliced or a range lies outside
    the tensor, before anything is yielded.
    """
    prefix = memoryview(read(0, PREFIX_NBYTES))
    if len(prefix) < PREFIX_NBYTES:
        raise CodecError(f"encoded data is truncated: {len(prefix)} bytes")
    header_bytes = read(0, header_nbytes_needed(prefix))
    spec, shape, dtype, payload_offset, payload_len = read_wire_header(memoryview(header_bytes))
    codec = parse_codec(spec)
    block = slice_block(spec)
    if block is None or not isinstance(codec, PipelineCodec):
        raise CodecError(f"codec {spec!r} cannot be sliced: its payload indexes the whole tensor")
    numel = 1
    for d in shape:
        numel *= d
    expected = codec.payload_nbytes(numel, dtype)
    if payload_len != expected:
        raise CodecError(
            f"encoded data holds {payload_len} payload bytes; {numel} elements of {spec!r} need {expected}"
        )
    for offset, count in ranges:
        if offset < 0 or count < 0 or offset + count > numel:
            raise CodecError(f"element range {offset}..{offset + count} lies outside the tensor's {numel} elements")
    runs = covering_runs(ranges, block, numel)
    total = sum(count for _, count in runs)
    regions = _byte_regions(codec, dtype, runs, numel, block)
    header = wire_header(spec, (total,), dtype, codec.payload_nbytes(total, dtype))
    crc = zlib.crc32(header)
    yield header
    for start, stop in regions:
        for at in range(payload_offset + start, payload_offset + stop, _PIECE_BYTES):
            piece = read(at, min(_PIECE_BYTES, payload_offset + stop - at))
            crc = zlib.crc32(piece, crc)
            yield piece
    yield wire_trailer(crc)


def _byte_regions(
    codec: PipelineCodec, dtype: torch.dtype, runs: list[tuple[int, int]], numel: int, block: int
) -> list[tuple[int, int]]:
    """Payload byte ranges (start, stop) whose concatenation is the runs' payload."""
    values = codec.values
    if isinstance(values, BlockQuantizer):  # scales of every run, then codes of every run
        blocks = values.num_blocks(numel)
        block_bytes = block * values.bits // 8
        codes_end = 2 * blocks + (numel * values.bits + 7) // 8
        scales = [(2 * (s // block), 2 * -(-(s + c) // block)) for s, c in runs]
        codes = [
            (2 * blocks + s // block * block_bytes, min(codes_end, 2 * blocks + -(-(s + c) // block) * block_bytes))
            for s, c in runs
        ]
        return scales + codes
    item = codec.payload_nbytes(1, dtype)
    return [(s * item, (s + c) * item) for s, c in runs]

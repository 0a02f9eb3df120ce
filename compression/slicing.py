"""Element ranges of an encoded tensor, as an encoding of their own, without decoding it.

A rank of a sharded site needs only its rows of a broadcast delta. For an *elementwise* codec
(no sparsifier; ``none`` or a cast: one fixed-size value per element, in order) the payload bytes
of an element range are a byte range of the payload, so the rows' encoding is the original
header with a new shape, those byte ranges and a new CRC: the very values every whole-delta
site decodes, so a rank adds exactly what the coordinator added. Quantizers (per-block scales)
and sparsifiers (indices) have no such slices; ``element_nbytes`` says None for them.

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
    header_nbytes_needed,
    read_wire_header,
    wire_header,
    wire_trailer,
)

__all__ = ["element_nbytes", "sliced_parts"]

Reader = Callable[[int, int], bytes]
"""``read(offset, size)``: ``size`` bytes of the encoded data from ``offset``."""

_PIECE_BYTES = 8 << 20
"""Largest byte range read at once: a model-sized range is yielded in pieces of this size."""


def element_nbytes(spec: str, dtype: torch.dtype) -> int | None:
    """Payload bytes per element when codec ``spec``'s payload is one fixed-size value per
    element in element order (a slice of elements is a slice of the payload); None otherwise."""
    codec = parse_codec(spec)
    if not isinstance(codec, PipelineCodec) or codec.sparsifier is not None:
        return None
    if isinstance(codec.values, Lossless):
        return torch.empty(0, dtype=dtype).element_size()
    if isinstance(codec.values, Cast):
        return torch.empty(0, dtype=codec.values.target).element_size()
    return None


def sliced_parts(read: Reader, ranges: Sequence[tuple[int, int]]) -> Iterator[bytes]:
    """The wire bytes (in pieces) of the elements ``ranges`` ((offset, count) in element order)
    of the encoded tensor ``read`` serves, as one flat encoding of their concatenation.

    Raises :class:`CodecError` when the data's codec is not elementwise or a range lies outside
    the tensor, before anything is yielded.
    """
    prefix = memoryview(read(0, PREFIX_NBYTES))
    if len(prefix) < PREFIX_NBYTES:
        raise CodecError(f"encoded data is truncated: {len(prefix)} bytes")
    header_bytes = read(0, header_nbytes_needed(prefix))
    spec, shape, dtype, payload_offset, payload_len = read_wire_header(memoryview(header_bytes))
    item = element_nbytes(spec, dtype)
    if item is None:
        raise CodecError(f"codec {spec!r} is not elementwise: its payload has no element slices")
    numel = 1
    for d in shape:
        numel *= d
    if payload_len != numel * item:
        raise CodecError(
            f"encoded data holds {payload_len} payload bytes; {numel} elements of {item} bytes need {numel * item}"
        )
    for offset, count in ranges:
        if offset < 0 or count < 0 or offset + count > numel:
            raise CodecError(f"element range {offset}..{offset + count} lies outside the tensor's {numel} elements")
    total = sum(count for _, count in ranges)
    header = wire_header(spec, (total,), dtype, total * item)
    crc = zlib.crc32(header)
    yield header
    for offset, count in ranges:
        start, stop = payload_offset + offset * item, payload_offset + (offset + count) * item
        for at in range(start, stop, _PIECE_BYTES):
            piece = read(at, min(_PIECE_BYTES, stop - at))
            crc = zlib.crc32(piece, crc)
            yield piece
    yield wire_trailer(crc)

"""Packing small unsigned integers densely into bytes, and typed views of byte regions.

Bit order is little-endian throughout: value ``i`` occupies bits ``[i*w, (i+1)*w)`` of the stream,
and bit ``j`` of the stream is bit ``j % 8`` of byte ``j // 8``. The quantizers pack their codes
with specialised arithmetic (see ``quantize.py``); this generic packer is used for top-k's local
indices, whose width (``ceil(log2(chunk))`` bits) need not divide 8.
"""

from __future__ import annotations

import torch


def packed_nbytes(count: int, width: int) -> int:
    """Bytes needed for ``count`` values of ``width`` bits."""
    return (count * width + 7) // 8


def view_as(region: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a 1-D ``uint8`` region as ``dtype`` elements, copying first if misaligned.

    Pipelines keep regions aligned, but an :class:`Encoded` built by hand around a slice of a
    larger buffer might not be; a copy is then cheaper than a crash.
    """
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if region.numel() % itemsize:
        raise ValueError(f"a region of {region.numel()} bytes does not hold whole {dtype} elements")
    if region.storage_offset() % itemsize or region.data_ptr() % itemsize:
        region = region.clone()
    return region.view(dtype)


def pack_uint(values: torch.Tensor, width: int, out: torch.Tensor) -> None:
    """Pack 1-D non-negative integers below ``2**width`` into ``out`` (``packed_nbytes`` bytes)."""
    count = values.numel()
    nbytes = packed_nbytes(count, width)
    if out.numel() != nbytes:
        raise ValueError(f"pack_uint needs an output of {nbytes} bytes, got {out.numel()}")
    if count == 0:
        return
    source = values.to(torch.int64)
    bits = torch.zeros(nbytes * 8, dtype=torch.uint8, device=values.device)
    bit_matrix = bits[: count * width].view(count, width)
    for j in range(width):
        bit_matrix[:, j] = (source >> j) & 1
    grouped = bits.view(nbytes, 8)
    out.copy_(grouped[:, 0])
    for j in range(1, 8):
        out.bitwise_or_(grouped[:, j] << j)


def unpack_uint(packed: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_uint`: ``count`` values as an ``int64`` tensor."""
    nbytes = packed_nbytes(count, width)
    if packed.numel() != nbytes:
        raise ValueError(f"unpack_uint needs {nbytes} bytes for {count} values of {width} bits, got {packed.numel()}")
    result = torch.zeros(count, dtype=torch.int64, device=packed.device)
    if count == 0:
        return result
    bits = torch.empty(nbytes, 8, dtype=torch.uint8, device=packed.device)
    for j in range(8):
        torch.bitwise_and(packed >> j, 1, out=bits[:, j])
    bit_matrix = bits.view(-1)[: count * width].view(count, width)
    for j in range(width):
        result |= bit_matrix[:, j].to(torch.int64) << j
    return result

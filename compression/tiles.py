"""``tiletopk``: top-k per tile of each tensor, as SparseLoCo (Sarfi et al. 2025) chunks updates.

``topk:F`` cuts the *flat* vector into chunks of consecutive values, so a chunk can straddle two
tensors and a weight matrix's chunk is a run of whole rows. ``tiletopk:F,tile=T`` follows the
paper instead: every 2-D tensor is cut into ``T x T`` tiles (the tiles at its right and bottom
edges are smaller), every 1-D tensor (and every tensor with one row) into contiguous chunks of
``T * T`` values (the last one shorter); a tensor of more dimensions is read as
``shape[0] x prod(shape[1:])``. Each tile keeps its ``ceil(F * size)`` largest magnitudes, so a
tile of small values still sends its share, as in the paper.

The tensor shapes come from the encoder: a codec bound to a model's shapes
(:meth:`geoloco.compression.PipelineCodec.with_shapes`, what the training strategies build from the
model's parameter layout) tiles the flat vector tensor by tensor; an unbound one tiles the tensor
it is given by that tensor's own shape (a flat vector is then one 1-D tensor). The payload starts
with the shapes, so a receiver decodes any ``tiletopk`` payload from the data alone, whatever
model it came from::

    uint32 count, uint32 0, then count x (uint32 rows, uint32 cols), then packed tile-local
    indices (ceil(log2(T * T)) bits each, zero-padded to a multiple of 8 bytes), then the value
    codec's payload for the kept values: tensor by tensor, tile by tile, in the order below.

Tiles are visited per tensor in four regions, each a grid of equal tiles in row-major order:
full tiles, the right edge column, the bottom edge row, the corner.

``tiletopk:F,tile=T,divisors`` chunks as the authors' code does instead (``ChunkingTransformer``
and ``TopKCompressor`` of tplr-ai's SparseLoCo / templar): each dimension is cut by its largest
divisor ``<= T`` (their ``_get_smaller_split``), so every chunk of a tensor has the same shape and
there are no edge tiles; a 1-D tensor (read as one row) is cut into chunks of at most ``T`` values,
and a dimension with no divisor in ``2..T`` (a prime above ``T``) into chunks of 1. The authors
keep a fixed count ``k`` per chunk; here ``k = ceil(F * T * T)`` (``F = 1/64`` at ``T = 64`` is
their ``topk_compression = 64``), clamped as they clamp it: at most the chunk's size, at least 2,
rounded down to even (their 12-bit indices are packed in pairs), and never more than the chunk
holds. So a chunk smaller than a full ``T x T`` one keeps the same count, not the same share: a
1-D tensor in 64-value chunks is sent whole at ``k >= 64``, as theirs is. The wire format is the
same, with one grid of equal chunks per tensor as its only region.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import ClassVar, Final

import torch

from geoloco.compression.bitpack import pack_uint, packed_nbytes, unpack_uint
from geoloco.compression.encoded import CodecError
from geoloco.compression.stages import Option, Sparsifier

TILE_OPTION: Final = Option(
    "tile",
    "int",
    "tile side: 2-D tensors in TxT tiles, 1-D tensors in chunks of T*T values",
    default=64,
    minimum=1,
    maximum=1024,
)

_HEADER: Final = 8
_ENTRY: Final = 8
_MAX_DIM: Final = 2**32 - 1

DIVISORS_OPTION: Final = Option(
    "divisors",
    "flag",
    "the authors' chunking: each dimension by its largest divisor <= T, ceil(F*T*T) kept per chunk (>= 2, even)",
)

Shape = tuple[int, int]


@dataclass(frozen=True, slots=True)
class _Region:
    """A grid of ``rows x cols`` equal tiles of ``height x width`` values, its top-left corner at
    (``top``, ``left``) of a ``matrix_cols``-wide tensor starting at flat ``offset``."""

    offset: int
    matrix_cols: int
    top: int
    left: int
    rows: int
    cols: int
    height: int
    width: int

    @property
    def tiles(self) -> int:
        return self.rows * self.cols

    @property
    def size(self) -> int:
        return self.height * self.width


def matrix_shape(shape: Sequence[int]) -> Shape | None:
    """How a tensor of ``shape`` is tiled: ``(rows, cols)``; None for an empty tensor."""
    numel = math.prod(shape)
    if numel == 0:
        return None
    if len(shape) < 2:
        return (1, numel)
    return (int(shape[0]), numel // int(shape[0]))


def largest_divisor(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is at most ``limit`` (``n`` itself when ``n <= limit``):
    the chunk side the authors' ``_get_smaller_split(n, limit)`` picks for a dimension of ``n``."""
    for divisor in range(min(n, limit), 0, -1):
        if n % divisor == 0:
            return divisor
    raise ValueError(f"largest_divisor needs n >= 1 and limit >= 1, got n={n}, limit={limit}")


def _divisor_regions(shapes: Sequence[Shape], tile: int) -> Iterator[_Region]:
    offset = 0
    for rows, cols in shapes:
        height, width = largest_divisor(rows, tile), largest_divisor(cols, tile)
        yield _Region(offset, cols, 0, 0, rows // height, cols // width, height, width)
        offset += rows * cols


def _tile_regions(shapes: Sequence[Shape], tile: int) -> Iterator[_Region]:
    offset = 0
    for rows, cols in shapes:
        height, width = (1, tile * tile) if rows == 1 else (tile, tile)
        full_rows, edge_height = divmod(rows, height)
        full_cols, edge_width = divmod(cols, width)
        grids = (
            (0, 0, full_rows, full_cols, height, width),
            (0, full_cols * width, full_rows, 1, height, edge_width),
            (full_rows * height, 0, 1, full_cols, edge_height, width),
            (full_rows * height, full_cols * width, 1, 1, edge_height, edge_width),
        )
        for top, left, grid_rows, grid_cols, h, w in grids:
            if grid_rows and grid_cols and h and w:
                yield _Region(offset, cols, top, left, grid_rows, grid_cols, h, w)
        offset += rows * cols


@dataclass(frozen=True)
class TileTopK(Sparsifier):
    """``tiletopk:F[,tile=T]``: top-k by magnitude in each tile of each tensor (module docstring)."""

    fraction: float
    tile: int = 64
    divisors: bool = False
    """Chunk each dimension by its largest divisor <= ``tile`` and keep the authors' fixed count
    per chunk (module docstring); False: ``tile x tile`` tiles keeping ``fraction`` of each."""
    shapes: tuple[Shape, ...] | None = field(default=None, compare=False)
    """The tensors of the flat vector as ``(rows, cols)``; None: tile the encoded tensor's own shape."""
    _exact: Fraction = field(init=False, repr=False, compare=False)

    name: ClassVar[str] = "tiletopk"
    summary: ClassVar[str] = (
        "keep the largest magnitudes per TxT tile of each tensor (divisors: SparseLoCo's own chunking)"
    )
    options: ClassVar[tuple[Option, ...]] = (
        Option("fraction", "fraction", "share of each tile's values to keep"),
        TILE_OPTION,
        DIVISORS_OPTION,
    )
    positional: ClassVar[str | None] = "fraction"

    def __post_init__(self) -> None:
        fraction = self.fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
            raise ValueError(f"tiletopk fraction must be a number in (0, 1], e.g. 'tiletopk:0.03'; got {fraction!r}")
        if not TILE_OPTION.minimum <= self.tile <= TILE_OPTION.maximum:
            raise ValueError(
                f"tiletopk tile={self.tile} is out of range; use {TILE_OPTION.minimum}..{TILE_OPTION.maximum}"
            )
        object.__setattr__(self, "_exact", Fraction(repr(float(self.fraction))))

    @property
    def index_bits(self) -> int:
        """Bits per packed tile-local index: ``ceil(log2(T * T))``, at least 1."""
        return max(1, (self.tile * self.tile - 1).bit_length())

    def with_shapes(self, shapes: Sequence[Sequence[int]]) -> TileTopK:
        """This sparsifier bound to the tensors a flat vector is made of (empty ones skipped)."""
        matrices = tuple(m for m in (matrix_shape(s) for s in shapes) if m is not None)
        return replace(self, shapes=matrices)

    def for_shape(self, shape: Sequence[int]) -> TileTopK:
        if self.shapes is not None:
            return self
        return self.with_shapes([shape])

    def for_payload(self, payload: torch.Tensor, numel: int) -> TileTopK:
        """Bound to the shapes the payload's header names, checked to add up to ``numel``."""
        if payload.numel() < _HEADER:
            raise CodecError(f"{self.canonical()}: payload of {payload.numel()} bytes has no tensor header")
        head = payload[:_HEADER].cpu().clone().view(torch.int32)
        count = int(head[0]) & 0xFFFFFFFF
        if not 1 <= count <= max(1, numel) or payload.numel() < _HEADER + count * _ENTRY:
            raise CodecError(f"{self.canonical()}: payload header names {count} tensors; data is corrupted")
        dims = payload[_HEADER : _HEADER + count * _ENTRY].cpu().clone().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        shapes = tuple((int(r), int(c)) for r, c in dims.view(count, 2).tolist())
        if any(r < 1 or c < 1 for r, c in shapes) or sum(r * c for r, c in shapes) != numel:
            raise CodecError(
                f"{self.canonical()}: payload header's tensors hold {sum(r * c for r, c in shapes)} values, "
                f"the encoded tensor {numel}; data is corrupted"
            )
        return replace(self, shapes=shapes)

    def _shapes_for(self, numel: int) -> tuple[Shape, ...]:
        shapes = self.shapes if self.shapes is not None else ((1, numel),) if numel else ()
        if sum(r * c for r, c in shapes) != numel:
            raise ValueError(
                f"tiletopk is bound to tensors of {sum(r * c for r, c in shapes)} values in all, "
                f"but the vector to encode has {numel}"
            )
        return shapes

    def _regions(self, shapes: Sequence[Shape]) -> Iterator[_Region]:
        return _divisor_regions(shapes, self.tile) if self.divisors else _tile_regions(shapes, self.tile)

    def _keep(self, size: int) -> int:
        if not self.divisors:
            return min(size, math.ceil(self._exact * size))
        keep = max(2, min(math.ceil(self._exact * self.tile * self.tile), size))
        return min(size, keep - keep % 2)

    def num_selected(self, numel: int) -> int:
        return sum(r.tiles * self._keep(r.size) for r in self._regions(self._shapes_for(numel)))

    def value_segments(self, numel: int) -> tuple[int, ...]:
        """Kept values per tensor, in payload order: a value codec that codes each tensor's
        values apart (``int2mean``'s per-tensor table) reads its runs from these."""
        return tuple(
            sum(r.tiles * self._keep(r.size) for r in self._regions([shape])) for shape in self._shapes_for(numel)
        )

    def _header_nbytes(self, numel: int) -> int:
        return _HEADER + _ENTRY * len(self._shapes_for(numel))

    def index_nbytes(self, numel: int) -> int:
        packed = packed_nbytes(self.num_selected(numel), self.index_bits)
        return self._header_nbytes(numel) + (packed + 7) // 8 * 8

    def select(self, flat: torch.Tensor, index_out: torch.Tensor, *, seed: int) -> torch.Tensor:
        shapes = self._shapes_for(flat.numel())
        if any(r > _MAX_DIM or c > _MAX_DIM for r, c in shapes):
            raise ValueError("tiletopk handles tensor dimensions below 2**32")
        values: list[torch.Tensor] = []
        local: list[torch.Tensor] = []
        for region in self._regions(shapes):
            tiles = _tiles(flat, region)
            _, index = torch.topk(tiles.abs(), self._keep(region.size), dim=1, sorted=False)
            values.append(torch.gather(tiles, 1, index).reshape(-1))
            local.append(index.reshape(-1))
        header = torch.tensor([len(shapes), 0, *(d for s in shapes for d in s)], dtype=torch.int64)
        header_nbytes = _HEADER + _ENTRY * len(shapes)
        index_out[:header_nbytes].copy_(header.to(torch.int32).view(torch.uint8).to(index_out.device))
        chosen = torch.cat(values) if values else flat.new_empty(0)
        indices = torch.cat(local) if local else torch.empty(0, dtype=torch.int64, device=flat.device)
        packed = packed_nbytes(chosen.numel(), self.index_bits)
        pack_uint(indices, self.index_bits, index_out[header_nbytes : header_nbytes + packed])
        index_out[header_nbytes + packed :].zero_()
        return chosen

    def selected(
        self, index_payload: torch.Tensor, values: torch.Tensor, numel: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shapes = self._shapes_for(numel)
        header_nbytes = _HEADER + _ENTRY * len(shapes)
        count = values.numel()
        packed = index_payload[header_nbytes : header_nbytes + packed_nbytes(count, self.index_bits)]
        local = unpack_uint(packed, count, self.index_bits).to(values.device)
        coords = torch.empty(count, dtype=torch.int64, device=values.device)
        start = 0
        for region in self._regions(shapes):
            keep = self._keep(region.size)
            stop = start + region.tiles * keep
            part = local[start:stop]
            if part.numel() and int(part.max()) >= region.size:
                raise CodecError(
                    f"{self.canonical()}: payload holds an index beyond its tile of {region.size}; data is corrupted"
                )
            tile = torch.arange(region.tiles, dtype=torch.int64, device=values.device).repeat_interleave(keep)
            row = region.top + (tile // region.cols) * region.height + part // region.width
            col = region.left + (tile % region.cols) * region.width + part % region.width
            coords[start:stop] = region.offset + row * region.matrix_cols + col
            start = stop
        return coords, values

    def scatter_into(self, index_payload: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> None:
        coords, values = self.selected(index_payload, values, out.numel())
        out.zero_()
        out.index_copy_(0, coords, values.to(out.dtype))


def _tiles(flat: torch.Tensor, region: _Region) -> torch.Tensor:
    """The region's tiles as rows of a ``tiles x size`` matrix (a copy)."""
    end = region.offset + (region.top + region.rows * region.height) * region.matrix_cols
    matrix = flat[region.offset : end].view(-1, region.matrix_cols)
    block = matrix[region.top :, region.left : region.left + region.cols * region.width]
    grid = block.reshape(region.rows, region.height, region.cols, region.width)
    return grid.permute(0, 2, 1, 3).reshape(region.tiles, region.size)

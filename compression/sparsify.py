"""Sparsifiers: ``topk`` (largest magnitudes, chunked) and ``randk`` (random coordinates from a seed).

``topk:F`` is **per-chunk** top-k: the flat tensor is cut into chunks of ``chunk`` values (the
last may be shorter) and each chunk keeps its ``ceil(F * len)`` largest magnitudes. It is not the
global top-k: a chunk of small values still sends its share. That is the price of speed (one
``torch.topk`` over a ``rows x chunk`` matrix runs 5-15x faster than over the whole tensor) and of
compact indices: each index is local to its chunk and packed in ``ceil(log2(chunk))`` bits, 12 at
the default for ``F = 0.01`` instead of 32 for a global int32 index. The default chunk is the
smallest power of two with at least 32 kept values per chunk (``32 / F``), clamped to
``[1024, 2**20]``, so small fractions are not inflated by the at-least-one-per-chunk rounding.
Payload: packed indices (zero-padded to a multiple of 8 bytes), then the value codec's payload
for the kept values in chunk order.

``randk:F`` keeps ``ceil(F * n)`` coordinates chosen uniformly at random without replacement from
the ``seed`` passed to ``encode``. Which seed that is, the caller decides from the ``shared`` flag
(``geoloco.algorithms.strategy.uplink_seed``): ``randk:F`` (default) is seeded per site and
round, so every site keeps its own coordinates and the mean covers up to ``N`` times more of
them; ``randk:F,shared`` is seeded from the round's shared seed, so every site keeps the same
coordinates (what secure aggregation needs, where masked values only add up on shared
coordinates; a private round reads ``randk:F`` as ``randk:F,shared``). Stochastic rounding in a
``shared`` pipeline draws from that shared seed too, so the sites' rounding is then correlated.
Only the seed travels (8 bytes); the decoder
regenerates the coordinates. They come from a counter-based hash implemented here in integer
tensor arithmetic, not from ``torch.Generator``, so they are bit-identical on every device and
every torch version; they are returned sorted. Values are sent unscaled by default, which suits
error feedback (the residual keeps what was not sent); the ``unbiased`` flag multiplies the
decoded values by ``n / k`` so that ``E[decode] = x`` over seeds. ``randk`` handles tensors of
fewer than ``2**31`` elements.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from fractions import Fraction
from typing import ClassVar, Final

import torch

from geoloco.compression import _memory
from geoloco.compression.bitpack import pack_uint, packed_nbytes, unpack_uint
from geoloco.compression.encoded import CodecError
from geoloco.compression.stages import Option, Sparsifier

FRACTION_OPTION: Final = Option("fraction", "fraction", "share of the coordinates to keep")
CHUNK_OPTION: Final = Option(
    "chunk",
    "int",
    "values per top-k chunk, by default the power of two at or above 32/F within 1024..1048576; "
    "smaller is faster and needs fewer index bits",
    default=None,
    minimum=1,
    maximum=1 << 30,
)
UNBIASED_OPTION: Final = Option("unbiased", "flag", "scale decoded values by n/k so E[decode] = x")
SHARED_OPTION: Final = Option(
    "shared", "flag", "every site keeps the same coordinates (from the round's shared seed); default: per-site"
)

_TOPK_ROWS_ELEMENTS: Final = {"cpu": 1 << 22}
"""Elements handed to one ``torch.topk`` call: bounds the workspace, not the speed."""
_DEFAULT_TOPK_ROWS_ELEMENTS: Final = 1 << 26

_SEED_NBYTES: Final = 8
_RANDK_MAX_NUMEL: Final = 2**31 - 1


def _keep(fraction: Fraction, length: int) -> int:
    """Values kept out of ``length``: ``ceil(fraction * length)``, exact for decimal fractions."""
    return min(length, math.ceil(fraction * length))


def _round8(nbytes: int) -> int:
    return (nbytes + 7) // 8 * 8


def default_topk_chunk(fraction: float) -> int:
    """Smallest power of two >= ``32 / fraction``, clamped to ``[1024, 2**20]``."""
    target = math.ceil(32 / fraction)
    return min(1 << 20, max(1024, 1 << (target - 1).bit_length()))


@dataclass(frozen=True)
class TopK(Sparsifier):
    """``topk:F[,chunk=N]``: per-chunk largest magnitudes with bit-packed local indices."""

    fraction: float
    chunk: int | None = None
    _exact: Fraction = field(init=False, repr=False, compare=False)

    name: ClassVar[str] = "topk"
    summary: ClassVar[str] = "keep the largest magnitudes, per chunk (indices bit-packed)"
    options: ClassVar[tuple[Option, ...]] = (FRACTION_OPTION, CHUNK_OPTION)
    positional: ClassVar[str | None] = "fraction"

    def __post_init__(self) -> None:
        _check_fraction("topk", self.fraction)
        if self.chunk is None:
            object.__setattr__(self, "chunk", default_topk_chunk(self.fraction))
        elif not (CHUNK_OPTION.minimum <= self.chunk <= CHUNK_OPTION.maximum):
            raise ValueError(
                f"topk chunk={self.chunk} is out of range; use {CHUNK_OPTION.minimum}..{CHUNK_OPTION.maximum}"
            )
        object.__setattr__(self, "_exact", Fraction(repr(float(self.fraction))))

    @property
    def index_bits(self) -> int:
        """Bits per packed local index: ``ceil(log2(chunk))``, at least 1."""
        assert self.chunk is not None
        return max(1, (self.chunk - 1).bit_length())

    def _layout(self, numel: int) -> tuple[int, int, int, int]:
        """(full chunks, kept per full chunk, tail length, kept in tail)."""
        assert self.chunk is not None
        full, tail = divmod(numel, self.chunk)
        return full, _keep(self._exact, self.chunk), tail, _keep(self._exact, tail)

    def num_selected(self, numel: int) -> int:
        full, per_chunk, _, tail_keep = self._layout(numel)
        return full * per_chunk + tail_keep

    def index_nbytes(self, numel: int) -> int:
        return _round8(packed_nbytes(self.num_selected(numel), self.index_bits))

    def select(self, flat: torch.Tensor, index_out: torch.Tensor, *, seed: int) -> torch.Tensor:
        assert self.chunk is not None
        chunk = self.chunk
        full, per_chunk, tail, tail_keep = self._layout(flat.numel())
        selected = full * per_chunk + tail_keep
        values = torch.empty(selected, dtype=flat.dtype, device=flat.device)
        local = torch.empty(selected, dtype=torch.int64, device=flat.device)
        rows_per_step = max(1, _TOPK_ROWS_ELEMENTS.get(flat.device.type, _DEFAULT_TOPK_ROWS_ELEMENTS) // chunk)
        magnitude = _memory.workspace("topk-abs", min(full, rows_per_step) * chunk, flat.dtype, flat.device)
        for row in range(0, full, rows_per_step):
            stop = min(full, row + rows_per_step)
            self._select_rows(
                flat[row * chunk : stop * chunk].view(stop - row, chunk),
                per_chunk,
                magnitude[: (stop - row) * chunk].view(stop - row, chunk),
                values[row * per_chunk : stop * per_chunk].view(stop - row, per_chunk),
                local[row * per_chunk : stop * per_chunk].view(stop - row, per_chunk),
            )
        if tail_keep:
            rows = flat[full * chunk :].view(1, tail)
            self._select_rows(
                rows,
                tail_keep,
                torch.empty_like(rows),
                values[full * per_chunk :].view(1, tail_keep),
                local[full * per_chunk :].view(1, tail_keep),
            )
        packed = packed_nbytes(selected, self.index_bits)
        pack_uint(local, self.index_bits, index_out[:packed])
        index_out[packed:].zero_()
        return values

    @staticmethod
    def _select_rows(
        rows: torch.Tensor, keep: int, magnitude: torch.Tensor, values_out: torch.Tensor, index_out: torch.Tensor
    ) -> None:
        torch.abs(rows, out=magnitude)
        _, index = torch.topk(magnitude, keep, dim=1, sorted=False)
        torch.gather(rows, 1, index, out=values_out)
        index_out.copy_(index)

    def _local_indices(self, index_payload: torch.Tensor, numel: int) -> torch.Tensor:
        """The payload's chunk-local indices, checked to lie within their chunks."""
        assert self.chunk is not None
        full, per_chunk, tail, tail_keep = self._layout(numel)
        selected = full * per_chunk + tail_keep
        local = unpack_uint(index_payload[: packed_nbytes(selected, self.index_bits)], selected, self.index_bits)
        head = local[: full * per_chunk]
        if head.numel() and int(head.max()) >= self.chunk:
            raise CodecError(
                f"{self.canonical()}: payload holds an index beyond its chunk of {self.chunk}; data is corrupted"
            )
        if tail_keep and int(local[full * per_chunk :].max()) >= tail:
            raise CodecError(f"{self.canonical()}: payload holds an index beyond the last chunk; data is corrupted")
        return local

    def scatter_into(self, index_payload: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> None:
        assert self.chunk is not None
        chunk = self.chunk
        full, per_chunk, tail, tail_keep = self._layout(out.numel())
        local = self._local_indices(index_payload, out.numel())
        head = local[: full * per_chunk]
        out.zero_()
        if full:
            out[: full * chunk].view(full, chunk).scatter_(
                1, head.view(full, per_chunk), values[: full * per_chunk].view(full, per_chunk)
            )
        if tail_keep:
            out[full * chunk :].view(1, tail).scatter_(
                1, local[full * per_chunk :].view(1, tail_keep), values[full * per_chunk :].view(1, tail_keep)
            )

    def selected(
        self, index_payload: torch.Tensor, values: torch.Tensor, numel: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        local = self._local_indices(index_payload, numel)
        assert self.chunk is not None
        full, per_chunk, _, _ = self._layout(numel)
        # Local index -> flat coordinate: chunk r's values start at r * chunk (the tail's too).
        offsets = torch.arange(0, (full + 1) * self.chunk, self.chunk, dtype=torch.int64, device=local.device)
        rows = torch.arange(local.numel(), dtype=torch.int64, device=local.device)
        rows.div_(per_chunk, rounding_mode="floor")
        local.add_(offsets[rows.clamp_(max=full)])
        return local, values


@dataclass(frozen=True)
class RandK(Sparsifier):
    """``randk:F[,unbiased][,shared]``: uniformly random coordinates regenerated from the seed
    ``encode`` gets: per site and round by default, the round's shared seed with ``shared``."""

    fraction: float
    unbiased: bool = False
    shared: bool = False
    _exact: Fraction = field(init=False, repr=False, compare=False)

    name: ClassVar[str] = "randk"
    summary: ClassVar[str] = (
        "keep random coordinates from a seed, per site (default) or shared by all sites (shared); "
        "indices not sent"
    )
    options: ClassVar[tuple[Option, ...]] = (FRACTION_OPTION, UNBIASED_OPTION, SHARED_OPTION)
    positional: ClassVar[str | None] = "fraction"

    def __post_init__(self) -> None:
        _check_fraction("randk", self.fraction)
        object.__setattr__(self, "_exact", Fraction(repr(float(self.fraction))))

    def num_selected(self, numel: int) -> int:
        return _keep(self._exact, numel)

    def index_nbytes(self, numel: int) -> int:
        return _SEED_NBYTES

    def select(self, flat: torch.Tensor, index_out: torch.Tensor, *, seed: int) -> torch.Tensor:
        if not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise ValueError(f"randk needs a seed in [0, 2**64), got {seed!r}")
        if flat.numel() > _RANDK_MAX_NUMEL:
            raise ValueError(
                f"randk handles tensors of at most {_RANDK_MAX_NUMEL} elements, got {flat.numel()}; "
                "encode the tensor in parts"
            )
        index_out.copy_(torch.tensor(list(seed.to_bytes(_SEED_NBYTES, "little")), dtype=torch.uint8))
        index = random_indices(seed, flat.numel(), self.num_selected(flat.numel()), flat.device)
        return flat.index_select(0, index)

    def scatter_into(self, index_payload: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> None:
        numel = out.numel()
        index, values = self.selected(index_payload, values, numel)
        out.zero_()
        out.index_copy_(0, index, values)

    def selected(
        self, index_payload: torch.Tensor, values: torch.Tensor, numel: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        seed = int.from_bytes(bytes(index_payload.cpu().tolist()), "little")
        if numel > _RANDK_MAX_NUMEL:
            raise CodecError(f"randk: encoded tensor has {numel} elements, more than randk can produce")
        index = random_indices(seed, numel, values.numel(), values.device)
        if self.unbiased and values.numel():
            values = values * (numel / values.numel())
        return index, values


def _check_fraction(name: str, fraction: float) -> None:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
        raise ValueError(f"{name} fraction must be a number in (0, 1], e.g. '{name}:0.01'; got {fraction!r}")


# ------------------------------------------------------------------ seeded random coordinates

_MASK32: Final = 0xFFFFFFFF


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2**32`` for ``x < 2**32`` in int64 without signed overflow."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' ``lowbias32`` integer hash, a bijection on 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _hash32_int(value: int) -> int:
    return int(_hash32(torch.tensor(value & _MASK32, dtype=torch.int64)))


def _draws(seed: int, count: int, numel: int, device: torch.device) -> torch.Tensor:
    """Draws ``0..count-1`` of the seed's stream: pseudo-random integers in ``[0, numel)``.

    Each draw hashes its counter into 53 random bits ``r`` and maps them to ``r * numel >> 53``
    with exact integer arithmetic (``numel < 2**31``), so the result is the same everywhere.
    """
    key0 = _hash32_int(seed ^ 0x243F6A88)
    key1 = _hash32_int((seed >> 32) ^ key0 ^ 0x85A308D3)
    key2 = _hash32_int(key1 ^ 0x13198A2E)
    counter = torch.arange(count, dtype=torch.int64, device=device)
    low = _hash32(_hash32(counter ^ key0) ^ key1)  # 32 bits
    high = _hash32(low ^ key2) >> 11  # 21 bits
    return (high * numel + ((low * numel) >> 32)) >> 21


def _first_distinct(seed: int, numel: int, count: int, device: torch.device) -> torch.Tensor:
    """The first ``count`` distinct values of the seed's stream, sorted.

    The first ``count`` distinct draws of an i.i.d. uniform stream form a uniformly random
    ``count``-subset. We draw a batch large enough that this almost always suffices (the
    expected number of draws plus a 4-sigma margin) and redraw a longer prefix of the same
    stream otherwise, so the result never depends on the batch size.
    """
    draws = math.ceil(-numel * math.log1p(-count / numel)) + 4 * math.isqrt(count) + 16
    while True:
        stream = _draws(seed, draws, numel, device)
        unique, inverse = torch.unique(stream, sorted=True, return_inverse=True)
        if unique.numel() >= count:
            break
        draws *= 2
    position = torch.arange(draws, dtype=torch.int64, device=device)
    first = torch.full((unique.numel(),), draws, dtype=torch.int64, device=device)
    first.scatter_reduce_(0, inverse, position, reduce="amin")
    if unique.numel() == count:
        return unique
    cutoff = torch.kthvalue(first, count).values
    return unique[first <= cutoff]


_INDEX_CACHE: OrderedDict[tuple[int, int, int, str], torch.Tensor] = OrderedDict()
_INDEX_CACHE_ENTRIES: Final = 2
_INDEX_CACHE_MAX_COUNT: Final = 1 << 25
_INDEX_CACHE_LOCK: Final = threading.Lock()


def random_indices(seed: int, numel: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``count`` distinct coordinates of ``[0, numel)`` chosen uniformly from ``seed``, sorted, int64.

    Pure function of its arguments: identical on every machine and device. The last two results
    are cached, because error feedback decodes right after it encodes with the same seed.
    """
    device = torch.device(device)
    if not 0 <= count <= numel:
        raise ValueError(f"cannot choose {count} of {numel} coordinates")
    key = (seed, numel, count, str(device))
    with _INDEX_CACHE_LOCK:
        cached = _INDEX_CACHE.get(key)
        if cached is not None:
            _INDEX_CACHE.move_to_end(key)
            return cached
    if count == 0:
        index = torch.empty(0, dtype=torch.int64, device=device)
    elif count == numel:
        index = torch.arange(numel, dtype=torch.int64, device=device)
    elif 2 * count <= numel:
        index = _first_distinct(seed, numel, count, device)
    else:
        # Choosing the complement keeps the number of draws below 0.7 * numel.
        keep = torch.ones(numel, dtype=torch.bool, device=device)
        keep[_first_distinct(seed, numel, numel - count, device)] = False
        index = keep.nonzero().squeeze(1)
    if count <= _INDEX_CACHE_MAX_COUNT:
        with _INDEX_CACHE_LOCK:
            _INDEX_CACHE[key] = index
            while len(_INDEX_CACHE) > _INDEX_CACHE_ENTRIES:
                _INDEX_CACHE.popitem(last=False)
    return index

"""Block-wise absmax quantization to 8, 4, 2 or 1 bits, with optional stochastic rounding.

The flat input is cut into blocks of ``block`` values (the last one may be shorter). Each block
stores one scale ``s`` as a **bfloat16** (2 bytes) and one code per value, bit-packed
little-endian (two int4 per byte, four int2, eight int1; value ``i`` in the lowest bits first).
bfloat16 rather than fp16 because it has fp32's exponent range: a block of 1e30s or of 1e-30s
gets a finite, non-zero scale with no special cases, at a cost of 8 instead of 11 significant
bits in a number that only sets the grid spacing.

Grids, with ``A`` the block's absolute maximum (``q`` is the code, ``x̂`` the decoded value):

========  ======================  ==================  ===================  ================
spec      scale ``s``              codes               ``x̂``                deterministic
                                                                           ``|x - x̂|`` ≤
========  ======================  ==================  ===================  ================
int8      ``A / 127``              q ∈ [-127, 127]     ``q·s``              ``s/2 = A/254``
int4      ``A / 7``                q ∈ [-7, 7]         ``q·s``              ``s/2 = A/14``
int2      ``A / 3``                j ∈ {0, 1, 2, 3}    ``(2j-3)·s``         ``s = A/3``
int1      ``mean |x|`` (stoch.:    sign bit            ``±s``               ``max(s, A-s) ≤ A``
          ``A``)
========  ======================  ==================  ===================  ================

- int8/int4 keep an exact zero (sparse and all-zero regions stay zero) at the price of one unused
  code. int2 does not: a zero-centred 3-level grid would waste a quarter of its code space and
  err by up to ``A/2``; the 4-level grid ``{±1/3, ±1}·A`` errs by at most ``A/3``.
- int1 deterministic is ``sign(x)·mean|x|`` (zero counts as positive): for a fixed sign pattern
  the mean magnitude is the scale that minimises the squared error; on Gaussian data in blocks
  of 256 its squared error is about 15x lower than that of ``sign·A`` (0.36 vs 5.5 variances).
  Stochastic int1 must use ``±A`` so every value lies inside the grid, as unbiased rounding
  requires.
- Scales for absmax grids are rounded *up* to bfloat16 (so the grid always covers ``[-A, A]``)
  and floored at ``2**-126`` (so ``1/s`` is finite); the bounds above therefore hold with ``s``
  up to ``(1 + 2**-7)`` times larger, or with ``s = 2**-126`` for blocks whose values are all
  below about ``1e-36``. int1's mean-abs scale is rounded to nearest.
- ``stochastic`` rounds ``x/s`` to one of its two neighbouring grid points with probabilities
  that make ``E[x̂] = x`` (error ``< one grid step``). The randomness is 16-bit, so the
  expectation is exact up to ``2**-17`` of a step; it comes from the default generator of the
  tensor's device, so ``torch.manual_seed`` makes it reproducible.

All arithmetic is fp32 (inputs of other dtypes are converted chunk by chunk); payload size for
``m`` values is ``2 * ceil(m / block) + ceil(m * bits / 8)`` bytes: scales first, then codes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, Final

import torch

from geoloco.compression import _memory
from geoloco.compression.bitpack import view_as
from geoloco.compression.encoded import CodecError
from geoloco.compression.stages import Option, ValueCodec, check_payload_nbytes

_MIN_SCALE: Final = 2.0**-126
"""Smallest normal fp32: scales are floored here so ``1/s`` never overflows."""

_CHUNK_ELEMENTS: Final = {"cpu": 1 << 20}
"""Values processed per step: on CPU few enough that the temporaries stay in cache, enough that
per-operation overhead stays small (measured best at 2**20 for 256-value blocks)."""
_DEFAULT_CHUNK_ELEMENTS: Final = 1 << 24


@dataclass(frozen=True, slots=True)
class _Grid:
    divisor: float
    """``s = A / divisor`` for absmax grids."""
    midrise: bool
    """Codes ``j`` in ``[0, 2**bits)`` meaning ``(2j - 2**bits + 1) * s`` (no zero level), instead
    of signed codes ``q`` meaning ``q * s``."""

    def levels(self, bits: int) -> int:
        """Largest code magnitude: ``q`` in ``[-levels, levels]`` or ``j`` in ``[0, levels]``."""
        return (1 << bits) - 1 if self.midrise else int(self.divisor)


_GRIDS: Final = {
    8: _Grid(divisor=127.0, midrise=False),
    4: _Grid(divisor=7.0, midrise=False),
    2: _Grid(divisor=3.0, midrise=True),
    1: _Grid(divisor=1.0, midrise=True),
}

BLOCK_OPTION: Final = Option(
    "block",
    "int",
    "values per scale; larger blocks cost fewer scale bytes but coarser grids",
    default=256,
    minimum=8,
    maximum=1 << 20,
    multiple_of=8,
)
STOCHASTIC_OPTION: Final = Option("stochastic", "flag", "unbiased stochastic rounding instead of round-to-nearest")


def _chunk_elements(device: torch.device) -> int:
    return _CHUNK_ELEMENTS.get(device.type, _DEFAULT_CHUNK_ELEMENTS)


def _round_up_bf16_(scale: torch.Tensor) -> torch.Tensor:
    """In place: floor positive fp32 ``scale`` at ``_MIN_SCALE`` and round it up to a bfloat16 value.

    Adding ``0xFFFF`` to the bit pattern and clearing the low 16 bits rounds a positive float up
    to the next value with a zero low half, which is exactly a bfloat16. Inf and NaN must stay
    non-finite so the caller's check sees them, but a NaN whose payload fills the low bits
    overflows the integer addition into a zero, so non-finite scales are put back afterwards.
    """
    scale.clamp_min_(_MIN_SCALE)
    nonfinite = ~torch.isfinite(scale)
    bits = scale.view(torch.int32)
    bits.add_(0xFFFF).bitwise_and_(-0x10000)
    scale.masked_fill_(nonfinite, float("nan"))
    return scale


@dataclass(frozen=True)
class BlockQuantizer(ValueCodec):
    """``int8`` / ``int4`` / ``int2`` / ``int1``: block absmax (int1: mean-abs) quantization."""

    bits: int
    block: int = 256
    stochastic: bool = False

    options: ClassVar[tuple[Option, ...]] = (BLOCK_OPTION, STOCHASTIC_OPTION)
    checks_finite: ClassVar[bool] = True
    summary: ClassVar[str] = "block-wise absmax quantization (bfloat16 scale per block)"

    def __post_init__(self) -> None:
        if self.bits not in _GRIDS:
            raise ValueError(f"BlockQuantizer bits must be one of {sorted(_GRIDS)}, got {self.bits}")
        if not (BLOCK_OPTION.minimum <= self.block <= BLOCK_OPTION.maximum) or self.block % 8:
            raise ValueError(
                f"block={self.block} is invalid for int{self.bits}: use a multiple of 8 "
                f"between {BLOCK_OPTION.minimum} and {BLOCK_OPTION.maximum}"
            )

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"int{self.bits}"

    @property
    def _grid(self) -> _Grid:
        return _GRIDS[self.bits]

    @property
    def _mean_abs_scale(self) -> bool:
        return self.bits == 1 and not self.stochastic

    def num_blocks(self, numel: int) -> int:
        """Scales stored for ``numel`` values."""
        return -(-numel // self.block)

    def payload_nbytes(self, numel: int, dtype: torch.dtype) -> int:
        return 2 * self.num_blocks(numel) + (numel * self.bits + 7) // 8

    # ---------------------------------------------------------------- encode

    def encode_into(self, values: torch.Tensor, out: torch.Tensor, *, absmax: float | None) -> None:
        numel = values.numel()
        blocks = self.num_blocks(numel)
        scales = view_as(out[: 2 * blocks], torch.bfloat16)
        codes = out[2 * blocks :]
        full = numel // self.block
        block_bytes = self.block * self.bits // 8
        rows_per_chunk = max(1, _chunk_elements(values.device) // self.block)
        for row in range(0, full, rows_per_chunk):
            stop = min(full, row + rows_per_chunk)
            self._encode_rows(
                values[row * self.block : stop * self.block].view(stop - row, self.block),
                scales[row:stop],
                codes[row * block_bytes : stop * block_bytes],
                count=self.block,
            )
        tail = numel - full * self.block
        if tail:
            padded = _memory.workspace("q-tail-in", self.block, torch.float32, values.device)
            padded.zero_()
            padded[:tail].copy_(values[full * self.block :])
            tail_codes = _memory.workspace("q-tail-codes", block_bytes, torch.uint8, values.device)
            self._encode_rows(padded.view(1, self.block), scales[full:], tail_codes, count=tail)
            codes[full * block_bytes :].copy_(tail_codes[: codes.numel() - full * block_bytes])
        # Checked once at the end rather than per chunk: a failed encoding is discarded whole.
        self._check_scales(scales)

    def _encode_rows(
        self, rows: torch.Tensor, scales_out: torch.Tensor, codes_out: torch.Tensor, *, count: int
    ) -> None:
        """Encode ``rows`` (R blocks of ``block`` values; the last ``block - count`` are padding)."""
        num_rows, block = rows.shape
        device = rows.device
        grid = self._grid
        if rows.dtype == torch.float32:
            x = rows
        else:
            x = _memory.workspace("q-x", num_rows * block, torch.float32, device).view(num_rows, block)
            x.copy_(rows)
        work = _memory.workspace("q-work", num_rows * block, torch.float32, device).view(num_rows, block)
        codes = _memory.workspace("q-codes", num_rows * block, torch.uint8, device).view(num_rows, block)

        if self._mean_abs_scale:
            torch.abs(x, out=work)
            total = work.sum(dim=1)
            if not torch.isfinite(total).all():  # only for values near float32's limit
                total = work.sum(dim=1, dtype=torch.float64)
            scale = (total / count).to(torch.float32)
            scales_out.copy_(scale)
            torch.ge(x, 0.0, out=codes.view(torch.bool))
        else:
            scale = torch.amax(x, dim=1)
            torch.maximum(scale, torch.amin(x, dim=1).neg_(), out=scale)
            scale.mul_(1.0 / grid.divisor)
            _round_up_bf16_(scale)
            scales_out.copy_(scale)
            inverse = scale.reciprocal_().unsqueeze(1)
            if grid.midrise:
                inverse.mul_(0.5)
                torch.addcmul(self._midrise_offset(device), x, inverse, out=work)
            else:
                torch.mul(x, inverse, out=work)
            if self.stochastic:
                self._add_rounding_noise(work)
            work.round_()
            levels = grid.levels(self.bits)
            if self.stochastic:
                work.clamp_(0 if grid.midrise else -levels, levels)
            if self.bits == 8:
                codes_out.view(torch.int8).view(num_rows, block).copy_(work)
                return
            codes.view(torch.int8).copy_(work)
            if not grid.midrise:
                codes.add_(levels + 1)  # int4: q in [-7, 7] -> j in [1, 15]
        self._pack(codes.view(-1), codes_out)

    def _midrise_offset(self, device: torch.device) -> torch.Tensor:
        return _constant(((1 << self.bits) - 1) / 2, device)

    def _check_scales(self, scales: torch.Tensor) -> None:
        """Raise if any stored scale is not finite: the input had NaN/Inf, or is too large."""
        if torch.isfinite(scales).all():
            return
        raise ValueError(
            f"cannot encode with int{self.bits}: the tensor has NaN or Inf values, or magnitudes so close "
            "to float32's limit that no finite scale covers them; clean, clip or scale it first"
        )

    @staticmethod
    def _add_rounding_noise(work: torch.Tensor) -> None:
        """Add uniform noise in (-1/2, 1/2) on a 2**-16 grid, offset half a step so no sum lands
        exactly on a rounding tie: round-to-nearest then gives unbiased stochastic rounding."""
        numel = work.numel()
        raw = _memory.workspace("q-noise-bits", (numel + 3) // 4, torch.int64, work.device)
        raw.random_(-(2**63), None)
        noise = _memory.workspace("q-noise", numel, torch.float32, work.device).view_as(work)
        noise.copy_(raw.view(torch.int16)[:numel].view_as(work))
        noise.add_(0.5)
        work.add_(noise, alpha=2.0**-16)

    def _pack(self, codes: torch.Tensor, out: torch.Tensor) -> None:
        """Pack unsigned codes below ``2**bits`` (one per byte, clobbered) into ``out``.

        Works on machine words holding one output byte's worth of codes (int16 for int4, int32
        for int2, int64 for int1): shifting right by ``8 - bits``, then twice that, ... and OR-ing
        gathers each code's bits into the low byte. Contiguous word operations vectorise;
        per-lane strided byte operations do not.
        """
        word_dtype, steps = _PACKING[self.bits]
        words = codes.view(word_dtype)
        scratch = _memory.workspace("q-pack", words.numel(), word_dtype, codes.device)
        for shift, _ in steps:
            torch.bitwise_right_shift(words, shift, out=scratch)
            words.bitwise_or_(scratch)
        words.bitwise_and_(0xFF)
        out.copy_(words)

    def _unpack(self, packed: torch.Tensor, codes: torch.Tensor) -> None:
        """Inverse of :meth:`_pack`: spread each byte of ``packed`` over one word of ``codes``."""
        word_dtype, steps = _PACKING[self.bits]
        words = codes.view(word_dtype)
        words.copy_(packed)
        scratch = _memory.workspace("q-pack", words.numel(), word_dtype, codes.device)
        for shift, mask in reversed(steps):
            torch.bitwise_left_shift(words, shift, out=scratch)
            words.bitwise_or_(scratch)
            words.bitwise_and_(mask)

    # ---------------------------------------------------------------- decode

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor, dtype: torch.dtype) -> None:
        numel = out.numel()
        check_payload_nbytes(self.canonical(), payload, self.payload_nbytes(numel, dtype))
        blocks = self.num_blocks(numel)
        scales = view_as(payload[: 2 * blocks], torch.bfloat16).to(torch.float32)
        if not torch.isfinite(scales).all():
            raise CodecError(f"{self.canonical()}: payload holds non-finite scales; the data is corrupted")
        codes = payload[2 * blocks :]
        full = numel // self.block
        block_bytes = self.block * self.bits // 8
        rows_per_chunk = max(1, _chunk_elements(out.device) // self.block)
        for row in range(0, full, rows_per_chunk):
            stop = min(full, row + rows_per_chunk)
            self._decode_rows(
                codes[row * block_bytes : stop * block_bytes],
                scales[row:stop],
                out[row * self.block : stop * self.block].view(stop - row, self.block),
            )
        tail = numel - full * self.block
        if tail:
            padded_codes = _memory.workspace("q-tail-codes", block_bytes, torch.uint8, out.device)
            padded_codes.zero_()
            tail_codes = codes[full * block_bytes :]
            padded_codes[: tail_codes.numel()].copy_(tail_codes)
            padded = _memory.workspace("q-tail-out", self.block, torch.float32, out.device)
            self._decode_rows(padded_codes, scales[full:], padded.view(1, self.block))
            out[full * self.block :].copy_(padded[:tail])

    def decode_pieces(
        self, payload: torch.Tensor, numel: int, dtype: torch.dtype, device: torch.device
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Rows of blocks decoded into one reused buffer of ``_chunk_elements`` values, with
        the very operations ``decode_into`` applies to a float32 ``out``."""
        check_payload_nbytes(self.canonical(), payload, self.payload_nbytes(numel, dtype))
        blocks = self.num_blocks(numel)
        scales = view_as(payload[: 2 * blocks], torch.bfloat16).to(torch.float32)
        if not torch.isfinite(scales).all():
            raise CodecError(f"{self.canonical()}: payload holds non-finite scales; the data is corrupted")
        codes = payload[2 * blocks :]
        full = numel // self.block
        block_bytes = self.block * self.bits // 8
        rows_per_chunk = max(1, _chunk_elements(device) // self.block)
        buffer = torch.empty(max(1, min(full, rows_per_chunk)) * self.block, dtype=torch.float32, device=device)
        for row in range(0, full, rows_per_chunk):
            stop = min(full, row + rows_per_chunk)
            rows = buffer[: (stop - row) * self.block].view(stop - row, self.block)
            self._decode_rows(codes[row * block_bytes : stop * block_bytes], scales[row:stop], rows)
            yield row * self.block, rows.view(-1)
        tail = numel - full * self.block
        if tail:
            padded_codes = torch.zeros(block_bytes, dtype=torch.uint8, device=device)
            tail_codes = codes[full * block_bytes :]
            padded_codes[: tail_codes.numel()].copy_(tail_codes)
            padded = buffer[: self.block]
            self._decode_rows(padded_codes, scales[full:], padded.view(1, self.block))
            yield full * self.block, padded[:tail]

    def _decode_rows(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        num_rows, block = out.shape
        grid = self._grid
        if out.dtype == torch.float32:
            values = out
        else:
            values = _memory.workspace("q-x", num_rows * block, torch.float32, out.device).view(num_rows, block)
        scale = scales.unsqueeze(1)
        if self.bits == 8:
            signed = codes.view(torch.int8)
        else:
            unpacked = _memory.workspace("q-codes", num_rows * block, torch.uint8, out.device)
            self._unpack(codes, unpacked)
            signed = unpacked.view(torch.int8)
            if grid.midrise:
                signed.mul_(2).sub_((1 << self.bits) - 1)  # j -> 2j - (2**bits - 1)
            else:
                signed.sub_(grid.levels(self.bits) + 1)  # int4: j in [1, 15] -> q in [-7, 7]
        torch.mul(signed.view(num_rows, block), scale, out=values)
        if values is not out:
            out.copy_(values)


_PACKING: Final[dict[int, tuple[torch.dtype, tuple[tuple[int, int], ...]]]] = {
    # bits: (word holding one packed byte's codes, ((shift, mask after unpacking), ...))
    4: (torch.int16, ((4, 0x0F0F),)),
    2: (torch.int32, ((6, 0x03030303), (12, 0x000F000F))),
    1: (torch.int64, ((7, 0x0101010101010101), (14, 0x0003000300030003), (28, 0x0000000F0000000F))),
}

_CONSTANTS: dict[tuple[float, torch.device], torch.Tensor] = {}


def _constant(value: float, device: torch.device) -> torch.Tensor:
    """A cached 0-d fp32 tensor (``addcmul`` needs its addend as a tensor)."""
    key = (value, device)
    tensor = _CONSTANTS.get(key)
    if tensor is None:
        tensor = torch.tensor(value, dtype=torch.float32, device=device)
        _CONSTANTS[key] = tensor
    return tensor

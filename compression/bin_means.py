"""``int2mean``: SparseLoCo's 2-bit quantizer, which decodes each value to the mean of its bin.

The absmax grids of ``quantize.py`` put their levels at fixed fractions of a block's largest
magnitude; on top-k values (two clusters of large magnitudes, one per sign) the 2-bit grid
``{±A/3, ±A}`` spends its levels where few values are and rounds most of them to a sign times a
scale. The authors' quantizer (``TopKCompressor._quantize_values`` of tplr-ai's SparseLoCo /
templar, with ``quantization_bins = 4``) adapts to the values instead, per tensor:

1. shift by the mean ``μ`` of the tensor's values: ``c = x − μ``;
2. ``σ = ‖c‖ / sqrt(n − 1)``, bin width ``s = sigmas · σ / 4`` (``s = 1`` when that is zero or not
   finite, as for a single value), code ``q = clamp(round(c / s + 2), 0, 3)``;
3. send the four bin means ``m_j = mean{x : q(x) = j}`` (0 for an empty bin) with the codes;
   decode ``x̂ = m_q``.

Because a value decodes to the mean of the values that share its code, the decoded tensor keeps
each bin's sum exactly (up to the float32 rounding of ``m_j``) whatever the spread inside a bin.
``sigmas`` (the quantizer's range in standard deviations) is 6 by default, the authors' default.
The authors store ``μ`` and a table of centred means and add them on decoding; sending ``m_j``
with ``μ`` already added gives the same numbers up to rounding in one fewer step.

"Per tensor" means per run of values the pipeline says belong to one tensor
(``ValueCodec.for_segments``, from ``tiletopk``'s ``value_segments``); without a ``tiletopk``
before it (``"int2mean"`` alone, ``"topk:F|int2mean"``) the whole vector is one run.

Payload for ``n`` values in ``r`` runs: ``r`` tables of four float32 means (16 bytes each, run by
run), then the codes, 2 bits each, packed little-endian (``bitpack.pack_uint``):
``16 * r + ceil(n / 4)`` bytes. Statistics are summed in float64 and the means stored in float32;
the decoded values are the stored means exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import ClassVar, Final

import torch

from geoloco.compression.bitpack import pack_uint, packed_nbytes, unpack_uint, view_as
from geoloco.compression.encoded import CodecError
from geoloco.compression.stages import Option, ValueCodec, check_payload_nbytes

BINS: Final = 4
"""Codes per value: 2 bits."""
_BITS: Final = 2
_TABLE_NBYTES: Final = 4 * BINS
"""One run's table: four float32 bin means."""

SIGMAS_OPTION: Final = Option(
    "sigmas",
    "int",
    "the four bins span this many standard deviations around the mean",
    default=6,
    minimum=1,
    maximum=64,
)


@dataclass(frozen=True)
class BinMeanQuantizer(ValueCodec):
    """``int2mean[:sigmas=S]``: 2-bit codes over mean-shifted, σ-scaled bins, decoded to each
    bin's mean from a table per run (module docstring)."""

    sigmas: int = 6
    segments: tuple[int, ...] | None = field(default=None, compare=False)
    """Lengths of the runs coded apart (one per tensor); None: the whole vector is one run."""

    name: ClassVar[str] = "int2mean"
    summary: ClassVar[str] = (
        "SparseLoCo's 2-bit quantizer: mean-shifted, sigma-scaled bins decoded to each bin's mean "
        "(a table of 4 float32 means per tensor)"
    )
    options: ClassVar[tuple[Option, ...]] = (SIGMAS_OPTION,)

    def __post_init__(self) -> None:
        if isinstance(self.sigmas, bool) or not SIGMAS_OPTION.minimum <= self.sigmas <= SIGMAS_OPTION.maximum:
            raise ValueError(
                f"int2mean sigmas={self.sigmas!r} is out of range; use {SIGMAS_OPTION.minimum}..{SIGMAS_OPTION.maximum}"
            )

    def for_segments(self, segments: tuple[int, ...] | None) -> BinMeanQuantizer:
        return replace(self, segments=None if segments is None else tuple(segments))

    def _runs(self, numel: int) -> tuple[int, ...]:
        if self.segments is None:
            return (numel,) if numel else ()
        if sum(self.segments) != numel:
            raise ValueError(
                f"{self.canonical()} is bound to runs of {sum(self.segments)} values in all, but got {numel} values"
            )
        return self.segments

    def payload_nbytes(self, numel: int, dtype: torch.dtype) -> int:
        return _TABLE_NBYTES * len(self._runs(numel)) + packed_nbytes(numel, _BITS)

    def encode_into(self, values: torch.Tensor, out: torch.Tensor, *, absmax: float | None) -> None:
        runs = self._runs(values.numel())
        tables = torch.zeros(len(runs), BINS, dtype=torch.float32, device=values.device)
        codes = torch.empty(values.numel(), dtype=torch.int64, device=values.device)
        start = 0
        for index, length in enumerate(runs):
            stop = start + length
            if length:
                codes[start:stop], tables[index] = self._encode_run(values[start:stop].to(torch.float32))
            start = stop
        table_nbytes = _TABLE_NBYTES * len(runs)
        out[:table_nbytes].copy_(tables.view(-1).view(torch.uint8))
        pack_uint(codes, _BITS, out[table_nbytes:])

    def _encode_run(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One run's codes and its table of bin means (steps 1-3 of the module docstring)."""
        count = x.numel()
        shift = float(x.sum(dtype=torch.float64)) / count
        centred = x - shift
        spread = math.sqrt(float(centred.square().sum(dtype=torch.float64)) / (count - 1)) if count > 1 else 0.0
        width = self.sigmas * spread / BINS
        if not (math.isfinite(width) and width > 0):
            width = 1.0
        codes = centred.mul_(1.0 / width).add_(BINS // 2).round_().clamp_(0, BINS - 1).to(torch.int64)
        table = torch.zeros(BINS, dtype=torch.float64, device=x.device)
        for code in range(BINS):
            chosen = codes == code
            hits = int(chosen.sum())
            if hits:
                table[code] = torch.where(chosen, x, 0.0).sum(dtype=torch.float64) / hits
        return codes, table.to(torch.float32)

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor, dtype: torch.dtype) -> None:
        numel = out.numel()
        check_payload_nbytes(self.canonical(), payload, self.payload_nbytes(numel, dtype))
        runs = self._runs(numel)
        table_nbytes = _TABLE_NBYTES * len(runs)
        tables = view_as(payload[:table_nbytes], torch.float32)
        if not torch.isfinite(tables).all():
            raise CodecError(f"{self.canonical()}: payload holds non-finite bin means; the data is corrupted")
        if not numel:
            return
        codes = unpack_uint(payload[table_nbytes:], numel, _BITS).to(out.device)
        run = torch.repeat_interleave(
            torch.arange(len(runs), dtype=torch.int64, device=out.device),
            torch.tensor(runs, dtype=torch.int64, device=out.device),
        )
        out.copy_(tables.to(out.device)[run * BINS + codes])

"""Value codecs that store every value as a float: lossless ``none`` and the casts.

- ``none``: the raw bytes of the original dtype. Lossless for every input dtype, which is why it
  is the fallback and the implicit value stage after a bare sparsifier (``"topk:0.01"`` means
  ``"topk:0.01,...|none"``: the chosen values travel exactly).
- ``fp32``, ``bf16``, ``fp16``: round to nearest in that dtype. Casts *saturate*: a magnitude
  beyond the target's largest finite value becomes that value (65504 for fp16, about 3.39e38 for
  bf16) instead of Inf, because an Inf would poison the aggregate, while a saturated value
  leaves the excess in the error-feedback residual.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from geoloco.compression import _memory
from geoloco.compression.bitpack import view_as
from geoloco.compression.stages import ValueCodec, elementwise_pieces

_CLAMP_CHUNK = 1 << 20


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


@dataclass(frozen=True)
class Lossless(ValueCodec):
    """``none``: values travel as the raw bytes of their original dtype."""

    name: ClassVar[str] = "none"
    summary: ClassVar[str] = "lossless: raw values in the tensor's own dtype"

    def payload_nbytes(self, numel: int, dtype: torch.dtype) -> int:
        return numel * _itemsize(dtype)

    def encode_into(self, values: torch.Tensor, out: torch.Tensor, *, absmax: float | None) -> None:
        if values.numel():
            out.copy_(values.view(torch.uint8))

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor, dtype: torch.dtype) -> None:
        if not out.numel():
            return
        if out.dtype == dtype and out.is_contiguous():
            # A byte copy needs no alignment: a payload that sits at an odd offset of a received
            # buffer (the wire header is 29 bytes for ``none``) is copied once, not twice.
            out.view(torch.uint8).copy_(payload)
            return
        out.copy_(view_as(payload, dtype))

    def decode_pieces(
        self, payload: torch.Tensor, numel: int, dtype: torch.dtype, device: torch.device
    ) -> Iterator[tuple[int, torch.Tensor]]:
        return elementwise_pieces(self, payload, numel, dtype, device, _itemsize(dtype))


@dataclass(frozen=True)
class Cast(ValueCodec):
    """``fp32`` / ``bf16`` / ``fp16``: values rounded to nearest in ``target``, saturating."""

    target: torch.dtype

    names: ClassVar[dict[torch.dtype, str]] = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    summary: ClassVar[str] = "cast each value to this float type (round to nearest, saturating)"

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.names[self.target]

    def payload_nbytes(self, numel: int, dtype: torch.dtype) -> int:
        return numel * _itemsize(self.target)

    def encode_into(self, values: torch.Tensor, out: torch.Tensor, *, absmax: float | None) -> None:
        if not values.numel():
            return
        target = view_as(out, self.target)
        limit = torch.finfo(self.target).max
        if absmax is None or absmax <= limit:
            target.copy_(values)
            return
        # Saturate chunk by chunk so no full-size temporary is needed.
        # The scratch is at least fp32 so the limit itself is exact (bf16 cannot hold 65504).
        wide = torch.promote_types(values.dtype, torch.float32)
        scratch = _memory.workspace("cast", min(values.numel(), _CLAMP_CHUNK), wide, values.device)
        for start in range(0, values.numel(), _CLAMP_CHUNK):
            stop = min(values.numel(), start + _CLAMP_CHUNK)
            part = scratch[: stop - start]
            part.copy_(values[start:stop]).clamp_(-limit, limit)
            target[start:stop].copy_(part)

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor, dtype: torch.dtype) -> None:
        if out.numel():
            out.copy_(view_as(payload, self.target))

    def decode_pieces(
        self, payload: torch.Tensor, numel: int, dtype: torch.dtype, device: torch.device
    ) -> Iterator[tuple[int, torch.Tensor]]:
        return elementwise_pieces(self, payload, numel, dtype, device, _itemsize(self.target))

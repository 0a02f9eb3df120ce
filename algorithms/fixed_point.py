"""Fixed-point encoding of real updates into ``Z_{2^b}`` for secure aggregation.

Masks only cancel in modular integer arithmetic, so every site maps its (clipped) update onto
integers with the *same* scale, the sum is taken modulo ``2^b`` and lifted back to signed values.
The scale is chosen with **headroom** for the number of sites (and for distributed DP noise) so the
true integer sum can never wrap: ``n * (clip * scale + 1) + 12 * noise_std_of_sum < 2^(b-1)``.
Rounding is **stochastic** (``floor(x) + Bernoulli(frac(x))``), so the encoding is unbiased and the
rounding error of a sum of ``n`` sites has standard deviation at most ``sqrt(n) / (2 * scale)``
per coordinate.

Masked values travel at the modulus width (``uint8``/``uint16``/``uint32``, little-endian), never
as int64.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch

__all__ = [
    "MODULUS_DTYPES",
    "FixedPoint",
    "clip_l2",
    "lift",
    "pack",
    "plan_fixed_point",
    "secure_generator",
    "stochastic_round",
    "unpack",
]

MODULUS_DTYPES: Final[dict[int, np.dtype[Any]]] = {8: np.dtype("<u1"), 16: np.dtype("<u2"), 32: np.dtype("<u4")}
"""Modulus bits -> the unsigned little-endian dtype masked values travel in."""

_TAIL_SIGMAS: Final = 12.0
"""Noise standard deviations reserved as headroom (a 12-sigma excursion has probability < 1e-32)."""


def secure_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A torch generator seeded from the OS CSPRNG, for rounding and DP noise.

    Noise and rounding must be unpredictable to the coordinator, so they never come from the
    shared round seeds that random-k uses.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(secrets.randbits(63))
    return generator


def clip_l2(update: torch.Tensor, clip_norm: float) -> tuple[torch.Tensor, float]:
    """``update * min(1, clip_norm / ||update||_2)`` and the norm before clipping."""
    if not clip_norm > 0:
        raise ValueError(f"clip_norm must be > 0, got {clip_norm}")
    norm = float(torch.linalg.vector_norm(update.to(torch.float64)))
    if norm > clip_norm:
        return update * (clip_norm / norm), norm
    return update, norm


def stochastic_round(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``floor(x) + Bernoulli(x - floor(x))`` as int64: unbiased, error below 1 per value."""
    x = x.to(torch.float64)
    low = torch.floor(x)
    up = torch.rand(x.shape, dtype=torch.float64, device=x.device, generator=generator) < (x - low)
    return low.to(torch.int64) + up.to(torch.int64)


@dataclass(frozen=True, slots=True)
class FixedPoint:
    """The shared encoding every site of a secure round uses (same clip, same scale, same width)."""

    clip_norm: float
    """L2 norm each site's update is clipped to; bounds every coordinate by ``clip_norm``."""
    scale: float
    """Integer units per unit of update value."""
    modulus_bits: int
    """``b`` in ``Z_{2^b}``: 8, 16 or 32."""

    @property
    def dtype(self) -> np.dtype[Any]:
        return MODULUS_DTYPES[self.modulus_bits]

    def quantize(self, values: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Already-clipped float values -> int64 fixed point (stochastic rounding)."""
        return stochastic_round(values.to(torch.float64) * self.scale, generator)

    def dequantize(self, ints: torch.Tensor) -> torch.Tensor:
        """Signed integers (e.g. a lifted sum) -> fp32 values."""
        return (ints.to(torch.float64) / self.scale).to(torch.float32)


def plan_fixed_point(
    clip_norm: float,
    num_sites: int,
    *,
    modulus_bits: int = 32,
    noise_std: float = 0.0,
    min_levels: int = 1 << 8,
    max_scale: float | None = None,
) -> FixedPoint:
    """The largest scale for which the sum of ``num_sites`` clipped, noised updates cannot wrap.

    ``noise_std`` is the standard deviation of the noise in the *sum* (in update units, e.g.
    ``noise_multiplier * clip_norm`` for DP). Raises ``ValueError`` when fewer than ``min_levels``
    integer levels would remain for ``clip_norm``: the encoding would then be too coarse to train.
    ``max_scale`` caps the scale (distributed DP keeps its integer noise in the range where
    Poisson samplers are exact).
    """
    if modulus_bits not in MODULUS_DTYPES:
        raise ValueError(f"modulus_bits must be one of {sorted(MODULUS_DTYPES)}, got {modulus_bits}")
    if num_sites < 1:
        raise ValueError(f"num_sites must be >= 1, got {num_sites}")
    if not clip_norm > 0:
        raise ValueError(f"clip_norm must be > 0, got {clip_norm}")
    if noise_std < 0:
        raise ValueError(f"noise_std must be >= 0, got {noise_std}")
    room = (1 << (modulus_bits - 1)) - 1 - num_sites  # +1 per site for rounding up
    scale = room / (num_sites * clip_norm + _TAIL_SIGMAS * noise_std)
    if max_scale is not None:
        scale = min(scale, max_scale)
    if scale * clip_norm < min_levels:
        raise ValueError(
            f"Z_2^{modulus_bits} leaves only {scale * clip_norm:.0f} integer levels for clip_norm "
            f"{clip_norm} with {num_sites} sites and noise std {noise_std}; use modulus_bits=32 "
            f"or fewer sites per round (need >= {min_levels})"
        )
    return FixedPoint(clip_norm=clip_norm, scale=scale, modulus_bits=modulus_bits)


def pack(ints: np.ndarray | torch.Tensor, modulus_bits: int) -> bytes:
    """Integers reduced modulo ``2^b`` as little-endian bytes of width ``b / 8``."""
    dtype = MODULUS_DTYPES[modulus_bits]
    if isinstance(ints, torch.Tensor):
        ints = ints.cpu().numpy()
    if ints.dtype == dtype:
        return ints.tobytes()
    return (ints.astype(np.int64) & ((1 << modulus_bits) - 1)).astype(dtype).tobytes()


def unpack(data: bytes | memoryview, modulus_bits: int) -> np.ndarray:
    """Bytes written by ``pack`` -> an array of the modulus dtype (a copy, writable)."""
    dtype = MODULUS_DTYPES[modulus_bits]
    if len(data) % dtype.itemsize:
        raise ValueError(
            f"{len(data)} bytes is not a whole number of {modulus_bits}-bit values"
        )
    return np.frombuffer(data, dtype=dtype).copy()


def lift(total: np.ndarray, modulus_bits: int) -> torch.Tensor:
    """A sum in ``Z_{2^b}`` -> signed int64 in ``[-2^(b-1), 2^(b-1))`` (exact while there is headroom)."""
    values = total.astype(np.int64)
    half = 1 << (modulus_bits - 1)
    values[values >= half] -= 1 << modulus_bits
    return torch.from_numpy(values)

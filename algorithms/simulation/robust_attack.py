"""Poisoned sites for the simulator: what a faulty or hostile site could upload instead of its update.

A research hook to measure robust aggregation (``geoloco.algorithms.robust``), set per simulated
site as ``attack`` in ``[[sites]]``; the real site agent has no such setting. The site trains
honestly and the transform replaces the pseudo-gradient it uploads (before its uplink codec):

- ``"scale:F"``: ``F · Δ`` (e.g. ``scale:100``, a blown-up update or a model-replacement attempt);
- ``"sign_flip"``: ``−Δ`` (pushes the model back the way the site's data pulls it);
- ``"noise:S"``: ``Δ`` replaced by Gaussian noise of standard deviation ``S`` per coordinate
  (a broken site), drawn from a seed derived from the round seed and the site, so runs repeat.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from geoloco.algorithms.params import derive_seed

__all__ = ["ATTACK_KINDS", "ATTACK_SEED_PURPOSE", "Attack", "parse_attack"]

ATTACK_KINDS: tuple[str, ...] = ("scale:F", "sign_flip", "noise:S")
"""The forms ``attack`` takes (``F`` a factor, ``S`` a standard deviation > 0)."""

ATTACK_SEED_PURPOSE = "attack"
"""Domain tag of a noise attack's seed, ``derive_seed(round_seed, tag, site)``."""


@dataclass(frozen=True, slots=True)
class Attack:
    """One parsed ``attack`` spec."""

    kind: Literal["scale", "sign_flip", "noise"]
    value: float = 1.0
    """The factor (``scale``) or the standard deviation (``noise``)."""

    def apply(self, update: torch.Tensor, *, round_seed: int, site: str) -> torch.Tensor:
        """The poisoned upload in place of ``update`` (a new tensor; ``update`` is left alone)."""
        if self.kind == "scale":
            return update * self.value
        if self.kind == "sign_flip":
            return -update
        generator = torch.Generator().manual_seed(derive_seed(round_seed, ATTACK_SEED_PURPOSE, site))
        noise = torch.randn(update.shape, generator=generator, dtype=torch.float32)
        return (noise * self.value).to(device=update.device, dtype=update.dtype)


def parse_attack(spec: str) -> Attack:
    """``"scale:100"``, ``"sign_flip"`` or ``"noise:1.0"`` as an ``Attack``; a ``ValueError`` that
    lists the allowed forms otherwise."""
    allowed = f"allowed: {', '.join(ATTACK_KINDS)}"
    name, _, arg = spec.strip().partition(":")
    if name == "sign_flip" and not arg:
        return Attack("sign_flip")
    if name in ("scale", "noise"):
        try:
            value = float(arg)
        except ValueError:
            raise ValueError(f"attack {spec!r}: {name} needs a number after ':'; {allowed}") from None
        if not math.isfinite(value) or (name == "noise" and value <= 0):
            what = "the standard deviation must be > 0" if name == "noise" else "the factor must be finite"
            raise ValueError(f"attack {spec!r}: {what}; {allowed}")
        return Attack(name, value)  # type: ignore[arg-type]
    raise ValueError(f"unknown attack {spec!r}; {allowed}")

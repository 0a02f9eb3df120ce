"""Shared helpers for the privacy tests: identity keys and a seeded entropy source."""

from __future__ import annotations

import random
from collections.abc import Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey


def identity_keys(n: int, seed: int = 0) -> dict[int, Ed25519PrivateKey]:
    rng = random.Random(seed)
    return {s: Ed25519PrivateKey.from_private_bytes(rng.randbytes(32)) for s in range(n)}


def seeded_bytes(seed: int) -> Callable[[int], bytes]:
    """A reproducible stand-in for ``os.urandom`` (tests only)."""
    return random.Random(seed).randbytes

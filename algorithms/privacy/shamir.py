"""Shamir secret sharing of 32-byte secrets over the prime field GF(2^521 - 1).

Secure aggregation (Bonawitz et al. 2017) shares two secrets per site: the seed of its self-mask
and the private key of its pairwise-mask key pair. Any ``threshold`` shares reconstruct a secret;
fewer reveal nothing about it (every value is equally likely). The field is the Mersenne prime
``2^521 - 1``, large enough that every 32-byte secret is a field element without reduction, so
reconstruction returns the exact bytes. Share x-coordinates are ``holder + 1`` (never 0, where the
secret lives).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from typing import Final

__all__ = ["PRIME", "SECRET_NBYTES", "SHARE_NBYTES", "is_share", "reconstruct", "split"]

PRIME: Final = (1 << 521) - 1
"""The field modulus, a Mersenne prime (so every 256-bit secret is a field element)."""
SHARE_NBYTES: Final = 66
"""Bytes of one share value (521 bits rounded up)."""
SECRET_NBYTES: Final = 32
"""Bytes of a secret: an X25519 private key or a 256-bit mask seed."""


def split(secret: bytes, holders: Iterable[int], threshold: int) -> dict[int, bytes]:
    """Shares of ``secret`` for each holder (a site id >= 0); any ``threshold`` of them reconstruct it.

    The polynomial's coefficients come from ``secrets`` (the OS CSPRNG): they are what keeps fewer
    than ``threshold`` shares from revealing anything.
    """
    holders = sorted(set(holders))
    if len(secret) != SECRET_NBYTES:
        raise ValueError(f"Shamir secrets are {SECRET_NBYTES} bytes, got {len(secret)}")
    if any(h < 0 for h in holders):
        raise ValueError(f"share holders are site ids >= 0, got {holders}")
    if not 1 <= threshold <= len(holders):
        raise ValueError(
            f"threshold {threshold} must be between 1 and the number of holders ({len(holders)})"
        )
    coefficients = [int.from_bytes(secret, "big")] + [
        secrets.randbelow(PRIME) for _ in range(threshold - 1)
    ]
    shares = {}
    for holder in holders:
        x = holder + 1
        y = 0
        for c in reversed(coefficients):  # Horner's rule
            y = (y * x + c) % PRIME
        shares[holder] = y.to_bytes(SHARE_NBYTES, "big")
    return shares


def is_share(value: object) -> bool:
    """Whether ``value`` can be a share: ``SHARE_NBYTES`` bytes encoding a field element."""
    return (
        isinstance(value, bytes) and len(value) == SHARE_NBYTES and int.from_bytes(value, "big") < PRIME
    )


def reconstruct(shares: Mapping[int, bytes], threshold: int) -> bytes:
    """The secret from at least ``threshold`` shares (``holder -> share``), by Lagrange at x = 0.

    Raises ``ValueError`` with fewer than ``threshold`` shares: the secret is then undetermined,
    and guessing would silently corrupt the aggregate.
    """
    if len(shares) < threshold:
        raise ValueError(
            f"{len(shares)} shares cannot reconstruct a secret shared with threshold {threshold}"
        )
    points = sorted(shares.items())[:threshold]
    xs = [h + 1 for h, _ in points]
    secret = 0
    for i, (xi, (_, share)) in enumerate(zip(xs, points, strict=True)):
        if len(share) != SHARE_NBYTES:
            raise ValueError(f"a Shamir share is {SHARE_NBYTES} bytes, got {len(share)}")
        yi = int.from_bytes(share, "big")
        num, den = 1, 1
        for j, xj in enumerate(xs):
            if j != i:
                num = num * (-xj) % PRIME
                den = den * (xi - xj) % PRIME
        secret = (secret + yi * num * pow(den, -1, PRIME)) % PRIME
    if secret >= 1 << (8 * SECRET_NBYTES):
        raise ValueError("the shares do not belong to one 32-byte secret (corrupted or mixed shares)")
    return secret.to_bytes(SECRET_NBYTES, "big")

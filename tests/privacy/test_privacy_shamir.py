from __future__ import annotations

import itertools
import os

import pytest

from geoloco.algorithms.privacy import shamir


def test_any_threshold_subset_reconstructs_the_exact_secret() -> None:
    secret = os.urandom(32)
    shares = shamir.split(secret, range(6), 4)
    for subset in itertools.combinations(range(6), 4):
        assert shamir.reconstruct({h: shares[h] for h in subset}, 4) == secret
    assert shamir.reconstruct(shares, 4) == secret


def test_secret_with_high_bits_set_round_trips() -> None:
    secret = b"\xff" * 32
    shares = shamir.split(secret, [0, 5, 9], 2)
    assert shamir.reconstruct({5: shares[5], 9: shares[9]}, 2) == secret


def test_below_threshold_is_refused() -> None:
    shares = shamir.split(os.urandom(32), range(5), 3)
    with pytest.raises(ValueError, match="2 shares cannot reconstruct"):
        shamir.reconstruct({0: shares[0], 1: shares[1]}, 3)


def test_fewer_shares_than_threshold_do_not_determine_the_secret() -> None:
    # Two different secrets, threshold 3: two shares of one are consistent with the other
    # (a third point can always be chosen), so mixing shares gives garbage, not either secret.
    a, b = os.urandom(32), os.urandom(32)
    sa, sb = shamir.split(a, range(4), 3), shamir.split(b, range(4), 3)
    try:
        mixed = shamir.reconstruct({0: sa[0], 1: sa[1], 2: sb[2]}, 3)
    except ValueError:
        return  # out of the 32-byte range: detected as mixed shares
    assert mixed not in (a, b)


@pytest.mark.parametrize(
    ("secret", "holders", "threshold", "match"),
    [(b"x" * 31, [0, 1, 2], 2, "32 bytes"), (b"x" * 32, [0, 1], 3, "threshold 3"), (b"x" * 32, [-1, 2], 2, ">= 0")],
)
def test_bad_arguments_are_named(secret: bytes, holders: list[int], threshold: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        shamir.split(secret, holders, threshold)

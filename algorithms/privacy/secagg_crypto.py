"""Secure aggregation's crypto primitives: X25519 keys, HKDF, the ChaCha20 mask PRG, the neighbour graph.

Pure functions shared by the site (``secagg_client``) and the coordinator (``secagg_server``);
the protocol itself is described in ``geoloco.algorithms.privacy.secagg_messages``. Every derived key is bound by
HKDF to ``DOMAIN``, a purpose, the session and the round, so no two masks of a run share a
keystream and no key of one purpose can be replayed as another's.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = [
    "DEFAULT_COLLUDING_SITES",
    "DOMAIN",
    "NeighbourMode",
    "RandomBytes",
    "ThresholdPolicy",
    "add_masks",
    "check_threshold",
    "default_threshold",
    "hkdf",
    "keystream",
    "keystream_into",
    "mask_key",
    "neighbour_graph",
    "num_chunks",
    "private_bytes",
    "public_bytes",
    "secure_threshold",
    "seed_commitment",
    "site_index",
    "split_view_bound",
]

NeighbourMode = Literal["full", "secagg+"]

DOMAIN: Final = b"geoloco-secagg/v1"
"""Domain separation of every key derivation and signed byte string of the protocol."""
PURPOSE_PAIR_MASK: Final = b"pair-mask"
PURPOSE_SELF_MASK: Final = b"self-mask"
PURPOSE_SHARE_KEY: Final = b"share-encryption"
PURPOSE_SEED_COMMITMENT: Final = b"self-mask-commitment"

RandomBytes = Callable[[int], bytes]


def default_threshold(num_holders: int) -> int:
    """About two thirds of the share holders (at least 2): ``ceil(2 n / 3)``."""
    return max(2, math.ceil(2 * num_holders / 3))


def split_view_bound(num_holders: int, colluding_sites: int = 0) -> int:
    """The smallest threshold that stops a coordinator from splitting the sites' views.

    A hostile coordinator can tell one group of honest sites "these survived, those dropped" and
    another group the opposite; each honest site answers (and signs) one view only, while the
    ``c`` colluding sites answer both. It then holds, for some site, ``t`` shares of its
    self-mask seed *and* ``t`` of its mask key (its update in the clear) exactly when two
    disjoint groups of honest holders of ``t - c`` each exist: ``2 (t - c) <= h - c``. So
    ``2 t > h + c`` makes the attack impossible; the least such ``t`` is ``floor((h + c) / 2) + 1``.
    """
    return (num_holders + colluding_sites) // 2 + 1


def secure_threshold(threshold: int | None, num_holders: int, colluding_sites: int = 0) -> int:
    """The Shamir threshold of a secret shared among ``num_holders`` sites: the configured one,
    else the larger of ``default_threshold`` and ``split_view_bound`` (checked by ``check_threshold``)."""
    if threshold is not None:
        return threshold
    return max(default_threshold(num_holders), split_view_bound(num_holders, colluding_sites))


def check_threshold(threshold: int, num_holders: int, colluding_sites: int = 0) -> str:
    """Why ``threshold`` is unsafe or unusable for ``num_holders`` holders, or "" when it is fine."""
    bound = split_view_bound(num_holders, colluding_sites)
    if threshold < bound:
        return (
            f"threshold {threshold} of {num_holders} share holders with {colluding_sites} colluding "
            f"sites assumed lets a hostile coordinator show two groups of sites different survivor "
            f"lists and unmask every update; it must satisfy 2 t > holders + colluding_sites, i.e. "
            f"t >= {bound}"
        )
    if threshold > num_holders:
        return f"threshold {threshold} exceeds the {num_holders} share holders: no secret could be rebuilt"
    return ""


DEFAULT_COLLUDING_SITES: Final = 1
"""Colluding sites assumed when a config says nothing, a site's (``ThresholdPolicy``) and the
coordinator's (``PrivacyConfig``) alike: one site may be on the coordinator's side. The default
thresholds (3 of 4, 4 of 5, 4 of 6, 5 of 7, ...) hold under it; only a 3-site round needs all
three (``split_view_bound(3, 1) = 3``)."""


@dataclass(frozen=True, slots=True)
class ThresholdPolicy:
    """The least Shamir threshold a site accepts, from the site's own settings.

    The coordinator picks a round's threshold and declares the colluding sites it assumes, but a
    hostile coordinator would declare none and pick a threshold just above half the holders:
    with one site on its side it then splits the views (``split_view_bound``) and unmasks every
    honest update (5 sites with ``t = 3``, 7 with ``t = 4``). So each site checks the round's
    threshold against its own assumption, and the coordinator's declaration can only raise it.
    """

    colluding_sites: int = DEFAULT_COLLUDING_SITES
    """Sites this site assumes collude with a hostile coordinator."""
    min_threshold: int | None = None
    """Refuse any round whose threshold is lower, whatever the holders (unset: the bound only)."""

    def __post_init__(self) -> None:
        if self.colluding_sites < 0:
            raise ValueError(f"colluding_sites must be >= 0, got {self.colluding_sites}")
        if self.min_threshold is not None and self.min_threshold < 2:
            raise ValueError(f"min_threshold must be >= 2 or unset, got {self.min_threshold}")

    def minimum(self, num_holders: int, declared_colluding: int = 0) -> int:
        """The least threshold accepted for ``num_holders`` holders: the split-view bound under the
        larger of this site's assumption and the coordinator's declaration, and ``min_threshold``."""
        bound = split_view_bound(num_holders, max(self.colluding_sites, declared_colluding))
        return max(bound, self.min_threshold or 0)

    def refusal(self, threshold: int, num_holders: int, declared_colluding: int = 0) -> str:
        """Why a site refuses a round of ``threshold`` of ``num_holders`` holders in which the
        coordinator declared ``declared_colluding`` colluding sites, or "" when it takes part."""
        if threshold > num_holders:
            return check_threshold(threshold, num_holders)
        least = self.minimum(num_holders, declared_colluding)
        if threshold >= least:
            return ""
        colluding = max(self.colluding_sites, declared_colluding)
        bound = split_view_bound(num_holders, colluding)
        reasons = []
        if threshold < bound:
            reasons.append(
                f"2 t > holders + colluding_sites with colluding_sites = {colluding} (this site assumes "
                f"{self.colluding_sites}, the coordinator declared {declared_colluding}) needs t >= {bound}, "
                "else a hostile coordinator with that many sites on its side can show two groups of "
                "sites different survivor lists and unmask every update"
            )
        if self.min_threshold is not None and threshold < self.min_threshold:
            reasons.append(f"this site's min_threshold is {self.min_threshold}")
        allowed = (
            f"allowed: t = {least}..{num_holders}"
            if least <= num_holders
            else f"no threshold of {num_holders} holders is allowed (this site needs t >= {least})"
        )
        return (
            f"threshold {threshold} of {num_holders} share holders is below what this site accepts: "
            f"{'; '.join(reasons)}; {allowed}. Raise the coordinator's [privacy] threshold (or its "
            "colluding_sites), or lower this site's colluding_sites / min_threshold if that risk "
            "is accepted"
        )


def seed_commitment(seed: bytes, session: str, round_index: int, site: int) -> bytes:
    """SHA-256 commitment to a self-mask seed, signed in the site's advertisement.

    The coordinator checks the seed it rebuilds from unmask answers against it, so a site that
    lies about its share of another site's seed aborts the round instead of silently corrupting
    the sum (shares beyond the first ``t`` are not needed to detect it). The seed is 256 random
    bits, so the hash reveals nothing usable about it.
    """
    fields = [DOMAIN, PURPOSE_SEED_COMMITMENT, session.encode(), str(round_index).encode(), str(site).encode(), seed]
    return hashlib.sha256(b"|".join(fields)).digest()


def public_bytes(key: X25519PublicKey | Ed25519PublicKey) -> bytes:
    """Raw 32-byte encoding of a public key (what travels and what is signed)."""
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def private_bytes(key: X25519PrivateKey) -> bytes:
    """Raw 32-byte encoding of an X25519 private key (what is Shamir-shared)."""
    return key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )


def hkdf(material: bytes, *info: bytes | int | str) -> bytes:
    """A 256-bit key from ``material``, bound to ``DOMAIN`` and each ``info`` item (hashed, in order)."""
    parts = [DOMAIN]
    for item in info:
        if isinstance(item, int):
            parts.append(item.to_bytes(8, "little", signed=True))
        elif isinstance(item, str):
            parts.append(item.encode())
        else:
            parts.append(item)
    info_bytes = b"/".join(hashlib.sha256(p).digest() for p in parts)
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info_bytes).derive(material)


def mask_key(
    material: bytes, session: str, round_index: int, *, pair: tuple[int, int] | None = None, site: int | None = None
) -> bytes:
    """The 256-bit ChaCha20 key of one mask: a pairwise mask (``pair``) or a self-mask (``site``).

    ``material`` is the X25519 shared secret (pairwise) or the self-mask seed ``b_u``; HKDF binds
    the key to the session, round and the (unordered) pair or the site, so no two masks of a run
    share a keystream.
    """
    if (pair is None) == (site is None):
        raise ValueError("mask_key needs exactly one of pair= or site=")
    if pair is not None:
        low, high = sorted(pair)
        return hkdf(material, PURPOSE_PAIR_MASK, session, round_index, low, high)
    return hkdf(material, PURPOSE_SELF_MASK, session, round_index, int(site))  # type: ignore[arg-type]


_ZEROS = bytes(1 << 22)


def keystream(key: bytes, chunk_index: int, nbytes: int) -> bytes:
    """ChaCha20 keystream for one chunk: the nonce carries the chunk index (domain separation)."""
    nonce = b"\x00\x00\x00\x00" + chunk_index.to_bytes(8, "little") + b"mask"
    encryptor = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor()
    if nbytes <= len(_ZEROS):
        return encryptor.update(memoryview(_ZEROS)[:nbytes])
    return encryptor.update(bytes(nbytes))


def keystream_into(key: bytes, chunk_index: int, out: bytearray | memoryview) -> None:
    """``keystream`` written into ``out`` (no allocation; the hot path of masking)."""
    nonce = b"\x00\x00\x00\x00" + chunk_index.to_bytes(8, "little") + b"mask"
    encryptor = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor()
    nbytes = len(out)
    if nbytes > len(_ZEROS):
        out[:] = encryptor.update(bytes(nbytes))
        return
    encryptor.update_into(memoryview(_ZEROS)[:nbytes], out)


def add_masks(keys: Iterable[tuple[bytes, int]], chunk_index: int, target: np.ndarray, *, subtract: bool) -> None:
    """Add (or subtract) ``sign * PRG(key)`` for each key into ``target`` in place, one buffer reused."""
    buffer = bytearray(target.nbytes)
    mask = np.frombuffer(buffer, dtype=target.dtype)
    for key, sign in keys:
        keystream_into(key, chunk_index, buffer)
        if (sign > 0) != subtract:
            target += mask
        else:
            target -= mask


def num_chunks(numel: int, chunk_size: int) -> int:
    """Chunks of ``chunk_size`` values that cover ``numel`` values (the last may be shorter)."""
    return max(1, math.ceil(numel / chunk_size))


def neighbour_graph(
    sites: Iterable[int], mode: NeighbourMode, *, session: str, round_index: int, degree: int | None = None
) -> dict[int, frozenset[int]]:
    """Who masks with whom: everyone (``"full"``), or a random ``k``-regular circulant (``"secagg+"``).

    SecAgg+ places the sites on a ring in an order every party derives from (session, round,
    sites) and links each to its ``k/2`` nearest on either side, ``k = 2 ceil(log2 n)`` by default,
    so per-site cost grows with ``log n`` and total cost with ``n log n``.
    """
    return _neighbour_graph(tuple(sorted(set(sites))), mode, session, round_index, degree)


@functools.lru_cache(maxsize=16)
def _neighbour_graph(
    ordered_sites: tuple[int, ...], mode: NeighbourMode, session: str, round_index: int, degree: int | None
) -> dict[int, frozenset[int]]:
    """``neighbour_graph`` of sorted sites, built once per round: every party of a round in one
    process (the simulator) derives the same graph, which is O(n log n) to build. Shared between
    callers, so nobody may change it."""
    ordered = list(ordered_sites)
    n = len(ordered)
    if mode == "full":
        return {u: frozenset(v for v in ordered if v != u) for u in ordered}
    if mode != "secagg+":
        raise ValueError(f"unknown neighbour mode {mode!r}; choose 'full' or 'secagg+'")
    k = degree if degree is not None else 2 * math.ceil(math.log2(max(n, 2)))
    if k >= n - 1:
        return {u: frozenset(v for v in ordered if v != u) for u in ordered}
    seed = hashlib.sha256(f"{session}/{round_index}/{ordered}".encode()).digest()
    ring = list(ordered)
    random.Random(seed).shuffle(ring)
    half = max(1, k // 2)
    graph: dict[int, set[int]] = {u: set() for u in ordered}
    for p, u in enumerate(ring):
        for d in range(1, half + 1):
            v = ring[(p + d) % n]
            graph[u].add(v)
            graph[v].add(u)
    return {u: frozenset(vs) for u, vs in graph.items()}


@functools.lru_cache(maxsize=1 << 16)
def site_index(name: str) -> int:
    """The protocol's integer id of a named site: 32 bits of SHA-256 of the name.

    Both sides compute it without a round trip; a collision between two names of one run (odds
    about 1 in 4e9 per pair) is detected by the coordinator, which refuses the second site.
    Remembered: every site maps every survivor's name every round, N² hashes a round at N sites.
    """
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big")

"""Secure aggregation: the coordinator learns the sum of the sites' integer vectors, never one site's.

Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine Learning", CCS 2017,
with the optional sparse neighbour graph of Bell et al., "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead", CCS 2020 ("SecAgg+"). Split the way Flower splits it: pure crypto
helpers (this module's functions), a site's state machine (``SecAggClient``) and the coordinator's
workflow (``SecAggServer``), with the protocol stages as named constants. No I/O: the coordinator
and site agent move these dataclasses over gRPC, the simulator passes them in memory.

One round, for sites ``U``:

1. ``STAGE_ADVERTISE_KEYS`` — each site makes two X25519 key pairs (``c`` to encrypt shares,
   ``s`` for pairwise masks) and signs ``(session, round, site, c_pk, s_pk)`` with its Ed25519
   identity key. The coordinator relays all advertisements; a site refuses the round if any
   signature fails (key substitution), names another session or round (replay), or its own
   advertisement was altered.
2. ``STAGE_SHARE_KEYS`` — each site draws a self-mask seed ``b_u`` and Shamir-shares ``b_u`` and
   its ``s`` private key among its holders (its neighbours and itself, threshold ``t``); each share
   is encrypted with AES-GCM under an ECDH(``c``) + HKDF key bound to (session, round, sender,
   recipient).
3. ``STAGE_MASKED_INPUT`` — ``y_u = x_u + PRG(b_u) + Σ_v ±PRG(s_uv)  (mod 2^b)`` over the
   neighbours ``v`` that shared keys, ``+`` when ``u < v``. Masks are ChaCha20 keystream (from
   ``cryptography``) generated **chunk by chunk** as the upload streams, from a 256-bit HKDF key
   with domain separation by session, round, pair (or site for the self-mask) and chunk (nonce).
   The coordinator adds each arriving chunk into one aggregate buffer and keeps no site's vector.
4. ``STAGE_CONSISTENCY`` — the coordinator tells the sites which of them uploaded (``survivors``);
   each signs that list. An unmask request must carry at least ``t`` such signatures, so the
   coordinator cannot tell different sites different survivor sets.
5. ``STAGE_UNMASK`` — a site returns, for every survivor, its share of ``b_u`` and for every
   dropped site its share of ``s_u`` — never both for one site, and only once per round. With
   ``t`` answers the coordinator removes the self-masks of survivors and the pairwise masks the
   survivors shared with dropped sites: the exact integer sum is left. Fewer than ``t`` answers:
   ``SecAggAbort``, nothing is revealed.

Honest sites raise ``SecAggViolation`` (with the reason) on any detected misbehaviour. With fewer
than 3 sites a sum reveals the other site's input to each of them, so a round needs at least
``MIN_SITES``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import math
import os
import random
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

import numpy as np
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from geoloco.algorithms import shamir
from geoloco.algorithms.fixed_point import MODULUS_DTYPES

__all__ = [
    "MIN_SITES",
    "STAGE_ADVERTISE_KEYS",
    "STAGE_CONSISTENCY",
    "STAGE_MASKED_INPUT",
    "STAGE_SHARE_KEYS",
    "STAGE_UNMASK",
    "STAGE_UNMASK_RESPONSE",
    "STAGES",
    "EncryptedShare",
    "KeyAdvertisement",
    "NeighbourMode",
    "RoundContext",
    "SecAggAbort",
    "SecAggClient",
    "SecAggServer",
    "SecAggViolation",
    "UnmaskRequest",
    "UnmaskResponse",
    "default_threshold",
    "keystream",
    "keystream_into",
    "message_from_bytes",
    "message_to_bytes",
    "pack_messages",
    "site_index",
    "unpack_messages",
    "mask_key",
    "neighbour_graph",
    "num_chunks",
    "public_bytes",
    "run_round_in_memory",
]

STAGE_ADVERTISE_KEYS: Final = "advertise_keys"
STAGE_SHARE_KEYS: Final = "share_keys"
STAGE_MASKED_INPUT: Final = "masked_input"
STAGE_CONSISTENCY: Final = "consistency"
STAGE_UNMASK: Final = "unmask"
_STAGE_DONE: Final = "done"
STAGE_UNMASK_RESPONSE: Final = "unmask_response"
"""Wire-only stage: a site hands in its ``UnmaskResponse`` (the answer to ``STAGE_UNMASK``)."""
STAGES: Final = (
    STAGE_ADVERTISE_KEYS,
    STAGE_SHARE_KEYS,
    STAGE_MASKED_INPUT,
    STAGE_CONSISTENCY,
    STAGE_UNMASK,
    STAGE_UNMASK_RESPONSE,
)

MIN_SITES: Final = 3
"""With 2 sites, each learns the other's input from the sum; secure aggregation needs at least 3."""

NeighbourMode = Literal["full", "secagg+"]

_DOMAIN: Final = b"geoloco-secagg/v1"
_PURPOSE_PAIR_MASK: Final = b"pair-mask"
_PURPOSE_SELF_MASK: Final = b"self-mask"
_PURPOSE_SHARE_KEY: Final = b"share-encryption"
_SHARE_PLAINTEXT: Final = struct.Struct("<II")

RandomBytes = Callable[[int], bytes]


class SecAggViolation(ValueError):
    """An honest party detected misbehaviour (substituted key, replay, double-share request...)."""


class SecAggAbort(RuntimeError):
    """The round cannot complete securely (too few sites left); nothing was revealed."""


# --------------------------------------------------------------------------------------------
# Pure helpers


def default_threshold(num_holders: int) -> int:
    """About two thirds of the share holders (at least 2): ``ceil(2 n / 3)``."""
    return max(2, math.ceil(2 * num_holders / 3))


def public_bytes(key: X25519PublicKey | Ed25519PublicKey) -> bytes:
    """Raw 32-byte encoding of a public key (what travels and what is signed)."""
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )


def _hkdf(material: bytes, *info: bytes | int | str) -> bytes:
    parts = [_DOMAIN]
    for item in info:
        if isinstance(item, int):
            parts.append(item.to_bytes(8, "little", signed=True))
        elif isinstance(item, str):
            parts.append(item.encode())
        else:
            parts.append(item)
    info_bytes = b"/".join(hashlib.sha256(p).digest() for p in parts)
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info_bytes).derive(material)


def mask_key(material: bytes, session: str, round_index: int, *, pair: tuple[int, int] | None = None, site: int | None = None) -> bytes:
    """The 256-bit ChaCha20 key of one mask: a pairwise mask (``pair``) or a self-mask (``site``).

    ``material`` is the X25519 shared secret (pairwise) or the self-mask seed ``b_u``; HKDF binds
    the key to the session, round and the (unordered) pair or the site, so no two masks of a run
    share a keystream.
    """
    if (pair is None) == (site is None):
        raise ValueError("mask_key needs exactly one of pair= or site=")
    if pair is not None:
        low, high = sorted(pair)
        return _hkdf(material, _PURPOSE_PAIR_MASK, session, round_index, low, high)
    return _hkdf(material, _PURPOSE_SELF_MASK, session, round_index, int(site))  # type: ignore[arg-type]


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


def _masks(keys: Iterable[tuple[bytes, int]], chunk_index: int, target: np.ndarray, *, subtract: bool) -> None:
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
    ordered = sorted(set(sites))
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


# --------------------------------------------------------------------------------------------
# Messages


@dataclass(frozen=True, slots=True)
class RoundContext:
    """What every party of a secure round agrees on before it starts."""

    session: str
    """Identifies the run (e.g. the coordinator's run id): messages of another run are replays."""
    round_index: int
    """The training round: messages of another round are replays."""
    numel: int
    """Values each site uploads (the model size, or ``k`` for random-k)."""
    modulus_bits: int = 32
    """``b`` of ``Z_{2^b}`` (8, 16 or 32)."""
    chunk_size: int = 1 << 18
    """Values per upload chunk (and per mask keystream)."""
    neighbours: NeighbourMode = "full"
    """Pairwise masks with every site, or the SecAgg+ sparse graph."""
    threshold: int | None = None
    """Shares needed to reconstruct a secret; ``None``: ``default_threshold`` of the holders."""

    def __post_init__(self) -> None:
        if self.modulus_bits not in MODULUS_DTYPES:
            raise ValueError(f"modulus_bits must be one of {sorted(MODULUS_DTYPES)}, got {self.modulus_bits}")
        if self.numel < 1 or self.chunk_size < 1:
            raise ValueError(f"numel ({self.numel}) and chunk_size ({self.chunk_size}) must be >= 1")
        if self.threshold is not None and self.threshold < 2:
            raise ValueError(f"threshold must be >= 2 (or unset for about 2/3), got {self.threshold}")

    def threshold_for(self, num_holders: int) -> int:
        """The Shamir threshold for a secret shared among ``num_holders`` sites."""
        return self.threshold if self.threshold is not None else default_threshold(num_holders)

    def chunk_bounds(self, chunk_index: int) -> tuple[int, int]:
        start = chunk_index * self.chunk_size
        if not 0 <= start < self.numel:
            raise ValueError(
                f"chunk {chunk_index} is outside the {num_chunks(self.numel, self.chunk_size)} chunks "
                f"of {self.numel} values"
            )
        return start, min(self.numel, start + self.chunk_size)


@dataclass(frozen=True, slots=True)
class KeyAdvertisement:
    """A site's two X25519 public keys for one round, signed with its Ed25519 identity key."""

    site: int
    session: str
    round_index: int
    cipher_public_key: bytes
    mask_public_key: bytes
    signature: bytes

    def signed_bytes(self) -> bytes:
        return _advert_bytes(self.session, self.round_index, self.site, self.cipher_public_key, self.mask_public_key)


def _advert_bytes(session: str, round_index: int, site: int, cpk: bytes, spk: bytes) -> bytes:
    return b"|".join(
        [_DOMAIN, STAGE_ADVERTISE_KEYS.encode(), session.encode(), str(round_index).encode(), str(site).encode(), cpk, spk]
    )


def _survivors_bytes(session: str, round_index: int, survivors: Sequence[int]) -> bytes:
    return b"|".join(
        [_DOMAIN, STAGE_CONSISTENCY.encode(), session.encode(), str(round_index).encode(), ",".join(map(str, sorted(survivors))).encode()]
    )


@dataclass(frozen=True, slots=True)
class EncryptedShare:
    """The shares of ``sender``'s two secrets held by ``recipient``, AES-GCM encrypted for it."""

    sender: int
    recipient: int
    round_index: int
    ciphertext: bytes


@dataclass(frozen=True, slots=True)
class UnmaskRequest:
    """Which sites uploaded (their self-masks go) and which dropped (their pairwise masks go)."""

    round_index: int
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]
    signatures: Mapping[int, bytes]
    """Survivors' Ed25519 signatures over the survivor list (``STAGE_CONSISTENCY``)."""


@dataclass(frozen=True, slots=True)
class UnmaskResponse:
    """One site's answer: its shares of survivors' self-mask seeds and of dropped sites' mask keys."""

    site: int
    round_index: int
    self_mask_shares: Mapping[int, bytes]
    mask_key_shares: Mapping[int, bytes]


_MESSAGE_TYPES: dict[str, type] = {}


def _message_types() -> dict[str, type]:
    if not _MESSAGE_TYPES:
        for cls in (KeyAdvertisement, EncryptedShare, UnmaskRequest, UnmaskResponse):
            _MESSAGE_TYPES[cls.__name__] = cls
    return _MESSAGE_TYPES


def message_to_bytes(message: KeyAdvertisement | EncryptedShare | UnmaskRequest | UnmaskResponse) -> bytes:
    """A protocol message as self-describing JSON bytes (for a ``bytes`` field of a transport message).

    Integrity does not rest on this encoding: advertisements and survivor lists are signed and
    shares are AEAD-encrypted, so a tampered message is refused by the state machines.
    """
    name = type(message).__name__
    if name not in _message_types():
        raise TypeError(f"not a secure-aggregation message: {name}; allowed: {', '.join(_message_types())}")
    body: dict[str, object] = {}
    for f in dataclasses.fields(message):  # type: ignore[arg-type]
        value = getattr(message, f.name)
        if isinstance(value, bytes):
            value = {"b64": base64.b64encode(value).decode()}
        elif isinstance(value, Mapping):
            value = {"map": {str(k): base64.b64encode(v).decode() for k, v in value.items()}}
        elif isinstance(value, tuple):
            value = list(value)
        body[f.name] = value
    return json.dumps({"type": name, "body": body}, sort_keys=True).encode()


def message_from_bytes(data: bytes) -> KeyAdvertisement | EncryptedShare | UnmaskRequest | UnmaskResponse:
    """Inverse of ``message_to_bytes``; raises ``ValueError`` naming what is malformed."""
    try:
        raw = json.loads(data)
        cls = _message_types()[raw["type"]]
        kwargs: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            value = raw["body"][f.name]
            if isinstance(value, dict) and "b64" in value:
                value = base64.b64decode(value["b64"], validate=True)
            elif isinstance(value, dict) and "map" in value:
                value = {int(k): base64.b64decode(v, validate=True) for k, v in value["map"].items()}
            elif isinstance(value, list):
                value = tuple(int(v) for v in value)
            kwargs[f.name] = value
        return cls(**kwargs)  # type: ignore[no-any-return]
    except (KeyError, TypeError, ValueError, binascii.Error) as err:
        raise ValueError(f"malformed secure-aggregation message: {err!r}") from None


def site_index(name: str) -> int:
    """The protocol's integer id of a named site: 32 bits of SHA-256 of the name.

    Both sides compute it without a round trip; a collision between two names of one run (odds
    about 1 in 4e9 per pair) is detected by the coordinator, which refuses the second site.
    """
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big")


def pack_messages(messages: Iterable[object]) -> bytes:
    """Several protocol messages (or raw bytes, e.g. signatures) as one payload."""
    items = []
    for m in messages:
        data = m if isinstance(m, bytes) else message_to_bytes(m)  # type: ignore[arg-type]
        items.append(base64.b64encode(data).decode())
    return json.dumps(items).encode()


def unpack_messages(data: bytes, *, raw: bool = False) -> list:  # type: ignore[type-arg]
    """Inverse of ``pack_messages``; ``raw`` returns the bytes without decoding messages."""
    try:
        items = [base64.b64decode(x, validate=True) for x in json.loads(data or b"[]")]
    except (TypeError, ValueError, binascii.Error) as err:
        raise ValueError(f"malformed secure-aggregation payload: {err!r}") from None
    return items if raw else [message_from_bytes(x) for x in items]


# --------------------------------------------------------------------------------------------
# Site state machine


@dataclass(slots=True)
class _Peer:
    cipher_public_key: X25519PublicKey
    mask_public_key: X25519PublicKey


class SecAggClient:
    """One site's side of one secure round; methods must be called in stage order.

    ``identities`` maps every site id to its Ed25519 identity public key (bound to its TLS
    certificate by the deployment), which is what makes key substitution detectable. ``random_bytes``
    is the entropy source (``os.urandom``); tests pass a seeded one for reproducible statistics.
    """

    def __init__(
        self,
        site: int,
        context: RoundContext,
        identity_key: Ed25519PrivateKey,
        identities: Mapping[int, Ed25519PublicKey],
        *,
        random_bytes: RandomBytes = os.urandom,
    ) -> None:
        if site not in identities:
            raise ValueError(f"site {site} has no identity key among {sorted(identities)}")
        self.site = site
        self.context = context
        self.stage = STAGE_ADVERTISE_KEYS
        self._identity = identity_key
        self._identities = dict(identities)
        self._random = random_bytes
        self._cipher_key = X25519PrivateKey.from_private_bytes(random_bytes(32))
        self._mask_key = X25519PrivateKey.from_private_bytes(random_bytes(32))
        self._self_seed = random_bytes(32)
        self._advertisement: KeyAdvertisement | None = None
        self._peers: dict[int, _Peer] = {}
        self._graph: dict[int, frozenset[int]] = {}
        self._own_shares: tuple[bytes, bytes] | None = None
        self._held: dict[int, tuple[bytes, bytes]] = {}
        self._mask_keys: list[tuple[bytes, int]] = []
        self._self_key = b""
        self._survivors: tuple[int, ...] | None = None
        self._uploaded = False

    def _expect(self, stage: str) -> None:
        if self.stage != stage:
            raise SecAggViolation(
                f"site {self.site}, round {self.context.round_index}: got a {stage} message while "
                f"at stage {self.stage}; out-of-order or repeated protocol messages are refused"
            )

    def _check_round(self, round_index: int, what: str) -> None:
        if round_index != self.context.round_index:
            raise SecAggViolation(
                f"site {self.site}: {what} is for round {round_index}, this is round "
                f"{self.context.round_index}; refusing a replayed message"
            )

    def add_identities(self, identities: Mapping[int, Ed25519PublicKey]) -> None:
        """Learn other sites' verified identity keys (before ``share_keys``); never replace one."""
        if self.stage not in (STAGE_ADVERTISE_KEYS, STAGE_SHARE_KEYS):
            raise SecAggViolation(f"site {self.site}: identities arrive before keys are shared")
        for site, key in identities.items():
            known = self._identities.get(site)
            if known is not None and public_bytes(known) != public_bytes(key):
                raise SecAggViolation(f"site {self.site}: a second identity key for site {site} was offered")
            self._identities[site] = key

    # stage 1
    def advertise(self) -> KeyAdvertisement:
        self._expect(STAGE_ADVERTISE_KEYS)
        c = self.context
        cpk = public_bytes(self._cipher_key.public_key())
        spk = public_bytes(self._mask_key.public_key())
        signature = self._identity.sign(_advert_bytes(c.session, c.round_index, self.site, cpk, spk))
        self._advertisement = KeyAdvertisement(self.site, c.session, c.round_index, cpk, spk, signature)
        self.stage = STAGE_SHARE_KEYS
        return self._advertisement

    # stage 2
    def share_keys(self, advertisements: Sequence[KeyAdvertisement]) -> list[EncryptedShare]:
        """Verify every advertisement, then Shamir-share ``b_u`` and ``s_u`` encrypted per holder."""
        self._expect(STAGE_SHARE_KEYS)
        c = self.context
        seen: set[int] = set()
        for ad in advertisements:
            if ad.site in seen:
                raise SecAggViolation(f"site {self.site}: two advertisements for site {ad.site}")
            seen.add(ad.site)
            if ad.session != c.session:
                raise SecAggViolation(
                    f"site {self.site}: advertisement of site {ad.site} is from session "
                    f"{ad.session!r}, not {c.session!r}; refusing a replayed message"
                )
            self._check_round(ad.round_index, f"the advertisement of site {ad.site}")
            identity = self._identities.get(ad.site)
            if identity is None:
                raise SecAggViolation(f"site {self.site}: advertisement from unknown site {ad.site}")
            try:
                identity.verify(ad.signature, ad.signed_bytes())
            except InvalidSignature:
                raise SecAggViolation(
                    f"site {self.site}: the keys advertised for site {ad.site} are not signed by its "
                    "identity key; the coordinator substituted or corrupted them"
                ) from None
            self._peers[ad.site] = _Peer(
                X25519PublicKey.from_public_bytes(ad.cipher_public_key),
                X25519PublicKey.from_public_bytes(ad.mask_public_key),
            )
        if self._advertisement not in advertisements:
            raise SecAggViolation(f"site {self.site}: its own advertisement is missing or altered")
        if len(seen) < MIN_SITES:
            raise SecAggAbort(
                f"only {len(seen)} sites advertised keys; secure aggregation needs at least "
                f"{MIN_SITES} (with 2, the sum reveals the other site's update)"
            )
        self._graph = neighbour_graph(seen, c.neighbours, session=c.session, round_index=c.round_index)
        holders = self._graph[self.site] | {self.site}
        t = c.threshold_for(len(holders))
        if len(holders) < t:
            raise SecAggAbort(f"only {len(holders)} share holders for threshold {t}")
        b_shares = shamir.split(self._self_seed, holders, t)
        s_shares = shamir.split(_private_bytes(self._mask_key), holders, t)
        self._own_shares = (b_shares[self.site], s_shares[self.site])
        out = []
        for v in sorted(holders - {self.site}):
            plaintext = _SHARE_PLAINTEXT.pack(self.site, v) + b_shares[v] + s_shares[v]
            out.append(EncryptedShare(self.site, v, c.round_index, self._seal(v, self.site, v, plaintext)))
        self.stage = STAGE_MASKED_INPUT
        return out

    def _share_cipher(self, peer: int, sender: int, recipient: int) -> tuple[AESGCM, bytes, bytes]:
        c = self.context
        secret = self._cipher_key.exchange(self._peers[peer].cipher_public_key)
        key = _hkdf(secret, _PURPOSE_SHARE_KEY, c.session, c.round_index, min(sender, recipient), max(sender, recipient))
        nonce = _SHARE_PLAINTEXT.pack(sender, recipient) + b"\x00" * 4
        aad = _DOMAIN + c.session.encode() + struct.pack("<qII", c.round_index, sender, recipient)
        return AESGCM(key), nonce, aad

    def _seal(self, peer: int, sender: int, recipient: int, plaintext: bytes) -> bytes:
        aead, nonce, aad = self._share_cipher(peer, sender, recipient)
        return aead.encrypt(nonce, plaintext, aad)

    # stage 3
    def receive_shares(self, shares: Sequence[EncryptedShare]) -> None:
        """Decrypt the shares addressed to this site; their senders are the neighbours that mask."""
        self._expect(STAGE_MASKED_INPUT)
        if self._held:
            raise SecAggViolation(f"site {self.site}: shares were already delivered this round")
        for share in shares:
            self._check_round(share.round_index, f"the share from site {share.sender}")
            if share.recipient != self.site or share.sender not in self._graph.get(self.site, ()):
                raise SecAggViolation(
                    f"site {self.site}: got a share from {share.sender} for {share.recipient}, "
                    "which is not a neighbour's share for this site"
                )
            if share.sender in self._held:
                raise SecAggViolation(f"site {self.site}: two shares from site {share.sender}")
            aead, nonce, aad = self._share_cipher(share.sender, share.sender, self.site)
            try:
                plaintext = aead.decrypt(nonce, share.ciphertext, aad)
            except InvalidTag:
                raise SecAggViolation(
                    f"site {self.site}: the share from site {share.sender} fails authentication "
                    "(tampered, or encrypted for another round or session)"
                ) from None
            sender, recipient = _SHARE_PLAINTEXT.unpack_from(plaintext)
            if (sender, recipient) != (share.sender, self.site):
                raise SecAggViolation(f"site {self.site}: share routing fields were altered")
            n = shamir.SHARE_NBYTES
            body = plaintext[_SHARE_PLAINTEXT.size :]
            self._held[share.sender] = (body[:n], body[n : 2 * n])
        c = self.context
        self._mask_keys = []
        for v in sorted(self._held):
            secret = self._mask_key.exchange(self._peers[v].mask_public_key)
            sign = 1 if self.site < v else -1
            self._mask_keys.append((mask_key(secret, c.session, c.round_index, pair=(self.site, v)), sign))
        self._self_key = mask_key(self._self_seed, c.session, c.round_index, site=self.site)

    @property
    def masking_neighbours(self) -> list[int]:
        """The neighbours whose pairwise masks this site adds (those that shared keys with it)."""
        return sorted(self._held)

    def mask_chunk(self, chunk_index: int, values: np.ndarray | Sequence[int]) -> bytes:
        """``y = x + PRG(b_u) + Σ ±PRG(s_uv)`` for one chunk, packed at the modulus width.

        ``values`` are the chunk's integers (any integer dtype; reduced mod ``2^b``). Memory is
        O(chunk): each mask is generated for this chunk only and added in place.
        """
        if self.stage != STAGE_MASKED_INPUT or not self._self_key:
            raise SecAggViolation(f"site {self.site}: mask_chunk before the shares were received")
        c = self.context
        start, stop = c.chunk_bounds(chunk_index)
        values = np.asarray(values)
        if values.shape != (stop - start,):
            raise ValueError(f"chunk {chunk_index} must hold {stop - start} values, got shape {values.shape}")
        dtype = MODULUS_DTYPES[c.modulus_bits]
        out = values.astype(dtype)  # C cast: wraps modulo 2^b, as modular arithmetic needs
        _masks([(self._self_key, 1), *self._mask_keys], chunk_index, out, subtract=False)
        return out.tobytes()

    def masked_chunks(self, chunks: Iterable[np.ndarray]) -> Iterator[tuple[int, bytes]]:
        """``(chunk_index, masked bytes)`` for each integer chunk, in order; marks the upload done."""
        count = 0
        for index, values in enumerate(chunks):
            yield index, self.mask_chunk(index, values)
            count += 1
        expected = num_chunks(self.context.numel, self.context.chunk_size)
        if count != expected:
            raise ValueError(f"the upload had {count} chunks, expected {expected}")
        self.finish_upload()

    def finish_upload(self) -> None:
        self._expect(STAGE_MASKED_INPUT)
        self._uploaded = True
        self.stage = STAGE_CONSISTENCY

    # stage 4
    def sign_survivors(self, round_index: int, survivors: Sequence[int]) -> bytes:
        """Sign the survivor list (once); the unmask request must carry the same list."""
        self._expect(STAGE_CONSISTENCY)
        self._check_round(round_index, "the survivor list")
        self._check_survivors(survivors)
        self._survivors = tuple(sorted(survivors))
        self.stage = STAGE_UNMASK
        return self._identity.sign(_survivors_bytes(self.context.session, round_index, self._survivors))

    def _check_survivors(self, survivors: Sequence[int]) -> None:
        if self.site not in survivors:
            raise SecAggViolation(
                f"site {self.site} uploaded its masked input but is not listed as a survivor; "
                "answering would let the coordinator strip its masks"
            )
        if len(set(survivors)) != len(survivors) or not set(survivors) <= set(self._peers):
            raise SecAggViolation(f"site {self.site}: invalid survivor list {list(survivors)}")
        t = self.context.threshold_for(len(self._graph[self.site]) + 1)
        if len(survivors) < t:
            raise SecAggViolation(
                f"site {self.site}: only {len(survivors)} survivors, below the threshold {t}; "
                "refusing to reveal shares"
            )

    # stage 5
    def unmask(self, request: UnmaskRequest) -> UnmaskResponse:
        """Reveal shares for the request, after checking it cannot unmask any single site."""
        self._expect(STAGE_UNMASK)
        c = self.context
        self._check_round(request.round_index, "the unmask request")
        survivors, dropped = set(request.survivors), set(request.dropped)
        both = survivors & dropped
        if both:
            raise SecAggViolation(
                f"site {self.site}: the coordinator asked for both the self-mask share and the "
                f"mask-key share of site(s) {sorted(both)}, which would unmask their input; refusing"
            )
        if tuple(sorted(survivors)) != self._survivors:
            raise SecAggViolation(
                f"site {self.site}: unmask request lists survivors {sorted(survivors)} but this site "
                f"signed {list(self._survivors or ())}; refusing"
            )
        message = _survivors_bytes(c.session, c.round_index, self._survivors)
        valid = 0
        for signer, signature in request.signatures.items():
            if signer not in survivors:
                continue
            try:
                self._identities[signer].verify(signature, message)
                valid += 1
            except (InvalidSignature, KeyError):
                raise SecAggViolation(
                    f"site {self.site}: survivor-list signature of site {signer} is invalid"
                ) from None
        t = c.threshold_for(len(self._graph[self.site]) + 1)
        if valid < t:
            raise SecAggViolation(
                f"site {self.site}: the unmask request carries {valid} valid survivor signatures, "
                f"fewer than the threshold {t}; refusing"
            )
        if not dropped <= set(self._peers):
            raise SecAggViolation(f"site {self.site}: unknown dropped sites {sorted(dropped - set(self._peers))}")
        held = dict(self._held)
        assert self._own_shares is not None
        held[self.site] = self._own_shares
        self_shares = {u: held[u][0] for u in sorted(survivors) if u in held}
        key_shares = {u: held[u][1] for u in sorted(dropped) if u in held}
        self.stage = _STAGE_DONE
        return UnmaskResponse(self.site, c.round_index, self_shares, key_shares)


# --------------------------------------------------------------------------------------------
# Coordinator workflow


@dataclass(slots=True)
class _Upload:
    chunks: dict[int, int] = field(default_factory=dict)
    """chunk index -> CRC-32 of the masked bytes (a resent identical chunk is ignored), never values."""


class SecAggServer:
    """The coordinator's side of one secure round: relays keys and shares, sums masked chunks.

    It holds one aggregate buffer in ``Z_{2^b}`` and digests of received chunks, never a site's
    vector (masked or not). ``result()`` is the exact integer sum of the survivors' inputs.
    """

    def __init__(self, context: RoundContext) -> None:
        self.context = context
        self.stage = STAGE_ADVERTISE_KEYS
        self._ads: dict[int, KeyAdvertisement] = {}
        self._graph: dict[int, frozenset[int]] = {}
        self._mailbox: dict[int, list[EncryptedShare]] = {}
        self._shared: set[int] = set()
        self._uploads: dict[int, _Upload] = {}
        self._aggregate: np.ndarray | None = None
        self._survivors: tuple[int, ...] = ()
        self._dropped: tuple[int, ...] = ()
        self._signatures: dict[int, bytes] = {}
        self._responses: dict[int, UnmaskResponse] = {}
        self._chunks = num_chunks(context.numel, context.chunk_size)

    def _expect(self, *stages: str) -> None:
        if self.stage not in stages:
            raise ValueError(f"secure aggregation: expected stage {' or '.join(stages)}, at {self.stage}")

    # stage 1
    def receive_advertisement(self, ad: KeyAdvertisement) -> None:
        self._expect(STAGE_ADVERTISE_KEYS)
        if ad.round_index != self.context.round_index or ad.session != self.context.session:
            raise SecAggViolation(f"advertisement of site {ad.site} is for another round or session")
        self._ads[ad.site] = ad

    def advertisements(self) -> list[KeyAdvertisement]:
        """Close key advertisement and return what every site must receive (U1)."""
        if self.stage == STAGE_ADVERTISE_KEYS:
            if len(self._ads) < MIN_SITES:
                raise SecAggAbort(
                    f"only {len(self._ads)} sites advertised keys; secure aggregation needs at "
                    f"least {MIN_SITES}, skipping the round"
                )
            c = self.context
            self._graph = neighbour_graph(self._ads, c.neighbours, session=c.session, round_index=c.round_index)
            self.stage = STAGE_SHARE_KEYS
        return [self._ads[s] for s in sorted(self._ads)]

    # stage 2
    def receive_shares(self, sender: int, shares: Sequence[EncryptedShare]) -> None:
        self._expect(STAGE_SHARE_KEYS)
        if sender not in self._ads:
            raise ValueError(f"site {sender} sent shares without advertising keys")
        expected = self._graph[sender]
        recipients = {s.recipient for s in shares}
        if any(s.sender != sender for s in shares) or recipients != set(expected) or len(shares) != len(expected):
            raise ValueError(f"site {sender} must send one share to each of its neighbours {sorted(expected)}")
        self._shared.add(sender)
        for share in shares:
            self._mailbox.setdefault(share.recipient, []).append(share)

    def close_share_keys(self) -> list[int]:
        """Freeze U2 (sites that shared keys); those are the only ones that may upload."""
        self._expect(STAGE_SHARE_KEYS)
        if len(self._shared) < MIN_SITES:
            raise SecAggAbort(f"only {len(self._shared)} sites shared keys; need at least {MIN_SITES}")
        self.stage = STAGE_MASKED_INPUT
        return sorted(self._shared)

    def shares_for(self, site: int) -> list[EncryptedShare]:
        self._expect(STAGE_MASKED_INPUT)
        return [s for s in self._mailbox.get(site, []) if s.sender in self._shared]

    # stage 3
    def receive_masked_chunk(self, site: int, chunk_index: int, data: bytes) -> None:
        """Add one masked chunk into the aggregate; a resent identical chunk is ignored."""
        self._expect(STAGE_MASKED_INPUT)
        if site not in self._shared:
            raise ValueError(f"site {site} did not share keys this round and cannot upload")
        c = self.context
        start, stop = c.chunk_bounds(chunk_index)
        digest = zlib.crc32(data)
        upload = self._uploads.setdefault(site, _Upload())
        previous = upload.chunks.get(chunk_index)
        if previous is not None:
            if previous != digest:
                raise ValueError(f"site {site} resent chunk {chunk_index} with different bytes")
            return
        dtype = MODULUS_DTYPES[c.modulus_bits]
        if len(data) != (stop - start) * dtype.itemsize:
            raise ValueError(
                f"site {site} chunk {chunk_index}: {len(data)} bytes, expected {(stop - start) * dtype.itemsize}"
            )
        if self._aggregate is None:
            self._aggregate = np.zeros(c.numel, dtype=dtype)
        self._aggregate[start:stop] += np.frombuffer(data, dtype=dtype)
        upload.chunks[chunk_index] = digest

    def uploaded(self) -> list[int]:
        return sorted(s for s, u in self._uploads.items() if len(u.chunks) == self._chunks)

    def close_upload(self) -> list[int]:
        """Freeze U3 (complete uploads) and return it; every survivor must sign it."""
        self._expect(STAGE_MASKED_INPUT)
        incomplete = set(self._uploads) - set(self.uploaded())
        if incomplete:
            # A partial upload cannot be subtracted chunk-wise without its masks; the round
            # only survives if those sites are treated as complete-or-absent, so refuse.
            raise SecAggAbort(f"sites {sorted(incomplete)} uploaded only part of their input; aborting the round")
        self._survivors = tuple(self.uploaded())
        self._dropped = tuple(sorted(self._shared - set(self._survivors)))
        self._check_enough(len(self._survivors), "uploaded")
        self.stage = STAGE_CONSISTENCY
        return list(self._survivors)

    def _check_enough(self, count: int, what: str) -> None:
        holders = min(len(self._graph[s]) + 1 for s in self._shared)
        t = self.context.threshold_for(holders)
        if count < max(t, MIN_SITES):
            raise SecAggAbort(
                f"only {count} sites {what}; the threshold is {t} (and at least {MIN_SITES}): "
                "the round is aborted and nothing is revealed"
            )

    # stage 4
    def receive_signature(self, site: int, signature: bytes) -> None:
        self._expect(STAGE_CONSISTENCY)
        if site not in self._survivors:
            raise ValueError(f"site {site} is not a survivor")
        self._signatures[site] = signature

    def unmask_request(self) -> UnmaskRequest:
        self._expect(STAGE_CONSISTENCY, STAGE_UNMASK)
        self._check_enough(len(self._signatures), "signed the survivor list")
        self.stage = STAGE_UNMASK
        return UnmaskRequest(self.context.round_index, self._survivors, self._dropped, dict(self._signatures))

    # stage 5
    def receive_unmask(self, response: UnmaskResponse) -> None:
        self._expect(STAGE_UNMASK)
        if response.round_index != self.context.round_index or response.site not in self._survivors:
            raise ValueError(f"unexpected unmask response from site {response.site}")
        self._responses[response.site] = response

    def result(self) -> np.ndarray:
        """The exact sum of the survivors' inputs in ``Z_{2^b}`` (lift it to signed values)."""
        self._expect(STAGE_UNMASK)
        assert self._aggregate is not None
        c = self.context
        total = self._aggregate
        dtype = total.dtype
        pair_keys: list[tuple[bytes, int]] = []
        self_keys: list[bytes] = []
        for u in self._survivors:
            seed = shamir.reconstruct(self._collect(u, self_mask=True), self._threshold(u))
            self_keys.append(mask_key(seed, c.session, c.round_index, site=u))
        for u in self._dropped:
            private = shamir.reconstruct(self._collect(u, self_mask=False), self._threshold(u))
            key = X25519PrivateKey.from_private_bytes(private)
            if public_bytes(key.public_key()) != self._ads[u].mask_public_key:
                raise SecAggAbort(f"reconstructed mask key of site {u} does not match its advertisement")
            for v in sorted(self._graph[u] & set(self._survivors)):
                secret = key.exchange(X25519PublicKey.from_public_bytes(self._ads[v].mask_public_key))
                # Survivor v added sign(v, u) * PRG(s_uv): + when v < u.
                pair_keys.append((mask_key(secret, c.session, c.round_index, pair=(u, v)), 1 if v < u else -1))
        for index in range(self._chunks):
            start, stop = c.chunk_bounds(index)
            view = total[start:stop]
            _masks([(k, 1) for k in self_keys] + pair_keys, index, view, subtract=True)
        self.stage = _STAGE_DONE
        self._aggregate = None
        return total

    def _threshold(self, u: int) -> int:
        return self.context.threshold_for(len(self._graph[u]) + 1)

    def _collect(self, u: int, *, self_mask: bool) -> dict[int, bytes]:
        shares = {}
        for site, response in self._responses.items():
            table = response.self_mask_shares if self_mask else response.mask_key_shares
            if u in table:
                shares[site] = table[u]
        t = self._threshold(u)
        if len(shares) < t:
            raise SecAggAbort(
                f"only {len(shares)} shares of site {u}'s {'self-mask seed' if self_mask else 'mask key'} "
                f"arrived, the threshold is {t}: the round is aborted and nothing is revealed"
            )
        return shares

    @property
    def survivors(self) -> tuple[int, ...]:
        return self._survivors

    @property
    def dropped(self) -> tuple[int, ...]:
        return self._dropped


def run_round_in_memory(
    context: RoundContext,
    inputs: Mapping[int, np.ndarray],
    identity_keys: Mapping[int, Ed25519PrivateKey],
    *,
    drop_before_upload: Iterable[int] = (),
    drop_after_upload: Iterable[int] = (),
    random_bytes: RandomBytes = os.urandom,
    traffic: dict[int, int] | None = None,
) -> tuple[np.ndarray, tuple[int, ...]]:
    """One whole secure round with every party in this process (simulator, tests, benchmarks).

    ``drop_before_upload`` sites vanish after sharing keys, ``drop_after_upload`` sites after
    uploading (they answer nothing more). Returns the sum in ``Z_{2^b}`` and the survivors; raises
    ``SecAggAbort`` when too few sites remain. ``traffic``, when given, receives each site's
    upload bytes (messages as ``message_to_bytes`` encodes them, plus the masked chunks).
    """
    sent: dict[int, int] = {s: 0 for s in inputs}
    identities = {s: k.public_key() for s, k in identity_keys.items()}
    clients = {
        s: SecAggClient(s, context, identity_keys[s], identities, random_bytes=random_bytes) for s in inputs
    }
    server = SecAggServer(context)
    for site, client in clients.items():
        ad = client.advertise()
        sent[site] += len(message_to_bytes(ad))
        server.receive_advertisement(ad)
    ads = server.advertisements()
    for site, client in clients.items():
        shares = client.share_keys(ads)
        sent[site] += sum(len(message_to_bytes(x)) for x in shares)
        server.receive_shares(site, shares)
    server.close_share_keys()
    before, after = set(drop_before_upload), set(drop_after_upload)
    for site, client in clients.items():
        client.receive_shares(server.shares_for(site))
        if site in before:
            continue
        chunks = (
            inputs[site][i * context.chunk_size : (i + 1) * context.chunk_size]
            for i in range(num_chunks(context.numel, context.chunk_size))
        )
        for index, data in client.masked_chunks(chunks):
            sent[site] += len(data)
            server.receive_masked_chunk(site, index, data)
    survivors = server.close_upload()
    answering = [s for s in survivors if s not in after]
    for site in answering:
        signature = clients[site].sign_survivors(context.round_index, survivors)
        sent[site] += len(signature)
        server.receive_signature(site, signature)
    request = server.unmask_request()
    for site in answering:
        response = clients[site].unmask(request)
        sent[site] += len(message_to_bytes(response))
        server.receive_unmask(response)
    if traffic is not None:
        traffic.update(sent)
    return server.result(), server.survivors

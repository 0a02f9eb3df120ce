"""Secure aggregation's protocol: its stages, errors, the round context and the messages.

The coordinator learns the sum of the sites' integer vectors, never one site's. Bonawitz et al.,
"Practical Secure Aggregation for Privacy-Preserving Machine Learning", CCS 2017, with the optional
sparse neighbour graph of Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic
Overhead", CCS 2020 ("SecAgg+"). Split the way Flower splits it: pure crypto helpers
(``secagg_crypto``: X25519 / HKDF / ChaCha20 mask PRG, the neighbour graph), a site's state
machine (``secagg_client.SecAggClient``) and the coordinator's workflow
(``secagg_server.SecAggServer``), with the protocol stages as named constants (here);
``secagg_stages`` says what each stage call of the real system carries either way, and
``secagg_in_memory`` runs a whole round in one process.

One round, for sites ``U``:

1. ``STAGE_ADVERTISE_KEYS`` — each site makes two X25519 key pairs (``c`` to encrypt shares,
   ``s`` for pairwise masks), draws its self-mask seed ``b_u`` and signs ``(session, round,
   site, c_pk, s_pk, H(b_u))`` with its Ed25519 identity key (``seed_commitment``). The
   coordinator checks each signature against the sender's identity key and leaves a badly
   signed one out; it relays the rest. A site refuses the round if any relayed signature fails
   (key substitution by the coordinator), names another session or round (replay), or its own
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
   each signs that list. An unmask request must carry at least ``t`` valid such signatures
   (invalid ones are not counted), and every threshold satisfies ``2 t > h + c`` (``h`` share
   holders, ``c`` = ``colluding_sites`` assumed; ``split_view_bound``, checked by every site
   before it shares keys against its own ``c``, ``secagg_crypto.ThresholdPolicy``, not the one
   the coordinator declares), so two disjoint groups of honest sites can never both reach ``t``:
   the coordinator cannot tell different sites different survivor sets.
5. ``STAGE_UNMASK`` — a site returns, for every survivor, its share of ``b_u`` and for every
   dropped site its share of ``s_u`` — never both for one site, and only once per round. With
   ``t`` answers the coordinator removes the self-masks of survivors and the pairwise masks the
   survivors shared with dropped sites: the exact integer sum is left. Fewer than ``t`` answers:
   ``SecAggAbort``, nothing is revealed. A malformed answer is refused; a rebuilt seed that
   misses its commitment (or mask key that misses its public key) aborts the round.

Honest sites raise ``SecAggViolation`` (with the reason) on any detected misbehaviour. With fewer
than 3 sites a sum reveals the other site's input to each of them, so a round needs at least
``MIN_SITES``.

The messages are frozen dataclasses with no encoding of their own on the wire: the real system
translates them to and from protobuf in ``geoloco.protos.secagg_wire`` (one place per side), the
simulator passes them in memory. What is signed never depends on an encoding: ``advert_signed_bytes``
and ``survivors_signed_bytes`` build the exact byte strings the Ed25519 signatures cover from the
fields, so any serialisation that carries the same field values verifies, and any changed field
fails. ``message_to_bytes`` (self-describing JSON) remains for the in-memory round's traffic
estimate and for tests.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, TypeAlias

from geoloco.algorithms.fixed_point import MODULUS_DTYPES
from geoloco.algorithms.privacy.secagg_crypto import DOMAIN, NeighbourMode, num_chunks, secure_threshold

__all__ = [
    "MIN_SITES",
    "STAGES",
    "STAGE_ADVERTISE_KEYS",
    "STAGE_CONSISTENCY",
    "STAGE_DONE",
    "STAGE_MASKED_INPUT",
    "STAGE_SHARE_KEYS",
    "STAGE_UNMASK",
    "STAGE_UNMASK_RESPONSE",
    "STAGE_WITHDRAW",
    "EncryptedShare",
    "KeyAdvertisement",
    "ProtocolMessage",
    "RoundContext",
    "SecAggAbort",
    "SecAggViolation",
    "UnmaskRequest",
    "UnmaskResponse",
    "advert_signed_bytes",
    "message_from_bytes",
    "message_to_bytes",
    "pack_messages",
    "survivors_signed_bytes",
    "unpack_messages",
]

STAGE_ADVERTISE_KEYS: Final = "advertise_keys"
STAGE_SHARE_KEYS: Final = "share_keys"
STAGE_MASKED_INPUT: Final = "masked_input"
STAGE_CONSISTENCY: Final = "consistency"
STAGE_UNMASK: Final = "unmask"
STAGE_DONE: Final = "done"
"""A state machine's stage after its last message (nothing more is accepted)."""
STAGE_UNMASK_RESPONSE: Final = "unmask_response"
"""Wire-only stage: a site hands in its ``UnmaskResponse`` (the answer to ``STAGE_UNMASK``)."""
STAGE_WITHDRAW: Final = "withdraw"
"""Wire-only call, at any stage: the site refused the round (it detected misbehaviour or was left
out) and takes no further part, so the coordinator stops waiting for it."""
STAGES: Final = (
    STAGE_ADVERTISE_KEYS,
    STAGE_SHARE_KEYS,
    STAGE_MASKED_INPUT,
    STAGE_CONSISTENCY,
    STAGE_UNMASK,
    STAGE_UNMASK_RESPONSE,
    STAGE_WITHDRAW,
)

MIN_SITES: Final = 3
"""With 2 sites, each learns the other's input from the sum; secure aggregation needs at least 3."""


class SecAggViolation(ValueError):
    """An honest party detected misbehaviour (substituted key, replay, double-share request...)."""


class SecAggAbort(RuntimeError):
    """The round cannot complete securely (too few sites left); nothing was revealed."""


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
    """Shares needed to reconstruct a secret; ``None``: ``secure_threshold`` of the holders."""
    colluding_sites: int = 0
    """Sites the coordinator declares it assumes collude with it; every threshold must satisfy
    ``2 t > holders + colluding_sites`` (``split_view_bound``), which both sides check per round,
    each site with the larger of this and its own assumption (``ThresholdPolicy``)."""

    def __post_init__(self) -> None:
        if self.modulus_bits not in MODULUS_DTYPES:
            raise ValueError(f"modulus_bits must be one of {sorted(MODULUS_DTYPES)}, got {self.modulus_bits}")
        if self.numel < 1 or self.chunk_size < 1:
            raise ValueError(f"numel ({self.numel}) and chunk_size ({self.chunk_size}) must be >= 1")
        if self.threshold is not None and self.threshold < 2:
            raise ValueError(f"threshold must be >= 2 (or unset for about 2/3), got {self.threshold}")
        if self.colluding_sites < 0:
            raise ValueError(f"colluding_sites must be >= 0, got {self.colluding_sites}")

    def threshold_for(self, num_holders: int) -> int:
        """The Shamir threshold for a secret shared among ``num_holders`` sites."""
        return secure_threshold(self.threshold, num_holders, self.colluding_sites)

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
    """A site's two X25519 public keys for one round and its self-mask seed commitment, signed
    with its Ed25519 identity key."""

    site: int
    session: str
    round_index: int
    cipher_public_key: bytes
    mask_public_key: bytes
    signature: bytes
    seed_commitment: bytes = b""
    """``seed_commitment`` of the site's self-mask seed (32 bytes; refused when missing)."""

    def signed_bytes(self) -> bytes:
        return advert_signed_bytes(
            self.session, self.round_index, self.site, self.cipher_public_key, self.mask_public_key,
            self.seed_commitment,
        )


def advert_signed_bytes(
    session: str, round_index: int, site: int, cpk: bytes, spk: bytes, seed_commitment: bytes = b""
) -> bytes:
    """What a key advertisement's Ed25519 signature covers (built from the fields, never an encoding).

    The seed commitment is appended as a last field when present; both sides refuse an
    advertisement without one, so the shorter form never verifies in a round.
    """
    fields = [session.encode(), str(round_index).encode(), str(site).encode(), cpk, spk]
    if seed_commitment:
        fields.append(seed_commitment)
    return b"|".join([DOMAIN, STAGE_ADVERTISE_KEYS.encode(), *fields])


def survivors_signed_bytes(session: str, round_index: int, survivors: Sequence[int]) -> bytes:
    """What a survivor-list signature (``STAGE_CONSISTENCY``) covers: the sorted list, session, round."""
    survivor_list = ",".join(map(str, sorted(survivors))).encode()
    return b"|".join([DOMAIN, STAGE_CONSISTENCY.encode(), session.encode(), str(round_index).encode(), survivor_list])


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


ProtocolMessage: TypeAlias = KeyAdvertisement | EncryptedShare | UnmaskRequest | UnmaskResponse
"""A message of the in-memory protocol (``message_to_bytes`` / ``message_from_bytes``)."""

_MESSAGE_TYPES: dict[str, type] = {}


def _message_types() -> dict[str, type]:
    if not _MESSAGE_TYPES:
        for cls in (KeyAdvertisement, EncryptedShare, UnmaskRequest, UnmaskResponse):
            _MESSAGE_TYPES[cls.__name__] = cls
    return _MESSAGE_TYPES


def message_to_bytes(message: ProtocolMessage) -> bytes:
    """A protocol message as self-describing JSON bytes.

    Not the wire format (the real system sends the ``SecAgg*`` protobuf messages, see
    ``geoloco.protos.secagg_wire``): ``run_round_in_memory`` sizes its traffic estimate with it.
    Integrity does not rest on this encoding: advertisements and survivor lists are signed and
    shares are AEAD-encrypted, so a tampered message is refused by the state machines.
    """
    name = type(message).__name__
    if name not in _message_types():
        raise TypeError(f"not a secure-aggregation message: {name}; allowed: {', '.join(_message_types())}")
    body: dict[str, object] = {}
    for f in dataclasses.fields(message):
        value = getattr(message, f.name)
        if isinstance(value, bytes):
            value = {"b64": base64.b64encode(value).decode()}
        elif isinstance(value, Mapping):
            value = {"map": {str(k): base64.b64encode(v).decode() for k, v in value.items()}}
        elif isinstance(value, tuple):
            value = list(value)
        body[f.name] = value
    return json.dumps({"type": name, "body": body}, sort_keys=True).encode()


def message_from_bytes(data: bytes) -> ProtocolMessage:
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
        return cls(**kwargs)
    except (KeyError, TypeError, ValueError, binascii.Error) as err:
        raise ValueError(f"malformed secure-aggregation message: {err!r}") from None


def pack_messages(messages: Iterable[ProtocolMessage | bytes]) -> bytes:
    """Several protocol messages (or raw bytes, e.g. signatures) as one JSON payload (the wire
    format before protocol version 2; kept for callers of the old API, not sent any more)."""
    items = []
    for m in messages:
        data = m if isinstance(m, bytes) else message_to_bytes(m)
        items.append(base64.b64encode(data).decode())
    return json.dumps(items).encode()


def unpack_messages(data: bytes, *, raw: bool = False) -> list[bytes] | list[ProtocolMessage]:
    """Inverse of ``pack_messages``; ``raw`` returns the bytes without decoding messages."""
    try:
        items = [base64.b64decode(x, validate=True) for x in json.loads(data or b"[]")]
    except (TypeError, ValueError, binascii.Error) as err:
        raise ValueError(f"malformed secure-aggregation payload: {err!r}") from None
    return items if raw else [message_from_bytes(x) for x in items]

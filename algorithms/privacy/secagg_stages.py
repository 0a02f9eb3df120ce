"""What each secure-aggregation stage call carries between a named site and the coordinator.

The protocol messages (``secagg_messages``) are what the state machines exchange; a real round
also names its sites, relays identity bindings and says who survived. This module gives every
stage call's request and reply one frozen dataclass, and the table of which stage takes and
answers which, so both sides (and the wire translation in ``geoloco.protos.secagg_wire``) refuse a
message that does not belong to its stage with the same words:

===================  ===========================  =================================
stage                site -> coordinator          coordinator -> site
===================  ===========================  =================================
advertise_keys       ``AdvertiseKeys``            ``Advertisements``
share_keys           ``ShareBundle``              ``ShareBundle``
consistency          nothing (a wait)             ``SurvivorList``
unmask               ``SurvivorSignature``        ``UnmaskRequest``
unmask_response      ``UnmaskResponse``           nothing (an acknowledgement)
withdraw             nothing (the site is out)    nothing (an acknowledgement)
===================  ===========================  =================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, TypeAlias

from geoloco.algorithms.privacy.secagg_messages import (
    STAGE_ADVERTISE_KEYS,
    STAGE_CONSISTENCY,
    STAGE_SHARE_KEYS,
    STAGE_UNMASK,
    STAGE_UNMASK_RESPONSE,
    STAGE_WITHDRAW,
    EncryptedShare,
    KeyAdvertisement,
    SecAggViolation,
    UnmaskRequest,
    UnmaskResponse,
)

__all__ = [
    "STAGE_REPLIES",
    "STAGE_REQUESTS",
    "AdvertiseKeys",
    "Advertisements",
    "IdentityBinding",
    "ShareBundle",
    "StageMessage",
    "StageReply",
    "SurvivorList",
    "SurvivorSignature",
    "check_stage_message",
]


@dataclass(frozen=True, slots=True)
class IdentityBinding:
    """A site's Ed25519 identity key, bound to its TLS certificate (made and checked by the site
    agent, relayed unchanged by the coordinator)."""

    name: str
    """The site's name, as its certificate names it."""
    identity_key: bytes
    """Raw 32-byte Ed25519 public key."""
    certificate: bytes = b""
    """The site's PEM certificate; empty without TLS (``--insecure``)."""
    signature: bytes = b""
    """The TLS key's ECDSA signature over (name, identity key); empty without TLS."""


@dataclass(frozen=True, slots=True)
class AdvertiseKeys:
    """``advertise_keys`` request: the site's signed keys and its identity binding."""

    advertisement: KeyAdvertisement
    binding: IdentityBinding | None = None
    """None when the site offers no binding (tests; the coordinator relays what it gets)."""


@dataclass(frozen=True, slots=True)
class Advertisements:
    """``advertise_keys`` reply: every site's advertisement, names and identity bindings."""

    names: Mapping[int, str]
    """Protocol id (``site_index``) -> site name, for every site that advertised."""
    advertisements: tuple[KeyAdvertisement, ...]
    bindings: tuple[IdentityBinding, ...]


@dataclass(frozen=True, slots=True)
class ShareBundle:
    """``share_keys`` request (a site's shares for its neighbours) and reply (the shares for it)."""

    shares: tuple[EncryptedShare, ...]


@dataclass(frozen=True, slots=True)
class SurvivorList:
    """``consistency`` reply: the names of the sites whose masked upload is complete, sorted."""

    sites: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SurvivorSignature:
    """``unmask`` request: the site's Ed25519 signature over the survivor list."""

    signature: bytes


StageMessage: TypeAlias = (
    AdvertiseKeys | Advertisements | ShareBundle | SurvivorList | SurvivorSignature | UnmaskRequest
    | UnmaskResponse | None
)
"""Anything a stage call carries either way; ``None`` where a stage carries nothing."""

STAGE_REQUESTS: Final[Mapping[str, type | None]] = {
    STAGE_ADVERTISE_KEYS: AdvertiseKeys,
    STAGE_SHARE_KEYS: ShareBundle,
    STAGE_CONSISTENCY: None,
    STAGE_UNMASK: SurvivorSignature,
    STAGE_UNMASK_RESPONSE: UnmaskResponse,
    STAGE_WITHDRAW: None,
}
"""Stage name -> what a site sends with that stage call (None: nothing)."""

STAGE_REPLIES: Final[Mapping[str, type | None]] = {
    STAGE_ADVERTISE_KEYS: Advertisements,
    STAGE_SHARE_KEYS: ShareBundle,
    STAGE_CONSISTENCY: SurvivorList,
    STAGE_UNMASK: UnmaskRequest,
    STAGE_UNMASK_RESPONSE: None,
    STAGE_WITHDRAW: None,
}
"""Stage name -> what the coordinator answers once that stage closed (None: nothing)."""


def _name(kind: type | None) -> str:
    return "no message" if kind is None else kind.__name__


def check_stage_message(stage: str, message: object, *, reply: bool = False) -> None:
    """Raise ``SecAggViolation`` unless ``message`` is what ``stage`` takes (or, with ``reply``,
    answers); an unknown stage raises ``ValueError`` naming the stages."""
    table = STAGE_REPLIES if reply else STAGE_REQUESTS
    if stage not in table:
        raise ValueError(f"unknown secure-aggregation stage {stage!r}; stages: {', '.join(table)}")
    expected = table[stage]
    if (message is None) if expected is None else isinstance(message, expected):
        return
    direction = "reply to" if reply else "request at"
    got = _name(type(message) if message is not None else None)
    raise SecAggViolation(f"a {direction} stage {stage!r} must carry {_name(expected)}, got {got}")


@dataclass(frozen=True, slots=True)
class StageReply:
    """What a stage call gets back now."""

    ready: bool
    """False: the stage is still open; call again (the call is idempotent)."""
    message: StageMessage = None
    """The stage's reply once ready (see ``STAGE_REPLIES``); None while open or aborted."""
    aborted: str = ""
    """Non-empty when the secure round was aborted (too few sites): skip to the broadcast."""

"""Secure aggregation on the wire: the one translation between the dataclasses of
``geoloco.algorithms.privacy.secagg_messages`` / ``secagg_stages`` and the ``SecAgg*`` protobuf messages
of the SecureStage RPC.

Each side calls it in one place: the coordinator's servicer (``request_message`` in,
``stage_response`` out) and the site's coordinator client (``stage_request`` out,
``reply_message`` in). ``to_pb`` / ``from_pb`` translate any single message.

Security does not rest on this encoding. Ed25519 signatures cover byte strings built from the
field values (``advert_signed_bytes``, ``survivors_signed_bytes``, the identity binding's
``(name, identity key)``), never a protobuf serialisation, so a message re-encoded by any
protobuf runtime verifies exactly when its fields are unchanged, and a changed field fails at
the honest sites. Shares are AES-GCM encrypted for their recipient.

A stage call whose message is not the one its stage takes (``STAGE_REQUESTS``, mirrored by the
oneofs of ``SecureStageRequest`` / ``SecureStageResponse``) is refused here with
``StageMessageError`` (INVALID_ARGUMENT, ``ERROR_REASON_BAD_STAGE_MESSAGE``) before it reaches
the protocol; a site refuses a mistyped reply with ``SecAggViolation``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

import grpc

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
from geoloco.algorithms.privacy.secagg_stages import (
    AdvertiseKeys,
    Advertisements,
    IdentityBinding,
    ShareBundle,
    StageMessage,
    StageReply,
    SurvivorList,
    SurvivorSignature,
    check_stage_message,
)
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.errors import StatusError

__all__ = [
    "REPLY_FIELDS",
    "REQUEST_FIELDS",
    "StageMessageError",
    "from_pb",
    "reply_message",
    "request_message",
    "stage_request",
    "stage_response",
    "to_pb",
]

REQUEST_FIELDS: Final[Mapping[str, str | None]] = {
    STAGE_ADVERTISE_KEYS: "advertise_keys",
    STAGE_SHARE_KEYS: "share_keys",
    STAGE_CONSISTENCY: None,
    STAGE_UNMASK: "survivor_signature",
    STAGE_UNMASK_RESPONSE: "unmask_response",
    STAGE_WITHDRAW: None,
}
"""Stage -> the ``SecureStageRequest.message`` oneof field it takes (None: no message)."""

REPLY_FIELDS: Final[Mapping[str, str | None]] = {
    STAGE_ADVERTISE_KEYS: "advertisements",
    STAGE_SHARE_KEYS: "shares",
    STAGE_CONSISTENCY: "survivors",
    STAGE_UNMASK: "unmask_request",
    STAGE_UNMASK_RESPONSE: None,
    STAGE_WITHDRAW: None,
}
"""Stage -> the ``SecureStageResponse.message`` oneof field it answers with (None: no message)."""


class StageMessageError(StatusError):
    """A SecureStage call names an unknown stage, or carries a message its stage does not take."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = pb.ERROR_REASON_BAD_STAGE_MESSAGE


# ---------------------------------------------------------------------------------------------
# One message each way


def _advert_to_pb(ad: KeyAdvertisement) -> pb.SecAggKeyAdvert:
    return pb.SecAggKeyAdvert(
        site=ad.site, session=ad.session, round=ad.round_index, cipher_public_key=ad.cipher_public_key,
        mask_public_key=ad.mask_public_key, signature=ad.signature, seed_commitment=ad.seed_commitment,
    )


def _advert_from_pb(m: pb.SecAggKeyAdvert) -> KeyAdvertisement:
    return KeyAdvertisement(
        m.site, m.session, m.round, m.cipher_public_key, m.mask_public_key, m.signature, m.seed_commitment
    )


def _binding_to_pb(b: IdentityBinding) -> pb.SecAggIdentityBinding:
    return pb.SecAggIdentityBinding(
        name=b.name, identity_key=b.identity_key, certificate_pem=b.certificate, signature=b.signature
    )


def _binding_from_pb(m: pb.SecAggIdentityBinding) -> IdentityBinding:
    return IdentityBinding(m.name, m.identity_key, m.certificate_pem, m.signature)


def _share_to_pb(s: EncryptedShare) -> pb.SecAggEncryptedShare:
    return pb.SecAggEncryptedShare(
        sender=s.sender, recipient=s.recipient, round=s.round_index, ciphertext=s.ciphertext
    )


def _share_from_pb(m: pb.SecAggEncryptedShare) -> EncryptedShare:
    return EncryptedShare(m.sender, m.recipient, m.round, m.ciphertext)


def _unmask_request_to_pb(r: UnmaskRequest) -> pb.SecAggUnmaskRequest:
    return pb.SecAggUnmaskRequest(
        round=r.round_index, survivors=r.survivors, dropped=r.dropped, signatures=dict(r.signatures)
    )


def _unmask_request_from_pb(m: pb.SecAggUnmaskRequest) -> UnmaskRequest:
    return UnmaskRequest(m.round, tuple(m.survivors), tuple(m.dropped), dict(m.signatures))


def _unmask_response_to_pb(r: UnmaskResponse) -> pb.SecAggUnmaskResponse:
    return pb.SecAggUnmaskResponse(
        site=r.site, round=r.round_index, self_mask_shares=dict(r.self_mask_shares),
        mask_key_shares=dict(r.mask_key_shares),
    )


def _unmask_response_from_pb(m: pb.SecAggUnmaskResponse) -> UnmaskResponse:
    return UnmaskResponse(m.site, m.round, dict(m.self_mask_shares), dict(m.mask_key_shares))


def _advertise_keys_to_pb(a: AdvertiseKeys) -> pb.SecAggAdvertiseKeys:
    binding = _binding_to_pb(a.binding) if a.binding is not None else None
    return pb.SecAggAdvertiseKeys(advert=_advert_to_pb(a.advertisement), binding=binding)


def _advertise_keys_from_pb(m: pb.SecAggAdvertiseKeys) -> AdvertiseKeys:
    if not m.HasField("advert"):
        raise ValueError("the advertise_keys message carries no advertisement")
    binding = _binding_from_pb(m.binding) if m.HasField("binding") else None
    return AdvertiseKeys(_advert_from_pb(m.advert), binding)


def _advertisements_to_pb(a: Advertisements) -> pb.SecAggAdvertisements:
    return pb.SecAggAdvertisements(
        names=dict(a.names), adverts=[_advert_to_pb(x) for x in a.advertisements],
        bindings=[_binding_to_pb(b) for b in a.bindings],
    )


def _advertisements_from_pb(m: pb.SecAggAdvertisements) -> Advertisements:
    return Advertisements(
        names=dict(m.names),
        advertisements=tuple(_advert_from_pb(x) for x in m.adverts),
        bindings=tuple(_binding_from_pb(b) for b in m.bindings),
    )


_TO_PB: Final[dict[type, Callable[[Any], Any]]] = {
    KeyAdvertisement: _advert_to_pb,
    IdentityBinding: _binding_to_pb,
    EncryptedShare: _share_to_pb,
    UnmaskRequest: _unmask_request_to_pb,
    UnmaskResponse: _unmask_response_to_pb,
    AdvertiseKeys: _advertise_keys_to_pb,
    Advertisements: _advertisements_to_pb,
    ShareBundle: lambda b: pb.SecAggShareBundle(shares=[_share_to_pb(s) for s in b.shares]),
    SurvivorList: lambda s: pb.SecAggSurvivors(sites=s.sites),
    SurvivorSignature: lambda s: pb.SecAggSurvivorSignature(signature=s.signature),
}

_FROM_PB: Final[dict[type, Callable[[Any], Any]]] = {
    pb.SecAggKeyAdvert: _advert_from_pb,
    pb.SecAggIdentityBinding: _binding_from_pb,
    pb.SecAggEncryptedShare: _share_from_pb,
    pb.SecAggUnmaskRequest: _unmask_request_from_pb,
    pb.SecAggUnmaskResponse: _unmask_response_from_pb,
    pb.SecAggAdvertiseKeys: _advertise_keys_from_pb,
    pb.SecAggAdvertisements: _advertisements_from_pb,
    pb.SecAggShareBundle: lambda m: ShareBundle(tuple(_share_from_pb(s) for s in m.shares)),
    pb.SecAggSurvivors: lambda m: SurvivorList(tuple(m.sites)),
    pb.SecAggSurvivorSignature: lambda m: SurvivorSignature(m.signature),
}


def to_pb(message: object) -> Any:
    """The ``pb.SecAgg*`` message for a secure-aggregation dataclass; ``TypeError`` for others,
    ``ValueError`` for a field out of the wire's range (a negative round or site id)."""
    convert = _TO_PB.get(type(message))
    if convert is None:
        raise TypeError(
            f"not a secure-aggregation message: {type(message).__name__}; "
            f"allowed: {', '.join(t.__name__ for t in _TO_PB)}"
        )
    return convert(message)


def from_pb(message: Any) -> Any:
    """The secure-aggregation dataclass for a ``pb.SecAgg*`` message (inverse of ``to_pb``)."""
    convert = _FROM_PB.get(type(message))
    if convert is None:
        raise TypeError(f"not a secure-aggregation protobuf message: {type(message).__name__}")
    return convert(message)


# ---------------------------------------------------------------------------------------------
# Stage calls: coordinator side


def request_message(request: pb.SecureStageRequest) -> StageMessage:
    """The dataclass a stage call carries; ``StageMessageError`` when it is not its stage's."""
    stage = request.stage
    if stage not in REQUEST_FIELDS:
        raise StageMessageError(
            f"unknown secure-aggregation stage {stage!r}; stages: {', '.join(REQUEST_FIELDS)}"
        )
    expected, kind = REQUEST_FIELDS[stage], request.WhichOneof("message")
    if kind != expected:
        raise StageMessageError(
            f"SecureStage {stage!r} carries {kind or 'no message'}; that stage takes "
            f"{expected or 'no message'}"
        )
    if kind is None:
        return None
    try:
        return from_pb(getattr(request, kind))
    except ValueError as err:
        raise StageMessageError(f"SecureStage {stage!r}: {err}") from None


def stage_response(stage: str, reply: StageReply) -> pb.SecureStageResponse:
    """The SecureStage response for ``reply`` to a ``stage`` call."""
    response = pb.SecureStageResponse(
        ready=reply.ready, aborted=bool(reply.aborted), abort_reason=reply.aborted
    )
    if reply.message is not None:
        check_stage_message(stage, reply.message, reply=True)
        getattr(response, REPLY_FIELDS[stage]).CopyFrom(to_pb(reply.message))  # type: ignore[arg-type]
    return response


# ---------------------------------------------------------------------------------------------
# Stage calls: site side


def stage_request(
    stage: str, message: StageMessage, *, site: str, session_id: str, round_number: int, wait_ms: int
) -> pb.SecureStageRequest:
    """The SecureStage request of one stage call (``message`` checked against the stage)."""
    check_stage_message(stage, message)
    request = pb.SecureStageRequest(
        site=site, session_id=session_id, round=round_number, stage=stage, wait_ms=wait_ms
    )
    if message is not None:
        getattr(request, REQUEST_FIELDS[stage]).CopyFrom(to_pb(message))  # type: ignore[arg-type]
    return request


def reply_message(stage: str, response: pb.SecureStageResponse) -> StageMessage:
    """The dataclass a ready, not aborted, response carries; ``SecAggViolation`` when it is not
    what ``stage`` answers with (the site refuses the round)."""
    expected, kind = REPLY_FIELDS.get(stage), response.WhichOneof("message")
    if stage not in REPLY_FIELDS or kind != expected:
        raise SecAggViolation(
            f"the coordinator answered stage {stage!r} with {kind or 'no message'}, expected "
            f"{expected or 'no message'}"
        )
    return from_pb(getattr(response, kind)) if kind is not None else None

"""Secure aggregation on the wire (``geoloco.protos.secagg_wire``).

Every message survives dataclass -> protobuf bytes -> dataclass unchanged; a field changed on
the wire fails signature verification at an honest site (signatures cover bytes built from the
fields, pinned below); a stage call carrying another stage's message is refused, in the
translation (INVALID_ARGUMENT, BAD_STAGE_MESSAGE, also over real gRPC), by the coordinator's
``SecureRound`` and by the site.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
from geoloco.algorithms.privacy.secagg_client import SecAggClient
from geoloco.algorithms.privacy.secagg_crypto import num_chunks
from geoloco.algorithms.privacy.secagg_messages import (
    STAGE_ADVERTISE_KEYS,
    STAGE_CONSISTENCY,
    STAGE_SHARE_KEYS,
    STAGE_UNMASK,
    STAGE_UNMASK_RESPONSE,
    STAGE_WITHDRAW,
    EncryptedShare,
    KeyAdvertisement,
    RoundContext,
    SecAggViolation,
    UnmaskRequest,
    UnmaskResponse,
    advert_signed_bytes,
    survivors_signed_bytes,
)
from geoloco.algorithms.privacy.secagg_server import SecAggServer
from geoloco.algorithms.privacy.secagg_stages import (
    STAGE_REPLIES,
    STAGE_REQUESTS,
    AdvertiseKeys,
    Advertisements,
    IdentityBinding,
    ShareBundle,
    StageReply,
    SurvivorList,
    SurvivorSignature,
)
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import secagg_wire
from geoloco.protos.secagg_wire import StageMessageError, from_pb, to_pb

N = 4
NUMEL = 50


@dataclasses.dataclass
class _Round:
    """One in-memory round taken up to the unmask answers, keeping every message it produced."""

    context: RoundContext
    keys: dict[int, Ed25519PrivateKey]
    clients: dict[int, SecAggClient]
    ads: list[KeyAdvertisement]
    shares: list[EncryptedShare]
    survivors: list[int]
    signatures: dict[int, bytes]
    request: UnmaskRequest
    responses: list[UnmaskResponse]


def _clients(context: RoundContext) -> tuple[dict[int, Ed25519PrivateKey], dict[int, SecAggClient]]:
    keys = {s: Ed25519PrivateKey.generate() for s in range(N)}
    identities = {s: k.public_key() for s, k in keys.items()}
    return keys, {s: SecAggClient(s, context, keys[s], identities) for s in range(N)}


def _round(*, drop: int | None = None, answer: bool = True) -> _Round:
    """``answer=False`` leaves every survivor at the unmask stage, not yet answered."""
    context = RoundContext(session="sess", round_index=7, numel=NUMEL, chunk_size=20)
    keys, clients = _clients(context)
    server = SecAggServer(context)
    for c in clients.values():
        server.receive_advertisement(c.advertise())
    ads = server.advertisements()
    shares: list[EncryptedShare] = []
    for s, c in clients.items():
        mine = c.share_keys(ads)
        shares += mine
        server.receive_shares(s, mine)
    server.close_share_keys()
    rng = np.random.default_rng(0)
    for s, c in clients.items():
        c.receive_shares(server.shares_for(s))
        if s == drop:
            continue
        chunks = (rng.integers(0, 100, min(20, NUMEL - 20 * i)) for i in range(num_chunks(NUMEL, 20)))
        for index, data in c.masked_chunks(chunks):
            server.receive_masked_chunk(s, index, data)
    survivors = server.close_upload()
    signatures = {s: clients[s].sign_survivors(context.round_index, survivors) for s in survivors}
    for s, sig in signatures.items():
        server.receive_signature(s, sig)
    request = server.unmask_request()
    responses = [clients[s].unmask(request) for s in survivors] if answer else []
    return _Round(context, keys, clients, ads, shares, survivors, signatures, request, responses)


@pytest.fixture(scope="module")
def secure_round() -> _Round:
    return _round(drop=3)


def _wire(message: Any) -> Any:
    """Through protobuf bytes and back, as a peer would see it."""
    encoded = to_pb(message)
    return from_pb(type(encoded).FromString(encoded.SerializeToString()))


def _binding(name: str = "s0") -> IdentityBinding:
    return IdentityBinding(name, b"k" * 32, b"-----BEGIN CERTIFICATE-----\n...\n", b"\x30\x45" + b"x" * 69)


def _every_message(r: _Round) -> list[Any]:
    return [
        *r.ads,
        _binding(),
        IdentityBinding("insecure-site", b"k" * 32),
        *r.shares,
        r.request,
        *r.responses,
        AdvertiseKeys(r.ads[0], _binding()),
        AdvertiseKeys(r.ads[1]),
        Advertisements({1: "a", 2**32 - 1: "b"}, tuple(r.ads), (_binding("a"), _binding("b"))),
        ShareBundle(tuple(r.shares[:3])),
        ShareBundle(()),
        SurvivorList(("alpha", "beta", "gamma")),
        SurvivorSignature(r.signatures[r.survivors[0]]),
    ]


def test_every_message_round_trips_through_protobuf_bytes(secure_round: _Round) -> None:
    messages = _every_message(secure_round)
    for message in messages:
        assert _wire(message) == message, type(message).__name__
    stage_types = {t for t in (*STAGE_REQUESTS.values(), *STAGE_REPLIES.values()) if t is not None}
    assert stage_types <= {type(m) for m in messages}
    # The dropped site's shares are asked for: the request has both lists filled.
    assert secure_round.request.dropped == (3,) and secure_round.responses[0].mask_key_shares
    with pytest.raises(TypeError, match="not a secure-aggregation message"):
        to_pb(b"raw bytes")
    with pytest.raises(TypeError, match="not a secure-aggregation protobuf message"):
        from_pb(pb.Chunk())


def _stage_examples(r: _Round) -> dict[str, tuple[Any, Any]]:
    """stage -> (what a site sends, what the coordinator answers), from a real round."""
    return {
        STAGE_ADVERTISE_KEYS: (
            AdvertiseKeys(r.ads[0], _binding()),
            Advertisements({a.site: f"s{a.site}" for a in r.ads}, tuple(r.ads), (_binding(),)),
        ),
        STAGE_SHARE_KEYS: (ShareBundle(tuple(r.shares[:3])), ShareBundle(tuple(r.shares[3:6]))),
        STAGE_CONSISTENCY: (None, SurvivorList(("s0", "s1", "s2"))),
        STAGE_UNMASK: (SurvivorSignature(r.signatures[0]), r.request),
        STAGE_UNMASK_RESPONSE: (r.responses[0], None),
    }


def test_every_stage_call_round_trips_through_the_rpc_messages(secure_round: _Round) -> None:
    for stage, (sent, answer) in _stage_examples(secure_round).items():
        request = secagg_wire.stage_request(stage, sent, site="s0", session_id="x", round_number=7, wait_ms=5)
        request = pb.SecureStageRequest.FromString(request.SerializeToString())
        assert (request.site, request.session_id, request.round, request.stage, request.wait_ms) == (
            "s0", "x", 7, stage, 5,
        )
        assert secagg_wire.request_message(request) == sent
        response = secagg_wire.stage_response(stage, StageReply(ready=True, message=answer))
        response = pb.SecureStageResponse.FromString(response.SerializeToString())
        assert response.ready and not response.aborted
        assert secagg_wire.reply_message(stage, response) == answer
        waiting = secagg_wire.stage_response(stage, StageReply(ready=False))
        assert not waiting.ready and waiting.WhichOneof("message") is None
    aborted = secagg_wire.stage_response(STAGE_SHARE_KEYS, StageReply(ready=True, aborted="too few"))
    assert aborted.aborted and aborted.abort_reason == "too few"


# ---------------------------------------------------------------------------------------------
# Tampering on the wire


def test_signed_bytes_are_pinned() -> None:
    """Signatures cover these exact byte strings (as before the protobuf messages): a change
    here breaks every peer of another version, so it must be deliberate."""
    assert advert_signed_bytes("sess", 7, 3, b"C" * 4, b"S" * 4) == (
        b"geoloco-secagg/v1|advertise_keys|sess|7|3|CCCC|SSSS"
    )
    assert survivors_signed_bytes("sess", 7, [5, 1, 3]) == b"geoloco-secagg/v1|consistency|sess|7|1,3,5"


@pytest.mark.parametrize(
    "field, value",
    [
        ("site", 2),
        ("session", "other"),
        ("round", 8),
        ("cipher_public_key", bytes(32)),
        ("mask_public_key", b"\x09" + bytes(31)),
        ("signature", bytes(64)),
    ],
)
def test_an_advertisement_changed_on_the_wire_fails_verification(field: str, value: object) -> None:
    context = RoundContext(session="sess", round_index=7, numel=NUMEL, chunk_size=20)
    keys, clients = _clients(context)
    ads = [c.advertise() for c in clients.values()]
    wire = to_pb(ads[1])
    setattr(wire, field, value)
    tampered = from_pb(pb.SecAggKeyAdvert.FromString(wire.SerializeToString()))
    assert tampered != ads[1]
    with pytest.raises(InvalidSignature):
        keys[1].public_key().verify(tampered.signature, tampered.signed_bytes())
    # The honest site refuses the round (a substituted key, or a replay of another round).
    with pytest.raises(SecAggViolation):
        clients[0].share_keys([ads[0], tampered, *ads[2:]])


@pytest.mark.parametrize("change", ["survivor", "dropped", "signature"])
def test_an_unmask_request_changed_on_the_wire_is_refused(change: str) -> None:
    r = _round(answer=False)
    wire = to_pb(r.request)
    if change == "survivor":
        del wire.survivors[-1]  # a survivor silently left out: not the list the sites signed
    elif change == "dropped":
        wire.dropped.append(wire.survivors[0])  # both shares of one site: would unmask it
    else:
        # Altered signatures do not count; with fewer than t = 3 valid ones left, refused.
        wire.signatures[r.survivors[1]] = bytes(64)
        wire.signatures[r.survivors[2]] = bytes(64)
    tampered = from_pb(pb.SecAggUnmaskRequest.FromString(wire.SerializeToString()))
    with pytest.raises(SecAggViolation):
        r.clients[0].unmask(tampered)
    assert r.clients[1].unmask(_wire(r.request)).site == 1  # the request as sent is answered


def test_an_identity_binding_changed_on_the_wire_fails_verification(tmp_path: Path) -> None:
    from geoloco.protos.secagg_identity import verify_binding
    from geoloco.scenarios.certs import init_ca, issue_site
    from geoloco.site_agent.secure_site import SiteIdentity, verify_bindings

    init_ca(tmp_path)
    for name in ("s0", "s1"):
        issue_site(tmp_path, name)
    ca = (tmp_path / "ca.crt").read_bytes()
    cert, key = (tmp_path / "s0.crt").read_bytes(), (tmp_path / "s0.key").read_bytes()
    identity = SiteIdentity.create("s0", cert, key)
    assert set(verify_bindings([_wire(identity.binding)], ca)) == {"s0"}
    # Checked once per process, then remembered (the binding is the same every round) ...
    hits = verify_binding.cache_info().hits
    assert set(verify_bindings([_wire(identity.binding)], ca)) == {"s0"}
    assert verify_binding.cache_info().hits == hits + 1
    # ... for the CA it was checked against only.
    init_ca(tmp_path / "other")
    with pytest.raises(SecAggViolation, match="not bound to a certificate of this run's CA"):
        verify_bindings([_wire(identity.binding)], (tmp_path / "other" / "ca.crt").read_bytes())
    other = SiteIdentity.create("s1").binding.identity_key
    for field, value in (("identity_key", other), ("name", "s1"), ("signature", bytes(70))):
        wire = to_pb(identity.binding)
        setattr(wire, field, value)
        with pytest.raises(SecAggViolation):
            verify_bindings([from_pb(wire)], ca)
    stripped = to_pb(identity.binding)
    stripped.ClearField("certificate_pem")
    with pytest.raises(SecAggViolation, match="not signed with its TLS key"):
        verify_bindings([from_pb(stripped)], ca)


# ---------------------------------------------------------------------------------------------
# A message at the wrong stage


def _request(stage: str, **message: Any) -> pb.SecureStageRequest:
    return pb.SecureStageRequest(site="s0", session_id="x", round=7, stage=stage, **message)


def test_a_stage_call_carrying_another_stages_message_is_refused_by_the_translation() -> None:
    advertise = pb.SecAggAdvertiseKeys(advert=pb.SecAggKeyAdvert(site=1))
    cases = [
        _request(STAGE_SHARE_KEYS, advertise_keys=advertise),
        _request(STAGE_ADVERTISE_KEYS),  # no message at all
        _request(STAGE_CONSISTENCY, share_keys=pb.SecAggShareBundle()),  # a wait carries nothing
        _request(STAGE_UNMASK, unmask_response=pb.SecAggUnmaskResponse()),
        _request(STAGE_UNMASK_RESPONSE, survivor_signature=pb.SecAggSurvivorSignature()),
        _request("masked_input"),  # not a stage call (uploads go through Upload)
        _request(STAGE_ADVERTISE_KEYS, advertise_keys=pb.SecAggAdvertiseKeys()),  # no advertisement
    ]
    for request in cases:
        with pytest.raises(StageMessageError) as caught:
            secagg_wire.request_message(request)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.reason_name == "ERROR_REASON_BAD_STAGE_MESSAGE"
    with pytest.raises(StageMessageError, match="carries share_keys; that stage takes survivor_signature"):
        secagg_wire.request_message(_request(STAGE_UNMASK, share_keys=pb.SecAggShareBundle()))


def test_sending_or_receiving_another_stages_message_is_refused_by_the_site(secure_round: _Round) -> None:
    with pytest.raises(SecAggViolation, match="must carry SurvivorSignature, got ShareBundle"):
        secagg_wire.stage_request(
            STAGE_UNMASK, ShareBundle(()), site="s0", session_id="x", round_number=7, wait_ms=0
        )
    # A coordinator answering the unmask stage with a survivor list instead of a request.
    response = pb.SecureStageResponse(ready=True, survivors=pb.SecAggSurvivors(sites=["s0"]))
    with pytest.raises(SecAggViolation, match="answered stage 'unmask' with survivors"):
        secagg_wire.reply_message(STAGE_UNMASK, response)
    with pytest.raises(SecAggViolation, match="with no message"):
        secagg_wire.reply_message(STAGE_SHARE_KEYS, pb.SecureStageResponse(ready=True))


def test_the_coordinator_refuses_another_stages_message() -> None:
    from geoloco.coordinator.secure_round import SecureRound

    privacy = PrivacyConfig(secure_aggregation=True, clip_norm=1.0)
    sr = SecureRound(privacy, "none", numel=10, session="sess", round_number=0, index_seed=1,
                     stage_timeout_s=5.0, now=0.0)
    with pytest.raises(SecAggViolation, match="must carry AdvertiseKeys, got ShareBundle"):
        sr.submit("s0", STAGE_ADVERTISE_KEYS, ShareBundle(()))
    with pytest.raises(SecAggViolation, match="must carry no message"):
        sr.submit("s0", STAGE_CONSISTENCY, SurvivorSignature(b""))
    assert not sr.aborted  # refused calls change nothing


@pytest.fixture
def secure_coordinator() -> Iterator[int]:
    from geoloco.algorithms.strategy import AlgorithmConfig
    from geoloco.coordinator.config import CoordinatorConfig
    from geoloco.coordinator.server import CoordinatorServer

    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(inner_steps=1), insecure=True, min_sites=3, total_rounds=2,
        privacy=PrivacyConfig(secure_aggregation=True, clip_norm=1.0),
    )
    server = CoordinatorServer.from_model(config, torch.nn.Linear(3, 2))
    server.start()
    yield server.port
    server.stop(grace=0)


def test_a_mistyped_stage_call_over_grpc_is_invalid_argument(secure_coordinator: int) -> None:
    from geoloco.protos.transport_endpoints import client_channel, coordinator_stub
    from geoloco.protos.transport_errors import error_reason

    channel = client_channel(f"127.0.0.1:{secure_coordinator}", tls=None, insecure=True)
    try:
        stub = coordinator_stub(channel)
        request = _request(STAGE_UNMASK, share_keys=pb.SecAggShareBundle())
        with pytest.raises(grpc.RpcError) as caught:
            stub.SecureStage(request, timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_reason(caught.value) == pb.ERROR_REASON_BAD_STAGE_MESSAGE
        assert "that stage takes survivor_signature" in (caught.value.details() or "")
    finally:
        channel.close()


_WRONG_MESSAGE = {
    STAGE_ADVERTISE_KEYS: {"share_keys": pb.SecAggShareBundle()},
    STAGE_SHARE_KEYS: {"advertise_keys": pb.SecAggAdvertiseKeys(advert=pb.SecAggKeyAdvert(site=1))},
    STAGE_CONSISTENCY: {"survivor_signature": pb.SecAggSurvivorSignature()},
    STAGE_UNMASK: {"unmask_response": pb.SecAggUnmaskResponse()},
    STAGE_UNMASK_RESPONSE: {"survivor_signature": pb.SecAggSurvivorSignature()},
    STAGE_WITHDRAW: {"share_keys": pb.SecAggShareBundle()},
}


@pytest.mark.parametrize("stage", sorted(_WRONG_MESSAGE))
def test_every_stage_refuses_another_stages_message_over_grpc_with_invalid_argument(
    secure_coordinator: int, stage: str
) -> None:
    from geoloco.protos.transport_endpoints import client_channel, coordinator_stub
    from geoloco.protos.transport_errors import error_reason

    assert set(_WRONG_MESSAGE) == set(STAGE_REQUESTS)  # every stage call is covered
    channel = client_channel(f"127.0.0.1:{secure_coordinator}", tls=None, insecure=True)
    try:
        with pytest.raises(grpc.RpcError) as caught:
            coordinator_stub(channel).SecureStage(_request(stage, **_WRONG_MESSAGE[stage]), timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_reason(caught.value) == pb.ERROR_REASON_BAD_STAGE_MESSAGE
        assert f"SecureStage {stage!r} carries" in (caught.value.details() or "")
    finally:
        channel.close()

"""The coordinator's secure round (coordinator.secure_round, privacy_rounds) against hostile or
refusing sites: it leaves the sender of a bad message out instead of relaying it, never waits for
a site that withdrew, aborts with "no change" as soon as the quorum can no longer upload, and its
key stages close at their deadline even when no site calls."""

from __future__ import annotations

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig, PrivateUpdateEncoder, secure_context
from geoloco.algorithms.privacy.secagg_client import SecAggClient
from geoloco.algorithms.privacy.secagg_crypto import public_bytes, site_index
from geoloco.algorithms.privacy.secagg_messages import (
    STAGE_ADVERTISE_KEYS,
    STAGE_CONSISTENCY,
    STAGE_SHARE_KEYS,
    STAGE_UNMASK,
    STAGE_UNMASK_RESPONSE,
    STAGE_WITHDRAW,
    KeyAdvertisement,
    SecAggViolation,
    UnmaskRequest,
)
from geoloco.algorithms.privacy.secagg_stages import (
    AdvertiseKeys,
    Advertisements,
    IdentityBinding,
    ShareBundle,
    SurvivorSignature,
)
from geoloco.coordinator.privacy_rounds import PrivateRounds
from geoloco.protos.errors import InvalidUpdateError

NAMES = ["alpha", "beta", "gamma", "delta"]
TIMEOUT = 5.0
NUMEL = 300
PRIVACY = PrivacyConfig(secure_aggregation=True, clip_norm=10.0, chunk_size=100)


class _Round:
    """A coordinator's ``PrivateRounds`` with four protocol clients named ``NAMES``."""

    def __init__(self) -> None:
        self.rounds = PrivateRounds(PRIVACY, "none", numel=NUMEL, session="sess", stage_timeout_s=TIMEOUT)
        self.rounds.start_round(3, 11, 0.0)
        self.keys = {n: Ed25519PrivateKey.generate() for n in NAMES}
        identities = {site_index(n): k.public_key() for n, k in self.keys.items()}
        context = secure_context(PRIVACY, "none", numel=NUMEL, session="sess", round_index=3)
        self.clients = {n: SecAggClient(site_index(n), context, self.keys[n], identities) for n in NAMES}
        self.live = set(NAMES)
        gen = torch.Generator().manual_seed(0)
        self.updates = {n: 0.01 * torch.randn(NUMEL, generator=gen) for n in NAMES}

    @property
    def secure(self):  # type: ignore[no-untyped-def]
        assert self.rounds.current is not None
        return self.rounds.current

    def call(self, site: str, stage: str, message: object, now: float):  # type: ignore[no-untyped-def]
        return self.rounds.stage(site, 3, stage, message, self.live, now)  # type: ignore[arg-type]

    def advertise(self, names: list[str], now: float = 0.1) -> None:
        for n in names:
            binding = IdentityBinding(n, public_bytes(self.keys[n].public_key()))
            self.call(n, STAGE_ADVERTISE_KEYS, AdvertiseKeys(self.clients[n].advertise(), binding), now)

    def share(self, names: list[str], now: float = 0.2) -> None:
        reply = self.secure.reply(names[0], STAGE_ADVERTISE_KEYS).message
        assert isinstance(reply, Advertisements)
        for n in names:
            self.call(n, STAGE_SHARE_KEYS, ShareBundle(tuple(self.clients[n].share_keys(reply.advertisements))), now)

    def upload(self, names: list[str]) -> None:
        assert self.secure.fixed is not None
        for n in names:
            bundle = self.secure.reply(n, STAGE_SHARE_KEYS).message
            assert isinstance(bundle, ShareBundle)
            client = self.clients[n]
            client.receive_shares(bundle.shares)
            ints = PrivateUpdateEncoder(PRIVACY, "none").encode(
                self.updates[n], self.secure.fixed, client.context, index_seed=1, num_sites=len(self.live)
            )
            self.secure.receive_upload(n, b"".join(data for _, data in client.masked_chunks(ints)))


def test_a_site_that_withdraws_after_keys_were_shared_aborts_a_round_whose_quorum_it_was() -> None:
    r = _Round()
    r.advertise(NAMES)
    r.share(NAMES)
    assert r.secure.keys_shared
    # "delta" got a bad share and refused the round: it says so instead of uploading.
    assert r.call("delta", STAGE_WITHDRAW, None, now=0.3).ready
    assert not r.secure.may_upload("delta")
    r.upload(["alpha", "beta", "gamma"])
    # min_sites = 4: the quorum can no longer upload, so the round ends now with no change.
    assert r.rounds.close_decision(r.live, {"alpha", "beta", "gamma"}, 4, now=0.4)
    assert "only 3 sites can still upload" in r.secure.aborted


def test_uploads_close_without_waiting_for_a_site_that_withdrew() -> None:
    r = _Round()
    r.advertise(NAMES)
    r.share(NAMES)
    r.call("delta", STAGE_WITHDRAW, None, now=0.3)
    r.upload(["alpha", "beta"])
    assert not r.rounds.close_decision(r.live, {"alpha", "beta"}, 3, now=0.4)  # gamma still uploads
    r.upload(["gamma"])
    assert r.rounds.close_decision(r.live, {"alpha", "beta", "gamma"}, 3, now=0.5)
    assert not r.secure.aborted


def test_sites_withdrawing_while_keys_are_shared_end_the_round_at_once() -> None:
    r = _Round()
    r.advertise(NAMES)
    assert r.secure.reply("alpha", STAGE_ADVERTISE_KEYS).ready
    # Sites refuse the round before sharing keys (its threshold is below their own bound) and
    # say so: once too few are left to reach the quorum, the round ends now, not at the deadline.
    r.share(["alpha"])
    r.call("delta", STAGE_WITHDRAW, None, now=0.3)
    assert not r.rounds.close_decision(r.live, set(), 3, now=0.4)  # alpha, beta, gamma may still
    r.call("gamma", STAGE_WITHDRAW, None, now=0.5)
    assert r.rounds.close_decision(r.live, set(), 3, now=0.6)
    assert "only 2 sites can still upload (['alpha', 'beta'])" in r.secure.aborted
    assert r.rounds.unmasked  # the round aggregates as "no change"


def test_key_stage_deadline_holds_when_no_site_calls() -> None:
    r = _Round()
    r.advertise(NAMES)
    assert r.secure.reply("alpha", STAGE_ADVERTISE_KEYS).ready
    # Every site refused at the share stage and went silent (no stage call reaches the round):
    # the coordinator's poll alone must close the stage at its deadline and abort the round.
    assert not r.rounds.close_decision(r.live, set(), 3, now=1.0)
    assert r.rounds.close_decision(r.live, set(), 3, now=TIMEOUT + 1.0)
    assert "shared keys" in r.secure.aborted
    assert r.rounds.unmasked  # the round aggregates as "no change"


def test_a_badly_signed_advertisement_leaves_its_sender_out_not_the_round() -> None:
    r = _Round()
    r.advertise(NAMES[:3])
    ad = r.clients["delta"].advertise()
    forged = KeyAdvertisement(
        ad.site, ad.session, ad.round_index, ad.cipher_public_key, ad.mask_public_key,
        Ed25519PrivateKey.generate().sign(ad.signed_bytes()), ad.seed_commitment,
    )
    binding = IdentityBinding("delta", public_bytes(r.keys["delta"].public_key()))
    with pytest.raises(InvalidUpdateError, match="not signed by its identity key"):
        r.call("delta", STAGE_ADVERTISE_KEYS, AdvertiseKeys(forged, binding), now=0.1)
    # Advertisement closes without waiting for the left-out site, and does not relay it.
    r.rounds.advance(r.live, 0.2)
    reply = r.secure.reply("alpha", STAGE_ADVERTISE_KEYS)
    assert reply.ready and isinstance(reply.message, Advertisements)
    assert sorted(reply.message.names.values()) == ["alpha", "beta", "gamma"]
    r.share(["alpha", "beta", "gamma"])  # no honest site refuses
    assert r.secure.keys_shared and not r.secure.aborted


def test_a_bad_survivor_signature_leaves_its_sender_out_and_the_sum_is_exact() -> None:
    r = _Round()
    r.advertise(NAMES)
    r.share(NAMES)
    r.upload(NAMES)
    assert r.rounds.close_decision(r.live, set(NAMES), 3, now=0.5)
    r.rounds.close_upload(0.5)
    survivors = sorted(site_index(n) for n in r.secure.survivors)
    for n in NAMES[:3]:
        r.call(n, STAGE_CONSISTENCY, None, now=0.6)
        r.call(n, STAGE_UNMASK, SurvivorSignature(r.clients[n].sign_survivors(3, survivors)), now=0.6)
    with pytest.raises(InvalidUpdateError, match="survivor-list signature is invalid"):
        r.call("delta", STAGE_UNMASK, SurvivorSignature(bytes(64)), now=0.6)
    r.rounds.advance(r.live, 0.7)  # closes without waiting for delta (left out) or the deadline
    request = r.secure.reply("alpha", STAGE_UNMASK).message
    assert isinstance(request, UnmaskRequest) and set(request.signatures) == set(survivors) - {site_index("delta")}
    for n in NAMES[:3]:
        r.call(n, STAGE_UNMASK_RESPONSE, r.clients[n].unmask(request), now=0.8)
    r.rounds.advance(r.live, 0.9)
    assert r.secure.done
    mean = r.secure.result()
    assert r.secure.fixed is not None
    assert (mean - sum(r.updates.values()) / 4).abs().max().item() <= 1.0 / r.secure.fixed.scale


def test_a_malformed_unmask_answer_is_invalid_argument_and_never_crashes_the_unmasking() -> None:
    r = _Round()
    r.advertise(NAMES)
    r.share(NAMES)
    r.upload(NAMES)
    r.rounds.close_decision(r.live, set(NAMES), 3, now=0.5)
    r.rounds.close_upload(0.5)
    survivors = sorted(site_index(n) for n in r.secure.survivors)
    for n in NAMES:
        r.call(n, STAGE_UNMASK, SurvivorSignature(r.clients[n].sign_survivors(3, survivors)), now=0.6)
    request = r.secure.reply("alpha", STAGE_UNMASK).message
    assert isinstance(request, UnmaskRequest)
    answer = r.clients["delta"].unmask(request)
    shares = {u: s[:10] for u, s in answer.self_mask_shares.items()}  # truncated
    bad = type(answer)(answer.site, answer.round_index, shares, answer.mask_key_shares)
    with pytest.raises(InvalidUpdateError, match="malformed self-mask seed share"):
        r.call("delta", STAGE_UNMASK_RESPONSE, bad, now=0.7)
    for n in NAMES[:3]:
        r.call(n, STAGE_UNMASK_RESPONSE, r.clients[n].unmask(request), now=0.8)
    assert r.secure.done  # no wait for the left-out site
    mean = r.secure.result()
    assert r.secure.fixed is not None
    assert (mean - sum(r.updates.values()) / 4).abs().max().item() <= 1.0 / r.secure.fixed.scale


def test_a_site_left_out_cannot_come_back_in_the_same_round() -> None:
    r = _Round()
    r.advertise(NAMES)
    r.call("delta", STAGE_WITHDRAW, None, now=0.15)
    with pytest.raises(InvalidUpdateError, match="left out"):
        r.share(["delta"])
    with pytest.raises(SecAggViolation):
        r.secure.submit("delta", STAGE_SHARE_KEYS, ShareBundle(()))

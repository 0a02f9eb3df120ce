"""The coordinator's stage-call adapter (coordinator.secure_round) driven by protocol clients.

Sites are named; one is "killed" right after uploading (it answers nothing more and the stage
deadline passes); the survivors' mean update is recovered exactly as the plain mean of what
they encoded, and nothing individual is kept.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from geoloco.algorithms.privacy.private_aggregation import (
    SECURE_UPLOAD_CODEC,
    PrivacyConfig,
    PrivateUpdateEncoder,
    secure_context,
    secure_fixed_point,
)
from geoloco.algorithms.privacy.secagg_client import SecAggClient
from geoloco.algorithms.privacy.secagg_crypto import site_index
from geoloco.algorithms.privacy.secagg_messages import (
    STAGE_ADVERTISE_KEYS,
    STAGE_CONSISTENCY,
    STAGE_SHARE_KEYS,
    STAGE_UNMASK,
    STAGE_UNMASK_RESPONSE,
    SecAggViolation,
    UnmaskRequest,
)
from geoloco.algorithms.privacy.secagg_stages import (
    AdvertiseKeys,
    Advertisements,
    ShareBundle,
    SurvivorList,
    SurvivorSignature,
)
from geoloco.coordinator.secure_round import SecureRound

NAMES = ["alpha", "beta", "gamma", "delta"]
TIMEOUT = 5.0


def _round(privacy: PrivacyConfig, numel: int) -> SecureRound:
    return SecureRound(privacy, "none", numel=numel, session="sess", round_number=3,
                       index_seed=1, stage_timeout_s=TIMEOUT, now=0.0)


def _clients(privacy: PrivacyConfig, numel: int) -> dict[str, SecAggClient]:
    keys = {n: Ed25519PrivateKey.generate() for n in NAMES}
    identities = {site_index(n): k.public_key() for n, k in keys.items()}
    context = secure_context(privacy, "none", numel=numel, session="sess", round_index=3)
    return {n: SecAggClient(site_index(n), context, keys[n], identities) for n in NAMES}


def test_secure_round_over_stage_calls_survives_a_site_killed_after_upload() -> None:
    numel = 3000
    privacy = PrivacyConfig(secure_aggregation=True, clip_norm=10.0, chunk_size=1000)
    sr = _round(privacy, numel)
    clients = _clients(privacy, numel)
    live = set(NAMES)
    assert sr.reply("alpha", STAGE_ADVERTISE_KEYS).ready is False
    for n, c in clients.items():
        sr.submit(n, STAGE_ADVERTISE_KEYS, AdvertiseKeys(c.advertise()))
    sr.advance(live, now=0.1)
    reply = sr.reply("beta", STAGE_ADVERTISE_KEYS).message
    assert isinstance(reply, Advertisements)
    ads = reply.advertisements
    assert dict(reply.names) == {site_index(n): n for n in NAMES}
    for n, c in clients.items():
        sr.submit(n, STAGE_SHARE_KEYS, ShareBundle(tuple(c.share_keys(ads))))
    sr.advance(live, now=0.2)
    assert sr.keys_shared and sr.may_upload("alpha")
    fixed = secure_fixed_point(privacy, len(ads))
    assert sr.fixed == fixed
    gen = torch.Generator().manual_seed(0)
    updates = {n: 0.01 * torch.randn(numel, generator=gen) for n in NAMES}
    for n, c in clients.items():
        bundle = sr.reply(n, STAGE_SHARE_KEYS).message
        assert isinstance(bundle, ShareBundle)
        c.receive_shares(bundle.shares)
        ints = PrivateUpdateEncoder(privacy, "none").encode(updates[n], fixed, c.context, index_seed=1, num_sites=4)
        blob = b"".join(data for _, data in c.masked_chunks(ints))
        sr.receive_upload(n, blob)
    # "delta" is killed right after its upload: it never answers again.
    live.discard("delta")
    survivors = sr.close_upload(now=1.0)
    assert survivors == sorted(NAMES)  # its upload is complete, so it is in the sum
    for n in ("alpha", "beta", "gamma"):
        sr.submit(n, STAGE_CONSISTENCY, None)
        listed = sr.reply(n, STAGE_CONSISTENCY).message
        assert isinstance(listed, SurvivorList)
        indices = sorted(site_index(x) for x in listed.sites)
        sr.submit(n, STAGE_UNMASK, SurvivorSignature(clients[n].sign_survivors(3, indices)))
    sr.advance(live, now=1.1)
    for n in ("alpha", "beta", "gamma"):
        request = sr.reply(n, STAGE_UNMASK).message
        assert isinstance(request, UnmaskRequest)
        sr.submit(n, STAGE_UNMASK_RESPONSE, clients[n].unmask(request))
    assert not sr.done
    sr.advance(live, now=1.2)
    assert sr.done
    mean = sr.result()
    plain = sum(updates.values()) / 4
    assert (mean - plain).abs().max().item() <= 1.0 / fixed.scale
    assert SECURE_UPLOAD_CODEC == "secagg"


def test_stage_deadline_aborts_when_too_few_sites_advertise() -> None:
    privacy = PrivacyConfig(secure_aggregation=True, clip_norm=1.0)
    sr = _round(privacy, 100)
    clients = _clients(privacy, 100)
    for n in NAMES[:2]:
        sr.submit(n, STAGE_ADVERTISE_KEYS, AdvertiseKeys(clients[n].advertise()))
    sr.advance(set(NAMES), now=1.0)
    assert not sr.aborted  # still waiting for the others
    sr.advance(set(NAMES), now=TIMEOUT + 0.1)
    assert "at least 3" in sr.aborted
    reply = sr.reply("alpha", STAGE_ADVERTISE_KEYS)
    assert reply.ready and reply.aborted
    assert sr.done and sr.close_upload(now=TIMEOUT + 1) == []


def test_stage_calls_are_checked() -> None:
    privacy = PrivacyConfig(secure_aggregation=True, clip_norm=1.0)
    sr = _round(privacy, 100)
    clients = _clients(privacy, 100)
    ad = AdvertiseKeys(clients["alpha"].advertise())
    sr.submit("alpha", STAGE_ADVERTISE_KEYS, ad)
    sr.submit("alpha", STAGE_ADVERTISE_KEYS, ad)  # idempotent retry
    with pytest.raises(SecAggViolation, match="protocol site"):
        sr.submit("beta", STAGE_ADVERTISE_KEYS, ad)  # beta cannot advertise alpha's keys
    with pytest.raises(SecAggViolation, match="not open yet"):
        sr.submit("alpha", STAGE_SHARE_KEYS, ShareBundle(()))
    with pytest.raises(ValueError, match="unknown secure-aggregation stage"):
        sr.submit("alpha", "gossip", None)
    with pytest.raises(ValueError, match="bytes, expected"):
        sr.receive_upload("alpha", np.zeros(3, dtype="<u4").tobytes())

"""Secure aggregation under attack, in process: a hostile coordinator or a hostile site.

* Thresholds at or below about half the sites let a coordinator alone show two groups of sites
  different survivor lists and unmask every update (shown below with the check switched off);
  the config, every site and the coordinator refuse them (``2 t > holders + colluding_sites``).
* A malformed unmask answer (random, truncated, wrongly typed, missing or extra shares) is
  refused and left out; unmasking goes on with the others and the sum is exact.
* A consistent lie about a self-mask seed share aborts the round (the rebuilt seed misses the
  commitment its owner signed) instead of silently changing the sum.
* A badly signed advertisement or survivor signature leaves its sender out, not the round.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from _privacy_helpers import identity_keys
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.fixed_point import lift
from geoloco.algorithms.privacy import shamir
from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
from geoloco.algorithms.privacy.secagg_client import SecAggClient
from geoloco.algorithms.privacy.secagg_crypto import (
    ThresholdPolicy,
    add_masks,
    mask_key,
    num_chunks,
    secure_threshold,
    split_view_bound,
)
from geoloco.algorithms.privacy.secagg_messages import (
    EncryptedShare,
    KeyAdvertisement,
    RoundContext,
    SecAggAbort,
    SecAggViolation,
    UnmaskRequest,
    UnmaskResponse,
    survivors_signed_bytes,
)
from geoloco.algorithms.privacy.secagg_server import SecAggServer
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.site_agent.config import SiteAgentConfig

NUMEL, CHUNK = 60, 25


def _clients(n: int, context: RoundContext, policy: ThresholdPolicy | None = None) -> dict[int, SecAggClient]:
    keys = identity_keys(n)
    identities = {s: k.public_key() for s, k in keys.items()}
    return {s: SecAggClient(s, context, keys[s], identities, policy=policy) for s in range(n)}


def _inputs(n: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(7)
    return {s: rng.integers(-1000, 1000, NUMEL) for s in range(n)}


def _chunks(values: np.ndarray) -> list[np.ndarray]:
    return [values[i * CHUNK : (i + 1) * CHUNK] for i in range(num_chunks(NUMEL, CHUNK))]


def _to_unmask(n: int, context: RoundContext) -> tuple[SecAggServer, dict[int, SecAggClient], UnmaskRequest]:
    """A round with every site honest up to the unmask request (all survive)."""
    clients = _clients(n, context)
    server = SecAggServer(context)
    for s, c in clients.items():
        server.receive_advertisement(c.advertise(), c._identities[s])
    ads = server.advertisements()
    for s, c in clients.items():
        server.receive_shares(s, c.share_keys(ads))
    server.close_share_keys()
    for s, c in clients.items():
        c.receive_shares(server.shares_for(s))
        for index, data in c.masked_chunks(_chunks(_inputs(n)[s])):
            server.receive_masked_chunk(s, index, data)
    survivors = server.close_upload()
    for s in survivors:
        server.receive_signature(s, clients[s].sign_survivors(context.round_index, survivors))
    return server, clients, server.unmask_request()


# ---------------------------------------------------------------------------------------------
# 1. Thresholds that let a coordinator split the sites' views


def _split_view_attack(
    n: int, t: int, colluding: int = 0, policy: ThresholdPolicy | None = None
) -> dict[int, np.ndarray]:
    """A hostile coordinator, with the last ``colluding`` sites on its side: the honest sites are
    cut in two groups A and B; A is shown "A and the colluders survived, B dropped", B the
    opposite. Each honest site signs and answers one view only; the colluders sign both and hand
    over every share they hold. The coordinator then holds ``t`` shares of each honest site's
    self-mask seed (from its own group) *and* of its mask key (from the other): every honest
    update in the clear. Returns what it recovers, by honest site."""
    context = RoundContext(session="s", round_index=1, numel=NUMEL, chunk_size=CHUNK, threshold=t)
    clients = _clients(n, context, policy)
    ads = [c.advertise() for c in clients.values()]
    shares: dict[int, list[EncryptedShare]] = {s: [] for s in clients}
    for c in clients.values():
        for share in c.share_keys(ads):
            shares[share.recipient].append(share)
    masked: dict[int, bytes] = {}
    for s, c in clients.items():
        c.receive_shares(shares[s])
        masked[s] = b"".join(data for _, data in c.masked_chunks(_chunks(_inputs(n)[s])))
    honest, colluders = list(range(n - colluding)), tuple(range(n - colluding, n))
    half = len(honest) // 2
    groups = (tuple(honest[:half]), tuple(honest[half:]))
    seed_shares: dict[int, dict[int, bytes]] = {u: {} for u in honest}
    key_shares: dict[int, dict[int, bytes]] = {u: {} for u in honest}
    for group, dropped in (groups, groups[::-1]):
        survivors = tuple(sorted(group + colluders))
        signatures = {s: clients[s].sign_survivors(1, survivors) for s in group}
        for s in colluders:
            signatures[s] = clients[s]._identity.sign(survivors_signed_bytes("s", 1, survivors))
        request = UnmaskRequest(1, survivors, dropped, signatures)
        for s in group:
            answer = clients[s].unmask(request)
            for u, share in answer.self_mask_shares.items():
                if u in seed_shares:
                    seed_shares[u][s] = share
            for u, share in answer.mask_key_shares.items():
                key_shares[u][s] = share
    for s in colluders:
        for u, (seed_share, key_share) in clients[s]._held.items():
            if u in seed_shares:
                seed_shares[u][s], key_shares[u][s] = seed_share, key_share
    recovered: dict[int, np.ndarray] = {}
    for u in honest:
        seed = shamir.reconstruct(seed_shares[u], t)
        mask_private = X25519PrivateKey.from_private_bytes(shamir.reconstruct(key_shares[u], t))
        keys = [(mask_key(seed, "s", 1, site=u), 1)]
        for ad in ads:
            if ad.site != u:
                secret = mask_private.exchange(X25519PublicKey.from_public_bytes(ad.mask_public_key))
                keys.append((mask_key(secret, "s", 1, pair=(u, ad.site)), 1 if u < ad.site else -1))
        values = np.frombuffer(masked[u], dtype=np.uint32).copy()
        for index in range(num_chunks(NUMEL, CHUNK)):
            add_masks(keys, index, values[index * CHUNK : (index + 1) * CHUNK], subtract=True)
        recovered[u] = lift(values, 32).numpy()
    return recovered


def test_a_threshold_at_half_the_sites_lets_a_coordinator_split_views(monkeypatch: pytest.MonkeyPatch) -> None:
    # With the bound switched off, 2 of 4 hands the coordinator site 0's update in the clear.
    monkeypatch.setattr(ThresholdPolicy, "refusal", lambda *args: "")
    recovered = _split_view_attack(4, 2)
    for s in range(4):
        np.testing.assert_array_equal(recovered[s], _inputs(4)[s])
    # 3 of 4 (2 t > n): each half is below the threshold, so no honest site signs its view.
    with pytest.raises(SecAggViolation, match="below the threshold"):
        _split_view_attack(4, 3)


@pytest.mark.parametrize(("n", "t"), [(5, 3), (7, 4)])
def test_one_colluding_site_breaks_what_a_coordinator_declaring_none_may_pick_and_sites_refuse_it(
    n: int, t: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # t is the least threshold a coordinator declaring colluding_sites = 0 may pick...
    assert t == split_view_bound(n, 0)
    # ...and with one site on its side it unmasks every honest update (the site's check off).
    with monkeypatch.context() as patched:
        patched.setattr(ThresholdPolicy, "refusal", lambda *args: "")
        recovered = _split_view_attack(n, t, colluding=1, policy=ThresholdPolicy())
    assert sorted(recovered) == list(range(n - 1))
    for s, values in recovered.items():
        np.testing.assert_array_equal(values, _inputs(n)[s])
    # A site keeps its own assumption (default: one colluding site), whatever the round declares,
    # and refuses before a share or a masked value leaves it, saying what is allowed.
    with pytest.raises(SecAggViolation, match=(
        rf"refusing to share keys: threshold {t} of {n} share holders is below what this site accepts: "
        rf"2 t > holders \+ colluding_sites with colluding_sites = 1 \(this site assumes 1, the "
        rf"coordinator declared 0\) needs t >= {t + 1}.*allowed: t = {t + 1}..{n}\."
    )):
        _split_view_attack(n, t, colluding=1, policy=ThresholdPolicy())


@pytest.mark.parametrize("n", [4, 5, 6, 7, 9])
def test_the_default_thresholds_hold_against_one_colluding_site_and_sites_accept_them(n: int) -> None:
    assert PrivacyConfig().colluding_sites == 1  # the coordinator's default, as the sites'
    t = secure_threshold(None, n, 1)
    assert t == secure_threshold(None, n)  # one colluding site raises no default above 3 sites
    assert ThresholdPolicy().refusal(t, n) == ""
    with pytest.raises(SecAggViolation, match="below the threshold"):  # each view is short of t
        _split_view_attack(n, t, colluding=1, policy=ThresholdPolicy())


def test_a_site_policy_takes_the_stricter_assumption_and_its_own_minimum() -> None:
    policy = ThresholdPolicy()
    assert ThresholdPolicy(colluding_sites=0).refusal(2, 3) == ""
    assert "t >= 3" in policy.refusal(2, 3)  # 3 sites with one colluding: all must answer
    assert policy.minimum(5, declared_colluding=3) == split_view_bound(5, 3) == 5  # declaring more only raises
    assert "colluding_sites = 3 (this site assumes 1, the coordinator declared 3)" in policy.refusal(4, 5, 3)
    strict = ThresholdPolicy(min_threshold=5)
    why = strict.refusal(4, 5)
    assert "this site's min_threshold is 5" in why and "allowed: t = 5..5" in why and "2 t >" not in why
    assert "no threshold of 4 holders is allowed (this site needs t >= 5)" in strict.refusal(4, 4)
    assert "exceeds the 5 share holders" in policy.refusal(6, 5)
    for bad in ({"colluding_sites": -1}, {"min_threshold": 1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ThresholdPolicy(**bad)  # type: ignore[arg-type]


def test_a_site_agent_config_carries_its_own_threshold_policy() -> None:
    assert SiteAgentConfig().threshold_policy() == ThresholdPolicy(colluding_sites=1)
    config = SiteAgentConfig.from_dict({"colluding_sites": 2, "min_threshold": 4})
    assert config.threshold_policy() == ThresholdPolicy(colluding_sites=2, min_threshold=4)
    with pytest.raises(ConfigError, match="colluding_sites"):
        SiteAgentConfig(colluding_sites=-1)
    with pytest.raises(ConfigError, match="min_threshold.*>= 2"):
        SiteAgentConfig(min_threshold=1)


@pytest.mark.parametrize(("n", "t", "c"), [(4, 2, 0), (6, 3, 0), (5, 3, 1), (7, 5, 3)])
def test_sites_and_coordinator_refuse_a_threshold_below_the_bound(n: int, t: int, c: int) -> None:
    assert 2 * t <= n + c  # below the bound
    context = RoundContext(session="s", round_index=1, numel=NUMEL, chunk_size=CHUNK, threshold=t, colluding_sites=c)
    clients = _clients(n, context)
    ads = [cl.advertise() for cl in clients.values()]
    with pytest.raises(SecAggViolation, match=r"2 t > holders \+ colluding_sites"):
        clients[0].share_keys(ads)
    server = SecAggServer(context)
    for ad in ads:
        server.receive_advertisement(ad)
    with pytest.raises(SecAggAbort, match=f"t >= {split_view_bound(n, c)}"):
        server.advertisements()


def _coordinator(n: int, t: int | None, c: int, *, allowed: bool) -> CoordinatorConfig:
    privacy: dict[str, Any] = {"secure_aggregation": True, "clip_norm": 1.0, "colluding_sites": c}
    if t is not None:
        privacy["threshold"] = t
    data: dict[str, Any] = {"insecure": True, "min_sites": n, "privacy": privacy}
    if allowed:
        data["allowed_sites"] = [f"s{i}" for i in range(n)]
    return CoordinatorConfig.from_dict(data)


@pytest.mark.parametrize("allowed", [True, False])
@pytest.mark.parametrize(("n", "t", "c"), [(4, 2, 0), (6, 3, 0), (5, 3, 1)])
def test_config_refuses_a_threshold_below_the_bound(n: int, t: int, c: int, allowed: bool) -> None:
    with pytest.raises(ConfigError, match=r"privacy\.threshold.*2 t > holders \+ colluding_sites"):
        _coordinator(n, t, c, allowed=allowed)
    _coordinator(n, split_view_bound(n, c), c, allowed=allowed)  # the least safe threshold passes


def test_default_threshold_rises_with_colluding_sites_and_refuses_what_cannot_hold() -> None:
    assert [secure_threshold(None, 6, c) for c in range(5)] == [4, 4, 5, 5, 6]
    _coordinator(6, None, 5, allowed=True)  # t = 6: every site must answer
    with pytest.raises(ConfigError, match="colluding_sites"):
        _coordinator(6, None, 6, allowed=True)  # t = 7 would be needed, above the 6 holders


# ---------------------------------------------------------------------------------------------
# 2. Malformed unmask answers


def _corrupt(response: UnmaskResponse, how: str) -> UnmaskResponse:
    table = dict(response.self_mask_shares)
    owner = min(table)
    if how == "random":
        table[owner] = b"\xff" * shamir.SHARE_NBYTES  # above the field prime
    elif how == "truncated":
        table[owner] = table[owner][:-1]
    elif how == "wrong type":
        table[owner] = table[owner].hex()  # type: ignore[assignment]
    elif how == "missing":
        del table[owner]
    elif how == "extra":
        table[10**6] = table[owner]
    elif how == "not a mapping":
        return UnmaskResponse(response.site, response.round_index, [owner], response.mask_key_shares)  # type: ignore[arg-type]
    return UnmaskResponse(response.site, response.round_index, table, response.mask_key_shares)


@pytest.mark.parametrize("how", ["random", "truncated", "wrong type", "missing", "extra", "not a mapping"])
def test_a_malformed_unmask_answer_is_refused_and_the_sum_stays_exact(how: str) -> None:
    n = 4
    context = RoundContext(session="s", round_index=1, numel=NUMEL, chunk_size=CHUNK)
    server, clients, request = _to_unmask(n, context)
    responses = [clients[s].unmask(request) for s in range(n)]
    with pytest.raises(SecAggViolation, match="unmask answer of site 3"):
        server.receive_unmask(_corrupt(responses[3], how))
    for response in responses[:3]:  # t = 3 honest answers
        server.receive_unmask(response)
    np.testing.assert_array_equal(lift(server.result(), 32).numpy(), sum(_inputs(n).values()))


# ---------------------------------------------------------------------------------------------
# 3. A consistent lie about a seed share


def _lie(response: UnmaskResponse, owner: int) -> UnmaskResponse:
    """A well-formed share that is simply wrong (another field element)."""
    table = dict(response.self_mask_shares)
    value = (int.from_bytes(table[owner], "big") + 1) % shamir.PRIME
    table[owner] = value.to_bytes(shamir.SHARE_NBYTES, "big")
    return UnmaskResponse(response.site, response.round_index, table, response.mask_key_shares)


def test_a_lied_seed_share_aborts_the_round_instead_of_changing_the_sum() -> None:
    n = 4
    context = RoundContext(session="s", round_index=1, numel=NUMEL, chunk_size=CHUNK)
    server, clients, request = _to_unmask(n, context)
    responses = [clients[s].unmask(request) for s in range(n)]
    server.receive_unmask(_lie(responses[0], owner=2))  # site 0's share is among the first t used
    for response in responses[1:]:
        server.receive_unmask(response)
    with pytest.raises(SecAggAbort, match="site 2 .*does not match the commitment"):
        server.result()


def test_an_advertisement_without_a_seed_commitment_is_refused() -> None:
    context = RoundContext(session="s", round_index=1, numel=NUMEL, chunk_size=CHUNK)
    ad = _clients(3, context)[0].advertise()
    bare = KeyAdvertisement(ad.site, ad.session, ad.round_index, ad.cipher_public_key, ad.mask_public_key, ad.signature)
    with pytest.raises(SecAggViolation, match="seed commitment has 0 bytes"):
        SecAggServer(context).receive_advertisement(bare)


# ---------------------------------------------------------------------------------------------
# 5. One bad signature leaves its sender out, not the round


def test_a_badly_signed_advertisement_is_refused_by_the_coordinator() -> None:
    context = RoundContext(session="s", round_index=1, numel=NUMEL, chunk_size=CHUNK)
    clients = _clients(4, context)
    server = SecAggServer(context)
    impostor = Ed25519PrivateKey.generate()
    for s, c in clients.items():
        ad = c.advertise()
        if s == 3:
            ad = KeyAdvertisement(
                ad.site, ad.session, ad.round_index, ad.cipher_public_key, ad.mask_public_key,
                impostor.sign(ad.signed_bytes()), ad.seed_commitment,
            )
            with pytest.raises(SecAggViolation, match="not signed by its identity key"):
                server.receive_advertisement(ad, c._identities[s])
            continue
        server.receive_advertisement(ad, c._identities[s])
    ads = server.advertisements()
    assert [a.site for a in ads] == [0, 1, 2]
    for s in range(3):
        clients[s].share_keys(ads)  # the honest sites go on without site 3


def test_an_invalid_survivor_signature_is_not_counted_and_not_relayed() -> None:
    n = 4
    context = RoundContext(session="s", round_index=1, numel=NUMEL, chunk_size=CHUNK)
    _, clients, request = _to_unmask(n, context)
    # The site: an extra invalid signature among t valid ones does not count, nor stop it.
    forged = dict(request.signatures)
    forged[3] = bytes(64)
    response = clients[0].unmask(UnmaskRequest(request.round_index, request.survivors, request.dropped, forged))
    assert set(response.self_mask_shares) == set(range(n))
    # The coordinator refuses a bad signature on arrival, with the sender's identity known.
    context2 = RoundContext(session="s2", round_index=1, numel=NUMEL, chunk_size=CHUNK)
    clients2 = _clients(n, context2)
    server2 = SecAggServer(context2)
    for s, c in clients2.items():
        server2.receive_advertisement(c.advertise(), c._identities[s])
    ads = server2.advertisements()
    for s, c in clients2.items():
        server2.receive_shares(s, c.share_keys(ads))
    server2.close_share_keys()
    for s, c in clients2.items():
        c.receive_shares(server2.shares_for(s))
        for index, data in c.masked_chunks(_chunks(_inputs(n)[s])):
            server2.receive_masked_chunk(s, index, data)
    survivors = server2.close_upload()
    wrong = clients2[3]._identity.sign(survivors_signed_bytes("s2", 1, survivors[:3]))
    with pytest.raises(SecAggViolation, match="site 3's survivor-list signature is invalid"):
        server2.receive_signature(3, wrong)
    for s in range(3):
        server2.receive_signature(s, clients2[s].sign_survivors(1, survivors))
    assert set(server2.unmask_request().signatures) == {0, 1, 2}

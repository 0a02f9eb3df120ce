"""Secure aggregation: exact sums under dropouts, uniformity of one site's upload, attacks refused."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from _privacy_helpers import identity_keys, seeded_bytes
from scipy import stats

from geoloco.algorithms.fixed_point import lift
from geoloco.algorithms.privacy.secagg_client import SecAggClient
from geoloco.algorithms.privacy.secagg_crypto import default_threshold, neighbour_graph, num_chunks
from geoloco.algorithms.privacy.secagg_in_memory import SiteTraffic, StageCost, run_round_in_memory
from geoloco.algorithms.privacy.secagg_messages import (
    MIN_SITES,
    RoundContext,
    SecAggAbort,
    SecAggViolation,
    UnmaskRequest,
)
from geoloco.algorithms.privacy.secagg_server import SecAggServer


def _inputs(n: int, numel: int, rng: np.random.Generator, bound: int = 1 << 20) -> dict[int, np.ndarray]:
    return {s: rng.integers(-bound, bound, numel) for s in range(n)}


@pytest.mark.parametrize("case", range(6))
def test_secure_sum_is_exact_at_the_threshold(case: int) -> None:
    rng = np.random.default_rng(case)
    n = int(rng.integers(MIN_SITES, 8))
    numel = int(rng.integers(1, 3000))
    chunk = int(rng.integers(1, 700))
    t = default_threshold(n)
    dropped = [int(s) for s in rng.choice(n, size=n - t, replace=False)]
    half = len(dropped) // 2
    context = RoundContext(session="run-a", round_index=case, numel=numel, chunk_size=chunk)
    inputs = _inputs(n, numel, rng)
    total, survivors = run_round_in_memory(
        context, inputs, identity_keys(n),
        drop_before_upload=dropped[:half], drop_after_upload=dropped[half:],
    )
    # Sites dropped after uploading are still in the sum; sites dropped before are not.
    assert set(survivors) == set(range(n)) - set(dropped[:half])
    expected = sum(inputs[s] for s in survivors)
    np.testing.assert_array_equal(lift(total, 32).numpy(), expected)


def test_one_below_the_threshold_aborts() -> None:
    n, numel = 6, 100
    t = default_threshold(n)
    context = RoundContext(session="run-a", round_index=1, numel=numel, chunk_size=40)
    inputs = _inputs(n, numel, np.random.default_rng(1))
    # t - 1 uploads: the server refuses to even ask for shares.
    with pytest.raises(SecAggAbort, match="aborted and nothing is revealed"):
        run_round_in_memory(context, inputs, identity_keys(n), drop_before_upload=range(t - 1, n))
    # All upload, but only t - 1 answer the unmask step.
    with pytest.raises(SecAggAbort, match="threshold"):
        run_round_in_memory(context, inputs, identity_keys(n), drop_after_upload=range(t - 1, n))


def test_modulus_16_and_8_bits_wrap_consistently() -> None:
    rng = np.random.default_rng(3)
    for bits, bound in ((16, 1000), (8, 10)):
        context = RoundContext(session="s", round_index=0, numel=257, chunk_size=100, modulus_bits=bits)
        inputs = _inputs(4, 257, rng, bound)
        total, _ = run_round_in_memory(context, inputs, identity_keys(4))
        assert total.dtype.itemsize == bits // 8
        np.testing.assert_array_equal(lift(total, bits).numpy(), sum(inputs.values()))


def test_secagg_plus_graph_is_sparse_and_still_exact() -> None:
    n = 20
    graph = neighbour_graph(range(n), "secagg+", session="s", round_index=2)
    degrees = {len(v) for v in graph.values()}
    assert max(degrees) < n - 1 and min(degrees) >= 2
    assert all(u in graph[v] for u in graph for v in graph[u])  # symmetric
    rng = np.random.default_rng(4)
    context = RoundContext(session="s", round_index=2, numel=500, chunk_size=128, neighbours="secagg+")
    inputs = _inputs(n, 500, rng)
    total, survivors = run_round_in_memory(context, inputs, identity_keys(n), drop_after_upload=[0, 7])
    np.testing.assert_array_equal(lift(total, 32).numpy(), sum(inputs[s] for s in survivors))


def _prepared(n: int, numel: int = 64, seed: int = 0, round_index: int = 5) -> tuple[
    RoundContext, dict[int, SecAggClient], SecAggServer
]:
    keys = identity_keys(n)
    identities = {s: k.public_key() for s, k in keys.items()}
    context = RoundContext(session="run-a", round_index=round_index, numel=numel, chunk_size=32)
    clients = {
        s: SecAggClient(s, context, keys[s], identities, random_bytes=seeded_bytes(seed * 100 + s))
        for s in range(n)
    }
    return context, clients, SecAggServer(context)


def _through_shares(clients: dict[int, SecAggClient], server: SecAggServer) -> None:
    for client in clients.values():
        server.receive_advertisement(client.advertise())
    ads = server.advertisements()
    for s, client in clients.items():
        server.receive_shares(s, client.share_keys(ads))
    server.close_share_keys()
    for s, client in clients.items():
        client.receive_shares(server.shares_for(s))


def test_one_sites_upload_alone_is_uniform() -> None:
    # The site's input is all zeros (maximally structured); its masked upload must look uniform.
    numel = 1 << 16
    context, clients, server = _prepared(4, numel=numel, seed=11)
    _through_shares(clients, server)
    masked = np.frombuffer(
        b"".join(clients[0].mask_chunk(i, np.zeros(min(32, numel - 32 * i), dtype=np.int64))
                 for i in range(num_chunks(numel, 32))),
        dtype="<u4",
    )
    for values in (masked >> 24, masked & 0xFF):  # high and low bytes
        observed = np.bincount(values.astype(np.int64), minlength=256)
        chi2 = float(((observed - numel / 256) ** 2 / (numel / 256)).sum())
        assert chi2 < stats.chi2.ppf(0.999, df=255), chi2


def test_coordinator_never_holds_an_individual_update() -> None:
    n, numel = 4, 96
    context, clients, server = _prepared(n, numel=numel, seed=2)
    inputs = _inputs(n, numel, np.random.default_rng(9), bound=1 << 10)
    plain = {s: (x & 0xFFFFFFFF).astype("<u4").tobytes() for s, x in inputs.items()}
    _through_shares(clients, server)

    def assert_nothing_individual() -> None:
        seen = []

        def walk(obj: object, depth: int = 0) -> None:
            if depth > 6:
                return
            if isinstance(obj, np.ndarray):
                seen.append(obj.astype("<u4").tobytes())
            elif isinstance(obj, (bytes, bytearray)):
                seen.append(bytes(obj))
            elif isinstance(obj, dict):
                for k, v in obj.items():
                    walk(k, depth + 1)
                    walk(v, depth + 1)
            elif isinstance(obj, (list, tuple, set, frozenset)):
                for v in obj:
                    walk(v, depth + 1)
            elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
                for f in dataclasses.fields(obj):
                    walk(getattr(obj, f.name), depth + 1)
            elif hasattr(obj, "__dict__"):
                walk(vars(obj), depth + 1)

        walk(server)
        for blob in seen:
            for s, p in plain.items():
                assert p not in blob, f"coordinator state holds site {s}'s unmasked input"

    for s, client in clients.items():
        for index in range(num_chunks(numel, 32)):
            server.receive_masked_chunk(s, index, client.mask_chunk(index, inputs[s][index * 32 : (index + 1) * 32]))
            assert_nothing_individual()
        client.finish_upload()
    survivors = server.close_upload()
    for s in survivors:
        server.receive_signature(s, clients[s].sign_survivors(context.round_index, survivors))
    request = server.unmask_request()
    for s in survivors:
        server.receive_unmask(clients[s].unmask(request))
    assert_nothing_individual()
    np.testing.assert_array_equal(lift(server.result(), 32).numpy(), sum(inputs.values()))


def test_substituted_key_is_refused() -> None:
    _, clients, server = _prepared(4)
    for client in clients.values():
        server.receive_advertisement(client.advertise())
    ads = server.advertisements()
    # The coordinator swaps site 2's mask key for one it controls.
    forged = dataclasses.replace(ads[2], mask_public_key=ads[3].mask_public_key)
    with pytest.raises(SecAggViolation, match="not signed by its identity key"):
        clients[0].share_keys([ads[0], ads[1], forged, ads[3]])


def test_replayed_round_messages_are_refused() -> None:
    _, old_clients, old_server = _prepared(4, round_index=4)
    for client in old_clients.values():
        old_server.receive_advertisement(client.advertise())
    old_ads = old_server.advertisements()
    _, clients, server = _prepared(4, round_index=5)
    for client in clients.values():
        server.receive_advertisement(client.advertise())
    ads = server.advertisements()
    with pytest.raises(SecAggViolation, match="replayed"):
        clients[0].share_keys([ads[0], old_ads[1], ads[2], ads[3]])
    # A signed advertisement whose round field is rewritten fails the signature at its
    # neighbours instead (every site is one with the full graph), and at itself as altered.
    rewritten = dataclasses.replace(old_ads[1], round_index=5)
    with pytest.raises(SecAggViolation, match="not signed"):
        clients[0].share_keys([ads[0], rewritten, ads[2], ads[3]])
    with pytest.raises(SecAggViolation, match="its own advertisement is missing or altered"):
        clients[1].share_keys([ads[0], rewritten, ads[2], ads[3]])


def test_replayed_share_of_another_round_fails_authentication() -> None:
    _, clients, server = _prepared(4)
    for client in clients.values():
        server.receive_advertisement(client.advertise())
    ads = server.advertisements()
    for s, client in clients.items():
        server.receive_shares(s, client.share_keys(ads))
    server.close_share_keys()
    shares = server.shares_for(0)
    bad = [dataclasses.replace(shares[0], round_index=4)] + shares[1:]
    with pytest.raises(SecAggViolation, match="round 4"):
        clients[0].receive_shares(bad)


def _uploaded(n: int = 4) -> tuple[RoundContext, dict[int, SecAggClient], SecAggServer, list[int]]:
    context, clients, server = _prepared(n)
    _through_shares(clients, server)
    for s, client in clients.items():
        for index in range(num_chunks(context.numel, 32)):
            server.receive_masked_chunk(s, index, client.mask_chunk(index, np.arange(32) + s))
        client.finish_upload()
    survivors = server.close_upload()
    return context, clients, server, survivors


def test_request_for_both_shares_of_one_site_is_refused() -> None:
    context, clients, server, survivors = _uploaded()
    for s in survivors:
        server.receive_signature(s, clients[s].sign_survivors(context.round_index, survivors))
    honest = server.unmask_request()
    evil = UnmaskRequest(honest.round_index, honest.survivors, (2,), honest.signatures)
    with pytest.raises(SecAggViolation, match="both the self-mask share and the mask-key share"):
        clients[0].unmask(evil)
    # Asking a second time after an honest answer is refused too.
    clients[1].unmask(honest)
    with pytest.raises(SecAggViolation, match="out-of-order or repeated"):
        clients[1].unmask(evil)


def test_inconsistent_survivor_lists_are_refused() -> None:
    context, clients, server, survivors = _uploaded()
    # The coordinator tells site 0 that site 3 dropped (to get site 3's mask key share)
    # while the others signed a list with site 3 in it.
    with pytest.raises(SecAggViolation, match="not listed as a survivor"):
        clients[3].sign_survivors(context.round_index, [0, 1, 2])
    signatures = {s: clients[s].sign_survivors(context.round_index, survivors) for s in (1, 2, 3)}
    clients[0].sign_survivors(context.round_index, [0, 1, 2])
    request = UnmaskRequest(context.round_index, (0, 1, 2), (3,), signatures)
    with pytest.raises(SecAggViolation, match="valid survivor signatures|signature"):
        clients[0].unmask(request)


def test_fewer_than_three_sites_is_refused() -> None:
    context = RoundContext(session="s", round_index=0, numel=8, chunk_size=8)
    with pytest.raises(SecAggAbort, match="at least 3"):
        run_round_in_memory(context, {0: np.zeros(8), 1: np.zeros(8)}, identity_keys(2))


def test_resent_chunk_is_idempotent_and_altered_chunk_rejected() -> None:
    context, clients, server = _prepared(3)
    _through_shares(clients, server)
    data = clients[0].mask_chunk(0, np.arange(32))
    server.receive_masked_chunk(0, 0, data)
    server.receive_masked_chunk(0, 0, data)
    with pytest.raises(ValueError, match="different bytes"):
        server.receive_masked_chunk(0, 0, bytes(len(data)))
    with pytest.raises(ValueError, match="outside"):
        server.receive_masked_chunk(0, 99, data)


def test_masks_of_distinct_chunks_and_rounds_differ() -> None:
    from geoloco.algorithms.privacy.secagg_crypto import keystream, mask_key

    secret = random.Random(0).randbytes(32)
    k5 = mask_key(secret, "s", 5, pair=(1, 2))
    assert k5 == mask_key(secret, "s", 5, pair=(2, 1))
    assert k5 != mask_key(secret, "s", 6, pair=(1, 2)) != mask_key(secret, "t", 5, pair=(1, 2))
    assert k5 != mask_key(secret, "s", 5, site=1)
    assert keystream(k5, 0, 64) != keystream(k5, 1, 64)


def test_messages_round_trip_through_bytes_and_tampering_is_caught() -> None:
    from geoloco.algorithms.privacy.secagg_messages import message_from_bytes, message_to_bytes

    context, clients, server, survivors = _uploaded()
    ads = server.advertisements()
    assert [message_from_bytes(message_to_bytes(a)) for a in ads] == ads
    for s in survivors:
        server.receive_signature(s, clients[s].sign_survivors(context.round_index, survivors))
    request = server.unmask_request()
    wire = message_from_bytes(message_to_bytes(request))
    assert wire == request
    response = clients[0].unmask(wire)
    assert message_from_bytes(message_to_bytes(response)) == response
    with pytest.raises(ValueError, match="malformed"):
        message_from_bytes(b'{"type": "Nope", "body": {}}')
    # A request re-encoded with a survivor moved to "dropped" is refused by the site.
    tampered = message_to_bytes(request).replace(b'"dropped": []', b'"dropped": [1]')
    with pytest.raises(SecAggViolation, match="both the self-mask share"):
        clients[2].unmask(message_from_bytes(tampered))


def test_traffic_counts_the_masked_upload_at_the_modulus_width() -> None:
    n, numel = 4, 1000
    for bits in (32, 16):
        context = RoundContext(session="s", round_index=0, numel=numel, chunk_size=300, modulus_bits=bits)
        traffic: dict[int, SiteTraffic] = {}
        run_round_in_memory(context, _inputs(n, numel, np.random.default_rng(0), 100), identity_keys(n),
                            traffic=traffic)
        payload = numel * bits // 8
        for s in range(n):
            # Masked values at b/8 bytes each, plus a few kilobytes of keys, shares and signatures.
            assert traffic[s].masked_up == payload, traffic
            assert payload < traffic[s].up < payload + 4096, traffic
            assert all(v > 0 for v in dataclasses.astuple(traffic[s])), traffic


def test_server_refuses_an_advertisement_for_another_round_or_session() -> None:
    """A replayed or misrouted key advertisement is a protocol violation the coordinator can turn
    into INVALID_ARGUMENT, not an error of its own."""
    context, clients, server = _prepared(4, seed=3)
    ad = clients[0].advertise()
    for changed in ({"round_index": context.round_index + 1}, {"session": context.session + "-old"}):
        with pytest.raises(SecAggViolation, match="another round or session"):
            server.receive_advertisement(dataclasses.replace(ad, **changed))
    server.receive_advertisement(ad)


def test_with_the_secagg_plus_graph_a_site_checks_only_its_neighbours_keys_and_signatures() -> None:
    n = 24
    keys = identity_keys(n)
    identities = {s: k.public_key() for s, k in keys.items()}
    context = RoundContext(session="run-a", round_index=5, numel=64, chunk_size=32, neighbours="secagg+")
    clients = {
        s: SecAggClient(s, context, keys[s], identities, random_bytes=seeded_bytes(s)) for s in range(n)
    }
    server = SecAggServer(context)
    for client in clients.values():
        server.receive_advertisement(client.advertise())
    ads = server.advertisements()
    graph = neighbour_graph(range(n), "secagg+", session="run-a", round_index=5)
    assert all(len(graph[s]) < n - 1 for s in range(n))  # sparse: not every site is a neighbour
    # The coordinator corrupts site 7's keys: exactly its neighbours, who would use them, refuse.
    forged = [dataclasses.replace(ad, mask_public_key=bytes(32)) if ad.site == 7 else ad for ad in ads]
    refused = set()
    for s, client in clients.items():
        if s == 7:
            continue
        try:
            client.share_keys(forged)
        except SecAggViolation as why:
            assert "not signed by its identity key" in str(why)
            refused.add(s)
    assert refused == set(graph[7])
    # The whole round over the sparse graph still sums exactly, with one site dropped after upload.
    inputs = {s: np.random.default_rng(s).integers(0, 2**32, 64, dtype=np.uint32) for s in range(n)}
    stages: dict[str, StageCost] = {}
    total, survivors = run_round_in_memory(
        context, inputs, keys, drop_after_upload=[3], random_bytes=seeded_bytes(99), stages=stages
    )
    expected = np.zeros(64, dtype=np.uint64)
    for s in survivors:
        expected += inputs[s]
    assert survivors == tuple(range(n)) and np.array_equal(total.astype(np.uint64), expected % 2**32)
    assert list(stages) == ["advertise_keys", "share_keys", "masked_input", "consistency", "unmask"]
    assert stages["masked_input"].bytes_up == n * 64 * 4
    assert all(cost.seconds > 0 and cost.bytes_up > 0 for cost in stages.values())

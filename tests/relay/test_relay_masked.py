"""Masked partial sums (pure, no gRPC): a relay's ring sum of its sites' masked uploads enters
the secure-aggregation sum like one upload, every listed site becomes a survivor, a site missing
from every upload is dropped and its masks are removed as usual."""

from __future__ import annotations

import re

import numpy as np
import pytest

from geoloco.algorithms.aggregation import RunningSum
from geoloco.algorithms.engine import UNSCREENED, RoundEngine
from geoloco.algorithms.fixed_point import lift
from geoloco.algorithms.privacy.secagg_client import SecAggClient
from geoloco.algorithms.privacy.secagg_crypto import num_chunks
from geoloco.algorithms.privacy.secagg_messages import RoundContext
from geoloco.algorithms.privacy.secagg_server import SecAggServer
from geoloco.algorithms.round import RoundPolicy
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.errors import InvalidUpdateError
from geoloco.protos.wire_manifests import blob_manifest
from geoloco.relay.masked import MaskedSum, SecureRun, check_masked_manifest
from geoloco.relay.partial import RelayRound, RelayWait

NUMEL, CHUNK = 50, 16


def _keys(n: int):  # type: ignore[no-untyped-def]
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return {s: Ed25519PrivateKey.generate() for s in range(n)}


def _shared(n: int) -> tuple[RoundContext, dict[int, SecAggClient], SecAggServer]:
    """Stages 1-2 of a round with ``n`` sites, every site sharing keys."""
    context = RoundContext(session="relayed", round_index=3, numel=NUMEL, chunk_size=CHUNK)
    keys = _keys(n)
    identities = {s: k.public_key() for s, k in keys.items()}
    clients = {s: SecAggClient(s, context, keys[s], identities) for s in range(n)}
    server = SecAggServer(context)
    for s, client in clients.items():
        server.receive_advertisement(client.advertise(), identities[s])
    ads = server.advertisements()
    for s, client in clients.items():
        server.receive_shares(s, client.share_keys(ads))
    server.close_share_keys()
    for s, client in clients.items():
        client.receive_shares(server.shares_for(s))
    return context, clients, server


def _masked(client: SecAggClient, values: np.ndarray) -> bytes:
    chunks = (values[i * CHUNK : (i + 1) * CHUNK] for i in range(num_chunks(NUMEL, CHUNK)))
    return b"".join(data for _, data in client.masked_chunks(chunks))


def _send_partial(server: SecAggServer, sites: list[int], data: bytes) -> None:
    step = CHUNK * 4
    for index, start in enumerate(range(0, len(data), step)):
        server.receive_masked_partial(sites, index, data[start : start + step])


def test_relay_partials_unmask_to_the_survivors_sum_with_a_site_dropped_after_sharing_keys() -> None:
    context, clients, server = _shared(5)
    rng = np.random.default_rng(0)
    inputs = {s: rng.integers(-(1 << 20), 1 << 20, NUMEL) for s in range(5)}
    masked = {s: _masked(clients[s], inputs[s]) for s in range(4)}  # site 4 drops after sharing keys
    secure = SecureRun(modulus_bits=32, chunk_size=CHUNK)
    forwarded = {}
    for relay, sites in {"eu": [0, 1], "us": [2, 3]}.items():
        ring = MaskedSum(NUMEL, secure)
        for s in sites:
            ring.add(str(s), masked[s])
        forwarded[relay] = ring.to_bytes()
        _send_partial(server, sites, forwarded[relay])
    # The relay forwards the ring sum: neither site's masked vector alone.
    assert all(forwarded["eu"] != masked[s] for s in (0, 1))
    survivors = server.close_upload()
    assert survivors == [0, 1, 2, 3] and server.dropped == (4,)
    for s in survivors:
        server.receive_signature(s, clients[s].sign_survivors(context.round_index, survivors))
    request = server.unmask_request()
    for s in survivors:
        server.receive_unmask(clients[s].unmask(request))
    total = lift(server.result(), 32).numpy()
    np.testing.assert_array_equal(total, sum(inputs[s] for s in range(4)))


def test_a_site_is_in_one_upload_only() -> None:
    _context, clients, server = _shared(4)
    data = _masked(clients[0], np.zeros(NUMEL, dtype=np.int64))
    server.receive_masked_partial([0, 1], 0, data[: CHUNK * 4])
    server.receive_masked_partial([1, 0], 0, data[: CHUNK * 4])  # the same partial resent: ignored
    with pytest.raises(ValueError, match="resent chunk 0 with different bytes"):
        server.receive_masked_partial([0, 1], 0, bytes(CHUNK * 4))
    with pytest.raises(ValueError, match="relay's partial sum"):
        server.receive_masked_chunk(0, 1, data[CHUNK * 4 : CHUNK * 8])
    with pytest.raises(ValueError, match="another upload"):
        server.receive_masked_partial([1, 2], 1, data[CHUNK * 4 : CHUNK * 8])
    server.receive_masked_chunk(3, 0, data[: CHUNK * 4])
    with pytest.raises(ValueError, match="another upload"):
        server.receive_masked_partial([2, 3], 0, data[: CHUNK * 4])
    with pytest.raises(ValueError, match="distinct sites"):
        server.receive_masked_partial([2, 2], 0, data[: CHUNK * 4])


def test_the_ring_sum_wraps_at_the_modulus() -> None:
    secure = SecureRun(modulus_bits=8, chunk_size=4)
    ring = MaskedSum(3, secure)
    ring.add("a", bytes([200, 1, 255]))
    ring.add("b", bytes([100, 2, 1]))
    assert ring.to_bytes() == bytes([44, 3, 0])
    assert ring.sites == ["a", "b"]
    with pytest.raises(ValueError, match="already in the ring sum"):
        ring.add("a", bytes(3))
    with pytest.raises(ValueError, match="4 values"):
        ring.add("c", bytes(4))


def test_a_relay_refuses_an_upload_that_cannot_be_masked_in_a_secure_run() -> None:
    secure = SecureRun(modulus_bits=32, chunk_size=16)

    def manifest(codec: str, dtype: str, nbytes: int, chunk: int) -> pb.UploadManifest:
        data = bytes(nbytes)
        return pb.UploadManifest(blob=blob_manifest(data, codec=codec, shape=[NUMEL], dtype=dtype, chunk_size=chunk))

    check_masked_manifest(manifest("secagg", "uint32", NUMEL * 4, 64), secure, NUMEL)
    for bad, needle in [
        (manifest("none", "float32", NUMEL * 4, 64), "uploads must be masked (codec 'secagg')"),
        (manifest("secagg", "uint16", NUMEL * 2, 32), "expected uint32 [n]"),
        (manifest("secagg", "uint32", NUMEL * 4, 128), "in chunks of 64 (one protocol chunk each)"),
    ]:
        with pytest.raises(InvalidUpdateError, match=re.escape(needle)):
            check_masked_manifest(bad, secure, NUMEL)
    assert SecureRun.of('{"privacy": {"secure_aggregation": true, "modulus_bits": 16, "chunk_size": 8}}') == (
        SecureRun(modulus_bits=16, chunk_size=8)
    )
    assert SecureRun.of('{"privacy": {"secure_aggregation": false}}') is None


def test_a_secure_partial_does_not_wait_for_a_site_that_withdrew() -> None:
    secure = SecureRun(modulus_bits=32, chunk_size=16)
    engine = RoundEngine(None, RoundPolicy(), None, close=RelayWait(max_wait_s=30.0))
    r = RelayRound(number=2, opened_s=0.0, shape=(NUMEL,))
    r.core = engine.open(2, RunningSum(numel=NUMEL), 0.0)
    engine.maybe_start(r.core, 0.0, members=2)
    buffer = bytearray(b"\x01" * NUMEL * 4)
    r.buffers["site-a"] = buffer
    r.add_masked("site-a", memoryview(buffer), secure, inner_steps=3, upload_bytes=NUMEL * 4)
    engine.admit(r.core, "site-a", None, 1.0, screen=UNSCREENED, now=0.5)
    assert buffer == bytes(NUMEL * 4)  # the site's masked upload is gone once in the ring sum
    assert r.masked is not None and r.masked.to_bytes() == b"\x01" * NUMEL * 4 and r.weight == 1.0
    live = {"site-a", "site-b"}
    assert not engine.decide(r.core, now=1.0, expected=live - r.withdrawn).close
    r.withdrawn.add("site-b")  # its withdraw stage call passed through the relay
    assert engine.decide(r.core, now=1.0, expected=live - r.withdrawn).close

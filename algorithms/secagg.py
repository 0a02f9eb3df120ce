"""Secure aggregation: the coordinator learns the sum of the sites' integer vectors, never one site's.

Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine Learning", CCS 2017,
with the optional sparse neighbour graph of Bell et al., "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead", CCS 2020 ("SecAgg+"). Split the way Flower splits it: pure crypto
helpers, a site's state machine and the coordinator's workflow, with the protocol stages as named
constants. No I/O: the coordinator and site agent move the messages over gRPC (translated to
protobuf in ``geoloco.protos.secagg_wire``), the simulator passes them in memory.

Modules (this one re-exports their public names and runs a whole round in memory):

- ``secagg_crypto``: X25519 / HKDF / ChaCha20 mask PRG helpers, the neighbour graph, ``site_index``.
- ``secagg_messages``: stage constants, ``SecAggViolation`` / ``SecAggAbort``, ``RoundContext``
  and the protocol messages, and the exact byte strings that signatures cover.
- ``secagg_client``: ``SecAggClient``, a site's state machine.
- ``secagg_server``: ``SecAggServer``, the coordinator's workflow.
- ``secagg_stages``: what each stage call of the real system carries either way
  (``AdvertiseKeys``, ``Advertisements``, ``ShareBundle``, ...), ``StageReply``.

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
   before it shares keys), so two disjoint groups of honest sites can never both reach ``t``: the
   coordinator cannot tell different sites different survivor sets.
5. ``STAGE_UNMASK`` — a site returns, for every survivor, its share of ``b_u`` and for every
   dropped site its share of ``s_u`` — never both for one site, and only once per round. With
   ``t`` answers the coordinator removes the self-masks of survivors and the pairwise masks the
   survivors shared with dropped sites: the exact integer sum is left. Fewer than ``t`` answers:
   ``SecAggAbort``, nothing is revealed. A malformed answer is refused; a rebuilt seed that
   misses its commitment (or mask key that misses its public key) aborts the round.

Honest sites raise ``SecAggViolation`` (with the reason) on any detected misbehaviour. With fewer
than 3 sites a sum reveals the other site's input to each of them, so a round needs at least
``MIN_SITES``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from geoloco.algorithms.secagg_client import SecAggClient
from geoloco.algorithms.secagg_crypto import (
    NeighbourMode,
    RandomBytes,
    check_threshold,
    default_threshold,
    keystream,
    keystream_into,
    mask_key,
    neighbour_graph,
    num_chunks,
    public_bytes,
    secure_threshold,
    seed_commitment,
    site_index,
    split_view_bound,
)
from geoloco.algorithms.secagg_messages import (
    MIN_SITES,
    STAGE_ADVERTISE_KEYS,
    STAGE_CONSISTENCY,
    STAGE_MASKED_INPUT,
    STAGE_SHARE_KEYS,
    STAGE_UNMASK,
    STAGE_UNMASK_RESPONSE,
    STAGE_WITHDRAW,
    STAGES,
    EncryptedShare,
    KeyAdvertisement,
    ProtocolMessage,
    RoundContext,
    SecAggAbort,
    SecAggViolation,
    UnmaskRequest,
    UnmaskResponse,
    message_from_bytes,
    message_to_bytes,
    pack_messages,
    unpack_messages,
)
from geoloco.algorithms.secagg_server import SecAggServer
from geoloco.algorithms.secagg_stages import (
    STAGE_REPLIES,
    STAGE_REQUESTS,
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

__all__ = [
    "MIN_SITES",
    "STAGES",
    "STAGE_ADVERTISE_KEYS",
    "STAGE_CONSISTENCY",
    "STAGE_MASKED_INPUT",
    "STAGE_REPLIES",
    "STAGE_REQUESTS",
    "STAGE_SHARE_KEYS",
    "STAGE_UNMASK",
    "STAGE_UNMASK_RESPONSE",
    "STAGE_WITHDRAW",
    "AdvertiseKeys",
    "Advertisements",
    "EncryptedShare",
    "IdentityBinding",
    "KeyAdvertisement",
    "NeighbourMode",
    "ProtocolMessage",
    "RandomBytes",
    "RoundContext",
    "SecAggAbort",
    "SecAggClient",
    "SecAggServer",
    "SecAggViolation",
    "ShareBundle",
    "StageMessage",
    "StageReply",
    "SurvivorList",
    "SurvivorSignature",
    "UnmaskRequest",
    "UnmaskResponse",
    "check_stage_message",
    "check_threshold",
    "default_threshold",
    "keystream",
    "keystream_into",
    "mask_key",
    "message_from_bytes",
    "message_to_bytes",
    "neighbour_graph",
    "num_chunks",
    "pack_messages",
    "public_bytes",
    "run_round_in_memory",
    "secure_threshold",
    "seed_commitment",
    "site_index",
    "split_view_bound",
    "unpack_messages",
]


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
        server.receive_advertisement(ad, identities[site])
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

"""One whole secure-aggregation round with every party in this process.

The simulator (``geoloco.algorithms.privacy.private_aggregation``), tests and benchmarks run the real protocol here
(``SecAggClient`` and ``SecAggServer`` passing their messages in memory), not an exact-sum
shortcut, so what they measure and check is what the coordinator and the sites do over gRPC.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from geoloco.algorithms.privacy.secagg_client import SecAggClient
from geoloco.algorithms.privacy.secagg_crypto import RandomBytes, num_chunks
from geoloco.algorithms.privacy.secagg_messages import RoundContext, message_to_bytes
from geoloco.algorithms.privacy.secagg_server import SecAggServer

__all__ = ["run_round_in_memory"]


def run_round_in_memory(
    context: RoundContext,
    inputs: Mapping[int, np.ndarray],
    identity_keys: Mapping[int, Ed25519PrivateKey],
    *,
    drop_before_upload: Iterable[int] = (),
    drop_after_upload: Iterable[int] = (),
    random_bytes: RandomBytes = os.urandom,
    traffic: dict[int, int] | None = None,
    masked_traffic: dict[int, int] | None = None,
) -> tuple[np.ndarray, tuple[int, ...]]:
    """One whole secure round with every party in this process (simulator, tests, benchmarks).

    ``drop_before_upload`` sites vanish after sharing keys, ``drop_after_upload`` sites after
    uploading (they answer nothing more). Returns the sum in ``Z_{2^b}`` and the survivors; raises
    ``SecAggAbort`` when too few sites remain. ``traffic``, when given, receives each site's
    upload bytes (messages as ``message_to_bytes`` encodes them, plus the masked chunks);
    ``masked_traffic`` the masked chunks' part of them (what a relay adds into its ring sum
    instead of passing it on, ``geoloco.algorithms.simulation.sim_regions``).
    """
    sent: dict[int, int] = {s: 0 for s in inputs}
    masked: dict[int, int] = {s: 0 for s in inputs}
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
            masked[site] += len(data)
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
    if masked_traffic is not None:
        masked_traffic.update(masked)
    return server.result(), server.survivors

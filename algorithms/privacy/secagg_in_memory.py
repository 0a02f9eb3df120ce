"""One whole secure-aggregation round with every party in this process.

The simulator (``geoloco.algorithms.privacy.private_aggregation``), tests and benchmarks run the real protocol here
(``SecAggClient`` and ``SecAggServer`` passing their messages in memory), not an exact-sum
shortcut, so what they measure and check is what the coordinator and the sites do over gRPC.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from geoloco.algorithms.privacy.secagg_client import SecAggClient
from geoloco.algorithms.privacy.secagg_crypto import RandomBytes, num_chunks
from geoloco.algorithms.privacy.secagg_messages import RoundContext, message_to_bytes
from geoloco.algorithms.privacy.secagg_server import SecAggServer

__all__ = ["SiteTraffic", "StageCost", "run_round_in_memory"]


def run_round_in_memory(
    context: RoundContext,
    inputs: Mapping[int, np.ndarray],
    identity_keys: Mapping[int, Ed25519PrivateKey],
    *,
    drop_before_upload: Iterable[int] = (),
    drop_after_upload: Iterable[int] = (),
    random_bytes: RandomBytes = os.urandom,
    traffic: dict[int, SiteTraffic] | None = None,
    stages: dict[str, StageCost] | None = None,
) -> tuple[np.ndarray, tuple[int, ...]]:
    """One whole secure round with every party in this process (simulator, tests, benchmarks).

    ``drop_before_upload`` sites vanish after sharing keys, ``drop_after_upload`` sites after
    uploading (they answer nothing more). Returns the sum in ``Z_{2^b}`` and the survivors; raises
    ``SecAggAbort`` when too few sites remain. ``traffic``, when given, receives each site's
    ``SiteTraffic``: its bytes each way in each stage call, messages as ``message_to_bytes``
    encodes them (the simulator's clock times the stages with them). ``stages``, when
    given, receives each stage's ``StageCost``: the seconds every party spent in it together, and
    the bytes up (sites to the coordinator) and down (the coordinator to every site), messages
    sized as ``message_to_bytes`` encodes them.
    """
    clock = _StageClock(stages)
    sent = {s: SiteTraffic() for s in inputs}
    identities = {s: k.public_key() for s, k in identity_keys.items()}
    clients = {
        s: SecAggClient(s, context, identity_keys[s], identities, random_bytes=random_bytes) for s in inputs
    }
    server = SecAggServer(context)
    with clock.stage("advertise_keys") as cost:
        for site, client in clients.items():
            ad = client.advertise()
            sent[site].advertise_up = cost.up(len(message_to_bytes(ad)))
            server.receive_advertisement(ad, identities[site])
        server.advertisements()
        sites = server.sites
        ads = {site: server.advertisements_for(site) for site in clients}
        for site in clients:
            sent[site].advertise_down = cost.down(
                4 * len(sites) + sum(len(message_to_bytes(ad)) for ad in ads[site])
            )
    with clock.stage("share_keys") as cost:
        for site, client in clients.items():
            shares = client.share_keys(ads[site], sites)
            sent[site].share_up = cost.up(sum(len(message_to_bytes(x)) for x in shares))
            server.receive_shares(site, shares)
        server.close_share_keys()
    before, after = set(drop_before_upload), set(drop_after_upload)
    with clock.stage("masked_input") as cost:
        for site, client in clients.items():
            delivered = server.shares_for(site)
            sent[site].share_down = cost.down(sum(len(message_to_bytes(x)) for x in delivered))
            client.receive_shares(delivered)
            if site in before:
                continue
            chunks = (
                inputs[site][i * context.chunk_size : (i + 1) * context.chunk_size]
                for i in range(num_chunks(context.numel, context.chunk_size))
            )
            for index, data in client.masked_chunks(chunks):
                sent[site].masked_up += cost.up(len(data))
                server.receive_masked_chunk(site, index, data)
        survivors = server.close_upload()
    answering = [s for s in survivors if s not in after]
    with clock.stage("consistency") as cost:
        for site in answering:
            signature = clients[site].sign_survivors(context.round_index, survivors)
            sent[site].signature_up = cost.up(len(signature))
            sent[site].survivors_down = cost.down(4 * len(survivors))
            server.receive_signature(site, signature)
    with clock.stage("unmask") as cost:
        request = server.unmask_request()
        for site in answering:
            mine = server.unmask_request_for(site, request)
            sent[site].request_down = cost.down(len(message_to_bytes(mine)))
            response = clients[site].unmask(mine)
            sent[site].response_up = cost.up(len(message_to_bytes(response)))
            server.receive_unmask(response)
        result = server.result()
    if traffic is not None:
        traffic.update(sent)
    return result, server.survivors


@dataclass(slots=True)
class SiteTraffic:
    """One site's bytes in one secure round, per stage call and direction, in the order the
    site makes them (``geoloco.site_agent.secure_site``): advertise keys, share keys (both
    beside the inner steps), the masked upload, then consistency (the survivor list comes
    down), unmask (its signature up, the unmask request down) and the unmask answer. The
    simulator's clock (``geoloco.algorithms.simulation.secure_clock``) times each call; none
    of these sizes depends on the values summed."""

    advertise_up: int = 0
    advertise_down: int = 0
    share_up: int = 0
    share_down: int = 0
    masked_up: int = 0
    """The masked vector: what a relay adds into its ring sum instead of passing it on."""
    survivors_down: int = 0
    signature_up: int = 0
    request_down: int = 0
    response_up: int = 0

    @property
    def up(self) -> int:
        """Everything the site sent the coordinator in the round."""
        return self.advertise_up + self.share_up + self.masked_up + self.signature_up + self.response_up

    @property
    def down(self) -> int:
        """Everything the coordinator sent the site in the round's protocol (the broadcast not
        included)."""
        return self.advertise_down + self.share_down + self.survivors_down + self.request_down


@dataclass(slots=True)
class StageCost:
    """One protocol stage of one round, all parties together."""

    seconds: float = 0.0
    """CPU time of every party in the stage (they run one after another in this process)."""
    bytes_up: int = 0
    """What the sites sent the coordinator."""
    bytes_down: int = 0
    """What the coordinator sent the sites (a message every site gets counts once per site)."""

    def up(self, nbytes: int) -> int:
        """Count one site's ``nbytes`` to the coordinator; returns them."""
        self.bytes_up += nbytes
        return nbytes

    def down(self, nbytes: int) -> int:
        """Count ``nbytes`` from the coordinator to one site; returns them."""
        self.bytes_down += nbytes
        return nbytes


class _StageClock:
    """Times the stages into ``stages`` (a cost object either way, so the round has one path)."""

    def __init__(self, stages: dict[str, StageCost] | None) -> None:
        self.stages = stages

    @contextmanager
    def stage(self, name: str) -> Iterator[StageCost]:
        cost = StageCost()
        started = time.perf_counter()
        try:
            yield cost
        finally:
            cost.seconds = time.perf_counter() - started
            if self.stages is not None:
                self.stages[name] = cost

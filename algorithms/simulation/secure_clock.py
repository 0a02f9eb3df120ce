"""A secure-aggregation round on the simulator's clock: every stage call a transfer, every stage a barrier.

A secure round is not one upload. The real site (``geoloco.site_agent.secure_site``) makes six
calls a round, and the coordinator answers a stage's calls only once the stage closes, when every
site of the round has called (``geoloco.coordinator.secure_round``). Charged as one upload of all
its bytes, a round missed up to six one-way latencies of the slowest site after the uploads
closed and the key stages' barriers before them. With ``up_k(b) = latency_k + 8 · b / uplink_bps_k``
and ``down_k(b)`` alike, the bytes of each call from ``SiteTraffic``, ``s_k`` the time site
``k`` holds ``θ_t`` and ``c_k`` the time it has finished its inner steps:

- **Keys**, beside the inner steps: the advertisements close at ``K1 = max_k (s_k +
  up_k(advertise))``; the shares at ``K2 = max_k (K1 + down_k(advertisements) + up_k(shares))``;
  site ``k`` holds the shares addressed to it at ``h_k = K2 + down_k(its shares)``.
- **The masked upload** goes once the site has trained and holds its shares (it masks with
  them): ``a_k = max(c_k, h_k) + up_k(masked)``. The round closes at ``A`` by the same
  ``RoundPolicy`` as any round.
- **Unmasking**: a site asks for the survivor list once its upload's answer is back
  (``a_k + 2 · latency_k``, a call that carries nothing), and has it at ``max(A, a_k + 2 ·
  latency_k) + down_k(survivors)``; its signature arrives ``up_k(signature)`` later and the
  unmask stage closes at ``U``, the last survivor's; the unmask request reaches the site at ``U +
  down_k(request)`` and its answer the coordinator ``up_k(answer)`` later. The sum is unmasked at
  ``M``, the last answer: the broadcast starts there (``A_t`` of the plain clock,
  ``geoloco.algorithms.simulation.clock``).

As on the plain clock, masking, unmasking and the outer step take no virtual time, and a stage
call is answered the moment its stage closes: a real call is held at most a second
(``geoloco.coordinator.rounds.SECURE_STAGE_WAIT_S``) and asked again, so a stage that closes in
between reaches the site up to a round trip later; this is a lower bound. The simulator's flat
and streaming secure rounds (``streaming_sim``: the key stages start with the steps after the
merge) and the planner's are timed here, so the planner equals the simulator on them; the
regions' secure rounds still charge the protocol as one upload.
"""

from __future__ import annotations

from collections.abc import Sequence

from geoloco.algorithms.privacy.secagg_in_memory import SiteTraffic
from geoloco.algorithms.simulation.clock import SiteConfig, transfer_time

__all__ = ["keys_held", "masked_arrivals", "unmasked_at"]


def _up(site: SiteConfig, nbytes: int) -> float:
    return transfer_time(nbytes, site.uplink_bps, site.latency_s)


def _down(site: SiteConfig, nbytes: int) -> float:
    return transfer_time(nbytes, site.downlink_bps, site.latency_s)


def keys_held(starts: Sequence[float], traffic: Sequence[SiteTraffic], sites: Sequence[SiteConfig]) -> list[float]:
    """``h_k``: when each site holds the shares addressed to it, the key stages having started at
    ``starts`` (every site of the round takes part in them)."""
    advertised = max(s + _up(site, t.advertise_up) for s, t, site in zip(starts, traffic, sites, strict=True))
    shared = max(
        advertised + _down(site, t.advertise_down) + _up(site, t.share_up)
        for t, site in zip(traffic, sites, strict=True)
    )
    return [shared + _down(site, t.share_down) for t, site in zip(traffic, sites, strict=True)]


def masked_arrivals(
    starts: Sequence[float],
    compute_s: Sequence[float],
    traffic: Sequence[SiteTraffic],
    sites: Sequence[SiteConfig],
) -> list[float]:
    """``a_k``: when each site's masked upload has fully arrived, its key stages and its inner
    steps having started at ``starts``."""
    held = keys_held(starts, traffic, sites)
    return [
        max(start + compute, h) + _up(site, t.masked_up)
        for start, compute, h, t, site in zip(starts, compute_s, held, traffic, sites, strict=True)
    ]


def unmasked_at(
    close_s: float,
    arrivals: Sequence[float],
    traffic: Sequence[SiteTraffic],
    sites: Sequence[SiteConfig],
    survivors: Sequence[int],
) -> float:
    """``M``: when the coordinator has every survivor's unmask answer, the uploads having closed
    at ``close_s`` (``survivors``: indices into the other sequences, the sites in the sum)."""
    if not survivors:
        return close_s
    signed = max(
        max(close_s, arrivals[k] + 2 * sites[k].latency_s)
        + _down(sites[k], traffic[k].survivors_down) + _up(sites[k], traffic[k].signature_up)
        for k in survivors
    )
    return max(
        signed + _down(sites[k], traffic[k].request_down) + _up(sites[k], traffic[k].response_up)
        for k in survivors
    )

"""``geoloco simulate`` with ``[[regions]]`` and secure aggregation ends where the real relays do.

The simulator runs ``ROUNDS`` secure rounds of the relay tests' four sites in their two regions
(``REGIONS``) on the relay tests' model, and each site's pseudo-gradient of each round is kept.
The same updates then go, round by round, through the real system as ``test_relay_secure`` runs
it: a coordinator, one relay per region, and every site's secure protocol (``SecureTestSite``)
over mutual TLS through its relay. After every round:

- the coordinator's weights equal the simulator's within the secure-vs-plain tolerance
  (``SECURE_VS_PLAIN``: each side rounds its own fixed-point sum), and every site counted;
- each relay sent one masked partial listing its two sites, one masked vector long: what the
  simulator's two-tier clock charges for the ring sum, the size of each site's masked upload.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from _relay_helpers import REGIONS, SITES, coordinator, make_certs, relay, tiny_model, tiny_weights
from test_relay_secure import NUMEL, PRIVACY, SECURE_VS_PLAIN, SecureTestSite, _spy
from torch import nn

from geoloco.algorithms.aggregation import Aggregation
from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
from geoloco.algorithms.privacy.secagg_in_memory import SiteTraffic
from geoloco.algorithms.simulation.sim_uplinks import Payload
from geoloco.algorithms.simulation.simulator import Simulator, SimulatorConfig
from geoloco.algorithms.strategy import RoundPlan
from geoloco.protos import geoloco_pb2 as pb

ROUNDS = 2


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"))


class TinyRegression:
    """Linear regression on the relay tests' model (``tiny_model``): each site its own target."""

    name = "tiny-regression"

    def build_model(self, seed: int) -> nn.Module:
        return tiny_model(NUMEL)

    def site_batches(self, site: int, num_sites: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed * 100 + site)
        target = torch.linspace(-1.0, 1.0, NUMEL - 1)[:, None] * (site + 1)
        while True:
            x = torch.randn(8, NUMEL - 1, generator=g)
            yield x, x @ target

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    def eval_loss(self, model: nn.Module) -> float:
        with torch.no_grad():
            return float(self.loss(model, next(self.site_batches(0, 1, 7))))


def _simulate(privacy: PrivacyConfig) -> tuple[list[dict[str, torch.Tensor]], list[torch.Tensor], dict[str, int]]:
    """The simulated run: each round's updates by site name, the weights after each round, and
    each site's masked-vector bytes as the two-tier clock saw them."""
    config = SimulatorConfig.from_dict({
        # The algorithm the relay tests' coordinator runs (``_relay_helpers.coordinator``).
        "algorithm": {"inner_steps": 1, "uplink_codec": "none", "weighting": "uniform"},
        "inner_optimizer": {"name": "sgd", "lr": 0.02},
        "sites": [{"name": name} for name in SITES],
        "regions": [{"name": name, "sites": sites} for name, sites in REGIONS.items()],
        "privacy": privacy.to_dict(),
        "simulation": {"rounds": ROUNDS, "eval_every": ROUNDS, "device": "cpu"},
    })
    sim = Simulator(config, TinyRegression())
    assert sim.tiers is not None and [r.sites for r in sim.tiers.regions] == [[0, 1], [2, 3]]
    torch.testing.assert_close(sim.global_flat, tiny_weights(NUMEL)[0], rtol=0, atol=0)
    updates: list[dict[str, torch.Tensor]] = [{} for _ in range(ROUNDS)]
    masked: dict[str, int] = {}
    encode, traffic = sim.uplinks.encode, sim.uplinks.traffic

    def keep_update(site: str, update: torch.Tensor, plan: RoundPlan, aggregation: Aggregation) -> Payload:
        updates[plan.round][SITES[int(site)]] = update.detach().clone()
        return encode(site, update, plan, aggregation)

    def keep_masked(site: str, aggregation: Aggregation) -> SiteTraffic | None:
        stages = traffic(site, aggregation)
        assert stages is not None  # a secure round's upload holds a masked vector
        masked[SITES[int(site)]] = stages.masked_up
        return stages

    sim.uplinks.encode = keep_update  # type: ignore[method-assign]
    sim.uplinks.traffic = keep_masked  # type: ignore[method-assign]
    weights = []
    for record in sim.run():
        assert len(record.participants) == len(SITES)
        weights.append(sim.global_flat.clone())
    return updates, weights, masked


def test_simulated_secure_rounds_through_regions_end_where_the_real_relays_do(certs: Path) -> None:
    updates, simulated, masked = _simulate(PRIVACY)
    assert all(sorted(u) == sorted(SITES) for u in updates)

    server = coordinator(
        certs, numel=NUMEL, rounds=ROUNDS, privacy=PRIVACY, weighting="uniform",
        heartbeat_timeout_s=60.0, secure_stage_timeout_s=60.0,
    )
    relays = {name: relay(certs, name, server.port) for name in REGIONS}
    partials: dict[str, list[tuple[pb.UploadManifest, bytes, list[bytes]]]] = {name: [] for name in REGIONS}
    for name, r in relays.items():
        _spy(r, partials[name])
    sites = [
        SecureTestSite(site, certs, f"localhost:{relays[region].port}", PRIVACY)
        for region, names in REGIONS.items() for site in names
    ]
    go = threading.Event()
    go.set()
    try:
        for s in sites:
            s.drops = False
            s.join()
        for number in range(ROUNDS):
            for s in sites:
                s.round_number = number
            with ThreadPoolExecutor(len(sites)) as pool:
                futures = [pool.submit(s.run, updates[number][s.site.name], threading.Event(), go) for s in sites]
                for future in futures:
                    future.result(timeout=60)
            headers = {s.site.name: s.site.await_broadcast(number)[0] for s in sites}
            assert all(h.included and h.num_contributors == len(SITES) for h in headers.values()), headers
            torch.testing.assert_close(server.rounds.weights, simulated[number], rtol=0, atol=SECURE_VS_PLAIN)
            for s in sites:
                s.round_seed = int(headers[s.site.name].next_round.round_seed)
                assert len(s.masked) == masked[s.site.name]
    finally:
        for s in sites:
            s.site.close()
        for r in relays.values():
            r.stop(grace=0)
        server.stop(grace=0)
    assert (simulated[-1] - tiny_weights(NUMEL)[0]).abs().max() > 100 * SECURE_VS_PLAIN  # the rounds moved them
    # One masked partial per relay and round, listing its sites, one masked vector long: the
    # ring sum the clock charges (``TwoTierClock.partial_bytes``) besides the stage messages.
    for region, names in REGIONS.items():
        assert [sorted(s.site for s in m.relayed_sites) for m, _, _ in partials[region]] == [names] * ROUNDS
        assert all(len(data) == max(masked[n] for n in names) for _, data, _ in partials[region])

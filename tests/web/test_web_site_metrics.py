"""A site's own /metrics: fed by the agent's hooks (the user's hooks still run), served over HTTP
and parsed with the Prometheus client's parser, also from a real agent against a real coordinator."""

from __future__ import annotations

import itertools
import urllib.request

import pytest
import torch
from _round_helpers import tiny_model
from prometheus_client.parser import text_string_to_metric_families

from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.server import CoordinatorServer
from geoloco.site_agent.agent import SiteAgent
from geoloco.site_agent.config import JoinInfo, RoundResult, SiteAgentConfig, SiteHooks
from geoloco.site_agent.prometheus import SiteMetrics


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def result(round_number: int, *, included: bool, inner_s: float, round_s: float) -> RoundResult:
    return RoundResult(
        round=round_number, train_loss=1.0 / (round_number + 1), samples=64, inner_steps=20,
        included=included, num_contributors=2, resynced=False, bytes_up=1000, bytes_down=3000,
        inner_time_s=inner_s, round_time_s=round_s, weights_digest="d", next_round=round_number + 1,
    )


def test_site_metrics_from_hooks_served_and_parsed() -> None:
    seen: list[int] = []
    metrics = SiteMetrics("lisbon")
    hooks = metrics.hooks(SiteHooks(on_round_end=lambda r: seen.append(r.round)))
    hooks.on_join(JoinInfo(session_id="s", round=4, inner_steps=20, uplink_codec="int8",
                           downlink_codec="int8", total_rounds=10, fetched_model=True, config={}))
    port = metrics.serve("127.0.0.1", 0)
    try:
        assert scrape(port)[("geoloco_site_round", (("site", "lisbon"),))] == 4
        hooks.on_round_end(result(4, included=True, inner_s=2.0, round_s=3.5))
        hooks.on_round_end(result(5, included=False, inner_s=4.0, round_s=4.5))
        m = scrape(port)
    finally:
        metrics.stop()
    assert seen == [4, 5], "the user's hook still runs"
    site = (("site", "lisbon"),)
    assert m[("geoloco_site_round", site)] == 6
    assert m[("geoloco_site_rounds_trained_total", site)] == 2
    assert m[("geoloco_site_rounds_included_total", site)] == 1
    assert m[("geoloco_site_inner_steps_total", site)] == 40
    assert m[("geoloco_site_inner_step_rate", site)] == pytest.approx(5.0)  # 20 steps in 4 s
    assert m[("geoloco_site_compute_seconds_total", site)] == pytest.approx(6.0)
    assert m[("geoloco_site_network_wait_seconds_total", site)] == pytest.approx(2.0)
    assert m[("geoloco_site_bytes_sent_total", site)] == 2000
    assert m[("geoloco_site_bytes_received_total", site)] == 6000
    assert m[("geoloco_site_train_loss", site)] == pytest.approx(1 / 6)


def test_real_agent_reports_its_rounds() -> None:
    config = CoordinatorConfig(insecure=True, total_rounds=2, heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0)
    model = tiny_model()
    with CoordinatorServer.from_model(config, model) as server:
        metrics = SiteMetrics("alpha")
        site_model = tiny_model(seed=1)
        generator = torch.Generator().manual_seed(0)
        batches = ((torch.randn(8, 4, generator=generator), torch.randint(0, 2, (8,), generator=generator))
                   for _ in itertools.count())
        agent = SiteAgent(
            site_model,
            torch.optim.SGD(site_model.parameters(), lr=0.1),
            batches,
            lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
            coordinator=server.address,
            site="alpha",
            insecure=True,
            config=SiteAgentConfig(device="cpu"),
            hooks=metrics.hooks(),
        )
        summary = agent.run()
        assert server.wait_until_finished(timeout=30)
    assert summary.rounds_trained == 2
    port = metrics.serve()
    try:
        m = scrape(port)
    finally:
        metrics.stop()
    site = (("site", "alpha"),)
    assert m[("geoloco_site_round", site)] == 2
    assert m[("geoloco_site_rounds_included_total", site)] == 2
    assert m[("geoloco_site_inner_steps_total", site)] == 2 * server.rounds.strategy.inner_steps
    assert m[("geoloco_site_inner_step_rate", site)] > 0
    assert m[("geoloco_site_compute_seconds_total", site)] > 0
    assert m[("geoloco_site_network_wait_seconds_total", site)] > 0
    assert m[("geoloco_site_bytes_sent_total", site)] > 0

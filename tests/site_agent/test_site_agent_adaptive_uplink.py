"""Real site agents follow the coordinator's per-site uplink codec (``[algorithm.adaptive_uplink]``).

The coordinator's link measurements are seeded so that site ``slow`` is far slower than
``fast`` before the first round (a real slow link would take the rounds a test should not);
both agents then run three rounds over real gRPC with TLS: the slow site uploads the top-k codec
the coordinator assigned, the fast one int8, every upload is accepted and counted, and the sites
end on the coordinator's weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _agent_helpers import AgentThread, make_agent, make_certs, start_coordinator

from geoloco.algorithms.link_codec import AdaptiveUplinkConfig
from geoloco.algorithms.record import RoundRecord
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.scenarios.workloads import build_workload

SITES = ["fast", "slow"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"), SITES)


def test_each_agent_uploads_in_the_codec_assigned_to_it(certs: Path) -> None:
    mlp: Any = build_workload("mlp")
    records: list[RoundRecord] = []
    server = start_coordinator(
        certs, mlp.build_model(0),
        algorithm=AlgorithmConfig(
            inner_steps=2, uplink_codec="int8",
            adaptive_uplink=AdaptiveUplinkConfig(enabled=True, min_density=0.05, smoothing=0.01),
        ),
        total_rounds=3, min_sites=2, heartbeat_timeout_s=600.0, on_round_end=records.append,
    )
    plans = server.rounds._ctx.link_codecs
    assert plans is not None
    plans.observe_upload("fast", 10**9, 1.0)
    plans.observe_upload("slow", 10**3, 1.0)
    threads = []
    try:
        for index, site in enumerate(SITES):
            agent = make_agent(mlp, server, certs, site, index=index, num_sites=2, seed=0)
            threads.append(AgentThread(agent))
        for t in threads:
            t.start()
        summaries = {t.agent.site: t.finish(120) for t in threads}
        assert server.wait_until_finished(30)
    finally:
        server.stop(grace=0)
    assert {s.weights_digest for s in summaries.values()} == {server.rounds.digest_hex}
    assert all(s.rounds_included == 3 for s in summaries.values())
    assert [r.round for r in records] == [0, 1, 2]
    int8 = plans.base_codec
    for record in records:
        plan = plans.plans[record.round]
        assert plan["fast"] == int8 and plan["slow"].startswith("topk:0.05,")
        assert sorted(record.participants) == SITES
        assert record.bytes_up["slow"] * 2 < record.bytes_up["fast"]

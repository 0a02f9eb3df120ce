"""A short link cut costs a site about a round, not the rest of the run.

* ``test_a_site_whose_link_returns_rejoins_at_once_even_with_a_long_backoff``: a real coordinator
  behind a real TCP relay (the emulator's ``LinkRelay``, whose ``cut`` drops every connection
  and refuses new ones); the site's retry delays are set absurdly long (300-600 s), so a site
  that slept through the link's return would stay away far beyond the test's bound. The link is
  cut for 2 s; the site must train and be included in two more rounds well within that bound,
  and it must have been the channel's connectivity (READY again) that cut its sleep short.
* ``test_retry_pauses_are_capped_by_a_fraction_of_the_round_time``: the pure rule, with a fake
  sleep: once a round time was seen, pauses between retries stay below
  ``backoff_round_fraction`` of it (jitter kept), whatever ``backoff_max_s`` says.
"""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest
import torch
from _agent_helpers import AgentThread, make_certs, start_coordinator

from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.protos.transport_tls import TLSFiles
from geoloco.scenarios.shaping import LinkShape, RelayHub
from geoloco.scenarios.workloads import MLPWorkload
from geoloco.site_agent.agent import SiteAgent
from geoloco.site_agent.backoff import Backoff
from geoloco.site_agent.config import SiteAgentConfig, SiteHooks
from geoloco.site_agent.connectivity import RoundTimer, backoff_cap

WAIT_S = 120.0
"""Bound of the waits: generous for a loaded machine, far below the 300 s a site sleeping
through the link's return would stay away."""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"), ["osaka"])


def test_a_site_whose_link_returns_rejoins_at_once_even_with_a_long_backoff(
    certs: Path, tmp_path: Path
) -> None:
    mlp = MLPWorkload()
    server = start_coordinator(
        certs, mlp.build_model(0), total_rounds=1000, min_sites=1, seed=0,
        heartbeat_timeout_s=60.0, algorithm=AlgorithmConfig(inner_steps=2),
    )
    hub = RelayHub()
    rounds: list[int] = []
    progressed = threading.Condition()

    def on_round_end(result: object) -> None:
        with progressed:
            rounds.append(int(result.round))  # type: ignore[attr-defined]
            progressed.notify_all()

    def wait_rounds(count: int) -> None:
        with progressed:
            assert progressed.wait_for(lambda: len(rounds) >= count, timeout=WAIT_S), (
                f"the site trained {len(rounds)} rounds, not {count}, within {WAIT_S} s: "
                f"{server.rounds.status()}"
            )

    try:
        link = LinkShape(bandwidth_bps=1e9)
        relay = hub.add("osaka", link, link)
        hub.set_target("127.0.0.1", server.port)
        config = SiteAgentConfig(
            device="cpu", backoff_initial_s=600.0, backoff_max_s=600.0, give_up_after_s=3600.0
        )
        model = mlp.build_model(0)
        agent = SiteAgent(
            model, torch.optim.AdamW(model.parameters(), lr=3e-3), mlp.site_batches(0, 1, 0), mlp.loss,
            coordinator=f"127.0.0.1:{relay.port}", site="osaka", tls=TLSFiles.from_dir(certs, "osaka"),
            config=config, hooks=SiteHooks(on_round_end=on_round_end),
        )
        thread = AgentThread(agent)
        thread.start()
        wait_rounds(2)
        before = len(rounds)
        hub.cut("osaka", 2.0)
        wait_rounds(before + 2)
        assert agent.client.connectivity.wakeups >= 1
        assert relay.connections_cut >= 1
        agent.stop()
        thread.finish(WAIT_S)
    finally:
        hub.close()
        server.stop(grace=0)


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "link cut"

    def trailing_metadata(self) -> tuple[()]:
        return ()


def test_retry_pauses_are_capped_by_a_fraction_of_the_round_time() -> None:
    config = SiteAgentConfig(backoff_initial_s=0.2, backoff_max_s=10.0, backoff_round_fraction=0.25)
    assert backoff_cap(config, None) == 10.0
    assert backoff_cap(config, 2.0) == 0.5
    assert backoff_cap(config, 0.1) == 0.2  # never below the first delay
    assert backoff_cap(config, 3600.0) == 10.0

    timer = RoundTimer()
    for now in (100.0, 102.0, 104.0):
        timer.broadcast_received(now)
    assert timer.round_time_s == 2.0

    pauses: list[float] = []
    backoff = Backoff(
        "Upload", config=config, target="coordinator:1", classify=lambda _: None,
        sleep=lambda seconds, _mark: pauses.append(seconds),
        cap=lambda: backoff_cap(config, timer.round_time_s),
    )
    for _ in range(12):
        backoff.failed(_Unavailable())
    assert max(pauses) <= 0.5
    assert len(set(pauses)) > 1  # jitter kept
    assert pauses[-1] >= 0.25  # the delay grew to the cap (jitter draws from [cap/2, cap])

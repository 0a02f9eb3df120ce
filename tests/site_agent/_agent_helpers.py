"""Helpers for site-agent tests: certificates, a TLS coordinator on port 0, agents in threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from geoloco.algorithms.params import ParamLayout
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.server import CoordinatorServer
from geoloco.protos.transport_tls import TLSFiles
from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_site
from geoloco.site_agent.agent import SiteAgent, SiteRunSummary
from geoloco.site_agent.config import SiteAgentConfig


class FakeClock:
    """The coordinator's clock, moved by the test (deadlines without waiting for them)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_certs(directory: Path, sites: list[str]) -> Path:
    init_ca(directory)
    issue_coordinator(directory)
    for name in sites:
        issue_site(directory, name)
    return directory


def start_coordinator(
    certs: Path, model: torch.nn.Module, **config: Any
) -> CoordinatorServer:
    clock = config.pop("clock", time.monotonic)
    eval_fn = config.pop("eval_fn", None)
    on_round_end = config.pop("on_round_end", None)
    layout = ParamLayout.from_model(model)
    server = CoordinatorServer(
        CoordinatorConfig(certs_dir=str(certs), **config),
        layout.flatten(model),
        layout,
        eval_fn,
        on_round_end=on_round_end,
        clock=clock,
    )
    server.start()
    return server


def make_agent(
    workload: Any,
    server: CoordinatorServer,
    certs: Path,
    site: str,
    *,
    index: int,
    num_sites: int,
    seed: int,
    lr: float = 3e-3,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    config: SiteAgentConfig | None = None,
    **kwargs: Any,
) -> SiteAgent:
    model = workload.build_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95))
    return SiteAgent(
        model,
        optimizer,
        workload.site_batches(index, num_sites, seed),
        loss_fn or workload.loss,
        coordinator=f"localhost:{server.port}",
        site=site,
        tls=TLSFiles.from_dir(certs, site),
        config=config or SiteAgentConfig(device="cpu", backoff_initial_s=0.05, backoff_max_s=0.5),
        **kwargs,
    )


class AgentThread(threading.Thread):
    """Runs ``agent.run()`` and keeps its summary or exception for the test."""

    def __init__(self, agent: SiteAgent, max_rounds: int | None = None) -> None:
        super().__init__(name=f"site-{agent.site}", daemon=True)
        self.agent = agent
        self.max_rounds = max_rounds
        self.summary: SiteRunSummary | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.summary = self.agent.run(self.max_rounds)
        except BaseException as error:  # reported by finish()
            self.error = error

    def finish(self, timeout_s: float = 60.0) -> SiteRunSummary:
        self.join(timeout_s)
        if self.is_alive():
            self.agent.stop()
            self.join(10)
            raise AssertionError(f"site {self.agent.site} did not finish within {timeout_s} s")
        if self.error is not None:
            raise AssertionError(f"site {self.agent.site} failed") from self.error
        assert self.summary is not None
        return self.summary


def wait_until(predicate: Callable[[], bool], server: CoordinatorServer, timeout_s: float = 30.0) -> None:
    """Block on the coordinator's state changes until ``predicate`` holds (no fixed sleeps)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"condition not reached within {timeout_s} s: {server.rounds.status()}")
        server.rounds.wait_for_change(min(remaining, 0.2))

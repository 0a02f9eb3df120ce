"""A coordinator and its sites on loopback with mutual TLS, and the simulator run to compare with.

Sites are named "0", "1", ... so that each site's uplink codec seed,
``derive_seed(round_seed, "uplink", name)``, equals the simulator's ``RoundPlan.uplink_seed(k)``
for site index ``k`` (``derive_seed`` hashes ``str(part)``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from geoloco.algorithms.optimizers import InnerOptimizerConfig
from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.record import RoundRecord
from geoloco.algorithms.simulation.clock import SiteConfig
from geoloco.algorithms.simulation.simulator import SimulationConfig, Simulator, SimulatorConfig
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.server import CoordinatorServer
from geoloco.protos.transport_tls import TLSFiles
from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_site
from geoloco.site_agent.agent import SiteAgent, SiteRunSummary
from geoloco.site_agent.config import JoinInfo, RoundResult, SiteAgentConfig, SiteHooks


def make_certs(directory: Path, sites: list[str]) -> Path:
    init_ca(directory)
    issue_coordinator(directory)
    for name in sites:
        issue_site(directory, name)
    return directory


@dataclass
class Run:
    """One experiment's settings, shared by the real system and the simulator."""

    workload: Any
    num_sites: int
    rounds: int
    seed: int = 0
    algorithm: AlgorithmConfig = field(default_factory=lambda: AlgorithmConfig(inner_steps=4))
    inner: InnerOptimizerConfig = field(default_factory=lambda: InnerOptimizerConfig(lr=3e-3))

    def coordinator_config(self, certs: Path, **overrides: Any) -> CoordinatorConfig:
        settings: dict[str, Any] = {
            "algorithm": self.algorithm,
            "inner_optimizer": self.inner,
            "seed": self.seed,
            "total_rounds": self.rounds,
            "min_sites": self.num_sites,
            "certs_dir": str(certs),
        }
        settings.update(overrides)
        return CoordinatorConfig(**settings)

    def start_coordinator(self, certs: Path, **overrides: Any) -> CoordinatorServer:
        model = self.workload.build_model(self.seed)
        layout = ParamLayout.from_model(model)
        on_round_end = overrides.pop("on_round_end", None)
        server = CoordinatorServer(
            self.coordinator_config(certs, **overrides), layout.flatten(model), layout,
            on_round_end=on_round_end,
        )
        server.start()
        return server

    def agent(
        self, certs: Path, port: int, index: int, results: list[RoundResult] | None = None, *, pause_s: float = 0.0,
        state_dir: Path | None = None, loss_fn: Callable[..., torch.Tensor] | None = None,
        interceptors: list[Any] | None = None,
    ) -> SiteAgent:
        """Site ``index``'s agent; ``pause_s``: seconds it sleeps before each batch (a slow site);
        ``state_dir``: where it saves its state (``SiteAgentConfig.state_dir``); ``loss_fn``:
        instead of the workload's; ``interceptors``: gRPC client interceptors on its calls."""
        model = self.workload.build_model(self.seed)
        name = str(index)
        batches = self.workload.site_batches(index, self.num_sites, self.seed)
        return SiteAgent(
            model,
            self.inner.build(model.parameters()),
            _paused(batches, pause_s) if pause_s else batches,
            loss_fn if loss_fn is not None else self.workload.loss,
            coordinator=f"localhost:{port}",
            site=name,
            tls=TLSFiles.from_dir(certs, name),
            config=SiteAgentConfig(
                device="cpu", backoff_initial_s=0.05, backoff_max_s=0.5,
                state_dir=None if state_dir is None else str(state_dir),
            ),
            hooks=SiteHooks(on_round_end=results.append if results is not None else None),
            interceptors=interceptors or (),
        )

    def simulate(self) -> torch.Tensor:
        return self.simulate_records()[0]

    def simulate_records(self) -> tuple[torch.Tensor, list[RoundRecord]]:
        """The simulator's final weights and its round records for this run."""
        config = SimulatorConfig(
            algorithm=self.algorithm,
            inner_optimizer=self.inner,
            sites=[SiteConfig() for _ in range(self.num_sites)],
            simulation=SimulationConfig(rounds=self.rounds, seed=self.seed, device="cpu", eval_every=10**6),
        )
        simulator = Simulator(config, self.workload)
        records = list(simulator.run())
        return simulator.global_flat, records


def _paused(batches: Iterator[Any], pause_s: float) -> Iterator[Any]:
    for batch in batches:
        time.sleep(pause_s)
        yield batch


class AgentThread(threading.Thread):
    """Runs ``agent.run()`` and keeps its summary or exception for the test."""

    def __init__(self, agent: SiteAgent) -> None:
        super().__init__(name=f"site-{agent.site}", daemon=True)
        self.agent = agent
        self.summary: SiteRunSummary | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.summary = self.agent.run()
        except BaseException as error:  # reported by finish()
            self.error = error

    def finish(self, timeout_s: float = 90.0) -> SiteRunSummary:
        self.join(timeout_s)
        if self.is_alive():
            self.agent.stop()
            self.join(10)
            raise AssertionError(f"site {self.agent.site} did not finish within {timeout_s} s")
        if self.error is not None:
            raise AssertionError(f"site {self.agent.site} failed") from self.error
        assert self.summary is not None
        return self.summary


def run_to_end(
    server: CoordinatorServer, agents: list[SiteAgent], *, finish_s: float = 90.0, wait_s: float = 30.0
) -> list[SiteRunSummary]:
    """Run every agent on its own thread until the run ends; the sites' summaries. The
    coordinator is stopped afterwards, whatever happened (its state stays readable)."""
    threads = [AgentThread(agent) for agent in agents]
    try:
        for t in threads:
            t.start()
        summaries = [t.finish(finish_s) for t in threads]
        assert server.wait_until_finished(wait_s)
    finally:
        server.stop(grace=0)
    return summaries


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def wait_for(event: threading.Event, timeout_s: float = 60.0) -> None:
    if not event.wait(timeout_s):
        raise AssertionError(f"event not set within {timeout_s} s")


def on_round(round_number: int, event: threading.Event) -> Callable[[RoundRecord], None]:
    """An ``on_round_end`` callback that sets ``event`` once round ``round_number`` is aggregated."""

    def callback(record: RoundRecord) -> None:
        if record.round == round_number:
            event.set()

    return callback


def poison_update(agent: SiteAgent, factor: float, *, nth: int = 1) -> None:
    """Make ``agent`` upload ``factor`` times its ``nth`` pseudo-gradient (1: its first), and
    honest ones otherwise. The update is formed whole (``encode``), not piece by piece in the
    residual, so it can be scaled."""

    def on_join(info: JoinInfo) -> None:
        uplink = agent._rounds.uplink  # type: ignore[union-attr]
        encode = uplink.encode
        if getattr(encode, "poisoned", False):
            return
        calls = [0]

        def scaled(update: torch.Tensor, **kwargs: object) -> object:
            calls[0] += 1
            return encode(update * factor if calls[0] == nth else update, **kwargs)

        scaled.poisoned = True  # type: ignore[attr-defined]
        uplink.encode = scaled  # type: ignore[method-assign]
        uplink.encode_added = lambda *args, **kwargs: None  # type: ignore[method-assign]

    agent.hooks.on_join = on_join

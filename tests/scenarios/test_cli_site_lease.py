"""``geoloco site`` holding its name and its ``--state-dir``: the CLI entry point in-process
(``main([...])`` in the test's main thread, ``GEOLOCO_NO_MALLOC_REEXEC=1``) against a coordinator with mutual
TLS on a loopback port, beside a second process of the same site (a ``SiteAgent``).

* A site process that another process of its name replaced stops and exits 1, saying when and
  from where the other one joined.
* A second site process on a ``--state-dir`` in use exits 1 naming the holder, before it joins:
  the process holding the folder keeps its name at the coordinator.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.server import CoordinatorServer
from geoloco.protos.transport_tls import TLSFiles
from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_site
from geoloco.scenarios.cli import main
from geoloco.scenarios.workloads import build_workload
from geoloco.site_agent.agent import SiteAgent, SiteRunSummary
from geoloco.site_agent.config import SiteAgentConfig

WORKLOAD = {"name": "mlp", "hidden_dim": 16}


@pytest.fixture(autouse=True)
def _no_reexec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEOLOCO_NO_MALLOC_REEXEC", "1")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    init_ca(directory)
    issue_coordinator(directory)
    issue_site(directory, "a")
    return directory


@contextlib.contextmanager
def _coordinator(certs: Path, total_rounds: int) -> Iterator[CoordinatorServer]:
    model = build_workload(WORKLOAD["name"], hidden_dim=WORKLOAD["hidden_dim"]).build_model(0)
    layout = ParamLayout.from_model(model)
    server = CoordinatorServer(
        CoordinatorConfig(
            certs_dir=str(certs), min_sites=1, total_rounds=total_rounds, heartbeat_interval_s=0.2,
            workload=dict(WORKLOAD), algorithm=AlgorithmConfig(inner_steps=2),
        ),
        layout.flatten(model),
        layout,
    )
    server.start()
    try:
        yield server
    finally:
        server.stop(grace=0)


def _agent(server: CoordinatorServer, certs: Path, state_dir: Path | None = None) -> SiteAgent:
    """Another process of site "a" (the workload the coordinator advertises, shard 0 of 1)."""
    workload = build_workload(WORKLOAD["name"], hidden_dim=WORKLOAD["hidden_dim"])
    model = workload.build_model(0)
    return SiteAgent(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), workload.site_batches(0, 1, 0), workload.loss,
        coordinator=f"localhost:{server.port}", site="a", tls=TLSFiles.from_dir(certs, "a"),
        config=SiteAgentConfig(
            device="cpu", backoff_initial_s=0.05, backoff_max_s=0.5,
            state_dir=None if state_dir is None else str(state_dir),
        ),
    )


class Running(threading.Thread):
    """``target()`` in a thread, keeping its result or exception."""

    def __init__(self, target: Callable[[], object]) -> None:
        super().__init__(daemon=True)
        self._target_fn = target
        self.result: object = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self._target_fn()
        except BaseException as error:  # reported by the test
            self.error = error

    def outcome(self, timeout_s: float = 60.0) -> object:
        self.join(timeout_s)
        assert not self.is_alive(), "still running"
        assert self.error is None, self.error
        return self.result


def _site_command(server: CoordinatorServer, certs: Path, *extra: str) -> list[str]:
    return [
        "site", "--coordinator", f"localhost:{server.port}", "--name", "a", "--certs", str(certs),
        "--device", "cpu", "--backoff-max", "0.5", "--site-index", "0", "--num-sites", "1", *extra,
    ]


def _wait_for(predicate: Callable[[], bool], server: CoordinatorServer, timeout_s: float = 60.0) -> None:
    """Block on the coordinator's state changes until ``predicate`` holds (no fixed sleeps)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout_s} s: {server.rounds.status()}")
        server.rounds.wait_for_change(0.2)


def test_a_site_process_replaced_by_another_of_its_name_exits_1_saying_who(
    certs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with _coordinator(certs, total_rounds=8) as server:

        def newer_process() -> SiteRunSummary:
            _wait_for(lambda: server.rounds.round >= 2, server)  # the CLI site trained rounds 0 and 1
            return _agent(server, certs).run()

        newer = Running(newer_process)
        newer.start()
        code = main(_site_command(server, certs))  # in the main thread: it installs signal handlers
        summary = newer.outcome()
    assert code == 1
    assert isinstance(summary, SiteRunSummary) and summary.run_finished
    err = capsys.readouterr().err
    assert "geoloco site: error: another process joined as site 'a' at " in err, err
    assert "this one" in err and "stops" in err and "Traceback" not in err


def test_a_second_site_process_on_a_state_dir_in_use_exits_1_before_joining(
    certs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    state_dir = tmp_path / "state"
    caplog.set_level(logging.INFO, logger="geoloco.coordinator.membership")
    with _coordinator(certs, total_rounds=1000) as server:
        holder = _agent(server, certs, state_dir)
        running = Running(holder.run)
        running.start()
        _wait_for(lambda: server.rounds.round >= 1, server)
        assert main(_site_command(server, certs, "--state-dir", str(state_dir), "--max-rounds", "2")) == 1
        assert running.is_alive(), "the process holding the folder was replaced"
        holder.stop()
        summary = running.outcome()
    assert isinstance(summary, SiteRunSummary)
    err = capsys.readouterr().err
    assert f"{state_dir} is in use by another site process (pid {os.getpid()} on {socket.gethostname()}" in err, err
    joins = [r.getMessage() for r in caplog.records if "joined" in r.getMessage()]
    assert len(joins) == 1, joins  # the refused process never joined

"""``CoordinatorClient.interrupting``: stopping the client's other threads without closing it.

An asynchronous site's follower thread waits in AwaitBroadcast while the agent's loop decides to
stop (``max_rounds`` reached, a failure to re-join from). A plain ``cancel_active_calls`` left
two ways for that thread to block for good, and one did in a loaded CI run: a wait that started
just after the cancel was never cancelled, and a cancelled wait was retried (CANCELLED is
transient unless the whole agent stops). Real gRPC over mutual TLS against a real coordinator
whose round 0 never closes (it needs two sites' uploads).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _agent_helpers import make_certs, start_coordinator

from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.protos.transport_tls import TLSFiles
from geoloco.site_agent.client import CoordinatorClient
from geoloco.site_agent.config import SiteAgentConfig
from geoloco.site_agent.errors import AgentStopped


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"), ["a"])


@pytest.fixture
def client(certs: Path) -> Iterator[CoordinatorClient]:
    server = start_coordinator(certs, torch.nn.Linear(8, 8), algorithm=AlgorithmConfig(inner_steps=1), min_sites=2)
    client = CoordinatorClient(
        f"localhost:{server.port}", site="a", tls=TLSFiles.from_dir(certs, "a"), insecure=False,
        config=SiteAgentConfig(backoff_initial_s=0.05, backoff_max_s=0.1), stop_event=threading.Event(),
    )
    try:
        client.join(has_weights=False, weights_round=0, digest_hex=None)
        yield client
    finally:
        client.close()
        server.stop(grace=0)


def _waiter(client: CoordinatorClient, go: threading.Event, outcome: list[object]) -> threading.Thread:
    """A thread that waits for round 0's broadcast once ``go`` is set; ``outcome`` gets how it ended."""

    def wait() -> None:
        go.wait()
        try:
            outcome.append(client.await_broadcast(0))
        except BaseException as error:  # the test reads what ended the wait
            outcome.append(error)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


def _until(condition, what: str, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_wait_in_flight_ends_and_is_not_retried(client: CoordinatorClient) -> None:
    go, outcome = threading.Event(), list[object]()
    thread = _waiter(client, go, outcome)
    go.set()
    _until(lambda: client._active_calls, "the wait did not start")
    with client.interrupting():
        thread.join(10)
        assert not thread.is_alive(), "the cancelled wait was retried and blocks"
    assert len(outcome) == 1 and isinstance(outcome[0], AgentStopped), outcome


def test_a_wait_that_starts_while_interrupting_ends_at_once(client: CoordinatorClient) -> None:
    go, outcome = threading.Event(), list[object]()
    thread = _waiter(client, go, outcome)
    with client.interrupting():
        go.set()  # starts after the calls in flight were cancelled: the race that hung
        thread.join(10)
        assert not thread.is_alive(), "a wait started after the cancel blocks"
    assert len(outcome) == 1 and isinstance(outcome[0], AgentStopped), outcome


def test_the_client_works_again_after_the_interruption(client: CoordinatorClient) -> None:
    with client.interrupting():
        pass  # entered and left: nothing is interrupted any more
    go, outcome = threading.Event(), list[object]()
    thread = _waiter(client, go, outcome)
    go.set()
    _until(lambda: client._active_calls, "the wait did not start")
    time.sleep(0.3)
    assert thread.is_alive() and outcome == []  # waiting for round 0, as it should
    client._stop.set()  # what SiteAgent.stop does
    client.cancel_active_calls()
    thread.join(10)
    assert not thread.is_alive() and isinstance(outcome[0], AgentStopped), outcome

"""The site agent against a real coordinator over mutual TLS on loopback (agents in threads).

Stragglers, resumed uploads, giving up, bf16 autocast and the built-in GPT workload, all through
the public ``SiteAgent`` API.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from _agent_helpers import AgentThread, FakeClock, make_agent, make_certs, start_coordinator, wait_until
from torch import nn

from geoloco.algorithms.params import load_flat_
from geoloco.algorithms.record import RoundRecord
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.algorithms.streaming import StreamingConfig
from geoloco.coordinator.metrics import read_metrics
from geoloco.protos.transport_tls import TLSFiles
from geoloco.scenarios.workloads import build_workload
from geoloco.site_agent.agent import SiteAgent
from geoloco.site_agent.client import CoordinatorUnreachableError
from geoloco.site_agent.config import RoundResult, SiteAgentConfig, SiteHooks

SITES = ["fast", "slow", "solo", "gpt"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"), SITES)


@pytest.fixture(scope="module")
def mlp() -> Any:
    return build_workload("mlp")


def test_straggler_is_excluded_then_catches_up_in_sync(certs: Path, mlp: Any, tmp_path: Path) -> None:
    clock = FakeClock()
    metrics_path = tmp_path / "metrics.jsonl"
    server = start_coordinator(
        certs,
        mlp.build_model(0),
        algorithm=AlgorithmConfig(inner_steps=3, uplink_codec="int8"),
        total_rounds=3,
        min_sites=1,
        round_deadline_s=10.0,
        heartbeat_timeout_s=600.0,
        metrics_path=str(metrics_path),
        clock=clock,
    )
    release = threading.Event()
    held = threading.Event()
    round_zero_steps = 0

    def slow_loss(model: nn.Module, batch: Any) -> torch.Tensor:
        nonlocal round_zero_steps
        if not release.is_set():
            round_zero_steps += 1
            held.set()
            release.wait(60)  # held in round 0 until the coordinator closed it without us
        return mlp.loss(model, batch)

    results: dict[str, list[RoundResult]] = {"fast": [], "slow": []}
    threads = []
    try:
        for index, site in enumerate(["fast", "slow"]):
            hooks = SiteHooks(on_round_end=results[site].append)
            agent = make_agent(
                mlp, server, certs, site, index=index, num_sites=2, seed=0, hooks=hooks,
                loss_fn=slow_loss if site == "slow" else None,
            )
            threads.append(AgentThread(agent))
        for t in threads:
            t.start()
        wait_until(lambda: server.rounds.status()["contributed"] == ["fast"], server)
        # On a loaded machine "slow" may not have reached its first step yet: it must be held in
        # round 0 when the round closes, not start after it.
        assert held.wait(60), "\"slow\" never started round 0"
        assert server.rounds.round == 0, "round 0 closed before its deadline"
        clock.now += 11.0  # past round 0's deadline
        server.rounds.wake()
        wait_until(lambda: server.rounds.round >= 1, server)
        release.set()
        summaries = {t.agent.site: t.finish() for t in threads}
        assert server.wait_until_finished(30)
    finally:
        release.set()
        server.stop(grace=0)
    assert round_zero_steps == 1  # the gate held the first step only
    slow = results["slow"]
    assert [r.round for r in slow] == [0, 1, 2]
    assert [r.included for r in slow] == [False, True, True]
    assert all(r.included for r in results["fast"])
    assert summaries["slow"].rounds_included == 2 and summaries["fast"].rounds_included == 3
    digests = {s.weights_digest for s in summaries.values()}
    assert digests == {server.rounds.digest_hex}, "replicas diverged after the straggler caught up"
    records = read_metrics(metrics_path)
    assert [r["round"] for r in records] == [0, 1, 2]
    assert records[0]["excluded"] == ["slow"] and records[0]["deadline_hit"]
    assert sorted(records[1]["participants"]) == ["fast", "slow"]
    assert records[1]["bytes_up"]["slow"] > 0 and records[1]["bytes_down"]["slow"] > 0


def _poll_until(predicate: Callable[[], bool], timeout_s: float) -> None:
    """Poll ``predicate`` (state that no event signals, e.g. chunks received) until it holds."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout_s} s")
        pause.wait(0.01)


class BreakFirstUpload(grpc.StreamUnaryClientInterceptor):
    """Cuts the first Upload stream once the coordinator holds ``after`` of its chunks; records
    the chunks sent per stream."""

    def __init__(self, after: int, server_received: Callable[[], int]) -> None:
        self.after = after
        self.server_received = server_received
        self.chunks_per_stream: list[int] = []

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Iterator[Any]) -> Any:
        if not details.method.endswith("/Upload"):
            return continuation(details, requests)
        index = len(self.chunks_per_stream)
        self.chunks_per_stream.append(0)

        def counted() -> Iterator[Any]:
            for request in requests:
                if request.WhichOneof("kind") == "chunk":
                    if index == 0 and self.chunks_per_stream[index] == self.after:
                        _poll_until(lambda: self.server_received() >= self.after, timeout_s=30)
                        raise ConnectionResetError("injected: link dropped mid-upload")
                    self.chunks_per_stream[index] += 1
                yield request

        return continuation(details, counted())


def test_broken_upload_resumes_with_only_missing_chunks(certs: Path, mlp: Any) -> None:
    server = start_coordinator(
        certs, mlp.build_model(0), algorithm=AlgorithmConfig(inner_steps=2), total_rounds=1, min_sites=1
    )

    def server_received() -> int:
        upload = server.rounds.status()["uploads"].get("solo")
        return 0 if upload is None else upload["received_chunks"]

    breaker = BreakFirstUpload(after=3, server_received=server_received)
    try:
        agent = make_agent(
            mlp, server, certs, "solo", index=0, num_sites=1, seed=0,
            config=SiteAgentConfig(device="cpu", chunk_size=256, backoff_initial_s=0.01),
            interceptors=[breaker],
        )
        thread = AgentThread(agent)
        thread.start()
        result = thread.finish()
        open_uploads = server.rounds.status()["uploads"]
    finally:
        server.stop(grace=0)
    assert open_uploads == {}, "the round closed, so no upload is left open"
    total_chunks = -(-(4 * server.rounds.numel + 21 + len("none") + 8) // 256)  # Encoded header
    # Stream 1 delivered 3 chunks and broke; stream 2 carried exactly the other ones.
    assert breaker.chunks_per_stream == [3, total_chunks - 3]
    assert result.rounds_included == 1 and result.weights_digest == server.rounds.digest_hex


def test_agent_gives_up_with_a_clear_error_when_no_coordinator_answers(certs: Path, mlp: Any) -> None:
    server = start_coordinator(certs, mlp.build_model(0), total_rounds=1)
    port = server.port
    server.stop(grace=0)  # nothing listens on the port any more
    model = mlp.build_model(0)
    agent = SiteAgent(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        mlp.site_batches(0, 1, 0),
        mlp.loss,
        coordinator=f"localhost:{port}",
        site="solo",
        tls=TLSFiles.from_dir(certs, "solo"),
        config=SiteAgentConfig(device="cpu", give_up_after_s=0.5, backoff_initial_s=0.05),
    )
    with pytest.raises(CoordinatorUnreachableError, match=f"localhost:{port}.*--give-up-after SECONDS"):
        agent.run()


def test_bf16_autocast_runs_the_forward_pass_in_bfloat16_on_cpu(certs: Path, mlp: Any) -> None:
    server = start_coordinator(
        certs, mlp.build_model(0), algorithm=AlgorithmConfig(inner_steps=2), total_rounds=2, min_sites=1
    )
    seen: set[torch.dtype] = set()
    try:
        agent = make_agent(
            mlp, server, certs, "solo", index=0, num_sites=1, seed=0,
            config=SiteAgentConfig(device="cpu", autocast_bf16=True),
        )
        agent.module[0].register_forward_hook(lambda m, i, out: seen.add(out.dtype))
        result = AgentThread(agent)
        result.start()
        summary = result.finish()
    finally:
        server.stop(grace=0)
    assert seen == {torch.bfloat16}
    assert summary.rounds_included == 2
    # Weights stay fp32 and bit-identical to the coordinator's.
    assert agent.global_weights is not None and agent.global_weights.dtype == torch.float32
    assert summary.weights_digest == server.rounds.digest_hex


def test_builtin_gpt_workload_trains_through_the_site_agent_api(certs: Path) -> None:
    gpt = build_workload("gpt", size="tiny", batch_size=4, seq_len=32, eval_batches=1)
    losses: list[float] = []

    def eval_fn(flat: torch.Tensor) -> float:
        model = gpt.build_model(0)
        load_flat_(model, flat)
        return gpt.eval_loss(model)

    server = start_coordinator(
        certs,
        gpt.build_model(0),
        algorithm=AlgorithmConfig(inner_steps=3, uplink_codec="topk:0.1|int8", downlink_codec="int8"),
        total_rounds=2,
        min_sites=1,
        eval_fn=eval_fn,
        on_round_end=lambda record: losses.append(record.eval_loss),
    )
    try:
        agent = make_agent(gpt, server, certs, "gpt", index=0, num_sites=1, seed=0, lr=1e-3)
        thread = AgentThread(agent)
        thread.start()
        summary = thread.finish(120)
        assert server.wait_until_finished(30)
    finally:
        server.stop(grace=0)
    assert summary.rounds_included == 2 and summary.weights_digest == server.rounds.digest_hex
    assert len(losses) == 2 and all(loss is not None and loss == loss for loss in losses)


class _Responses:
    """A response stream whose items pass through ``edit``; keeps the call's ``cancel``."""

    def __init__(self, call: Any, edit: Callable[[Any], Any]) -> None:
        self._call = call
        self._edit = edit

    def __iter__(self) -> _Responses:
        return self

    def __next__(self) -> Any:
        return self._edit(next(self._call))

    def cancel(self) -> bool:
        return self._call.cancel()


class FalsifyFirstBroadcastDigest(grpc.UnaryStreamClientInterceptor):
    """Replaces the weights digest of the first APPLY_DELTA header with a wrong one."""

    def __init__(self) -> None:
        self.falsified = 0

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        call = continuation(details, request)
        if not details.method.endswith("/AwaitBroadcast"):
            return call

        def edit(response: Any) -> Any:
            if response.WhichOneof("kind") == "header" and self.falsified == 0:
                response.header.weights_digest.digest = bytes(32)
                self.falsified += 1
            return response

        return _Responses(call, edit)


def test_digest_mismatch_after_a_delta_fetches_the_full_weights(certs: Path, mlp: Any) -> None:
    records: list[RoundRecord] = []
    server = start_coordinator(
        certs, mlp.build_model(0), algorithm=AlgorithmConfig(inner_steps=2), total_rounds=2,
        min_sites=1, on_round_end=records.append,
    )
    results: list[RoundResult] = []
    falsifier = FalsifyFirstBroadcastDigest()
    try:
        agent = make_agent(
            mlp, server, certs, "solo", index=0, num_sites=1, seed=0,
            hooks=SiteHooks(on_round_end=results.append), interceptors=[falsifier],
        )
        thread = AgentThread(agent)
        thread.start()
        summary = thread.finish()
    finally:
        server.stop(grace=0)
    assert falsifier.falsified == 1
    assert [r.resynced for r in results] == [True, False]
    assert summary.weights_digest == server.rounds.digest_hex
    # After the re-fetch the site holds exactly the coordinator's weights of round 1.
    assert results[0].weights_digest == records[0].weights_digest and results[0].next_round == 1


def test_stop_interrupts_a_site_waiting_for_its_round_and_it_leaves(certs: Path, mlp: Any) -> None:
    server = start_coordinator(
        certs, mlp.build_model(0), algorithm=AlgorithmConfig(inner_steps=2), total_rounds=3, min_sites=2
    )
    try:
        agent = make_agent(mlp, server, certs, "solo", index=0, num_sites=2, seed=0)
        thread = AgentThread(agent)
        thread.start()
        # Alone in a run that needs two sites: it uploads, then waits for a round that never closes.
        wait_until(lambda: server.rounds.status()["contributed"] == ["solo"], server)
        agent.stop()
        summary = thread.finish(30)
        wait_until(lambda: server.rounds.members == [], server)
    finally:
        server.stop(grace=0)
    assert not summary.run_finished and summary.rounds_trained == 0 and summary.final_round == 0


class RecordCallOrder(grpc.UnaryStreamClientInterceptor, grpc.StreamUnaryClientInterceptor):
    """Records, in order, when each AwaitBroadcast starts and each Upload starts and ends."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def _record(self, what: str, round_number: int) -> None:
        with self._lock:
            self.events.append((what, round_number))

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        if details.method.endswith("/AwaitBroadcast"):
            self._record("await", request.round)
        return continuation(details, request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Iterator[Any]) -> Any:
        if not details.method.endswith("/Upload"):
            return continuation(details, requests)
        requests = iter(requests)
        first = next(requests)
        round_number = first.manifest.round
        self._record("upload", round_number)

        def replay() -> Iterator[Any]:
            yield first
            yield from requests

        response = continuation(details, replay())
        self._record("uploaded", round_number)
        return response


@pytest.mark.parametrize("streaming", [False, True], ids=["plain", "streaming"])
def test_the_broadcast_wait_is_open_before_the_upload_starts(certs: Path, mlp: Any, streaming: bool) -> None:
    """The last site's broadcast must leave the coordinator when the round closes, not one round
    trip later: the site asks for it before uploading, with a single call per round. A streaming
    site's fragments take the same path (on a 160 ms round trip it asked only after its upload's
    answer, and every fragment came back a round trip late)."""
    algorithm = AlgorithmConfig(
        inner_steps=2,
        streaming=StreamingConfig(enabled=True, fragments=2, overlap_steps=1) if streaming else StreamingConfig(),
    )
    server = start_coordinator(certs, mlp.build_model(0), algorithm=algorithm, total_rounds=3, min_sites=1)
    recorder = RecordCallOrder()
    try:
        agent = make_agent(mlp, server, certs, "solo", index=0, num_sites=1, seed=0, interceptors=[recorder])
        thread = AgentThread(agent)
        thread.start()
        summary = thread.finish()
    finally:
        server.stop(grace=0)
    assert summary.rounds_included == 3 and summary.weights_digest == server.rounds.digest_hex
    assert recorder.events == [
        event for r in range(3) for event in (("await", r), ("upload", r), ("uploaded", r))
    ]

"""A sharded site's saved state (``ShardedSite(state_dir=...)``): a restarted rank takes up its
error-feedback residual, and a state saved for another site or shard is refused by name. The
run's int8 downlink reaches the rank as the quantizer blocks around its rows. A model built on the
meta device gets its rows from the coordinator at join.

One rank (a world of one, gloo, in this process) is enough to see what every rank does with its
own folder; the coordinator is real (gRPC, mutual TLS, port 0).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _cluster import make_certs
from torch import nn

from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.server import CoordinatorServer
from geoloco.protos.transport_tls import TLSFiles
from geoloco.scenarios.workloads.mlp import MLPWorkload, MLPWorkloadConfig
from geoloco.site_agent.config import SiteAgentConfig
from geoloco.site_agent.persist import POINTER_NAME, SiteStateError
from geoloco.site_agent.sharded import ShardedSite

pytest.importorskip("torch.distributed.fsdp")

WORKLOAD = MLPWorkloadConfig(input_dim=8, hidden_dim=32, num_classes=3)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg-store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _coordinator(certs: Path, total_rounds: int, algorithm: AlgorithmConfig) -> CoordinatorServer:
    """A started coordinator of one site "fs" for the workload's model (seed 0)."""
    model = MLPWorkload(WORKLOAD).build_model(0)
    layout = ParamLayout.from_model(model)
    server = CoordinatorServer(
        CoordinatorConfig(certs_dir=str(certs), min_sites=1, total_rounds=total_rounds, heartbeat_timeout_s=600.0,
                          algorithm=algorithm),
        layout.flatten(model), layout, None,
    )
    server.start()
    return server


def _sharded(certs: Path, port: int, state_dir: Path) -> ShardedSite:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    workload = MLPWorkload(WORKLOAD)
    model = workload.build_model(0)
    mesh = init_device_mesh("cpu", (1,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return ShardedSite(
        model, torch.optim.SGD(model.parameters(), lr=0.05), workload.site_batches(0, 1, 0), workload.loss,
        coordinator=f"localhost:{port}", site="fs", tls=TLSFiles.from_dir(certs, "fs"),
        config=SiteAgentConfig(device="cpu", backoff_initial_s=0.05), state_dir=state_dir,
    )


def test_a_restarted_rank_takes_up_its_residual_and_refuses_another_sites_state(world: None, tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs", ["fs"])
    server = _coordinator(certs, 5, AlgorithmConfig(
        inner_steps=2, uplink_codec="int8", downlink_codec="int8:block=64", error_feedback=True
    ))
    state = tmp_path / "state"
    try:
        first = _sharded(certs, server.port, state)
        first.run(max_rounds=2)
        # The int8 broadcast reached the rank sliced (the blocks around its rows; with one rank,
        # every block), and what it added matched the coordinator's digest of its rows both times.
        assert first.summary.digests_checked == 2 and first.summary.resyncs == 0
        assert first.residual is not None
        saved = first.residual.clone()
        assert saved.abs().sum() > 0  # int8 left something behind

        restarted = _sharded(certs, server.port, state)
        rounds = restarted.rounds()
        current = next(rounds)  # joined: the state is taken up before the first round
        assert current.number == 2 and restarted.summary.restored_round == 2
        assert restarted.residual is not None
        assert torch.equal(restarted.residual, saved)
        rounds.close()

        pointer = state / "rank-0-of-1" / POINTER_NAME
        data = json.loads(pointer.read_text())
        data["meta"]["site"] = "elsewhere"
        pointer.write_text(json.dumps(data))
        other = _sharded(certs, server.port, state)
        with pytest.raises(SiteStateError, match=r"saved for another site .*site 'elsewhere'.*delete it"):
            next(other.rounds())
    finally:
        server.stop(grace=0)


def test_a_model_built_on_the_meta_device_gets_its_rows_from_the_coordinator(world: None, tmp_path: Path) -> None:
    """No rank need ever hold the whole model: built on ``meta``, sharded, given storage with
    ``to_empty`` (uninitialised), the rows are filled with the coordinator's weights at join."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    certs = make_certs(tmp_path / "certs", ["fs"])
    reference = MLPWorkload(WORKLOAD).build_model(0)
    layout = ParamLayout.from_model(reference)
    server = _coordinator(certs, 1, AlgorithmConfig(inner_steps=1, uplink_codec="none"))
    try:
        with torch.device("meta"):
            model = MLPWorkload(WORKLOAD).build_model(0)
        mesh = init_device_mesh("cpu", (1,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        site = ShardedSite(
            model, torch.optim.SGD(model.parameters(), lr=0.05), coordinator=f"localhost:{server.port}",
            site="fs", tls=TLSFiles.from_dir(certs, "fs"), config=SiteAgentConfig(device="cpu"),
        )
        rounds = site.rounds()
        next(rounds)
        held = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
        assert torch.equal(held, layout.flatten(reference))
        rounds.close()
    finally:
        server.stop(grace=0)


def test_a_run_without_a_round_count_trains_until_the_site_stops(world: None, tmp_path: Path) -> None:
    """``total_rounds = 0`` (run until stopped): the site trains rounds, not none."""
    certs = make_certs(tmp_path / "certs", ["fs"])
    server = _coordinator(certs, 0, AlgorithmConfig(inner_steps=1, uplink_codec="none"))
    try:
        site = _sharded(certs, server.port, tmp_path / "state")
        summary = site.run(max_rounds=2)
        assert summary.rounds_trained == 2 and summary.rounds_included == 2 and not summary.run_finished
    finally:
        server.stop(grace=0)


def test_a_round_that_closes_between_join_and_fetch_makes_the_site_join_again(
    world: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The ranks fetch their rows after rank 0 joined; when a round closes in between, the rows
    are of a round whose seed the join did not tell. The site joins again and trains the round
    its rows are of, instead of labelling them with the round it joined at."""
    import threading

    from _cluster import AgentThread

    from geoloco.site_agent.agent import SiteAgent
    from geoloco.site_agent.config import SiteHooks

    certs = make_certs(tmp_path / "certs", ["fs", "solo"])
    model = MLPWorkload(WORKLOAD).build_model(0)
    layout = ParamLayout.from_model(model)
    server = CoordinatorServer(
        CoordinatorConfig(certs_dir=str(certs), min_sites=1, total_rounds=4, heartbeat_timeout_s=600.0,
                          round_deadline_s=1.0, algorithm=AlgorithmConfig(inner_steps=1, uplink_codec="none")),
        layout.flatten(model), layout, None,
    )
    server.start()
    released = threading.Event()
    solo_model = MLPWorkload(WORKLOAD).build_model(0)
    solo = AgentThread(SiteAgent(
        solo_model, torch.optim.SGD(solo_model.parameters(), lr=0.05), MLPWorkload(WORKLOAD).site_batches(1, 2, 0),
        MLPWorkload(WORKLOAD).loss, coordinator=f"localhost:{server.port}", site="solo",
        tls=TLSFiles.from_dir(certs, "solo"), config=SiteAgentConfig(device="cpu", backoff_initial_s=0.05),
        # After its first round solo holds until the test has seen fs's first round.
        hooks=SiteHooks(on_round_end=lambda result: released.wait(60.0)),
    ))
    try:
        site = _sharded(certs, server.port, tmp_path / "state")
        fetch_model = site.client.fetch_model
        joined_at: list[int] = []

        def fetch_after_a_round_closed(numel: int) -> object:
            if not joined_at:  # the first fetch: let round 0 close (solo's upload, fs past the deadline)
                joined_at.append(server.rounds.round)
                solo.start()
                for _ in range(600):
                    if server.rounds.round > joined_at[0]:
                        break
                    threading.Event().wait(0.05)
            return fetch_model(numel)

        site.client.fetch_model = fetch_after_a_round_closed  # type: ignore[method-assign]
        rounds = site.rounds()
        with caplog.at_level("INFO", logger="geoloco.site_agent.sharded"):
            current = next(rounds)
        assert joined_at == [0]
        assert current.number == 1, "the site must train the round its rows are of"
        assert "joining again" in caplog.text
        held = torch.cat([p.to_local().detach().reshape(-1) for p in site.model.parameters()])
        assert torch.equal(held, server.rounds.weights)
        rounds.close()
    finally:
        released.set()
        solo.agent.stop()
        solo.join(30.0)
        server.stop(grace=0)


def test_a_loop_that_reports_no_loss_uploads_its_rows_over_parallel_streams(world: None, tmp_path: Path) -> None:
    """A ``rounds()`` loop need not report a loss. The site's ``train_loss`` is then unknown and
    not sent: a NaN in the upload's manifest made it unequal to itself, so each of the rank's
    parallel streams replaced the other's upload and the round failed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    certs = make_certs(tmp_path / "certs", ["fs"])
    metrics = tmp_path / "metrics.jsonl"
    model = MLPWorkload(WORKLOAD).build_model(0)
    layout = ParamLayout.from_model(model)
    server = CoordinatorServer(
        CoordinatorConfig(certs_dir=str(certs), min_sites=1, total_rounds=2, heartbeat_timeout_s=600.0,
                          metrics_path=str(metrics), algorithm=AlgorithmConfig(inner_steps=1, uplink_codec="none")),
        layout.flatten(model), layout, None,
    )
    server.start()
    try:
        workload = MLPWorkload(WORKLOAD)
        mesh = init_device_mesh("cpu", (1,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        site = ShardedSite(
            model, optimizer, coordinator=f"localhost:{server.port}", site="fs", tls=TLSFiles.from_dir(certs, "fs"),
            config=SiteAgentConfig(device="cpu", chunk_size=256, parallel_streams=2),
        )
        batches = workload.site_batches(0, 1, 0)
        for current in site.rounds():
            for _ in range(current.inner_steps):
                optimizer.zero_grad()
                workload.loss(model, next(batches)).backward()
                optimizer.step()
        assert site.summary.rounds_included == 2 and site.summary.run_finished
    finally:
        server.stop(grace=0)
    from geoloco.coordinator.metrics import read_metrics

    reported = [record["site_metrics"]["fs"] for record in read_metrics(metrics)]
    assert [("train_loss" in m, m["inner_steps"]) for m in reported] == [(False, 1.0), (False, 1.0)], reported

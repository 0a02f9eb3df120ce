"""The site's saved state (``geoloco.site_agent.persist``): files, round trips, refusals.

The end-to-end guarantee (a site killed with ``kill -9`` at three moments of a round ends on the
uninterrupted run's weights bit for bit) is tested with real processes in
``tests/integration/test_site_restart.py``; here are the parts, and a site that is given the state
of another site, model or run refusing it with a message that says what differs.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
from pathlib import Path

import pytest
import torch
from _agent_helpers import AgentThread, make_agent, make_certs, start_coordinator

from geoloco.algorithms.optimizers import InnerOptimizerConfig
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.protos.atomic_files import atomic_write
from geoloco.scenarios.workloads import MLPWorkload, MLPWorkloadConfig
from geoloco.site_agent.agent import SiteAgent, SiteRunSummary
from geoloco.site_agent.config import SiteAgentConfig
from geoloco.site_agent.persist import (
    POINTER_NAME,
    SiteSnapshot,
    SiteStateError,
    SiteStateStore,
    load_optimizer_state,
    optimizer_state,
)
from geoloco.site_agent.trainer import SiteTrainer


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"), ["a", "b"])


def _snapshot(value: float) -> SiteSnapshot:
    return SiteSnapshot(tensors={"w": torch.full((5,), value)}, meta={"value": value})


def test_store_keeps_the_newest_state_and_prunes_older_files(tmp_path: Path) -> None:
    store = SiteStateStore(tmp_path, keep=2)
    assert store.load() is None
    for value in (1.0, 2.0, 3.0):
        store.save(_snapshot(value))
    loaded = SiteStateStore(tmp_path).load()
    assert loaded is not None and loaded.meta == {"value": 3.0}
    assert torch.equal(loaded.tensors["w"], torch.full((5,), 3.0))
    assert len(list(tmp_path.glob("site-state-*.safetensors"))) == 2
    # A new store (a restarted process) numbers its files after the newest on disk.
    SiteStateStore(tmp_path).save(_snapshot(4.0))
    reloaded = SiteStateStore(tmp_path).load()
    assert reloaded is not None and reloaded.meta == {"value": 4.0}


def test_a_write_that_fails_midway_leaves_the_previous_state(tmp_path: Path) -> None:
    store = SiteStateStore(tmp_path)
    store.save(_snapshot(1.0))
    pointer = (tmp_path / POINTER_NAME).read_bytes()

    class Broken(dict[str, torch.Tensor]):
        def items(self):  # type: ignore[no-untyped-def]
            raise OSError("disk full")

    with pytest.raises(OSError):
        store.save(SiteSnapshot(tensors=Broken(), meta={}))
    assert (tmp_path / POINTER_NAME).read_bytes() == pointer
    assert not list(tmp_path.glob(".*tmp*"))
    loaded = SiteStateStore(tmp_path).load()
    assert loaded is not None and loaded.meta == {"value": 1.0}


def test_a_damaged_state_is_refused(tmp_path: Path) -> None:
    store = SiteStateStore(tmp_path)
    path = store.save(_snapshot(1.0))
    path.write_bytes(path.read_bytes()[:-4] + b"\0\0\0\1")
    with pytest.raises(SiteStateError, match="fails its checksum"):
        SiteStateStore(tmp_path).load()
    atomic_write(tmp_path / POINTER_NAME, b"{not json")
    with pytest.raises(SiteStateError, match="not a geoloco site state"):
        SiteStateStore(tmp_path).load()


def test_inner_optimizer_state_round_trips_exactly() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).square().mean().backward()
        optimizer.step()
    tensors, meta = optimizer_state(optimizer)
    tensors = {name: t.clone() for name, t in tensors.items()}  # as read back from the file
    meta = json.loads(json.dumps(meta))  # it is stored as JSON

    twin = torch.nn.Linear(4, 3)
    twin.load_state_dict(model.state_dict())
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=1.0, betas=(0.1, 0.2))
    load_optimizer_state(twin_optimizer, tensors, meta)
    assert twin_optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    batch = torch.randn(8, 4)
    for m, opt in ((model, optimizer), (twin, twin_optimizer)):
        opt.zero_grad()
        m(batch).square().mean().backward()
        opt.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def _run(agent: SiteAgent, max_rounds: int) -> SiteRunSummary:
    thread = AgentThread(agent, max_rounds)
    thread.start()
    return thread.finish()


def _config(state_dir: Path) -> SiteAgentConfig:
    return SiteAgentConfig(device="cpu", backoff_initial_s=0.05, backoff_max_s=0.5, state_dir=str(state_dir))


def test_a_restarted_site_goes_on_from_its_state_and_refuses_another_sites_model_or_run(
    certs: Path, tmp_path: Path
) -> None:
    mlp = MLPWorkload()
    state_dir = tmp_path / "state"
    server = start_coordinator(
        certs, mlp.build_model(0), total_rounds=6, min_sites=1, seed=0,
        algorithm=AlgorithmConfig(inner_steps=3, uplink_codec="int8"),
    )
    try:
        first = make_agent(mlp, server, certs, "a", index=0, num_sites=1, seed=0, config=_config(state_dir))
        summary = _run(first, 2)
        assert summary.final_round == 2
        # A new process of the same site takes its state back before joining.
        again = make_agent(mlp, server, certs, "a", index=0, num_sites=1, seed=0, config=_config(state_dir))
        assert again.held_round == 2 and again.weights_digest == summary.weights_digest
        assert again.trainer.steps_done == first.trainer.steps_done
        for p, q in zip(again.optimizer.state_dict()["state"].values(),
                        first.optimizer.state_dict()["state"].values(), strict=True):
            assert torch.equal(p["exp_avg"], q["exp_avg"])
        residual, saved = again.uplink_residual(), first.uplink_residual()
        assert residual is None  # restored into the uplink at the first join
        summary = _run(again, 3)  # max_rounds counts the rounds trained before the restart too
        assert summary.final_round == 3
        assert again.state.rounds_trained == 3
        restored = again.uplink_residual()
        assert saved is not None and restored is not None and restored.shape == saved.shape

        with pytest.raises(SiteStateError, match="belongs to site 'a', not 'b'"):
            make_agent(mlp, server, certs, "b", index=0, num_sites=1, seed=0, config=_config(state_dir))
        wider = MLPWorkload(MLPWorkloadConfig(hidden_dim=MLPWorkloadConfig().hidden_dim + 1))
        with pytest.raises(SiteStateError, match="another model"):
            make_agent(wider, server, certs, "a", index=0, num_sites=1, seed=0, config=_config(state_dir))
    finally:
        server.stop(grace=0)

    other_run = start_coordinator(
        certs, mlp.build_model(0), total_rounds=6, min_sites=1, seed=9,
        algorithm=AlgorithmConfig(inner_steps=3, uplink_codec="int8"),
    )
    try:
        agent = make_agent(mlp, other_run, certs, "a", index=0, num_sites=1, seed=0, config=_config(state_dir))
        thread = AgentThread(agent)
        thread.run()
        assert isinstance(thread.error, SiteStateError), thread.error
        assert "another run" in str(thread.error) and "seed" in str(thread.error)
    finally:
        other_run.stop(grace=0)


def test_the_data_stream_is_replayed_to_the_saved_position(certs: Path, tmp_path: Path) -> None:
    """A restarted site's next batch is the one the saved site would have drawn next."""
    mlp = MLPWorkload()
    state_dir = tmp_path / "state"
    server = start_coordinator(certs, mlp.build_model(0), total_rounds=4, min_sites=1, seed=0)
    try:
        agent = make_agent(mlp, server, certs, "a", index=0, num_sites=1, seed=0, config=_config(state_dir))
        _run(agent, 1)
        drawn = agent.trainer.steps_done
        assert drawn > 0
        again = make_agent(mlp, server, certs, "a", index=0, num_sites=1, seed=0, config=_config(state_dir))
        expected = next(itertools.islice(mlp.site_batches(0, 1, 0), drawn, None))
        actual = next(again.trainer._data)
        assert all(torch.equal(x, y) for x, y in zip(actual, expected, strict=True))
    finally:
        server.stop(grace=0)


def _trainer(workload: MLPWorkload) -> SiteTrainer:
    inner = InnerOptimizerConfig(lr=1e-2, schedule="cosine", warmup_steps=3, decay_steps=40)
    model = workload.build_model(0)
    optimizer = inner.build(model.parameters())
    return SiteTrainer(
        model, optimizer, workload.site_batches(0, 1, 0), workload.loss, site="a",
        config=SiteAgentConfig(device="cpu"), device=torch.device("cpu"), group=None,
        lr_schedule=inner.build_schedule(optimizer), stop=threading.Event(),
    )


def test_trainer_state_round_trips_the_lr_step_data_position_and_next_steps_exactly(tmp_path: Path) -> None:
    """Seven steps, saved, restored into a fresh trainer: the lr schedule stands at step 7 (not
    at a round's nominal start), and both trainers' next steps give the same weights."""
    mlp = MLPWorkload()
    first = _trainer(mlp)
    first.train_steps(7)
    tensors, meta = first.snapshot()
    store = SiteStateStore(tmp_path)
    store.save(SiteSnapshot(tensors=tensors, meta=meta))
    saved = SiteStateStore(tmp_path).load()
    assert saved is not None

    second = _trainer(mlp)
    second.load_(first.flatten())
    second.restore(saved.tensors, saved.meta)
    assert second.lr_schedule is not None and second.lr_schedule.step_count == 7
    assert second.optimizer.param_groups[0]["lr"] == first.optimizer.param_groups[0]["lr"]
    assert second.steps_done == first.steps_done == 7
    first.train_steps(5)
    second.train_steps(5)
    assert torch.equal(first.flatten(), second.flatten())


def test_a_site_warns_loudly_when_the_coordinators_run_goes_backwards(
    certs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A coordinator restarted with ``--fresh`` by mistake is at round 0 in a new session; the
    site, which held round 2, says so at WARNING (what happened, what to check) in one line."""
    mlp = MLPWorkload()
    state_dir = tmp_path / "state"
    settings = {"total_rounds": 6, "min_sites": 1, "seed": 0, "algorithm": AlgorithmConfig(inner_steps=2)}
    first = start_coordinator(certs, mlp.build_model(0), **settings)
    try:
        assert _run(make_agent(mlp, first, certs, "a", index=0, num_sites=1, seed=0, config=_config(state_dir)), 2)
    finally:
        first.stop(grace=0)
    fresh = start_coordinator(certs, mlp.build_model(0), **settings)
    try:
        caplog.set_level(logging.WARNING, logger="geoloco.site_agent")
        agent = make_agent(mlp, fresh, certs, "a", index=0, num_sites=1, seed=0, config=_config(state_dir))
        assert agent.held_round == 2
        summary = _run(agent, 3)
        assert summary.final_round == 1  # it took the new run's weights and went on from round 0
    finally:
        fresh.stop(grace=0)
    warnings = [r.getMessage() for r in caplog.records if "BACKWARDS" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0], [r.getMessage() for r in caplog.records]
    assert "round 0" in warnings[0] and "at round 2" in warnings[0] and "--fresh" in warnings[0]
    assert [r.levelno for r in caplog.records if "BACKWARDS" in r.getMessage()] == [logging.WARNING]

"""Sharded (FSDP2) sites through the real system: torchrun ranks on gloo/CPU, a real coordinator
over gRPC with mutual TLS on port 0, temp dirs.

* A 2-rank FSDP site, a 2-rank data-parallel site (two runs, same model, data and SGD) and the
  simulator (one site whose batches are both ranks' together) end on the same weights: within
  1e-5 relative, 1e-6 absolute, because FSDP2 reduce-scatters the gradients (sum, then divide
  by the world size), DDP all-reduces bucketed gradients and the simulator takes the gradient
  of the mean loss over both batches: the same numbers added in another order, one float32
  rounding apart per step; 3 rounds of 3 SGD steps keep that far below the bound. Every FSDP
  rank's rows equal the coordinator's exactly (the broadcast is added with the same float sum on
  both sides), each rank downloaded about half a model per transfer (its rows) and checked its
  rows against the coordinator's digest after every round.
* The two ranks' uploads overlap in time (from their recorded timestamps: in some round each
  rank's upload started before the other's ended; a shard of ~280 chunks takes tens of ms, the
  ranks start theirs within a few ms of each other after the same all-reduce).
* A rank SIGKILLed half-way through its shard's upload: its site is a straggler for that round
  (nothing of it enters the sum); the job started again joins as the same site and counts again
  in a later round, and the run finishes.
* A NaN loss on one rank (its NaN gradients reach both ranks' rows): no rank uploads that round,
  the site takes the broadcast and counts again in the next one.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _cluster import AgentThread, make_certs
from _sharded_site import INNER_STEPS, LR, SEED, WORKLOAD
from _torchrun import finish, torchrun

from geoloco.algorithms.optimizers import InnerOptimizerConfig
from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.simulation.clock import SiteConfig
from geoloco.algorithms.simulation.simulator import SimulationConfig, Simulator, SimulatorConfig
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator import events as ev
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.metrics import read_metrics
from geoloco.coordinator.server import CoordinatorServer
from geoloco.protos.transport_tls import TLSFiles
from geoloco.scenarios.workloads.mlp import MLPWorkload
from geoloco.site_agent.agent import SiteAgent
from geoloco.site_agent.config import RoundResult, SiteAgentConfig, SiteHooks
from geoloco.site_agent.distributed import rank_data_seed

pytest.importorskip("torch.distributed.fsdp")


WORKER = Path(__file__).with_name("_sharded_site.py")
LAUNCH_TIMEOUT_S = 240.0
"""Upper bound for one torchrun launch (seconds when idle); only a hang gets near it."""
ROUNDS = 3


class _TwoRankSite:
    """The workload as one simulated site sees a 2-rank site: every batch is rank 0's and rank
    1's batch together, so the mean loss's gradient is the mean of the ranks' mean gradients,
    which FSDP's reduce-scatter and DDP's all-reduce compute (in another float order)."""

    def __init__(self) -> None:
        self.inner = MLPWorkload(WORKLOAD)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def site_batches(self, site: int, num_sites: int, seed: int) -> Iterator[tuple[torch.Tensor, ...]]:
        ranks = [self.inner.site_batches(0, 1, rank_data_seed(SEED, r)) for r in range(2)]
        while True:
            parts = [next(stream) for stream in ranks]
            yield tuple(torch.cat(tensors) for tensors in zip(*parts, strict=True))


def _simulated() -> torch.Tensor:
    """The simulator's weights after the same run (one site, same H, codec, SGD lr, init)."""
    config = SimulatorConfig(
        algorithm=AlgorithmConfig(inner_steps=INNER_STEPS, uplink_codec="none", weighting="samples"),
        inner_optimizer=InnerOptimizerConfig(name="sgd", lr=LR),
        sites=[SiteConfig()],
        simulation=SimulationConfig(rounds=ROUNDS, seed=SEED, device="cpu", eval_every=10**6),
    )
    simulator = Simulator(config, _TwoRankSite())  # type: ignore[arg-type]
    for _ in simulator.run():
        pass
    return simulator.global_flat


def _coordinator(certs: Path, metrics: Path, **config: Any) -> CoordinatorServer:
    model = MLPWorkload(WORKLOAD).build_model(SEED)
    layout = ParamLayout.from_model(model)
    server = CoordinatorServer(
        CoordinatorConfig(
            certs_dir=str(certs), metrics_path=str(metrics), min_sites=1,
            algorithm=AlgorithmConfig(inner_steps=INNER_STEPS, uplink_codec="none", weighting="samples"),
            **{"total_rounds": ROUNDS, **config},
        ),
        layout.flatten(model), layout, None,
    )
    server.start()
    return server


def _launch(mode: str, site: str, server: CoordinatorServer, certs: Path, out: Path,
            **env_extra: str) -> subprocess.Popen[str]:
    return torchrun([str(WORKER), mode, site, f"localhost:{server.port}", str(certs), str(out)], **env_extra)


def _finish(proc: subprocess.Popen[str]) -> str:
    return finish(proc, LAUNCH_TIMEOUT_S)


def _solo(server: CoordinatorServer, certs: Path, hooks: SiteHooks | None = None) -> AgentThread:
    """A single-process site "solo" beside the sharded site "fs" (not started yet)."""
    workload = MLPWorkload(WORKLOAD)
    model = workload.build_model(SEED)
    return AgentThread(SiteAgent(
        model, torch.optim.SGD(model.parameters(), lr=LR), workload.site_batches(0, 1, SEED + 1), workload.loss,
        coordinator=f"localhost:{server.port}", site="solo", tls=TLSFiles.from_dir(certs, "solo"),
        config=SiteAgentConfig(device="cpu", backoff_initial_s=0.05), hooks=hooks or SiteHooks(),
    ))


def _start_once_fs_joined(server: CoordinatorServer, proc: subprocess.Popen[str], solo: AgentThread) -> None:
    """Start ``solo`` once the sharded site joined (torchrun starts slowly), so both take part
    from round 0 on."""
    give_up = time.monotonic() + LAUNCH_TIMEOUT_S
    while "fs" not in server.rounds.members and proc.poll() is None and time.monotonic() < give_up:
        time.sleep(0.05)
    solo.start()


def test_fsdp_site_matches_data_parallel_site_and_uploads_shards_in_parallel(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs", ["fs", "dp"])
    out = tmp_path / "out"
    out.mkdir()
    fs_server = _coordinator(certs, tmp_path / "fs.jsonl")
    dp_server = _coordinator(certs, tmp_path / "dp.jsonl")
    try:
        procs = {mode: _launch(mode, site, server, certs, out)
                 for mode, site, server in (("fsdp", "fs", fs_server), ("dp", "dp", dp_server))}
        outputs = {mode: _finish(proc) for mode, proc in procs.items()}
        for mode, proc in procs.items():
            assert proc.returncode == 0, f"{mode} site failed:\n{outputs[mode][-6000:]}"
        fs_weights, dp_weights = fs_server.rounds.weights.clone(), dp_server.rounds.weights.clone()
    finally:
        fs_server.stop(grace=0)
        dp_server.stop(grace=0)
    initial = ParamLayout.from_model(MLPWorkload(WORKLOAD).build_model(SEED))
    assert not torch.equal(fs_weights, initial.flatten(MLPWorkload(WORKLOAD).build_model(SEED)))
    torch.testing.assert_close(fs_weights, dp_weights, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fs_weights, _simulated(), rtol=1e-5, atol=1e-6)

    ranks = [torch.load(out / f"fsdp-rank{r}.pt", weights_only=False) for r in range(2)]
    covered = torch.zeros(fs_weights.numel(), dtype=torch.int64)
    for rank, saved in enumerate(ranks):
        rows = torch.cat([fs_weights[o : o + n] for o, n in saved["ranges"]])
        assert torch.equal(saved["held"], rows), f"rank {rank}'s rows differ from the coordinator's"
        assert saved["held"].numel() < fs_weights.numel()  # a shard, not the model
        for o, n in saved["ranges"]:
            covered[o : o + n] += 1
        summary = saved["summary"]
        assert summary["rounds_trained"] == summary["rounds_included"] == ROUNDS
        assert summary["run_finished"]
        # Each rank downloaded its rows, not the model: the join's weights and 3 deltas of
        # ``none`` are 4 model-sized transfers for a whole site; a rank's are about half that.
        assert summary["bytes_received"] < 0.6 * 4 * fs_weights.numel() * 4, summary["bytes_received"]
        assert summary["digests_checked"] == ROUNDS and summary["resyncs"] == 0
    assert bool((covered == 1).all()), "the two ranks' shards must tile the vector exactly once"
    for dp_rank in range(2):
        dp = torch.load(out / f"dp-rank{dp_rank}.pt", weights_only=False)
        assert torch.equal(dp["weights"], dp_weights)

    # The sharded site runs a data-parallel site's round (``SyncRounds``), so it reports what
    # one reports: the same metric names (training, phase seconds) and the same mean loss.
    fs_records, dp_records = read_metrics(tmp_path / "fs.jsonl"), read_metrics(tmp_path / "dp.jsonl")
    assert len(fs_records) == len(dp_records) == ROUNDS
    for fs_record, dp_record in zip(fs_records, dp_records, strict=True):
        fs_metrics, dp_metrics = fs_record["site_metrics"]["fs"], dp_record["site_metrics"]["dp"]
        assert set(dp_metrics) <= set(fs_metrics), (fs_metrics, dp_metrics)
        assert fs_metrics["train_loss"] == pytest.approx(dp_metrics["train_loss"], rel=1e-4)
        assert fs_metrics["inner_steps"] == dp_metrics["inner_steps"] == INNER_STEPS
        assert set(fs_record["site_phases_s"]["fs"]) == set(dp_record["site_phases_s"]["dp"])

    # The ranks uploaded concurrently: in some round each started before the other ended.
    spans = [{r: (s, e) for r, s, e in saved["summary"]["upload_spans"]} for saved in ranks]
    overlapping = [
        t for t in range(ROUNDS)
        if max(spans[0][t][0], spans[1][t][0]) < min(spans[0][t][1], spans[1][t][1])
    ]
    assert overlapping, f"the ranks' uploads never overlapped: {spans}"

    records = read_metrics(tmp_path / "fs.jsonl")
    assert [r["participants"] for r in records] == [["fs"]] * ROUNDS
    batch = WORKLOAD.batch_size
    # One site, counted once per round, with the weight of both ranks' batches.
    assert all(r["sample_weights"]["fs"] == 2 * INNER_STEPS * batch for r in records)
    # The site's loss, the two ranks' mean, reported by every shard alike.
    assert all(0 < r["site_metrics"]["fs"]["loss"] < 10 for r in records), records


def test_rank_killed_mid_upload_makes_its_site_a_straggler_and_torchrun_brings_it_back(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs", ["fs", "solo"])
    out = tmp_path / "out"
    out.mkdir()
    metrics = tmp_path / "fs.jsonl"
    # Rounds without fs close at the 3 s deadline. The run must not end before the fresh torchrun
    # launch joined again, however slowly a loaded machine starts it (a fixed number of rounds
    # gave it 30 s, then 66 s, and it missed both under CI load): once the killed launch is gone,
    # "solo" holds at the end of each round until the coordinator saw fs join again, so no round
    # closes meanwhile (min_sites = 1 needs solo's upload).
    rounds = 12
    server = _coordinator(certs, metrics, round_deadline_s=3.0, heartbeat_timeout_s=6.0, total_rounds=rounds)
    relaunched, fs_back = threading.Event(), threading.Event()

    def on_event(event: ev.RoundEvent) -> None:
        if event.kind == ev.SITE_JOINED and event.site == "fs" and relaunched.is_set():
            fs_back.set()

    server.rounds.events.add_listener(on_event)

    def hold_until_fs_is_back(result: RoundResult) -> None:
        if relaunched.is_set() and not fs_back.wait(LAUNCH_TIMEOUT_S):
            raise AssertionError(f"the restarted sharded site did not join within {LAUNCH_TIMEOUT_S:.0f} s")

    solo = _solo(server, certs, SiteHooks(on_round_end=hold_until_fs_is_back))
    try:
        proc = _launch("fsdp", "fs", server, certs, out, KILL_AT_ROUND="1")
        _start_once_fs_joined(server, proc, solo)
        output = _finish(proc)
        killed_returncode = proc.returncode
        # The job is started again (as a supervisor or torchrun's --max-restarts would; a fresh
        # launch here, because gloo's re-rendezvous inside one torchrun is flaky on a loaded
        # machine); its ranks join again as the same site, with no saved state.
        relaunched.set()
        proc = _launch("fsdp", "fs", server, certs, out)
        output += _finish(proc)
        solo.join(timeout=LAUNCH_TIMEOUT_S)
        records = read_metrics(metrics)
    finally:
        solo.agent.stop()
        server.stop(grace=0)
    assert killed_returncode != 0, f"the killed rank's launch should fail:\n{output[-3000:]}"
    assert solo.error is None and solo.summary is not None and solo.summary.run_finished, solo.error
    by_round = {r["round"]: r for r in records}
    assert sorted(by_round) == list(range(rounds)), f"the run did not finish: {records}"
    assert sorted(by_round[0]["participants"]) == ["fs", "solo"]
    # Round 1: rank 0's shard arrived whole, rank 1's only half: the site did not count at all.
    assert by_round[1]["participants"] == ["solo"]
    assert "fs" not in by_round[1]["sample_weights"]
    # The restarted site joined again and counted, once, in a later round.
    back = [r for r in range(2, rounds) if "fs" in by_round[r]["participants"]]
    assert back, f"the restarted site never counted again:\n{output[-8000:]}"
    assert proc.returncode == 0, f"the restarted site failed:\n{output[-3000:]}"


def test_a_refused_join_stops_every_rank_with_the_reason(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs", ["fs", "solo"])
    out = tmp_path / "out"
    out.mkdir()
    server = _coordinator(certs, tmp_path / "fs.jsonl", allowed_sites=["solo"])
    try:
        proc = _launch("fsdp", "fs", server, certs, out)
        output = _finish(proc)
    finally:
        server.stop(grace=0)
    assert proc.returncode != 0
    # Rank 1 heard of rank 0's refusal over the site's process group, instead of waiting in the
    # collective until its timeout.
    assert "[rank1]:" in output and "rank 0 could not join the run" in output, output[-3000:]
    assert "not in this run's allowed_sites" in output


def test_a_non_finite_shard_is_not_uploaded_and_the_site_goes_on(tmp_path: Path) -> None:
    """As every site runner does with a NaN pseudo-gradient: the site sends nothing that round
    (no rank: a site missing a shard is never counted), resets its residual, takes the round's
    broadcast and counts again in the next round; the global weights stay finite."""
    certs = make_certs(tmp_path / "certs", ["fs", "solo"])
    out = tmp_path / "out"
    out.mkdir()
    metrics = tmp_path / "fs.jsonl"
    # The round fs sends nothing in closes with solo's update at the deadline.
    server = _coordinator(certs, metrics, round_deadline_s=2.0)
    solo = _solo(server, certs)
    try:
        proc = _launch("fsdp", "fs", server, certs, out, NAN_AT_ROUND="1")
        _start_once_fs_joined(server, proc, solo)
        output = _finish(proc)
        solo.join(timeout=LAUNCH_TIMEOUT_S)
        weights = server.rounds.weights.clone()
        records = read_metrics(metrics)
    finally:
        solo.agent.stop()
        server.stop(grace=0)
    assert proc.returncode == 0, f"the sharded site failed:\n{output[-6000:]}"
    assert solo.error is None, solo.error
    assert "has NaN/Inf values on 2 of 2 ranks" in output, output[-3000:]
    assert bool(torch.isfinite(weights).all())
    assert [sorted(r["participants"]) for r in records] == [["fs", "solo"], ["solo"], ["fs", "solo"]], records
    for rank in range(2):
        summary = torch.load(out / f"fsdp-rank{rank}.pt", weights_only=False)["summary"]
        assert summary["rounds_trained"] == ROUNDS and summary["rounds_included"] == ROUNDS - 1
        assert summary["run_finished"]

"""Partial Parameter Updates and SparseLoCo's per-tensor tiles through the real system: a
coordinator and two sites over gRPC with mutual TLS (sites as threads, as in
test_real_system_matches_simulator) end on the simulator's weights; with partial updates each site
trains and uploads only its group's tensors.

Equality: with ``mode = "blocks"`` every coordinate is trained by exactly one site, so the
coordinator's per-coordinate mean does not depend on the order uploads arrive in, and the run is
bit-for-bit the simulator's (the tolerance asked for is 0)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _cluster import AgentThread, Run, make_certs

from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.partial import PartialAssignment, PartialUpdatesConfig
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.compression import parse_codec
from geoloco.coordinator.metrics import read_metrics
from geoloco.scenarios.workloads import build_workload

PARTIAL = PartialUpdatesConfig(enabled=True, groups=2, mode="blocks")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"), ["0", "1"])


def test_two_sites_over_grpc_end_on_the_simulators_weights_uploading_only_their_subset(
    certs: Path, tmp_path: Path
) -> None:
    mlp = build_workload("mlp")
    run = Run(
        workload=mlp, num_sites=2, rounds=3, seed=4,
        algorithm=AlgorithmConfig(inner_steps=3, uplink_codec="int8", downlink_codec="none", partial_updates=PARTIAL),
    )
    metrics = tmp_path / "metrics.jsonl"
    server = run.start_coordinator(certs, metrics_path=str(metrics))
    threads = [AgentThread(run.agent(certs, server.port, k)) for k in range(run.num_sites)]
    try:
        for t in threads:
            t.start()
        summaries = {t.agent.site: t.finish() for t in threads}
        assert server.wait_until_finished(30)
    finally:
        server.stop(grace=0)
    assert all(s.run_finished and s.rounds_included == run.rounds for s in summaries.values())
    assert {s.weights_digest for s in summaries.values()} == {server.rounds.digest_hex}
    assert torch.equal(server.rounds.weights, run.simulate())

    layout = ParamLayout.from_model(mlp.build_model(0))
    assignment = PartialAssignment.build(PARTIAL, layout)
    for t in threads:
        group = assignment.site_group(t.agent.site)
        trained = assignment.trained(group)
        params = list(t.agent.trainer.module.parameters())
        # Frozen tensors: no gradient, no inner-optimizer state; trained ones have both.
        assert [p.requires_grad for p in params] == list(trained)
        stateful = [p in t.agent.trainer.optimizer.state for p in params]
        assert stateful == list(trained)
    codec = parse_codec("int8")
    full = codec.encoded_nbytes((layout.numel,))
    records = read_metrics(metrics)
    assert [r["round"] for r in records] == list(range(run.rounds))
    for record in records:
        # Bytes received = the subset's encoding + the upload's fixed framing (manifest, the
        # same few hundred bytes for either site): they scale with the subset, not the model.
        overhead = {
            site: sent - codec.encoded_nbytes((assignment.partial_numel(assignment.site_group(site)),))
            for site, sent in record["bytes_up"].items()
        }
        assert sorted(overhead) == ["0", "1"]
        assert len(set(overhead.values())) == 1 and 0 <= overhead["0"] <= 512
        assert record["bytes_up"]["1"] + 1000 < full  # site 1 trains 164 of 1,732 values


SPARSELOCO = AlgorithmConfig.preset("sparseloco", inner_steps=3, uplink_codec="tiletopk:0.1,tile=8,divisors|int2mean")
"""The authors' SparseLoCo (divisor chunks, per-tensor bin means, median-norm clipping) at a tile
small enough for the MLP's tensors."""
TILES_PPU = AlgorithmConfig(
    name="fedavg", inner_steps=3, uplink_codec="tiletopk:0.1,tile=8|int2", error_feedback_decay=0.95,
    partial_updates=PARTIAL,
)
"""The earlier tiles variant with partial updates, under the name the coordinator runs (fedavg is
outer SGD lr 1, as ``sparseloco-tiles``; median clipping, which ``sparseloco`` turns on, cannot
combine with partial updates)."""


@pytest.mark.parametrize("algorithm", [SPARSELOCO, TILES_PPU], ids=["sparseloco", "sparseloco-tiles-ppu"])
def test_sparseloco_tiles_per_tensor_over_grpc_and_matches_the_simulator(
    certs: Path, algorithm: AlgorithmConfig
) -> None:
    """The sites' uplink codec is bound to the model's (or their group's) tensor shapes, the
    coordinator decodes the tiles (and the per-tensor bin means) from the payload alone, and both
    end bit for bit equal (the clipped mean combines in site-name order, whatever the arrivals)."""
    partial = algorithm.partial_updates.enabled
    run = Run(workload=build_workload("mlp"), num_sites=2, rounds=3, seed=6, algorithm=algorithm)
    server = run.start_coordinator(certs)
    threads = [AgentThread(run.agent(certs, server.port, k)) for k in range(run.num_sites)]
    try:
        for t in threads:
            t.start()
        summaries = [t.finish() for t in threads]
        assert server.wait_until_finished(30)
    finally:
        server.stop(grace=0)
    assert {s.weights_digest for s in summaries} == {server.rounds.digest_hex}
    assert torch.equal(server.rounds.weights, run.simulate())
    for t in threads:
        # Bound to the tensors the site uploads: the MLP's 6, or its blocks/2 group's 3.
        encoder = t.agent._rounds.uplink.encoders.encoders[0]  # type: ignore[union-attr]
        shapes = encoder.codec.sparsifier.shapes
        assert shapes is not None and len(shapes) == (3 if partial else 6)


def test_upload_numel_is_the_sites_group_subset() -> None:
    from geoloco.algorithms.strategy import build_strategy

    mlp = build_workload("mlp")
    layout = ParamLayout.from_model(mlp.build_model(0))
    strategy = build_strategy(
        AlgorithmConfig(inner_steps=3, partial_updates=PARTIAL), numel=layout.numel, layout=layout
    )
    assignment = strategy.partial
    assert assignment is not None
    assert strategy.upload_numel(0, "site-1") == assignment.partial_numel(1) < layout.numel
    assert strategy.upload_numel(0, "0") == assignment.partial_numel(0)
    with pytest.raises(ValueError, match="ends with"):
        strategy.upload_numel(0, "alpha")

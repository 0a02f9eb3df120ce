"""The site's parts without a socket: ``SiteState`` and the uplinks the round runners use."""

from __future__ import annotations

import json

import pytest
import torch

from geoloco.algorithms.params import ParamLayout, weights_digest
from geoloco.algorithms.strategy import AlgorithmConfig, build_strategy
from geoloco.algorithms.streaming import StreamingConfig
from geoloco.protos import geoloco_pb2 as pb
from geoloco.site_agent.client import SiteAgentError
from geoloco.site_agent.state import SiteState
from geoloco.site_agent.uplink import StrategyUplink

NUMEL = 64


def run_config(algorithm: AlgorithmConfig, *, total_rounds: int = 5) -> pb.RunConfig:
    return pb.RunConfig(
        inner_steps=algorithm.inner_steps,
        uplink_codec=algorithm.uplink_codec,
        total_rounds=total_rounds,
        config_json=json.dumps({"algorithm": algorithm.to_dict()}),
    )


def test_a_rejoin_with_the_same_run_config_changes_nothing_and_a_new_codec_changes_the_algorithm() -> None:
    state = SiteState()
    plain = AlgorithmConfig(inner_steps=4, uplink_codec="int8")
    first = state.adopt_run_config(run_config(plain))
    assert first.first and first.algorithm and first.privacy
    again = state.adopt_run_config(run_config(plain))
    assert not (again.first or again.algorithm or again.privacy)
    other = state.adopt_run_config(run_config(AlgorithmConfig(inner_steps=4, uplink_codec="int4")))
    assert other.algorithm and not other.privacy and not other.first
    assert state.algorithm.uplink_codec == "int4" and state.total_rounds == 5


def test_a_broadcast_is_applied_only_when_its_digest_is_the_coordinators() -> None:
    algorithm = AlgorithmConfig(inner_steps=2)
    strategy = build_strategy(algorithm, numel=NUMEL)
    coordinator = build_strategy(algorithm, numel=NUMEL)
    state = SiteState()
    start = torch.randn(NUMEL)
    assert state.adopt_weights(start.clone(), 3) is None  # held nothing before
    plan = coordinator.configure_round(3, ["a"])
    update = coordinator.apply_mean_update(start.clone(), torch.randn(NUMEL), ("a",), plan)

    assert not state.apply_broadcast(strategy, 3, update.downlink, "not the digest")
    assert state.held_round == 3 and state.digest == weights_digest(start)

    assert state.apply_broadcast(strategy, 3, update.downlink, update.digest)
    assert state.held_round == 4 and state.digest == update.digest
    assert torch.equal(state.global_weights, update.global_flat)


def test_a_broadcast_header_moves_the_coordinators_round_and_ends_the_run() -> None:
    state = SiteState()
    state.adopt_run_config(run_config(AlgorithmConfig(inner_steps=2), total_rounds=2))
    state.adopt_weights(torch.zeros(NUMEL), 1)
    state.joined(pb.RoundInfo(round=1, round_seed=11))
    assert state.round_seed(1) == 11
    with pytest.raises(SiteAgentError, match="without its round seed"):
        state.round_seed(2)
    # The coordinator moved on while this site was away: chase, keeping round 1's seed.
    state.take_broadcast_header(pb.BroadcastHeader(round=0, next_round=pb.RoundInfo(round=3, round_seed=7)))
    assert state.is_behind and state.coordinator_round == 3 and state.round_seed(1) == 11
    assert not state.finished
    state.adopt_weights(torch.zeros(NUMEL), 2)
    state.take_broadcast_header(pb.BroadcastHeader(round=1, next_round=pb.RoundInfo(round=2, round_seed=5)))
    assert state.at_end and state.finished


@pytest.mark.parametrize("fragments", [1, 2])
def test_the_strategy_uplink_sends_the_simulators_bytes_and_keeps_what_missed_its_round(
    fragments: int,
) -> None:
    """Seeds from ``plan.uplink_seed(site)`` (what the simulator uses) and one residual per
    fragment: a restored update comes back whole in that fragment's next encoding."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 4))
    layout = ParamLayout.from_model(model)
    algorithm = AlgorithmConfig(
        inner_steps=4, uplink_codec="randk:0.25",
        streaming=StreamingConfig(enabled=fragments > 1, fragments=fragments, overlap_steps=0)
        if fragments > 1 else StreamingConfig(),
    )
    strategy = build_strategy(algorithm, numel=layout.numel, layout=layout)
    plan = strategy.configure_round(1, ["a", "b"])
    update = torch.randn(strategy.update_numel(1))

    uplink = StrategyUplink(strategy, "b")
    sent = uplink.encode(update, round_seed=plan.seed, fragment=plan.fragment, samples=6)
    reference = strategy.build_uplink().encode(update, seed=plan.uplink_seed("b"), fragment=plan.fragment)
    assert sent.data == reference.to_bytes() and sent.fragment == plan.fragment
    assert sent.sample_weight == 6.0 and not sent.masked
    assert sent.wire == {"codec": reference.spec, "shape": list(reference.shape)}

    uplink.restore(sent)
    residual = uplink.residual(plan.fragment)
    assert residual is not None and torch.allclose(residual, update)
    uplink.reset(plan.fragment)
    assert uplink.residual(plan.fragment) is None

"""The round state machine with Streaming DiLoCo: one fragment per round, checked on upload."""

from __future__ import annotations

import pytest
import torch
from _round_helpers import FakeClock, encode_update, join, tiny_weights, upload_manifest, upload_status, wait_broadcast
from _round_helpers import send as send_upload

from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.algorithms.streaming import StreamingConfig
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.rounds import RoundStateMachine
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.errors import InvalidUpdateError


def make() -> RoundStateMachine:
    weights, layout = tiny_weights()
    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(
            inner_steps=4, uplink_codec="int8",
            streaming=StreamingConfig(enabled=True, fragments=2, overlap_steps=1),
        ),
        insecure=True,
        total_rounds=4,
    )
    return RoundStateMachine(config, weights, layout, clock=FakeClock())


def send(rounds: RoundStateMachine, site: str, values: torch.Tensor, *, fragment: int) -> pb.UploadResponse:
    data, spec = encode_update(values, "int8")
    manifest = upload_manifest(
        rounds.session_id, rounds.round, data, codec=spec, numel=values.numel(), site=site
    )
    manifest.fragment = fragment
    return send_upload(rounds, site, manifest, data)


def test_each_round_aggregates_its_fragment_only() -> None:
    rounds = make()
    partition = rounds.strategy.partition
    assert rounds.strategy.inner_steps == 2  # H / P steps per round
    join(rounds, "a")
    for round_number in range(4):
        fragment = partition[round_number % 2]
        assert rounds.fragment_of(round_number) == fragment.index
        before = rounds.weights.clone()
        values = torch.randn(fragment.numel, generator=torch.Generator().manual_seed(round_number))
        assert send(rounds, "a", values, fragment=fragment.index).complete
        status = upload_status(rounds, "a", rounds.session_id, round_number, fragment.index)
        assert status.known and status.complete
        metrics = rounds.poll()
        assert metrics is not None and metrics.fragment == fragment.index
        other = partition[1 - fragment.index]
        assert torch.equal(other.gather(rounds.weights), other.gather(before))
        assert not torch.equal(fragment.gather(rounds.weights), fragment.gather(before))
        header = wait_broadcast(rounds, "a", rounds.session_id, round_number, timeout_s=0).header
        assert header is not None and list(header.delta.shape) == [fragment.numel]


def test_upload_for_the_wrong_fragment_or_size_is_refused() -> None:
    rounds = make()
    join(rounds, "a")
    f0, f1 = rounds.strategy.partition.fragments
    with pytest.raises(InvalidUpdateError, match="names fragment 1; that round synchronises fragment 0"):
        send(rounds, "a", torch.zeros(f1.numel), fragment=1)
    with pytest.raises(InvalidUpdateError, match=rf"expected \[{f0.numel}\].*of fragment 0"):
        send(rounds, "a", torch.zeros(rounds.numel), fragment=0)
    assert not upload_status(rounds, "a", rounds.session_id, 0, 1).known

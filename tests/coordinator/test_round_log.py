"""The round log makes a round durable before its broadcast; snapshots follow in the background.

Without sockets: ``RoundStateMachine`` runs rounds on a checkpoint folder; a second machine on
the same folder stands for the coordinator restarted after ``kill -9`` (the first is dropped
without ``close``, its background snapshot joined or never started). It must continue exactly
where the first would have: same weights, same outer state, same history.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _round_helpers import FakeClock, encode_update, join, tiny_weights, upload, upload_manifest
from _round_helpers import send as send_upload

from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.algorithms.streaming import StreamingConfig
from geoloco.coordinator.checkpoint import CheckpointError, load_latest_checkpoint
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.round_log import RoundLog
from geoloco.coordinator.rounds import RoundStateMachine
from geoloco.coordinator.server import CoordinatorServer

ALGORITHM = AlgorithmConfig(inner_steps=2, downlink_codec="int8")


def _machine(folder: Path, **overrides: object) -> RoundStateMachine:
    settings: dict[str, object] = {
        "algorithm": ALGORITHM,
        "insecure": True,
        "total_rounds": 20,
        "min_sites": 1,
        "checkpoint_dir": str(folder),
    }
    settings.update(overrides)
    weights, layout = tiny_weights()
    machine = RoundStateMachine(CoordinatorConfig(**settings), weights, layout, clock=FakeClock())  # type: ignore[arg-type]
    join(machine, "a")
    return machine


def _round(machine: RoundStateMachine, r: int) -> None:
    upload(machine, "a", torch.randn(machine.numel, generator=torch.Generator().manual_seed(100 + r)))
    assert machine.poll() is not None


def _outer_state(machine: RoundStateMachine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in machine.phases.ctx.strategy.state_tensors().items()}


def test_rounds_after_the_first_are_durable_by_the_log_and_snapshots_compact_it(tmp_path: Path) -> None:
    machine = _machine(tmp_path, checkpoint_every=1)
    _round(machine, 0)  # no snapshot yet: round 0 is made durable by a full checkpoint
    checkpoint = load_latest_checkpoint(tmp_path)
    assert checkpoint is not None and checkpoint.round == 1
    assert RoundLog(tmp_path).newest_round() is None
    _round(machine, 1)
    # Round 1's entry is committed before its broadcast; its snapshot follows in the background.
    machine.phases.snapshots.join()
    checkpoint = load_latest_checkpoint(tmp_path)
    assert checkpoint is not None and checkpoint.round == 2
    assert checkpoint.metadata["weights_digest"] == machine.digest_hex
    assert not (tmp_path / "round-log").exists(), "the snapshot of round 2 covers the log"
    machine.close()


CENTRAL_DP = PrivacyConfig(dp="central", clip_norm=1.0, noise_multiplier=0.5)


@pytest.mark.parametrize("overrides", [{}, {"privacy": CENTRAL_DP}], ids=["plain", "central-dp"])
def test_a_restart_replays_the_logged_rounds_to_the_same_state_as_the_run_that_went_on(
    tmp_path: Path, overrides: dict[str, object]
) -> None:
    folder = tmp_path / "ckpt"
    first = _machine(folder, checkpoint_every=100, **overrides)  # one snapshot (round 1), then the log
    for r in range(4):
        _round(first, r)
    first.phases.snapshots.join()
    assert [e.round for e in RoundLog(folder).entries(1)] == [1, 2, 3]
    assert load_latest_checkpoint(folder).round == 1  # type: ignore[union-attr]
    # Dropped without close(): the restarted machine has only the snapshot and the log.
    second = _machine(folder, checkpoint_every=100, **overrides)
    if overrides:  # the privacy accountant is the logged round's, not the checkpoint's
        assert second.phases.privacy is not None and first.phases.privacy is not None
        assert second.phases.privacy.state() == first.phases.privacy.state()
    assert second.round == 4
    assert second.digest_hex == first.digest_hex
    assert torch.equal(second.weights, first.weights)
    for name, tensor in _outer_state(first).items():
        assert torch.equal(_outer_state(second)[name], tensor), name
    ctx1, ctx2 = first.phases.ctx, second.phases.ctx
    assert ctx2.contributor_history == ctx1.contributor_history
    assert ctx2.strategy.state_meta() == ctx1.strategy.state_meta()
    # And the next round, the same on both, ends on the same weights (not with DP: its noise
    # comes from the OS CSPRNG, which is why the log keeps the noised mean, never the noise's
    # seed). The replay left the log whole, so a second restart replays it again, round 4 (the
    # second machine's, written last) included.
    _round(first, 4)
    _round(second, 4)
    if not overrides:
        assert second.digest_hex == first.digest_hex
    third = _machine(folder, checkpoint_every=100, **overrides)
    assert third.round == 5 and third.digest_hex == second.digest_hex
    for machine in (first, second, third):
        machine.close()


def _three_logged_rounds(folder: Path) -> RoundStateMachine:
    machine = _machine(folder, checkpoint_every=100)
    for r in range(3):
        _round(machine, r)
    machine.phases.snapshots.join()
    return machine


def test_a_truncated_mean_is_refused_with_its_file_named(tmp_path: Path) -> None:
    _three_logged_rounds(tmp_path)
    mean = tmp_path / "round-log" / "round-000002.mean"
    mean.write_bytes(mean.read_bytes()[:-4])
    with pytest.raises(CheckpointError, match=r"round-000002\.mean holds \d+ bytes, its entry says") as info:
        _machine(tmp_path, checkpoint_every=100)
    assert "\n" not in str(info.value) and "--fresh" in str(info.value)


def test_a_corrupted_mean_fails_its_checksum(tmp_path: Path) -> None:
    _three_logged_rounds(tmp_path)
    mean = tmp_path / "round-log" / "round-000001.mean"
    data = bytearray(mean.read_bytes())
    data[0] ^= 0x01  # the lowest mantissa bit: the int8 downlink rounds it away
    mean.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"round-000001\.mean fails its checksum .* damaged"):
        _machine(tmp_path, checkpoint_every=100)


def test_changed_outer_settings_cannot_replay_the_log_and_say_so(tmp_path: Path) -> None:
    _three_logged_rounds(tmp_path)
    changed = AlgorithmConfig(inner_steps=2, downlink_codec="none")
    with pytest.raises(CheckpointError, match="algorithm settings changed since"):
        _machine(tmp_path, checkpoint_every=100, algorithm=changed)


def test_an_uncommitted_mean_and_entries_past_a_gap_are_not_replayed(tmp_path: Path) -> None:
    first = _three_logged_rounds(tmp_path)
    log = tmp_path / "round-log"
    (log / "round-000003.mean").write_bytes(b"\0" * 64)  # killed before its entry was written
    after_gap = json.loads((log / "round-000002.json").read_text())
    after_gap["round"] = 9
    (log / "round-000009.json").write_text(json.dumps(after_gap))
    second = _machine(tmp_path, checkpoint_every=100)
    assert second.round == 3 and second.digest_hex == first.digest_hex


def test_a_fresh_start_moves_the_round_log_aside_with_the_checkpoints(tmp_path: Path) -> None:
    first = _three_logged_rounds(tmp_path)
    first.close()
    config = CoordinatorConfig(
        algorithm=ALGORITHM, insecure=True, total_rounds=20, min_sites=1, port=0, checkpoint_dir=str(tmp_path),
        resume=False,
    )
    weights, layout = tiny_weights()
    server = CoordinatorServer(config, weights, layout, clock=FakeClock())
    try:
        server.start()
        assert server.rounds.round == 0
        assert (tmp_path / "previous-run-1" / "round-log" / "round-000002.json").exists()
        assert not (tmp_path / "round-log").exists()
    finally:
        server.stop(grace=0)


def test_a_restart_replays_streaming_fragments_each_into_its_own_outer_state(tmp_path: Path) -> None:
    """Streaming DiLoCo: each logged round is one fragment's mean; the replay steps the fragment
    the round's plan names, and both machines go on identically."""
    algorithm = AlgorithmConfig(
        inner_steps=4, uplink_codec="int8", streaming=StreamingConfig(enabled=True, fragments=2, overlap_steps=1)
    )

    def stream_round(machine: RoundStateMachine, r: int) -> None:
        strategy = machine.phases.ctx.strategy
        values = torch.randn(strategy.update_numel(r), generator=torch.Generator().manual_seed(200 + r))
        data, spec = encode_update(values, "int8")
        manifest = upload_manifest(machine.session_id, r, data, codec=spec, numel=values.numel(), site="a")
        manifest.fragment = strategy.fragment_for_round(r)
        send_upload(machine, "a", manifest, data)
        assert machine.poll() is not None

    first = _machine(tmp_path, checkpoint_every=100, algorithm=algorithm)
    for r in range(4):
        stream_round(first, r)
    assert {e.fragment for e in RoundLog(tmp_path).entries(1)} == {0, 1}
    second = _machine(tmp_path, checkpoint_every=100, algorithm=algorithm)
    assert second.round == 4 and second.digest_hex == first.digest_hex
    for name, tensor in _outer_state(first).items():
        assert torch.equal(_outer_state(second)[name], tensor), name
    stream_round(first, 4)
    stream_round(second, 4)
    assert second.digest_hex == first.digest_hex
    first.close()
    second.close()

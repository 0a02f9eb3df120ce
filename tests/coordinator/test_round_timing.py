"""A round's phase table: disjoint phases, receive net of verification, site phases parsed
from an upload's metrics (``geoloco.coordinator.round_timing``, ``geoloco.protos.round_phases``)."""

from __future__ import annotations

import pytest
import torch
from _round_helpers import join, upload
from test_round_state_machine import make, update

from geoloco.coordinator.round_timing import RoundTimings
from geoloco.protos.round_phases import (
    COORDINATOR_PHASES,
    SITE_PHASES,
    site_metric_name,
    site_phases_from_metrics,
)


def test_receive_is_streaming_time_net_of_verification() -> None:
    t = RoundTimings(opened_s=0.0)
    t.upload_started(1.0)
    t.upload_started(2.0)
    t.spent("verify", 3.0, 4.0)  # the first site's update, verified while the second streams
    t.spent("add", 4.0, 4.5)
    t.upload_received(6.0)
    t.spent("verify", 6.0, 7.0)
    t.record("outer_step", 1.0)
    t.published(9.0)
    table = t.table()
    assert set(table) == set(COORDINATOR_PHASES)
    assert table["receive"] == pytest.approx(6.0 - 1.0 - 1.5)
    assert table["verify"] == pytest.approx(2.0) and table["add"] == pytest.approx(0.5)
    assert t.wall_s() == 9.0 and sum(table.values()) <= 9.0


def test_unknown_or_misplaced_phases_are_refused() -> None:
    t = RoundTimings()
    with pytest.raises(ValueError, match="unknown coordinator phase"):
        t.spent("lunch", 0.0, 1.0)
    with pytest.raises(ValueError, match="after the close"):
        t.record("verify", 1.0)


def test_site_phases_round_trip_through_upload_metrics_and_bad_values_are_dropped() -> None:
    sent = {site_metric_name(phase): float(i) for i, phase in enumerate(SITE_PHASES)}
    assert site_metric_name("train") == "phase_train_s" and site_metric_name("upload") == "prev_phase_upload_s"
    assert site_phases_from_metrics({**sent, "train_loss": 2.0}) == {p: float(i) for i, p in enumerate(SITE_PHASES)}
    bad = {"phase_train_s": -1.0, "phase_encode_s": float("nan"), "prev_phase_wait_s": float("inf")}
    assert site_phases_from_metrics(bad) == {}
    with pytest.raises(ValueError, match="unknown site phase"):
        site_metric_name("nap")


def test_state_machine_record_carries_phases_within_the_wall_time() -> None:
    rounds = make(min_sites=1)
    join(rounds, "a")
    upload(rounds, "a", update(1, rounds.numel))
    record = rounds.poll()
    assert record is not None
    assert set(record.phases_s) == set(COORDINATOR_PHASES)
    assert record.phases_s["verify"] > 0 and record.phases_s["add"] > 0
    assert sum(record.phases_s.values()) <= record.round_wall_s


def test_infinite_update_is_rejected_as_non_finite_and_an_overflowing_norm_by_the_bound() -> None:
    from geoloco.protos.errors import InvalidUpdateError

    rounds = make(min_sites=1)
    join(rounds, "a")
    join(rounds, "b")
    poisoned = update(1, rounds.numel)
    poisoned[0], poisoned[1] = float("inf"), float("-inf")
    with pytest.raises(InvalidUpdateError, match="NaN or Inf"):
        upload(rounds, "a", poisoned)
    huge = torch.full((rounds.numel,), 3e38)  # finite, but its norm overflows float32
    with pytest.raises(InvalidUpdateError) as err:
        upload(rounds, "b", huge)
    assert "NaN or Inf" not in str(err.value) and "norm" in str(err.value)


def test_broadcast_checksum_is_ready_when_the_round_is_published() -> None:
    """The broadcast manifest's SHA-256 is hashed during the aggregation (beside the checkpoint),
    not by the first site's AwaitBroadcast, and it is the checksum of the broadcast's bytes."""
    import hashlib

    from geoloco.coordinator import translate
    from geoloco.coordinator.domain import BroadcastHeader
    from geoloco.protos.wire_manifests import blob_manifest

    rounds = make(min_sites=1)
    join(rounds, "a")
    upload(rounds, "a", update(1, rounds.numel))
    assert rounds.poll() is not None
    record = rounds.phases.broadcast
    assert record is not None and record.data_sha256 == hashlib.sha256(record.data).digest()
    header = rounds.phases.header_for("a", 0, 0.0, 0)
    assert isinstance(header, BroadcastHeader)
    sent = translate.broadcast_header(header).delta
    expected = blob_manifest(record.data, codec=record.codec, shape=list(record.shape), dtype="float32",
                             chunk_size=record.chunk_size)
    assert sent == expected


def test_upload_bytes_verified_by_sha256_get_no_second_crc_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """The transfer's SHA-256 proved every byte; the container's CRC-32 is not run over the
    payload again. Corruption is still caught (by the SHA-256), and a container parsed without
    that proof still checks its CRC."""
    import zlib

    from _round_helpers import encode_update, send, upload_manifest

    from geoloco.compression import CodecError, Encoded
    from geoloco.compression import encoded as encoded_module

    rounds = make(min_sites=1)
    join(rounds, "a")
    data, spec = encode_update(update(1, rounds.numel), "none")
    manifest = upload_manifest(rounds.session_id, 0, data, codec=spec, numel=rounds.numel, site="a")
    payload_passes = []

    class CountingZlib:
        @staticmethod
        def crc32(buffer: object, value: int = 0) -> int:
            view = memoryview(buffer)  # type: ignore[arg-type]
            if view.nbytes >= 4 * rounds.numel:
                payload_passes.append(view.nbytes)
            return zlib.crc32(view, value)

    monkeypatch.setattr(encoded_module, "zlib", CountingZlib)
    assert send(rounds, "a", manifest, data).complete
    assert payload_passes == []
    broken = bytearray(data)
    broken[-1] ^= 0xFF  # the stored CRC
    with pytest.raises(CodecError, match="CRC32"):
        Encoded.from_bytes(broken)
    assert Encoded.from_bytes(broken, check_crc=False).spec == "none"
    assert payload_passes  # the checked parse did run its pass

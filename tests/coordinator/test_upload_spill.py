"""Big uploads arrive into an unnamed file in the checkpoint folder (``BlobSpill``), not into
the coordinator's memory; the round's result is the same bit for bit as with uploads in memory."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from _round_helpers import chunk_requests, encode_update, join, tiny_weights, upload_manifest

from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator import translate
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.rounds import RoundStateMachine
from geoloco.protos.wire_files import BlobSpill


def _mapped_under(folder: Path) -> bool:
    return str(folder) in Path("/proc/self/maps").read_text() if sys.platform.startswith("linux") else True


def run_round(folder: Path, *, spill_min_bytes: int) -> tuple[str, bool]:
    """One round of two sites' uploads, the first in two streams; (the new weights' digest,
    whether an upload was mapped from a file in the checkpoint folder while it arrived)."""
    weights, layout = tiny_weights()
    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(inner_steps=2), insecure=True, total_rounds=2, min_sites=2,
        checkpoint_dir=str(folder),
    )
    rounds = RoundStateMachine(config, weights, layout)
    rounds.intake.spill = dataclasses.replace(rounds.intake.spill, min_bytes=spill_min_bytes)
    for site in ("a", "b"):
        join(rounds, site)
    mapped = False
    for k, site in enumerate(("a", "b")):
        update = torch.randn(rounds.numel, generator=torch.Generator().manual_seed(k)) * 0.01
        data, codec = encode_update(update, "none")
        manifest = upload_manifest(
            rounds.session_id, 0, data, codec=codec, numel=rounds.numel, site=site, chunk_size=32
        )
        pieces = list(translate.upload_chunks(chunk_requests(manifest, data)))
        spec = translate.upload_spec(manifest, site)
        assert not rounds.receive_upload(site, spec, iter(pieces[:3])).complete
        mapped = mapped or _mapped_under(folder)
        assert rounds.receive_upload(site, spec, iter(pieces[3:])).complete
    record = rounds.poll()
    assert record is not None and record.participants == ["a", "b"]
    return rounds.phases.weights.digest, mapped


def test_a_spilled_upload_gives_the_same_round_as_one_in_memory(tmp_path: Path) -> None:
    spilled, mapped = run_round(tmp_path / "spilled", spill_min_bytes=1)
    kept, kept_mapped = run_round(tmp_path / "kept", spill_min_bytes=1 << 40)
    assert mapped and (not kept_mapped or not sys.platform.startswith("linux"))
    assert spilled == kept


def test_without_a_file_an_upload_arrives_in_memory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A folder that cannot hold the file (here: a file where the folder should be) costs the
    memory, not the upload."""
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    assert BlobSpill(str(blocked), min_bytes=1).buffer(1000) is None
    assert "arrives in memory: no file for it" in caplog.text
    assert BlobSpill(str(tmp_path), min_bytes=1).buffer(1000) is not None
    assert BlobSpill(str(tmp_path), min_bytes=1001).buffer(1000) is None

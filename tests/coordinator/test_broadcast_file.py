"""The last broadcast served from a file (``FileBlob``), not held in the coordinator's memory:
the same bytes, manifest and chunks as from memory, and a real site applies it over gRPC."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest
import torch
from _round_helpers import join, upload
from test_round_state_machine import make, update

from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.compression import Encoded, parse_codec
from geoloco.coordinator import translate
from geoloco.coordinator.broadcast_store import PreparedBroadcast, SpillingBlob
from geoloco.coordinator.checkpoint import LOCK_NAME
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.server import CoordinatorServer
from geoloco.protos.wire_chunks import broadcast_responses, iter_chunks
from geoloco.protos.wire_files import FileBlob
from geoloco.protos.wire_manifests import blob_manifest
from geoloco.site_agent.client import CoordinatorClient
from geoloco.site_agent.config import SiteAgentConfig


def _payload(size: int = 10_000) -> bytes:
    return bytes(torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8))


def test_a_file_blob_reads_back_the_bytes_and_chunks_like_memory(tmp_path: Path) -> None:
    data = _payload()
    blob = FileBlob.spill(data, tmp_path)
    assert list(tmp_path.iterdir()) == []  # unnamed: nothing to clean up, even after a crash
    assert len(blob) == len(data) and blob.to_bytes() == data
    assert blob.read(9_990, 100) == data[9_990:]  # clipped at the end
    assert blob.sha256() == hashlib.sha256(data).digest()
    for stride, start in ((1, 0), (3, 2)):
        from_file = [(c.index, bytes(c.data)) for c in iter_chunks(blob, 1024, start=start, stride=stride)]
        from_memory = [(c.index, bytes(c.data)) for c in iter_chunks(data, 1024, start=start, stride=stride)]
        assert from_file == from_memory
    assert blob_manifest(blob, codec="none", chunk_size=1024) == blob_manifest(data, codec="none", chunk_size=1024)
    with pytest.raises(ValueError, match="offset and size"):
        blob.read(-1, 4)


def _encoded() -> Encoded:
    return parse_codec("int8").encode(torch.randn(5000, generator=torch.Generator().manual_seed(2)), seed=0)


def test_a_large_delta_is_served_from_memory_then_from_its_file_a_small_one_stays_in_memory(
    tmp_path: Path,
) -> None:
    delta = _encoded()
    data = delta.to_bytes()
    large = PreparedBroadcast(delta, directory=tmp_path, spill_min_bytes=len(data))
    served, sha256 = large.result()  # published once hashed, before the move to the file
    assert large.nbytes == len(data) and sha256 == hashlib.sha256(data).digest()
    assert isinstance(served, SpillingBlob) and len(served) == len(data)
    before = [served.read(at, 1000) for at in range(0, len(data), 1000)]
    large.join()
    assert served.spilled and large.error is None
    after = [served.read(at, 1000) for at in range(0, len(data), 1000)]
    assert b"".join(before) == b"".join(after) == data
    assert served.read(len(data) - 3, 100) == data[-3:] and served.read(len(data), 10) == b""
    small = PreparedBroadcast(delta, directory=tmp_path, spill_min_bytes=len(data) + 1)
    served, sha256 = small.result()
    assert served == data and isinstance(served, bytes) and sha256 == hashlib.sha256(data).digest()


def test_a_large_delta_never_exists_as_one_bytes_object(tmp_path: Path) -> None:
    """Spilling writes the encoded payload's own memory: no model-sized ``bytes`` is formed
    (``tracemalloc`` sees Python allocations; the 4 MB payload lives in a torch tensor)."""
    import tracemalloc

    delta = parse_codec("none").encode(torch.randn(1 << 20), seed=0)
    tracemalloc.start()
    try:
        prepared = PreparedBroadcast(delta, directory=tmp_path, spill_min_bytes=0)
        served, _ = prepared.result()
        prepared.join()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(served, SpillingBlob) and served.spilled and len(served) > 4 << 20
    assert peak < 1 << 20, f"spilling allocated {peak} bytes of Python objects"


def test_a_failed_spill_keeps_the_broadcast_in_memory(tmp_path: Path) -> None:
    delta = _encoded()
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    prepared = PreparedBroadcast(delta, directory=blocked / "sub", spill_min_bytes=0)
    served, sha256 = prepared.result()
    prepared.join()
    assert isinstance(served, SpillingBlob) and not served.spilled and prepared.error is not None
    assert served.to_bytes() == delta.to_bytes() and sha256 == hashlib.sha256(delta.to_bytes()).digest()


def test_the_round_record_holds_a_file_and_serves_the_same_chunks() -> None:
    rounds = make(min_sites=1, chunk_size=64)
    rounds.phases.spill_min_bytes = 0
    join(rounds, "a")
    upload(rounds, "a", update(1, rounds.numel))
    assert rounds.poll() is not None
    record = rounds.phases.broadcast
    assert record is not None and isinstance(record.data, SpillingBlob)
    data = record.data.to_bytes()
    assert record.data_sha256 == hashlib.sha256(data).digest()
    header = translate.broadcast_header(rounds.phases.header_for("a", 0, 0.0, 0))
    assert header.delta == blob_manifest(data, codec=record.codec, shape=list(record.shape), dtype="float32",
                                         chunk_size=64)
    messages = list(broadcast_responses(header, record.data, stride=1))[1:]
    assert b"".join(bytes(m.data) for m in messages) == data
    assert [m.index for m in messages] == list(range(header.delta.num_chunks))


def test_a_site_applies_a_broadcast_served_from_a_file_over_grpc(tmp_path: Path) -> None:
    model = torch.nn.Linear(64, 64)
    layout = ParamLayout.from_model(model)
    weights = layout.flatten(model)
    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(inner_steps=1), insecure=True, min_sites=1, total_rounds=2,
        chunk_size=1024, checkpoint_dir=str(tmp_path / "checkpoints"),
    )
    server = CoordinatorServer(config, weights.clone(), layout)
    server.rounds.phases.spill_min_bytes = 0
    server.start()
    client = CoordinatorClient(
        f"localhost:{server.port}", site="a", tls=None, insecure=True,
        config=SiteAgentConfig(chunk_size=1024, parallel_streams=2), stop_event=threading.Event(),
    )
    try:
        client.join(has_weights=False, weights_round=0, digest_hex=None)
        encoded = parse_codec("none").encode(torch.full((layout.numel,), 0.01), seed=0)
        client.upload(round_number=0, data=encoded.to_bytes(), codec="none", shape=[layout.numel],
                      sample_weight=1.0, metrics={})
        header, delta = client.await_broadcast(0)
        record = server.rounds.phases.broadcast
        assert record is not None and isinstance(record.data, SpillingBlob)
        assert delta is not None and bytes(delta) == record.data.to_bytes()
        assert header.delta.checksum.digest == record.data_sha256
        checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name != LOCK_NAME)
        assert checkpoints == ["checkpoint.json", "round-000001.safetensors"]  # no broadcast file left
    finally:
        client.close()
        server.stop(grace=0)

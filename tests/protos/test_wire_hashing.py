"""The receiver's checksum is taken outside the assembler's lock, by the hash pool, and is still
the wire's SHA-256 of the whole blob whatever order and however many streams the chunks took."""

from __future__ import annotations

import hashlib
import random
import threading
import time

import pytest
import torch

from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import wire_assembly
from geoloco.protos.wire_assembly import BlobAssembler
from geoloco.protos.wire_buffers import ChecksumMismatchError
from geoloco.protos.wire_chunks import ChunkRef, iter_chunks
from geoloco.protos.wire_manifests import blob_manifest

CHUNK = 4096


def _data(size: int) -> bytes:
    return bytes(torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(size), dtype=torch.uint8))


def _watch_hashing(monkeypatch: pytest.MonkeyPatch) -> tuple[list[tuple[str, bool]], list[BlobAssembler]]:
    """Record, for every digest update, the thread and whether the assembler's lock was held."""
    seen: list[tuple[str, bool]] = []
    assemblers: list[BlobAssembler] = []
    original = wire_assembly._RunningDigest.update

    def update(self: wire_assembly._RunningDigest, data: memoryview) -> None:
        seen.append((threading.current_thread().name, assemblers[0]._lock.locked()))
        original(self, data)

    monkeypatch.setattr(wire_assembly._RunningDigest, "update", update)
    return seen, assemblers


def test_in_order_chunks_are_hashed_by_the_pool_outside_the_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    seen, assemblers = _watch_hashing(monkeypatch)
    data = _data(64 * CHUNK + 100)
    assembler = BlobAssembler(blob_manifest(data, chunk_size=CHUNK))
    assemblers.append(assembler)
    for ref in iter_chunks(data, CHUNK):
        assembler.add(ref.index, ref.data)
    # The pool catches up on its own (finish would hash what it has not; wait so it need not).
    deadline = time.monotonic() + 60
    while assembler._hashed < assembler.num_chunks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert assembler._hashed == assembler.num_chunks, "the hash pool never caught up"
    assert bytes(assembler.finish()) == data
    assert seen, "the digest was updated"
    assert not any(locked for _, locked in seen), "no SHA-256 pass ran under the assembler's lock"
    assert all(name.startswith("geoloco-wire-hash") for name, _ in seen), seen


@pytest.mark.parametrize("streams", [1, 2, 4, 8])
def test_k_concurrent_streams_in_any_order_give_the_blobs_sha256(streams: int) -> None:
    data = _data(97 * CHUNK + 7)
    manifest = blob_manifest(data, chunk_size=CHUNK)
    assert manifest.checksum.digest == hashlib.sha256(data).digest()
    assembler = BlobAssembler(manifest)
    shares = [list(iter_chunks(data, CHUNK, start=k, stride=streams)) for k in range(streams)]
    for k, share in enumerate(shares):
        random.Random(k).shuffle(share[len(share) // 2 :])  # half in order, half shuffled

    def feed(share: list[ChunkRef]) -> None:
        for ref in share:
            assembler.add(ref.index, ref.data)
            assembler.add(ref.index, ref.data)  # a duplicate changes nothing

    threads = [threading.Thread(target=feed, args=(share,)) for share in shares]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert bytes(assembler.finish()) == data
    assert assembler.duplicates == assembler.num_chunks


def test_a_corrupted_chunk_is_still_caught_and_everything_is_asked_again() -> None:
    data = _data(20 * CHUNK)
    assembler = BlobAssembler(blob_manifest(data, chunk_size=CHUNK))
    for ref in iter_chunks(data, CHUNK):
        payload = bytearray(ref.data)
        if ref.index == 7:
            payload[3] ^= 1
        assembler.add(ref.index, payload)
    with pytest.raises(ChecksumMismatchError):
        assembler.finish()
    assert assembler.missing() == [(0, 20)]
    for ref in reversed(list(iter_chunks(data, CHUNK))):  # resent, last chunk first
        assembler.add(ref.index, ref.data)
    assert bytes(assembler.finish()) == data


def test_crc32_blobs_verify_the_same_way() -> None:
    data = _data(10 * CHUNK + 1)
    manifest = blob_manifest(data, chunk_size=CHUNK, checksum_algorithm=pb.CHECKSUM_ALGORITHM_CRC32)
    assembler = BlobAssembler(manifest)
    for ref in iter_chunks(data, CHUNK):
        assembler.add(ref.index, ref.data)
    assert bytes(assembler.finish()) == data

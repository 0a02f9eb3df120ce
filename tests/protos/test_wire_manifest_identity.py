"""A blob manifest's checksum identifies the bytes, also for buffers ending with their own CRC-32."""

from __future__ import annotations

import pytest
import torch

from geoloco.compression import parse_codec
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.wire_assembly import Download
from geoloco.protos.wire_buffers import CRC32_RESIDUE, ManifestError, compute_checksum
from geoloco.protos.wire_manifests import blob_manifest, validate_blob_manifest


def _encoded(seed: int) -> bytes:
    update = torch.randn(300, generator=torch.Generator().manual_seed(seed))
    return parse_codec("int8").encode(update, seed=0).to_bytes()


def test_two_encoded_updates_of_the_same_size_have_different_manifests() -> None:
    first, second = _encoded(1), _encoded(2)
    assert len(first) == len(second) and first != second
    # The reason the default cannot be CRC-32: it is the same constant for both.
    assert compute_checksum(first, pb.CHECKSUM_ALGORITHM_CRC32).digest == CRC32_RESIDUE
    assert compute_checksum(second, pb.CHECKSUM_ALGORITHM_CRC32).digest == CRC32_RESIDUE
    a, b = blob_manifest(first, codec="int8"), blob_manifest(second, codec="int8")
    assert a.total_bytes == b.total_bytes
    assert a != b and a.checksum != b.checksum


def test_a_crc32_that_cannot_identify_its_buffer_is_refused_by_both_sides() -> None:
    data = _encoded(3)
    with pytest.raises(ValueError, match="cannot tell two such buffers apart"):
        blob_manifest(data, checksum_algorithm=pb.CHECKSUM_ALGORITHM_CRC32)
    manifest = blob_manifest(data)
    manifest.checksum.CopyFrom(pb.Checksum(algorithm=pb.CHECKSUM_ALGORITHM_CRC32, digest=CRC32_RESIDUE))
    with pytest.raises(ManifestError, match="SHA256"):
        validate_blob_manifest(manifest)
    # CRC-32 still describes a buffer that does not end with its own CRC-32.
    raw = bytes(range(200))
    validate_blob_manifest(blob_manifest(raw, checksum_algorithm=pb.CHECKSUM_ALGORITHM_CRC32))


def test_a_download_does_not_keep_chunks_of_another_delta_of_the_same_size() -> None:
    first, second = _encoded(4), _encoded(5)
    download = Download()
    partial = download.start(blob_manifest(first, chunk_size=64), 0)
    partial.add(0, first[:64])
    # A new broadcast of the same size: a different manifest, so the download starts over.
    with pytest.raises(ManifestError, match="never started"):
        download.start(blob_manifest(second, chunk_size=64), 1)

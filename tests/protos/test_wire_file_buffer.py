"""A big upload assembled in a ``FileBuffer``: an unnamed file mapped into memory. The bytes are
the same as in memory, in any chunk order, across a checksum failure and its resend; what has
been hashed leaves the process's resident memory (the page cache keeps it) and is read back
when the update is decoded."""

from __future__ import annotations

import os
import random
import re
import sys
from pathlib import Path

import pytest

from geoloco.protos.wire_assembly import BlobAssembler
from geoloco.protos.wire_buffers import ChecksumMismatchError, MiB
from geoloco.protos.wire_files import FileBuffer
from geoloco.protos.wire_manifests import blob_manifest


def chunks(data: bytes, size: int) -> list[tuple[int, bytes]]:
    return [(i, data[o : o + size]) for i, o in enumerate(range(0, len(data), size))]


def test_a_file_buffer_assembles_the_same_bytes_in_any_order(tmp_path: Path) -> None:
    data = random.Random(0).randbytes(300_001)
    manifest = blob_manifest(data, chunk_size=4096)
    assembler = BlobAssembler(manifest, out=FileBuffer(len(data), tmp_path))
    order = chunks(data, 4096)
    random.Random(1).shuffle(order)
    for index, chunk in order:
        assembler.add(index, chunk)
    assert bytes(assembler.finish()) == data
    assert list(tmp_path.iterdir()) == []  # unnamed: nothing to clean up, ever


def test_a_checksum_failure_is_resent_into_the_same_file(tmp_path: Path) -> None:
    data = random.Random(2).randbytes(100_000)
    manifest = blob_manifest(data, chunk_size=1000)
    assembler = BlobAssembler(manifest, out=FileBuffer(len(data), tmp_path))
    for index, chunk in chunks(data, 1000):
        assembler.add(index, chunk if index != 7 else bytes(len(chunk)))
    with pytest.raises(ChecksumMismatchError):
        assembler.finish()
    for index, chunk in chunks(data, 1000):
        assembler.add(index, chunk)
    assert bytes(assembler.finish()) == data
    assembler.release()
    with pytest.raises(RuntimeError, match="released"):
        assembler.finish()


def test_a_file_buffer_must_fit_the_manifest(tmp_path: Path) -> None:
    data = bytes(100)
    with pytest.raises(ValueError, match="output buffer has 99 bytes, the manifest needs 100"):
        BlobAssembler(blob_manifest(data, chunk_size=10), out=FileBuffer(99, tmp_path))


def _resident_kib(path_part: str) -> int:
    """Resident KiB of this process's mappings of files under ``path_part`` (smaps)."""
    total, mapped = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            mapped = path_part in line
        elif mapped and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps (Linux)")
def test_hashed_bytes_leave_resident_memory_and_come_back_when_read(tmp_path: Path) -> None:
    size = 48 * MiB
    data = os.urandom(size)
    manifest = blob_manifest(data, chunk_size=MiB)
    assembler = BlobAssembler(manifest, out=FileBuffer(size, tmp_path))
    for index, chunk in chunks(data, MiB):
        assembler.add(index, chunk)
    view = assembler.finish()  # hashes what the pool had not: everything is hashed now
    assert _resident_kib(str(tmp_path)) < size // 1024 // 8, "the hashed bytes stayed resident"
    assert bytes(view) == data  # read back from the page cache
    assert _resident_kib(str(tmp_path)) > size // 1024 // 2

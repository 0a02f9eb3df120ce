"""Blobs in a file instead of memory: the coordinator's last broadcast for stragglers, and big
uploads while they arrive.

A coordinator keeps the last round's encoded delta until the next round closes, so that sites
that wait, reconnect or resume late can still fetch it. With a lossless downlink that delta is
as large as the model (4 GB for a billion fp32 parameters); held as ``bytes`` it sat in the
coordinator's memory beside everything the next round needs. ``FileBlob`` keeps those bytes in
an unnamed temporary file (on the checkpoint volume when there is one: ``/tmp`` may be a RAM
disk) and reads each chunk with ``os.pread`` as it is sent, so the bytes live in the page
cache, which the kernel can drop, not in the process's resident memory. ``pread`` rather than
``mmap``: pages of a mapping that were sent count in the process's RSS until it is unmapped.

A big upload arrives into a ``FileBuffer``: an unnamed file mapped into memory, the buffer the
assembler copies chunks into and hashes. Its pages belong to the page cache, which the kernel
may write back and reclaim, not to the process's anonymous memory; the assembler gives back the
mapping of what it has hashed (``forget``), so a transfer's bytes do not stay resident while the
rest arrives, and the decode maps them in again once, when the verified update is added.

The chunk senders (``geoloco.protos.wire_chunks``) and ``blob_manifest`` accept a ``RangeBlob``
(a ``FileBlob``, or the coordinator's blob that moves from memory to a file while it is served)
wherever they accept a buffer. The file is unnamed (``tempfile.TemporaryFile``): it disappears
when the blob is garbage-collected or the process dies, whatever happened.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from geoloco.protos.wire_buffers import Buffer, MiB, as_byte_view

__all__ = ["SPILL_MIN_BYTES", "BlobSpill", "FileBlob", "FileBuffer", "RangeBlob"]

logger = logging.getLogger(__name__)

SPILL_MIN_BYTES = 64 << 20
"""Blobs this large or larger go to a file (a broadcast, an upload), smaller ones stay in memory,
where a file would only add work."""

_COPY_BLOCK = 16 * MiB
"""Bytes written or hashed at a time (one block in flight, never a second copy of the blob)."""


class RangeBlob(ABC):
    """Immutable bytes read by range, wherever they live: what the chunk senders and
    ``blob_manifest`` accept beside a buffer. One chunk is read at a time, as it is sent."""

    __slots__ = ()

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def read(self, offset: int, size: int) -> bytes:
        """Bytes ``offset .. offset + size`` (clipped to the blob's end); safe from any thread."""

    def sha256(self) -> bytes:
        """SHA-256 of the bytes, read block by block."""
        digest = hashlib.sha256()
        for offset in range(0, len(self), _COPY_BLOCK):
            digest.update(self.read(offset, _COPY_BLOCK))
        return digest.digest()

    def to_bytes(self) -> bytes:
        """All the bytes in memory (tests and small blobs only)."""
        return self.read(0, len(self))


class FileBlob(RangeBlob):
    """Immutable bytes in an unnamed temporary file, read by range (module doc)."""

    __slots__ = ("_file", "_size")

    def __init__(self, file: IO[bytes], size: int) -> None:
        self._file = file
        self._size = size

    @classmethod
    def spill(
        cls, data: Buffer, directory: str | os.PathLike[str] | None = None, *, digest: Any = None
    ) -> FileBlob:
        """A copy of ``data`` in a new unnamed file in ``directory`` (the system's temporary
        folder when None); ``digest`` (a ``hashlib`` object) is updated with the bytes in the
        same pass. Not fsynced: the file lives as long as the process, no longer."""
        return cls.spill_parts([data], directory, digest=digest)

    @classmethod
    def spill_parts(
        cls, parts: Iterable[Buffer], directory: str | os.PathLike[str] | None = None, *, digest: Any = None
    ) -> FileBlob:
        """``spill`` of the concatenation of ``parts``, never joined in memory."""
        folder = None if directory is None else Path(directory)
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        file = tempfile.TemporaryFile(dir=folder)  # noqa: SIM115 - owned by the blob, closed with it
        size = 0
        try:
            for part in parts:
                view = as_byte_view(part)
                for offset in range(0, len(view), _COPY_BLOCK):
                    block = view[offset : offset + _COPY_BLOCK]
                    if digest is not None:
                        digest.update(block)
                    file.write(block)
                size += len(view)
            file.flush()
        except BaseException:
            file.close()
            raise
        return cls(file, size)

    def __len__(self) -> int:
        return self._size

    def read(self, offset: int, size: int) -> bytes:
        """Bytes ``offset .. offset + size`` (clipped to the blob's end); safe from any thread."""
        if offset < 0 or size < 0:
            raise ValueError(f"offset and size must be >= 0, got {offset} and {size}")
        size = max(0, min(size, self._size - offset))
        parts: list[bytes] = []
        fd = self._file.fileno()
        done = 0
        while done < size:
            part = os.pread(fd, size - done, offset + done)
            if not part:
                raise OSError(f"broadcast file ended at byte {offset + done}; expected {self._size} bytes")
            parts.append(part)
            done += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        self._file.close()

    def __del__(self) -> None:
        # The last stream serving it is done and the next round's broadcast replaced it: the
        # unnamed file's disk space goes back now, without an unclosed-file warning.
        file = getattr(self, "_file", None)
        if file is not None:
            file.close()

    def __repr__(self) -> str:
        return f"FileBlob({self._size} bytes)"


class FileBuffer:
    """A writable buffer of ``size`` bytes backed by an unnamed file in ``directory`` (the
    system's temporary folder when None; on a RAM disk it saves nothing): what a big upload is
    assembled in (module doc), through ``view``. ``OSError`` when the file cannot be made or
    the disk has not ``size`` bytes free."""

    __slots__ = ("_map", "size")

    def __init__(self, size: int, directory: str | os.PathLike[str] | None = None) -> None:
        if size <= 0:
            raise ValueError(f"a file buffer needs at least one byte, got {size}")
        folder = None if directory is None else Path(directory)
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder) as file:  # the mapping keeps the unnamed file
            if hasattr(os, "posix_fallocate"):
                # The disk space up front: a sparse file on a full disk would fail a later write
                # into the mapping with SIGBUS, killing the process; this raises OSError now.
                os.posix_fallocate(file.fileno(), 0, size)
            else:
                file.truncate(size)
            self._map = mmap.mmap(file.fileno(), size)
        self.size = size

    def view(self) -> memoryview:
        return memoryview(self._map)

    def forget(self, offset: int, size: int) -> None:
        """Drop the pages of bytes ``offset .. offset + size`` from this process's memory: they
        stay in the file (the page cache) and are read back when touched again. A no-op where
        the platform cannot."""
        start = offset - offset % mmap.PAGESIZE  # madvise wants a page-aligned start
        end = min(self.size, offset + size)
        if end > start and hasattr(self._map, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def __repr__(self) -> str:
        return f"FileBuffer({self.size} bytes)"


@dataclass(frozen=True, slots=True)
class BlobSpill:
    """Blobs of ``min_bytes`` or more arrive in a ``FileBuffer`` in ``directory`` (the
    coordinator's checkpoint folder; the system's temporary folder when None) instead of
    memory: with dense codecs every upload in flight was a model's worth of anonymous memory,
    so a coordinator's or a relay's peak grew with the sites uploading at once."""

    directory: str | None
    min_bytes: int = SPILL_MIN_BYTES

    def buffer(self, size: int) -> FileBuffer | None:
        """A file buffer for a blob of ``size`` bytes, or None: a small one, or no file could be
        made (a full disk, a missing folder), and then it arrives in memory as before."""
        if size < self.min_bytes:
            return None
        try:
            return FileBuffer(size, self.directory)
        except OSError as err:
            logger.warning(
                "a transfer of %d bytes arrives in memory: no file for it in %s (%s)",
                size, self.directory or "the temporary folder", err,
            )
            return None

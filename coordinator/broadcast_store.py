"""Where the last broadcast's bytes live between rounds: memory for small deltas, a file for big.

Sites that wait, reconnect or resume late fetch the last round's delta until the next round
closes, so the coordinator keeps it that long, and it coincided with the next round's own
aggregation (the memory peak). A delta of at least ``SPILL_MIN_BYTES`` (a lossless downlink of a
big model) moves to an unnamed file beside the checkpoints (``FileBlob``) straight from the
encoded delta's payload, never serialised into one model-sized ``bytes``. The move is off the
round's critical path: the broadcast is published as soon as its SHA-256 is taken (the sites'
manifest needs it), served from the payload's memory meanwhile (``SpillingBlob``), and from the
file once it is written, when the memory goes. Smaller deltas stay in memory, where a file would
only add work.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading

from geoloco.compression import Encoded
from geoloco.protos.wire_files import SPILL_MIN_BYTES, FileBlob, RangeBlob

__all__ = ["PreparedBroadcast", "SpillingBlob"]

logger = logging.getLogger(__name__)



class SpillingBlob(RangeBlob):
    """A delta served from its encoded parts in memory until ``spill`` has copied them to an
    unnamed file, then from the file: readers never wait for the copy, and the parts are
    released as soon as it is done."""

    __slots__ = ("_file", "_lock", "_parts", "_size")

    def __init__(self, parts: tuple[bytes, memoryview, bytes]) -> None:
        self._parts: tuple[bytes, memoryview, bytes] | None = parts
        self._size = sum(len(part) for part in parts)
        self._file: FileBlob | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._size

    def read(self, offset: int, size: int) -> bytes:
        if offset < 0 or size < 0:
            raise ValueError(f"offset and size must be >= 0, got {offset} and {size}")
        with self._lock:
            file, parts = self._file, self._parts
        if file is not None:
            return file.read(offset, size)
        assert parts is not None
        out: list[bytes] = []
        end = min(self._size, offset + size)
        at = 0
        for part in parts:
            lo, hi = max(offset, at), min(end, at + len(part))
            if lo < hi:
                out.append(bytes(part[lo - at : hi - at]))
            at += len(part)
        return out[0] if len(out) == 1 else b"".join(out)

    def sha256(self) -> bytes:
        """SHA-256 of the bytes: straight from the parts' memory while they are held (no
        copies), else from the file."""
        with self._lock:
            parts = self._parts
        if parts is None:
            return super().sha256()
        digest = hashlib.sha256()
        for part in parts:
            digest.update(part)
        return digest.digest()

    @property
    def spilled(self) -> bool:
        """Served from the file now (the memory is released)."""
        with self._lock:
            return self._file is not None

    def spill(self, directory: str | os.PathLike[str] | None) -> None:
        with self._lock:
            parts = self._parts
        if parts is None:
            return
        file = FileBlob.spill_parts(parts, directory)
        with self._lock:
            self._file, self._parts = file, None


class PreparedBroadcast:
    """Serialise one encoded delta, hash it and, when large, move it to a file, in a background
    thread (hashlib and file writes release the GIL). ``result()`` waits for the hash only and
    returns the bytes to serve and their SHA-256; a large delta's move to its file goes on."""

    def __init__(
        self,
        delta: Encoded,
        *,
        directory: str | os.PathLike[str] | None,
        spill_min_bytes: int = SPILL_MIN_BYTES,
    ) -> None:
        parts: tuple[bytes, memoryview, bytes] | None = delta.wire_parts()
        assert parts is not None
        self.nbytes = sum(len(part) for part in parts)
        """Size of the encoded delta on the wire."""
        self._served: bytes | SpillingBlob = (
            SpillingBlob(parts) if self.nbytes >= spill_min_bytes else b"".join(parts)
        )
        del parts
        self._directory = directory
        self._sha256: bytes | None = None
        self._error: OSError | None = None
        self._hashed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="geoloco-broadcast-prepare", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        served = self._served
        try:
            self._sha256 = served.sha256() if isinstance(served, SpillingBlob) else hashlib.sha256(served).digest()
        finally:
            self._hashed.set()
        if isinstance(served, SpillingBlob):
            try:
                served.spill(self._directory)
            except OSError as exc:  # reported by ``error``; served from memory meanwhile
                self._error = exc
                logger.warning("the broadcast stays in memory: %s", exc)

    def result(self) -> tuple[bytes | SpillingBlob, bytes | None]:
        """(bytes or ``SpillingBlob`` to serve, SHA-256 or None when it could not be taken)."""
        self._hashed.wait()
        return self._served, self._sha256

    def join(self) -> None:
        """Wait for a large delta's move to its file too (tests, and memory measurements)."""
        self._thread.join()

    @property
    def error(self) -> OSError | None:
        """What went wrong while moving the delta to its file (then it is served from memory)."""
        return self._error

"""Where the last broadcast's bytes live between rounds: memory for small deltas, a file for big.

Sites that wait, reconnect or resume late fetch the last round's delta until the next round
closes, so the coordinator keeps it that long, and it coincided with the next round's own
aggregation (the memory peak). A delta of at least ``SPILL_MIN_BYTES`` (a lossless downlink of a
big model) is written to an unnamed file beside the checkpoints (``FileBlob``) straight from the
encoded delta's payload, never serialised into one model-sized ``bytes``, while the checkpoint is
being written, its SHA-256 taken in the same pass; it is then served from the file chunk by
chunk. Smaller ones (compressed downlinks) stay in memory, where a file would only add work.
"""

from __future__ import annotations

import hashlib
import os
import threading

from geoloco.compression import Encoded
from geoloco.protos.wire_files import FileBlob

__all__ = ["SPILL_MIN_BYTES", "PreparedBroadcast"]

SPILL_MIN_BYTES = 64 << 20
"""Deltas this large or larger are served from a file, smaller ones from memory."""


class PreparedBroadcast:
    """Serialise one encoded delta, hash it (and, when large, spill it) in a background thread;
    hashlib and file writes release the GIL, so this overlaps the checkpoint write. ``result()``
    waits for it and returns the bytes to serve and their SHA-256."""

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
        self._data: bytes | None = None
        if self.nbytes < spill_min_bytes:
            self._data = b"".join(parts)
            parts = None
        self._parts = parts
        self._directory = directory
        self._served: bytes | FileBlob | None = None
        self._sha256: bytes | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="geoloco-broadcast-prepare", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        digest = hashlib.sha256()
        try:
            if self._parts is not None:
                self._served = FileBlob.spill_parts(self._parts, self._directory, digest=digest)
            else:
                digest.update(self._data or b"")
                self._served = self._data
            self._sha256 = digest.digest()
        except BaseException as exc:  # noqa: BLE001 - reported by ``error``; served from memory
            self._error = exc
            self._sha256 = None
            self._served = self._data if self._data is not None else b"".join(self._parts or ())

    def result(self) -> tuple[bytes | FileBlob, bytes | None]:
        """(bytes or ``FileBlob`` to serve, SHA-256 or None when it could not be taken)."""
        self._thread.join()
        served = self._served
        assert served is not None
        self._data = self._parts = None
        return served, self._sha256

    @property
    def error(self) -> BaseException | None:
        """What went wrong while spilling (then the delta is served from memory)."""
        return self._error

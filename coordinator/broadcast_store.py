"""Where the last broadcast's bytes live between rounds: memory for small deltas, a file for big.

Sites that wait, reconnect or resume late fetch the last round's delta until the next round
closes, so the coordinator keeps it that long, and it coincided with the next round's own
aggregation (the memory peak). A delta of at least ``SPILL_MIN_BYTES`` (a lossless downlink of a
big model) is written to an unnamed file beside the checkpoints (``FileBlob``) while the
checkpoint is being written, its SHA-256 taken in the same pass, and served from there chunk by
chunk; smaller ones (compressed downlinks) stay in memory, where a file would only add work.
"""

from __future__ import annotations

import hashlib
import os
import threading

from geoloco.protos.wire import Buffer, FileBlob, as_byte_view

__all__ = ["SPILL_MIN_BYTES", "PreparedBroadcast"]

SPILL_MIN_BYTES = 64 << 20
"""Deltas this large or larger are served from a file, smaller ones from memory."""


class PreparedBroadcast:
    """Hash (and, when large, spill) one encoded delta in a background thread; hashlib and file
    writes release the GIL, so this overlaps the checkpoint write. ``result()`` waits for it and
    returns the bytes to serve and their SHA-256; the caller then drops its own ``data``."""

    def __init__(
        self,
        data: bytes,
        *,
        directory: str | os.PathLike[str] | None,
        spill_min_bytes: int = SPILL_MIN_BYTES,
    ) -> None:
        self._data: bytes | None = data
        self._directory = directory
        self._spill = len(data) >= spill_min_bytes
        self._served: bytes | FileBlob | None = None
        self._sha256: bytes | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="geoloco-broadcast-prepare", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        data = self._data
        assert data is not None
        digest = hashlib.sha256()
        try:
            if self._spill:
                self._served = FileBlob.spill(data, self._directory, digest=digest)
            else:
                digest.update(as_byte_view(data))
                self._served = data
            self._sha256 = digest.digest()
        except BaseException as exc:  # noqa: BLE001 - reported by result(); the bytes stay in memory
            self._error = exc
            self._served = data

    def result(self) -> tuple[Buffer, bytes | None]:
        """(bytes or ``FileBlob`` to serve, SHA-256 or None when hashing failed)."""
        self._thread.join()
        served = self._served
        assert served is not None
        self._data = None
        return served, self._sha256

    @property
    def error(self) -> BaseException | None:
        """What went wrong while spilling (then the delta is served from memory)."""
        return self._error

"""What a rank of a sharded site downloads: its own rows of the weights and of the broadcast.

A sharded site's rank (``geoloco.site_agent.sharded``) holds only its rows of the model, so it
asks FetchModel and AwaitBroadcast for those rows (``ShardRef``), and the site as a whole
downloads one model's worth, not one per rank. The rows are the ones the rank uploads
(``geoloco.algorithms.shard_split``, recomputed here from the layout).

* Weights: the rows of ``θ`` as float32 bytes; the manifest's checksum is their SHA-256, so the
  download itself checks the rank's rows against the coordinator's.
* Broadcast delta: without a sparsifier in the downlink codec (``none``, the casts, the block
  quantizers) the rows' encoding is made of byte ranges of the delta
  (``geoloco.compression.slicing``; whole quantizer blocks around the rows): the same values
  every whole-delta site adds. A sparse downlink cannot be sliced; the rank then gets the whole
  delta (``shard_rows`` false) and keeps its rows. Either way the header carries the SHA-256 of
  the rank's rows of ``θ_{r+1}``.

A round's slices are made once per (count, index) on first request and kept until the next
broadcast replaces the record; large slices live in unnamed files like the delta itself.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from geoloco.algorithms.shard_split import SHARD_SPLITS, ShardRange, shard_ranges
from geoloco.compression import CodecError, slicing
from geoloco.coordinator.domain import BroadcastRecord
from geoloco.coordinator.shards import MAX_SHARDS
from geoloco.protos.errors import InvalidUpdateError, quoted
from geoloco.protos.wire_buffers import as_byte_view
from geoloco.protos.wire_files import FileBlob, RangeBlob

__all__ = ["ShardKey", "ShardSlice", "ShardViews"]

ShardKey = tuple[int, int, str]
"""(index, count, split) of a rank's rows."""


@dataclass(frozen=True, slots=True)
class ShardSlice:
    """A rank's rows of one broadcast delta, encoded, with what its manifest needs."""

    data: bytes | RangeBlob
    sha256: bytes
    codec: str
    numel: int


class ShardViews:
    """Per-shard rows of the weights and of the last broadcast (module doc)."""

    def __init__(
        self,
        shapes: list[tuple[int, ...]],
        *,
        spill_directory: str | os.PathLike[str] | None = None,
    ) -> None:
        self.shapes = shapes
        self._spill_directory = spill_directory
        self._lock = threading.Lock()
        self._record: BroadcastRecord | None = None
        self._slices: dict[ShardKey, Future[ShardSlice | None]] = {}
        self._digests: dict[tuple[str, ShardKey], str] = {}

    def ranges(self, key: ShardKey) -> list[ShardRange]:
        """The rows ``key`` names, or a clear error naming what a shard may be."""
        index, count, split = key
        if split not in SHARD_SPLITS:
            raise InvalidUpdateError(
                f"request names shard split {quoted(split)}; the known splits are {list(SHARD_SPLITS)}"
            )
        if not 1 <= count <= MAX_SHARDS or not 0 <= index < count:
            raise InvalidUpdateError(
                f"request names shard {index} of {count}; count must be 1 .. {MAX_SHARDS} and index "
                "0 .. count-1"
            )
        return shard_ranges(self.shapes, index, count, split)

    def weight_rows(self, weights: torch.Tensor, key: ShardKey) -> torch.Tensor:
        """The rows of a flat CPU float32 vector, concatenated in layout order (a copy)."""
        ranges = self.ranges(key)
        if not ranges:
            return weights[:0].clone()
        return torch.cat([weights[offset : offset + count] for offset, count in ranges])

    def rows_digest(self, weights: torch.Tensor, weights_digest: str, key: ShardKey) -> str:
        """Hex SHA-256 of ``key``'s rows of ``weights`` (whose whole digest is
        ``weights_digest``), hashed range by range without a copy and cached per weights."""
        cache_key = (weights_digest, key)
        with self._lock:
            known = self._digests.get(cache_key)
        if known is not None:
            return known
        digest = hashlib.sha256()
        for offset, count in self.ranges(key):
            digest.update(as_byte_view(weights[offset : offset + count].numpy()))
        hex_digest = digest.hexdigest()
        with self._lock:
            self._digests = {k: v for k, v in self._digests.items() if k[0] == weights_digest}
            self._digests[cache_key] = hex_digest
        return hex_digest

    def delta_rows(self, record: BroadcastRecord, key: ShardKey) -> ShardSlice | None:
        """``key``'s rows of ``record``'s delta, or None when its codec cannot be sliced.

        Made once per shard: the first request makes it while requests for the same shard
        wait for it, and requests for other shards make theirs meanwhile (no lock is held
        while a model-sized slice is read and written)."""
        ranges = self.ranges(key)
        with self._lock:
            if self._record is not record:
                self._record, self._slices = record, {}
            pending = self._slices.get(key)
            owner = pending is None
            if pending is None:
                pending = self._slices[key] = Future()
        if owner:
            try:
                pending.set_result(self._slice(record, ranges))
            except BaseException as err:  # noqa: BLE001 - raised to every waiter; the next request retries
                pending.set_exception(err)
                with self._lock:
                    if self._slices.get(key) is pending:
                        del self._slices[key]
        return pending.result()

    def _slice(self, record: BroadcastRecord, ranges: list[ShardRange]) -> ShardSlice | None:
        block = slicing.slice_block(record.codec)
        if block is None:
            return None
        data = record.data
        digest = hashlib.sha256()
        try:
            if isinstance(data, RangeBlob):  # a big delta: its slices go to files too, piece by piece
                served: bytes | FileBlob = FileBlob.spill_parts(
                    slicing.sliced_parts(data.read, ranges), self._spill_directory, digest=digest
                )
            else:
                view = memoryview(data)
                served = b"".join(slicing.sliced_parts(lambda at, size: bytes(view[at : at + size]), ranges))
                digest.update(served)
        except CodecError as err:
            raise InvalidUpdateError(f"the broadcast of round {record.round} cannot be sliced: {err}") from None
        numel = sum(count for _, count in slicing.covering_runs(ranges, block, math.prod(record.shape)))
        return ShardSlice(served, digest.digest(), record.codec, numel)

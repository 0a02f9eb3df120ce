"""Receiving: validated, idempotent, resumable reassembly of chunk streams.

Chunks may arrive in any order, more than once, and over several streams. ``BlobAssembler``
copies each chunk into a preallocated buffer (which may be the caller's own tensor, so weights
land in place), records which indices arrived, ignores duplicates and verifies the checksum
(computed while in-order chunks arrive) once all are there. ``UploadAssembler`` adds
the (site, round, fragment) identity and the UploadStatus/Upload responses; ``Download`` keeps a
client's partial FetchModel/AwaitBroadcast download across broken streams.
"""

from __future__ import annotations

import hashlib
import os
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from google.protobuf.message import Message

from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.errors import clip
from geoloco.protos.wire_buffers import (
    DEFAULT_MAX_BLOB_BYTES,
    MAX_CHUNK_SIZE,
    Buffer,
    ChecksumMismatchError,
    ChunkIndexError,
    ChunkSizeError,
    IncompleteError,
    ManifestConflictError,
    ManifestError,
    OversizeChunkError,
    StreamOverrunError,
    as_byte_view,
    checksum_hex,
    flag_ranges,
    to_index_ranges,
)
from geoloco.protos.wire_chunks import ChunkRef
from geoloco.protos.wire_files import FileBuffer
from geoloco.protos.wire_manifests import validate_blob_manifest


class _RunningDigest:
    """Checksum computed while chunks arrive in order, so ``finish`` need not reread the blob
    (a 256 MiB CRC-32 pass is ~85 ms, a third of a loopback transfer)."""

    def __init__(self, algorithm: int) -> None:
        self.algorithm = algorithm
        self.reset()

    def reset(self) -> None:
        self._crc = 0
        self._sha = hashlib.sha256() if self.algorithm == pb.CHECKSUM_ALGORITHM_SHA256 else None

    def update(self, data: memoryview) -> None:
        if self._sha is not None:
            self._sha.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def digest(self) -> bytes:
        return self._sha.digest() if self._sha is not None else self._crc.to_bytes(4, "big")


_HASH_WORKERS = max(1, min(4, os.cpu_count() or 1))
_hash_pool: ThreadPoolExecutor | None = None
_hash_pool_lock = threading.Lock()


def _hash_executor() -> ThreadPoolExecutor:
    """Threads that advance the assemblers' running checksums (shared by all of a process's
    assemblers; started on first use)."""
    global _hash_pool
    with _hash_pool_lock:
        if _hash_pool is None:
            _hash_pool = ThreadPoolExecutor(max_workers=_HASH_WORKERS, thread_name_prefix="geoloco-wire-hash")
        return _hash_pool


def _forget_hash_pool() -> None:
    """A forked child has none of its parent's threads: it starts its own pool when needed."""
    global _hash_pool, _hash_pool_lock
    _hash_pool = None
    _hash_pool_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_hash_pool)


class BlobAssembler:
    """Reassembles one blob from chunks arriving in any order, any number of times.

    Thread-safe: two streams for the same blob (a broken one the server has not noticed yet and
    its resumption), or K parallel streams, may feed it concurrently.

    The checksum is the wire's: SHA-256 (or CRC-32) of the whole blob, taken over the chunks in
    index order as soon as a prefix of them is there. It is taken outside the lock that
    ``add`` holds while copying a chunk in, by a pool thread (``hashlib`` releases the GIL for
    large buffers): the streams keep receiving and copying while earlier chunks are hashed,
    instead of every stream waiting on one thread's SHA-256 (about 1 s per GiB here). Chunks
    never change once stored (duplicates are ignored), so hashing them unlocked is safe; a
    second lock (``_hash_lock``, always taken before ``_lock``) keeps one hasher per blob, and
    ``finish`` hashes whatever the pool has not yet before it verifies.
    """

    def __init__(
        self,
        manifest: pb.BlobManifest,
        *,
        max_total_bytes: int = DEFAULT_MAX_BLOB_BYTES,
        max_chunk_size: int = MAX_CHUNK_SIZE,
        out: Buffer | FileBuffer | None = None,
    ) -> None:
        """``out``: where to write (e.g. the uint8 view of a weight tensor, or a ``FileBuffer``
        for a big upload, whose hashed bytes leave the process's memory), exactly
        ``manifest.total_bytes`` long; a new bytearray when None."""
        validate_blob_manifest(
            manifest, max_total_bytes=max_total_bytes, max_chunk_size=max_chunk_size
        )
        self.manifest = pb.BlobManifest()
        self.manifest.CopyFrom(manifest)
        total = manifest.total_bytes
        self._file: FileBuffer | None = out if isinstance(out, FileBuffer) else None
        if out is None:
            self._view = memoryview(bytearray(total))
        else:
            self._view = self._file.view() if self._file is not None else as_byte_view(out, writable=True)
            if len(self._view) != total:
                raise ValueError(
                    f"output buffer has {len(self._view)} bytes, the manifest needs {total}"
                )
        self._chunk_size = manifest.chunk_size
        self._num_chunks = manifest.num_chunks
        self._last_size = total - (self._num_chunks - 1) * self._chunk_size if total else 0
        self._flags = bytearray(self._num_chunks)
        self._received_count = 0
        self._received_bytes = 0
        self._duplicates = 0
        self._verified = False
        self._released = False
        self._digest = _RunningDigest(manifest.checksum.algorithm)
        self._hashed = 0  # chunks [0, _hashed) are in the running digest
        self._hash_scheduled = False  # a pool task will advance the digest (under _lock)
        self._lock = threading.Lock()
        self._hash_lock = threading.Lock()

    # --- state ---------------------------------------------------------------------------

    @property
    def num_chunks(self) -> int:
        return self._num_chunks

    @property
    def received_count(self) -> int:
        return self._received_count

    @property
    def received_bytes(self) -> int:
        return self._received_bytes

    @property
    def duplicates(self) -> int:
        """Chunks that arrived again after their first copy (ignored)."""
        return self._duplicates

    @property
    def complete(self) -> bool:
        """Every chunk arrived (the checksum is checked by ``finish``)."""
        return self._received_count == self._num_chunks

    def missing(self) -> list[tuple[int, int]]:
        """Half-open index ranges not received yet."""
        with self._lock:
            return flag_ranges(self._flags, 0)

    def received(self) -> list[tuple[int, int]]:
        with self._lock:
            return flag_ranges(self._flags, 1)

    def first_missing(self) -> int | None:
        """Lowest missing index (where an in-order download resumes), None when complete."""
        with self._lock:
            index = self._flags.find(b"\x00")
        return None if index < 0 else index

    def first_missing_in(self, residue: int, stride: int) -> int | None:
        """Lowest missing index of the form ``residue + n * stride`` (where one of ``stride``
        parallel downloads resumes), None when all of those arrived."""
        with self._lock:
            for index in range(residue, self._num_chunks, max(1, stride)):
                if not self._flags[index]:
                    return index
        return None

    def slot_size(self, index: int) -> int:
        """Exact byte count chunk ``index`` must have."""
        if not 0 <= index < self._num_chunks:
            raise ChunkIndexError(
                f"chunk index {index} is out of range: the manifest has {self._num_chunks} "
                f"chunks (0..{self._num_chunks - 1})"
            )
        return self._last_size if index == self._num_chunks - 1 else self._chunk_size

    # --- feeding -------------------------------------------------------------------------

    def add(self, index: int, data: bytes | memoryview) -> bool:
        """Store chunk ``index``; True if new, False for an (ignored) duplicate."""
        expected = self.slot_size(index)
        size = len(data)
        if size > expected:
            raise OversizeChunkError(
                f"chunk {index} has {size} bytes but its slot holds {expected}: it would write "
                f"past the manifest's {self.manifest.total_bytes} bytes"
            )
        if size < expected:
            raise ChunkSizeError(
                f"chunk {index} has {size} bytes, expected {expected} (every chunk but the last "
                f"holds chunk_size={self._chunk_size} bytes)"
            )
        with self._lock:
            if self._flags[index]:
                self._duplicates += 1
                return False
            offset = index * self._chunk_size
            self._view[offset : offset + size] = data
            self._flags[index] = 1
            self._received_count += 1
            self._received_bytes += size
            schedule = index == self._hashed and not self._hash_scheduled
            if schedule:
                self._hash_scheduled = True
        if schedule:
            _hash_executor().submit(self._hash_in_background)
        return True

    # --- the running checksum --------------------------------------------------------------

    def _in_order_run(self) -> tuple[int, int]:
        """Chunk indices ``[first, stop)``: stored, in order, not hashed yet (``_lock`` held)."""
        first = stop = self._hashed
        while stop < self._num_chunks and self._flags[stop]:
            stop += 1
        return first, stop

    def _hash_run(self, first: int, stop: int) -> None:
        """Hash chunks ``[first, stop)`` without ``_lock`` (``_hash_lock`` held)."""
        if first < stop:
            start = first * self._chunk_size
            end = min((stop - 1) * self._chunk_size + self.slot_size(stop - 1), len(self._view))
            self._digest.update(self._view[start:end])
            if self._file is not None:
                self._file.forget(start, end - start)
        with self._lock:
            self._hashed = stop

    def _hash_in_background(self) -> None:
        """Pool task: advance the digest over every in-order chunk, until none is left."""
        with self._hash_lock:
            while True:
                with self._lock:
                    first, stop = self._in_order_run()
                    if first == stop:
                        self._hash_scheduled = False
                        return
                self._hash_run(first, stop)

    def consume(self, chunks: Iterable[pb.Chunk | ChunkRef]) -> int:
        """Feed one stream's chunks; return how many were new.

        A stream that carries more chunk bytes than the whole blob is a sender stuck in a loop
        (a correct sender never repeats a chunk within one stream): ``StreamOverrunError``.
        """
        limit = self.manifest.total_bytes
        streamed = 0
        new = 0
        for chunk in chunks:
            data = chunk.data
            streamed += len(data)
            if streamed > limit:
                raise StreamOverrunError(
                    f"stream carried more than the manifest's {limit} bytes; a sender must send "
                    "each chunk at most once per stream"
                )
            new += self.add(chunk.index, data)
        return new

    # --- result --------------------------------------------------------------------------

    def finish(self) -> memoryview:
        """Check completeness and the checksum; return the assembled bytes (a view, no copy).

        On a checksum mismatch every chunk is marked missing again, so a retry resends all.
        """
        if self._released:
            raise RuntimeError("internal error: the blob's bytes were released after they were used")
        with self._hash_lock:
            with self._lock:
                if self._verified or self._received_count != self._num_chunks:
                    first = stop = self._hashed
                else:
                    first, stop = self._in_order_run()
            self._hash_run(first, stop)
            return self._verify()

    def _verify(self) -> memoryview:
        with self._lock:
            if self._verified:
                return self._view
            if self._received_count != self._num_chunks:
                missing = flag_ranges(self._flags, 0)
                raise IncompleteError(
                    f"{self._num_chunks - self._received_count} of {self._num_chunks} chunks "
                    f"missing (ranges {missing[:8]}{' ...' if len(missing) > 8 else ''})",
                    missing,
                )
            expected = self.manifest.checksum
            actual = pb.Checksum(algorithm=expected.algorithm, digest=self._digest.digest())
            if actual.digest != expected.digest:
                self._flags[:] = bytes(self._num_chunks)
                self._received_count = 0
                self._received_bytes = 0
                self._digest.reset()
                self._hashed = 0
                raise ChecksumMismatchError(
                    f"checksum mismatch: expected {checksum_hex(expected)}, got "
                    f"{checksum_hex(actual)}; every chunk must be sent again"
                )
            self._verified = True
            return self._view

    @property
    def verified(self) -> bool:
        return self._verified

    def release(self) -> None:
        """Drop the assembled bytes once they were used (a verified upload added to its round):
        the assembler goes on answering for the blob (complete, which chunks, its manifest) for
        resumed or repeated streams without holding a copy of it. Before, every counted upload
        stayed in memory until its round ended: a model's worth per site with a dense codec."""
        with self._lock:
            if not self._verified:
                raise RuntimeError("internal error: an unverified blob's bytes are still needed")
            self._released = True
            self._view = memoryview(bytearray(0))
            self._file = None  # its mapping goes once the last view of it does


class UploadAssembler(BlobAssembler):
    """Coordinator-side state of one (site, round, fragment) upload, kept across streams.

    The coordinator keys its assemblers by (site, round, fragment) with the site name from
    ``transport_tls.resolve_site`` (the certificate's name with TLS), not by the manifest's field.
    """

    def __init__(
        self,
        manifest: pb.UploadManifest,
        *,
        max_total_bytes: int = DEFAULT_MAX_BLOB_BYTES,
        max_chunk_size: int = MAX_CHUNK_SIZE,
        out: Buffer | FileBuffer | None = None,
    ) -> None:
        super().__init__(
            manifest.blob, max_total_bytes=max_total_bytes, max_chunk_size=max_chunk_size, out=out
        )
        self.upload = pb.UploadManifest()
        self.upload.CopyFrom(manifest)

    def check_same_manifest(self, manifest: pb.UploadManifest) -> None:
        """A resumed upload must resend the identical manifest (same bytes, same checksum).
        The refusal names what differs: the checksums, or -- the same bytes sent with other
        metrics, weight or session, e.g. by a restarted or a second process of the site --
        the fields that do. Equal serialised bytes count as the same manifest too: protobuf
        backends that compare floats with IEEE ``==`` find a manifest holding a NaN unequal to
        its own copy (upb does not), and a client's parallel streams would refuse each other."""
        if manifest == self.upload or _same_bytes(manifest, self.upload):
            return
        stored, sent = self.upload.blob.checksum, manifest.blob.checksum
        if stored != sent:
            differs = f"stored checksum {checksum_hex(stored)}, sent {checksum_hex(sent)}"
        else:
            fields = message_differences(self.upload, manifest) or ["fields this version does not know"]
            shown = "; ".join(fields[:MAX_DIFFERENCES_SHOWN])
            if len(fields) > MAX_DIFFERENCES_SHOWN:
                shown += f"; and {len(fields) - MAX_DIFFERENCES_SHOWN} more"
            differs = f"the same bytes (checksum {checksum_hex(stored)}), but these fields differ: {shown}"
        raise ManifestConflictError(
            f"upload for site {self.upload.site!r} round {self.upload.round} fragment "
            f"{self.upload.fragment} already has a different manifest ({differs}); resend the "
            "stored update with its manifest or ask UploadStatus for the stored manifest"
        )

    def upload_response(self) -> pb.UploadResponse:
        return pb.UploadResponse(
            complete=self.verified,
            missing=to_index_ranges(self.missing()),
            received_bytes=self.received_bytes,
        )

    def status_response(self) -> pb.UploadStatusResponse:
        return pb.UploadStatusResponse(
            known=True,
            manifest=self.upload,
            received=to_index_ranges(self.received()),
            missing=to_index_ranges(self.missing()),
            complete=self.verified,
        )


MAX_DIFFERENCES_SHOWN = 4
"""Fields a manifest-conflict message names (the rest are counted)."""


def message_differences(stored: Message, sent: Message, prefix: str = "") -> list[str]:
    """The fields in which two messages of one type differ, each with both values, for a
    refusal message: ``sample_weight (stored 12.0, sent 13.0)``, a map's keys one by one
    (``metrics['train_loss'] (stored 0.5, sent 0.51)``), a sub-message's fields dotted. Values
    come from requests, so each is cut short (``clip``)."""
    found: list[str] = []
    for field in stored.DESCRIPTOR.fields:
        name = prefix + field.name
        a, b = getattr(stored, field.name), getattr(sent, field.name)
        if a == b:
            continue
        if isinstance(a, Message):
            found.extend(message_differences(a, b, name + "."))
        elif hasattr(a, "keys"):  # a map
            for key in sorted(set(a.keys()) | set(b.keys()), key=str):
                x, y = a.get(key), b.get(key)
                if x != y:
                    found.append(f"{name}[{clip(repr(key))}] (stored {_shown(x)}, sent {_shown(y)})")
        elif isinstance(a, str | bytes | bool | int | float):
            found.append(f"{name} (stored {_shown(a)}, sent {_shown(b)})")
        else:  # a repeated field
            found.append(f"{name} (stored {_shown(list(a))}, sent {_shown(list(b))})")
    return found


def _shown(value: Any) -> str:
    return "nothing" if value is None else clip(repr(value), 40)


def read_upload_manifest(requests: Iterator[pb.UploadRequest | ChunkRef]) -> pb.UploadManifest:
    """The first message of an Upload stream, which must be a manifest."""
    first = next(requests, None)
    if first is None:
        raise ManifestError("empty Upload stream: the first message must be a manifest")
    if isinstance(first, ChunkRef) or first.WhichOneof("kind") != "manifest":
        raise ManifestError(
            f"Upload stream starts with {first.WhichOneof('kind')!r}; the first message must be "
            "a manifest"
        )
    return first.manifest


def upload_chunks(
    requests: Iterator[pb.UploadRequest | ChunkRef],
) -> Iterator[pb.Chunk | ChunkRef]:
    """The chunks after an Upload stream's manifest; a second manifest is an error."""
    for request in requests:
        kind = request.WhichOneof("kind")
        if kind != "chunk":
            raise ManifestError(
                f"Upload stream has a {kind!r} message after its manifest; only chunks may follow"
            )
        yield request.chunk


class Download:
    """Client side of a chunked download (FetchModel, AwaitBroadcast) that survives broken
    streams: keep one ``Download`` across retries and ask ``resume_point()`` where to restart.
    """

    def __init__(
        self,
        *,
        max_total_bytes: int = DEFAULT_MAX_BLOB_BYTES,
        out_factory: Callable[[pb.BlobManifest], Buffer] | None = None,
        parallel: bool = False,
    ) -> None:
        """``out_factory(manifest)`` returns the buffer to write into, or None for a new
        bytearray. Writing straight into the live weights saves a copy, but a failed download
        then leaves them garbled: only do that when failure means a full resync anyway.

        ``parallel``: several concurrent streams feed this download, each asking for every
        K-th chunk from its own first index (``chunk_stride``), so a stream may start a blob at
        a chunk other than 0."""
        self.max_total_bytes = max_total_bytes
        self.out_factory = out_factory
        self.parallel = parallel
        self.assembler: BlobAssembler | None = None
        self._lock = threading.Lock()

    def resume_point(self) -> tuple[int, pb.Checksum | None]:
        """(start_chunk, expect_digest) for the next request."""
        if self.assembler is None:
            return 0, None
        first = self.assembler.first_missing()
        start = self.assembler.num_chunks if first is None else first
        return start, self.assembler.manifest.checksum

    def stream_resume_point(self, residue: int, stride: int) -> tuple[int | None, pb.Checksum | None]:
        """(start_chunk, expect_digest) for parallel stream ``residue`` of ``stride``; a None
        start when that stream's share is complete."""
        assembler = self.assembler
        if assembler is None:
            return residue, None
        return assembler.first_missing_in(residue, stride), assembler.manifest.checksum

    def start(self, blob: pb.BlobManifest, start_chunk: int) -> BlobAssembler:
        """A manifest arrived; keep the partial download if it is the same blob."""
        with self._lock:
            if self.assembler is not None and self.assembler.manifest == blob:
                return self.assembler
            if start_chunk != 0 and not self.parallel:
                raise ManifestError(
                    f"server resumes at chunk {start_chunk} of a blob this client never started"
                )
            out = self.out_factory(blob) if self.out_factory is not None else None
            self.assembler = BlobAssembler(blob, max_total_bytes=self.max_total_bytes, out=out)
            return self.assembler

    def result(self) -> memoryview:
        if self.assembler is None:
            raise IncompleteError("no manifest received yet", [])
        return self.assembler.finish()


def read_model_stream(
    responses: Iterable[pb.FetchModelResponse], download: Download
) -> pb.ModelManifest:
    """Consume a FetchModel stream into ``download``; return its manifest.

    The caller then calls ``download.result()`` (verifies the checksum). If the stream breaks,
    the chunks received so far stay in ``download`` for a resumed request.
    """
    it = iter(responses)
    first = next(it, None)
    if first is None or first.WhichOneof("kind") != "manifest":
        raise ManifestError("FetchModel stream must start with a manifest")
    manifest = first.manifest
    assembler = download.start(manifest.blob, manifest.start_chunk)
    assembler.consume(r.chunk for r in _only_chunks(it, "FetchModel"))
    return manifest


def read_broadcast_stream(
    responses: Iterable[pb.AwaitBroadcastResponse],
    download: Download,
    *,
    on_progress: Callable[[pb.RoundProgress], None] | None = None,
) -> pb.BroadcastHeader:
    """Consume an AwaitBroadcast stream: progress messages, the header, then delta chunks.

    For APPLY_DELTA the delta is in ``download`` (call ``download.result()``); for RESYNC no
    chunks follow and ``download`` is untouched.
    """
    it = iter(responses)
    for response in it:
        kind = response.WhichOneof("kind")
        if kind == "progress":
            if on_progress is not None:
                on_progress(response.progress)
            continue
        if kind != "header":
            raise ManifestError(f"AwaitBroadcast sent a {kind!r} before its header")
        header = response.header
        if header.action == pb.BROADCAST_ACTION_APPLY_DELTA:
            assembler = download.start(header.delta, header.start_chunk)
            assembler.consume(r.chunk for r in _only_chunks(it, "AwaitBroadcast"))
        else:
            for extra in it:
                raise ManifestError(
                    f"AwaitBroadcast sent a {extra.WhichOneof('kind')!r} after a "
                    f"{pb.BroadcastAction.Name(header.action)} header"
                )
        return header
    raise ManifestError("AwaitBroadcast stream ended without a header")


def _only_chunks(responses: Iterable[Any], rpc: str) -> Iterator[Any]:
    for response in responses:
        if response.WhichOneof("kind") != "chunk":
            raise ManifestError(
                f"{rpc} sent a {response.WhichOneof('kind')!r} message among the chunks"
            )
        yield response


def _same_bytes(a: Message, b: Message) -> bool:
    """Whether two messages serialise to the same bytes (map entries in a fixed order)."""
    return a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)

"""Large buffers on the wire: chunking, manifests, checksums and validated reassembly.

Everything big that geoloco sends -- the flat fp32 global weights (FetchModel), an encoded
pseudo-gradient (Upload), an encoded downlink delta (AwaitBroadcast) -- is one byte buffer,
described by a ``BlobManifest`` and streamed as ``Chunk`` messages. This module knows nothing about
codecs: it moves ``bytes`` / ``bytearray`` / ``memoryview`` / NumPy arrays / CPU torch tensors
(viewed as raw bytes, without copying) and the codec spec is an opaque string.

Chunk size. ``DEFAULT_CHUNK_SIZE`` is 1 MiB, picked with ``benchmarks/bench_transfer.py``:
a 256 MiB Upload over loopback between two processes through this package's code path (chunk
fast path, malloc tunables on, plain text, best of 5, 2 shared cores)::

    chunk     MB/s   x raw socket   CPU s/GiB site   CPU s/GiB coordinator
    256 KiB    307       0.21            0.63               1.18
    1 MiB    1,318       0.91            0.43               0.98
    4 MiB      774       0.53            0.44               1.06

Wall-clock numbers on that shared machine vary by up to 2x between runs (CPU per GiB is
steadier); 1 MiB was the fastest or tied in every run. Smaller chunks pay per-message costs
(a Python generator step, a thread hand-off in gRPC's sync API, HTTP/2 framing); larger ones
gain nothing, make a broken-and-resumed transfer repeat more bytes, and only fit a peer that
raised gRPC's 4 MiB default receive limit. ``MAX_CHUNK_SIZE`` (4 MiB) is what a receiver
accepts from a peer.

Checksum. SHA-256 by default, because a manifest's checksum must identify its bytes: the
coordinator resumes an upload whose manifest equals the stored one and refuses a different one
as MANIFEST_CONFLICT, and a client keeps a partial download only for an equal manifest. CRC-32
(``zlib.crc32``, ~3.1 GB/s here against SHA-256 1.8 GB/s with SHA extensions, SHA-1 1.9,
BLAKE2b 0.7, MD5 0.8 GB/s; 256 MiB buffer, one core) cannot: every encoded update and delta ends
with its own CRC-32, and the CRC-32 of such a buffer is one constant (``CRC32_RESIDUE``) whatever
its content, so two different updates of the same size had equal manifests (a second update was
answered "complete", two concurrent ones were merged chunk by chunk). CRC-32 stays accepted for
other buffers; a CRC-32 manifest equal to the residue is refused. Assembling and verifying
costs the coordinator 1.34x the CPU per received byte that it did with CRC-32, hashing an update
costs a site 2.35x (``benchmarks/bench_manifest_checksum.py``), so receivers compute the digest
while chunks arrive (in order) instead of in a pass at the end. It guards against bugs (wrong
reassembly, stale buffers, mixed-up rounds or updates) and storage faults, not against an
attacker: mutual TLS already authenticates and integrity-protects every byte in transit. Both
functions release the GIL on large buffers.

Copies. Senders yield ``ChunkRef`` (a memoryview of the caller's buffer, no copy) instead of
protobuf ``Chunk`` messages, and ``MessageCodec`` writes/reads chunk messages by hand: one copy
per side instead of four, with the same bytes on the wire (``transport.coordinator_stub`` and
``transport.add_coordinator_servicer`` install it). In the benchmark this cut the site's CPU per
GiB 1.5-3x and the coordinator's by 15-30%.

Idempotence and resume. Chunks may arrive in any order, more than once, and over several
streams; ``BlobAssembler`` copies each chunk into a preallocated buffer (which may be the
caller's own tensor, so weights land in place), records which indices arrived, ignores
duplicates, and verifies the checksum once all are there. ``UploadAssembler`` adds the
(site, round, fragment) identity and the UploadStatus/Upload responses; ``Download`` keeps a
client's partial FetchModel/AwaitBroadcast download across broken streams.

Violations raise ``WireError`` subclasses, each carrying the gRPC status code the servicer should
return (see ``geoloco.protos.errors``).

Modules (this one holds ``PROTOCOL_VERSION`` and re-exports their public names, so
``from geoloco.protos import wire; wire.X`` keeps working):

- ``wire_buffers``: sizes and limits, ``WireError`` and its subclasses, zero-copy byte views,
  checksums, chunk index ranges.
- ``wire_manifests``: ``BlobManifest`` construction and validation, ``ModelLayout``.
- ``wire_chunks``: ``ChunkRef``, the hand-written chunk messages (``MessageCodec``), send streams.
- ``wire_assembly``: ``BlobAssembler`` / ``UploadAssembler`` / ``Download`` and stream readers.
"""

from __future__ import annotations

from geoloco.protos.wire_assembly import (
    BlobAssembler,
    Download,
    UploadAssembler,
    read_broadcast_stream,
    read_model_stream,
    read_upload_manifest,
    upload_chunks,
)
from geoloco.protos.wire_buffers import (
    CRC32_RESIDUE,
    DEFAULT_CHECKSUM,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_MAX_BLOB_BYTES,
    MAX_CHUNK_SIZE,
    RAW_CODEC,
    Buffer,
    ChecksumMismatchError,
    ChunkIndexError,
    ChunkSizeError,
    GiB,
    IncompleteError,
    KiB,
    ManifestConflictError,
    ManifestError,
    ManifestTooLargeError,
    MiB,
    OversizeChunkError,
    StreamOverrunError,
    WireError,
    as_byte_view,
    checksum_hex,
    compute_checksum,
    dtype_name,
    indices_to_ranges,
    num_chunks_for,
    ranges_to_indices,
    to_index_ranges,
    verify_checksum,
)
from geoloco.protos.wire_chunks import (
    AWAIT_BROADCAST_RESPONSE_CODEC,
    FETCH_MODEL_RESPONSE_CODEC,
    UPLOAD_REQUEST_CODEC,
    ChunkRef,
    MessageCodec,
    as_messages,
    broadcast_responses,
    decode_chunk_message,
    encode_chunk_message,
    iter_chunks,
    message_nbytes,
    model_responses,
    upload_requests,
)
from geoloco.protos.wire_files import FileBlob
from geoloco.protos.wire_manifests import (
    blob_manifest,
    layout_slices,
    model_layout,
    validate_blob_manifest,
)

PROTOCOL_VERSION = 3
"""Sent in Join; bump on incompatible changes to the meaning of geoloco.proto.

2: SecureStage carries typed ``SecAgg*`` messages in oneofs instead of JSON in a ``payload``
field (now reserved), so a version-1 peer cannot take part in a secure round.
3: Blob manifests carry SHA-256 by default and a CRC-32 equal to ``CRC32_RESIDUE`` (what every
version-2 upload and delta carried) is refused, so a version-2 peer's uploads would fail.
"""

__all__ = [
    "AWAIT_BROADCAST_RESPONSE_CODEC",
    "CRC32_RESIDUE",
    "DEFAULT_CHECKSUM",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_MAX_BLOB_BYTES",
    "FETCH_MODEL_RESPONSE_CODEC",
    "MAX_CHUNK_SIZE",
    "PROTOCOL_VERSION",
    "RAW_CODEC",
    "UPLOAD_REQUEST_CODEC",
    "BlobAssembler",
    "Buffer",
    "ChecksumMismatchError",
    "ChunkIndexError",
    "ChunkRef",
    "ChunkSizeError",
    "Download",
    "FileBlob",
    "GiB",
    "IncompleteError",
    "KiB",
    "ManifestConflictError",
    "ManifestError",
    "ManifestTooLargeError",
    "MessageCodec",
    "MiB",
    "OversizeChunkError",
    "StreamOverrunError",
    "UploadAssembler",
    "WireError",
    "as_byte_view",
    "as_messages",
    "blob_manifest",
    "broadcast_responses",
    "checksum_hex",
    "compute_checksum",
    "decode_chunk_message",
    "dtype_name",
    "encode_chunk_message",
    "indices_to_ranges",
    "iter_chunks",
    "layout_slices",
    "message_nbytes",
    "model_layout",
    "model_responses",
    "num_chunks_for",
    "ranges_to_indices",
    "read_broadcast_stream",
    "read_model_stream",
    "read_upload_manifest",
    "to_index_ranges",
    "upload_chunks",
    "upload_requests",
    "validate_blob_manifest",
    "verify_checksum",
]

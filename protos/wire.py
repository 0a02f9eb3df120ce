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

Checksum. CRC-32 (``zlib.crc32``) by default: ~3.1 GB/s here against SHA-256 1.8 GB/s (with SHA
extensions), SHA-1 1.9, BLAKE2b 0.7, MD5 0.8 GB/s (256 MiB buffer, one core). Even so it is
a fifth to a quarter of the coordinator's CPU per received byte (perf), so receivers compute it
while chunks arrive (in order) instead of in a pass at the end. The checksum
guards against bugs (wrong reassembly, stale buffers, mixed-up rounds) and storage faults, not
against an attacker: mutual TLS already authenticates and integrity-protects every byte in
transit. For the replica check (every site's weights equal the coordinator's) an undetected
random mismatch has probability 2**-32 per comparison, which is acceptable; SHA-256 is available
(``CHECKSUM_ALGORITHM_SHA256``) for users who want a cryptographic digest. Both functions release
the GIL on large buffers.

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
"""

from __future__ import annotations

import hashlib
import logging
import math
import sys
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import grpc

from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.errors import StatusError

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
"""Sent in Join; bump on incompatible changes to the meaning of geoloco.proto."""

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

DEFAULT_CHUNK_SIZE = 1 * MiB
"""Bytes per chunk when sending (measured best; see the module docstring)."""

MAX_CHUNK_SIZE = 4 * MiB
"""Largest chunk a receiver accepts; ``transport``'s message limits are sized from it. A chunk
message is the chunk plus ~10 bytes of framing, so chunks up to ~4 MiB - 16 B also pass a peer
that keeps gRPC's default 4 MiB receive limit; the default chunk size always does."""

DEFAULT_MAX_BLOB_BYTES = 16 * GiB
"""Largest blob an assembler allocates unless told otherwise. Receivers that know better (the
coordinator knows the model size) should pass a tighter ``max_total_bytes``."""

DEFAULT_CHECKSUM = pb.CHECKSUM_ALGORITHM_CRC32

RAW_CODEC = "none"
"""Codec name of uncompressed bytes, e.g. the fp32 weights in FetchModel."""

_DIGEST_SIZES = {pb.CHECKSUM_ALGORITHM_CRC32: 4, pb.CHECKSUM_ALGORITHM_SHA256: 32}

Buffer = Any
"""bytes, bytearray, memoryview, a C-contiguous NumPy array or a contiguous CPU torch tensor."""


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


class WireError(StatusError):
    """A chunk stream or manifest that violates the protocol."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ManifestError(WireError):
    """Malformed manifest, or a stream that does not start with exactly one manifest."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = pb.ERROR_REASON_BAD_MANIFEST


class ManifestTooLargeError(ManifestError):
    """The manifest announces more bytes, or larger chunks, than the receiver accepts."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ManifestConflictError(WireError):
    """A resumed upload sent a manifest that differs from the stored one."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = pb.ERROR_REASON_MANIFEST_CONFLICT


class ChunkIndexError(WireError):
    """A chunk index at or past the manifest's num_chunks."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = pb.ERROR_REASON_CHUNK_OUT_OF_BOUNDS


class ChunkSizeError(WireError):
    """A chunk shorter than its slot (every chunk but the last is exactly chunk_size)."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = pb.ERROR_REASON_CHUNK_OUT_OF_BOUNDS


class OversizeChunkError(ChunkSizeError):
    """A chunk longer than its slot: it would write past the manifest's total size."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class StreamOverrunError(WireError):
    """One stream carried more chunk bytes than the whole blob holds (a looping sender)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = pb.ERROR_REASON_CHUNK_OUT_OF_BOUNDS


class IncompleteError(WireError):
    """Reassembly finished while chunks are missing; ``missing`` lists them as ranges."""

    code = grpc.StatusCode.DATA_LOSS

    def __init__(self, message: str, missing: list[tuple[int, int]]) -> None:
        super().__init__(message)
        self.missing = missing


class ChecksumMismatchError(WireError):
    """The reassembled bytes do not match the manifest's checksum."""

    code = grpc.StatusCode.DATA_LOSS
    reason = pb.ERROR_REASON_CHECKSUM_MISMATCH


# ---------------------------------------------------------------------------------------------
# Buffers, checksums, ranges
# ---------------------------------------------------------------------------------------------


def as_byte_view(data: Buffer, *, writable: bool = False) -> memoryview:
    """A flat ``uint8`` memoryview of ``data`` without copying.

    Torch tensors are viewed through NumPy (CPU, contiguous only); other objects must support the
    buffer protocol and be C-contiguous.
    """
    if isinstance(data, memoryview):
        view = data
    elif isinstance(data, (bytes, bytearray)):
        view = memoryview(data)
    else:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(data, torch.Tensor):
            tensor = data.detach()
            if tensor.device.type != "cpu":
                raise ValueError(
                    f"tensor is on {tensor.device}; wire buffers are host memory, call .cpu() first"
                )
            if not tensor.is_contiguous():
                raise ValueError("tensor is not contiguous; call .contiguous() first")
            tensor = tensor.reshape(-1)
            if tensor.dtype != torch.uint8:
                tensor = tensor.view(torch.uint8)
            view = memoryview(tensor.numpy())
        else:
            try:
                view = memoryview(data)
            except TypeError:
                raise TypeError(
                    "expected bytes, bytearray, memoryview, a NumPy array or a CPU torch tensor, "
                    f"got {type(data).__name__}"
                ) from None
    if not view.c_contiguous:
        raise ValueError("buffer is not C-contiguous; make a contiguous copy first")
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    if writable and view.readonly:
        raise ValueError(f"buffer of type {type(data).__name__} is read-only; pass a writable one")
    return view


def compute_checksum(data: Buffer, algorithm: int = DEFAULT_CHECKSUM) -> pb.Checksum:
    """Checksum of ``data``'s bytes (CRC-32 digest as 4 big-endian bytes, or SHA-256)."""
    view = as_byte_view(data)
    if algorithm == pb.CHECKSUM_ALGORITHM_CRC32:
        digest = zlib.crc32(view).to_bytes(4, "big")
    elif algorithm == pb.CHECKSUM_ALGORITHM_SHA256:
        digest = hashlib.sha256(view).digest()
    else:
        raise ValueError(
            f"unknown checksum algorithm {algorithm}; use one of "
            f"{[pb.ChecksumAlgorithm.Name(a) for a in _DIGEST_SIZES]}"
        )
    return pb.Checksum(algorithm=algorithm, digest=digest)


def checksum_hex(checksum: pb.Checksum) -> str:
    """``crc32:1a2b3c4d`` for logs."""
    name = pb.ChecksumAlgorithm.Name(checksum.algorithm).removeprefix("CHECKSUM_ALGORITHM_")
    return f"{name.lower()}:{checksum.digest.hex()}"


def verify_checksum(data: Buffer, expected: pb.Checksum) -> None:
    """Raise ``ChecksumMismatchError`` unless ``data`` has checksum ``expected``."""
    actual = compute_checksum(data, expected.algorithm)
    if actual.digest != expected.digest:
        raise ChecksumMismatchError(
            f"checksum mismatch: expected {checksum_hex(expected)}, got {checksum_hex(actual)}; "
            "every chunk must be sent again"
        )


def num_chunks_for(total_bytes: int, chunk_size: int) -> int:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return -(-total_bytes // chunk_size)


def indices_to_ranges(indices: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted, merged half-open ranges covering ``indices``: [0, 1, 2, 5] -> [(0, 3), (5, 6)]."""
    ranges: list[tuple[int, int]] = []
    for i in sorted(set(indices)):
        if ranges and ranges[-1][1] == i:
            ranges[-1] = (ranges[-1][0], i + 1)
        else:
            ranges.append((i, i + 1))
    return ranges


def ranges_to_indices(ranges: Iterable[tuple[int, int] | pb.IndexRange]) -> list[int]:
    out: list[int] = []
    for r in ranges:
        start, end = (r.start, r.end) if isinstance(r, pb.IndexRange) else r
        out.extend(range(start, end))
    return out


def to_index_ranges(ranges: Iterable[tuple[int, int]]) -> list[pb.IndexRange]:
    return [pb.IndexRange(start=s, end=e) for s, e in ranges]


def _flag_ranges(flags: bytes | bytearray, value: int) -> list[tuple[int, int]]:
    """Runs of ``value`` (0 or 1) in a flag array; bytes.find keeps this fast for 1e5+ chunks."""
    want, other = bytes([value]), bytes([1 - value])
    ranges = []
    pos, n = 0, len(flags)
    while pos < n:
        start = flags.find(want, pos)
        if start < 0:
            break
        end = flags.find(other, start)
        end = n if end < 0 else end
        ranges.append((start, end))
        pos = end
    return ranges


def dtype_name(dtype: object) -> str:
    """``torch.float32`` / ``numpy.float32`` / ``"float32"`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# Manifests and layouts
# ---------------------------------------------------------------------------------------------


def blob_manifest(
    data: Buffer,
    *,
    codec: str = RAW_CODEC,
    shape: Sequence[int] = (),
    dtype: object = "uint8",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    checksum_algorithm: int = DEFAULT_CHECKSUM,
) -> pb.BlobManifest:
    """Describe ``data`` for streaming: size, chunking, checksum, and what the bytes encode."""
    if not 0 < chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be in 1..{MAX_CHUNK_SIZE} bytes, got {chunk_size}")
    view = as_byte_view(data)
    return pb.BlobManifest(
        total_bytes=len(view),
        chunk_size=chunk_size,
        num_chunks=num_chunks_for(len(view), chunk_size),
        checksum=compute_checksum(view, checksum_algorithm),
        codec=codec,
        shape=list(shape),
        dtype=dtype_name(dtype),
    )


def validate_blob_manifest(
    manifest: pb.BlobManifest,
    *,
    max_total_bytes: int = DEFAULT_MAX_BLOB_BYTES,
    max_chunk_size: int = MAX_CHUNK_SIZE,
) -> None:
    """Raise ``ManifestError`` (or ``ManifestTooLargeError``) unless the manifest is usable."""
    if manifest.chunk_size == 0:
        raise ManifestError("manifest chunk_size is 0; it must be at least 1 byte")
    if manifest.chunk_size > max_chunk_size:
        raise ManifestTooLargeError(
            f"manifest chunk_size {manifest.chunk_size} exceeds the limit of {max_chunk_size} "
            "bytes; send smaller chunks"
        )
    if manifest.total_bytes > max_total_bytes:
        raise ManifestTooLargeError(
            f"manifest announces {manifest.total_bytes} bytes, more than the {max_total_bytes} "
            "this receiver accepts"
        )
    expected = num_chunks_for(manifest.total_bytes, manifest.chunk_size)
    if manifest.num_chunks != expected:
        raise ManifestError(
            f"manifest num_chunks is {manifest.num_chunks} but {manifest.total_bytes} bytes in "
            f"chunks of {manifest.chunk_size} make {expected}"
        )
    algorithm = manifest.checksum.algorithm
    if algorithm not in _DIGEST_SIZES:
        raise ManifestError(
            f"manifest checksum algorithm {algorithm} is not supported; use one of "
            f"{[pb.ChecksumAlgorithm.Name(a) for a in _DIGEST_SIZES]}"
        )
    if len(manifest.checksum.digest) != _DIGEST_SIZES[algorithm]:
        raise ManifestError(
            f"manifest {pb.ChecksumAlgorithm.Name(algorithm)} digest has "
            f"{len(manifest.checksum.digest)} bytes, expected {_DIGEST_SIZES[algorithm]}"
        )


def model_layout(
    named_shapes: Iterable[tuple[str, Sequence[int]]], *, dtype: object = "float32"
) -> pb.ModelLayout:
    """Layout of the flat weight vector: parameters back to back in the given order.

    ``named_shapes`` is e.g. ``((n, p.shape) for n, p in model.named_parameters())``.
    """
    layout = pb.ModelLayout(dtype=dtype_name(dtype))
    offset = 0
    seen: set[str] = set()
    for name, shape in named_shapes:
        if name in seen:
            raise ValueError(f"parameter name {name!r} appears twice in the layout")
        seen.add(name)
        dims = [int(d) for d in shape]
        if any(d < 0 for d in dims):
            raise ValueError(f"parameter {name!r} has a negative dimension in shape {dims}")
        numel = math.prod(dims)
        layout.tensors.add(name=name, shape=dims, offset=offset, numel=numel)
        offset += numel
    layout.numel = offset
    return layout


def layout_slices(layout: pb.ModelLayout) -> dict[str, tuple[slice, tuple[int, ...]]]:
    """name -> (element slice into the flat vector, shape), checked for gaps and overlaps."""
    out: dict[str, tuple[slice, tuple[int, ...]]] = {}
    expected_offset = 0
    for t in layout.tensors:
        if t.offset != expected_offset or t.numel != math.prod(t.shape):
            raise ManifestError(
                f"layout entry {t.name!r} (offset {t.offset}, numel {t.numel}, shape "
                f"{list(t.shape)}) does not follow the previous entry at offset {expected_offset}"
            )
        out[t.name] = (slice(t.offset, t.offset + t.numel), tuple(t.shape))
        expected_offset += t.numel
    if expected_offset != layout.numel:
        raise ManifestError(
            f"layout entries hold {expected_offset} elements but numel says {layout.numel}"
        )
    return out


# ---------------------------------------------------------------------------------------------
# Chunks without protobuf copies
# ---------------------------------------------------------------------------------------------


class ChunkRef:
    """A chunk as the fast path carries it: an index and a zero-copy view of its bytes.

    It quacks like the protobuf ``Chunk`` (``.index``, ``.data``) and like the message that
    wraps one (``WhichOneof("kind") == "chunk"``, ``.chunk``), so receiving code handles
    ``ChunkRef`` and protobuf messages alike. It is what the senders below yield and what the
    ``MessageCodec`` deserializers return for chunk messages. ``.data`` is a memoryview: use
    ``len()``, slicing and buffer copies, not ``bytes`` methods.

    Why: protobuf's Python runtimes copy a bytes field when a message is built, again when it is
    serialized, and twice more when it is parsed and read; for a stream of 1 MiB chunks those
    copies (and the page faults of fresh buffers) cost more than the network itself. A
    ``MessageCodec`` writes and reads the one wrapping field by hand (a few header bytes) and
    copies the payload once per side.
    """

    __slots__ = ("index", "data")

    def __init__(self, index: int, data: bytes | memoryview) -> None:
        self.index = index
        self.data = data

    def WhichOneof(self, oneof_group: str) -> str:  # noqa: N802 - protobuf's method name
        return "chunk"

    @property
    def chunk(self) -> ChunkRef:
        return self

    def to_proto(self) -> pb.Chunk:
        return pb.Chunk(index=self.index, data=bytes(self.data))

    def __repr__(self) -> str:
        return f"ChunkRef(index={self.index}, {len(self.data)} bytes)"


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """(value, next position); raises IndexError/ValueError on truncated or overlong input."""
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


_CHUNK_INDEX_TAG = b"\x08"  # Chunk.index: field 1, varint
_CHUNK_DATA_TAG = b"\x12"  # Chunk.data: field 2, length-delimited


def encode_chunk_message(field_number: int, index: int, data: bytes | memoryview) -> bytes:
    """Serialize ``Outer{<field_number>: Chunk{index, data}}`` exactly as protobuf does (proto3:
    zero / empty fields omitted), copying ``data`` once."""
    inner_head = b""
    if index:
        inner_head += _CHUNK_INDEX_TAG + _varint(index)
    if len(data):
        inner_head += _CHUNK_DATA_TAG + _varint(len(data))
    inner_len = len(inner_head) + len(data)
    head = _varint((field_number << 3) | 2) + _varint(inner_len) + inner_head
    return b"".join((head, data))


def _varint_size(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def message_nbytes(message: Any) -> int:
    """Serialized size of a stream message, for byte accounting without serializing it.

    ``ByteSize()`` for protobuf messages; for a zero-copy ``ChunkRef`` exactly what
    ``encode_chunk_message`` writes for the message that wraps it (the same bytes protobuf
    would: proto3 omits a zero index and empty data). Every chunk-carrying message
    (``UploadRequest``, ``FetchModelResponse``, ``AwaitBroadcastResponse``) holds its chunk in a
    field numbered below 16, whose tag is one byte.
    """
    if isinstance(message, ChunkRef):
        size = len(message.data)
        inner = (1 + _varint_size(message.index) if message.index else 0) + (
            1 + _varint_size(size) + size if size else 0
        )
        return 1 + _varint_size(inner) + inner
    return int(message.ByteSize())


def decode_chunk_message(buf: bytes, field_number: int) -> ChunkRef | None:
    """The ``ChunkRef`` in a serialized ``Outer{<field_number>: Chunk{...}}`` (a view into
    ``buf``, no copy), or None when ``buf`` is anything else -- another oneof member, unknown
    fields, an unusual but valid encoding -- for the caller to parse with protobuf."""
    end = len(buf)
    try:
        tag, pos = _read_varint(buf, 0, end)
        if tag != (field_number << 3) | 2:
            return None
        inner_len, pos = _read_varint(buf, pos, end)
        if pos + inner_len != end:
            return None
        index, data = 0, b""
        seen_index = seen_data = False
        while pos < end:
            tag, pos = _read_varint(buf, pos, end)
            if tag == 0x08 and not seen_index:
                index, pos = _read_varint(buf, pos, end)
                seen_index = True
            elif tag == 0x12 and not seen_data:
                size, pos = _read_varint(buf, pos, end)
                if pos + size > end:
                    return None
                data = memoryview(buf)[pos : pos + size]
                pos += size
                seen_data = True
            else:
                return None
        if index > 0xFFFFFFFF:
            return None
        return ChunkRef(index, data)
    except (ValueError, IndexError):
        return None


class MessageCodec:
    """gRPC serializer/deserializer for a message type with a ``chunk`` oneof member:
    ``ChunkRef`` goes through the hand-written fast path, everything else through protobuf.
    The bytes on the wire are the same either way, so peers need not use it."""

    def __init__(self, message_type: type, chunk_field: str = "chunk") -> None:
        self.message_type = message_type
        self.field_number = message_type.DESCRIPTOR.fields_by_name[chunk_field].number

    def serialize(self, message: Any) -> bytes:
        if type(message) is ChunkRef:
            return encode_chunk_message(self.field_number, message.index, message.data)
        return message.SerializeToString()

    def deserialize(self, buf: bytes) -> Any:
        chunk = decode_chunk_message(buf, self.field_number)
        return chunk if chunk is not None else self.message_type.FromString(buf)


UPLOAD_REQUEST_CODEC = MessageCodec(pb.UploadRequest)
FETCH_MODEL_RESPONSE_CODEC = MessageCodec(pb.FetchModelResponse)
AWAIT_BROADCAST_RESPONSE_CODEC = MessageCodec(pb.AwaitBroadcastResponse)


def as_messages(stream: Iterable[Any], message_type: type) -> Iterator[Any]:
    """Turn the ``ChunkRef`` items of a sender's stream into ``message_type(chunk=...)``, for
    stubs or servers that use protobuf's own serializers (the plain generated code)."""
    for item in stream:
        yield message_type(chunk=item.to_proto()) if type(item) is ChunkRef else item


# ---------------------------------------------------------------------------------------------
# Sending
# ---------------------------------------------------------------------------------------------


def iter_chunks(
    data: Buffer,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    start: int = 0,
    indices: Iterable[int] | None = None,
) -> Iterator[ChunkRef]:
    """``ChunkRef``s viewing ``data`` (no copy): all from index ``start``, or just ``indices``.

    The bytes are read when gRPC serializes each chunk, i.e. while the stream is being sent:
    ``data`` must not change until the stream is done (serve a snapshot, not a tensor that the
    next outer step updates in place).
    """
    view = as_byte_view(data)
    count = num_chunks_for(len(view), chunk_size)
    wanted: Iterable[int] = range(start, count) if indices is None else indices
    for index in wanted:
        if not 0 <= index < count:
            raise ValueError(f"chunk index {index} out of range 0..{count - 1}")
        offset = index * chunk_size
        yield ChunkRef(index, view[offset : offset + chunk_size])


def upload_requests(
    manifest: pb.UploadManifest,
    data: Buffer,
    *,
    missing: Iterable[tuple[int, int] | pb.IndexRange] | None = None,
) -> Iterator[pb.UploadRequest | ChunkRef]:
    """An Upload stream: the manifest, then every chunk (or only the ``missing`` ranges).

    Send it through ``transport.coordinator_stub`` (or wrap it in ``as_messages``)."""
    blob = manifest.blob
    view = as_byte_view(data)
    if len(view) != blob.total_bytes:
        raise ValueError(
            f"buffer has {len(view)} bytes but the manifest announces {blob.total_bytes}"
        )
    indices = None if missing is None else ranges_to_indices(missing)
    yield pb.UploadRequest(manifest=manifest)
    yield from iter_chunks(view, blob.chunk_size, indices=indices)


def model_responses(
    manifest: pb.ModelManifest, data: Buffer
) -> Iterator[pb.FetchModelResponse | ChunkRef]:
    """A FetchModel stream: the manifest, then chunks from ``manifest.start_chunk`` on.

    ``data`` must stay unchanged while the stream runs (see ``iter_chunks``)."""
    view = as_byte_view(data)
    if len(view) != manifest.blob.total_bytes:
        raise ValueError(
            f"buffer has {len(view)} bytes but the manifest announces {manifest.blob.total_bytes}"
        )
    yield pb.FetchModelResponse(manifest=manifest)
    yield from iter_chunks(view, manifest.blob.chunk_size, start=manifest.start_chunk)


def broadcast_responses(
    header: pb.BroadcastHeader, delta: Buffer | None
) -> Iterator[pb.AwaitBroadcastResponse | ChunkRef]:
    """An AwaitBroadcast answer: the header, then (APPLY_DELTA) the delta's chunks."""
    yield pb.AwaitBroadcastResponse(header=header)
    if header.action != pb.BROADCAST_ACTION_APPLY_DELTA:
        return
    if delta is None:
        raise ValueError("an APPLY_DELTA broadcast needs the encoded delta's bytes")
    view = as_byte_view(delta)
    if len(view) != header.delta.total_bytes:
        raise ValueError(
            f"delta has {len(view)} bytes but the header announces {header.delta.total_bytes}"
        )
    yield from iter_chunks(view, header.delta.chunk_size, start=header.start_chunk)


# ---------------------------------------------------------------------------------------------
# Receiving
# ---------------------------------------------------------------------------------------------


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


class BlobAssembler:
    """Reassembles one blob from chunks arriving in any order, any number of times.

    Thread-safe: two streams for the same blob (a broken one the server has not noticed yet and
    its resumption) may feed it concurrently.
    """

    def __init__(
        self,
        manifest: pb.BlobManifest,
        *,
        max_total_bytes: int = DEFAULT_MAX_BLOB_BYTES,
        max_chunk_size: int = MAX_CHUNK_SIZE,
        out: Buffer | None = None,
    ) -> None:
        """``out``: where to write (e.g. the uint8 view of a weight tensor), exactly
        ``manifest.total_bytes`` long; a new bytearray when None."""
        validate_blob_manifest(
            manifest, max_total_bytes=max_total_bytes, max_chunk_size=max_chunk_size
        )
        self.manifest = pb.BlobManifest()
        self.manifest.CopyFrom(manifest)
        total = manifest.total_bytes
        if out is None:
            self._view = memoryview(bytearray(total))
        else:
            self._view = as_byte_view(out, writable=True)
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
        self._digest = _RunningDigest(manifest.checksum.algorithm)
        self._hashed = 0  # chunks [0, _hashed) are in the running digest
        self._lock = threading.Lock()

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
            return _flag_ranges(self._flags, 0)

    def received(self) -> list[tuple[int, int]]:
        with self._lock:
            return _flag_ranges(self._flags, 1)

    def first_missing(self) -> int | None:
        """Lowest missing index (where an in-order download resumes), None when complete."""
        with self._lock:
            index = self._flags.find(b"\x00")
        return None if index < 0 else index

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
            while self._hashed < self._num_chunks and self._flags[self._hashed]:
                start = self._hashed * self._chunk_size
                self._digest.update(self._view[start : start + self.slot_size(self._hashed)])
                self._hashed += 1
            return True

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
        with self._lock:
            if self._verified:
                return self._view
            if self._received_count != self._num_chunks:
                missing = _flag_ranges(self._flags, 0)
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


class UploadAssembler(BlobAssembler):
    """Coordinator-side state of one (site, round, fragment) upload, kept across streams.

    The coordinator keys its assemblers by (site, round, fragment) with the site name from
    ``transport.resolve_site`` (the certificate's name with TLS), not by the manifest's field.
    """

    def __init__(
        self,
        manifest: pb.UploadManifest,
        *,
        max_total_bytes: int = DEFAULT_MAX_BLOB_BYTES,
        max_chunk_size: int = MAX_CHUNK_SIZE,
        out: Buffer | None = None,
    ) -> None:
        super().__init__(
            manifest.blob, max_total_bytes=max_total_bytes, max_chunk_size=max_chunk_size, out=out
        )
        self.upload = pb.UploadManifest()
        self.upload.CopyFrom(manifest)

    def check_same_manifest(self, manifest: pb.UploadManifest) -> None:
        """A resumed upload must resend the identical manifest (same bytes, same checksum)."""
        if manifest != self.upload:
            raise ManifestConflictError(
                f"upload for site {self.upload.site!r} round {self.upload.round} fragment "
                f"{self.upload.fragment} already has a different manifest (stored checksum "
                f"{checksum_hex(self.upload.blob.checksum)}, sent "
                f"{checksum_hex(manifest.blob.checksum)}); resend the stored update or ask "
                "UploadStatus for the stored manifest"
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


def read_upload_manifest(requests: Iterator[pb.UploadRequest | ChunkRef]) -> pb.UploadManifest:
    """The first message of an Upload stream, which must be a manifest."""
    first = next(requests, None)
    if first is None:
        raise ManifestError("empty Upload stream: the first message must be a manifest")
    if first.WhichOneof("kind") != "manifest":
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
    ) -> None:
        """``out_factory(manifest)`` returns the buffer to write into, or None for a new
        bytearray. Writing straight into the live weights saves a copy, but a failed download
        then leaves them garbled: only do that when failure means a full resync anyway."""
        self.max_total_bytes = max_total_bytes
        self.out_factory = out_factory
        self.assembler: BlobAssembler | None = None

    def resume_point(self) -> tuple[int, pb.Checksum | None]:
        """(start_chunk, expect_digest) for the next request."""
        if self.assembler is None:
            return 0, None
        first = self.assembler.first_missing()
        start = self.assembler.num_chunks if first is None else first
        return start, self.assembler.manifest.checksum

    def start(self, blob: pb.BlobManifest, start_chunk: int) -> BlobAssembler:
        """A manifest arrived; keep the partial download if it is the same blob."""
        if self.assembler is not None and self.assembler.manifest == blob:
            return self.assembler
        if start_chunk != 0:
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

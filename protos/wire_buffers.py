"""Byte buffers on the wire: sizes, zero-copy byte views, checksums, chunk index ranges, wire errors.

Everything big that geoloco sends -- the flat fp32 global weights (FetchModel), an encoded
pseudo-gradient (Upload), an encoded downlink delta (AwaitBroadcast) -- is one byte buffer,
described by a ``BlobManifest`` and streamed as ``Chunk`` messages. The wire modules know nothing
about codecs: they move ``bytes`` / ``bytearray`` / ``memoryview`` / NumPy arrays / CPU torch tensors
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

The vocabulary every other wire module uses: ``wire_manifests`` describes buffers,
``wire_chunks`` sends them, ``wire_assembly`` receives them. Violations raise ``WireError``
subclasses, each carrying the gRPC status code the servicer should return (see
``geoloco.protos.errors``).
"""

from __future__ import annotations

import hashlib
import sys
import zlib
from collections.abc import Iterable
from typing import Any

import grpc

from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.errors import StatusError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

DEFAULT_CHUNK_SIZE = 1 * MiB
"""Bytes per chunk when sending (measured best; see this module's docstring)."""

MAX_CHUNK_SIZE = 4 * MiB
"""Largest chunk a receiver accepts; the message limits of ``transport_options`` are sized from it.
A chunk message is the chunk plus ~10 bytes of framing, so chunks up to ~4 MiB - 16 B also pass a
peer that keeps gRPC's default 4 MiB receive limit; the default chunk size always does."""

DEFAULT_MAX_BLOB_BYTES = 16 * GiB
"""Largest blob an assembler allocates unless told otherwise. Receivers that know better (the
coordinator knows the model size) should pass a tighter ``max_total_bytes``."""

DEFAULT_CHECKSUM = pb.CHECKSUM_ALGORITHM_SHA256
"""SHA-256: a checksum must tell two buffers of the same size apart (an upload resumes, or is
refused as MANIFEST_CONFLICT, by comparing manifests). CRC-32 cannot for the buffers geoloco
streams: every encoded update and delta ends with its own CRC-32 (``compression.encoded``), and
the CRC-32 of any buffer that ends with its own CRC-32 is the same constant, ``CRC32_RESIDUE``."""

CRC32_RESIDUE = bytes.fromhex("2144df1c")
"""The CRC-32 digest (big-endian) of every buffer that ends with its own little-endian CRC-32."""

RAW_CODEC = "none"
"""Codec name of uncompressed bytes, e.g. the fp32 weights in FetchModel."""

DIGEST_SIZES = {pb.CHECKSUM_ALGORITHM_CRC32: 4, pb.CHECKSUM_ALGORITHM_SHA256: 32}
"""Digest length in bytes of each checksum algorithm."""

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

    def __reduce__(self) -> tuple[type[IncompleteError], tuple[str, list[tuple[int, int]]]]:
        return type(self), (str(self), self.missing)


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


def compute_checksum(data: Buffer, algorithm: pb.ChecksumAlgorithm = DEFAULT_CHECKSUM) -> pb.Checksum:
    """Checksum of ``data``'s bytes (CRC-32 digest as 4 big-endian bytes, or SHA-256)."""
    view = as_byte_view(data)
    if algorithm == pb.CHECKSUM_ALGORITHM_CRC32:
        digest = zlib.crc32(view).to_bytes(4, "big")
    elif algorithm == pb.CHECKSUM_ALGORITHM_SHA256:
        digest = hashlib.sha256(view).digest()
    else:
        raise ValueError(
            f"unknown checksum algorithm {algorithm}; use one of "
            f"{[pb.ChecksumAlgorithm.Name(a) for a in DIGEST_SIZES]}"
        )
    return pb.Checksum(algorithm=algorithm, digest=digest)


def checksum_hex(checksum: pb.Checksum) -> str:
    """``crc32:1a2b3c4d`` for logs."""
    name = pb.ChecksumAlgorithm.Name(checksum.algorithm).removeprefix("CHECKSUM_ALGORITHM_")
    return f"{name.lower()}:{checksum.digest.hex()}"


def num_chunks_for(total_bytes: int, chunk_size: int) -> int:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return -(-total_bytes // chunk_size)


def ranges_to_indices(ranges: Iterable[tuple[int, int] | pb.IndexRange]) -> list[int]:
    out: list[int] = []
    for r in ranges:
        start, end = (r.start, r.end) if isinstance(r, pb.IndexRange) else r
        out.extend(range(start, end))
    return out


def to_index_ranges(ranges: Iterable[tuple[int, int]]) -> list[pb.IndexRange]:
    return [pb.IndexRange(start=s, end=e) for s, e in ranges]


def flag_ranges(flags: bytes | bytearray, value: int) -> list[tuple[int, int]]:
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

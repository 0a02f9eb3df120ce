"""Manifests and layouts: describing a buffer (``BlobManifest``) and the flat weights (``ModelLayout``).

``blob_manifest`` describes a buffer about to be sent, ``validate_blob_manifest`` checks one a
peer sent before anything is allocated, ``model_layout`` / ``layout_slices`` map parameter names
onto the flat fp32 vector.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.wire_buffers import (
    CRC32_RESIDUE,
    DEFAULT_CHECKSUM,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_MAX_BLOB_BYTES,
    DIGEST_SIZES,
    MAX_CHUNK_SIZE,
    RAW_CODEC,
    Buffer,
    ManifestError,
    ManifestTooLargeError,
    as_byte_view,
    compute_checksum,
    dtype_name,
    num_chunks_for,
)
from geoloco.protos.wire_files import RangeBlob


def blob_manifest(
    data: Buffer,
    *,
    codec: str = RAW_CODEC,
    shape: Sequence[int] = (),
    dtype: object = "uint8",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    checksum_algorithm: pb.ChecksumAlgorithm = DEFAULT_CHECKSUM,
    digest: bytes | None = None,
) -> pb.BlobManifest:
    """Describe ``data`` for streaming: size, chunking, checksum, and what the bytes encode.

    The checksum identifies the bytes (SHA-256 by default): receivers resume, or refuse as a
    conflict, by comparing manifests. CRC-32 is refused for a buffer that ends with its own CRC-32
    (an encoded update), whose CRC-32 is the same for every such buffer. ``digest``: the
    ``checksum_algorithm`` digest of ``data``, already computed (a pass over the bytes saved).
    ``data`` may be a ``RangeBlob`` (read block by block for its SHA-256).
    """
    if not 0 < chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be in 1..{MAX_CHUNK_SIZE} bytes, got {chunk_size}")
    if isinstance(data, RangeBlob):
        if digest is None and checksum_algorithm == pb.CHECKSUM_ALGORITHM_SHA256:
            digest = data.sha256()
        view: Buffer = data if digest is not None else data.to_bytes()
    else:
        view = as_byte_view(data)
    checksum = (
        compute_checksum(view, checksum_algorithm)
        if digest is None
        else pb.Checksum(algorithm=checksum_algorithm, digest=digest)
    )
    if _ambiguous(checksum):
        raise ValueError(_AMBIGUOUS_CRC)
    return pb.BlobManifest(
        total_bytes=len(view),
        chunk_size=chunk_size,
        num_chunks=num_chunks_for(len(view), chunk_size),
        checksum=checksum,
        codec=codec,
        shape=list(shape),
        dtype=dtype_name(dtype),
    )


_AMBIGUOUS_CRC = (
    f"CRC-32 {CRC32_RESIDUE.hex()} is the CRC-32 of every buffer that ends with its own CRC-32 (as "
    "every encoded update does), so it cannot tell two such buffers apart; use "
    "CHECKSUM_ALGORITHM_SHA256 (the default)"
)


def _ambiguous(checksum: pb.Checksum) -> bool:
    return checksum.algorithm == pb.CHECKSUM_ALGORITHM_CRC32 and checksum.digest == CRC32_RESIDUE


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
    if algorithm not in DIGEST_SIZES:
        raise ManifestError(
            f"manifest checksum algorithm {algorithm} is not supported; use one of "
            f"{[pb.ChecksumAlgorithm.Name(a) for a in DIGEST_SIZES]}"
        )
    if len(manifest.checksum.digest) != DIGEST_SIZES[algorithm]:
        raise ManifestError(
            f"manifest {pb.ChecksumAlgorithm.Name(algorithm)} digest has "
            f"{len(manifest.checksum.digest)} bytes, expected {DIGEST_SIZES[algorithm]}"
        )
    if _ambiguous(manifest.checksum):
        raise ManifestError(f"manifest {_AMBIGUOUS_CRC}")


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

"""The self-describing result of encoding a tensor, and its wire format.

An :class:`Encoded` carries everything a receiver needs: the canonical codec spec that produced it,
the original shape and dtype, and one flat ``uint8`` payload. The payload may live on a GPU;
only :meth:`Encoded.to_bytes` moves it to host memory, so the bytes that leave a machine are
exactly the compressed ones.

Wire format (all integers little-endian)::

    offset  size      field
    0       4         magic  b"GLCE"
    4       1         format version (1)
    5       1         dtype code (1 float32, 2 float16, 3 bfloat16, 4 float64)
    6       1         ndim
    7       2         spec length L (uint16)
    9       L         spec, ASCII
    9+L     8*ndim    shape (uint64 each)
    ...     8         payload length P (uint64)
    ...     P         payload
    ...     4         CRC32 (zlib.crc32) of every preceding byte

so ``nbytes == 21 + L + 8 * ndim + P``. The CRC covers the header too: a flipped bit in the
shape or spec is caught as surely as one in the payload.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Final

import torch

MAGIC: Final = b"GLCE"
FORMAT_VERSION: Final = 1

_PREFIX = struct.Struct("<4sBBBH")  # magic, version, dtype code, ndim, spec length
_U64 = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_MAX_NDIM: Final = 64

HEADER_FIXED_NBYTES: Final = _PREFIX.size + _U64.size + _CRC.size
"""Bytes of every serialized :class:`Encoded` besides spec, shape and payload (21)."""

DTYPE_CODES: Final[dict[torch.dtype, int]] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
}
"""Floating-point dtypes a codec accepts, with their one-byte wire code."""

_CODE_DTYPES: Final = {code: dtype for dtype, code in DTYPE_CODES.items()}


class CodecError(ValueError):
    """Encoded data cannot be decoded: truncated, corrupted, or produced by another codec.

    A subclass of :class:`ValueError` so callers that treat all bad input alike can, while the
    transport layer can tell "the bytes are broken" (retry the transfer) from "the request is
    wrong" (a bug).
    """


@dataclass(frozen=True, eq=False)
class Encoded:
    """A compressed tensor: codec spec, original shape and dtype, and a flat ``uint8`` payload."""

    spec: str
    """Canonical spec of the codec that produced this, e.g. ``"topk:0.01,chunk=4096|int4:block=256"``."""
    shape: tuple[int, ...]
    """Shape of the original tensor; decoding restores it."""
    dtype: torch.dtype
    """dtype of the original tensor; decoding returns this dtype."""
    payload: torch.Tensor
    """1-D ``uint8`` tensor, on any device, holding everything the codec needs to decode."""

    def __post_init__(self) -> None:
        if not isinstance(self.spec, str) or not self.spec.isascii() or not self.spec:
            raise ValueError(f"Encoded.spec must be a non-empty ASCII codec spec, got {self.spec!r}")
        if len(self.spec) > 0xFFFF:
            raise ValueError(f"Encoded.spec is {len(self.spec)} characters; at most 65535 fit the header")
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape) or len(shape) > _MAX_NDIM:
            raise ValueError(f"Encoded.shape must be at most {_MAX_NDIM} non-negative sizes, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        if self.dtype not in DTYPE_CODES:
            raise ValueError(
                f"Encoded.dtype {self.dtype} is not supported; use one of {', '.join(map(str, DTYPE_CODES))}"
            )
        if not isinstance(self.payload, torch.Tensor) or self.payload.dtype != torch.uint8 or self.payload.dim() != 1:
            raise ValueError("Encoded.payload must be a 1-D torch.uint8 tensor")

    @property
    def numel(self) -> int:
        """Number of elements of the original tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Exactly ``len(self.to_bytes())``, computed without serializing."""
        return HEADER_FIXED_NBYTES + len(self.spec) + _U64.size * len(self.shape) + self.payload.numel()

    def _header(self) -> bytes:
        return wire_header(self.spec, self.shape, self.dtype, self.payload.numel())

    def to_bytes(self) -> bytes:
        """Serialize to the wire format described in the module docstring (moves the payload to host)."""
        return b"".join(self.wire_parts())

    def wire_parts(self) -> tuple[bytes, memoryview, bytes]:
        """(header, payload, CRC-32 trailer): what ``to_bytes`` joins, for writers that stream
        them (a model-sized delta written to a file needs no second copy in memory). The
        payload is a view of the host payload, not a copy."""
        header = self._header()
        payload = memoryview(self.payload.detach().to("cpu").contiguous().numpy())  # type: ignore[arg-type]
        crc = zlib.crc32(payload, zlib.crc32(header))
        return header, payload.cast("B"), _CRC.pack(crc)

    @classmethod
    def from_bytes(
        cls, data: bytes | bytearray | memoryview, *, copy: bool = True, check_crc: bool = True
    ) -> Encoded:
        """Parse :meth:`to_bytes` output; the payload lands on the CPU.

        ``check_crc=False`` skips the CRC-32 pass (the header is still parsed and checked) for
        bytes a stronger checksum of the very same bytes already verified, such as a transfer's
        SHA-256: one pass over every byte fewer, the same protection against corruption.

        ``copy=False``: the payload is a view of ``data`` when ``data`` is writable (a received
        upload or broadcast buffer), saving a copy of every payload byte; the caller keeps
        ``data`` alive and unchanged while the result is used (e.g. until it is decoded).

        Raises :class:`CodecError` when the data is truncated, has trailing bytes, a wrong magic,
        an unknown version or dtype, or a CRC mismatch. It checks the container only; whether the
        payload fits the spec is checked by decoding.
        """
        view = memoryview(data).cast("B")
        total = len(view)
        spec_raw, shape, dtype, offset, payload_len = _parse_header(view)
        expected = offset + payload_len + _CRC.size
        if total != expected:
            kind = "truncated" if total < expected else "followed by trailing bytes"
            raise CodecError(f"encoded data is {kind}: {total} bytes, the header promises {expected}")
        (crc_stored,) = _CRC.unpack_from(view, offset + payload_len)
        crc = zlib.crc32(view[offset : offset + payload_len], zlib.crc32(view[:offset])) if check_crc else crc_stored
        if crc != crc_stored:
            raise CodecError(f"encoded data is corrupted: CRC32 {crc:#010x} does not match stored {crc_stored:#010x}")
        spec = _ascii_spec(spec_raw)
        if payload_len:
            raw = view[offset : offset + payload_len]
            payload = torch.frombuffer(raw if not copy and not raw.readonly else bytearray(raw), dtype=torch.uint8)
        else:
            payload = torch.empty(0, dtype=torch.uint8)
        try:
            return cls(spec=spec, shape=shape, dtype=dtype, payload=payload)
        except ValueError as exc:
            raise CodecError(f"encoded data has an invalid header: {exc}") from exc

    def to(self, device: torch.device | str) -> Encoded:
        """The same encoding with its payload on ``device``."""
        return Encoded(self.spec, self.shape, self.dtype, self.payload.to(device))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Encoded):
            return NotImplemented
        return (
            self.spec == other.spec
            and self.shape == other.shape
            and self.dtype == other.dtype
            and self.payload.numel() == other.payload.numel()
            and torch.equal(self.payload.cpu(), other.payload.cpu())
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Encoded(spec={self.spec!r}, shape={self.shape}, dtype={self.dtype}, nbytes={self.nbytes})"


def wire_header(spec: str, shape: tuple[int, ...], dtype: torch.dtype, payload_nbytes: int) -> bytes:
    """The wire format's bytes before the payload (module doc), for writers that assemble an
    encoding from pieces (a slice of a served delta) instead of one payload tensor."""
    raw = spec.encode("ascii")
    parts = [_PREFIX.pack(MAGIC, FORMAT_VERSION, DTYPE_CODES[dtype], len(shape), len(raw)), raw]
    parts.extend(_U64.pack(d) for d in shape)
    parts.append(_U64.pack(payload_nbytes))
    return b"".join(parts)


def wire_trailer(crc32: int) -> bytes:
    """The CRC-32 trailer of an encoding whose header and payload hash to ``crc32``."""
    return _CRC.pack(crc32)


def read_wire_header(view: memoryview) -> tuple[str, tuple[int, ...], torch.dtype, int, int]:
    """(spec, shape, dtype, payload offset, payload length) from the start of encoded data;
    ``view`` needs only the header's bytes (``header_nbytes_needed``), not the payload.
    Raises :class:`CodecError` for a wrong magic, version or dtype, or a truncated header."""
    spec_raw, shape, dtype, offset, payload_len = _parse_header(view)
    return _ascii_spec(spec_raw), shape, dtype, offset, payload_len


def _parse_header(view: memoryview) -> tuple[bytes, tuple[int, ...], torch.dtype, int, int]:
    if len(view) < HEADER_FIXED_NBYTES:
        raise CodecError(f"encoded data is truncated: {len(view)} bytes, a header alone needs {HEADER_FIXED_NBYTES}")
    magic, version, dtype_code, ndim, spec_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise CodecError(f"not geoloco encoded data: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CodecError(f"encoded data has format version {version}; this build reads version {FORMAT_VERSION} only")
    dtype = _CODE_DTYPES.get(dtype_code)
    if dtype is None:
        raise CodecError(f"encoded data names unknown dtype code {dtype_code}")
    offset = _PREFIX.size
    header_end = offset + spec_len + _U64.size * (ndim + 1)
    if len(view) < header_end + _CRC.size:
        raise CodecError(
            f"encoded data is truncated: {len(view)} bytes, its header alone needs {header_end + _CRC.size}"
        )
    spec_raw = bytes(view[offset : offset + spec_len])
    offset += spec_len
    shape = tuple(_U64.unpack_from(view, offset + _U64.size * i)[0] for i in range(ndim))
    offset += _U64.size * ndim
    (payload_len,) = _U64.unpack_from(view, offset)
    return spec_raw, shape, dtype, offset + _U64.size, payload_len


def _ascii_spec(raw: bytes) -> str:
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError as exc:
        raise CodecError(f"encoded data has a non-ASCII codec spec {raw!r}") from exc


def header_nbytes_needed(prefix: memoryview) -> int:
    """Bytes ``read_wire_header`` needs, from the first ``PREFIX_NBYTES`` bytes of the data."""
    _, _, _, ndim, spec_len = _PREFIX.unpack_from(prefix, 0)
    return _PREFIX.size + spec_len + _U64.size * (ndim + 1) + _CRC.size


PREFIX_NBYTES: Final = _PREFIX.size
"""Bytes at the start of encoded data that say how long its header is (``header_nbytes_needed``)."""

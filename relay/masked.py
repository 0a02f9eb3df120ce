"""Secure aggregation at a relay: the ring sum of a region's masked uploads.

With ``[privacy] secure_aggregation`` a site's upload is its masked update, ``b``-bit unsigned
integers in ``Z_{2^b}`` (codec ``secagg``). Masked vectors add in the ring, so the relay adds its
sites' masked uploads with wrap-around and forwards that sum as one masked upload listing the
sites it contains; the coordinator adds it to the protocol's sum and unmasks as usual. The relay
learns nothing it could unmask: it never holds a key, a share in the clear (shares are encrypted
for their recipient) or a seed, and what it sees of the stage messages, the coordinator sees
too. A site's masked upload is assembled only to verify its checksum (so a corrupt stream cannot
poison the sum), added, and its buffer overwritten with zeros at once: after that the relay
holds the ring sum only. A partial of one site (the only one of its region that uploaded in
time) is that site's masked vector, exactly what the coordinator receives from a site without a
relay: it cannot be unmasked alone, since its pairwise masks with the other survivors are never
revealed. Nothing here does I/O.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from geoloco.algorithms.fixed_point import MODULUS_DTYPES
from geoloco.algorithms.privacy.private_aggregation import SECURE_UPLOAD_CODEC
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.errors import InvalidUpdateError, quoted

__all__ = ["MaskedSum", "SecureRun", "check_masked_manifest"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SecureRun:
    """What the relay needs of the coordinator's ``[privacy]`` when secure aggregation is on."""

    modulus_bits: int
    chunk_size: int
    """Values per protocol chunk: a masked upload's wire chunks are protocol chunks."""

    @property
    def dtype(self) -> np.dtype[Any]:
        return np.dtype(MODULUS_DTYPES[self.modulus_bits])

    @property
    def wire_chunk_bytes(self) -> int:
        return self.chunk_size * (self.modulus_bits // 8)

    @classmethod
    def of(cls, config_json: str) -> SecureRun | None:
        """The run's secure settings from ``RunConfig.config_json`` (None: plain rounds)."""
        try:
            privacy = json.loads(config_json or "{}").get("privacy") or {}
            if not privacy.get("secure_aggregation"):
                return None
            bits = int(privacy.get("modulus_bits", 32))
            chunk = int(privacy.get("chunk_size", 1 << 18))
        except (ValueError, AttributeError, TypeError):
            logger.warning("the coordinator's privacy settings cannot be read; the relay runs plain rounds")
            return None
        if bits not in MODULUS_DTYPES or chunk < 1:
            logger.warning("the coordinator's privacy settings (modulus_bits %s) are not known here", bits)
            return None
        return cls(modulus_bits=bits, chunk_size=chunk)


def check_masked_manifest(manifest: pb.UploadManifest, secure: SecureRun, numel: int) -> None:
    """Refuse a site's upload that cannot be a masked update of this run (the coordinator checks
    the exact size again for the partial)."""
    blob = manifest.blob
    if blob.codec != SECURE_UPLOAD_CODEC:
        raise InvalidUpdateError(
            f"secure aggregation is on: uploads must be masked (codec {SECURE_UPLOAD_CODEC!r}), got "
            f"{quoted(blob.codec)}; the site must run with the coordinator's [privacy] settings"
        )
    dtype = secure.dtype.name
    if blob.dtype != dtype or len(blob.shape) != 1 or not 0 < blob.shape[0] <= numel:
        raise InvalidUpdateError(
            f"masked upload is {quoted(blob.dtype)} {list(blob.shape)}; expected {dtype} [n] with n <= {numel}"
        )
    expected = blob.shape[0] * secure.dtype.itemsize
    if blob.total_bytes != expected or blob.chunk_size != secure.wire_chunk_bytes:
        raise InvalidUpdateError(
            f"masked upload of {blob.total_bytes} bytes in chunks of {blob.chunk_size}; expected "
            f"{expected} bytes in chunks of {secure.wire_chunk_bytes} (one protocol chunk each)"
        )


class MaskedSum:
    """The ring sum ``Σ y_k mod 2^b`` of masked uploads, and which sites it contains."""

    def __init__(self, numel: int, secure: SecureRun) -> None:
        self.total = np.zeros(numel, dtype=secure.dtype)
        self.sites: list[str] = []

    def add(self, site: str, data: memoryview | bytes) -> None:
        """Add ``site``'s masked upload (unsigned addition wraps: the ring's addition)."""
        if site in self.sites:
            raise ValueError(f"site {site!r} is already in the ring sum")
        values = np.frombuffer(data, dtype=self.total.dtype)
        if values.size != self.total.size:
            raise ValueError(f"masked upload of {values.size} values; the round's have {self.total.size}")
        self.total += values
        self.sites.append(site)

    def to_bytes(self) -> bytes:
        return self.total.tobytes()

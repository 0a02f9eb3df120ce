"""A complete plain upload's bytes -> the update to add, its L2 norm and whether it is finite.

Pure checks on one upload (no round state, no locks): the container, the codec and the shape
must be the run's, and the values decodable. A plain running sum takes the encoded update: its
norm is computed piece by piece here and the sum decodes it piece by piece into its buffer
(``geoloco.compression.add_decoded_into``), so no dense decoded copy of the update exists. That
norm is summed in float64, so it differs from the float32 norm of a decoded tensor
(``update_guard.update_norm``) by float32 rounding (~1e-5 relative at 1M values); the guard
only compares it with a bound. Robust and central-DP aggregations hold or clip dense updates by
design and get the decoded tensor.

``finite_metrics`` keeps what an upload's metrics say and ``check_metrics`` bounds them, for the
coordinator and a relay alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from geoloco.algorithms.finite import all_finite
from geoloco.algorithms.update_guard import update_norm
from geoloco.compression import CodecError, Encoded, decode, decoded_norm
from geoloco.protos.errors import InvalidUpdateError, quoted
from geoloco.protos.wire_buffers import DEFAULT_CHECKSUM

__all__ = ["MAX_METRIC_NAME_CHARS", "MAX_SITE_METRICS", "check_metrics", "checked_update", "finite_metrics"]

MAX_SITE_METRICS = 32
"""Entries an upload's ``metrics`` map may have (they go into every round's record)."""
MAX_METRIC_NAME_CHARS = 64
"""Characters of one metric's name."""


def check_metrics(metrics: Mapping[str, float]) -> None:
    """The ``metrics`` map goes into the round's record and the status page: keep it small."""
    if len(metrics) > MAX_SITE_METRICS:
        raise InvalidUpdateError(f"upload metrics has {len(metrics)} entries; at most {MAX_SITE_METRICS} are allowed")
    for name in metrics:
        if len(name) > MAX_METRIC_NAME_CHARS:
            raise InvalidUpdateError(
                f"upload metrics name {quoted(name)} has {len(name)} characters; at most "
                f"{MAX_METRIC_NAME_CHARS} are allowed"
            )


def finite_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """An upload's metrics without the values that are not finite numbers: they say nothing (a
    loop that reports no loss), and a NaN makes an upload's description unequal to its own
    resend, so a second stream of one upload would be taken for a new one."""
    return {name: value for name, value in metrics.items() if math.isfinite(value)}


def checked_update(
    what: str, data: memoryview, checksum: int, *, codec: str, numel: int, device: torch.device, dense: bool
) -> tuple[Encoded | torch.Tensor, float, bool]:
    """(update to add, its L2 norm, whether its values are all finite) of ``what`` (e.g.
    "site 'a''s update for round 3"), checksum the manifest's algorithm: encoded for a
    running sum, decoded when ``dense``.

    Raises ``InvalidUpdateError`` naming what is wrong.
    """
    encoded = _encoded(what, data, checksum, codec=codec, numel=numel)
    if dense:
        decoded = _decoded(what, encoded, numel=numel, device=device)
        norm = update_norm(decoded)
        return decoded, norm, all_finite(decoded, norm)
    try:
        norm, finite = decoded_norm(encoded, device=device)
    except CodecError as err:
        raise InvalidUpdateError(f"{what} cannot be decoded: {err}") from None
    return encoded.to(device), norm, finite


def _encoded(what: str, data: memoryview, checksum: int, *, codec: str, numel: int) -> Encoded:
    try:
        # A view of the upload's buffer, which the round keeps: decoding is the only copy.
        # The assembler verified the manifest's checksum of these bytes; with SHA-256 (the
        # default) the container's own CRC-32 pass adds nothing.
        encoded = Encoded.from_bytes(data, copy=False, check_crc=checksum != DEFAULT_CHECKSUM)
    except CodecError as err:
        raise InvalidUpdateError(f"{what} is not a valid encoded tensor: {err}") from None
    if encoded.spec != codec:
        raise InvalidUpdateError(
            f"{what} was encoded with {encoded.spec!r}; its uplink codec for that round is {codec!r}"
        )
    if encoded.shape != (numel,) or encoded.dtype != torch.float32:
        raise InvalidUpdateError(
            f"{what} decodes to {encoded.dtype} {list(encoded.shape)}; expected float32 [{numel}]"
        )
    return encoded


def _decoded(what: str, encoded: Encoded, *, numel: int, device: torch.device) -> torch.Tensor:
    try:
        decoded = decode(encoded, device=device)
    except CodecError as err:
        raise InvalidUpdateError(f"{what} cannot be decoded: {err}") from None
    if decoded.shape != (numel,) or decoded.dtype != torch.float32:
        raise InvalidUpdateError(
            f"{what} decoded to {decoded.dtype} {list(decoded.shape)}; expected float32 [{numel}]"
        )
    return decoded

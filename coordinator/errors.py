"""Domain errors of the coordinator, each carrying the gRPC status and ``ErrorReason`` a site sees.

The round state machine raises them; ``geoloco.protos.transport_errors.ErrorStatusInterceptor``
turns them into ``context.abort(code, message)`` plus the ``geoloco-error-reason`` trailing
metadata, so the servicer never translates errors by hand. The wire-level errors (bad manifests,
chunk bounds, checksums) live in ``geoloco.protos.wire_buffers``, the session, membership, round
and update ones (which a relay raises too) in ``geoloco.protos.errors``; this module adds what
only the coordinator knows about.
"""

from __future__ import annotations

import grpc

from geoloco.algorithms.engine import NOT_FINITE
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.errors import StatusError

__all__ = ["ShuttingDownError", "SiteNotAllowedError", "rejection_message"]


class SiteNotAllowedError(StatusError):
    """The site is authenticated but not in the coordinator's ``allowed_sites``."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = pb.ERROR_REASON_IDENTITY_MISMATCH


class ShuttingDownError(StatusError):
    """The coordinator is stopping; the site should retry (it will find a restarted one)."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = pb.ERROR_REASON_UNSPECIFIED


def rejection_message(what: str, why: str, *, aborted: bool) -> str:
    """What a site is told when the engine rejected ``what`` for ``why``."""
    if aborted:
        return f"{what} could not be added to the aggregate; the round is aborted with the model unchanged"
    if why == NOT_FINITE:
        return f"{what} contains NaN or Inf values; it is dropped (check the site's loss and learning rate)"
    return f"{what} is refused: {why}; it is dropped (check the site's loss and learning rate)"

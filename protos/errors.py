"""Errors that know which gRPC status they become.

Core code raises these; the servicer does not translate them by hand: the
``geoloco.protos.transport.ErrorStatusInterceptor`` turns any ``StatusError`` escaping a handler
into ``context.abort(error.code, str(error))`` with the machine-readable ``ErrorReason`` in the
trailing metadata key ``geoloco-error-reason``. Clients read it back with
``geoloco.protos.transport.error_reason(rpc_error)``.
"""

from __future__ import annotations

import grpc

from geoloco.protos import geoloco_pb2 as pb


class StatusError(Exception):
    """An error with the gRPC status code and ``ErrorReason`` a peer should see.

    Subclasses set class-level defaults; any instance may override them.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    reason: int = pb.ERROR_REASON_UNSPECIFIED

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        reason: int | None = None,
    ) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        if reason is not None:
            self.reason = reason

    @property
    def reason_name(self) -> str:
        """The ``ErrorReason`` value's name, as sent in the trailing metadata."""
        return pb.ErrorReason.Name(self.reason)


class IdentityError(StatusError):
    """The caller's identity is missing or does not match what it claims."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = pb.ERROR_REASON_IDENTITY_MISMATCH


class StaleSessionError(StatusError):
    """The request names a coordinator session that is not the current one: re-join."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = pb.ERROR_REASON_STALE_SESSION


class NotAMemberError(StatusError):
    """The site is not (or no longer) a member of the run: re-join."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = pb.ERROR_REASON_NOT_A_MEMBER


class WrongRoundError(StatusError):
    """The request is for a round that is closed (too late) or not open yet."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = pb.ERROR_REASON_WRONG_ROUND


class ProtocolVersionError(StatusError):
    """The peer speaks another protocol version (``wire.PROTOCOL_VERSION``)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = pb.ERROR_REASON_PROTOCOL_VERSION


class RunFinishedError(StatusError):
    """The run is over: the site should leave."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = pb.ERROR_REASON_RUN_FINISHED

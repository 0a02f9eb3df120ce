"""Errors that know which gRPC status they become.

Core code raises these; the servicer does not translate them by hand: the
``geoloco.protos.transport_errors.ErrorStatusInterceptor`` turns any ``StatusError`` escaping a handler
into ``context.abort(error.code, str(error))`` with the machine-readable ``ErrorReason`` in the
trailing metadata key ``geoloco-error-reason``. Clients read it back with
``geoloco.protos.transport_errors.error_reason(rpc_error)``.
"""

from __future__ import annotations

import grpc

from geoloco.protos import geoloco_pb2 as pb

MAX_QUOTED_CHARS = 80
"""Characters of a request's string (a claimed name, a codec, a session id) echoed in a message."""
MAX_MESSAGE_CHARS = 1024
"""Longest ``StatusError`` message: whatever a message quotes, a peer cannot make the status
detail, the log line or the status page's event text it becomes any longer."""


def clip(text: str, limit: int = MAX_QUOTED_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut. Anything a request
    carries goes through this (or ``quoted``) before it is echoed, logged or stored."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...[{len(text) - limit} more characters]"


def quoted(value: object, limit: int = MAX_QUOTED_CHARS) -> str:
    """``repr(value)`` for a message, at most about ``limit`` characters (``clip``)."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}...[{len(text) - limit} more characters]"


def _bounded_message(message: str) -> str:
    """The message with its middle cut past ``MAX_MESSAGE_CHARS``: the start says what is
    wrong, the end usually what to do."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    tail = MAX_MESSAGE_CHARS // 4
    head = MAX_MESSAGE_CHARS - tail
    cut = len(message) - head - tail
    return f"{message[:head]}...[{cut} characters cut]...{message[-tail:]}"


class StatusError(Exception):
    """An error with the gRPC status code and ``ErrorReason`` a peer should see.

    Subclasses set class-level defaults; any instance may override them.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    reason: int = pb.ERROR_REASON_UNSPECIFIED
    refuses_input: bool = True
    """Whether the caller sent something the server refused, counted as a rejected request
    (metrics, status page); False for an outcome the protocol expects and the caller handles."""

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        reason: int | None = None,
    ) -> None:
        super().__init__(_bounded_message(message))
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


class LateStageAnswerError(WrongRoundError):
    """A secure-aggregation answer that arrives after its round finished without it: the
    slowest sites' usual case, not a refused input (``refuses_input`` False); the broadcast
    tells the site whether its update counted."""

    refuses_input = False


class ProtocolVersionError(StatusError):
    """The peer speaks another protocol version (``protocol_version.PROTOCOL_VERSION``)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = pb.ERROR_REASON_PROTOCOL_VERSION


class RunFinishedError(StatusError):
    """The run is over: the site should leave."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = pb.ERROR_REASON_RUN_FINISHED


class SiteReplacedError(StatusError):
    """Another process joined under the caller's site name (``JoinRequest.instance_id``): the
    caller was replaced and must stop. Not a reason to join again: its Join is refused too, so
    two live processes of one site cannot take the name from each other in turn."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = pb.ERROR_REASON_SITE_REPLACED


class InvalidUpdateError(StatusError):
    """An upload whose content does not fit the run: codec, shape, dtype, weight, or values.
    Raised by whoever checks an upload (the coordinator, a relay)."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = pb.ERROR_REASON_BAD_MANIFEST


class UpdateRejectedError(StatusError):
    """The site's update for this round was already rejected (non-finite values); it is out of
    the aggregate until the next round."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = pb.ERROR_REASON_WRONG_ROUND

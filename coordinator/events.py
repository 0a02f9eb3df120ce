"""What happens inside a coordinator, as a stream of small events for observers.

The round state machine (and the gRPC error interceptor) *emit* events; observers such as the
Prometheus metrics (``geoloco.coordinator.prometheus``) and the status page
(``geoloco.coordinator.http_status``) *listen*. The state machine never depends on its observers:
it only knows this module, and a listener that raises is logged and ignored so that a broken
dashboard can never stop training.

Listeners run synchronously in the emitting thread, sometimes while the state machine holds its
lock (byte counts are emitted per chunk), so they must be quick and must not call back into the
state machine's methods that take the lock from another thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from geoloco.protos.errors import StatusError
from geoloco.protos.transport_errors import WrappingInterceptor, rebuild_handler

__all__ = [
    "BYTES_RECEIVED",
    "BYTES_SENT",
    "CHECKPOINT_SAVED",
    "EVENT_KINDS",
    "HEARTBEAT",
    "REQUEST_REJECTED",
    "ROUND_AGGREGATED",
    "ROUND_STARTED",
    "SITE_DROPPED",
    "SITE_JOINED",
    "SITE_LEFT",
    "UPDATE_AGGREGATED",
    "UPDATE_REJECTED",
    "UPLOAD_OPENED",
    "EventHub",
    "EventListener",
    "RejectedRequestInterceptor",
    "RoundEvent",
]

logger = logging.getLogger(__name__)

SITE_JOINED = "site_joined"
"""A site joined (``data["rejoin"]``: it was already a member, e.g. a restarted process)."""
SITE_LEFT = "site_left"
"""A site left on its own (``data["reason"]``)."""
SITE_DROPPED = "site_dropped"
"""A site was dropped after ``heartbeat_timeout_s`` of silence (``data["silent_s"]``)."""
HEARTBEAT = "heartbeat"
"""A heartbeat from a member (``data["phase"]``: its ``SitePhase`` value, ``data["inner_steps_done"]``)."""
ROUND_STARTED = "round_started"
"""The round's quorum assembled and its deadline clock started (``data["members"]``)."""
BYTES_RECEIVED = "bytes_received"
"""Serialized message bytes received from a site (``data["nbytes"]``)."""
BYTES_SENT = "bytes_sent"
"""Serialized message bytes sent to a site (``data["nbytes"]``)."""
UPLOAD_OPENED = "upload_opened"
"""A site started a new upload for ``round`` (a resumed upload does not emit it again)."""
UPDATE_AGGREGATED = "update_aggregated"
"""A site's complete, verified update went into the round's aggregate (``data["weight"]``)."""
UPDATE_REJECTED = "update_rejected"
"""A site's complete update was refused (non-finite values, a norm or weight beyond
``[update_guard]``; ``data["why"]``)."""
CHECKPOINT_SAVED = "checkpoint_saved"
"""A checkpoint holding ``θ_round`` was written."""
ROUND_AGGREGATED = "round_aggregated"
"""A round closed and was aggregated; ``data`` is the round's metrics record (as in metrics.jsonl)."""
REQUEST_REJECTED = "request_rejected"
"""A gRPC call ended with a ``StatusError`` (bad input, wrong round, stale session...):
``data["method"]``, ``data["code"]`` (gRPC status name), ``data["reason"]`` (``ErrorReason`` name),
``data["message"]``."""

EVENT_KINDS = (
    SITE_JOINED,
    SITE_LEFT,
    SITE_DROPPED,
    HEARTBEAT,
    ROUND_STARTED,
    BYTES_RECEIVED,
    BYTES_SENT,
    UPLOAD_OPENED,
    UPDATE_AGGREGATED,
    UPDATE_REJECTED,
    CHECKPOINT_SAVED,
    ROUND_AGGREGATED,
    REQUEST_REJECTED,
)


@dataclass(frozen=True, slots=True)
class RoundEvent:
    """One thing that happened, stamped with the emitter's clock."""

    kind: str
    """One of ``EVENT_KINDS``."""
    time_s: float
    """The state machine's clock (monotonic seconds; a fake clock in tests)."""
    site: str | None = None
    """The site concerned, if any."""
    round: int | None = None
    """The round concerned, if any."""
    data: Mapping[str, Any] = field(default_factory=dict)
    """Kind-specific fields (see the kind's constant)."""


EventListener = Callable[[RoundEvent], None]


class EventHub:
    """Fan-out of events to listeners; thread-safe, listener failures are logged and ignored."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._listeners: tuple[EventListener, ...] = ()
        self._lock = threading.Lock()

    def add_listener(self, listener: EventListener) -> None:
        with self._lock:
            self._listeners = (*self._listeners, listener)

    def remove_listener(self, listener: EventListener) -> None:
        with self._lock:
            self._listeners = tuple(x for x in self._listeners if x is not listener)

    @property
    def active(self) -> bool:
        """Whether anyone listens (emitters may skip building costly payloads otherwise)."""
        return bool(self._listeners)

    def emit(
        self,
        kind: str,
        *,
        site: str | None = None,
        round: int | None = None,
        data: Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> None:
        """Tell every listener; ``data`` and ``fields`` together make ``RoundEvent.data``."""
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {kind!r}; valid kinds: {', '.join(EVENT_KINDS)}")
        listeners = self._listeners
        if not listeners:
            return
        payload = {**data, **fields} if data is not None else fields
        event = RoundEvent(kind=kind, time_s=self.clock(), site=site, round=round, data=payload)
        for listener in listeners:
            try:
                listener(event)
            except Exception:
                # Observability must never break training.
                logger.exception("event listener %r failed on %s", listener, kind)


class RejectedRequestInterceptor(WrappingInterceptor):
    """Emits ``REQUEST_REJECTED`` for every ``StatusError`` a handler raises that refuses its
    input (``StatusError.refuses_input``), then re-raises it.

    Install it *after* ``ErrorStatusInterceptor`` in the server's interceptor list (gRPC nests
    later interceptors inside earlier ones), so it sees the domain error before it is turned
    into a status: ``build_server(interceptors=[*default_interceptors(...), this])``.
    """

    def __init__(self, hub: EventHub) -> None:
        super().__init__()
        self.hub = hub

    def _emit(self, method: str, error: StatusError) -> None:
        if not error.refuses_input:
            return  # a late answer the protocol expects (``LateStageAnswerError``)
        self.hub.emit(
            REQUEST_REJECTED,
            method=method.rsplit("/", 1)[-1],
            code=error.code.name,
            reason=error.reason_name.removeprefix("ERROR_REASON_").lower(),
            message=str(error),
        )

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        emit = self._emit

        def unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def call(request: Any, context: grpc.ServicerContext) -> Any:
                try:
                    return behavior(request, context)
                except StatusError as error:
                    emit(method, error)
                    raise

            return call

        def stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                try:
                    yield from behavior(request, context)
                except StatusError as error:
                    emit(method, error)
                    raise

            return call

        return rebuild_handler(handler, unary, stream)

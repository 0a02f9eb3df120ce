"""Which gRPC calls the coordinator takes on, so that a flood cannot starve the run's own sites.

gRPC's sync server runs every call on a worker thread from start to end; an Upload stream that
opens and never sends holds its thread until the client goes away. A few hundred such streams
used to fill the pool, and heartbeats queued behind them until the sites were dropped as silent.
``Admission`` bounds that, before any servicer code reads a request:

* **Allow-list first.** With TLS, a peer whose certificate names a site outside
  ``allowed_sites`` is refused PERMISSION_DENIED on every method before its first message is
  read (the servicer would only find out after the manifest).
* **Per peer.** With TLS, a peer (the site its certificate names) may have
  ``max_rpcs_per_peer`` calls open; more are refused RESOURCE_EXHAUSTED. In insecure mode peers
  cannot be told apart: anyone may claim any name, and gRPC clients in one process share one
  connection whatever site they speak for (so a per-connection bound would refuse legitimate
  sites run side by side, while a flooder just opens more connections); only the total bound
  and the idle timeout apply there.
* **In total.** Long-lived calls (Upload, FetchModel, AwaitBroadcast, SecureStage) from
  everyone together are bounded by ``max_streams``, below the main pool's size, so a thread
  always remains to answer or refuse; more are refused UNAVAILABLE (a site retries).
  ``max_concurrent_rpcs`` is gRPC's own bound behind it.
* **A pool of their own for the control calls.** Join, Heartbeat, Leave and UploadStatus run
  on a separate pool of ``max_rpcs_per_peer + 8`` threads, so they are answered whatever the
  main pool is doing, and one site holding all its calls open there still leaves threads over.
* **Idle reads.** A call whose next request message takes longer than
  ``stream_idle_timeout_s`` is cancelled with DEADLINE_EXCEEDED by a watchdog thread: an Upload
  stream between chunks (its partial upload is kept for UploadStatus, as for any broken
  stream), or a unary call that sent its headers and never its message (every method is
  registered request-streaming, see ``add_coordinator_servicer``, so that read is ours too).

Every refusal is a ``StatusError`` raised inside ``RejectedRequestInterceptor``, so it is
counted (``rejected_requests_total``, the status page) like any other refused call; the
watchdog emits the same event for the streams it cancels. Install ``interceptor`` last in the
server's list.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from geoloco.coordinator import events as ev
from geoloco.coordinator.admission_config import AdmissionLimits
from geoloco.coordinator.errors import SiteNotAllowedError, StatusError
from geoloco.protos.transport_errors import THREAD_POOL_ATTRIBUTE, rebuild_handler
from geoloco.protos.transport_tls import peer_relay, peer_site

__all__ = [
    "CONTROL_METHODS",
    "STREAM_METHODS",
    "Admission",
    "PeerLimitError",
    "ServerBusyError",
]

logger = logging.getLogger(__name__)

RELAY_PEER_PREFIX = "relay:"
"""Admission key prefix of a regional relay's calls (a colon never appears in a site name)."""

CONTROL_METHODS = frozenset({"Join", "Heartbeat", "Leave", "UploadStatus"})
"""Short calls that keep a site in the run; served by the control pool."""
STREAM_METHODS = frozenset({"Upload", "FetchModel", "AwaitBroadcast", "SecureStage"})
"""Calls that may hold a thread for long (a transfer, a round, a protocol stage)."""


class PeerLimitError(StatusError):
    """The peer already has ``max_rpcs_per_peer`` calls open."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ServerBusyError(StatusError):
    """``max_streams`` long-lived calls are open; the site should retry shortly."""

    code = grpc.StatusCode.UNAVAILABLE


class _Ticket:
    """One admitted call; ``release`` is idempotent (called on return and on termination)."""

    __slots__ = ("_admission", "_released", "long_lived", "peer")

    def __init__(self, admission: Admission, peer: str, long_lived: bool) -> None:
        self._admission = admission
        self.peer = peer
        self.long_lived = long_lived
        self._released = False

    def release(self) -> None:
        self._admission._release(self)


@dataclass(slots=True, eq=False)
class _Read:
    """A call's request stream being read: since when it waits for its next message (None: not
    waiting)."""

    method: str
    peer: str
    context: grpc.ServicerContext
    waiting_since: float | None = None
    expired: bool = False


class Admission:
    """The bounds of one coordinator's gRPC server (see the module doc)."""

    def __init__(
        self,
        limits: AdmissionLimits,
        *,
        allowed_sites: Sequence[str] | None,
        insecure: bool,
        events: ev.EventHub,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self.allowed_sites = None if allowed_sites is None else frozenset(allowed_sites)
        self.insecure = insecure
        self.events = events
        self.clock = clock
        self.control_pool = futures.ThreadPoolExecutor(
            max_workers=limits.control_workers, thread_name_prefix="geoloco-grpc-control"
        )
        self.interceptor = AdmissionInterceptor(self)
        self._lock = threading.Lock()
        self._per_peer: dict[str, int] = {}
        self._streams = 0
        self._reads: set[_Read] = set()
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None

    # -- admission --

    def peer_of(self, context: grpc.ServicerContext) -> str:
        """Who is calling: the site its certificate names (TLS), ``relay:NAME`` for a regional
        relay (whose sites are checked per request against ``[relays]``), else its connection."""
        if not self.insecure:
            site = peer_site(context)
            if site is not None:
                return site
            relay = peer_relay(context)
            if relay is not None:
                return RELAY_PEER_PREFIX + relay
        return str(context.peer())

    @property
    def per_peer_limit(self) -> int | None:
        """``max_rpcs_per_peer``, or None in insecure mode (see the module doc)."""
        return None if self.insecure else self.limits.max_rpcs_per_peer

    def admit(self, method: str, context: grpc.ServicerContext) -> _Ticket:
        """Count the call in, or raise the ``StatusError`` that refuses it (nothing read yet)."""
        peer = self.peer_of(context)
        if (
            not self.insecure
            and self.allowed_sites is not None
            and peer not in self.allowed_sites
            and not peer.startswith(RELAY_PEER_PREFIX)
        ):
            raise SiteNotAllowedError(
                f"site {peer!r} is not in this run's allowed_sites; add it to the coordinator's "
                "config to let it take part"
            )
        long_lived = method in STREAM_METHODS
        limits = self.limits
        per_peer = self.per_peer_limit
        with self._lock:
            open_calls = self._per_peer.get(peer, 0)
            if per_peer is not None and open_calls >= per_peer:
                raise PeerLimitError(
                    f"site {peer!r} already has {open_calls} calls open, the most "
                    f"admission.max_rpcs_per_peer allows ({per_peer}); finish or cancel some first"
                )
            if long_lived and self._streams >= limits.max_streams:
                raise ServerBusyError(
                    f"the coordinator is serving its limit of {limits.max_streams} long-lived calls "
                    "(admission.max_streams); retry shortly"
                )
            self._per_peer[peer] = open_calls + 1
            if long_lived:
                self._streams += 1
        ticket = _Ticket(self, peer, long_lived)
        if not context.add_callback(ticket.release):  # the call already ended
            ticket.release()
        return ticket

    def _release(self, ticket: _Ticket) -> None:
        with self._lock:
            if ticket._released:
                return
            ticket._released = True
            left = self._per_peer[ticket.peer] - 1
            if left:
                self._per_peer[ticket.peer] = left
            else:
                del self._per_peer[ticket.peer]
            if ticket.long_lived:
                self._streams -= 1

    def open_calls(self, peer: str | None = None) -> int:
        """Calls admitted and not yet ended (of ``peer``, or long-lived ones of everyone)."""
        with self._lock:
            return self._streams if peer is None else self._per_peer.get(peer, 0)

    # -- idle reads --

    def watched(self, requests: Iterator[Any], method: str, peer: str, context: grpc.ServicerContext) -> Iterator[Any]:
        """``requests``, the call cancelled by the watchdog when a message takes longer than
        ``stream_idle_timeout_s`` to arrive (every method's requests arrive as a stream)."""
        read = _Read(method=method, peer=peer, context=context)
        with self._lock:
            self._reads.add(read)
        try:
            while True:
                read.waiting_since = self.clock()
                try:
                    request = next(requests)
                except StopIteration:
                    return
                finally:
                    read.waiting_since = None
                yield request
        finally:
            with self._lock:
                self._reads.discard(read)

    def expire_idle_reads(self) -> int:
        """Cancel the streams idle for too long; returns how many (the watchdog's one step)."""
        timeout = self.limits.stream_idle_timeout_s
        now = self.clock()
        with self._lock:
            expired = [
                r for r in self._reads
                if not r.expired and r.waiting_since is not None and now - r.waiting_since > timeout
            ]
            for read in expired:
                read.expired = True
        for read in expired:
            message = (
                f"no request message for {timeout:g} s (admission.stream_idle_timeout_s); the call "
                "is cancelled" + (", resume the upload with UploadStatus" if read.method == "Upload" else "")
            )
            logger.info("%s of %s: %s", read.method, read.peer, message)
            _cancel(read.context, grpc.StatusCode.DEADLINE_EXCEEDED, message)
            self.events.emit(
                ev.REQUEST_REJECTED,
                method=read.method,
                code=grpc.StatusCode.DEADLINE_EXCEEDED.name,
                reason="unspecified",
                message=message,
            )
        return len(expired)

    def _watch(self) -> None:
        period = min(1.0, self.limits.stream_idle_timeout_s / 4)
        while not self._stop.wait(period):
            try:
                self.expire_idle_reads()
            except Exception:  # a broken watchdog must not end the run
                logger.exception("the idle-stream watchdog failed")

    def start(self) -> None:
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="geoloco-idle-watchdog", daemon=True)
            self._watchdog.start()

    def stop(self) -> None:
        """Stop the watchdog and the control pool (after the gRPC server stopped)."""
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout=10)
        self.control_pool.shutdown(wait=False, cancel_futures=True)


def _cancel(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """End a call from another thread than its handler's, with ``code`` if grpc lets us.

    ``ServicerContext.abort`` only works in the handler's own thread, which is blocked reading;
    the call object underneath can be cancelled with a status (a private attribute of grpc's
    sync server; without it the peer sees CANCELLED)."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    try:
        if call is not None:
            call.cancel(code.value[0], details)
            return
    except Exception:
        logger.debug("cancel with a status failed; cancelling plainly", exc_info=True)
    context.cancel()


class AdmissionInterceptor(grpc.ServerInterceptor):
    """Wraps every handler so that ``Admission.admit`` runs before the request is read, the
    control calls run on the control pool, and Upload reads are watched for idleness."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        admission = self.admission
        streaming_request = bool(handler.request_streaming)

        def admitted(request: Any, context: grpc.ServicerContext) -> tuple[_Ticket, Any]:
            ticket = admission.admit(method, context)
            if streaming_request:
                request = admission.watched(request, method, ticket.peer, context)
            return ticket, request

        def unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def call(request: Any, context: grpc.ServicerContext) -> Any:
                ticket, request = admitted(request, context)
                try:
                    return behavior(request, context)
                finally:
                    ticket.release()

            if method in CONTROL_METHODS:
                setattr(call, THREAD_POOL_ATTRIBUTE, admission.control_pool)
            return call

        def stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                ticket, request = admitted(request, context)
                try:
                    yield from behavior(request, context)
                finally:
                    ticket.release()

            return call

        return rebuild_handler(handler, unary, stream)

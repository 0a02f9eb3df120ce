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
* **In total, with a reserve per identity.** Long-lived calls (Upload, FetchModel,
  AwaitBroadcast, SecureStage) from everyone together are bounded by ``max_streams``, below the
  main pool's size, so a thread always remains to answer or refuse; more are refused
  UNAVAILABLE (a site retries). With TLS each identity the run admits (listed site or relay;
  ``AdmissionLimits.identities``) has ``STREAM_RESERVE`` of them in reserve (fewer when
  ``max_streams`` is too small): a peer beyond its share is admitted only while the others'
  unused shares stay free, so two sites holding idle uploads cannot take the streams an honest
  site needs. ``max_concurrent_rpcs``
  is gRPC's own bound behind it.
* **A pool of their own for the control calls.** Join, Heartbeat, Leave and UploadStatus run
  on a separate pool of ``CONTROL_PER_PEER`` threads per identity plus headroom, and with TLS
  one identity may hold at most ``CONTROL_PER_PEER`` of them: whatever the main pool is doing
  and whatever another identity holds open, a site's heartbeat finds a thread.
* **Relays by their listing.** A relay certificate whose name is not in ``[relays]`` is
  refused PERMISSION_DENIED before anything is read, as an unlisted site is.
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
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from geoloco.coordinator import events as ev
from geoloco.coordinator.admission_config import CONTROL_PER_PEER, AdmissionLimits
from geoloco.coordinator.errors import SiteNotAllowedError
from geoloco.protos.errors import StatusError
from geoloco.protos.transport_errors import THREAD_POOL_ATTRIBUTE, WrappingInterceptor, rebuild_handler
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

STREAM_RESERVE = 3
"""Long-lived calls kept in reserve for each identity (an AwaitBroadcast, an Upload and a
FetchModel or SecureStage: what a site has open at once). Beyond it the streams are shared first
come, first served, so the ranks of a sharded site can upload side by side."""
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

    __slots__ = ("_admission", "_released", "control", "long_lived", "peer")

    def __init__(self, admission: Admission, peer: str, long_lived: bool, control: bool) -> None:
        self._admission = admission
        self.peer = peer
        self.long_lived = long_lived
        self.control = control
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
        relays: Iterable[str] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self.allowed_sites = None if allowed_sites is None else frozenset(allowed_sites)
        self.relays = frozenset(relays)
        """The relays ``[relays]`` lists; another relay certificate is refused."""
        self.insecure = insecure
        self.events = events
        self.clock = clock
        self.control_pool = futures.ThreadPoolExecutor(
            max_workers=limits.control_workers, thread_name_prefix="geoloco-grpc-control"
        )
        self.interceptor = AdmissionInterceptor(self)
        self._lock = threading.Lock()
        self._per_peer: dict[str, int] = {}
        self._control_per_peer: dict[str, int] = {}
        self._streams_per_peer: dict[str, int] = {}
        self._streams = 0
        self._share = min(STREAM_RESERVE, limits.max_streams // max(1, limits.identities))
        """Long-lived calls each identity keeps in reserve (0: too few streams to reserve any)."""
        self._reserved_in_use = 0
        """Sum over peers of ``min(their long-lived calls, _share)``."""
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
        if not self.insecure:
            self._check_listed(peer)
        long_lived = method in STREAM_METHODS
        control = method in CONTROL_METHODS
        per_peer = self.per_peer_limit
        with self._lock:
            open_calls = self._per_peer.get(peer, 0)
            if per_peer is not None and open_calls >= per_peer:
                raise PeerLimitError(
                    f"site {peer!r} already has {open_calls} calls open, the most "
                    f"admission.max_rpcs_per_peer allows ({per_peer}); finish or cancel some first"
                )
            held_control = self._control_per_peer.get(peer, 0)
            if control and per_peer is not None and held_control >= CONTROL_PER_PEER:
                raise PeerLimitError(
                    f"site {peer!r} already has {held_control} Join/Heartbeat/Leave/UploadStatus calls "
                    f"open, the most one site may hold ({CONTROL_PER_PEER}, so that every site's "
                    "heartbeat finds a thread); finish or cancel some first"
                )
            held = self._streams_per_peer.get(peer, 0)
            if long_lived:
                self._check_stream(peer, held, reserve=per_peer is not None)
            self._per_peer[peer] = open_calls + 1
            if control:
                self._control_per_peer[peer] = held_control + 1
            if long_lived:
                self._streams += 1
                self._streams_per_peer[peer] = held + 1
                if held < self._share:
                    self._reserved_in_use += 1
        ticket = _Ticket(self, peer, long_lived, control)
        if not context.add_callback(ticket.release):  # the call already ended
            ticket.release()
        return ticket

    def _check_listed(self, peer: str) -> None:
        """Refuse a certificate the run does not list (site or relay), before anything is read."""
        if peer.startswith(RELAY_PEER_PREFIX):
            relay = peer.removeprefix(RELAY_PEER_PREFIX)
            if relay not in self.relays:
                listed = ", ".join(sorted(self.relays)) or "none"
                raise SiteNotAllowedError(
                    f"relay {relay!r} is not in this coordinator's [relays] table (listed: {listed}); "
                    "add it to the coordinator's config with the sites it may speak for"
                )
        elif self.allowed_sites is not None and peer not in self.allowed_sites:
            raise SiteNotAllowedError(
                f"site {peer!r} is not in this run's allowed_sites; add it to the coordinator's "
                "config to let it take part"
            )

    def _check_stream(self, peer: str, held: int, *, reserve: bool) -> None:
        """Refuse a long-lived call beyond ``max_streams``, or beyond ``peer``'s share while the
        other identities' unused shares would no longer fit (lock held)."""
        limits = self.limits
        free = limits.max_streams - self._streams
        if free <= 0:
            raise ServerBusyError(
                f"the coordinator is serving its limit of {limits.max_streams} long-lived calls "
                "(admission.max_streams); retry shortly"
            )
        if not reserve or held < self._share:
            return
        unused_by_others = self._share * limits.identities - self._reserved_in_use
        if free - 1 < unused_by_others:
            raise ServerBusyError(
                f"site {peer!r} already has {held} long-lived calls open; the {free} streams still "
                f"free of admission.max_streams ({limits.max_streams}) are kept for the other "
                f"{limits.identities - 1} identities' reserve of {self._share} each: retry once "
                "some of yours ended"
            )

    def _release(self, ticket: _Ticket) -> None:
        with self._lock:
            if ticket._released:
                return
            ticket._released = True
            peer = ticket.peer
            _decrement(self._per_peer, peer)
            if ticket.control:
                _decrement(self._control_per_peer, peer)
            if ticket.long_lived:
                self._streams -= 1
                if _decrement(self._streams_per_peer, peer) < self._share:
                    self._reserved_in_use -= 1

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


def _decrement(counts: dict[str, int], key: str) -> int:
    """``counts[key] - 1``, stored (the key dropped at 0); returns the new count."""
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]
    return left


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


class AdmissionInterceptor(WrappingInterceptor):
    """Wraps every handler so that ``Admission.admit`` runs before the request is read, the
    control calls run on the control pool, and Upload reads are watched for idleness."""

    def __init__(self, admission: Admission) -> None:
        super().__init__()
        self.admission = admission

    def wrap(self, handler: grpc.RpcMethodHandler, full_method: str) -> grpc.RpcMethodHandler:
        method = full_method.rsplit("/", 1)[-1]
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

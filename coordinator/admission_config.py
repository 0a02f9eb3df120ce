"""The ``[admission]`` table of the coordinator config: how many calls the gRPC server takes on.

Its own module (like ``http_config``) so that ``geoloco.coordinator.config`` only adds one field
and the limits' defaults are documented next to their reasons. ``AdmissionConfig.resolve`` turns
the unset keys into numbers derived from ``max_sites`` and the heartbeat settings;
``geoloco.coordinator.admission`` enforces them.
"""

from __future__ import annotations

from dataclasses import dataclass

from geoloco.algorithms.config import require
from geoloco.protos.transport_options import server_workers

__all__ = ["AdmissionConfig", "AdmissionLimits"]

CONTROL_HEADROOM = 8
"""Threads of the control pool beyond the identities' shares: calls from peers that are not
told apart (insecure mode) and refusals still find a thread."""
CONTROL_PER_PEER = 4
"""Control calls (Join, Heartbeat, Leave, UploadStatus) one identity may have open at once: a
site needs one or two; the pool holds this many per identity, so no identity can take another's."""


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """``AdmissionConfig`` with every default filled in (what the server runs with)."""

    workers: int
    control_workers: int
    max_concurrent_rpcs: int
    max_streams: int
    max_rpcs_per_peer: int
    stream_idle_timeout_s: float
    silent_join_grace_s: float
    identities: int = 1
    """Certificate identities the run admits (listed sites and relays, or ``max_sites`` and the
    relays when any site of the CA may join): each has its share of the control pool and a
    reserve of long-lived calls (``geoloco.coordinator.admission``)."""


@dataclass(kw_only=True, slots=True)
class AdmissionConfig:
    """``[admission]``: bounds that keep a flood of calls from starving the run's own sites."""

    max_rpcs_per_peer: int = 16
    """Calls one site may have open at once, the site being the name its TLS certificate gives
    (not applied with ``insecure``, where callers cannot be told apart). A site needs at most a
    handful (an AwaitBroadcast, an Upload, a Heartbeat, an UploadStatus); more are refused with
    RESOURCE_EXHAUSTED."""
    max_streams: int | None = None
    """Long-lived calls (Upload, FetchModel, AwaitBroadcast, SecureStage) open at once, from
    everyone; more are refused with UNAVAILABLE (retry later). Unset: the main thread pool's size
    (``4 x max_sites + 8``) minus 8, so a thread is always free to answer or refuse a call. With
    TLS each certificate identity (listed site or relay) keeps 3 of them in reserve: beyond that a
    peer gets a call only while the others' unused reserves stay free."""
    max_concurrent_rpcs: int | None = None
    """gRPC's own bound on calls in progress or queued, all methods together (beyond it gRPC
    answers RESOURCE_EXHAUSTED before any of our code runs). Unset: twice the main pool plus the
    control pool (4 threads per certificate identity, at least ``max_rpcs_per_peer``, plus 8, for
    Join, Heartbeat, Leave and UploadStatus)."""
    stream_idle_timeout_s: float = 60.0
    """A call whose next request message takes longer than this to arrive is cancelled: an
    Upload stream between chunks (the site resumes with UploadStatus), or any call that sent its
    headers but not its request. Long enough for one 4 MiB chunk on a link well below 1 Mbit/s."""
    silent_join_grace_s: float | None = None
    """A site that joined but made no other call (no heartbeat, no fetch, no upload) for this
    long is dropped, so that a join with a made-up name (anyone may claim any name with
    ``insecure``) cannot hold a round open until ``heartbeat_timeout_s``. Unset: no shorter grace,
    such a site is dropped after ``heartbeat_timeout_s`` like any silent one. Three heartbeat
    intervals is a good value: a live site heartbeats once per interval from its join on."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        require(self.max_rpcs_per_peer >= 4, "max_rpcs_per_peer", f"must be >= 4 (a site keeps "
                f"several calls open at once), got {self.max_rpcs_per_peer}")
        require(
            self.max_streams is None or self.max_streams >= 1,
            "max_streams", f"must be >= 1 or unset, got {self.max_streams}",
        )
        require(
            self.max_concurrent_rpcs is None or self.max_concurrent_rpcs >= 1,
            "max_concurrent_rpcs", f"must be >= 1 or unset, got {self.max_concurrent_rpcs}",
        )
        require(
            self.stream_idle_timeout_s > 0,
            "stream_idle_timeout_s", f"must be > 0 seconds, got {self.stream_idle_timeout_s}",
        )
        require(
            self.silent_join_grace_s is None or self.silent_join_grace_s > 0,
            "silent_join_grace_s", f"must be > 0 seconds or unset, got {self.silent_join_grace_s}",
        )

    def resolve(
        self, *, max_sites: int, heartbeat_interval_s: float, heartbeat_timeout_s: float, identities: int | None = None
    ) -> AdmissionLimits:
        """The limits in force for a coordinator with these settings; errors name the key.
        ``identities``: the certificate names that may call (default ``max_sites``)."""
        identities = max(1, max_sites if identities is None else identities)
        workers = server_workers(max_sites)
        max_streams = workers - 8 if self.max_streams is None else self.max_streams
        require(
            max_streams < workers,
            "admission.max_streams",
            f"must be below the server's {workers} worker threads (4 x max_sites + 8) so that a "
            f"thread stays free to refuse calls; got {max_streams}; raise max_sites or lower it",
        )
        control_workers = max(self.max_rpcs_per_peer, CONTROL_PER_PEER * identities) + CONTROL_HEADROOM
        total = 2 * workers + control_workers if self.max_concurrent_rpcs is None else self.max_concurrent_rpcs
        require(
            total > max_streams,
            "admission.max_concurrent_rpcs",
            f"must exceed max_streams ({max_streams}) so that heartbeats still get in when the "
            f"streams are all taken; got {total}",
        )
        grace = heartbeat_timeout_s if self.silent_join_grace_s is None else self.silent_join_grace_s
        require(
            heartbeat_interval_s < grace <= heartbeat_timeout_s,
            "admission.silent_join_grace_s",
            f"must be above heartbeat_interval_s ({heartbeat_interval_s} s: a site's first heartbeat "
            f"comes that long after its join) and at most heartbeat_timeout_s ({heartbeat_timeout_s} s), "
            f"got {grace}",
        )
        return AdmissionLimits(
            workers=workers,
            control_workers=control_workers,
            max_concurrent_rpcs=total,
            max_streams=max_streams,
            max_rpcs_per_peer=self.max_rpcs_per_peer,
            stream_idle_timeout_s=self.stream_idle_timeout_s,
            silent_join_grace_s=grace,
            identities=identities,
        )

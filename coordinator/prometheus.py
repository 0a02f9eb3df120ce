"""The coordinator's Prometheus metrics, fed by the round state machine's events.

``CoordinatorMetrics`` owns its own ``CollectorRegistry`` (several coordinators in one test
process must not share the global one) and is a ``geoloco.coordinator.events`` listener: every
value below comes from an event the state machine emitted, or is read from it at scrape time.
``geoloco.coordinator.http_status`` serves ``render()`` at ``/metrics``.

Metric names (all prefixed ``geoloco_coordinator_``; ``site`` is the certificate's site name):

=========================================  =========  ================================================
name                                       type       meaning
=========================================  =========  ================================================
``round``                                  gauge      round currently open (wire numbering, from 0)
``rounds_completed_total``                 counter    rounds aggregated by this process
``round_duration_seconds``                 histogram  open -> close of each aggregated round
``sites_connected``                        gauge      members now (joined, not left or dropped)
``sites_participating``                    gauge      sites aggregated in the last round
``sites_excluded``                         gauge      stragglers excluded from the last round
``site_bytes_received_total{site}``        counter    serialized protobuf bytes received from the site
``site_bytes_sent_total{site}``            counter    serialized protobuf bytes sent to the site
``site_upload_duration_seconds{site}``     histogram  first upload message -> update aggregated
``site_updates_aggregated_total{site}``    counter    rounds the site's update counted in
``update_norm``                            gauge      L2 norm of the last averaged pseudo-gradient
``eval_loss``                              gauge      last held-out loss (NaN before the first eval)
``checkpoint_age_seconds``                 gauge      seconds since the last checkpoint (NaN: none)
``rejected_requests_total{method,code,reason}`` counter  calls refused with a gRPC status
``privacy_epsilon_spent{delta}``           gauge      ε spent so far; absent unless privacy is on
=========================================  =========  ================================================

Bytes are the serialized protobuf messages the servicer counts (what ``metrics.jsonl`` reports),
without HTTP/2 and TLS framing. ``privacy_epsilon_spent`` is published by
``set_privacy_epsilon`` -- the privacy accountant calls it after every round when differential
privacy is enabled -- and does not exist in the output before that, so dashboards can tell "no
privacy" from "ε = 0".
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from geoloco.coordinator import events as ev

__all__ = ["CONTENT_TYPE_LATEST", "METRIC_PREFIX", "CoordinatorMetrics"]

METRIC_PREFIX = "geoloco_coordinator"

ROUND_DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, math.inf)
"""Seconds: from sub-second test rounds to hour-long rounds over slow links."""
UPLOAD_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, math.inf)


class CoordinatorMetrics:
    """Prometheus metrics of one coordinator; ``on_event`` is its ``EventHub`` listener."""

    def __init__(
        self,
        *,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.clock = clock
        r, p = self.registry, METRIC_PREFIX
        self.round = Gauge(f"{p}_round", "Round currently open (wire numbering, from 0).", registry=r)
        self.rounds_completed = Counter(
            f"{p}_rounds_completed", "Rounds aggregated by this coordinator process.", registry=r
        )
        self.round_duration = Histogram(
            f"{p}_round_duration_seconds",
            "Seconds from a round's opening to its close, per aggregated round.",
            buckets=ROUND_DURATION_BUCKETS,
            registry=r,
        )
        self.sites_connected = Gauge(
            f"{p}_sites_connected", "Sites that are members now (joined, not left or dropped).", registry=r
        )
        self.sites_participating = Gauge(
            f"{p}_sites_participating", "Sites whose update was aggregated in the last round.", registry=r
        )
        self.sites_excluded = Gauge(
            f"{p}_sites_excluded",
            "Members excluded from the last round (no complete upload at its close: stragglers).",
            registry=r,
        )
        self.bytes_received = Counter(
            f"{p}_site_bytes_received",
            "Serialized message bytes received from each site.",
            ["site"],
            registry=r,
        )
        self.bytes_sent = Counter(
            f"{p}_site_bytes_sent", "Serialized message bytes sent to each site.", ["site"], registry=r
        )
        self.upload_duration = Histogram(
            f"{p}_site_upload_duration_seconds",
            "Seconds from a site's upload manifest to its update being aggregated.",
            ["site"],
            buckets=UPLOAD_DURATION_BUCKETS,
            registry=r,
        )
        self.updates_aggregated = Counter(
            f"{p}_site_updates_aggregated",
            "Rounds in which the site's update was aggregated.",
            ["site"],
            registry=r,
        )
        self.update_norm = Gauge(
            f"{p}_update_norm", "L2 norm of the last averaged pseudo-gradient.", registry=r
        )
        self.update_norm.set(math.nan)
        self.eval_loss = Gauge(
            f"{p}_eval_loss", "Held-out loss of the global weights at the last evaluation.", registry=r
        )
        self.eval_loss.set(math.nan)
        self.checkpoint_age = Gauge(
            f"{p}_checkpoint_age_seconds",
            "Seconds since the last checkpoint was written (NaN before the first).",
            registry=r,
        )
        self.checkpoint_age.set_function(self._checkpoint_age)
        self.rejected = Counter(
            f"{p}_rejected_requests",
            "gRPC calls refused with a status (code: gRPC status; reason: geoloco ErrorReason).",
            ["method", "code", "reason"],
            registry=r,
        )
        self.privacy_epsilon = Gauge(
            f"{p}_privacy_epsilon_spent",
            "Differential-privacy epsilon spent so far at the given delta (set by the privacy "
            "accountant when privacy is enabled; absent otherwise).",
            ["delta"],
            registry=r,
        )
        self._lock = threading.Lock()
        self._upload_started: dict[str, tuple[int | None, float]] = {}
        self._last_checkpoint_s: float | None = None

    # ---------------------------------------------------------------------------------------
    # Feeding

    def watch(self, members: Callable[[], int], current_round: Callable[[], int]) -> None:
        """Read the live membership count and open round at scrape time."""
        self.sites_connected.set_function(lambda: float(members()))
        self.round.set_function(lambda: float(current_round()))

    def _checkpoint_age(self) -> float:
        last = self._last_checkpoint_s
        return math.nan if last is None else max(0.0, self.clock() - last)

    def set_privacy_epsilon(self, epsilon: float, delta: float) -> None:
        """Publish the ε spent so far at ``delta`` (called by the privacy accountant)."""
        if not (math.isfinite(epsilon) and epsilon >= 0):
            raise ValueError(f"epsilon must be a finite number >= 0, got {epsilon}")
        if not (0 < delta < 1):
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        self.privacy_epsilon.labels(delta=f"{delta:g}").set(epsilon)

    def on_event(self, event: ev.RoundEvent) -> None:
        kind, site, data = event.kind, event.site, event.data
        if kind == ev.BYTES_RECEIVED and site is not None:
            self.bytes_received.labels(site=site).inc(data["nbytes"])
        elif kind == ev.BYTES_SENT and site is not None:
            self.bytes_sent.labels(site=site).inc(data["nbytes"])
        elif kind == ev.UPLOAD_OPENED and site is not None:
            with self._lock:
                self._upload_started[site] = (event.round, event.time_s)
        elif kind == ev.UPDATE_AGGREGATED and site is not None:
            with self._lock:
                started = self._upload_started.pop(site, None)
            self.updates_aggregated.labels(site=site).inc()
            if started is not None and started[0] == event.round:
                self.upload_duration.labels(site=site).observe(max(0.0, event.time_s - started[1]))
        elif kind in (ev.UPDATE_REJECTED, ev.SITE_LEFT, ev.SITE_DROPPED) and site is not None:
            with self._lock:
                self._upload_started.pop(site, None)
        elif kind == ev.CHECKPOINT_SAVED:
            self._last_checkpoint_s = event.time_s
        elif kind == ev.REQUEST_REJECTED:
            self.rejected.labels(method=data["method"], code=data["code"], reason=data["reason"]).inc()
        elif kind == ev.ROUND_AGGREGATED:
            self._on_round(data)

    def _on_round(self, record: Any) -> None:
        self.rounds_completed.inc()
        self.round_duration.observe(max(0.0, float(record["round_time_s"])))
        self.sites_participating.set(len(record["participants"]))
        self.sites_excluded.set(len(record["excluded"]))
        norm = record.get("update_norm")
        if norm is not None:
            self.update_norm.set(float(norm))
        loss = record.get("eval_loss")
        if loss is not None:
            self.eval_loss.set(float(loss))
        epsilon = record.get("epsilon")
        if epsilon is not None:
            self.set_privacy_epsilon(float(epsilon), float(record["privacy_delta"]))

    # ---------------------------------------------------------------------------------------
    # Output

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format (``CONTENT_TYPE_LATEST``)."""
        return generate_latest(self.registry)

"""A site agent's own Prometheus metrics, fed by its hooks, served on ``/metrics`` when asked.

``SiteMetrics`` wraps the agent's ``SiteHooks`` (the user's callbacks still run) and turns every
``RoundResult`` into metrics; ``serve(host, port)`` starts ``prometheus_client``'s small HTTP
server on its own registry. Nothing here touches the training loop: a round's compute time is the
agent's own measurement of its inner steps (``RoundResult.inner_time_s``, synchronised on CUDA),
and the rest of the round -- upload, waiting for the other sites and the aggregate, download --
is time spent on the network.

Metric names (prefixed ``geoloco_site_``, labelled with ``site``):

* ``round`` (gauge): the round whose weights the site holds (the round it trains next);
* ``rounds_trained_total``, ``rounds_included_total`` (counters): rounds trained, and of those,
  aggregated by the coordinator;
* ``inner_steps_total`` (counter) and ``inner_step_rate`` (gauge, steps/s over the last round);
* ``compute_seconds_total`` / ``network_wait_seconds_total`` (counters): where the wall time of
  the rounds went;
* ``bytes_sent_total`` / ``bytes_received_total`` (counters): upload and broadcast bytes;
* ``train_loss`` (gauge): mean inner loss of the last round.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from geoloco.site_agent.config import JoinInfo, RoundResult, SiteHooks

__all__ = ["SiteMetrics"]

logger = logging.getLogger(__name__)

METRIC_PREFIX = "geoloco_site"


class SiteMetrics:
    """Prometheus metrics of one site; pass ``metrics.hooks(existing)`` to ``SiteAgent``."""

    def __init__(self, site: str, *, registry: CollectorRegistry | None = None) -> None:
        self.site = site
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r, p, labels = self.registry, METRIC_PREFIX, ["site"]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"{p}_{name}", doc, labels, registry=r).labels(site=site)

        def counter(name: str, doc: str) -> Any:
            return Counter(f"{p}_{name}", doc, labels, registry=r).labels(site=site)

        self.round = gauge("round", "Round whose global weights the site holds (it trains it next).")
        self.rounds_trained = counter("rounds_trained", "Rounds this site trained for.")
        self.rounds_included = counter("rounds_included", "Trained rounds the coordinator aggregated.")
        self.inner_steps = counter("inner_steps", "Inner optimizer steps taken.")
        self.inner_step_rate = gauge("inner_step_rate", "Inner steps per second in the last round.")
        self.compute_seconds = counter("compute_seconds", "Seconds spent in inner steps.")
        self.network_seconds = counter(
            "network_wait_seconds",
            "Seconds of rounds not spent computing: uploading, waiting for the aggregate, downloading.",
        )
        self.bytes_sent = counter("bytes_sent", "Update bytes uploaded to the coordinator.")
        self.bytes_received = counter("bytes_received", "Broadcast bytes received from the coordinator.")
        self.train_loss = gauge("train_loss", "Mean inner loss of the last round.")
        self.train_loss.set(math.nan)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def hooks(self, inner: SiteHooks | None = None) -> SiteHooks:
        """Hooks that update the metrics, then call ``inner``'s."""
        inner = inner or SiteHooks()

        def on_join(info: JoinInfo) -> None:
            self.on_join(info)
            if inner.on_join is not None:
                inner.on_join(info)

        def on_round_end(result: RoundResult) -> None:
            self.on_round_end(result)
            if inner.on_round_end is not None:
                inner.on_round_end(result)

        return SiteHooks(on_join=on_join, on_round_end=on_round_end)

    def on_join(self, info: JoinInfo) -> None:
        self.round.set(info.round)

    def on_round_end(self, result: RoundResult) -> None:
        self.round.set(result.next_round)
        self.rounds_trained.inc()
        if result.included:
            self.rounds_included.inc()
        self.inner_steps.inc(result.inner_steps)
        if result.inner_time_s > 0:
            self.inner_step_rate.set(result.inner_steps / result.inner_time_s)
        self.compute_seconds.inc(max(0.0, result.inner_time_s))
        self.network_seconds.inc(max(0.0, result.round_time_s - result.inner_time_s))
        self.bytes_sent.inc(result.bytes_up)
        self.bytes_received.inc(result.bytes_down)
        self.train_loss.set(result.train_loss)

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve ``/metrics`` on ``host:port`` (0 = a free port, returned). Loopback by default:
        put a reverse proxy with authentication in front to expose it."""
        if self._server is not None:
            raise RuntimeError("the site metrics server is already started")
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as err:
            raise OSError(f"cannot serve site metrics on {host}:{port}: {err}; pick another port") from None
        bound = int(self._server.server_address[1])
        logger.info("site %s metrics on http://%s:%d/metrics", self.site, host, bound)
        return bound

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = self._thread = None

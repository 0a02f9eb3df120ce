"""The coordinator process as a Python object: gRPC server, round driver thread, metrics.

``CoordinatorServer(config, initial_weights, layout, eval_fn)`` takes the checkpoint folder's
lock (``CheckpointFolderLock``: a second coordinator on the folder is refused, naming the holder)
and owns a ``RoundStateMachine``; ``start()`` binds the port (0 = a free one, returned) and the
status page's, only then (``resume = false``) moves a previous run's checkpoints and metrics file
aside and opens the metrics file, and starts a driver thread that wakes on every state change and
at every deadline to run ``RoundStateMachine.poll`` (drop silent sites, close and aggregate
rounds) and append each round's metrics to the JSON-lines file. A start that cannot serve
leaves the checkpoint folder and the metrics file as they were.
``wait_until_finished`` blocks until the last round is broadcast and the sites left (or the drain
timeout passed); ``stop`` wakes every waiting call with UNAVAILABLE and shuts the server down with
a grace period. It is also a context manager.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import torch
from torch import nn

from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.record import RoundRecord
from geoloco.coordinator import events as ev
from geoloco.coordinator.admission import Admission
from geoloco.coordinator.checkpoint import CheckpointFolderLock
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.http_status import CoordinatorStatus
from geoloco.coordinator.metrics import MetricsWriter
from geoloco.coordinator.resume import set_aside_previous_run
from geoloco.coordinator.rounds import EvalFn, RoundStateMachine
from geoloco.coordinator.servicer import CoordinatorServicer
from geoloco.protos.transport_endpoints import add_coordinator_servicer, build_server, stop_server
from geoloco.protos.transport_errors import default_interceptors
from geoloco.protos.transport_malloc import return_free_heap
from geoloco.protos.transport_options import SHUTDOWN_GRACE_S

__all__ = ["CoordinatorServer"]

logger = logging.getLogger(__name__)


class CoordinatorServer:
    """One coordinator: serve sites over gRPC until the run's last round is broadcast."""

    def __init__(
        self,
        config: CoordinatorConfig,
        initial_weights: torch.Tensor,
        layout: ParamLayout,
        eval_fn: EvalFn | None = None,
        *,
        on_round_end: Callable[[RoundRecord], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``initial_weights``: flat fp32 ``θ_0`` (``layout.flatten(model)``), ignored when
        ``config.checkpoint_dir`` holds a checkpoint. ``eval_fn(flat_weights) -> loss`` is
        called every ``eval_every`` rounds; ``on_round_end(record)`` after every round, with the
        round's ``RoundRecord`` (``record.to_dict()`` is the ``metrics.jsonl`` line).
        Raises ``CheckpointError`` when another coordinator holds ``config.checkpoint_dir`` or
        its checkpoint cannot be resumed."""
        self.config = config
        self._metrics: MetricsWriter | None = None  # opened by start(), after a fresh run's rotation
        self._user_on_round_end = on_round_end
        self.previous_run: Path | None = None
        """Where ``start()`` moved a previous run's files (``resume = false``), or None."""
        self._folder_lock = (
            CheckpointFolderLock.acquire(config.checkpoint_dir) if config.checkpoint_dir is not None else None
        )
        try:
            self.rounds = RoundStateMachine(
                config, initial_weights, layout, eval_fn=eval_fn, clock=clock, set_aside_previous_run=False
            )
        except BaseException:
            self._release_folder()
            raise
        self._server: grpc.Server | None = None
        self._port: int | None = None
        self._driver: threading.Thread | None = None
        self._stop = threading.Event()
        self._driver_error: BaseException | None = None
        self.http_status = CoordinatorStatus(config, self.rounds) if config.http.enabled else None
        """``/metrics`` and the status page (``config.http``), or None when disabled."""
        self.admission = Admission(
            config.admission_limits,
            allowed_sites=config.allowed_sites,
            insecure=config.insecure,
            events=self.rounds.events,
            relays=config.relays,
        )
        """Bounds on the calls the gRPC server takes on (``config.admission``)."""

    @classmethod
    def from_model(
        cls,
        config: CoordinatorConfig,
        model: nn.Module,
        eval_fn: EvalFn | None = None,
        **kwargs: Any,
    ) -> CoordinatorServer:
        """A server whose ``θ_0`` and layout come from ``model``'s parameters."""
        layout = ParamLayout.from_model(model)
        return cls(config, layout.flatten(model).cpu(), layout, eval_fn, **kwargs)

    @property
    def session_id(self) -> str:
        return self.rounds.session_id

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the server is not started; call start() first")
        return self._port

    @property
    def address(self) -> str:
        """``host:port`` for sites to dial (the coordinator's TLS certificate names it)."""
        host = self.config.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return f"{host}:{self.port}"

    @property
    def status_url(self) -> str | None:
        """URL of the status page (``/metrics`` next to it), or None when disabled."""
        return None if self.http_status is None else self.http_status.http.url

    def start(self) -> int:
        """Bind, start serving and return the port. The previous run's files are moved aside
        (``resume = false``) only once both ports are bound."""
        if self._server is not None:
            raise RuntimeError("the server is already started")
        if self._stop.is_set():
            raise RuntimeError("the server was stopped; build a new one")
        config = self.config
        limits = self.admission.limits
        server, port = build_server(
            tls=config.tls_files,
            insecure=config.insecure,
            host=config.host,
            port=config.port,
            max_workers=limits.workers,
            # gRPC nests later interceptors inside earlier ones: admission refusals are raised
            # inside the rejection counter and the error mapping, so they are counted and mapped.
            interceptors=[
                *default_interceptors(insecure=config.insecure),
                ev.RejectedRequestInterceptor(self.rounds.events),
                self.admission.interceptor,
            ],
            maximum_concurrent_rpcs=limits.max_concurrent_rpcs,
        )
        try:
            if self.http_status is not None:
                self.http_status.start()  # before serving: a busy HTTP port fails the start cleanly
            self.previous_run = set_aside_previous_run(config)
            if config.metrics_path:
                self._metrics = MetricsWriter(config.metrics_path, tensorboard_dir=config.tensorboard_dir)
            add_coordinator_servicer(
                CoordinatorServicer(
                    self.rounds,
                    insecure=config.insecure,
                    chunk_size=config.chunk_size,
                    progress_interval_s=config.progress_interval_s,
                ),
                server,
            )
            server.start()
        except BaseException:
            server.stop(None)  # releases the bound port
            if self.http_status is not None:
                self.http_status.http.stop()
            if self._metrics is not None:
                self._metrics.close()
                self._metrics = None
            raise
        self.admission.start()
        return_free_heap()  # what the caller freed building the model (transport_malloc)
        self._server, self._port = server, port
        self._driver = threading.Thread(target=self._drive, name="geoloco-round-driver", daemon=True)
        self._driver.start()
        logger.info(
            "coordinator listening on %s:%d (%s), session %s",
            config.host, port, "insecure" if config.insecure else "mutual TLS", self.session_id,
        )
        return port

    def _drive(self) -> None:
        try:
            while not self._stop.is_set():
                record = self.rounds.poll()
                if record is not None:
                    self._publish(record)
                    continue
                self.rounds.wait_for_change(self.rounds.next_poll_in())
        except BaseException as err:  # surfaced by wait_until_finished / stop
            logger.exception("the round driver failed")
            self._driver_error = err
            self.rounds.close()

    def _publish(self, record: RoundRecord) -> None:
        if self._metrics is not None:
            self._metrics.write(record)
        if self._user_on_round_end is not None:
            self._user_on_round_end(record)

    def wait_until_finished(self, timeout: float | None = None) -> bool:
        """Block until the last round is broadcast and every site left (or ``drain_timeout_s``
        passed). True when finished, False on ``timeout``; re-raises a driver failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._raise_driver_error()
            if self.rounds.drained():
                return True
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self.rounds.wait_for_change(0.25 if remaining is None else min(0.25, remaining))

    def _raise_driver_error(self) -> None:
        if self._driver_error is not None:
            raise RuntimeError("the coordinator's round driver failed") from self._driver_error

    def stop(self, grace: float = SHUTDOWN_GRACE_S) -> None:
        """Wake waiting calls (UNAVAILABLE), stop the driver and the server, close metrics."""
        self._stop.set()
        self.rounds.close()
        if self._driver is not None:
            self._driver.join(timeout=30)
        self.rounds.wait_for_snapshot()  # one the driver started while stopping
        if self._server is not None:
            stop_server(self._server, grace)
        self.admission.stop()
        if self._metrics is not None:
            self._metrics.close()
        if self.http_status is not None:
            self.http_status.stop()
        self._release_folder()
        logger.info("coordinator session %s stopped", self.session_id)

    def _release_folder(self) -> None:
        if self._folder_lock is not None:
            self._folder_lock.release()

    def __enter__(self) -> CoordinatorServer:
        if self._server is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop(grace=0.5)

"""The relay process: its gRPC server for the sites, its connection to the coordinator, and the
driver thread that sends each round's partial sum upward when it is due."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import grpc

from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.errors import StatusError, clip
from geoloco.protos.transport_endpoints import add_coordinator_servicer, build_server, stop_server
from geoloco.relay.config import RelayConfig
from geoloco.relay.hub import RelayHub
from geoloco.relay.partial import RelayRound
from geoloco.relay.servicer import RelayServicer
from geoloco.relay.upstream import Traffic, Upstream

__all__ = ["DRIVER_TICK_S", "RelayServer", "refusal_of_the_partial"]

logger = logging.getLogger(__name__)

DRIVER_TICK_S = 0.05
"""How often the driver looks for a due partial when nothing woke it."""
REFUSAL_REASON_CHARS = 300
"""Characters of the coordinator's refusal passed on as each site's reason."""
NOT_ABOUT_THE_PARTIAL = frozenset(
    {pb.ERROR_REASON_STALE_SESSION, pb.ERROR_REASON_RUN_FINISHED, pb.ERROR_REASON_SITE_REPLACED,
     pb.ERROR_REASON_IDENTITY_MISMATCH, pb.ERROR_REASON_PROTOCOL_VERSION}
)
"""Refusals of the relay itself (its session, its identity, the run): reporting its sites
would be refused for the same reason."""


def refusal_of_the_partial(err: StatusError) -> bool:
    """Whether the coordinator refused the partial's content or its place in the round (its
    values, a site's weight, a site already counted by another path), as opposed to a broken
    link (the upload already retried) or a refusal of the relay itself."""
    return err.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION) and (
        err.reason not in NOT_ABOUT_THE_PARTIAL
    )


class RelayServer:
    """One relay: ``start()`` returns the port its sites dial, ``stop()`` ends it."""

    def __init__(self, config: RelayConfig, *, on_update: Callable[[int, str], None] | None = None) -> None:
        """``on_update(round, site)``: a site's verified update entered the round's partial."""
        self.config = config
        self.traffic = Traffic()
        self.upstream = Upstream(config, self.traffic)
        self.hub = RelayHub(config, self.upstream, self.traffic, on_update=on_update)
        self._server: grpc.Server | None = None
        self._port: int | None = None
        self._stop = threading.Event()
        self._driver: threading.Thread | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the relay is not started; call start() first")
        return self._port

    @property
    def address(self) -> str:
        host = self.config.host if self.config.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        return f"{host}:{self.port}"

    def start(self) -> int:
        config = self.config
        server, port = build_server(
            tls=config.tls_files, insecure=config.insecure, host=config.host, port=config.port,
            max_workers=4 * config.max_sites + 8,
        )
        add_coordinator_servicer(
            RelayServicer(
                self.hub, self.upstream, self.traffic, insecure=config.insecure,
                progress_interval_s=config.progress_interval_s,
            ),
            server,
        )
        server.start()
        self._server, self._port = server, port
        self._driver = threading.Thread(target=self._drive, name=f"geoloco-relay-{config.name}", daemon=True)
        self._driver.start()
        logger.info(
            "relay %s listening on %s:%d (%s), coordinator %s",
            config.name, config.host, port, "insecure" if config.insecure else "mutual TLS", config.coordinator,
        )
        return port

    def _drive(self) -> None:
        """Send each round's partial upward once it is due; write the metrics records."""
        while not self._stop.is_set():
            with self.hub.cond:
                self.hub.cond.wait(timeout=DRIVER_TICK_S)
            try:
                self.forward_if_due()
            except Exception:  # one round's failure must not end the relay
                logger.exception("relay %s: forwarding a partial sum failed", self.config.name)
            self._write_records()

    def forward_if_due(self) -> bool:
        """Upload the open round's partial if it is due; whether one went up."""
        taken = self.hub.take_due()
        if taken is None:
            return False
        r, manifest, data = taken
        sites = [s.site for s in manifest.relayed_sites if not s.rejected]
        disowned = False
        refused: frozenset[str] = frozenset()
        try:
            if sites:
                # The broadcast wait goes upward with the partial, asked for a site of it (whose
                # ``included`` then speaks for the partial), as a site's goes ahead of its upload.
                self.hub.fetch_broadcast(r.number, sites[0])
            self.upstream.upload(manifest, data)
            outcome = "accepted"
            logger.info(
                "relay %s: round %d partial of %s (weight %.6g) accepted", self.config.name, r.number,
                ", ".join(sites), manifest.sample_weight,
            )
        except StatusError as err:
            outcome = f"refused: {err}"
            logger.warning("relay %s: round %d partial refused by the coordinator: %s", self.config.name, r.number, err)
            if refusal_of_the_partial(err):
                judged = err.code == grpc.StatusCode.INVALID_ARGUMENT  # its content, not its place
                disowned = self._report_refusals(r, err, judged=judged)
                if judged:
                    refused = frozenset(sites)
        except Exception as err:
            # Still answered below: the round's broadcast waits for the partial's outcome.
            outcome = f"failed: {err}"
            logger.exception("relay %s: sending round %d's partial failed", self.config.name, r.number)
        self.hub.forwarded(r, outcome, sites, disowned=disowned, refused=refused)
        return True

    def _report_refusals(self, r: RelayRound, err: StatusError, *, judged: bool) -> bool:
        """Tell the coordinator that the refused partial's sites are out of round ``r``
        (``RelayHub.refusals_only``; ``judged``: refused for its content): one site the
        coordinator refuses (its own upload counted after a failover, a weight beyond the other
        regions') would otherwise leave the rest of the region neither counted nor refused, and
        the round waiting for them. Whether the coordinator took the report (then the partial
        surely never counted)."""
        why = f"its relay's partial sum was refused: {clip(str(err), REFUSAL_REASON_CHARS)}"
        try:
            built = self.hub.refusals_only(r, why, judged=judged)
            if built is None:
                return False
            self.upstream.upload(*built)
            logger.info("relay %s: round %d's sites reported to the coordinator", self.config.name, r.number)
            return True
        except Exception as report_err:  # noqa: BLE001 - the round's answer below must still come
            # The round's deadline, or the coordinator dropping the silent sites, then ends it.
            logger.warning(
                "relay %s: reporting round %d's sites failed: %s", self.config.name, r.number, report_err
            )
            return False

    def _write_records(self) -> None:
        with self.hub.cond:
            records, self.hub.records = self.hub.records, []
        if not records or self.config.metrics_path is None:
            return
        path = Path(self.config.metrics_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, sort_keys=True) + "\n")

    def stop(self, grace: float = 1.0) -> None:
        self._stop.set()
        self.hub.close()
        if self._server is not None:
            stop_server(self._server, grace)
        if self._driver is not None:
            self._driver.join(timeout=5)
        self._write_records()
        self.upstream.close()

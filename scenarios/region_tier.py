"""The relay tier of an emulated run: a ``geoloco relay`` process per ``[[regions]]`` entry, its
shaped link to the coordinator, and the coordinator's own shared link (``[coordinator_link]``).

The links form a chain of ``LinkRelay`` shapers on the emulator's event loop::

    site -> site link -> relay process -> region link "relay:NAME" -> "coordinator" link -> coordinator

A flat site's link (no regions, or a shaped coordinator link) ends at the ``coordinator`` link
instead. Each site dials the pick-first list ``ipv4:SITE_LINK,COORDINATOR_LINK``: when its relay
is gone it goes on with the coordinator over the coordinator's link (its own link is then not
shaped). Relay processes start once the coordinator listens (they dial it at once), and each
site's link is pointed at its relay once that relay prints its listening line; until then a site
that dials falls back to the coordinator, so sites start only after the relays.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from geoloco.scenarios.child_commands import geoloco_command
from geoloco.scenarios.config_file import toml_text
from geoloco.scenarios.launcher import ChildProcess, stop_all, wait_for
from geoloco.scenarios.scenario import Scenario
from geoloco.scenarios.shaping import LinkRelay, LinkShape, RelayHub

__all__ = ["COORDINATOR_LINK", "RegionTier", "region_link"]

COORDINATOR_LINK = "coordinator"
"""The hub name of the coordinator's own link (not a valid site name: the scenario forbids it)."""
UNSHAPED_BPS = 1e12
"""Bandwidth of a coordinator-link direction left unset: far above anything emulated here."""
RELAY_LISTENING_RE = re.compile(r"geoloco-relay listening on (?P<host>[\w.\-\[\]:]+?):(?P<port>\d+)\b")
"""``geoloco relay``'s start-up line (``scenarios/relay_cmd.py``)."""
RELAY_START_TIMEOUT_S = 120.0


class RelayTierError(RuntimeError):
    """A relay process failed; the message says which and where its log is."""


def region_link(name: str) -> str:
    """The hub name of region ``name``'s relay-to-coordinator link (``relay:NAME``, as the
    coordinator's metrics name the relay)."""
    return f"relay:{name}"


@dataclass(slots=True)
class RegionTier:
    """The relays and the tier links of one emulated run (module doc)."""

    scenario: Scenario
    out: Path
    certs_dir: Path
    log_level: str
    env: dict[str, str]
    links: dict[str, LinkRelay] = field(default_factory=dict)
    """Tier links by hub name: ``coordinator`` and ``relay:NAME``."""
    relays: dict[str, ChildProcess] = field(default_factory=dict)
    relay_ports: dict[str, int] = field(default_factory=dict)

    def issue_certificates(self) -> None:
        from geoloco.scenarios.certs import issue_relay

        for region in self.scenario.regions:
            issue_relay(self.certs_dir, region.name, force=True)

    def add_links(self, hub: RelayHub) -> None:
        """The coordinator's link and one link per region, on ``hub`` (targets set by ``point``)."""
        spec = self.scenario.coordinator_link
        seed = self.scenario.run.seed
        ingress = LinkShape(spec.ingress_bps if spec.ingress_bps is not None else UNSHAPED_BPS)
        egress = LinkShape(spec.egress_bps if spec.egress_bps is not None else UNSHAPED_BPS)
        self.links[COORDINATOR_LINK] = hub.add(COORDINATOR_LINK, ingress, egress, seed=seed)
        for region in self.scenario.regions:
            name = region_link(region.name)
            self.links[name] = hub.add(
                name,
                LinkShape(region.uplink_bps, region.latency_s),
                LinkShape(region.downlink_bps, region.latency_s),
                seed=seed,
            )

    def site_address(self, site_link: LinkRelay) -> str:
        """What a site dials: its link, then the coordinator's link (pick-first)."""
        front = self.links[COORDINATOR_LINK]
        return f"ipv4:{site_link.host}:{site_link.port},{front.host}:{front.port}"

    def targets(self, coordinator_port: int, site_names: list[str]) -> dict[str, tuple[str, int]]:
        """Where every link forwards to, once the coordinator listens on ``coordinator_port``:
        the coordinator's link to it, region links to the coordinator's link, each site's link to
        its relay (once listening) or to the coordinator's link."""
        front = self.links[COORDINATOR_LINK]
        upward = (front.host, front.port)
        result: dict[str, tuple[str, int]] = {COORDINATOR_LINK: ("127.0.0.1", coordinator_port)}
        for name in self.links:
            if name != COORDINATOR_LINK:
                result[name] = upward
        for site in site_names:
            region = self.scenario.region_of(site)
            port = self.relay_ports.get(region.name) if region is not None else None
            result[site] = ("127.0.0.1", port) if port is not None else upward
        return result

    def relay_config(self, index: int) -> dict[str, Any]:
        """The ``geoloco relay --config`` table of region ``index``: it dials its region's link."""
        region = self.scenario.regions[index]
        link = self.links[region_link(region.name)]
        return {
            "name": region.name,
            "coordinator": f"{link.host}:{link.port}",
            "sites": list(region.sites),
            "host": "127.0.0.1",
            "port": 0,
            "certs_dir": str(self.certs_dir.resolve()),
            "metrics_path": str(self.relay_metrics_path(region.name).resolve()),
            "max_wait_s": region.max_wait_s,
            "upward_codec": region.upward_codec,
        }

    def relay_metrics_path(self, name: str) -> Path:
        return self.out / "relays" / f"{name}.jsonl"

    def start_relays(self, logs_dir: Path) -> None:
        """Start every relay and wait for its listening line (first start only)."""
        folder = self.out / "relays"
        folder.mkdir(parents=True, exist_ok=True)
        for index, region in enumerate(self.scenario.regions):
            config = folder / f"{region.name}.toml"
            config.write_text(toml_text(self.relay_config(index)))
            self.relay_metrics_path(region.name).unlink(missing_ok=True)
            child = ChildProcess(
                f"relay-{region.name}",
                geoloco_command("--log-level", self.log_level, "relay", "--config", str(config.resolve())),
                log_path=logs_dir / f"relay-{region.name}.log",
                env=self.env,
            )
            self.relays[region.name] = child
            child.start()
        for name, child in self.relays.items():
            match = wait_for(partial(self._listening, child), RELAY_START_TIMEOUT_S, what=f"relay {name} listening")
            assert isinstance(match, re.Match)
            self.relay_ports[name] = int(match["port"])

    @staticmethod
    def _listening(child: ChildProcess) -> re.Match[str] | None:
        if not child.running:
            raise RelayTierError(
                f"{child.name} exited with status {child.returncode} before it listened; its log "
                f"({child.log_path}) ends with:\n{child.log_tail()}"
            )
        return RELAY_LISTENING_RE.search(child.log_text())

    def check(self) -> None:
        """A relay that failed (non-zero exit) fails the run; one that finished is fine."""
        for child in self.relays.values():
            code = child.returncode
            if code not in (None, 0) and not child.expected_exit:
                raise RelayTierError(
                    f"{child.name} exited with status {code}; its log ({child.log_path}) ends with:\n"
                    f"{child.log_tail()}"
                )

    def stop(self) -> None:
        stop_all(list(self.relays.values()))

    def relay_records(self) -> dict[str, list[dict[str, Any]]]:
        """Each relay's metrics records (one per forwarded round)."""
        records: dict[str, list[dict[str, Any]]] = {}
        for region in self.scenario.regions:
            path = self.relay_metrics_path(region.name)
            lines = path.read_text().splitlines() if path.exists() else []
            records[region.name] = [json.loads(line) for line in lines if line.strip()]
        return records

"""One emulated run: certificates, shaped links, the coordinator and site processes, faults.

``Emulation(scenario, out).run()`` does, in order:

1. issue a CA and certificates into ``out/certs`` (mutual TLS, as in a real deployment);
2. start one ``LinkRelay`` per site (``geoloco.scenarios.shaping``); under ``--shaping kernel``
   first a network namespace and a tc-shaped veth pair per site (``geoloco.scenarios.netns``),
   with the relay listening at the emulator's end of the pair and the site started inside;
3. write ``out/coordinator.toml`` and start ``geoloco coordinator --config`` (port 0; the port is
   read back from its log line ``listening on HOST:PORT``), point every relay at it;
4. with ``[[regions]]``: start a ``geoloco relay`` per region behind its own shaped link
   (``region_tier``); then ``geoloco site`` per site, dialling its link (to its relay, if any);
5. poll: new lines of ``metrics.jsonl``, process exits, faults due, the time budget; report
   progress;
6. stop every child (also on Ctrl-C / SIGTERM / an error) and return an ``EmulationResult`` for
   ``geoloco.scenarios.report``.

Site states for the progress display come from the processes and the link traffic alone: a site
whose last transfer was an upload is *waiting* for the round's aggregate; after a download it is
*training*; a transfer in flight is *uploading* / *downloading*.

This module supervises the processes; the rest is elsewhere: what the children are told (config
file, command lines) in ``child_commands``, when faults fire and end in ``fault_schedule``, the
coordinator's metrics read as they grow in ``run_metrics``, the child processes themselves in
``launcher``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from geoloco.scenarios.child_commands import coordinator_table, geoloco_command, site_command
from geoloco.scenarios.config_file import toml_text
from geoloco.scenarios.emulation_result import (
    STATUS_COMPLETED,
    STATUS_FAILED,
    STATUS_INTERRUPTED,
    STATUS_TIME_BUDGET,
    EmulationResult,
)
from geoloco.scenarios.fault_schedule import (
    RESTORE_COORDINATOR,
    RESTORE_LINK,
    RESTORE_SITE,
    FaultEvent,
    FaultSchedule,
)
from geoloco.scenarios.launcher import STARTING_GRACE_S, STOP_GRACE_S, ChildProcess, stop_all, wait_for
from geoloco.scenarios.netns import (
    MODE_KERNEL,
    KernelLinkError,
    KernelLinks,
    ShapingPlan,
    choose_shaping,
    plan_links,
    relay_send_buffer,
    relay_shape,
    sweep_stale,
    used_networks,
)
from geoloco.scenarios.progress import (
    STATE_CUT,
    STATE_DONE,
    STATE_DOWN,
    STATE_DOWNLOADING,
    STATE_STARTING,
    STATE_TRAINING,
    STATE_UPLOADING,
    STATE_WAITING,
    Progress,
    SiteStatus,
    Snapshot,
)
from geoloco.scenarios.region_tier import RegionTier, RelayTierError
from geoloco.scenarios.run_metrics import MetricsTail
from geoloco.scenarios.scenario import CUT_LINK, KILL_COORDINATOR, KILL_SITE, Fault, Scenario
from geoloco.scenarios.shaping import LinkRelay, LinkShape, RelayHub
from geoloco.scenarios.stop_signals import StopSignals

__all__ = [
    "STATUS_PAGE_RE",
    "Emulation",
    "EmulationError",
    "EmulationResult",
]

logger = logging.getLogger(__name__)

LISTENING_RE = re.compile(r"listening on (?P<host>[\w.\-\[\]:]+?):(?P<port>\d+)\b")
"""The coordinator CLI's start-up line (``... listening on 127.0.0.1:PORT``)."""

UPLOAD_COMPLETE_RE = re.compile(r"geoloco-coordinator round (?P<round>\d+) upload complete: (?P<site>\S+)")
"""The coordinator's stdout line for a complete upload (``after_upload`` faults wait for it)."""
STATUS_PAGE_RE = re.compile(r"status page on (?P<url>https?://\S+)")
"""The coordinator CLI's status page line (printed just before ``listening on``)."""

FINISHED_MARK = "geoloco-coordinator finished:"
"""The coordinator CLI's last line after a completed run."""

COORDINATOR_START_TIMEOUT_S = 120.0
POLL_INTERVAL_S = 0.1
PROGRESS_INTERVAL_S = 0.5
SITE_NICENESS = 5
"""Sites train at a lower CPU priority than the emulator, whose relays emulate the network: on a
machine with fewer cores than sites, a starved relay would stretch transfers the links do not."""


class EmulationError(RuntimeError):
    """The run could not start or a process failed; the message says which and where its log is."""


class Emulation:
    """See the module docstring."""

    def __init__(
        self,
        scenario: Scenario,
        out: Path,
        *,
        progress: Progress | None = None,
        log_level: str = "INFO",
        shaping: ShapingPlan | None = None,
        stop: StopSignals | None = None,
    ) -> None:
        """``shaping``: from ``netns.choose_shaping`` (default: the relay). ``stop``: the stop-signal
        handler, asked between start-up steps and on every poll (``stop_signals``)."""
        self.scenario = scenario
        self.stop = stop or StopSignals()  # not installed: check() never raises
        self.shaping = shaping or choose_shaping("relay", None)
        self.kernel_links: KernelLinks | None = None
        """The namespaces and veth pairs of kernel shaping, once planned."""
        self.out = out
        self.progress = progress
        self.log_level = log_level
        self.hub: RelayHub | None = None
        self.relays: dict[str, LinkRelay] = {}
        self.coordinator: ChildProcess | None = None
        self.sites: dict[str, ChildProcess] = {}
        self.metrics = MetricsTail(self.metrics_path, self.now)
        self.faults: list[FaultEvent] = []
        self._schedule = FaultSchedule(scenario.faults)
        self._t0 = time.monotonic()
        self._site_starts: dict[str, list[float]] = {s.name: [] for s in scenario.sites}
        self._site_stops: dict[str, list[float]] = {s.name: [] for s in scenario.sites}
        self._coordinator_starts: list[float] = []
        self._coordinator_serving = False
        self._events: list[str] = []
        self._last_progress = 0.0
        self._coordinator_log_seen = 0
        self.status_url: str | None = None
        self.tier: RegionTier | None = None
        """Relays and the coordinator's link, when the scenario has them (``region_tier``)."""
        self._coordinator_port = 0
        self._uploads_seen: dict[tuple[int, str], float] = {}
        """The coordinator's status page (``/metrics`` next to it), once it started."""

    # -- paths ------------------------------------------------------------------------------------

    @property
    def certs_dir(self) -> Path:
        return self.out / "certs"

    @property
    def metrics_path(self) -> Path:
        return self.out / "metrics.jsonl"

    @property
    def logs_dir(self) -> Path:
        return self.out / "logs"

    def now(self) -> float:
        return time.monotonic() - self._t0

    # -- set-up -----------------------------------------------------------------------------------

    def _issue_certificates(self) -> None:
        from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_site

        init_ca(self.certs_dir, force=True)
        # Sites in a namespace dial their relay at the emulator's end of their veth pair.
        hosts = [link.host_address for link in self.kernel_links.links] if self.kernel_links else []
        issue_coordinator(self.certs_dir, hosts=hosts, force=True)
        for site in self.scenario.sites:
            issue_site(self.certs_dir, site.name, force=True)
        if self.tier is not None:
            self.tier.issue_certificates()

    @property
    def records(self) -> list[dict[str, Any]]:
        """The coordinator's metrics records so far."""
        return self.metrics.records

    def coordinator_config(self) -> dict[str, Any]:
        """The ``geoloco coordinator --config`` table for this scenario."""
        return coordinator_table(
            self.scenario,
            certs_dir=self.certs_dir,
            checkpoint_dir=self.out / "checkpoints",
            metrics_path=self.metrics_path,
        )

    def site_command(self, index: int) -> list[str]:
        """``geoloco site ...`` for site ``index`` dialling its relay (inside its namespace under
        kernel shaping)."""
        name = self.scenario.sites[index].name
        relay = self.relays[name]
        link = self.kernel_links.links[index] if self.kernel_links else None
        address = self.tier.site_address(relay) if self.tier else f"{relay.host}:{relay.port}"
        command = site_command(
            self.scenario, index, coordinator=address, certs_dir=self.certs_dir, log_level=self.log_level,
        )
        server_name = ["--server-name", "localhost"] if self.tier else []  # an ipv4: list names no host
        return [*(link.exec_prefix() if link else []), *command, *server_name]

    def _child_env(self) -> dict[str, str]:
        from geoloco.protos.transport_malloc import recommended_env

        env = recommended_env()
        # Every site gets one compute thread: N sites share this machine's cores, and
        # oversubscribed torch thread pools make step times erratic.
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("MKL_NUM_THREADS", "1")
        return env

    def _start_coordinator(self) -> None:
        assert self.coordinator is not None and self.hub is not None
        log = self.coordinator.log_path
        self._coordinator_log_seen = len(log.read_bytes()) if log.exists() else 0
        self._coordinator_serving = False
        self.coordinator.start()
        self._coordinator_starts.append(self.now())
        match = wait_for(
            lambda: self._listening_line(),
            COORDINATOR_START_TIMEOUT_S,
            what="the coordinator's 'listening on' line",
        )
        assert isinstance(match, re.Match)
        port, self._coordinator_serving = int(match["port"]), True
        self._coordinator_port = port
        self._point_links()
        page = STATUS_PAGE_RE.search(match.string)
        if page is not None and page["url"] != self.status_url:
            self.status_url = page["url"]
            self._event(f"status page: {self.status_url}")
            logger.info("status page and /metrics on %s", self.status_url)
        logger.debug("coordinator listening on port %d", port)

    def _point_links(self) -> None:
        """Every link at its next hop: the coordinator, or the chain of ``region_tier``."""
        assert self.hub is not None
        if self.tier is None:
            self.hub.set_target("127.0.0.1", self._coordinator_port)
        else:
            self.hub.set_targets(self.tier.targets(self._coordinator_port, list(self.relays)))

    def _listening_line(self) -> re.Match[str] | None:
        assert self.coordinator is not None
        self.stop.check()
        if not self.coordinator.running:
            raise EmulationError(
                f"the coordinator exited with status {self.coordinator.returncode} before it "
                f"listened; its log ({self.coordinator.log_path}) ends with:\n"
                f"{self.coordinator.log_tail()}"
            )
        data = self.coordinator.log_path.read_bytes()[self._coordinator_log_seen :]
        return LISTENING_RE.search(data.decode(errors="replace"))

    def _start_site(self, name: str) -> None:
        self.sites[name].start()
        self._site_starts[name].append(self.now())

    def setup(self) -> None:
        s = self.scenario
        self.out.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(exist_ok=True)
        for stale in (self.metrics_path, self.out / "links.jsonl"):
            stale.unlink(missing_ok=True)
        (self.out / "scenario.json").write_text(json.dumps(s.to_dict(), indent=2) + "\n")
        env = self._child_env()
        if s.regions or s.coordinator_link.shaped:
            if self.shaping.uses_namespaces:
                raise EmulationError("[[regions]] and [coordinator_link] need --shaping relay (the default)")
            self.tier = RegionTier(s, self.out, self.certs_dir, self.log_level, env)
        shapes = [
            (
                LinkShape(site.uplink_bps, site.latency_s, site.jitter_s, site.loss, site.flow_window_bytes),
                LinkShape(site.downlink_bps, site.latency_s, site.jitter_s, site.loss, site.flow_window_bytes),
            )
            for site in s.sites
        ]
        logger.info("link shaping: %s", self.shaping.description)
        if self.shaping.uses_namespaces:
            self._create_kernel_links(shapes)
        self._issue_certificates()
        self.hub = RelayHub()
        for index, (site, (up, down)) in enumerate(zip(s.sites, shapes, strict=True)):
            link = self.kernel_links.links[index] if self.kernel_links else None
            self.relays[site.name] = self.hub.add(
                site.name,
                relay_shape(up, self.shaping.mode),
                relay_shape(down, self.shaping.mode),
                seed=s.run.seed,
                host=link.host_address if link else "127.0.0.1",
                send_buffer=relay_send_buffer(down, self.shaping.mode),
            )
        if self.tier is not None:
            self.tier.add_links(self.hub)
        config_path = self.out / "coordinator.toml"
        config_path.write_text(toml_text(self.coordinator_config()))
        self.coordinator = ChildProcess(
            "coordinator",
            geoloco_command("--log-level", self.log_level, "coordinator", "--config", str(config_path.resolve())),
            log_path=self.logs_dir / "coordinator.log",
            env=env,
        )
        for index, site in enumerate(s.sites):
            self.sites[site.name] = ChildProcess(
                site.name,
                self.site_command(index),
                log_path=self.logs_dir / f"{site.name}.log",
                env=env,
                nice=SITE_NICENESS,
            )

    def _create_kernel_links(self, shapes: list[tuple[LinkShape, LinkShape]]) -> None:
        """A namespace and shaped veth pair per site (``geoloco.scenarios.netns``), after
        removing any a killed emulator left behind."""
        sweep_stale()
        links = plan_links(shapes, pid=os.getpid(), used=used_networks())
        self.kernel_links = KernelLinks(links, netem=self.shaping.mode == MODE_KERNEL)
        try:
            self.kernel_links.create()
        except KernelLinkError as err:
            raise EmulationError(f"could not set up kernel link shaping: {err}") from err

    # -- the run ----------------------------------------------------------------------------------

    def run(self) -> EmulationResult:
        status, reason = STATUS_FAILED, "not started"
        try:
            self.stop.check()
            self.setup()
            self.stop.check()
            self._t0 = time.monotonic()
            self._start_coordinator()
            if self.tier is not None:
                self.tier.start_relays(self.logs_dir)
                self._point_links()
            for name in self.sites:
                self.stop.check()
                self._start_site(name)
            self.metrics.round_started_s[0] = self.now()
            status, reason = self._loop()
        except KeyboardInterrupt:
            status, reason = STATUS_INTERRUPTED, "interrupted (Ctrl-C or SIGTERM); every child stopped"
        except (EmulationError, RelayTierError, TimeoutError) as err:
            status, reason = STATUS_FAILED, str(err)
        finally:
            wall = self.now()
            self.shutdown()
        self._read_metrics()
        return self._result(status, reason, wall)

    def _loop(self) -> tuple[str, str]:
        run = self.scenario.run
        assert self.coordinator is not None
        while True:
            self.stop.check()
            now = self.now()
            self._read_metrics()
            self._fire_faults(now)
            self._do_restarts(now)
            self._check_sites()
            if self.tier is not None:
                self.tier.check()
            if not self.coordinator.running and not self._coordinator_down():
                code = self.coordinator.returncode
                if code == 0:
                    return STATUS_COMPLETED, f"{len(self.records)} rounds aggregated"
                self._read_metrics()
                if self._coordinator_finished() and FINISHED_MARK in self.coordinator.log_text():
                    # Finished and said so, then crashed on the way out (seen: gRPC's C++ core
                    # aborting at interpreter exit): the run itself is complete.
                    logger.warning(
                        "the coordinator finished the run but exited with status %d; see %s",
                        code, self.coordinator.log_path,
                    )
                    return STATUS_COMPLETED, (
                        f"{len(self.records)} rounds aggregated (the coordinator then exited with "
                        f"status {code}; see {self.coordinator.log_path})"
                    )
                raise EmulationError(
                    f"the coordinator exited with status {code}; its log "
                    f"({self.coordinator.log_path}) ends with:\n{self.coordinator.log_tail()}"
                )
            if run.time_budget_s is not None and now >= run.time_budget_s:
                return STATUS_TIME_BUDGET, f"stopped after the time budget of {run.time_budget_s:g} s"
            if now >= run.timeout_s:
                raise EmulationError(
                    f"the run did not finish within run.timeout_s = {run.timeout_s:g} s "
                    f"({self._rounds_done()} rounds aggregated); see the logs in {self.logs_dir}"
                )
            self._show_progress(now)
            time.sleep(POLL_INTERVAL_S)

    def _coordinator_down(self) -> bool:
        """The coordinator is dead on purpose (a fault) and waits for its restart."""
        return self._schedule.coordinator_down

    def _check_sites(self) -> None:
        for name, child in self.sites.items():
            code = child.returncode
            if code is None or child.expected_exit:
                continue
            if code == 0:
                child.expected_exit = True
                self._site_stops[name].append(self.now())
                continue
            raise EmulationError(
                f"site {name} exited with status {code}; its log ({child.log_path}) ends with:\n"
                f"{child.log_tail()}"
            )

    def _rounds_done(self) -> int:
        return self.metrics.rounds_done

    def _read_metrics(self) -> None:
        self.metrics.read()

    # -- faults -----------------------------------------------------------------------------------

    def _fire_faults(self, now: float) -> None:
        for fault in self._schedule.due_faults(now, self.metrics.round_started_s, self._upload_seen_s):
            self._fire(fault, now)

    def _upload_seen_s(self, round_number: int, site: str) -> float | None:
        """When the coordinator's log first said ``site``'s upload for the round completed."""
        key = (round_number, site)
        if key not in self._uploads_seen and self.coordinator is not None and self.coordinator.log_path.exists():
            for match in UPLOAD_COMPLETE_RE.finditer(self.coordinator.log_path.read_bytes().decode(errors="replace")):
                self._uploads_seen.setdefault((int(match["round"]), match["site"]), self.now())
        return self._uploads_seen.get(key)

    def _event(self, text: str) -> None:
        line = f"[{self.now():7.1f}s] {text}"
        logger.debug("%s", text)
        self._events.append(line)

    def _fire(self, fault: Fault, now: float) -> None:
        event = FaultEvent(fault=fault, fired_s=now, fired_round=self._rounds_done())
        self.faults.append(event)
        self._event(f"fault: {fault.describe()}")
        if fault.kind == KILL_SITE:
            assert fault.site is not None
            child = self.sites[fault.site]
            if child.running:
                child.kill()
                self._site_stops[fault.site].append(self.now())
            else:
                event.notes.append("the site had already exited; nothing to kill")
            self._schedule.restore_at(now + fault.down_s, RESTORE_SITE, event, fault.site)
        elif fault.kind == KILL_COORDINATOR:
            assert self.coordinator is not None
            self.coordinator.kill()
            self._schedule.restore_at(now + fault.down_s, RESTORE_COORDINATOR, event)
        elif fault.kind == CUT_LINK:
            assert fault.site is not None and self.hub is not None
            self.hub.cut(fault.site, fault.down_s)
            self._schedule.restore_at(now + fault.down_s, RESTORE_LINK, event, fault.site)

    def _do_restarts(self, now: float) -> None:
        for what, name, event in self._schedule.due_restorations(now):
            if what == RESTORE_SITE:
                assert name is not None
                if self._coordinator_finished():
                    event.notes.append("not restarted: the run had already finished")
                    continue
                self._start_site(name)
                event.restored_s = self.now()
                self._event(f"restarted site {name}")
            elif what == RESTORE_COORDINATOR:
                self._start_coordinator()
                event.restored_s = self.now()
                self._event("restarted the coordinator (it resumes from its newest checkpoint)")
            else:
                event.restored_s = self.now()
                self._event(f"link of site {name} restored")

    def _coordinator_finished(self) -> bool:
        return self.metrics.run_finished

    # -- progress ---------------------------------------------------------------------------------

    def site_state(self, name: str) -> str:
        child = self.sites[name]
        relay = self.relays[name]
        if not child.running:
            return STATE_DONE if child.returncode == 0 else (STATE_DOWN if child.starts else STATE_STARTING)
        if relay.is_cut():
            return STATE_CUT
        active = relay.active_direction()
        if active == "up":
            return STATE_UPLOADING
        if active == "down":
            return STATE_DOWNLOADING
        bursts = relay.bursts()
        since = self._site_starts[name][-1] + self._t0 if self._site_starts[name] else 0.0
        bursts = [b for b in bursts if b.start_s >= since]
        if not bursts:
            return STATE_STARTING
        return STATE_WAITING if bursts[-1].direction == "up" else STATE_TRAINING

    def snapshot(self) -> Snapshot:
        losses = self.metrics.losses()
        now = self.now()
        done = self._rounds_done()
        run = self.scenario.run
        eta = None
        if run.rounds and done:
            eta = (now / done) * (run.rounds - done)
        if run.time_budget_s is not None:
            remaining = run.time_budget_s - now
            eta = remaining if eta is None else min(eta, remaining)
        sites = [
            SiteStatus(
                name=name,
                state=self.site_state(name),
                bytes_up=self.relays[name].bytes_up,
                bytes_down=self.relays[name].bytes_down,
                train_loss=losses.per_site.get(name),
            )
            for name in self.sites
        ]
        events, self._events = self._events, []
        return Snapshot(
            elapsed_s=now, round=done, total_rounds=run.rounds, sites=sites,
            eval_loss=losses.eval, train_loss=losses.train, eta_s=eta, events=events,
        )

    def _show_progress(self, now: float) -> None:
        if self.progress is None:
            self._events.clear()
            return
        if now - self._last_progress < PROGRESS_INTERVAL_S and not self._events:
            return
        self._last_progress = now
        self.progress.update(self.snapshot())

    # -- tear-down --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every child (sites first, then the coordinator) and the relays. Idempotent."""
        for name, child in self.sites.items():
            if child.running:
                self._site_stops[name].append(self.now())
        stop_all(list(self.sites.values()))
        if self.tier is not None:
            self.tier.stop()
        if self.coordinator is not None:
            # Still starting, it holds SIGTERM until it serves, and has nothing to drain yet.
            self.coordinator.stop(STOP_GRACE_S if self._coordinator_serving else STARTING_GRACE_S)
        if self.hub is not None:
            self._bursts_snapshot = {
                name: [b.to_dict(self._t0) for b in relay.bursts(time.monotonic() + 3600)]
                for name, relay in self.hub.relays.items()
            }
            self.hub.close()
            self.hub = None
        if self.kernel_links is not None:
            self.kernel_links.close()

    def _result(self, status: str, reason: str, wall: float) -> EmulationResult:
        snapshot = getattr(self, "_bursts_snapshot", {})
        bursts = {name: items for name, items in snapshot.items() if name in self.relays}
        tier = self.tier.links if self.tier is not None else {}
        with (self.out / "links.jsonl").open("w") as f:
            for name, items in snapshot.items():
                for item in items:
                    f.write(json.dumps({"site": name, **item}) + "\n")
        return EmulationResult(
            scenario=self.scenario, out=self.out, status=status, reason=reason, wall_s=wall,
            records=self.records, bursts=bursts,
            wire_bytes={n: (r.bytes_up, r.bytes_down) for n, r in self.relays.items()},
            site_starts=self._site_starts, site_stops=self._site_stops, faults=self.faults,
            coordinator_starts=self._coordinator_starts, shaping=self.shaping.description,
            tier_bytes={n: (r.bytes_up, r.bytes_down) for n, r in tier.items()},
            tier_bursts={name: items for name, items in snapshot.items() if name in tier},
            relay_records=self.tier.relay_records() if self.tier is not None else {},
        )

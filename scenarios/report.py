"""The report of an emulated run: ``summary.md``, PNG plots, and the fidelity check.

Everything is derived from three sources the emulator collected: the coordinator's metrics
records (rounds, losses, payload bytes, participants), the relays' bursts (when each site was
moving bytes, in which direction) and the process start/stop times. A site's time splits into

- **communication**: a burst of its link is in flight;
- **compute**: from the end of a download (it holds new weights) to the start of its next upload;
- **idle**: from the end of an upload to the start of the next download (waiting for the other
  sites and the aggregation), and joining;
- **down**: its process was killed.

**Fidelity.** For each site, the measured communication time per round (mean upload burst + mean
download burst, the initial full-weights fetch excluded) is compared with the simulator's clock,
``geoloco.algorithms.simulation.clock.transfer_time(bytes, bandwidth, latency)`` for the round's upload and
broadcast payload bytes from the coordinator's metrics — what ``geoloco simulate`` would charge.
With ``[[regions]]`` the links are each site's link to its relay (its upload bytes from the relay's
records) and each relay's link; a shaped ``[coordinator_link]`` is one more line: its busy time
against its wire bytes (TLS, gRPC and the first full-weights fetches included) at its bandwidth,
per round. Each link is measured by its own shaper, so waiting behind the shared link is not in a
site's or relay's line.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geoloco.algorithms.privacy.dp_accountant import describe_epsilon
from geoloco.algorithms.simulation.clock import SiteConfig, transfer_time
from geoloco.scenarios.emulation import EmulationResult
from geoloco.scenarios.overlap_fidelity import overlap_fidelity
from geoloco.scenarios.progress import human_bytes
from geoloco.site_agent.async_rounds import COMPUTE_S_TOTAL

__all__ = ["Fidelity", "SiteFidelity", "SiteReport", "fidelity", "site_reports", "write_report"]

logger = logging.getLogger(__name__)

FIDELITY_TOLERANCE = 0.15
"""The emulator and the simulator's clock should agree on communication time within this."""
FIDELITY_FLOOR_S = 0.02
"""...or within this many seconds: on a busy machine the relay's timers and the processes'
scheduling add a few milliseconds per transfer, which matters only on the fastest links."""

COMPUTE, COMMUNICATION, IDLE, DOWN = "compute", "communication", "idle", "down"
COLORS = {COMPUTE: "#4c72b0", COMMUNICATION: "#dd8452", IDLE: "#cccccc", DOWN: "#c44e52"}


@dataclass(slots=True)
class SiteReport:
    name: str
    payload_up: int
    """Bytes of the updates the coordinator received from this site (its metrics)."""
    payload_down: int
    """Bytes the coordinator counted as sent to this site."""
    wire_up: int
    """Bytes through the site's link towards the coordinator (TLS, gRPC, heartbeats included)."""
    wire_down: int
    rounds_included: int
    compute_s: float
    communication_s: float
    idle_s: float
    down_s: float
    final_train_loss: float | None
    startup_s: float = 0.0
    """Seconds from the site's first process start until it first held the weights (imports,
    TLS, join, the full-weights fetch): part of ``idle_s``, left out of the steady-state figure."""
    wind_down_s: float = 0.0
    """Seconds the site lived after the run's last round was aggregated (the last broadcast,
    leaving, the process's exit): left out of the steady-state figure like start-up."""

    @property
    def alive_s(self) -> float:
        return self.compute_s + self.communication_s + self.idle_s

    @property
    def utilization(self) -> float:
        return self.compute_s / self.alive_s if self.alive_s > 0 else 0.0

    @property
    def steady_utilization(self) -> float:
        """Compute share once training began and until the run's last round: what a long run
        converges to, since start-up and wind-down are paid once (a short emulation's would
        otherwise dominate the figure)."""
        steady = self.alive_s - self.startup_s - self.wind_down_s
        return min(1.0, self.compute_s / steady) if steady > 0 else 0.0

    @property
    def network_wait_s(self) -> float:
        return self.communication_s + self.idle_s


@dataclass(slots=True)
class SiteFidelity:
    name: str
    rounds: int
    measured_s: float
    """Mean communication seconds per round (upload + download) through the shaped link."""
    predicted_s: float
    """The simulator clock's ``latency + 8·bytes/bandwidth`` for the same bytes, both ways."""

    @property
    def ratio(self) -> float:
        return self.measured_s / self.predicted_s if self.predicted_s > 0 else math.nan

    @property
    def within_tolerance(self) -> bool:
        return abs(self.measured_s - self.predicted_s) <= max(
            FIDELITY_TOLERANCE * self.predicted_s, FIDELITY_FLOOR_S
        )


@dataclass(slots=True)
class Fidelity:
    sites: list[SiteFidelity]
    skipped: str | None = None
    links: list[Any] = field(default_factory=list)
    """The scenario's sites (their link settings), for the notes."""
    """Why no comparison was made (faults, no complete round)."""

    @property
    def measured_s(self) -> float:
        return sum(s.measured_s for s in self.sites) / max(1, len(self.sites))

    @property
    def predicted_s(self) -> float:
        return sum(s.predicted_s for s in self.sites) / max(1, len(self.sites))

    @property
    def ratio(self) -> float:
        return self.measured_s / self.predicted_s if self.predicted_s > 0 else math.nan

    @property
    def within_tolerance(self) -> bool:
        return bool(self.sites) and all(s.within_tolerance for s in self.sites)

    def lines(self) -> list[str]:
        if self.skipped:
            return [f"fidelity check skipped: {self.skipped}"]
        lines = ["communication time per round, emulator vs simulator clock (same bytes, links):"]
        width = max(len(s.name) for s in self.sites)
        for s in self.sites:
            lines.append(
                f"  {s.name.ljust(width)}  measured {s.measured_s:7.3f} s  simulated "
                f"{s.predicted_s:7.3f} s  ratio {s.ratio:5.2f}  ({s.rounds} rounds)"
            )
        verdict = "within" if self.within_tolerance else "OUTSIDE"
        lines.append(
            f"  {'mean'.ljust(width)}  measured {self.measured_s:7.3f} s  simulated "
            f"{self.predicted_s:7.3f} s  ratio {self.ratio:5.2f}  ({verdict} "
            f"±{FIDELITY_TOLERANCE:.0%} or ±{FIDELITY_FLOOR_S * 1000:.0f} ms per site)"
        )
        if any(s.loss or s.jitter_s for s in self.links):
            lines.append(
                "  note: the simulator's clock has no loss or jitter; links with them take longer"
            )
        return lines


# -- per-site timelines ----------------------------------------------------------------------------


def _lifetimes(result: EmulationResult, name: str) -> list[tuple[float, float]]:
    starts = result.site_starts.get(name, [])
    stops = sorted(result.site_stops.get(name, []))
    spans = []
    for start in starts:
        stop = next((t for t in stops if t >= start), result.wall_s)
        spans.append((start, min(stop, result.wall_s)))
    return spans


def site_timeline(result: EmulationResult, name: str) -> list[tuple[str, float, float]]:
    """``(kind, start_s, end_s)`` segments covering the site's run (see the module docstring)."""
    segments: list[tuple[str, float, float]] = []
    bursts = sorted(result.bursts.get(name, []), key=lambda b: b["start_s"])
    spans = _lifetimes(result, name)
    for i, (start, stop) in enumerate(spans):
        if i + 1 < len(spans) and spans[i + 1][0] > stop:
            segments.append((DOWN, stop, spans[i + 1][0]))
        cursor = start
        state = IDLE  # joining until the first download
        for burst in bursts:
            b0, b1 = max(burst["start_s"], start), min(burst["end_s"], stop)
            if b1 <= b0 or (b0 < cursor - 1e-9 and b1 <= cursor):
                continue
            b0 = max(b0, cursor)
            if b0 > cursor:
                segments.append((state, cursor, b0))
            segments.append((COMMUNICATION, b0, b1))
            cursor = b1
            state = COMPUTE if burst["direction"] == "down" else IDLE
        if stop > cursor:
            segments.append((state if state == IDLE else COMPUTE, cursor, stop))
    return segments


def _startup_s(result: EmulationResult, name: str) -> float:
    """Seconds from the site's first start to the end of its weights fetch: its first download
    of at least half its largest one (the full weights; the TLS handshake and the join's small
    replies come before it and are start-up too)."""
    spans = _lifetimes(result, name)
    if not spans:
        return 0.0
    start, stop = spans[0]
    downs = [b for b in result.bursts.get(name, []) if b["direction"] == "down" and b["end_s"] > start]
    largest = max((int(b.get("bytes", 0)) for b in downs), default=0)
    ends = [b["end_s"] for b in downs if 2 * int(b.get("bytes", 0)) >= largest]
    return min(min(ends, default=stop), stop) - start


def _wind_down_s(result: EmulationResult, name: str) -> float:
    """Seconds of the site's last lifetime after the run's last round was aggregated (0 when
    the run did not finish, or the site was gone by then)."""
    spans = _lifetimes(result, name)
    finished = [r for r in result.records if r.get("run_finished")]
    if not spans or not finished:
        return 0.0
    end = float(finished[-1].get("observed_s", result.wall_s))
    start, stop = spans[-1]
    return max(0.0, stop - max(start, end))


def _restarted_totals(running: list[float]) -> float:
    """The sum of a running total that starts again from 0 when its process restarts: the
    last value before every drop, plus the last one."""
    total = 0.0
    for before, after in itertools.pairwise(running):
        if after < before:
            total += before
    return total + (running[-1] if running else 0.0)


def site_reports(result: EmulationResult) -> list[SiteReport]:
    payload_up: dict[str, int] = {}
    payload_down: dict[str, int] = {}
    included: dict[str, int] = {}
    last_loss: dict[str, float] = {}
    inner_time: dict[str, float] = {}
    async_compute: dict[str, list[float]] = {}
    """Asynchronous merges: per site, the process's running compute total its merged updates
    reported (``AsyncRounds``'s ``compute_s_total``), in merge order."""
    for record in result.records:
        for site, n in (record.get("bytes_up") or {}).items():
            payload_up[site] = payload_up.get(site, 0) + int(n)
        for site, n in (record.get("bytes_down") or {}).items():
            payload_down[site] = payload_down.get(site, 0) + int(n)
        for site in record.get("participants") or []:
            included[site] = included.get(site, 0) + 1
        for site, metrics in (record.get("site_metrics") or {}).items():
            if metrics.get("train_loss") is not None:
                last_loss[site] = float(metrics["train_loss"])
            inner_time[site] = inner_time.get(site, 0.0) + float(metrics.get("inner_time_s") or 0.0)
            if metrics.get(COMPUTE_S_TOTAL) is not None:
                async_compute.setdefault(site, []).append(float(metrics[COMPUTE_S_TOTAL]))
    for site, totals_seen in async_compute.items():
        inner_time[site] = _restarted_totals(totals_seen)
    reports = []
    for site in result.scenario.sites:
        totals = {COMPUTE: 0.0, COMMUNICATION: 0.0, IDLE: 0.0, DOWN: 0.0}
        for kind, t0, t1 in site_timeline(result, site.name):
            totals[kind] += t1 - t0
        algo = result.scenario.algorithm
        if algo.streaming.enabled or algo.asynchronous.enabled:
            # Streaming and asynchronous DiLoCo train while their transfers travel, so the link
            # bursts cannot tell compute from waiting: compute is the inner-step time the site
            # reported with each update that entered a round (asynchronous: the running total of
            # every phase it trained, merged or not, as of its latest merged update), the rest of
            # its lifetime is counted as waiting (idle).
            alive = totals[COMPUTE] + totals[COMMUNICATION] + totals[IDLE]
            totals[COMPUTE] = min(alive, inner_time.get(site.name, 0.0))
            totals[COMMUNICATION], totals[IDLE] = 0.0, alive - totals[COMPUTE]
        wire_up, wire_down = result.wire_bytes.get(site.name, (0, 0))
        reports.append(
            SiteReport(
                name=site.name,
                payload_up=payload_up.get(site.name, 0),
                payload_down=payload_down.get(site.name, 0),
                wire_up=wire_up,
                wire_down=wire_down,
                rounds_included=included.get(site.name, 0),
                compute_s=totals[COMPUTE],
                communication_s=totals[COMMUNICATION],
                idle_s=totals[IDLE],
                down_s=totals[DOWN],
                final_train_loss=last_loss.get(site.name),
                startup_s=_startup_s(result, site.name),
                wind_down_s=_wind_down_s(result, site.name),
            )
        )
    return reports


# -- fidelity --------------------------------------------------------------------------------------


def _link_fidelity(
    name: str, link: SiteConfig, ups: list[int], downs: list[int], bursts: list[dict[str, Any]]
) -> SiteFidelity | None:
    """One link's measured vs simulated time per round; None without enough bursts."""
    if not ups or not downs:
        return None
    predicted_up = sum(transfer_time(n, link.uplink_bps, link.latency_s) for n in ups) / len(ups)
    predicted_down = sum(transfer_time(n, link.downlink_bps, link.latency_s) for n in downs) / len(downs)
    # Without faults a link's traffic is: TLS handshakes, joins and the full-weights fetch, then
    # one upload and one broadcast per round. The last transfers of each direction are the rounds'
    # (heartbeats are below the burst threshold).
    up = [b for b in bursts if b["direction"] == "up"][-len(ups):]
    down = [b for b in bursts if b["direction"] == "down"][-len(downs):]
    if len(up) < len(ups) or len(down) < len(downs):
        return None
    measured_up = sum(b["end_s"] - b["start_s"] for b in up) / len(up)
    measured_down = sum(b["end_s"] - b["start_s"] for b in down) / len(down)
    return SiteFidelity(
        name=name, rounds=len(ups), measured_s=measured_up + measured_down, predicted_s=predicted_up + predicted_down
    )


def _shared_link_fidelity(result: EmulationResult, rounds: int) -> SiteFidelity | None:
    """The shaped coordinator link, shared by every transfer crossing it: its busy time (bursts
    merge the transfers that overlap) against its wire bytes at its bandwidth, per round."""
    shared = result.scenario.coordinator_link
    bursts = result.tier_bursts.get("coordinator", [])
    if not shared.shaped or not bursts or rounds == 0:
        return None
    up, down = result.tier_bytes["coordinator"]
    predicted = sum(8 * n / bps for n, bps in ((up, shared.ingress_bps), (down, shared.egress_bps)) if bps)
    measured = sum(b["end_s"] - b["start_s"] for b in bursts)
    return SiteFidelity(
        name="coordinator link", rounds=rounds, measured_s=measured / rounds, predicted_s=predicted / rounds
    )


def _relayed_uploads(result: EmulationResult) -> dict[str, list[int]]:
    """Per relayed site, the bytes of its upload to its relay in each round the relay forwarded it
    (the relay's records; the coordinator only sees the partial sums)."""
    uploads: dict[str, list[int]] = {}
    for records in result.relay_records.values():
        for record in records:
            for site in record.get("partial", {}):
                uploads.setdefault(site, []).append(int(record["bytes"].get(f"site:{site}->relay", 0)))
    return uploads


def fidelity(result: EmulationResult) -> Fidelity:
    """Measured vs simulated communication time per round, per site (see the module docstring);
    with ``[[regions]]``, each site's link to its relay and each relay's link to the coordinator."""
    if result.scenario.faults:
        return Fidelity([], skipped="the scenario injects faults (compare fault-free runs only)")
    if result.scenario.algorithm.asynchronous.enabled:
        return Fidelity(
            [], skipped="asynchronous merges: a site's uploads and broadcasts do not pair up one per round"
        )
    records = [r for r in result.records if r.get("participants")]
    if not records:
        return Fidelity([], skipped="no round was aggregated")
    relayed = _relayed_uploads(result)
    downs = [int(r["downlink_bytes"]) for r in records]
    checked = []
    for site in result.scenario.sites:
        rounds = [r for r in records if site.name in r["participants"]]
        ups = relayed.get(site.name) or [int(r["bytes_up"].get(site.name, 0)) for r in rounds]
        checked.append(_link_fidelity(site.name, site.clock_site(), ups, downs, result.bursts.get(site.name, [])))
    for region in result.scenario.regions:
        name = f"relay:{region.name}"
        link = SiteConfig(
            name=name, uplink_bps=region.uplink_bps, downlink_bps=region.downlink_bps, latency_s=region.latency_s
        )
        ups = [int(r["bytes_up"][name]) for r in records if name in r["bytes_up"]]
        down = [int(r["bytes_down"][name]) for r in records if name in r.get("bytes_down", {})]
        checked.append(_link_fidelity(name, link, ups, down, result.tier_bursts.get(name, [])))
    checked.append(_shared_link_fidelity(result, len(records)))
    sites = [f for f in checked if f is not None]
    if not sites:
        return Fidelity([], skipped="no site completed an upload and a download")
    return Fidelity(sites, links=list(result.scenario.sites))


# -- plots -----------------------------------------------------------------------------------------


def _loss_series(result: EmulationResult) -> list[dict[str, Any]]:
    """Per aggregated round: round, eval loss, mean train loss, cumulative bytes, time."""
    series = []
    for record in result.records:
        metrics = record.get("site_metrics") or {}
        losses = [float(m["train_loss"]) for m in metrics.values() if m.get("train_loss") is not None]
        series.append(
            {
                "round": int(record["round"]) + 1,
                "eval_loss": record.get("eval_loss"),
                "train_loss": sum(losses) / len(losses) if losses else None,
                "bytes": int(record.get("bytes_up_total", 0)) + int(record.get("bytes_down_total", 0)),
                "bytes_up": int(record.get("bytes_up_total", 0)),
                "time_s": float(record.get("observed_s", 0.0)),
            }
        )
    return series


def write_plots(result: EmulationResult, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _loss_series(result)
    written = []
    for x_key, x_label, file_name in (
        ("round", "round", "loss_vs_round.png"),
        ("bytes_up", "bytes sent by the sites (cumulative, payload)", "loss_vs_bytes.png"),
        ("time_s", "wall-clock seconds", "loss_vs_time.png"),
    ):
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for y_key, label, style in (("eval_loss", "eval loss (global weights)", "o-"),
                                    ("train_loss", "train loss (mean over sites)", ".--")):
            points = [(p[x_key], p[y_key]) for p in series if p[y_key] is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, style, label=label)
        ax.set_xlabel(x_label)
        ax.set_ylabel("loss")
        ax.set_title(f"{Path(result.scenario.source).stem}: loss vs {x_label.split(' (')[0]}")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out / file_name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    names = [s.name for s in result.scenario.sites]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(names) + 1.6))
    for row, name in enumerate(names):
        by_kind: dict[str, list[tuple[float, float]]] = {}
        for kind, t0, t1 in site_timeline(result, name):
            by_kind.setdefault(kind, []).append((t0, t1 - t0))
        for kind, bars in by_kind.items():
            ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=COLORS[kind])
    for event in result.faults:
        ax.axvline(event.fired_s, color="black", linestyle=":", linewidth=1)
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("wall-clock seconds")
    ax.set_title("per-site timeline (dotted: faults)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, list(COLORS), loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4)
    fig.tight_layout()
    path = out / "timeline.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    return written


# -- summary.md ------------------------------------------------------------------------------------


def _fault_recovery(result: EmulationResult) -> list[str]:
    lines = []
    for event in result.faults:
        fault = event.fault
        parts = [f"- **{fault.describe()}** — fired at {event.fired_s:.1f} s "
                 f"({event.fired_round} rounds aggregated)"]
        if event.restored_s is not None:
            parts.append(f"restored at {event.restored_s:.1f} s")
        after = [r for r in result.records if r.get("observed_s", 0) >= event.fired_s]
        if fault.site is not None:
            missed = [int(r["round"]) for r in after if fault.site not in (r.get("participants") or [])]
            back = next(
                (r for r in after
                 if fault.site in (r.get("participants") or [])
                 and event.restored_s is not None and r.get("observed_s", 0) >= event.restored_s),
                None,
            )
            missed = [m for m in missed if back is None or m < int(back["round"])]
            if missed:
                parts.append(f"round(s) {', '.join(map(str, missed))} aggregated without {fault.site}")
            if back is not None:
                parts.append(
                    f"{fault.site} contributed again in round {back['round']} "
                    f"({back['observed_s'] - event.fired_s:.1f} s after the fault)"
                )
            else:
                parts.append(f"{fault.site} did not contribute again before the run ended")
        else:
            before = {r.get("session_id") for r in result.records if r.get("observed_s", 0) < event.fired_s}
            resumed = next((r for r in after if r.get("session_id") not in before), None)
            if resumed is not None:
                parts.append(
                    f"the restarted coordinator (new session) aggregated round {resumed['round']} "
                    f"{resumed['observed_s'] - event.fired_s:.1f} s after the kill, resuming from "
                    "its checkpoint"
                )
            else:
                parts.append("no round was aggregated by the restarted coordinator")
        parts.extend(event.notes)
        lines.append("; ".join(p for p in parts if p) + ".")
    return lines


def _lost_rounds(result: EmulationResult) -> str:
    rounds = sorted({int(r["round"]) for r in result.records})
    expected = result.scenario.run.rounds
    if not rounds:
        return "no round was aggregated"
    missing = [r for r in range(max(rounds) + 1) if r not in rounds]
    text = f"rounds 0..{max(rounds)} aggregated"
    if missing:
        text += f"; MISSING: {missing}"
    if expected and result.status == "completed" and max(rounds) + 1 != expected:
        text += f"; expected {expected} rounds"
    repeated = len(result.records) - len(rounds)
    if repeated:
        text += f"; {repeated} round(s) aggregated twice (re-done after a coordinator restart)"
    return text


def _privacy_lines(result: EmulationResult) -> list[str]:
    """The privacy line of the summary: what was on, epsilon spent, dropouts and aborts."""
    privacy = result.scenario.privacy
    if not privacy.enabled:
        return []
    private = [r for r in result.records if "privacy" in r]
    eps = next((r["epsilon"] for r in reversed(private) if r.get("epsilon") is not None), None)
    dropped = sorted({s for r in private for s in r["privacy"].get("dropped_after_upload", [])})
    aborted = [r["round"] for r in private if r["privacy"].get("aborted")]
    parts = [
        f"secure aggregation {'on' if privacy.secure_aggregation else 'off'}",
        f"DP {privacy.dp}"
        + ("" if privacy.dp == "off"
           else f" (noise multiplier {privacy.noise_multiplier:g}, clip {privacy.clip_norm:g})"),
    ]
    if eps is not None:
        parts.append(f"**{describe_epsilon(eps, privacy.delta)}** after {len(private)} rounds")
    if dropped:
        parts.append(f"dropped after uploading (their updates still unmasked in the sum): {', '.join(dropped)}")
    if aborted:
        parts.append(f"secure rounds aborted (too few sites): {', '.join(map(str, aborted))}")
    return [f"- privacy: {'; '.join(parts)}"]


def summary_markdown(result: EmulationResult, reports: list[SiteReport], fid: Fidelity, plots: list[Path]) -> str:
    s = result.scenario
    algo = s.algorithm
    final_eval = next((r["eval_loss"] for r in reversed(result.records) if r.get("eval_loss") is not None), None)
    lines = [
        f"# Emulation report: {Path(s.source).name}",
        "",
        f"- status: **{result.status}** ({result.reason})",
        f"- wall-clock: {result.wall_s:.1f} s",
        f"- workload: {s.workload_name} {s.workload_options}",
        f"- algorithm: {algo.name}, H={algo.inner_steps}, uplink {algo.uplink_codec}, "
        f"downlink {algo.downlink_codec}, {len(s.sites)} sites (quorum "
        f"{algo.asynchronous.min_quorum if algo.asynchronous.enabled else s.quorum})",
        *([f"- streaming: {algo.streaming.fragments} fragments (one synced every "
            f"{algo.inner_steps // algo.streaming.fragments} steps), overlap "
            f"{algo.streaming.overlap_steps} steps, mix {algo.streaming.mix:g}; compute utilization "
            "from the sites' reported inner-step time (transfers overlap compute)"]
          if algo.streaming.enabled else []),
        *([f"- asynchronous merges: min_quorum {algo.asynchronous.min_quorum}, "
           + ("adaptive grace window" if algo.asynchronous.adaptive_grace
              else f"grace {algo.asynchronous.grace_window_s:g} s")
           + f", max_staleness {algo.asynchronous.max_staleness}; rounds are merges; compute "
           "utilization from the sites' reported inner-step time (transfers overlap compute)"]
          if algo.asynchronous.enabled else []),
        f"- rounds: {_lost_rounds(result)}",
        f"- link shaping: {result.shaping or 'relay'}",
        f"- final eval loss: {'n/a' if final_eval is None else f'{final_eval:.4f}'}",
        *_privacy_lines(result),
        "",
        "## Sites",
        "",
        "| site | link up/down, latency | speed | bytes up (payload / wire) | bytes down (payload / wire) "
        "| rounds included | compute utilization (between start-up and wind-down) | waiting on network (comm + idle) "
        "| down | final train loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for site, r in zip(s.sites, reports, strict=True):
        lines.append(
            f"| {r.name} | {site.uplink_bps / 1e6:g}/{site.downlink_bps / 1e6:g} Mbit/s, "
            f"{site.latency_s * 1000:g} ms | {site.speed_factor:g}x | {human_bytes(r.payload_up)} / "
            f"{human_bytes(r.wire_up)} | {human_bytes(r.payload_down)} / {human_bytes(r.wire_down)} | "
            f"{r.rounds_included} | {100 * r.utilization:.1f} % ({100 * r.steady_utilization:.1f} %) | "
            f"{r.network_wait_s:.1f} s "
            f"({r.communication_s:.1f} + {r.idle_s:.1f}) | {r.down_s:.1f} s | "
            f"{'n/a' if r.final_train_loss is None else f'{r.final_train_loss:.4f}'} |"
        )
    total = lambda attr: sum(getattr(r, attr) for r in reports)  # noqa: E731
    mean_util = sum(r.utilization for r in reports) / max(1, len(reports))
    mean_steady = sum(r.steady_utilization for r in reports) / max(1, len(reports))
    lines.append(
        f"| **total** | | | {human_bytes(total('payload_up'))} / {human_bytes(total('wire_up'))} | "
        f"{human_bytes(total('payload_down'))} / {human_bytes(total('wire_down'))} | | "
        f"{100 * mean_util:.1f} % ({100 * mean_steady:.1f} %) (mean) | {total('network_wait_s'):.1f} s | "
        f"{total('down_s'):.1f} s | |"
    )
    lines += ["", "## Faults", ""]
    lines += _fault_recovery(result) or ["None injected."]
    lines += ["", "## Fidelity (emulator vs simulator clock)", "", "```", *fid.lines(), "```", ""]
    overlap = overlap_fidelity(result.scenario, result.records)
    if overlap.skipped is None:
        lines += ["Adaptive overlap (`geoloco.scenarios.overlap_fidelity`):", "", *overlap.lines(), ""]
    lines += ["## Plots", ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    lines += [
        "",
        "## Files",
        "",
        "- `metrics.jsonl`: the coordinator's record of every round (every site's bytes, loss, "
        "participation); `observed_s` is not in it (the emulator's clock is in `rounds.jsonl`)",
        "- `links.jsonl`: every transfer burst per link and direction (start, end, bytes): each site's, "
        "and with regions each relay's (`relay:NAME`) and the coordinator's (`coordinator`)",
        *(["- `relays/NAME.jsonl`: each relay's record per round (the sites in its partial, bytes per link)"]
          if s.regions else []),
        "- `logs/`: each process's output; `coordinator.toml`: the coordinator's config; "
        "`scenario.json`: the scenario as run",
        "",
    ]
    return "\n".join(lines)


def write_report(result: EmulationResult) -> tuple[Path, Fidelity]:
    """Write ``summary.md``, ``rounds.jsonl`` and the PNG plots into ``result.out``."""
    import json

    out = result.out
    with (out / "rounds.jsonl").open("w") as f:
        for record in result.records:
            f.write(json.dumps({"round": record["round"], "observed_s": record.get("observed_s"),
                                "session_id": record.get("session_id")}) + "\n")
    reports = site_reports(result)
    fid = fidelity(result)
    try:
        plots = write_plots(result, out)
    except Exception:  # a broken plot must not lose the summary
        logger.exception("could not draw the plots")
        plots = []
    path = out / "summary.md"
    path.write_text(summary_markdown(result, reports, fid, plots))
    return path, fid

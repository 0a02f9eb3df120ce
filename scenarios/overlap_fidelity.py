"""Emulator vs simulator for the adaptive overlap (``[algorithm.streaming] adaptive_overlap``).

Two checks on a fault-free emulated run's coordinator records, where every streaming site reports
with each upload what the overlap rule saw and chose (``step_s``, ``transfer_s``,
``overlap_steps``, ``next_round_steps``):

* **replay**: ``choose_overlap`` on the site's own reported measurements gives the site's reported
  choice, in every round: the real site ran the same pure rule as the simulator.
* **prediction**: the simulator's clock with the same rule (``overlap_clock``), fed the scenario's
  links, the run's transfer sizes, each site's measured step time and the coordinator's measured
  processing time per round, predicts each site's steady-state round steps and overlap τ (the
  rule's outputs); they agree when both are within ``STEPS_TOLERANCE`` steps. The transfer time
  the rule saw (its input) is shown beside the clock's: the clock leaves out the sites' own
  overheads (gRPC and TLS framing, the upload thread competing with training for the CPU, a loaded
  machine's scheduling) and the jitter that makes the sites' rounds alternate in length, so a
  site that waits for another measures more than the clock predicts.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from geoloco.algorithms.simulation.streaming_clock import overlap_clock
from geoloco.algorithms.streaming_overlap import OverlapBounds, OverlapChoice, choose_overlap
from geoloco.scenarios.scenario import Scenario

__all__ = ["OverlapFidelity", "SiteOverlapFidelity", "overlap_fidelity"]

STARTUP_ROUNDS = 3
"""Rounds left out of the steady state (the rule has measured nothing useful before round 3)."""
STEPS_TOLERANCE = 2.0
"""Measured vs predicted mean round steps and mean τ, in steps."""
AFTER_RECEIVE = ("verify", "add", "outer_step", "downlink_encode", "checkpoint", "broadcast")
"""Coordinator phases between the last upload's arrival and the broadcast."""


@dataclass(slots=True)
class SiteOverlapFidelity:
    name: str
    rounds: int
    replayed: int
    """Rounds whose choice ``choose_overlap`` reproduced from the site's reported measurements."""
    measured_transfer_s: float
    predicted_transfer_s: float
    measured_steps: float
    predicted_steps: float
    measured_overlap: float
    predicted_overlap: float
    mismatches: list[int] = field(default_factory=list)
    """Rounds whose reported choice the rule did not reproduce."""

    @property
    def ok(self) -> bool:
        return (
            self.replayed == self.rounds
            and abs(self.measured_steps - self.predicted_steps) <= STEPS_TOLERANCE
            and abs(self.measured_overlap - self.predicted_overlap) <= STEPS_TOLERANCE
        )


@dataclass(slots=True)
class OverlapFidelity:
    sites: list[SiteOverlapFidelity]
    skipped: str | None = None

    @property
    def ok(self) -> bool:
        return self.skipped is None and all(s.ok for s in self.sites)

    def lines(self) -> list[str]:
        if self.skipped is not None:
            return [f"adaptive overlap check skipped: {self.skipped}"]
        out = [
            "| site | rule replayed | round steps emulated / simulated | overlap steps emulated / "
            "simulated | agrees | transfer s seen, emulated / simulated |",
            "|---|---|---|---|---|---|",
        ]
        for s in self.sites:
            out.append(
                f"| {s.name} | {s.replayed}/{s.rounds} | {s.measured_steps:.2f} / {s.predicted_steps:.2f} "
                f"| {s.measured_overlap:.2f} / {s.predicted_overlap:.2f} | {'yes' if s.ok else 'no'} "
                f"| {s.measured_transfer_s:.3f} / {s.predicted_transfer_s:.3f} |"
            )
        return out


def _measured(value: Any) -> float | None:
    return None if value is None or float(value) < 0 else float(value)


def _steady(values: Sequence[float]) -> float:
    tail = list(values[STARTUP_ROUNDS:]) or list(values)
    return statistics.fmean(tail) if tail else 0.0


def overlap_fidelity(scenario: Scenario, records: Sequence[Mapping[str, Any]]) -> OverlapFidelity:
    """Replay and prediction per site (module docstring)."""
    algorithm = scenario.algorithm
    streaming = algorithm.streaming
    if not (streaming.enabled and streaming.adaptive_overlap):
        return OverlapFidelity([], skipped="the scenario does not use adaptive_overlap")
    if scenario.faults:
        return OverlapFidelity([], skipped="the scenario injects faults (compare fault-free runs only)")
    if scenario.privacy.secure_aggregation:
        # The streaming simulator times a secure round's stages (``secure_clock``); this clock
        # charges each round one upload, so its prediction would leave them out.
        return OverlapFidelity([], skipped="secure aggregation's stage calls are not on the overlap clock")
    names = [site.name for site in scenario.sites]
    rounds = [r for r in records if set(names) <= set(r.get("site_metrics") or {})]
    if len(rounds) <= STARTUP_ROUNDS:
        return OverlapFidelity([], skipped=f"fewer than {STARTUP_ROUNDS + 1} rounds with every site")
    bounds = OverlapBounds.from_config(algorithm.inner_steps, streaming)
    metrics = {name: [r["site_metrics"][name] for r in rounds] for name in names}
    step_s = [
        statistics.median([m["inner_time_s"] / m["inner_steps"] for m in metrics[name] if m.get("inner_steps")])
        for name in names
    ]
    overhead = statistics.median(
        sum(float((r.get("phases_s") or {}).get(phase, 0.0)) for phase in AFTER_RECEIVE) for r in rounds
    )
    clock = overlap_clock(
        bounds, sites=[site.clock_site() for site in scenario.sites],
        step_s=step_s,
        upload_bytes=[[int(r["bytes_up"][name]) for name in names] for r in rounds],
        download_bytes=[int(r["downlink_bytes"]) for r in rounds],
        aggregate_overhead_s=overhead,
    )
    sites = []
    for k, name in enumerate(names):
        mismatches = []
        for r, m in zip(rounds, metrics[name], strict=True):
            if "overlap_steps" not in m:
                mismatches.append(int(r["round"]))
                continue
            expected = choose_overlap(
                bounds, step_s=_measured(m.get("step_s")), transfer_s=_measured(m.get("transfer_s"))
            )
            got = OverlapChoice(int(m["overlap_steps"]), int(m["next_round_steps"]), expected.needed_steps)
            if got != expected:
                mismatches.append(int(r["round"]))
        transfers = [t for m in metrics[name] if (t := _measured(m.get("transfer_s"))) is not None]
        sites.append(
            SiteOverlapFidelity(
                name=name,
                rounds=len(rounds),
                replayed=len(rounds) - len(mismatches),
                measured_transfer_s=_steady(transfers),
                predicted_transfer_s=_steady([t for t in clock[k].transfer_s if t is not None]),
                measured_steps=_steady([float(m["inner_steps"]) for m in metrics[name]]),
                predicted_steps=_steady([float(n) for n in clock[k].steps]),
                measured_overlap=_steady([float(m.get("overlap_steps", 0)) for m in metrics[name]]),
                predicted_overlap=_steady([float(c.overlap_steps) for c in clock[k].choices]),
                mismatches=mismatches,
            )
        )
    return OverlapFidelity(sites)

"""The simulator's streaming clock without the training: what the overlap rule chooses, per site.

``geoloco.algorithms.simulation.streaming_sim`` trains a model and advances the virtual clock; this module
advances the same clock (``streaming_site_time``, ``download_ends``) with the same overlap rule
(``OverlapMeter``, ``choose_overlap``) in the same order, for given step times and transfer sizes,
in microseconds of CPU. The emulator's fidelity check uses it to predict what each real site
should have chosen on its links at the step time it measured; a test holds it to the simulator's
own choices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from geoloco.algorithms.simulation.clock import SiteConfig, download_ends
from geoloco.algorithms.simulation.streaming_sim import streaming_site_time
from geoloco.algorithms.streaming_overlap import OverlapBounds, OverlapChoice, OverlapMeter

__all__ = ["ClockSite", "overlap_clock"]


@dataclass(slots=True)
class ClockSite:
    """One site's run on the clock: every round's steps, stall and choice."""

    steps: list[int] = field(default_factory=list)
    stall_s: list[float] = field(default_factory=list)
    utilization: list[float] = field(default_factory=list)
    choices: list[OverlapChoice] = field(default_factory=list)
    step_s: list[float | None] = field(default_factory=list)
    """The step time each choice was made from (what a real site reports as ``step_s``)..."""
    transfer_s: list[float | None] = field(default_factory=list)
    """...and the transfer time (``transfer_s``; None until one was measured)."""


def overlap_clock(
    bounds: OverlapBounds,
    *,
    sites: Sequence[SiteConfig],
    step_s: Sequence[float],
    upload_bytes: Sequence[Sequence[int]],
    download_bytes: Sequence[int],
    start_s: Sequence[float] | None = None,
    aggregate_overhead_s: float = 0.0,
) -> list[ClockSite]:
    """Rounds ``0 .. len(download_bytes) - 1`` of streaming sites on the virtual clock.

    ``step_s[k]``: site k's seconds per inner step; ``upload_bytes[r][k]``: its upload in round r;
    ``download_bytes[r]``: round r's broadcast. Rounds close when every upload has arrived (no
    deadline), as in a fault-free emulated run; the broadcast leaves ``aggregate_overhead_s``
    after the last arrival (the coordinator's processing, which the simulator leaves out: 0).
    """
    n = len(sites)
    meters = [OverlapMeter() for _ in range(n)]
    upload_s = list(start_s) if start_s is not None else [0.0] * n
    broadcast_s: list[float | None] = [None] * n
    choice = [bounds.fixed] * n
    out = [ClockSite() for _ in range(n)]
    for r, down in enumerate(download_bytes):
        times = []
        for k, site in enumerate(sites):
            overlap = choice[k].overlap_steps if r > 0 else 0
            rest = choice[k].round_steps - overlap
            first_s, rest_s = overlap * step_s[k], rest * step_s[k]
            meters[k].record_steps(overlap + rest, first_s + rest_s)
            choice[k] = meters[k].choose(bounds)
            out[k].step_s.append(meters[k].step_s)
            out[k].transfer_s.append(meters[k].transfer_s)
            timing = streaming_site_time(
                start_s=upload_s[k], overlap_compute_s=first_s, rest_compute_s=rest_s,
                previous_broadcast_s=broadcast_s[k], upload_bytes=upload_bytes[r][k], site=site,
            )
            times.append(timing)
            out[k].steps.append(overlap + rest)
            out[k].stall_s.append(timing.stall_s)
            out[k].utilization.append(timing.utilization)
            out[k].choices.append(choice[k])
        arrivals = [t.arrival_s for t in times]
        ends = download_ends(max(arrivals) + aggregate_overhead_s, arrivals, down, sites)
        for k, (timing, end) in enumerate(zip(times, ends, strict=True)):
            meters[k].record_transfer(end - timing.upload_s)
            broadcast_s[k] = end
            upload_s[k] = timing.upload_s
    return out

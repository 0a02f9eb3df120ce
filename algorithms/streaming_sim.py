"""Streaming DiLoCo in the simulator: per-site local weights, staggered fragment syncs, overlap.

The plain simulator loads the global weights into its one shared model before each site's steps,
because in plain DiLoCo every site starts a round from ``θ_t``. In Streaming DiLoCo a site's
weights never reset as a whole (only one fragment is merged per round), so each site keeps its own
flat fp32 copy (``N × model`` memory) that is loaded into the shared model for its steps.

Round ``r`` of site ``k`` (``s = H/P`` steps, ``τ`` = overlap, fragment ``p = (r − 1) mod P``):

1. ``τ`` steps while the broadcast of round ``r − 1`` travels (none in round 1),
2. merge round ``r − 1``'s fragment (``merge_fragment_``),
3. ``s − τ`` steps,
4. upload ``Δ = θ_g[p] − θ_k[p]`` through fragment ``p``'s uplink encoder.

The virtual clock (``streaming_site_time``) follows the same order: the site computes without
pause unless the broadcast it must merge after ``τ`` steps has not arrived yet, in which case it
stalls until it has. Compute utilization is the share of each round's span spent in inner steps.
Peak bytes in flight per site is the largest single transfer of the round (an upload, or the
broadcast): one fragment, not the whole model.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from geoloco.algorithms.clock import SiteConfig, download_ends, transfer_time
from geoloco.algorithms.round import Round, close_time
from geoloco.algorithms.diloco import pseudo_gradient, run_inner_steps
from geoloco.algorithms.streaming import merge_fragment_
from geoloco.algorithms.strategy import Strategy
from geoloco.compression import Encoded

if TYPE_CHECKING:
    from geoloco.algorithms.simulator import Simulator

__all__ = ["SiteStreamTime", "StreamingRounds", "streaming_site_time"]


@dataclass(frozen=True, slots=True)
class SiteStreamTime:
    """One site's timeline in one streaming round (virtual seconds)."""

    start_s: float
    """When it started the round's first step (its previous upload time)."""
    stall_s: float
    """Seconds it waited for the previous round's broadcast before merging it."""
    compute_s: float
    """Seconds spent in the round's inner steps."""
    upload_s: float
    """When it started uploading its fragment (all steps done)."""
    arrival_s: float
    """When the upload had fully arrived at the coordinator."""

    @property
    def utilization(self) -> float:
        span = self.upload_s - self.start_s
        return self.compute_s / span if span > 0 else 1.0


def streaming_site_time(
    *,
    start_s: float,
    overlap_compute_s: float,
    rest_compute_s: float,
    previous_broadcast_s: float | None,
    upload_bytes: int,
    site: SiteConfig,
) -> SiteStreamTime:
    """A site's round: ``overlap_compute_s`` of steps, stall until ``previous_broadcast_s`` (the
    broadcast it merges now), ``rest_compute_s`` of steps, then its upload travels."""
    merge_ready = start_s + overlap_compute_s
    stall = 0.0 if previous_broadcast_s is None else max(0.0, previous_broadcast_s - merge_ready)
    upload = merge_ready + stall + rest_compute_s
    arrival = upload + transfer_time(upload_bytes, site.uplink_bps, site.latency_s)
    return SiteStreamTime(
        start_s=start_s,
        stall_s=stall,
        compute_s=overlap_compute_s + rest_compute_s,
        upload_s=upload,
        arrival_s=arrival,
    )


@dataclass(slots=True)
class _SiteStream:
    local: torch.Tensor | None = None
    """The site's own weights θ_k (flat fp32), kept between rounds."""
    merge_round: int | None = None
    """Round whose broadcast the site still has to merge (after τ steps of the next round)."""
    broadcast_s: float | None = None
    """When that broadcast reached the site."""
    upload_s: float = 0.0
    """When the site finished its last step (its last upload started)."""


class StreamingRounds:
    """Runs Streaming DiLoCo rounds for a ``Simulator`` (same workload, sites, clock, records)."""

    def __init__(self, simulator: Simulator) -> None:
        self.sim = simulator
        self.strategy: Strategy = simulator.strategy
        self.streams = [_SiteStream() for _ in simulator.sites]

    def _steps(self, site: Any, steps: int) -> tuple[list[float], int, float]:
        """``steps`` inner steps of ``site`` on the shared model: (losses, samples, virtual s)."""
        if steps == 0:
            return [], 0, 0.0
        sim = self.sim
        sim._sync_device()
        t0 = time.perf_counter()
        result = run_inner_steps(
            sim.model, site.optimizer, site.batches, steps, sim.workload.loss,
            grad_clip_norm=sim.config.inner_optimizer.grad_clip_norm, lr_schedule=site.lr_schedule,
        )
        sim._sync_device()
        return result.losses, result.samples, sim._step_seconds(site, steps, time.perf_counter() - t0)

    def round(self, round_number: int) -> dict[str, Any]:
        sim = self.sim
        strategy = self.strategy
        interval = strategy.schedule.interval
        mix = strategy.streaming.mix
        plan = strategy.configure_round(round_number, [s.name for s in sim.sites])
        p = plan.fragment
        fragment = strategy.partition[p]
        round_ = Round(number=plan.round, aggregation=strategy.new_aggregator(plan.round), opened_s=sim.open_s)
        round_.start(sim.open_s, sim.policy)
        cutoff = round_.deadline_at
        global_fragment = fragment.gather(sim.global_flat)
        pending: dict[int, Encoded] = {}
        times: list[SiteStreamTime] = []
        upload_sizes: list[int] = []
        losses: list[float] = []
        weights: dict[int, float] = {}
        private = sim.config.privacy.enabled
        private_updates: dict[int, torch.Tensor] = {}
        for site, stream in zip(sim.sites, self.streams):
            assert site.optimizer is not None
            if stream.local is None:
                stream.local = sim.global_flat.clone()
                stream.upload_s = site.ready_s
            sim.layout.load_(sim.model, stream.local)
            overlap = strategy.schedule.overlap_before_merge(plan.round)
            first_losses, first_samples, first_s = self._steps(site, overlap)
            if stream.merge_round is not None:
                local = sim.layout.flatten(sim.model)
                merge_fragment_(local, sim.global_flat, strategy.fragment(stream.merge_round), mix)
                sim.layout.load_(sim.model, local)
                del local
            rest_losses, rest_samples, rest_s = self._steps(site, interval - overlap)
            stream.local = sim.layout.flatten(sim.model)
            update = pseudo_gradient(global_fragment, fragment.gather(stream.local))
            losses.extend(first_losses + rest_losses)
            if private:
                # Privacy: the fragment's update enters this round's own private round below
                # (secure sum / clip / noise over the fragment only); timed once its size is known.
                private_updates[site.index] = update.to("cpu")
                times.append(streaming_site_time(
                    start_s=stream.upload_s, overlap_compute_s=first_s, rest_compute_s=rest_s,
                    previous_broadcast_s=stream.broadcast_s if stream.merge_round is not None else None,
                    upload_bytes=0, site=site.config,
                ))
                continue
            encoded = site.uplink.encode(update, seed=plan.uplink_seed(site.name), fragment=p)
            del update
            timing = streaming_site_time(
                start_s=stream.upload_s,
                overlap_compute_s=first_s,
                rest_compute_s=rest_s,
                previous_broadcast_s=stream.broadcast_s if stream.merge_round is not None else None,
                upload_bytes=encoded.nbytes,
                site=site.config,
            )
            weights[site.index] = strategy.site_weight(first_samples + rest_samples)
            if cutoff is None or timing.arrival_s <= cutoff:
                round_.add(encoded, weights[site.index], site=site.name, now=timing.arrival_s)
            else:
                pending[site.index] = encoded
            times.append(timing)
            upload_sizes.append(encoded.nbytes)
        if private:
            return self._private_finish(round_number, plan, p, private_updates, times, losses)
        arrivals = [t.arrival_s for t in times]
        aggregate_s = close_time(sim.policy, arrivals, start_s=sim.open_s, deadline_s=round_.deadline_s)
        included = [k for k, a in enumerate(arrivals) if a <= aggregate_s]
        for k in included:
            if k in pending:
                round_.add(pending.pop(k), weights[k], site=sim.sites[k].name, now=arrivals[k])
        sim.policy.observe(round_.close(now=aggregate_s, expected=[s.name for s in sim.sites]))
        # Streaming never folds (the next round syncs another fragment): late work stays in the
        # fragment's residual.
        for k, encoded in pending.items():
            sim.sites[k].uplink.restore(encoded, fragment=p)
        update = strategy.aggregate_round(sim.global_flat, round_.aggregation, plan)
        stats = self._finish(round_number, p, update, times, upload_sizes, arrivals, included,
                             aggregate_s, losses, [sim.sites[k].name for k in sorted(pending)])
        return {**stats, "deadline_s": round_.deadline_s}

    def _private_finish(
        self,
        round_number: int,
        plan: Any,
        p: int,
        updates: dict[int, torch.Tensor],
        compute_times: list[SiteStreamTime],
        losses: list[float],
    ) -> dict[str, Any]:
        """A privacy round of fragment ``p``: one secure sum / DP release of the fragment's
        updates (every site enters; privacy runs have no round deadline), then the outer step."""
        sim = self.sim
        mean, upload_sizes = sim._private_aggregate(round_number, updates, plan, fragment=p)
        update = self.strategy.apply_mean_update(
            sim.global_flat, mean, tuple(str(k) for k in sorted(updates)), plan, consume_mean=True
        )
        # The timelines were made before the upload size was known: its transfer now.
        times = [
            dataclasses.replace(t, arrival_s=t.upload_s + transfer_time(
                size, site.config.uplink_bps, site.config.latency_s
            ))
            for t, size, site in zip(compute_times, upload_sizes, sim.sites)
        ]
        arrivals = [t.arrival_s for t in times]
        # Privacy rounds have no deadline: every site's update enters.
        included, aggregate_s = list(range(len(arrivals))), max(arrivals)
        return self._finish(round_number, p, update, times, upload_sizes, arrivals, included,
                            aggregate_s, losses, [])

    def _finish(
        self,
        round_number: int,
        p: int,
        update: Any,
        times: list[SiteStreamTime],
        upload_sizes: list[int],
        arrivals: list[float],
        included: list[int],
        aggregate_s: float,
        losses: list[float],
        excluded: list[str],
    ) -> dict[str, Any]:
        """Apply the round's update, advance the clock and each site's stream; the stats."""
        sim = self.sim
        sim.global_flat = update.global_flat
        ends = download_ends(
            aggregate_s, arrivals, update.downlink.nbytes, [s.config for s in sim.sites]
        )
        for site, stream, timing, end in zip(sim.sites, self.streams, times, ends):
            stream.merge_round = round_number
            stream.broadcast_s = end
            stream.upload_s = timing.upload_s
            site.ready_s = timing.upload_s
        sim.open_s = aggregate_s
        down = update.downlink.nbytes
        return {
            "train_loss": sum(losses) / len(losses),
            "bytes_up": upload_sizes,
            "bytes_down": [down] * len(sim.sites),
            "compute_s": [t.compute_s for t in times],
            "utilization": [t.utilization for t in times],
            "excluded": excluded,
            "participants": [sim.sites[k].name for k in included],
            "end_s": max(ends),
            "peak_bytes_in_flight": [max(up, down) for up in upload_sizes],
            "fragment": p,
        }

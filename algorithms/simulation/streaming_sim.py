"""Streaming DiLoCo in the simulator: per-site local weights, staggered fragment syncs, overlap.

The plain simulator loads the global weights into its one shared model before each site's steps,
because in plain DiLoCo every site starts a round from ``θ_t``. In Streaming DiLoCo a site's
weights never reset as a whole (only one fragment is merged per round), so each site keeps its own
flat fp32 copy (``N × model`` memory) that is loaded into the shared model for its steps.

Round ``r`` of site ``k`` (from 0; ``s = H/P`` steps, ``τ`` = overlap, fragment ``p = r mod P``):

1. ``τ`` steps while the broadcast of round ``r − 1`` travels (none in round 0),
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

from dataclasses import dataclass, field
from typing import Any

import torch

from geoloco.algorithms.diloco import pseudo_gradient
from geoloco.algorithms.engine import RoundEngine
from geoloco.algorithms.finite import all_finite
from geoloco.algorithms.simulation.clock import SiteConfig, download_ends, transfer_time
from geoloco.algorithms.simulation.secure_clock import keys_held, unmasked_at
from geoloco.algorithms.simulation.sim_state import SimSite, SimTrainer
from geoloco.algorithms.simulation.sim_uplinks import Payload, SimUplinks, drop_refused, keep_aborted
from geoloco.algorithms.strategy import Strategy
from geoloco.algorithms.streaming import merge_fragment_
from geoloco.algorithms.streaming_overlap import OverlapBounds, OverlapChoice, OverlapMeter

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
    """When it started uploading its fragment (all steps done; a masked one, its round's shares
    held too) and went on to its next round's steps."""
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
    keys_held_s: float | None = None,
) -> SiteStreamTime:
    """A site's round: ``overlap_compute_s`` of steps, stall until ``previous_broadcast_s`` (the
    broadcast it merges now), ``rest_compute_s`` of steps, then its upload travels. A masked
    upload (secure aggregation) waits for the round's shares too (``keys_held_s``, from
    ``secure_clock.keys_held``: the key stages start with the steps after the merge), and so do
    the site's next steps: masking them is on its training thread."""
    merge_ready = start_s + overlap_compute_s
    stall = 0.0 if previous_broadcast_s is None else max(0.0, previous_broadcast_s - merge_ready)
    upload = merge_ready + stall + rest_compute_s
    if keys_held_s is not None:
        upload = max(upload, keys_held_s)
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
    meter: OverlapMeter | None = None
    """Its measured step time and fragment transfers (adaptive overlap)."""
    choice: OverlapChoice | None = None
    """τ of the fragment in flight and the steps of the site's next round (set at each upload)."""
    choices: list[OverlapChoice] = field(default_factory=list)
    """Every choice, in order (tests and the fidelity check read them)..."""
    seen: list[tuple[float | None, float | None]] = field(default_factory=list)
    """...and the step and transfer times each was chosen from."""


class StreamingRounds:
    """Runs Streaming DiLoCo rounds for the simulator: it owns the sites' own weights and streams;
    the global weights and the round clock go in and come back out of ``round``."""

    def __init__(
        self, strategy: Strategy, trainer: SimTrainer, uplinks: SimUplinks, engine: RoundEngine,
        sites: list[SimSite],
    ) -> None:
        self.strategy = strategy
        self.trainer = trainer
        self.uplinks = uplinks
        self.engine = engine
        self.sites = sites
        self.streams = [_SiteStream() for _ in sites]
        self.bounds = OverlapBounds.from_config(strategy.config.inner_steps, strategy.streaming)

    def _steps(self, site: SimSite, steps: int) -> tuple[list[float], int, float]:
        """``steps`` inner steps of ``site`` on the shared model: (losses, samples, virtual s)."""
        result, seconds = self.trainer.steps(site, steps)
        return ([], 0, seconds) if result is None else (result.losses, result.samples, seconds)

    def round(
        self, round_number: int, global_flat: torch.Tensor, open_s: float
    ) -> tuple[torch.Tensor, float, dict[str, Any]]:
        """Round ``round_number`` from the global weights ``global_flat``, opened at ``open_s``:
        the new global weights, when the round closed (the next one opens), and its stats."""
        strategy = self.strategy
        trainer = self.trainer
        uplinks = self.uplinks
        sites = self.sites
        names = [s.name for s in sites]
        plan = strategy.configure_round(round_number, names)
        p = plan.fragment
        fragment = strategy.partition[p]
        engine = self.engine
        round_ = engine.open(plan.round, uplinks.begin(plan), open_s)
        engine.maybe_start(round_, open_s, members=len(sites))
        global_fragment = fragment.gather(global_flat)
        payloads: list[Payload | None] = []
        weights: list[float] = []
        computed: list[tuple[float, float, float | None, float]] = []
        known: dict[int, int] = {}
        held_for_abort: dict[str, Payload] = {}
        losses: list[float] = []
        site_steps: list[int] = []
        for k, (site, stream) in enumerate(zip(sites, self.streams, strict=True)):
            if stream.local is None:
                stream.local = global_flat.clone()
                stream.upload_s = site.ready_s
                stream.meter = OverlapMeter()
            assert stream.meter is not None
            choice = stream.choice or self.bounds.fixed
            trainer.load(stream.local)
            overlap = choice.overlap_steps if plan.round > 0 else 0
            first_losses, first_samples, first_s = self._steps(site, overlap)
            if stream.merge_round is not None:
                local = trainer.flatten()
                merge_fragment_(local, global_flat, strategy.fragment(stream.merge_round), strategy.streaming.mix)
                trainer.load(local)
                del local
            rest_steps = choice.round_steps - overlap
            rest_losses, rest_samples, rest_s = self._steps(site, rest_steps)
            stream.meter.record_steps(overlap + rest_steps, first_s + rest_s)
            # Chosen as the real site does: when its upload starts, from the transfers it has
            # seen come back so far (not this round's).
            stream.choice = stream.meter.choose(self.bounds)
            stream.choices.append(stream.choice)
            stream.seen.append((stream.meter.step_s, stream.meter.transfer_s))
            site_steps.append(overlap + rest_steps)
            stream.local = trainer.flatten()
            pseudo = pseudo_gradient(global_fragment, fragment.gather(stream.local))
            if not all_finite(pseudo):
                raise ValueError(
                    f"site {site.name}'s fragment of round {plan.round} has NaN/Inf values; the simulator "
                    "does not model a streaming site's recovery from them (a real site withholds the "
                    "fragment, resets its residual and optimizer state and goes on from the global "
                    "weights): lower the inner lr, or clip gradients ([inner_optimizer] grad_clip_norm)"
                )
            losses.extend(first_losses + rest_losses)
            encoded = uplinks.encode(site.name, pseudo, plan, round_.aggregation)
            del pseudo
            # Weighted like the real site's upload: the round's inner steps.
            weights.append(strategy.site_weight(first_samples + rest_samples, overlap + rest_steps))
            previous = stream.broadcast_s if stream.merge_round is not None else None
            computed.append((stream.upload_s, first_s, previous, rest_s))
            size = uplinks.nbytes_now(encoded)
            held: Payload | None = encoded
            if size is not None:
                known[k] = size
                arrival = streaming_site_time(
                    start_s=stream.upload_s, overlap_compute_s=first_s, rest_compute_s=rest_s,
                    previous_broadcast_s=previous, upload_bytes=size, site=site.config,
                ).arrival_s
                if engine.admit_if_on_time(
                    round_, site.name, encoded, weights[k], screen=uplinks.screen(encoded), arrival=arrival
                ):
                    held = None
                    if uplinks.keeps(site.name, p):
                        held_for_abort[site.name] = encoded
            del encoded
            payloads.append(held)
        # The other sizes are known once every site has encoded (the secure protocol's messages).
        upload_sizes = []
        for k, (s, pl) in enumerate(zip(sites, payloads, strict=True)):
            if k in known:
                upload_sizes.append(known[k])
            else:
                assert pl is not None  # an update whose size was not known is still held
                upload_sizes.append(uplinks.nbytes(s.name, pl, round_.aggregation))
        configs = [s.config for s in sites]
        times = [
            streaming_site_time(
                start_s=start, overlap_compute_s=first_s, rest_compute_s=rest_s,
                previous_broadcast_s=previous, upload_bytes=size, site=site.config,
            )
            for (start, first_s, previous, rest_s), size, site in zip(computed, upload_sizes, sites, strict=True)
        ]
        traffic = [uplinks.traffic(s.name, round_.aggregation) for s in sites]
        secure = [t for t in traffic if t is not None]
        staged = len(secure) == len(sites)  # a secure round: its stages on the clock (``secure_clock``)
        if staged:
            keys_at = keys_held(
                [t.start_s + first_s + t.stall_s for t, (_, first_s, _, _) in zip(times, computed, strict=True)],
                secure, configs,
            )
            times = [
                streaming_site_time(
                    start_s=start, overlap_compute_s=first_s, rest_compute_s=rest_s,
                    previous_broadcast_s=previous, upload_bytes=t.masked_up, site=site.config, keys_held_s=h,
                )
                for (start, first_s, previous, rest_s), t, h, site in zip(computed, secure, keys_at, sites, strict=True)
            ]
        arrivals = [t.arrival_s for t in times]
        aggregate_s = engine.admit_arrivals(
            round_, sites=names, arrivals=arrivals, payloads=payloads, weights=weights, screen=uplinks.screen
        )
        outcome = engine.close(round_, now=aggregate_s, expected=names)
        # Streaming never folds (the next round syncs another fragment): late work stays in the
        # fragment's residual.
        for k, site in enumerate(sites):
            payload = payloads[k]
            if site.name in outcome.excluded and payload is not None:
                uplinks.keep(site.name, payload, p)
        stepped = engine.step(round_, global_flat, plan, list(outcome.contributors))
        drop_refused(uplinks, outcome, p)
        if stepped.aborted is not None:
            keep_aborted(uplinks, outcome, p, early=held_for_abort, names=names, payloads=payloads)
        del held_for_abort
        update = stepped.result.update
        if staged:  # the broadcast waits for the unmasking
            aggregate_s = unmasked_at(
                aggregate_s, arrivals, secure, configs, [k for k, n in enumerate(names) if n in outcome.contributors]
            )
        ends = download_ends(aggregate_s, arrivals, update.downlink.nbytes, configs)
        for site, stream, timing, end in zip(sites, self.streams, times, ends, strict=True):
            stream.merge_round = plan.round
            stream.broadcast_s = end
            assert stream.meter is not None
            stream.meter.record_transfer(end - timing.upload_s)
            stream.upload_s = timing.upload_s
            site.ready_s = timing.upload_s
        down = update.downlink.nbytes
        return update.global_flat, aggregate_s, {
            "train_loss": sum(losses) / len(losses),
            "bytes_up": upload_sizes,
            # A secure round's protocol messages come down besides the broadcast.
            "bytes_down": [down + (0 if t is None else t.down) for t in traffic],
            "compute_s": [t.compute_s for t in times],
            "utilization": [t.utilization for t in times],
            "end_s": max(ends),
            "peak_bytes_in_flight": [max(up, down) for up in upload_sizes],
            "fragment": p,
            "site_inner_steps": site_steps,
            "overlap_steps": [s.choice.overlap_steps if s.choice else 0 for s in self.streams],
            "closed": (outcome, stepped),
        }

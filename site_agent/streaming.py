"""Streaming DiLoCo on a real site: upload a fragment in the background and keep training.

The plain agent (``geoloco.site_agent.agent``) stops at the end of each round until the
broadcast is back. With ``[algorithm.streaming]`` enabled in the coordinator's config, the agent
hands each round to ``StreamingSite.step`` instead, which follows the schedule and merge of
``geoloco.algorithms.streaming`` (the simulator's functions):

1. run the round's remaining inner steps on the site's *own* weights (the model is never reset to
   the global weights as a whole);
2. compute ``Δ = θ_g[p] − θ_k[p]`` for the round's fragment ``p`` and encode it with that
   fragment's uplink encoder (error feedback per fragment);
3. start a background thread that uploads it (manifest ``fragment = p``) and then waits for the
   round's broadcast;
4. meanwhile run ``τ`` inner steps of the next round (``overlap_steps``; none in the run's last
   round);
5. join the thread, apply the fragment's delta to ``θ_g`` (digest-checked like every broadcast),
   and merge it into the model: ``θ_k[p] ← α·θ_k[p] + (1 − α)·θ_g[p]``.

Failures follow the plain agent's rules: a late or rejected upload goes back into its fragment's
residual; a digest mismatch or RESYNC fetches the full global weights, which then replace the
site's weights (its local progress since the last merge is lost, as for a freshly joined site);
a site that restarts (SIGKILL) joins, fetches ``θ_g`` and starts from it. Each round's upload is
its own aggregation on the coordinator: with secure aggregation each fragment sync is its own
secure sum (key stages beside the round's steps after the merge, the fragment's update masked
with the fragment's own private encoder and residual, then the unmask stages before the
broadcast). Multi-rank (``torchrun``) sites are not supported with streaming yet.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from geoloco.algorithms.diloco import pseudo_gradient, run_inner_steps
from geoloco.algorithms.params import derive_seed, weights_digest
from geoloco.algorithms.strategy import UPLINK_SEED_PURPOSE, AlgorithmConfig, build_strategy
from geoloco.algorithms.streaming import (
    FragmentUplink,
    StreamingSchedule,
    merge_fragment_,
)
from geoloco.compression import Encoded
from geoloco.protos import geoloco_pb2 as pb
from geoloco.site_agent.client import (
    RejoinRequired,
    RoundClosed,
    RunFinished,
    SiteAgentError,
    UpdateRejected,
)
from geoloco.site_agent.config import RoundResult

if TYPE_CHECKING:
    from geoloco.site_agent.agent import SiteAgent

__all__ = ["StreamingSite"]

logger = logging.getLogger(__name__)



@dataclass(slots=True)
class _InFlight:
    """One round's fragment on its way: the upload, then the broadcast, in a background thread."""

    round: int
    fragment: int
    encoded: Encoded | None
    loss: float
    samples: int
    inner_steps: int
    inner_time_s: float
    started_s: float
    bytes_down_before: int
    thread: threading.Thread | None = None
    uploaded: bool = False
    header: pb.BroadcastHeader | None = None
    data: bytes | None = None
    error: BaseException | None = None
    finished: bool = False
    skip_upload: bool = False
    masked: bytes | None = None
    """Secure aggregation: the masked fragment upload (``encoded`` is then None)."""


class StreamingSite:
    """Runs a ``SiteAgent``'s rounds as Streaming DiLoCo (see the module docstring)."""

    def __init__(self, agent: SiteAgent, algorithm: AlgorithmConfig) -> None:
        if agent.group is not None and agent.group.is_distributed:
            raise SiteAgentError(
                "the coordinator runs Streaming DiLoCo ([algorithm.streaming] enabled), which "
                "multi-rank (torchrun) sites do not support yet; run this site with one process "
                "or disable streaming"
            )
        strategy = build_strategy(algorithm, numel=agent.layout.numel, layout=agent.layout)
        self.agent = agent
        self.algorithm = algorithm
        self.strategy = strategy
        self.uplink: FragmentUplink = strategy.build_uplink()
        self.overlap_done = 0
        """Inner steps already run for the held round while the previous fragment travelled."""
        self.overlap_time_s = 0.0
        self.overlap_losses: list[float] = []
        self.overlap_samples = 0
        self.pending: _InFlight | None = None
        """A round whose upload or broadcast wait failed (coordinator restart, dropped site):
        finished after the re-join with the same encoded bytes (uploads are idempotent)."""

    @property
    def schedule(self) -> StreamingSchedule:
        return self.strategy.schedule

    # ---------------------------------------------------------------------------------------

    def step(self) -> None:
        """One round: train, send the fragment, overlap, merge. Called by ``SiteAgent._step``."""
        a = self.agent
        pending, self.pending = self.pending, None
        if pending is not None and pending.round == a._held_round:
            # Same bytes again; if the round already closed, only its broadcast is fetched.
            pending.skip_upload = a._coordinator_round > pending.round
            self._send_and_wait(pending)
            if pending.error is not None:
                self.pending = pending
                raise pending.error
            self._finish(pending)
            return
        if pending is not None and pending.encoded is not None and not pending.uploaded:
            # The site moved to another round (it re-joined and fetched) before this fragment
            # reached its round: what it carried goes back into the fragment's residual, as for
            # any update that missed its round.
            self.uplink.restore(pending.encoded, fragment=pending.fragment)
        a._refresh_round_info()
        if a._held_round < a._coordinator_round:
            self.overlap_done, self.overlap_losses, self.overlap_samples = 0, [], 0
            self._chase()
            return
        total = a._run_config.total_rounds
        if total and a._held_round >= total:
            a._finished = True
            return
        round_number = a._held_round
        last = bool(total) and round_number + 1 >= total
        flight = self._train_and_encode(round_number)
        flight.thread = threading.Thread(
            target=self._send_and_wait, args=(flight,), name=f"geoloco-stream-{a.site}", daemon=True
        )
        flight.thread.start()
        tau = self.schedule.overlap_steps
        self.overlap_done, self.overlap_time_s = 0, 0.0
        self.overlap_losses, self.overlap_samples = [], 0
        try:
            if tau > 0 and not last:
                losses, samples, seconds = self._train(tau)
                self.overlap_done, self.overlap_time_s = tau, seconds
                self.overlap_losses, self.overlap_samples = losses, samples
        finally:
            a._phase = pb.SITE_PHASE_WAITING
            flight.thread.join()
        if flight.error is not None:
            self.pending = flight
            raise flight.error
        self._finish(flight)

    def _train(self, steps: int) -> tuple[list[float], int, float]:
        """``steps`` inner steps on the model as it is (the site's own weights):
        (losses, samples, seconds)."""
        a = self.agent
        a._phase = pb.SITE_PHASE_TRAINING
        t0 = time.perf_counter()
        result = run_inner_steps(
            a.train_model, a.optimizer, a._batches(), steps, a._loss,
            grad_clip_norm=a.config.grad_clip_norm, lr_schedule=a.lr_schedule,
        )
        if a.device.type == "cuda":
            torch.cuda.synchronize(a.device)
        return result.losses, result.samples, time.perf_counter() - t0

    def _train_and_encode(self, round_number: int) -> _InFlight:
        a = self.agent
        assert a._global is not None
        started = time.monotonic()
        steps = self.schedule.interval - self.overlap_done
        fragment_index = self.strategy.fragment_for_round(round_number)
        fragment = self.strategy.partition[fragment_index]
        secure = a._secure
        if secure is not None:
            # The round's secure sum is over its fragment; key stages overlap the steps below.
            self._check_round_info(round_number)
            secure.begin_round(
                a.client, session=a.client.session_id, round_number=round_number,
                round_seed=a._round_info.round_seed, numel=fragment.numel,
            )
        a._position_lr_schedule(self.schedule.interval)
        losses, samples, seconds = self._train(steps)
        a._lr_round = round_number + 1  # the overlap steps count towards the next round
        # The round's steps: the overlap steps run while the previous fragment travelled, then these.
        losses = self.overlap_losses + losses
        samples += self.overlap_samples
        loss = sum(losses) / len(losses) if losses else float("nan")
        local = a.layout.flatten(a.module)
        update = pseudo_gradient(fragment.gather(a._global), fragment.gather(local))
        del local
        flight = _InFlight(
            round=round_number, fragment=fragment_index, encoded=None, loss=loss,
            samples=samples, inner_steps=self.schedule.interval,
            inner_time_s=seconds + self.overlap_time_s, started_s=started,
            bytes_down_before=a.client.stats.received,
        )
        if not bool(torch.isfinite(update).all()):
            logger.error(
                "site %s: fragment %d's pseudo-gradient of round %d has NaN/Inf values; not "
                "uploading it and resetting that fragment's residual", a.site, fragment_index,
                round_number,
            )
            self.uplink.encoders[fragment_index] = self.strategy.uplink_encoder()
            if secure is not None:
                secure.encoders.pop(fragment_index, None)
            return flight
        self._check_round_info(round_number)
        if secure is not None:
            flight.masked = secure.masked_update(update, fragment=fragment_index)
            return flight
        seed = derive_seed(a._round_info.round_seed, UPLINK_SEED_PURPOSE, a.site)
        flight.encoded = self.uplink.encode(update, seed=seed, fragment=fragment_index)
        return flight

    def _check_round_info(self, round_number: int) -> None:
        a = self.agent
        if a._round_info.round != round_number:
            raise SiteAgentError(
                f"internal error: training round {round_number} without its round seed "
                f"(latest round info is for round {a._round_info.round})"
            )

    def _upload(self, flight: _InFlight) -> None:
        """Upload the round's fragment: plain encoded bytes, or the masked secure-sum input
        followed by the unmask stages (before the broadcast exists)."""
        client = self.agent.client
        secure = self.agent._secure
        metrics = {
            "train_loss": flight.loss, "samples": float(flight.samples),
            "inner_steps": float(flight.inner_steps),
            "inner_time_s": flight.inner_time_s, "fragment": float(flight.fragment),
        }
        if flight.masked is not None:
            assert secure is not None
            client.upload(
                round_number=flight.round, data=flight.masked, **secure.upload_kwargs(),
                sample_weight=1.0, inner_steps=flight.inner_steps, metrics=metrics,
                fragment=flight.fragment,
            )
            flight.uploaded = True
            secure.unmask()
            return
        assert flight.encoded is not None
        client.upload(
            round_number=flight.round, data=flight.encoded.to_bytes(), codec=flight.encoded.spec,
            shape=list(flight.encoded.shape), sample_weight=float(max(flight.samples, 1)),
            inner_steps=flight.inner_steps, metrics=metrics, fragment=flight.fragment,
        )
        flight.uploaded = True

    def _send_and_wait(self, flight: _InFlight) -> None:
        """Background thread: upload the fragment (if any), then wait for the round's broadcast."""
        client = self.agent.client
        flight.error = None
        try:
            has_update = flight.encoded is not None or flight.masked is not None
            if has_update and not flight.skip_upload and not flight.uploaded:
                try:
                    self._upload(flight)
                except (RoundClosed, RunFinished) as why:
                    logger.info("site %s: fragment upload for round %d is late (%s)",
                                self.agent.site, flight.round, why)
                except UpdateRejected as why:
                    logger.error("site %s: the coordinator rejected round %d's fragment: %s",
                                 self.agent.site, flight.round, why)
            try:
                flight.header, flight.data = client.await_broadcast(flight.round)
            except RunFinished:
                flight.finished = True
        except BaseException as error:  # re-raised in the training thread
            flight.error = error

    def _finish(self, flight: _InFlight) -> None:
        a = self.agent
        if flight.finished:
            a._finished = True
            return
        header = flight.header
        assert header is not None and a._global is not None
        if not header.included and flight.encoded is not None:
            self.uplink.restore(flight.encoded, fragment=flight.fragment)
        elif not header.included and flight.masked is not None and a._secure is not None:
            # The fragment's secure sum did not include it (aborted, refused): keep it.
            a._secure.restore()
        resynced = self._apply(flight.round, header, flight.data)
        a._coordinator_round = max(header.next_round.round, a._held_round)
        if header.next_round.round == a._held_round:
            a._round_info = header.next_round
        total = a._run_config.total_rounds
        if header.run_finished or (total and a._held_round >= total):
            a._finished = True
        a._rounds_trained += 1
        a._rounds_included += int(header.included)
        logger.info(
            "site %s round %d (fragment %d): loss %.4f, %s (%d sites), now at round %d",
            a.site, flight.round, flight.fragment, flight.loss,
            "included" if header.included else "NOT included", header.num_contributors,
            a._held_round,
        )
        if a.hooks.on_round_end is not None:
            a.hooks.on_round_end(
                RoundResult(
                    round=flight.round, train_loss=flight.loss, samples=flight.samples,
                    inner_steps=flight.inner_steps, included=bool(header.included),
                    num_contributors=header.num_contributors, resynced=resynced,
                    bytes_up=(
                        0 if not flight.uploaded
                        else len(flight.masked) if flight.masked is not None
                        else len(flight.encoded.to_bytes()) if flight.encoded is not None else 0
                    ),
                    bytes_down=a.client.stats.received - flight.bytes_down_before,
                    inner_time_s=flight.inner_time_s,
                    round_time_s=time.monotonic() - flight.started_s,
                    weights_digest=a._global_digest or "", next_round=a._held_round,
                )
            )

    def _apply(self, round_number: int, header: pb.BroadcastHeader, data: bytes | None) -> bool:
        """Apply round ``round_number``'s fragment delta to ``θ_g`` and merge it into the model;
        True when the full weights had to be fetched instead."""
        a = self.agent
        assert a._global is not None
        if header.action == pb.BROADCAST_ACTION_APPLY_DELTA and data is not None:
            new = self.strategy.apply_downlink(a._global, Encoded.from_bytes(data), round_number)
            digest = weights_digest(new)
            if digest == header.weights_digest.digest.hex():
                a._global, a._global_digest, a._held_round = new, digest, round_number + 1
                fragment = self.strategy.fragment(round_number)
                local = a.layout.flatten(a.module)
                merge_fragment_(local, new, fragment, self.strategy.streaming.mix)
                a.layout.load_(a.module, local)
                return False
            logger.warning(
                "site %s: weights digest after round %d differs from the coordinator's; fetching "
                "the full weights", a.site, round_number,
            )
        a._fetch()  # through ``fetched``: merges what the site missed
        return True

    def fetched(self, weights: torch.Tensor, round_number: int) -> None:
        """The agent fetched the full ``θ_round_number`` while holding ``θ_g`` of an earlier round.

        The site keeps its own weights and merges the fragments of the rounds it missed (their
        merge is due now: the overlap steps after them are done), exactly what applying their
        broadcasts would have done. If it missed more than P rounds, or the coordinator went back
        (a restart from an older checkpoint), the global weights replace the site's.
        """
        a = self.agent
        held = a._held_round
        missed = range(held, round_number)
        local = a.layout.flatten(a.module)
        if 0 < len(missed) <= self.schedule.fragments:
            for missed_round in missed:
                merge_fragment_(
                    local, weights, self.strategy.fragment(missed_round), self.strategy.streaming.mix
                )
        else:
            local = weights.clone()
            self.overlap_done, self.overlap_losses, self.overlap_samples = 0, [], 0
        a.layout.load_(a.module, local)
        a._global, a._global_digest, a._held_round = weights, weights_digest(weights), round_number

    def _chase(self) -> None:
        """Behind the coordinator (after a re-join): apply broadcasts without training."""
        a = self.agent
        a._phase = pb.SITE_PHASE_WAITING
        round_number = a._held_round
        try:
            header, data = a.client.await_broadcast(round_number)
        except RunFinished:
            a._finished = True
            return
        except RoundClosed as why:
            # The coordinator went back to an earlier round (restart): join again.
            raise RejoinRequired(str(why)) from None
        self._apply(round_number, header, data)
        a._coordinator_round = max(header.next_round.round, a._held_round)
        if header.next_round.round == a._held_round:
            a._round_info = header.next_round
        total = a._run_config.total_rounds
        if header.run_finished or (total and a._held_round >= total):
            a._finished = True

"""Streaming DiLoCo on a real site: upload a fragment in the background and keep training.

Plain rounds (``geoloco.site_agent.plain``) stop at the end of each round until the broadcast
is back. With ``[algorithm.streaming]`` enabled in the coordinator's config, the agent runs its
rounds with ``StreamingRounds`` instead, which follows the strategy's fragments, schedule and
merge (``geoloco.algorithms.streaming``, the simulator's functions):

1. run the round's remaining inner steps on the site's *own* weights (the model is never reset to
   the global weights as a whole);
2. compute ``Δ = θ_g[p] − θ_k[p]`` for the round's fragment ``p`` and encode it with that
   fragment's uplink encoder (error feedback per fragment);
3. start a background thread that uploads it (manifest ``fragment = p``) and then waits for the
   round's broadcast;
4. meanwhile run ``τ`` inner steps of the next round (``overlap_steps``, or with
   ``adaptive_overlap`` what ``geoloco.algorithms.streaming_overlap.choose_overlap`` makes of the
   site's measured step time and fragment transfer times, which may also lengthen the next round
   up to ``interval_steps_max``; none in the run's last round);
5. join the thread, apply the fragment's delta to ``θ_g`` (digest-checked like every broadcast),
   and merge it into the model: ``θ_k[p] ← α·θ_k[p] + (1 − α)·θ_g[p]``.

The upload carries what the overlap rule saw and chose (``step_s``, ``transfer_s``,
``overlap_steps``, ``next_round_steps``) and how long the previous merge waited for its broadcast
after the overlap steps (``merge_wait_s``; 0 when the transfer was hidden).

Failures follow the plain agent's rules: a late upload, or one in an aborted round, goes back into
its fragment's residual, a refused one is dropped (``BroadcastHeader.refused``); a digest mismatch
or RESYNC fetches the full global weights, which then replace the site's weights (its local
progress since the last merge is lost, as for a freshly joined site);
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
from dataclasses import dataclass, field

import torch

from geoloco.algorithms.diloco import pseudo_gradient
from geoloco.algorithms.streaming import merge_fragment_
from geoloco.algorithms.streaming_overlap import OverlapBounds, OverlapChoice, OverlapMeter
from geoloco.protos import geoloco_pb2 as pb
from geoloco.site_agent.client import RoundClosed, RunFinished, SiteAgentError, UpdateRejected
from geoloco.site_agent.client_broadcast import OpenBroadcast
from geoloco.site_agent.errors import RejoinRequired
from geoloco.site_agent.runner import RoundRunner, TrainedUpdate
from geoloco.site_agent.trainer import SiteTrainer
from geoloco.site_agent.uplink import keep_or_drop

__all__ = ["StreamingRounds"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _InFlight:
    """One round's fragment on its way: the upload, then the broadcast, in a background thread."""

    trained: TrainedUpdate
    fragment: int
    bytes_down_before: int
    thread: threading.Thread | None = None
    uploaded: bool = False
    header: pb.BroadcastHeader | None = None
    data: memoryview | None = None
    error: BaseException | None = None
    finished: bool = False
    skip_upload: bool = False
    choice: OverlapChoice | None = None
    """τ to train while this fragment travels, and the next round's steps."""
    overlap_metrics: dict[str, float] = field(default_factory=dict)
    """What the overlap rule saw and chose, sent with the upload."""
    sent_s: float | None = None
    """``time.monotonic()`` when its first upload attempt started."""
    back_s: float | None = None
    """...and when its broadcast had arrived (None: not on the first attempt)."""
    withheld: str = ""
    """Why there is no fragment to send (``RoundRunner.withheld``), said with the wait."""

    @property
    def round(self) -> int:
        return self.trained.round


@dataclass(slots=True)
class _Overlap:
    """Inner steps already run for the held round while the previous fragment travelled."""

    steps: int = 0
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    samples: int = 0


class StreamingRounds(RoundRunner):
    """Streaming DiLoCo rounds (see the module docstring)."""

    trainer: SiteTrainer
    """A data-parallel site's trainer: these rounds train through it themselves."""

    def _setup(self) -> None:
        if self.trainer.is_distributed:
            raise SiteAgentError(
                "the coordinator runs Streaming DiLoCo ([algorithm.streaming] enabled), which "
                "multi-rank (torchrun) sites do not support yet; run this site with one process "
                "or disable streaming"
            )
        self.schedule = self.strategy.schedule
        self._bounds = OverlapBounds.from_config(self.strategy.config.inner_steps, self.strategy.streaming)
        self._meter = OverlapMeter()
        self._choice: OverlapChoice = self._bounds.fixed
        self._merge_wait_s = 0.0
        """Seconds the last merge waited for its broadcast after the overlap steps (0: hidden)."""
        """Steps of the next round (``geoloco.algorithms.streaming_overlap``)."""
        self._overlap = _Overlap()
        self._pending: _InFlight | None = None
        """A round whose upload or broadcast wait failed (coordinator restart, dropped site):
        finished after the re-join with the same encoded bytes (uploads are idempotent)."""

    # ---------------------------------------------------------------------------------------

    def step(self) -> None:
        """One round: train, send the fragment, overlap, merge."""
        state = self.state
        pending, self._pending = self._pending, None
        if pending is not None and pending.round == state.held_round:
            # Same bytes again; if the round already closed, only its broadcast is fetched.
            pending.skip_upload = state.coordinator_round > pending.round
            self._send_and_wait(pending)
            if pending.error is not None:
                self._pending = pending
                raise pending.error
            self._finish(pending)
            return
        update = None if pending is None else pending.trained.update
        if pending is not None and update is not None and not update.masked and not pending.uploaded:
            # The site moved to another round (it re-joined and fetched) before this fragment
            # reached its round: what it carried goes back into the fragment's residual, as for
            # any update that missed its round.
            self.uplink.restore(update)
        if state.is_behind:
            self._overlap = _Overlap()
            self._meter.reset_transfers()
            self._chase()
            return
        if state.at_end:
            state.mark_finished()
            return
        self._check_round_info()
        round_number = state.held_round
        flight = self._train_and_encode(round_number)
        # τ and the next round's steps, from what was measured before this fragment left.
        self._choice = flight.choice = self._meter.choose(self._bounds)
        flight.overlap_metrics = self._overlap_metrics(flight.choice)
        flight.thread = threading.Thread(
            target=self._send_and_wait, args=(flight,), name=f"geoloco-stream-{self.site}", daemon=True
        )
        flight.thread.start()
        tau = flight.choice.overlap_steps
        self._overlap = _Overlap()
        try:
            if tau > 0 and not state.is_last_round(round_number):
                state.phase = pb.SITE_PHASE_TRAINING
                result = self.trainer.train_steps(tau)
                self._overlap = _Overlap(tau, result.seconds, result.losses, result.samples)
        finally:
            state.phase = pb.SITE_PHASE_WAITING
            waited = time.monotonic()
            flight.thread.join()
            self._merge_wait_s = time.monotonic() - waited
        if flight.error is not None:
            self._pending = flight
            raise flight.error
        if flight.sent_s is not None and flight.back_s is not None:
            self._meter.record_transfer(flight.back_s - flight.sent_s)
        self._finish(flight)

    def _train_and_encode(self, round_number: int) -> _InFlight:
        state, trainer = self.state, self.trainer
        started = time.monotonic()
        steps = max(0, self._choice.round_steps - self._overlap.steps)
        fragment_index = self.strategy.fragment_for_round(round_number)
        fragment = self.strategy.partition[fragment_index]
        # Secure aggregation: the round's secure sum is over its fragment; the key stages
        # overlap the steps below.
        self.uplink.begin_round(
            self.client, round_number=round_number, round_seed=state.round_seed(round_number),
            numel=fragment.numel,
        )
        trainer.position_lr_schedule(round_number, self.schedule.interval)
        state.phase = pb.SITE_PHASE_TRAINING
        # The previous fragment's transfers and merge are reported with this upload, as a plain
        # site reports its previous round's (``TrainedUpdate.phases_s``).
        phases = dict(self.transfer_phases_s)
        self.transfer_phases_s.clear()
        training_at = time.monotonic()
        result = trainer.train_steps(steps)
        trained_at = time.monotonic()
        self._meter.record_steps(steps + self._overlap.steps, result.seconds + self._overlap.seconds)
        trainer.lr_schedule_reached(round_number + 1)  # the overlap steps count towards the next round
        # The round's steps: the overlap steps run while the previous fragment travelled, then these.
        losses = self._overlap.losses + result.losses
        samples = result.samples + self._overlap.samples
        loss = sum(losses) / len(losses) if losses else float("nan")
        local = trainer.flatten()
        update = pseudo_gradient(fragment.gather(state.global_weights), fragment.gather(local))
        del local
        bytes_down_before = self.client.stats.received
        encoding_at = time.monotonic()
        encoded = self._encode(update, round_number, fragment_index, samples)
        # ``train``: this round's steps after the merge (the overlap steps ran while the previous
        # fragment travelled, inside that round's wait).
        phases.update(
            train=trained_at - training_at, pseudo_gradient=encoding_at - trained_at,
            encode=time.monotonic() - encoding_at,
        )
        trained = TrainedUpdate(
            round=round_number, update=encoded, loss=loss, samples=samples,
            inner_steps=steps + self._overlap.steps, inner_time_s=result.seconds + self._overlap.seconds,
            started_s=started, phases_s=phases,
        )
        return _InFlight(
            trained=trained, fragment=fragment_index, bytes_down_before=bytes_down_before,
            withheld=self.withheld if encoded is None else "",
        )

    def _send_and_wait(self, flight: _InFlight) -> None:
        """Background thread: upload the fragment (if any), then wait for the round's broadcast."""
        client = self.client
        first_attempt = flight.error is None and flight.sent_s is None
        flight.error = None
        trained = flight.trained
        if first_attempt:
            flight.sent_s = time.monotonic()
        opened: OpenBroadcast | None = None
        try:
            if trained.update is not None and not flight.skip_upload and not flight.uploaded:
                # The wait goes out ahead of the upload, as a plain site's does: the broadcast
                # then leaves the moment the round closes, not one round trip later.
                opened = client.open_broadcast(trained.round)
                on_time = False
                upload_started = time.monotonic()
                try:
                    # A masked fragment is followed by the unmask stages (before the broadcast).
                    response = self.uplink.upload(
                        client, trained.update, round_number=trained.round,
                        inner_steps=trained.inner_steps,
                        metrics={**trained.metrics(), "fragment": float(flight.fragment),
                                 **flight.overlap_metrics},
                    )
                    flight.uploaded = True
                    self._add_phases({"upload": time.monotonic() - upload_started})
                    self.uplink.uploaded()
                    on_time = not response.folded_late
                except (RoundClosed, RunFinished) as why:
                    logger.info("site %s: fragment upload for round %d is late (%s)",
                                self.site, trained.round, why)
                except UpdateRejected as why:
                    logger.error("site %s: the coordinator rejected round %d's fragment: %s",
                                 self.site, trained.round, why)
                if not on_time:
                    # The early wait may hold a header written before the update was refused
                    # or folded into a later round: ask again.
                    opened.cancel()
                    opened = None
            try:
                waiting_at = time.monotonic()
                flight.header, flight.data = client.await_broadcast(
                    trained.round, opened=opened, withheld=flight.withheld
                )
                opened = None
                done = time.monotonic()
                header_at = min(max(client.stats.broadcast_header_s, waiting_at), done)
                self._add_phases({"wait": header_at - waiting_at, "download": done - header_at})
                if first_attempt:
                    flight.back_s = done
            except RunFinished:
                flight.finished = True
            except RoundClosed as why:
                # The coordinator is at an earlier round (restarted from an older checkpoint):
                # join again and take the weights it names, as a plain site does.
                flight.error = RejoinRequired(str(why))
        except BaseException as error:  # noqa: BLE001 (re-raised in the training thread)
            flight.error = error
        finally:
            if opened is not None:
                opened.cancel()

    def rejoined(self, *, coordinator_round: int, new_session: bool, must_fetch: bool) -> bool:
        """A fragment already uploaded to the round the coordinator is still at goes up again,
        as a plain site's update does: a restarted coordinator lost what arrived before its
        checkpoint, and waits for it; one that kept it takes the same bytes once."""
        pending = self._pending
        if pending is not None and pending.round == coordinator_round and not must_fetch:
            pending.uploaded = False
        return False

    def _overlap_metrics(self, choice: OverlapChoice) -> dict[str, float]:
        """What the overlap rule saw and chose for a fragment (the fidelity check replays it);
        a measurement not made yet is -1."""
        step_s, transfer_s = self._meter.step_s, self._meter.transfer_s
        return {
            "overlap_steps": float(choice.overlap_steps),
            "next_round_steps": float(choice.round_steps),
            "step_s": -1.0 if step_s is None else step_s,
            "transfer_s": -1.0 if transfer_s is None else transfer_s,
            "merge_wait_s": self._merge_wait_s,
        }

    def _finish(self, flight: _InFlight) -> None:
        state = self.state
        if flight.finished:
            state.mark_finished()
            return
        header = flight.header
        trained = flight.trained
        assert header is not None
        if not header.included and trained.update is not None:
            # Its fragment's (secure) sum did not include it: kept in the residual, unless refused.
            keep_or_drop(self.uplink, trained.update, refused=header.refused, site=self.site,
                         round_number=trained.round)
        resynced = self._apply_broadcast(trained.round, header, flight.data)
        state.take_broadcast_header(header)
        if flight.withheld:
            # The site's own weights hold the NaN/Inf values (they carry over between rounds here,
            # unlike in plain rounds): it goes on from the global weights. The overlap steps trained
            # from them meanwhile are dropped, and the optimizer's state they touched is reset again.
            logger.warning("site %s: going on from the global weights of round %d after NaN/Inf values",
                           self.site, state.held_round)
            self.trainer.load_(state.global_weights)
            self.trainer.reset_optimizer_state()
            self._overlap = _Overlap()
        self._report(
            trained, header, included=bool(header.included), resynced=resynced,
            bytes_up=len(trained.update.data) if flight.uploaded and trained.update is not None else 0,
            bytes_down=self.client.stats.received - flight.bytes_down_before,
            fragment=flight.fragment,
        )

    def _load_broadcast(self, round_number: int) -> None:
        """Merge round ``round_number``'s fragment of the new ``θ_g`` into the model:
        ``θ_k[p] ← α·θ_k[p] + (1 − α)·θ_g[p]``."""
        local = self.trainer.flatten()
        merge_fragment_(
            local, self.state.global_weights, self.strategy.fragment(round_number),
            self.strategy.streaming.mix,
        )
        self.trainer.load_(local)

    def _load_fetched(self, weights: torch.Tensor, held_before: int | None, round_number: int) -> None:
        """The site fetched the full ``θ_round_number`` while holding ``θ_g`` of ``held_before``.

        The site keeps its own weights and merges the fragments of the rounds it missed (their
        merge is due now: the overlap steps after them are done), exactly what applying their
        broadcasts would have done. If it missed more than P rounds, or the coordinator went back
        (a restart from an older checkpoint), the global weights replace the site's.
        """
        if held_before is None:
            self.trainer.load_(weights)
            return
        missed = range(held_before, round_number)
        local = self.trainer.flatten()
        if 0 < len(missed) <= self.schedule.fragments:
            for missed_round in missed:
                merge_fragment_(
                    local, weights, self.strategy.fragment(missed_round), self.strategy.streaming.mix
                )
        else:
            local = weights.clone()
            self._overlap = _Overlap()
        self.trainer.load_(local)

"""Asynchronous (decoupled) DiLoCo on a real site: train, hand the update off, train on.

With ``[algorithm.asynchronous]`` a site never waits at a round barrier. Three things run at
once, each on its own thread:

* **training** (the agent's loop, ``step``): a phase of H inner steps starts from the newest
  global model the site has fully received, ``θ_v``; the trained weights ``θ_k`` are handed to
  the uploader, and the next phase starts at once. Not from the site's own weights (except
  while the uploader is busy, below): the coordinator merges an update into whatever model it
  holds then, so the update must be measured from a model the coordinator knows, or the next
  update would carry this one's movement a second time
  (``geoloco.algorithms.simulation.async_sim`` explains the same choice for the simulator);
* **the follower**: waits for every merge's broadcast and applies it to the held global
  weights (digest-checked; a site that fell behind fetches the full weights);
* **the uploader**: forms each update's pseudo-gradient ``θ_v − θ_k`` and encodes it (error
  feedback as in synchronous rounds; off the training thread, so a phase never waits for the
  encoder), then sends it labelled with its base version ``v``. The coordinator puts it into the
  merge that is open (``geoloco.coordinator.intake``), discounted by its staleness, or holds it
  for the next merge when the site's previous update is already in the open one, and answers
  with the merge's number; the site's update after that waits until that merge is open (one
  update per site and merge, one held). An update the coordinator cannot take now (its merge is
  being applied) is sent again after the next broadcast; one beyond ``max_staleness`` is dropped
  with the error-feedback residual (its steps are lost), as one the update guard refuses is, and
  as the simulator drops both; one in a merge that aborted goes back into the residual.

Training does not wait for the link: while the uploader has not yet taken the previous update (a
link slower than the phases, or down), the site trains on from its own weights, and the update it
sends next covers every step since its base version (``_Trajectory``), for up to
``_MAX_TRAJECTORY_PHASES`` phases; a longer outage makes it wait. The site's inner
learning-rate schedule follows its own phases, which differ from the coordinator's merges. With
a ``state_dir`` the site saves its state (weights, inner optimizer, data position, residual)
after a hand-off, at most every ``_SAVE_EVERY_S`` seconds; a restarted process resumes from it.
With ``dynamic_local_updates`` a site runs ``H · v / v_max`` steps per phase (Liu et al.'s DyLU,
``dynamic_local_steps``): ``v`` its own speed over its latest phase, ``v_max`` the fastest site's,
which every broadcast carries (``RoundInfo.fastest_step_s``, from the updates' manifests).

With ``rebase``, at each step boundary of a phase a version the follower applied since the
trajectory's base is taken into the running model
(``geoloco.algorithms.diloco.rebase_local``, the simulator's formula) and becomes the base the
update is measured from, so on links slower than a step an update is not one merge stale. A
single-rank site only: the ranks of a multi-rank site would have to agree on the step.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from geoloco.algorithms.async_merge import dynamic_local_steps, stale_admission
from geoloco.algorithms.diloco import pseudo_gradient_into_local, rebase_local
from geoloco.algorithms.finite import all_finite
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.protocol_version import COUNTED_HISTORY_ROUNDS
from geoloco.site_agent.client import AgentStopped, RoundClosed, RunFinished, UpdateRejected
from geoloco.site_agent.errors import RejoinRequired, SiteAgentError
from geoloco.site_agent.persist import prefixed, unprefixed
from geoloco.site_agent.runner import RoundRunner, TrainedUpdate
from geoloco.site_agent.trainer import RoundTraining, SiteTrainer
from geoloco.site_agent.uplink import StrategyUplink, keep_or_drop

__all__ = ["COMPUTE_S_TOTAL", "REBASED_AT_STEP", "AsyncRounds"]

COMPUTE_S_TOTAL = "compute_s_total"
"""Upload metric: the site process's inner-step seconds so far (``_Outgoing.compute_s_total``)."""
REBASED_AT_STEP = "rebased_at_step"
"""Upload metric with ``rebase``: the update's inner steps run before it took in its base
version (absent when it took in none)."""

logger = logging.getLogger(__name__)

_POLL_S = 0.2
"""How often a waiting thread looks at the stop flag and the other threads' failures."""
_KEEP_VERDICTS = 8
"""Merges whose broadcast's word on this site's update the follower keeps (``_verdicts``)."""
_MAX_TRAJECTORY_PHASES = 4
"""While the uploader is busy, a site trains on from its own weights for at most this many phases
in all; then it waits for the link. Without a bound, a link or coordinator down for minutes would
make one update of thousands of steps, which the update guard refuses as an outlier anyway."""
_SAVE_EVERY_S = 5.0
"""With a ``state_dir``: the state is saved after a hand-off at most this often (phases can be
a fraction of a second; a restart loses at most this much training besides the update in hand)."""


@dataclass(slots=True)
class _Trajectory:
    """The inner steps a site ran since it last took a global version: one phase, or several
    while the uploader was busy (``AsyncRounds._train_phase``)."""

    base_round: int
    base: torch.Tensor
    """``θ_v``, the version the trajectory started from."""
    steps: int = 0
    samples: int = 0
    inner_time_s: float = 0.0
    train_s: float = 0.0
    started_s: float | None = None
    phases: int = 0
    rebased_at_step: int | None = None
    """With ``rebase``: ``steps`` when it last took in a newer version (None: never)."""

    def add(self, result: RoundTraining, started_s: float) -> None:
        """One more phase of ``SiteTrainer.train_round`` (``result``) begun at ``started_s``."""
        self.steps += int(result.steps)
        self.samples += int(result.samples)
        self.inner_time_s += float(result.seconds)
        self.train_s += time.monotonic() - started_s
        self.phases += 1
        if self.started_s is None:
            self.started_s = started_s


@dataclass(slots=True)
class _Outgoing:
    """An update trained from version ``trained.round`` and waiting for the uploader."""

    trained: TrainedUpdate
    phase: int
    compute_s_total: float
    """Inner-step seconds of this site process up to and including this phase (sent with the
    update: the emulator's compute utilization, where transfers overlap training)."""
    nbytes: int = 0
    rebased_at_step: int | None = None
    """The trajectory's ``rebased_at_step`` (sent with the update as ``REBASED_AT_STEP``)."""
    base: torch.Tensor | None = None
    local: torch.Tensor | None = None
    """``θ_v`` and the trained weights, until the uploader forms the update from them
    (``AsyncRounds._form``: ``trained.update`` is None until then)."""

    def metrics(self) -> dict[str, float]:
        """What the upload carries besides the update: the phase's metrics and this site's totals."""
        metrics = {**self.trained.metrics(), COMPUTE_S_TOTAL: self.compute_s_total}
        if self.rebased_at_step is not None:
            metrics[REBASED_AT_STEP] = float(self.rebased_at_step)
        return metrics


class AsyncRounds(RoundRunner):
    """Asynchronous DiLoCo phases (see the module docstring)."""

    trainer: SiteTrainer
    """A data-parallel site's trainer: these rounds train through it themselves."""

    def _setup(self) -> None:
        self._rebase = self.state.algorithm.asynchronous.rebase
        if self._rebase and self.trainer.is_distributed:
            raise SiteAgentError(
                "[algorithm.asynchronous] rebase takes merges into a running phase step by step, which a "
                "multi-rank site does not do yet; run this site on one rank or turn rebase off"
            )
        self._changed = threading.Condition()
        """Notified when the held version moves, the outbox empties or a thread fails."""
        self._weights_lock = threading.Lock()
        """Held while the follower changes the global weights and while a phase copies them."""
        self._uplink_lock = threading.Lock()
        """The error-feedback residual is encoded into by training and restored by the uploader."""
        self._queued: _Outgoing | None = None
        """The newest update, not yet taken by the uploader."""
        self._in_flight: _Outgoing | None = None
        """The update the uploader is sending."""
        self._awaiting: dict[int, _Outgoing] = {}
        """Updates the coordinator took, by the merge they entered (or are held for), until that
        merge's broadcast says whether they counted."""
        self._verdicts: dict[int, tuple[bool, bool]] = {}
        """merge -> (included, refused) as its broadcast said, for the last ``_KEEP_VERDICTS``
        merges the follower applied: an update registered after its merge's broadcast was
        applied is settled by it."""
        self._last_merge: int | None = None
        """The merge the latest uploaded update entered (or is held for)."""
        self._failure: BaseException | None = None
        self._threads: list[threading.Thread] = []
        self._halt = threading.Event()
        self._phase = 0
        self._trajectory: _Trajectory | None = None
        self._compute_s = 0.0
        self._saved_s = -math.inf
        self._step_s: float | None = None
        """Seconds per inner step over the latest phase (Dynamic Local Updates)."""
        self._fastest_step_s: float | None = None
        """The fastest site's, as the latest broadcast said (``RoundInfo.fastest_step_s``)."""
        self._non_finite = threading.Event()
        """The uploader found an update with NaN/Inf values: the trainer resets its optimizer's
        state and drops its trajectory before the next phase (both may hold them)."""

    # -- the agent's loop ----------------------------------------------------------------------

    def step(self) -> None:
        self._raise_failure()
        state = self.state
        if state.at_end:
            state.mark_finished()
        if state.finished:
            self._drain()
            return
        self._start_threads()
        outgoing = self._train_phase()
        if outgoing is None:
            return
        with self._changed:
            kept = not state.finished and self._queued is None  # else over, or the uploader failed
            if kept:
                self._queued = outgoing
                self._changed.notify_all()
        if not kept:
            self._give_back(outgoing)
            self._raise_failure()
            return
        now = time.monotonic()
        if now - self._saved_s >= _SAVE_EVERY_S:
            self._saved_s = now
            with self._weights_lock:  # the follower changes the held weights in place
                self._boundary()
        self._raise_failure()

    def close(self) -> None:
        """Stop the threads; with a ``state_dir``, save the state once more (a site stopped
        cleanly resumes exactly where it stopped)."""
        self._stop_threads()
        queued, self._queued = self._queued, None
        if queued is not None:  # never sent: its content goes on in the residual
            self._give_back(queued)
        if self._phase:
            self._boundary()

    def snapshot(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """The uplink's error-feedback residual (the agent saves the weights, the inner
        optimizer and the data position beside it); the update in hand is not saved: a
        restarted site's steps since its last hand-off are lost. None with secure aggregation
        (refused with asynchronous merges anyway)."""
        uplink = self.uplink
        if not isinstance(uplink, StrategyUplink):
            return None
        with self._uplink_lock:
            tensors, meta = uplink.state()
        return prefixed("uplink.", tensors), {"uplink": meta, "phase": self._phase}

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        uplink = self.uplink
        if isinstance(uplink, StrategyUplink):
            uplink.load_state(unprefixed("uplink.", tensors), meta["uplink"], self.trainer.device)
        # The inner lr schedule is positioned by the phase count: go on from where it was.
        self._phase = int(meta.get("phase", 0))

    def rejoined(self, *, coordinator_round: int, new_session: bool, must_fetch: bool) -> bool:
        """After a re-join the threads start again. The update that was being sent is sent
        again (the coordinator answers a resend of one that already entered a merge with that
        merge, from its durable state after a restart too, so it is never counted twice); an
        update queued behind it, never sent, goes back into the residual instead. In a new
        session, updates the old one took into merges it did not make durable (at or after the
        round it resumed at) go back into the residual too, and for those before it the
        coordinator says whether they counted (``_ask_verdict``). An update computed from a
        version the coordinator does not have (it started a new run) goes back into the
        residual."""
        self._stop_threads()
        self._failure = None
        interrupted, self._in_flight = self._in_flight, None
        if interrupted is not None:
            if self._queued is not None:
                self._give_back(self._queued)
            self._queued = interrupted  # sent again first
        if new_session:
            self._last_merge = None
            awaiting, self._awaiting = self._awaiting, {}
            self._verdicts.clear()
            for merge, taken in sorted(awaiting.items()):
                # A merge the restarted coordinator made durable says itself whether the update
                # counted (its history survives the restart); a later one is gone with its session.
                counted, dropped = self._ask_verdict(merge) if merge < coordinator_round else (False, False)
                self._finish(taken.trained, included=counted, refused=dropped, merged=merge)
        queued = self._queued
        if queued is not None and queued.trained.round > coordinator_round:
            logger.info(
                "site %s: the coordinator is at version %d, before its update's base %d; the update "
                "goes back into the residual", self.site, coordinator_round, queued.trained.round,
            )
            self._give_back(queued)
            self._queued = None
        return False

    def _load_fetched(self, weights: object, held_before: int | None, round_number: int) -> None:
        """Nothing: each phase loads the model from the newest held weights itself."""

    def _load_broadcast(self, round_number: int) -> None:
        """Nothing: each phase loads the model from the newest held weights itself."""

    # -- training ------------------------------------------------------------------------------

    def _train_phase(self) -> _Outgoing | None:
        """One phase of inner steps; the update it ends, or None when there is none to send
        now. While the uploader has not yet taken the previous update, the phase goes on from
        the site's own weights instead (its trajectory since its base grows, and the update
        that finally goes covers all of it: one pseudo-gradient ``θ_v − θ_k``, never two
        measured from the same base). A trajectory whose base fell more than ``max_staleness``
        merges behind is abandoned for the newest version, its steps lost."""
        state, trainer = self.state, self.trainer
        trajectory = self._trajectory
        if self._non_finite.is_set():
            self._non_finite.clear()
            trainer.reset_optimizer_state()
            if trajectory is not None:
                logger.info("site %s: dropping %d inner steps trained since an update with NaN/Inf values",
                            self.site, trajectory.steps)
            trajectory = self._trajectory = None
        if trajectory is not None and self._too_stale(trajectory.base_round):
            logger.info(
                "site %s: %d inner steps from version %d are too stale to send (the site holds version "
                "%d); going on from there", self.site, trajectory.steps, trajectory.base_round, state.held_round,
            )
            trajectory = self._trajectory = None
        if trajectory is None:
            with self._weights_lock:
                trajectory = self._trajectory = _Trajectory(state.held_round, state.global_weights.clone())
            start = trajectory.base
        else:
            start = trainer.flatten()  # the site's own weights: the trajectory goes on
        inner_steps = int(state.run_config.inner_steps)
        if state.algorithm.asynchronous.dynamic_local_updates:
            inner_steps = dynamic_local_steps(inner_steps, self._step_s, self._fastest_step_s)
        phase = self._phase
        self._phase += 1
        started = time.monotonic()
        state.phase = pb.SITE_PHASE_TRAINING
        trainer.tell_followers_to_train(phase, inner_steps, None)
        if self._rebase:
            done = trajectory.steps
            result = trainer.train_round(
                start, phase, inner_steps,
                before_step=lambda step: self._take_newer_version(trajectory, steps_before=done + step),
            )
        else:
            result = trainer.train_round(start, phase, inner_steps)
        del start
        self._compute_s += result.seconds
        if result.steps > 0 and result.seconds > 0:
            self._step_s = result.seconds / result.steps
        trajectory.add(result, started)
        with self._changed:
            if self._queued is not None and trajectory.phases < _MAX_TRAJECTORY_PHASES:
                return None  # the uploader is busy: train on before forming an update
            while self._queued is not None and self._failure is None and not state.finished:
                if self._halt.is_set():
                    raise AgentStopped()
                self._changed.wait(_POLL_S)  # the trajectory is long enough: wait for the link
            phases: dict[str, float] = dict(self.transfer_phases_s)
            self.transfer_phases_s.clear()
        self._trajectory = None
        phases["train"] = trajectory.train_s
        trained = TrainedUpdate(
            round=trajectory.base_round, update=None, loss=result.loss, samples=trajectory.samples,
            inner_steps=trajectory.steps, inner_time_s=trajectory.inner_time_s,
            started_s=trajectory.started_s or started, phases_s=phases,
        )
        return _Outgoing(
            trained, phase, self._compute_s, rebased_at_step=trajectory.rebased_at_step,
            base=trajectory.base, local=trainer.flatten(),
        )

    def _form(self, outgoing: _Outgoing) -> bool:
        """Form and encode ``outgoing``'s update unless that was done (the uploader, off the
        training thread); False when there is nothing to send: NaN/Inf values (not sent, the
        residual reset, as ``RoundRunner._encode`` does)."""
        trained = outgoing.trained
        if trained.update is not None:
            return True
        base, local = outgoing.base, outgoing.local
        if base is None or local is None:
            return False
        outgoing.base = outgoing.local = None
        started = time.monotonic()
        update = pseudo_gradient_into_local(base, local)
        del base, local
        formed_at = time.monotonic()
        if not all_finite(update):
            logger.error(
                "site %s: the pseudo-gradient of phase %d (from version %d) has NaN/Inf values; not "
                "uploading it and resetting the error-feedback residual and the inner optimizer's state",
                self.site, outgoing.phase, trained.round,
            )
            with self._uplink_lock:
                self.uplink.reset(0)
            self._non_finite.set()
            self.state.count_round(included=False)
            return False
        # The version's seed from the strategy, as the coordinator derives it (RoundInfo.round_seed):
        # the follower may have moved past the version whose RoundInfo the site last heard.
        round_seed = self.strategy.configure_round(trained.round, ()).seed
        with self._uplink_lock:
            encoded = self.uplink.encode(update, round_seed=round_seed, fragment=0, samples=trained.samples)
        if encoded is None:  # only a masked uplink has nothing to send, and it is refused with these merges
            return False
        trained.update = encoded
        trained.phases_s.update(pseudo_gradient=formed_at - started, encode=time.monotonic() - formed_at)
        outgoing.nbytes = len(encoded.data)
        return True

    def _give_back(self, outgoing: _Outgoing) -> None:
        """An update that will not be sent goes back into the error-feedback residual (formed
        first if it was not yet)."""
        if self._form(outgoing):
            self._restore(outgoing.trained)

    def _take_newer_version(self, trajectory: _Trajectory, *, steps_before: int) -> None:
        """Move the running model onto the newest held version if it is newer than the
        trajectory's base (``rebase_local``), which then becomes the base."""
        state = self.state
        if state.held_round <= trajectory.base_round:
            return
        with self._weights_lock:
            newest_round, newest = state.held_round, state.global_weights.clone()
        local = self.trainer.flatten()
        rebase_local(local, trajectory.base, newest)
        self.trainer.load_(local)
        logger.debug("site %s: took version %d into the running phase after %d steps (base was %d)",
                     self.site, newest_round, steps_before, trajectory.base_round)
        trajectory.base, trajectory.base_round = newest, newest_round
        trajectory.rebased_at_step = steps_before

    def _add_phases(self, seconds: dict[str, float]) -> None:
        with self._changed:  # the follower and the sender add, the trainer takes (_train_phase)
            super()._add_phases(seconds)

    def _too_stale(self, base_round: int, *, later: int = 0) -> bool:
        """An update from ``base_round`` could not enter the open merge (the one the newest
        version the site holds comes out of), or the one ``later`` merges after it: the
        coordinator's rule, ``stale_admission``."""
        into = self.state.held_round + later
        verdict = stale_admission(self.state.algorithm.asynchronous, base=base_round, into=into, weight=1.0)
        return verdict.refused is not None

    def _restore(self, trained: TrainedUpdate, *, refused: bool = False) -> None:
        """An update that will not be merged goes back into the error-feedback residual, unless
        it was refused or too stale to enter (``refused``): then it is dropped with the residual
        (``uplink.keep_or_drop``), as the simulator drops it."""
        if trained.update is not None:
            with self._uplink_lock:
                keep_or_drop(self.uplink, trained.update, refused=refused, site=self.site, round_number=trained.round)

    # -- threads -------------------------------------------------------------------------------

    def _start_threads(self) -> None:
        if self._threads:
            return
        self._halt.clear()
        self._threads = [
            threading.Thread(target=self._guarded, args=(body,), name=f"geoloco-{what}-{self.site}", daemon=True)
            for what, body in (("follow", self._follow), ("upload", self._send))
        ]
        for thread in self._threads:
            thread.start()

    def _stop_threads(self) -> None:
        if not self._threads:
            return
        self._halt.set()
        with self._changed:
            self._changed.notify_all()
        with self.client.interrupting():  # a follower blocked in AwaitBroadcast, or about to be
            for thread in self._threads:
                thread.join()
        self._threads = []

    def _drain(self) -> None:
        """The run is over: let the uploader finish or give up its update, then stop."""
        with self._changed:
            self._changed.notify_all()
            while (self._queued is not None or self._in_flight is not None) and self._failure is None and self._threads:
                self._changed.wait(_POLL_S)
        self._stop_threads()
        self._raise_failure()

    def _guarded(self, body: Callable[[], None]) -> None:
        try:
            body()
        except AgentStopped:
            return  # the agent is stopping: the thread's normal end
        except BaseException as err:  # noqa: BLE001 (handed to the agent's loop: re-join, stop or fail)
            if not self._halt.is_set():
                with self._changed:
                    self._failure = err
                    self._changed.notify_all()

    def _raise_failure(self) -> None:
        failure = self._failure
        if failure is not None:
            self._stop_threads()
            self._failure = None
            raise failure

    def _follow(self) -> None:
        """Apply every merge's broadcast as it comes (the follower thread)."""
        state = self.state
        while not self._halt.is_set() and not state.finished:
            round_number = state.held_round
            answer = self._await_broadcast(round_number)
            if answer is None:  # the run finished
                break
            header, data = answer
            if header.next_round.fastest_step_s > 0:
                self._fastest_step_s = header.next_round.fastest_step_s
            with self._changed:  # before the held version moves: an update registered then finds it
                self._verdicts[round_number] = (bool(header.included), bool(header.refused))
                for old in [m for m in self._verdicts if m < round_number - _KEEP_VERDICTS]:
                    del self._verdicts[old]
            with self._weights_lock:
                self._apply_broadcast(round_number, header, data)
                state.take_broadcast_header(header)
            del answer, data
            self._resolve(round_number, included=bool(header.included), refused=bool(header.refused))
            with self._changed:
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def _send(self) -> None:
        """Upload each handed-off update (the uploader thread)."""
        state = self.state
        while not self._halt.is_set():
            with self._changed:
                while self._queued is None and not self._halt.is_set():
                    if state.finished:
                        return
                    self._changed.wait(_POLL_S)
                outgoing, self._queued = self._queued, None
                self._in_flight = outgoing
                self._changed.notify_all()
            if outgoing is None:
                return
            if self._form(outgoing):
                self._deliver(outgoing)
            with self._changed:
                self._in_flight = None
                self._changed.notify_all()

    def _wait_for_version_after(self, merge: int) -> bool:
        """Block until the site holds a version newer than ``merge`` (its broadcast applied);
        False when the run finished or the runner stops first."""
        with self._changed:
            while self.state.held_round <= merge:
                if self._halt.is_set() or self.state.finished:
                    return False
                self._changed.wait(_POLL_S)
        return True

    def _deliver(self, outgoing: _Outgoing) -> None:
        """Upload one update until a merge takes it, or it is too stale or the run is over."""
        trained, state = outgoing.trained, self.state
        update = trained.update
        assert update is not None
        while True:
            # The previous update entered merge m (or is held for it): this one may go once merge
            # m is open, when it is held for m + 1 (one update held per site).
            if self._last_merge is not None and not self._wait_for_version_after(self._last_merge - 1):
                self._restore(trained)
                return
            state.phase = pb.SITE_PHASE_UPLOADING
            started = time.monotonic()
            try:
                response = self.uplink.upload(
                    self.client, update, round_number=trained.round, inner_steps=trained.inner_steps,
                    metrics=outgoing.metrics(),
                )
            except RoundClosed as why:
                # The open merge is being applied, already holds this site's update, or the
                # update is too stale: try the next merge, unless it is over the bound by then.
                version = state.held_round
                if self._too_stale(trained.round, later=1):
                    logger.info("site %s: update from version %d is too stale, dropped (%s)",
                                self.site, trained.round, why)
                    self._finish(trained, included=False, refused=True)
                    return
                if not self._wait_for_version_after(version):
                    self._restore(trained)
                    return
                continue
            except RunFinished:  # the follower takes the last broadcast and ends the run
                self._finish(trained, included=False)
                return
            except UpdateRejected as why:
                logger.error("site %s: the coordinator rejected the update from version %d: %s",
                             self.site, trained.round, why)
                self._finish(trained, included=False, refused=True)
                return
            self._add_phases({"upload": time.monotonic() - started})
            merged = response.merged_round if response.HasField("merged_round") else state.held_round
            self._last_merge = merged
            logger.info(
                "site %s: phase %d (from version %d) entered merge %d (staleness %d), loss %.4f",
                self.site, outgoing.phase, trained.round, merged, merged - trained.round, trained.loss,
            )
            # Kept until the merge's broadcast says it counted (an aborted merge, or an update
            # held for a merge that a coordinator restart lost, goes back into the residual).
            with self._changed:
                self._awaiting[merged] = outgoing
            if self.state.held_round > merged:  # the follower applied that broadcast already
                self._resolve(merged, included=None)
            return

    def _resolve(self, merge: int, *, included: bool | None, refused: bool = False) -> None:
        """Merge ``merge``'s broadcast was applied: the site's update in it (if any) counted or
        not (``included``; None: unknown, the broadcast was applied before the upload's answer
        came), and if not, whether the merge refused it (``refused``: an update held for the
        merge that the update guard refused when it opened). An update awaiting a merge whose
        broadcast the follower took meanwhile is settled by what it said (``_verdicts``); one
        awaiting a merge the follower skipped (it fetched the weights instead) by asking the
        coordinator (``_ask_verdict``)."""
        with self._changed:
            resolved = sorted((m, o) for m, o in self._awaiting.items() if m <= merge)
            for m, _ in resolved:
                del self._awaiting[m]
            verdicts = dict(self._verdicts)
        for m, outgoing in resolved:
            if m == merge and included is not None:
                counted, dropped = included, refused and not included
            elif m in verdicts:
                counted, was_refused = verdicts[m]
                dropped = was_refused and not counted
            else:
                counted, dropped = self._ask_verdict(m)
            if not counted and not dropped:
                logger.info("site %s: its update was not counted in merge %d (aborted or lost); back "
                            "into the residual", self.site, m)
            self._finish(outgoing.trained, included=counted, refused=dropped, merged=m, nbytes=outgoing.nbytes)

    def _ask_verdict(self, merge: int) -> tuple[bool, bool]:
        """(included, refused) of this site's update in ``merge``, from the coordinator: for an
        older merge it answers RESYNC, header only, from the history it keeps (and restores
        after a restart). Taken to have counted when it cannot say: asked too late (beyond that
        history) or not reachable now, as before the coordinator kept one."""
        if merge <= self.state.coordinator_round - COUNTED_HISTORY_ROUNDS:
            return True, False
        try:
            header, _ = self.client.await_broadcast(merge)
        except (SiteAgentError, RejoinRequired) as err:
            logger.info("site %s: could not ask whether its update counted in merge %d (%s); taken as counted",
                        self.site, merge, err)
            return True, False
        return bool(header.included), bool(header.refused) and not header.included

    def _finish(
        self, trained: TrainedUpdate, *, included: bool, refused: bool = False, merged: int | None = None,
        nbytes: int = 0,
    ) -> None:
        """Count the phase and tell ``hooks.on_round_end``; an update not merged goes back into
        the residual first, or is dropped with it when ``refused`` (``_restore``)."""
        if not included:
            self._restore(trained, refused=refused)
        self._round_end(
            trained, round_number=trained.round if merged is None else merged, included=included,
            num_contributors=0, resynced=False, bytes_up=nbytes, bytes_down=0,
        )

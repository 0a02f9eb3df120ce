"""Decoupled (asynchronous) DiLoCo and chaos on an event-driven virtual clock.

The round-by-round simulator (``geoloco.algorithms.simulation.simulator``) advances every site through the
same round; here each site runs on its own clock and the run is a queue of events (a site's
phase starts, its steps are done, its upload arrives, it fails, it is repaired, a merge's grace
window ends), so two rules can run on the same sites and the same failures:

- **asynchronous** (``[algorithm.asynchronous] enabled``; Decoupled DiLoCo, Douillard et al.
  2026; asynchronous Local-SGD, Liu et al. 2024): a site never waits at a barrier. When its
  inner steps are done it uploads ``θ_v − θ_k`` (``v`` the version of the global model it
  started from) and at once starts its next phase from **the newest global model it has fully
  received** by then. Not its own weights: its pseudo-gradient must be measured from a model the
  synchronizer knows, or the next update would carry this one's movement a second time; and not
  the model that will contain its own update, which it could only get by waiting, i.e. a
  barrier. The synchronizer merges what has arrived once ``min_quorum`` updates are in and the
  grace window has passed (or every site that is up has sent one): a merge is a round of the
  round engine (``geoloco.algorithms.engine``), whose admission (update guard, duplicates), close
  rule (``AsyncMerge``, a ``ClosePolicy``) and guarded outer step run unchanged. With
  ``rebase`` a merge whose broadcast reaches a site mid-phase is taken into its running model at
  the next step boundary (``rebase_local``), and the update is then measured from it. Each update's
  **staleness** is the number of merges between its base version and the one it is merged
  into; beyond ``max_staleness`` it is dropped, else it enters with weight
  ``w · discount_per_version^staleness`` (``w`` from ``[algorithm] weighting``: ``samples`` is
  the token-weighted merge). With ``dynamic_local_updates`` a site's phase has ``H · v_k /
  v_max`` steps (Liu et al.'s DyLU), its speed measured over its last phase. The outer
  optimizer is the run's: ``nesterov`` with ``momentum_period`` > 1 is Liu et al.'s Delayed
  Nesterov (``geoloco.algorithms.optimizers.DelayedNesterov``), the fix for the stale updates
  plain Nesterov momentum amplifies.
- **synchronous** (``[simulation.chaos]`` enabled, asynchronous off): DiLoCo rounds with the
  run's ``RoundPolicy`` (quorum, deadline), the expected sites being those that are up; a site
  waits for the broadcast before its next round. ``sync_on_failure`` says what a failure does
  to the round (``geoloco.algorithms.simulation.chaos``).

Identities that hold (tests check them bit for bit): without failures, the synchronous rule
gives the round-by-round simulator's weights, evaluations and close times; the asynchronous rule
with ``min_quorum`` = every site, uniform speeds and instantaneous links (zero latency, infinite
bandwidth) gives them too, since every merge then holds every site's update computed from the
newest model. With real links it does not: a site goes on from the model it holds while its
update travels, so from the second merge on every update is one merge stale.

The clock: a phase of ``s`` steps is ``s · step_time_s / speed_factor`` seconds of full-speed
compute, stretched by slowdown episodes; an upload takes ``latency + 8 · bytes / uplink_bps``
and every merge's broadcast ``latency + 8 · bytes / downlink_bps`` to reach each site that is up
(links full duplex: a site receives broadcasts while it uploads); a repaired site first fetches
the whole model (fp32) over its downlink.

Scale: one model is shared by all sites, as in the round-by-round simulator. A site's steps are
computed when they are done (its "finish" event), from its base version; a global version is
kept only while a running phase started from it. A site holds its inner optimizer state and
its error-feedback residual only while it is up (a failure loses them, as a crashed process
does), so memory is ``model × (versions in use) + (sites up) × (optimizer state + residual) +
uploads in flight``: ``DecoupledSimulator.memory`` reports the numbers.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from geoloco.algorithms.aggregation import Aggregation
from geoloco.algorithms.async_merge import AsyncMerge, dynamic_local_steps, stale_admission
from geoloco.algorithms.device import resolve_device
from geoloco.algorithms.diloco import pseudo_gradient, rebase_local
from geoloco.algorithms.engine import RoundEngine, Stepped
from geoloco.algorithms.finite import all_finite
from geoloco.algorithms.params import ParamLayout, weights_digest
from geoloco.algorithms.record import RoundRecord
from geoloco.algorithms.round import Round, RoundOutcome, RoundPolicy
from geoloco.algorithms.simulation.chaos import ChaosSchedule, SiteTimeline, StepLedger
from geoloco.algorithms.simulation.clock import SiteConfig, transfer_time
from geoloco.algorithms.simulation.robust_attack import parse_attack
from geoloco.algorithms.simulation.sim_config import SimulatorConfig
from geoloco.algorithms.simulation.sim_state import SimSite, SimTrainer
from geoloco.algorithms.simulation.sim_uplinks import AttackedUplinks, Payload, PlainUplinks, SimUplinks
from geoloco.algorithms.strategy import RoundPlan, Strategy, build_strategy
from geoloco.algorithms.streaming import FragmentUplink
from geoloco.algorithms.update_guard import UpdateGuard
from geoloco.algorithms.workload import Workload

__all__ = ["DecoupledSimulator", "build_simulator"]

logger = logging.getLogger(__name__)

# Event kinds, in the order they run at the same instant: a failure first (a phase that ends
# exactly when its site fails is lost), then finished steps, arrivals, a merge's timer, repairs
# and phase starts last, so a phase starting at a merge's instant starts from the merged model.
_FAIL, _FINISH, _ARRIVAL, _TIMER, _REPAIR, _START = range(6)


@dataclass(slots=True)
class _Phase:
    """A site's inner steps in progress."""

    base: int
    """The global version they start from."""
    steps: int
    start: float
    step_s: float
    """Full-speed virtual seconds per step (``step_time_s / speed_factor``)."""
    merged: list[int] = field(default_factory=list)
    """With ``rebase``: the versions merged while it runs (held until it ends), each taken into
    the running model when its broadcast reaches the site."""


@dataclass(slots=True)
class _Upload:
    """A finished phase's update on its way to (or held at) the synchronizer."""

    site: int
    incarnation: int
    token: int
    payload: Payload
    weight: float
    base: int
    steps: int
    start: float
    finish: float
    nbytes: int
    loss: float


@dataclass(slots=True)
class _Site:
    index: int
    name: str
    config: SiteConfig
    timeline: SiteTimeline
    up: bool = True
    incarnation: int = 0
    """Bumped at every failure: events of an earlier life are void."""
    token: int = 0
    """Bumped when its pending start or steps are cancelled (a failure, a lock-step restart)."""
    trainer: SimSite | None = None
    """Its inner optimizer, lr schedule and data while it is up; None before its first phase
    and after a failure (the optimizer state is lost with the process)."""
    batches: Iterator[Any] | None = None
    """Its data stream (kept across failures: a position in a data set is a small cursor)."""
    steps_done: int = 0
    """Inner steps it ran so far (its lr schedule's position)."""
    phase: _Phase | None = None
    joined_s: float = 0.0
    """When it last joined: every broadcast merged from then on reaches it."""
    fetched: int = 0
    """The version its last full fetch brought (0: the initial model every site starts with)."""
    fetched_s: float = 0.0
    """When that fetch ended."""
    fail_s: float = math.inf
    """When its current up period ends."""
    submitted: int | None = None
    """Synchronous rounds: the round its last finished phase was for."""
    step_s: float | None = None
    """Virtual seconds per step measured over its last phase (slowdowns included)."""
    carried: list[tuple[int, float, float]] = field(default_factory=list)
    """Late synchronous updates kept in its error-feedback residual: (steps, start, finish)."""
    residual_epoch: int = 0
    """Counts the drops of the site's residual (``_drop_residual``): an update encoded before
    the latest drop has nothing left to go back into."""


@dataclass(slots=True)
class _Merging:
    """What the open merge holds of one site, to account its steps once the merge steps."""

    steps: int
    start: float
    finish: float
    staleness: int
    loss: float
    nbytes: int
    carried: list[tuple[int, float, float]]
    payload: Payload | None = None
    """The upload, held until the merge steps when the site's error feedback would take it
    back (an aborted merge gives it back, as the real site keeps an update not merged)."""
    incarnation: int = 0
    """The site's process that sent it: one that failed since has another residual."""
    residual_epoch: int = 0
    """``_Site.residual_epoch`` when it was admitted: one dropped since has lost it."""


class _LazyUplinks(dict[str, FragmentUplink]):
    """Per-site uplink encoders created on first use (a site that never trained holds none; a
    failed site's residual is dropped by removing its entry)."""

    def __init__(self, strategy: Strategy) -> None:
        super().__init__()
        self.strategy = strategy

    def __missing__(self, site: str) -> FragmentUplink:
        uplink = self.strategy.build_uplink(site)
        self[site] = uplink
        return uplink


class DecoupledSimulator:
    """The event-driven simulator (module doc); iterate ``run()`` for one record per merge.

    ``schedule``: a chaos schedule to use instead of the one ``[simulation.chaos]`` draws (a
    hand-made one in tests)."""

    def __init__(self, config: SimulatorConfig, workload: Workload, *, schedule: ChaosSchedule | None = None) -> None:
        sim, algo = config.simulation, config.algorithm
        if not config.event_driven:
            raise ValueError(
                "the event-driven simulator runs [algorithm.asynchronous] or [simulation.chaos]; "
                "neither is enabled (geoloco.algorithms.simulation.simulator.Simulator runs this config)"
            )
        self.config = config
        self.workload = workload
        self.asynchronous = algo.asynchronous.enabled
        self.device = resolve_device(sim.device, "simulation.device")
        self.model = workload.build_model(sim.seed).to(self.device)
        self.layout = ParamLayout.from_model(self.model)
        self.global_flat = self.layout.flatten(self.model)

        def new_strategy() -> Strategy:
            return build_strategy(
                algo, numel=self.layout.numel, outer_optimizer=config.outer_optimizer,
                inner_optimizer=config.inner_optimizer, seed=sim.seed, device=self.device, layout=self.layout,
            )

        self.strategy = new_strategy()
        self.trainer = SimTrainer(
            self.model, self.layout, workload, device=self.device, step_time_s=sim.step_time_s,
            grad_clip_norm=config.inner_optimizer.grad_clip_norm, partial=self.strategy.partial,
        )
        self.schedule = schedule if schedule is not None else ChaosSchedule(sim.chaos)
        n = len(config.sites)
        self.sites = [
            _Site(index=k, name=str(k), config=site, timeline=self.schedule.site(k))
            for k, site in enumerate(config.sites)
        ]
        self._uplink_encoders = _LazyUplinks(self.strategy)
        plain = PlainUplinks(self.strategy, self._uplink_encoders, config.privacy)
        attacks = {str(k): parse_attack(s.attack) for k, s in enumerate(config.sites) if s.attack is not None}
        self.uplinks: SimUplinks = AttackedUplinks(plain, attacks) if attacks else plain
        self._keeps_late = self.strategy.uplink_encoder().error_feedback is not None
        """A late synchronous update goes into the site's error-feedback residual (else it is lost)."""
        self.policy: RoundPolicy = config.training.round_policy(n)
        self.merge_rule = AsyncMerge(algo.asynchronous, n) if self.asynchronous else None
        self.engine = RoundEngine(
            self.strategy, self.policy, UpdateGuard(config.update_guard),
            close=self.merge_rule, fresh_strategy=new_strategy,
        )
        self.ledger = StepLedger()
        """Where the computed inner steps went (goodput) and the useful compute spans (downtime)."""
        self.live: set[str] = {s.name for s in self.sites}
        self.version = 0
        """Merges done so far: the global model's version, and the number of the open round."""
        self._versions: dict[int, torch.Tensor] = {0: self.global_flat}
        """Global versions a site may still start from (``_forget_versions``)."""
        self._slowest_bps = min(s.config.downlink_bps for s in self.sites)
        self._longest_latency_s = max(s.config.latency_s for s in self.sites)
        self._hold_s = self._slowest_transfer_s(self.layout.numel * 4)
        """At least the longest a version's successor takes to reach a site (a whole-model
        fetch, or a broadcast: ``_close`` raises it for a larger one)."""
        self._version_refs: dict[int, int] = {}
        self._version_s: list[float] = [0.0]
        self._version_bytes: list[int] = [0]
        self._queue: list[tuple[float, int, int, int, Any]] = []
        """Events: (time, kind, site, sequence, data); ties run by kind, then site, then order."""
        self._seq = itertools.count()
        self._merging: dict[str, _Merging] = {}
        self._held: list[_Upload] = []
        """Asynchronous: uploads that arrived while their site's previous update was still in
        the open merge; they go into the next one."""
        self._round: Round | None = None
        self._timed: set[int] = set()
        """Asynchronous merges whose grace-window timer is set."""
        self._site_states = 0
        self._records: list[RoundRecord] = []
        self._record_s = 0.0
        self._train_loss: float | None = None
        """Mean inner loss of the latest merge's updates (a record without any repeats it)."""
        self._fastest_step_s: float | None = None
        self._fastest_site = -1
        self.bytes_up_total = 0
        self.bytes_down_total = 0
        self.clock_s = 0.0
        self._in_flight = 0
        self._in_flight_bytes = 0
        self._peaks = {"site_states": 0, "versions": 1, "uploads_in_flight": 0, "upload_bytes_in_flight": 0}
        self.site_state_bytes: int | None = None
        """Bytes one site holds while up (its inner optimizer state and uplink residual), measured
        after its first phase; None before."""

    # -- the clock ---------------------------------------------------------------------------------

    def _push(self, time_s: float, kind: int, site: int, data: Any = None) -> None:
        heapq.heappush(self._queue, (time_s, kind, site, next(self._seq), data))

    def _download_s(self, site: _Site, version: int) -> float:
        return transfer_time(self._version_bytes[version], site.config.downlink_bps, site.config.latency_s)

    def _available_s(self, site: _Site, version: int) -> float:
        """When ``site`` holds ``version``: its broadcast's arrival if merged since the site
        joined, else (an older version) the end of its last fetch."""
        if self._version_s[version] >= site.joined_s and version > site.fetched:
            return self._version_s[version] + self._download_s(site, version)
        return site.fetched_s

    def _newest_held(self, site: _Site, now: float) -> int:
        """The newest version ``site`` has fully received by ``now``."""
        for v in range(self.version, site.fetched, -1):
            if self._version_s[v] >= site.joined_s and self._available_s(site, v) <= now:
                return v
        return site.fetched

    def _slowest_transfer_s(self, nbytes: int) -> float:
        return transfer_time(nbytes, self._slowest_bps, self._longest_latency_s)

    def _forget_versions(self, now: float) -> None:
        """Drop the versions no site can start from any more: not the current one, none a
        running phase started from, none whose successor may not have reached every site yet
        (merged less than ``_hold_s`` ago: the longest download or fetch)."""
        for v in [v for v in self._versions if v != self.version and v not in self._version_refs]:
            if self._version_s[v + 1] + self._hold_s <= now:
                del self._versions[v]

    def _ref(self, version: int) -> torch.Tensor:
        self._version_refs[version] = self._version_refs.get(version, 0) + 1
        return self._versions[version]

    def _unref(self, version: int) -> None:
        left = self._version_refs[version] - 1
        if left:
            self._version_refs[version] = left
            return
        del self._version_refs[version]
        if version != self.version and self._version_s[version + 1] + self._hold_s <= self.clock_s:
            self._versions.pop(version, None)

    # -- sites -------------------------------------------------------------------------------------

    def _trainer_site(self, site: _Site) -> SimSite:
        """The site's training state, created when it first trains (again, after a failure)."""
        if site.trainer is None:
            config = self.config
            if site.batches is None:
                site.batches = self.workload.site_batches(site.index, len(self.sites), config.simulation.seed)
            optimizer = config.inner_optimizer.build(self.model.parameters())
            trainer = SimSite(index=site.index, name=site.name, config=site.config, batches=site.batches,
                              optimizer=optimizer)
            trainer.lr_schedule = config.inner_optimizer.build_schedule(
                optimizer, total_rounds=config.run_rounds, inner_steps=config.steps_per_round
            )
            if trainer.lr_schedule is not None and site.steps_done:
                trainer.lr_schedule.seek(site.steps_done)
            site.trainer = trainer
            self._site_states += 1
            self._peaks["site_states"] = max(self._peaks["site_states"], self._site_states)
        return site.trainer

    def _steps_for(self, site: _Site) -> int:
        inner = self.strategy.inner_steps
        if self.merge_rule is None or not self.config.algorithm.asynchronous.dynamic_local_updates:
            return inner
        return dynamic_local_steps(inner, site.step_s, self._fastest_step_s)

    def _start(self, now: float, site: _Site) -> None:
        """Start a phase of ``site`` at ``now`` if it can: from the newest model it holds
        (asynchronous) or from the open round's (synchronous, once it holds it)."""
        if not site.up or site.phase is not None:
            return
        if self.asynchronous:
            base = self._newest_held(site, now)
        else:
            base = self.version
            round_ = self._round
            assert round_ is not None
            if site.submitted == base or site.name in round_.contributed or site.name in round_.rejected:
                return  # done with this round: the close sends it the next one
            ready = self._available_s(site, base)
            if ready > now:
                self._push(ready, _START, site.index, (site.incarnation, site.token))
                return
        steps = self._steps_for(site)
        step_s = float(self.config.simulation.step_time_s) / site.config.speed_factor
        work = steps * float(self.config.simulation.step_time_s) / site.config.speed_factor
        finish = site.timeline.finish_time(now, work)
        site.phase = _Phase(base=base, steps=steps, start=now, step_s=step_s)
        self._ref(base)
        if finish < site.fail_s:
            self._push(finish, _FINISH, site.index, (site.incarnation, site.token))
        # else: the failure at fail_s cuts the phase; the failure event accounts for it

    def _steps_by(self, site: _Site, phase: _Phase, now: float) -> int:
        done = site.timeline.work_between(phase.start, now)
        return min(phase.steps, int(done / phase.step_s + 1e-9)) if phase.step_s > 0 else phase.steps

    def _steps_begun_by(self, site: _Site, phase: _Phase, now: float) -> int:
        """Steps of ``phase`` begun by ``now``: a step under way when a merge arrives ends on the
        weights it began with, so the merge is taken in at the next step boundary."""
        if phase.step_s <= 0:
            return phase.steps
        done = site.timeline.work_between(phase.start, now)
        return min(phase.steps, math.ceil(done / phase.step_s - 1e-9))

    def _finish(self, now: float, site: _Site) -> None:
        """``site``'s steps are done: compute them (from its base version), encode, upload."""
        phase = site.phase
        assert phase is not None
        site.phase = None
        trainer_site = self._trainer_site(site)
        base_version, losses, samples = self._train_phase(site, trainer_site, phase, now)
        pseudo = pseudo_gradient(self._versions[base_version], self.trainer.flatten())
        self._release(phase)
        if not all_finite(pseudo):
            del pseudo
            self._withhold(now, site, trainer_site, phase, base_version)
            return
        plan = self._plan(base_version)
        round_ = self._round
        assert round_ is not None
        encoded = self.uplinks.encode(site.name, pseudo, plan, round_.aggregation)
        del pseudo
        if self.site_state_bytes is None:
            self.site_state_bytes = self._state_bytes(site)
        nbytes = self.uplinks.nbytes_now(encoded)
        assert nbytes is not None  # plain uploads know their size at once
        site.steps_done += phase.steps
        self._measured(site, (now - phase.start) / phase.steps)
        site.submitted = base_version
        arrival = now + transfer_time(nbytes, site.config.uplink_bps, site.config.latency_s)
        upload = _Upload(
            site=site.index, incarnation=site.incarnation, token=site.token, payload=encoded,
            weight=self.strategy.site_weight(samples, phase.steps), base=base_version, steps=phase.steps,
            start=phase.start, finish=now, nbytes=nbytes, loss=sum(losses) / len(losses),
        )
        self.bytes_up_total += nbytes
        self._in_flight += 1
        self._in_flight_bytes += nbytes
        self._peaks["uploads_in_flight"] = max(self._peaks["uploads_in_flight"], self._in_flight)
        self._peaks["upload_bytes_in_flight"] = max(self._peaks["upload_bytes_in_flight"], self._in_flight_bytes)
        self._push(arrival, _ARRIVAL, site.index, upload)
        if self.asynchronous:
            self._push(now, _START, site.index, (site.incarnation, site.token))

    def _drop_residual(self, site: _Site, reason: str) -> None:
        """Drop ``site``'s error-feedback residual (its update was refused, too stale or not
        finite), and with it the steps it carried for a later update."""
        self.uplinks.drop(site.name, 0)
        site.residual_epoch += 1
        for steps, _, _ in site.carried:
            self.ledger.lost(steps, reason)
        site.carried = []

    def _withhold(self, now: float, site: _Site, trainer_site: SimSite, phase: _Phase, base: int) -> None:
        """A pseudo-gradient with NaN/Inf values, as the real asynchronous site handles it: not
        sent, its error-feedback residual and inner optimizer state reset, its steps lost; it goes
        on from the newest version."""
        if not self.asynchronous:
            raise ValueError(
                f"site {site.name}'s pseudo-gradient from version {base} has NaN/Inf values; the "
                "chaos simulator's lock-step rounds do not model a site withholding its update: "
                "lower the inner lr, or clip gradients ([inner_optimizer] grad_clip_norm)"
            )
        logger.warning(
            "site %s: the pseudo-gradient from version %d has NaN/Inf values; it sends nothing and "
            "resets its error-feedback residual and inner optimizer state", site.name, base,
        )
        self._drop_residual(site, "non_finite")
        if trainer_site.optimizer is not None:
            trainer_site.optimizer.state.clear()
        site.steps_done += phase.steps
        self.ledger.lost(phase.steps, "non_finite")
        self._push(now, _START, site.index, (site.incarnation, site.token))

    def _train_phase(
        self, site: _Site, trainer_site: SimSite, phase: _Phase, now: float
    ) -> tuple[int, list[float], int]:
        """Run ``phase``'s steps on the shared model (left holding the trained weights): from its
        base version, and with ``rebase`` each merge that reached the site while a step of the
        phase was still to come taken in at the next step boundary (one that arrives during the
        last step is not: no step would start from it, so it would only relabel the update as
        fresher than its steps are). Returns the version the update is measured from, the step
        losses and the samples."""
        base_version = phase.base
        self.trainer.load(self._versions[base_version])
        losses: list[float] = []
        samples = done = 0
        # (steps before it is taken in, version): as the site does, one step boundary takes in
        # only the newest version that has arrived by then.
        takes: list[tuple[int, int]] = []
        for version in phase.merged:
            arrived_s = self._available_s(site, version)
            if arrived_s > now:
                break
            steps = max(takes[-1][0] if takes else 0, self._steps_begun_by(site, phase, arrived_s))
            if steps >= phase.steps:
                break  # no step of this phase follows: it is taken in by the next phase's start
            if takes and takes[-1][0] == steps:
                takes.pop()
            takes.append((steps, version))
        for steps, version in takes:
            result, _ = self.trainer.steps(trainer_site, steps - done)
            if result is not None:
                losses += result.losses
                samples += result.samples
            done = steps
            local = self.trainer.flatten()
            rebase_local(local, self._versions[base_version], self._versions[version])
            self.trainer.load(local)
            base_version = version
        result, _ = self.trainer.steps(trainer_site, phase.steps - done)
        if result is not None:
            losses += result.losses
            samples += result.samples
        return base_version, losses, samples

    def _release(self, phase: _Phase) -> None:
        """The versions ``phase`` held are no longer needed by it."""
        self._unref(phase.base)
        for version in phase.merged:
            self._unref(version)

    def _plan(self, round_number: int, sites: tuple[str, ...] = ()) -> RoundPlan:
        return self.strategy.configure_round(round_number, sites)

    def _state_bytes(self, site: _Site) -> int:
        """What ``site`` holds while up: its inner optimizer's state and its uplink residual."""
        total = 0
        if site.trainer is not None and site.trainer.optimizer is not None:
            for state in site.trainer.optimizer.state.values():
                total += sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
        uplink = self._uplink_encoders.get(site.name)
        if uplink is not None:
            for encoder in uplink.encoders:
                residual = encoder.residual
                if residual is not None:
                    total += residual.numel() * residual.element_size()
        return total

    # -- arrivals and merges -----------------------------------------------------------------------

    def _arrive(self, now: float, upload: _Upload) -> None:
        self._in_flight -= 1
        self._in_flight_bytes -= upload.nbytes
        site = self.sites[upload.site]
        if upload.incarnation != site.incarnation:
            self.ledger.lost(upload.steps, "upload_lost")
            return
        if upload.token != site.token and not self.asynchronous:
            self.ledger.lost(upload.steps, "restarted")
            return
        if self.asynchronous:
            assert self.merge_rule is not None
            self.merge_rule.observe_arrival(now)
            self._admit_async(now, upload)
        else:
            self._admit_sync(now, site, upload)
        self._maybe_close(now)

    def _admit_sync(self, now: float, site: _Site, upload: _Upload) -> None:
        round_ = self._round
        assert round_ is not None
        if upload.base != round_.number:
            # A straggler's update of a round that closed without it: into its residual (it
            # reaches the model inside its next update) or lost; it then gets the new model.
            if self._keeps_late:
                self.uplinks.keep(site.name, upload.payload, 0)
                site.carried.append((upload.steps, upload.start, upload.finish))
            else:
                self.ledger.lost(upload.steps, "late")
            if site.up:
                ready = max(now, self._version_s[self.version]) + self._download_s(site, self.version)
                self._push(ready, _START, site.index, (site.incarnation, site.token))
            return
        self._admit(now, site, upload, staleness=0, weight=upload.weight)

    def _admit_async(self, now: float, upload: _Upload) -> None:
        round_ = self._round
        assert round_ is not None
        site = self.sites[upload.site]
        if site.name in round_.contributed:
            self._held.append(upload)  # its previous update is still in the open merge
            return
        round_.retry(site.name)  # a refused update does not count: the next one may enter
        admission = stale_admission(
            self.config.algorithm.asynchronous, base=upload.base, into=round_.number, weight=upload.weight
        )
        if admission.refused is not None:
            # Dropped, with what its encoding left in the residual, as the real site drops an
            # update too stale to enter (the coordinator refuses it at the manifest, WRONG_ROUND,
            # and records nothing).
            if upload.incarnation == site.incarnation:  # (a failed process's residual is gone)
                self._drop_residual(site, "stale")
            self.ledger.lost(upload.steps, "stale")
            return
        self._admit(now, site, upload, staleness=admission.staleness, weight=admission.weight)

    def _admit(self, now: float, site: _Site, upload: _Upload, *, staleness: int, weight: float) -> None:
        round_ = self._round
        assert round_ is not None
        admission = self.engine.admit(
            round_, site.name, upload.payload, weight, screen=self.uplinks.screen(upload.payload), now=now
        )
        # A held upload of a process that failed since still enters (the coordinator has it),
        # but the site's residual and carried steps are its new process's.
        own = upload.incarnation == site.incarnation
        if not admission.ok:
            # Dropped with its residual, as the real site drops a refused update.
            if own:
                self._drop_residual(site, "rejected")
            self.ledger.lost(upload.steps, "rejected")
            return
        carried: list[tuple[int, float, float]] = []
        if own:
            carried, site.carried = site.carried, []
        self._merging[site.name] = _Merging(
            steps=upload.steps, start=upload.start, finish=upload.finish, staleness=staleness,
            loss=upload.loss, nbytes=upload.nbytes, carried=carried,
            payload=upload.payload if self.uplinks.keeps(site.name, 0) else None, incarnation=upload.incarnation,
            residual_epoch=site.residual_epoch,
        )

    def _maybe_close(self, now: float, *, timer: bool = False) -> None:
        round_ = self._round
        if round_ is None:
            return
        if not self.asynchronous and not timer:
            # The plain rule closes when nobody up is pending, at the deadline or when a
            # rejection made the quorum unreachable: only then is it worth asking (asking
            # costs a pass over every site).
            done = len(round_.contributed) + len(round_.rejected)
            deadline = round_.deadline_at
            if done < len(self.live) and not round_.rejected and (deadline is None or now < deadline):
                return
        expected = self.live if not self.asynchronous else round_.contributed
        if self.engine.decide(round_, now=now, expected=expected).close:
            self._close(now)
            return
        if self.merge_rule is not None and round_.number not in self._timed:
            close_by = self.merge_rule.close_by(round_)
            if close_by is not None:  # the quorum is in: wake up when its grace window ends
                self._timed.add(round_.number)
                self._push(close_by, _TIMER, -1, round_.number)

    def _close(self, now: float) -> None:
        round_ = self._round
        assert round_ is not None
        expected: Collection[str] = self.live if not self.asynchronous else list(round_.contributed)
        outcome = self.engine.close(round_, now=now, expected=expected)
        if self.merge_rule is not None:
            self.merge_rule.closed(round_)
            self._timed.discard(round_.number)
        contributors = list(outcome.contributors)
        plan = self._plan(round_.number, tuple(contributors))
        stepped = self.engine.step(round_, self.global_flat, plan, contributors)
        update = stepped.result.update
        merging, self._merging = self._merging, {}
        by_name = {s.name: s for s in self.sites} if stepped.aborted is not None else {}
        for name, held in merging.items():
            chunks = [(held.steps, held.start, held.finish), *held.carried]
            site = by_name.get(name)
            if (
                site is not None and held.payload is not None
                and (site.incarnation, site.residual_epoch) == (held.incarnation, held.residual_epoch)
            ):
                # Back into the site's residual, as the real site keeps an update its merge did
                # not take: its steps reach the model inside the site's next update. (A site that
                # failed since, or dropped its residual since, lost this update with it.)
                self.uplinks.give_back(name, held.payload, 0)
                site.carried = [*chunks, *site.carried]
                continue
            for steps, start, finish in chunks:
                if stepped.aborted is None:
                    self.ledger.useful(steps, start, finish)
                else:
                    self.ledger.lost(steps, "aborted")
        self.global_flat = update.global_flat
        self.version += 1
        self._versions[self.version] = self.global_flat
        self._version_s.append(now)
        self._version_bytes.append(update.downlink.nbytes)
        if self.asynchronous and self.config.algorithm.asynchronous.rebase:
            for site in self.sites:
                if site.up and site.phase is not None:
                    site.phase.merged.append(self.version)
                    self._ref(self.version)
        self._hold_s = max(self._hold_s, self._slowest_transfer_s(update.downlink.nbytes))
        self._forget_versions(now)
        self._peaks["versions"] = max(self._peaks["versions"], len(self._versions))
        self.bytes_down_total += update.downlink.nbytes * len(self.live)
        self._records.append(self._record(now, outcome, stepped, merging))
        self._open(now)
        if not self.asynchronous:
            for name in [*outcome.contributors, *outcome.rejected]:
                site = self.sites[int(name)]
                if site.up:
                    site.submitted = None
                    self._push(now + self._download_s(site, self.version), _START, site.index,
                               (site.incarnation, site.token))

    def _measured(self, site: _Site, step_s: float) -> None:
        """``site``'s last phase took ``step_s`` per step: its speed for Dynamic Local Updates,
        and the fastest site's (recomputed over the sites that are up only when the fastest one
        slowed or failed: the coordinator takes the fastest of its members)."""
        site.step_s = step_s
        if self._fastest_step_s is None or step_s < self._fastest_step_s:
            self._fastest_step_s, self._fastest_site = step_s, site.index
        elif site.index == self._fastest_site and step_s > self._fastest_step_s:
            self._recompute_fastest()

    def _recompute_fastest(self) -> None:
        up = [s for s in self.sites if s.up and s.step_s is not None]
        if not up:
            self._fastest_step_s, self._fastest_site = None, -1
            return
        fastest = min(up, key=lambda s: s.step_s if s.step_s is not None else math.inf)
        self._fastest_step_s, self._fastest_site = fastest.step_s, fastest.index

    def _open(self, now: float) -> None:
        """Open the round (merge) ``self.version``; held asynchronous updates enter it first."""
        plan = self._plan(self.version)
        aggregation: Aggregation = self.uplinks.begin(plan)
        self._round = self.engine.open(self.version, aggregation, now)
        self.engine.maybe_start(self._round, now, members=len(self.live))
        if self._round.deadline_at is not None:
            self._push(self._round.deadline_at, _TIMER, -1, self._round.number)
        held, self._held = self._held, []
        for upload in held:
            self._admit_async(now, upload)
        if held:
            self._maybe_close(now)

    # -- failures ----------------------------------------------------------------------------------

    def _fail(self, now: float, site: _Site) -> None:
        round_ = self._round
        assert round_ is not None
        participating = (
            not self.asynchronous and site.name not in round_.contributed and site.name not in round_.rejected
        )
        site.up = False
        site.incarnation += 1
        site.token += 1
        if site.phase is not None:
            self.ledger.lost(self._steps_by(site, site.phase, now), "failed")
            self._release(site.phase)
            site.phase = None
        for steps, _, _ in site.carried:
            self.ledger.lost(steps, "failed")
        site.carried = []
        if site.trainer is not None:
            site.trainer = None
            self._site_states -= 1
        self._uplink_encoders.pop(site.name, None)
        site.submitted = None
        self.live.discard(site.name)
        if self.merge_rule is not None:
            self.merge_rule.sites_up = len(self.live)
        if site.index == self._fastest_site:  # a site that is down sets no one's phase length
            self._recompute_fastest()
        repaired = site.timeline.down_at(now)
        repair_s = repaired[1] if repaired is not None else now
        self._push(repair_s, _REPAIR, site.index, site.incarnation)
        if participating and self.config.simulation.chaos.sync_on_failure == "restart":
            self._restart_round(now)
        self._maybe_close(now)

    def _restart_round(self, now: float) -> None:
        """Lock-step: a site of the open round failed before its update arrived, so the round is
        void for everyone; it restarts from the same weights with the sites that are up."""
        round_ = self._round
        assert round_ is not None
        for held in self._merging.values():
            self.ledger.lost(held.steps, "restarted")
            for steps, _, _ in held.carried:
                self.ledger.lost(steps, "restarted")
        self._merging = {}
        for site in self.sites:
            if not site.up:
                continue
            site.token += 1  # uploads in flight and pending steps of this round are void
            site.submitted = None
            if site.phase is not None:
                self.ledger.lost(self._steps_by(site, site.phase, now), "restarted")
                self._release(site.phase)
                site.phase = None
            self._push(now, _START, site.index, (site.incarnation, site.token))
        self._round = self.engine.open(round_.number, self.uplinks.begin(self._plan(round_.number)), now)
        self.engine.maybe_start(self._round, now, members=len(self.live))
        if self._round.deadline_at is not None:
            self._push(self._round.deadline_at, _TIMER, -1, self._round.number)

    def _repair(self, now: float, site: _Site) -> None:
        site.up = True
        self.live.add(site.name)
        if site.step_s is not None and (self._fastest_step_s is None or site.step_s < self._fastest_step_s):
            self._fastest_step_s, self._fastest_site = site.step_s, site.index
        if self.merge_rule is not None:
            self.merge_rule.sites_up = len(self.live)
        site.joined_s = now
        site.fetched = self.version
        full = self.layout.numel * 4  # the whole model, fp32
        site.fetched_s = now + transfer_time(full, site.config.downlink_bps, site.config.latency_s)
        self.bytes_down_total += full
        self._schedule_failure(now, site)
        round_ = self._round
        if round_ is not None and not round_.started:
            self.engine.maybe_start(round_, now, members=len(self.live))
            if round_.deadline_at is not None:
                self._push(round_.deadline_at, _TIMER, -1, round_.number)
        self._push(site.fetched_s, _START, site.index, (site.incarnation, site.token))

    def _schedule_failure(self, now: float, site: _Site) -> None:
        failed, _ = site.timeline.next_failure(now)
        site.fail_s = failed
        if math.isfinite(failed):
            self._push(failed, _FAIL, site.index, site.incarnation)

    # -- records -----------------------------------------------------------------------------------

    def _record(
        self, now: float, outcome: RoundOutcome, stepped: Stepped, merging: dict[str, _Merging]
    ) -> RoundRecord:
        losses = [m.loss for m in merging.values()]
        if losses:
            self._train_loss = sum(losses) / len(losses)
        steps_total = self.ledger.useful_steps // len(self.sites)
        record = RoundRecord.closed(
            outcome, stepped,
            inner_steps={name: m.steps for name, m in merging.items()},
            inner_steps_total=steps_total,
            train_loss=self._train_loss if self._train_loss is not None else math.nan,
            eval_loss=None,
            bytes_up={name: m.nbytes for name, m in merging.items()},
            bytes_down={},
            bytes_up_total=self.bytes_up_total,
            bytes_down_total=self.bytes_down_total,
            round_time_s=now - self._record_s,
            wall_clock_s=now,
            compute_s={name: m.finish - m.start for name, m in merging.items()},
            utilization={},
            staleness={name: m.staleness for name, m in merging.items()},
            goodput=self.ledger.goodput,
            inner_steps_lost=self.ledger.lost_steps,
        )
        self._record_s = now
        return record

    def _end_record(self, now: float) -> RoundRecord:
        """The run stopped on ``max_wall_clock_s`` with a merge open: the state at that time."""
        assert self._round is not None
        return RoundRecord(
            round=self._round.number, inner_steps={},
            inner_steps_total=self.ledger.useful_steps // len(self.sites),
            train_loss=self._train_loss if self._train_loss is not None else math.nan, eval_loss=None,
            participants=[], excluded=[], bytes_up={}, bytes_down={}, bytes_up_total=self.bytes_up_total,
            bytes_down_total=self.bytes_down_total, round_time_s=now - self._record_s, wall_clock_s=now,
            compute_s={}, utilization={}, weights_digest=weights_digest(self.global_flat),
            aborted=f"the run ended at max_wall_clock_s = {now:g} s before this merge closed (the model is "
                    "the last merge's)",
            goodput=self.ledger.goodput, inner_steps_lost=self.ledger.lost_steps,
        )

    def running_spans(self, now: float) -> list[tuple[float, float]]:
        """Compute spans of the phases still running at ``now`` (they may yet count)."""
        spans = [(s.phase.start, now) for s in self.sites if s.up and s.phase is not None]
        for *_, upload in self._queue:
            if isinstance(upload, _Upload):
                site = self.sites[upload.site]
                if (upload.incarnation, upload.token) == (site.incarnation, site.token):
                    spans.append((upload.start, upload.finish))
        spans += [(u.start, u.finish) for u in self._held]
        spans += [(m.start, m.finish) for m in self._merging.values()]
        return spans

    def memory(self) -> dict[str, int | None]:
        """What the run held at its peak: sites holding training state, global versions kept,
        uploads in flight and their bytes; ``site_state_bytes``: one site's state."""
        return {
            "model_bytes": self.layout.numel * 4,
            "site_state_bytes": self.site_state_bytes,
            "peak_site_states": self._peaks["site_states"],
            "peak_versions": self._peaks["versions"],
            "peak_uploads_in_flight": self._peaks["uploads_in_flight"],
            "peak_upload_bytes_in_flight": self._peaks["upload_bytes_in_flight"],
        }

    # -- the run -----------------------------------------------------------------------------------

    def run(self) -> Iterator[RoundRecord]:
        """Events in time order until ``rounds`` merges, ``max_wall_clock_s`` or
        ``target_eval_loss``; one record per merge, the last with the global downtime."""
        sim = self.config.simulation
        torch.manual_seed(sim.seed)
        self._open(0.0)
        for site in self.sites:
            self._schedule_failure(0.0, site)
            self._push(0.0, _START, site.index, (site.incarnation, site.token))
        limit = sim.max_wall_clock_s if sim.max_wall_clock_s is not None else math.inf
        last: RoundRecord | None = None
        end_s = 0.0
        stopped = False
        while self._queue and not stopped:
            if self._queue[0][0] > limit:
                break
            now, kind, index, _, data = heapq.heappop(self._queue)
            self.clock_s = end_s = now
            self._handle(now, kind, index, data)
            while self._records:
                record = self._records.pop(0)
                due = self.config.evaluates_after(record.round, 0, 0)
                if due:
                    record.eval_loss = self.trainer.evaluate(self.global_flat)
                if last is not None:
                    yield last
                last = record
                if record.round + 1 >= self.config.run_rounds or (
                    sim.target_eval_loss is not None and record.eval_loss is not None
                    and record.eval_loss <= sim.target_eval_loss
                ):
                    stopped = True
                    break
        if not stopped and math.isfinite(limit):
            end_s = limit
            if last is not None:
                yield last
            last = self._end_record(limit)
        if last is None:
            return
        if last.eval_loss is None:
            last.eval_loss = self.trainer.evaluate(self.global_flat)
        if last.train_loss is None or math.isnan(last.train_loss):  # nothing merged yet: the global model's loss
            last.train_loss = last.eval_loss
        last.global_downtime_s = self.ledger.downtime(0.0, end_s, self.running_spans(end_s))
        self.clock_s = end_s
        yield last

    def _handle(self, now: float, kind: int, index: int, data: Any) -> None:
        if kind == _TIMER:
            if self._round is not None and self._round.number == data:
                self._maybe_close(now, timer=True)
            return
        if kind == _ARRIVAL:
            self._arrive(now, data)
            return
        site = self.sites[index]
        if kind == _FAIL:
            if data == site.incarnation and site.up:
                self._fail(now, site)
        elif kind == _REPAIR:
            if data == site.incarnation and not site.up:
                self._repair(now, site)
        elif data == (site.incarnation, site.token):
            if kind == _FINISH:
                self._finish(now, site)
            elif kind == _START:
                self._start(now, site)


def build_simulator(config: SimulatorConfig, workload: Workload) -> Any:
    """The simulator ``config`` needs: the event-driven one for ``[algorithm.asynchronous]`` or
    ``[simulation.chaos]``, else the round-by-round ``Simulator``. Both have ``run()``,
    ``device``, ``layout`` and ``strategy``."""
    if config.event_driven:
        return DecoupledSimulator(config, workload)
    from geoloco.algorithms.simulation.simulator import Simulator

    return Simulator(config, workload)

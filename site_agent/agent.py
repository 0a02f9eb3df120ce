"""The site agent: a user's model, optimizer, data and loss in; DiLoCo rounds against a coordinator.

Per round the agent holds ``θ_t`` (bit-identical to the coordinator's, checked by digest), runs
H inner steps with the user's optimizer (``run_inner_steps``, the simulator's own function),
computes the pseudo-gradient ``θ_t − θ_k``, encodes it with the run strategy's uplink
(``strategy.build_uplink()``, error feedback), uploads it (resumably), waits for the round's
broadcast and applies the delta (``strategy.apply_downlink``). The math is
``geoloco.algorithms``'; the site only decides *when*.

``SiteAgent`` is the public entry point and a thin composition of the site's parts:

* ``SiteState`` (``state``): the global weights, their digest, the rounds held and announced,
  the run config;
* ``SiteTrainer`` (``trainer``): inner steps, lr schedule, batches, loss, follower ranks;
* a round runner (``runner``): ``PlainRounds`` (``plain``), ``StreamingRounds``
  (``streaming``) or ``AsyncRounds`` (``async_rounds``: no round barrier), each over a
  ``SiteUplink`` (``uplink``: the strategy's encoders, or secure aggregation's masking);
* membership (here): join, heartbeats, leave, and the loop that turns the runner.

Rules the loop follows (the coordinator's side is in ``geoloco.coordinator.rounds``):

* **Straggler.** An upload refused as too late (WRONG_ROUND) is not an error: the site waits for
  that round's broadcast anyway. The header says whether its update was aggregated; if not, the
  encoded update goes back into the error-feedback residual (``UpdateEncoder.restore``), so the
  work reaches the model one round late instead of never. Holding ``θ_t`` it can apply round
  ``t``'s delta; if the coordinator moved further on, it chases the newer deltas without training
  or, when they are gone (RESYNC), fetches the full weights.
* **Refused update.** One the round refused (the header's ``refused``: beyond the update guard's
  bounds, or refused at the relay) is dropped with the fragment's residual instead
  (``uplink.keep_or_drop``), as the simulator does.
* **Replica check.** After every delta the site compares its weights digest with the header's;
  a mismatch fetches the full weights.
* **Coordinator restart.** Calls fail UNAVAILABLE and are retried with backoff and jitter; the
  restarted coordinator answers STALE_SESSION and the site joins again. If the new session is at
  the round the site trained for and the digests agree, the already computed update is re-sent;
  otherwise the update is dropped (it was already aggregated when the coordinator is ahead, or it
  belongs to weights the coordinator rolled back) and the site fetches the weights it is told to.
* **Dropped by the coordinator** (missed heartbeats, same session): the site re-joins and carries
  on with its pending update (re-sent when its round is still open, otherwise resolved by the
  round's broadcast as above).
* **One process per site name.** Every process has a random instance id
  (``JoinRequest.instance_id``). When another process joins under this site's name the
  coordinator gives it the name and refuses this one from then on (``SiteReplaced``, learnt at
  the next heartbeat or call at the latest): the agent stops without leaving (the name is the
  other process's now) and ``run`` raises ``SiteReplaced`` saying when and from where the other
  joined. Its state folder (``config.state_dir``) is locked from the agent's construction until
  ``run`` ends, so a second process on it is refused before it joins.
* **Site restart** (``config.state_dir``; ``geoloco.site_agent.persist``). The state saved at
  the last round boundary is taken back before the first join, with the coordinator session it
  belonged to: the same session at the join means only this process restarted, so a saved update
  is re-sent (its round still open; the coordinator recognises it) or resolved by its round's
  broadcast (the round closed meanwhile), exactly as after a drop. A state of another site,
  model or run is refused.
* **Link cut.** Retries sleep with backoff capped by a fraction of the round time, and wake the
  moment the channel is READY again (``geoloco.site_agent.connectivity``).
* **Non-finite update.** Not sent; logged, the residual is reset, and the site takes the
  broadcast like a straggler.

Multi-GPU sites (``torchrun``): pass the ``IntraSiteGroup`` from
``geoloco.site_agent.distributed.init_from_env``. Every rank trains with DDP; only the leader
(rank 0) talks to the coordinator and sends each round's control message and global weights to
the others over the local fabric. Call ``run()`` on every rank.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
from torch import nn

from geoloco.algorithms.lr_schedule import InnerLRSchedule
from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.strategy import build_strategy
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.atomic_files import atomic_write_safetensors, model_file_metadata
from geoloco.protos.folder_lock import FolderLock
from geoloco.protos.identity import new_instance_id, validate_site_name
from geoloco.protos.transport_errors import error_reason
from geoloco.protos.transport_tls import TLSFiles
from geoloco.site_agent.async_rounds import AsyncRounds
from geoloco.site_agent.client import (
    AgentStopped,
    CoordinatorClient,
    RejoinRequired,
    SiteAgentError,
    SiteReplaced,
)
from geoloco.site_agent.config import JoinInfo, SiteAgentConfig, SiteHooks, resolve_device
from geoloco.site_agent.distributed import IntraSiteGroup
from geoloco.site_agent.persist import (
    SiteSnapshot,
    SiteStateError,
    SiteStateStore,
    check_layout,
    layout_fingerprint,
    lock_state_dir,
    prefixed,
    run_fingerprint,
    unprefixed,
)
from geoloco.site_agent.plain import PlainRounds
from geoloco.site_agent.runner import RoundRunner
from geoloco.site_agent.secure_site import SecureUplink
from geoloco.site_agent.state import RunConfigChange, SiteState
from geoloco.site_agent.streaming import StreamingRounds
from geoloco.site_agent.trainer import LossFn, SiteTrainer
from geoloco.site_agent.uplink import MaskedUplink, SiteUplink, StrategyUplink

__all__ = ["LossFn", "SiteAgent", "SiteRunSummary"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SiteRunSummary:
    """What ``SiteAgent.run`` did."""

    rounds_trained: int
    """Rounds this site trained for (included or not)."""
    rounds_included: int
    """Of those, rounds whose update the coordinator aggregated."""
    final_round: int
    """The site holds ``θ_final_round``."""
    weights_digest: str
    """Digest of the weights it holds."""
    run_finished: bool
    """True when the coordinator's run completed (false: ``max_rounds`` or ``stop()``)."""


class SiteAgent:
    """Trains ``model`` as one site of a geoloco run (see the module docstring for the rules)."""

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        data: Iterable[Any],
        loss_fn: LossFn,
        *,
        coordinator: str,
        site: str,
        tls: TLSFiles | None = None,
        insecure: bool = False,
        config: SiteAgentConfig | None = None,
        hooks: SiteHooks | None = None,
        group: IntraSiteGroup | None = None,
        server_name: str | None = None,
        interceptors: Iterable[Any] = (),
        lr_schedule: InnerLRSchedule | None = None,
        instance_id: str | None = None,
        state_lock: FolderLock | None = None,
    ) -> None:
        """
        Args:
            model: the user's module (the same class, hence layout, as the coordinator's).
            inner_optimizer: optimizer over ``model``'s parameters; its state persists across rounds.
            data: endless iterable of batches for this site (this rank).
            loss_fn: ``loss_fn(model, batch) -> scalar``; batches are moved to the device first.
            coordinator: ``host:port`` of the coordinator.
            site: this site's name (with TLS it must equal the certificate's).
            tls: CA, certificate and key (``TLSFiles.from_dir(certs_dir, site)``), or
            insecure: True for plain text (local experiments only).
            config: device, autocast, clipping, retry settings.
            hooks: callbacks after join and after each round.
            group: the intra-site rank group of a multi-GPU site (``init_from_env()``).
            server_name: name to check the coordinator's certificate against, when dialing an
                address it does not list.
            interceptors: gRPC client interceptors (tracing, fault injection in tests).
            lr_schedule: inner lr schedule over ``inner_optimizer``
                (``InnerOptimizerConfig.build_schedule``; ``geoloco site`` passes the
                coordinator's): stepped after every inner step, and moved to step
                ``round × inner_steps`` whenever the site starts a round it did not reach by
                training the previous one (first round, restart, late join, catching up).
                Python-API users may instead attach their own torch scheduler to their optimizer.
            instance_id: this site process's id at the coordinator (``JoinRequest.instance_id``);
                None: a new random one. Pass the id of a client this process joined with before
                (``geoloco site``'s probe), so the agent's join is not taken for another process.
            state_lock: ``config.state_dir``'s lock when the caller took it already
                (``persist.lock_state_dir``; ``geoloco site`` takes it before its first join, so
                a second process on the folder is refused before it could replace the first at
                the coordinator); the agent owns it from then on. None: the agent takes it.
        """
        self.site = validate_site_name(site)
        self.instance_id = instance_id or new_instance_id()
        """This process's id at the coordinator (module doc: one process per site name)."""
        self.config = config or SiteAgentConfig()
        self.hooks = hooks or SiteHooks()
        self.group = group
        self.is_leader = group is None or group.is_leader
        device = group.device if group is not None else resolve_device(self.config.device)
        self._stop = threading.Event()
        self.trainer = SiteTrainer(
            model, inner_optimizer, data, loss_fn, site=self.site, config=self.config,
            device=device, group=group, lr_schedule=lr_schedule, stop=self._stop,
        )
        self.state = SiteState()
        self._coordinator = coordinator
        self._tls = tls
        self._insecure = insecure
        self._server_name = server_name
        self._interceptors = list(interceptors)
        self._rejoin = threading.Event()
        self._client: CoordinatorClient | None = None
        self._heartbeat_thread: threading.Thread | None = None
        self._rounds: RoundRunner | None = None
        """Runs the rounds the coordinator's run config asks for (built at the first join)."""
        self._store: SiteStateStore | None = None
        """Where the site's state is saved at every round boundary (``config.state_dir``)."""
        self._restored: SiteSnapshot | None = None
        """A saved state being taken back: its run and runner parts wait for the first join."""
        self._not_saved_warned = False
        self._state_lock: FolderLock | None = state_lock
        """``config.state_dir``'s lock, held from here until ``run`` ends."""
        self._replaced: SiteReplaced | None = None
        """Set by the heartbeat thread when another process took the site's name over."""
        if self.config.state_dir is not None:
            try:
                if group is not None and group.is_distributed:
                    raise SiteAgentError(
                        "state_dir is not supported for multi-rank (torchrun) sites yet; leave it unset"
                    )
                self._store = SiteStateStore(self.config.state_dir)
                self._lock_state_dir()
                self._restore()
            except BaseException:
                self._release_state_dir()
                raise

    # ---------------------------------------------------------------------------------------
    # Public surface

    @property
    def module(self) -> nn.Module:
        """The user's model (unwrapped from DDP)."""
        return self.trainer.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer."""
        return self.trainer.optimizer

    @property
    def layout(self) -> ParamLayout:
        return self.trainer.layout

    @property
    def global_weights(self) -> torch.Tensor | None:
        """The global weights this site holds (flat fp32), or None before the first join: the
        site's own copy, to which later broadcasts are added in place (clone it to keep a
        round's weights)."""
        flat = self.state.global_weights_or_none
        return None if flat is None else flat.detach().cpu()

    @property
    def held_round(self) -> int:
        """The site holds ``θ_held_round``."""
        return self.state.held_round

    @property
    def weights_digest(self) -> str | None:
        return self.state.digest

    def save_global_model(self, path: str | os.PathLike[str]) -> Path:
        """Write the global weights this site holds (``θ_held_round``, the run's model after
        ``run()`` finished it) to ``path`` as a normal ``state_dict`` in safetensors: every key
        of ``module.state_dict()``, the parameters from the global weights and the buffers as
        the module holds them, so ``model.load_state_dict(load_file(path), strict=True)`` loads
        it. The module itself is not changed. Raises ``SiteAgentError`` before the first join."""
        flat = self.state.global_weights_or_none
        if flat is None or self.state.digest is None:
            raise SiteAgentError(f"site {self.site} holds no global weights yet (it never joined)")
        state = self.layout.state_dict(flat.detach(), self.module)
        try:
            workload = json.loads(self.state.run_config.config_json or "{}").get("workload") or {}
        except (ValueError, AttributeError):
            workload = {}
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_safetensors(target, state, model_file_metadata(self.held_round, self.state.digest, workload))
        return target

    def uplink_residual(self, fragment: int = 0) -> torch.Tensor | None:
        """What the uplink's error feedback (plain or secure) holds back for ``fragment``'s
        next update; None before the first join, without error feedback or before an encode."""
        return None if self._rounds is None else self._rounds.uplink.residual(fragment)

    def stop(self) -> None:
        """Ask ``run`` to return at the next opportunity (interrupts waits and retries)."""
        self._stop.set()
        if self._client is not None:
            self._client.cancel_active_calls()

    def run(self, max_rounds: int | None = None) -> SiteRunSummary:
        """Take part in the run until it finishes, ``max_rounds`` rounds were trained, or
        ``stop()``; then leave. Call it on every rank of a multi-GPU site."""
        if max_rounds is not None and max_rounds < 0:
            raise ValueError(f"max_rounds must be >= 0 or None, got {max_rounds}")
        if not self.is_leader:
            return self._follow()
        if self._store is not None:
            self._lock_state_dir()  # held since construction, unless a previous run() ended
        self._client = CoordinatorClient(
            self._coordinator,
            site=self.site,
            tls=self._tls,
            insecure=self._insecure,
            config=self.config,
            stop_event=self._stop,
            server_name=self._server_name,
            interceptors=self._interceptors,
            instance_id=self.instance_id,
        )
        if self._restored is not None:
            # The coordinator's session the saved site belonged to: the same session after the
            # join means this process restarted, not the coordinator (``rejoined``).
            self._client.session_id = str(self._restored.meta.get("session_id", ""))
        state = self.state
        reason = "run finished"
        needs_join = True
        replaced: SiteReplaced | None = None
        try:
            while not state.finished:
                if self._stop.is_set():
                    reason = "stopped"
                    break
                if max_rounds is not None and state.rounds_trained >= max_rounds:
                    reason = f"trained max_rounds={max_rounds}"
                    break
                try:
                    if needs_join or self._rejoin.is_set():
                        self._rejoin.clear()
                        self._join()
                        needs_join = False
                        if self._heartbeat_thread is None:
                            self._start_heartbeat()
                        continue
                    self._runner().step()
                except RejoinRequired as why:
                    logger.info("site %s: re-joining (%s)", self.site, why)
                    needs_join = True
        except AgentStopped:
            reason = "stopped"
        except SiteReplaced as err:
            replaced = err
        finally:
            if self._rounds is not None:
                self._rounds.close()
            self._stop_heartbeat()
            replaced = replaced or self._replaced
            self.trainer.stop_followers(
                state.global_weights_or_none, round_number=state.held_round,
                finished=state.finished, rounds_included=state.rounds_included,
            )
            if self._client is not None:
                # A replaced process does not leave: the name (and a Leave in it) is the other one's.
                if self._client.session_id and not needs_join and replaced is None:
                    self._client.leave(reason)
                self._client.close()
            self._release_state_dir()
        if replaced is not None:
            logger.error(
                "site %s stops: %s (%d rounds trained, %d included, holding round %d)",
                self.site, replaced, state.rounds_trained, state.rounds_included, state.held_round,
            )
            raise replaced
        logger.info(
            "site %s done (%s): %d rounds trained, %d included, holding round %d",
            self.site, reason, state.rounds_trained, state.rounds_included, state.held_round,
        )
        return self._summary()

    def _summary(self) -> SiteRunSummary:
        state = self.state
        return SiteRunSummary(
            rounds_trained=state.rounds_trained,
            rounds_included=state.rounds_included,
            final_round=state.held_round,
            weights_digest=state.digest or "",
            run_finished=state.finished,
        )

    # ---------------------------------------------------------------------------------------
    # Joining

    @property
    def client(self) -> CoordinatorClient:
        assert self._client is not None
        return self._client

    def _runner(self) -> RoundRunner:
        assert self._rounds is not None
        return self._rounds

    def _join(self) -> None:
        state = self.state
        previous_session = self.client.session_id
        has_weights = state.has_weights
        response = self.client.join(
            has_weights=has_weights,
            weights_round=state.held_round,
            digest_hex=state.digest,
        )
        self._check_layout(response.layout)
        self._check_restored_run(response.config)
        new_session = response.session_id != previous_session
        self._configure_rounds(state.adopt_run_config(response.config))
        coordinator_round = response.round.round
        known_round = max(state.held_round if has_weights else 0, state.coordinator_round)
        if previous_session and new_session and coordinator_round < known_round:
            logger.warning(
                "site %s: the coordinator's run went BACKWARDS: its new session %s is at round %d, "
                "this site was at round %d; the site takes the coordinator's weights and drops its "
                "own work since. If that was not meant, check whether the coordinator was restarted "
                "with --fresh (resume = false) or another checkpoint_dir; a run moved aside is in "
                "checkpoint_dir/previous-run-N",
                self.site, response.session_id[:8], coordinator_round, known_round,
            )
        state.joined(response.round)
        runner = self._runner()
        has_pending = runner.rejoined(
            coordinator_round=coordinator_round, new_session=new_session,
            must_fetch=response.must_fetch_model,
        )
        chase = has_weights and not new_session and state.held_round < coordinator_round
        fetched = False
        if response.must_fetch_model and not has_pending and not chase:
            runner.fetch()
            fetched = True
            # If the coordinator closed a round between the join and the fetch, the weights are
            # newer than the join's round info: the runner asks again before it trains
            # (``RoundRunner._check_round_info``), as after any fetch past the info it holds.
        if state.at_end and not has_pending:
            state.mark_finished()
        logger.info(
            "site %s joined session %s at round %d%s",
            self.site, response.session_id[:8], coordinator_round, " (fetched weights)" if fetched else "",
        )
        if self.hooks.on_join is not None:
            run_config = state.run_config
            self.hooks.on_join(
                JoinInfo(
                    session_id=response.session_id,
                    round=coordinator_round,
                    inner_steps=run_config.inner_steps,
                    uplink_codec=run_config.uplink_codec,
                    downlink_codec=run_config.downlink_codec,
                    total_rounds=state.total_rounds,
                    fetched_model=fetched,
                    config=json.loads(run_config.config_json or "{}"),
                )
            )

    def _check_layout(self, layout: pb.ModelLayout) -> None:
        ours = [(e.name, tuple(e.shape)) for e in self.layout.entries]
        theirs = [(t.name, tuple(t.shape)) for t in layout.tensors]
        if ours != theirs:
            first = next(
                (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs))
            )
            mine = ours[first] if first < len(ours) else "nothing"
            other = theirs[first] if first < len(theirs) else "nothing"
            raise SiteAgentError(
                f"this site's model does not match the coordinator's: parameter #{first} is {mine} "
                f"here and {other} there ({len(ours)} vs {len(theirs)} tensors); build the same "
                "model class with the same configuration on both sides"
            )

    def _configure_rounds(self, change: RunConfigChange) -> None:
        """Build the round runner the run config asks for: plain or Streaming DiLoCo rounds
        over the strategy's uplink, or secure aggregation's. A re-join with the same algorithm
        and privacy settings keeps the runner, hence its residuals and its pending update."""
        if self._rounds is not None and not change.algorithm and not change.privacy:
            return
        state = self.state
        algorithm, privacy = state.algorithm, state.privacy
        strategy = build_strategy(algorithm, numel=self.layout.numel, layout=self.layout)
        partial = strategy.partial  # Partial Parameter Updates: this site trains its group only
        self.trainer.train_only(None if partial is None else partial.trained(partial.site_group(self.site)))
        uplink: SiteUplink
        if privacy.secure_aggregation:
            uplink = MaskedUplink(
                SecureUplink(
                    self.site, privacy, state.run_config.uplink_codec, tls=self._tls,
                    policy=self.config.threshold_policy(),
                )
            )
        else:
            uplink = StrategyUplink(strategy, self.site)
        runner: type[RoundRunner] = (
            AsyncRounds if algorithm.asynchronous.enabled
            else StreamingRounds if algorithm.streaming.enabled
            else PlainRounds
        )
        self._rounds = runner(
            site=self.site, state=state, trainer=self.trainer, client=lambda: self.client,
            hooks=self.hooks, strategy=strategy, uplink=uplink,
            on_boundary=self._save_state if self._store is not None else None,
        )
        restored, self._restored = self._restored, None
        if restored is not None and restored.meta.get("runner") is not None:
            self._rounds.restore(unprefixed("runner.", restored.tensors), restored.meta["runner"])

    # ---------------------------------------------------------------------------------------
    # Saved state (``geoloco.site_agent.persist``)

    def _lock_state_dir(self) -> None:
        """Hold the state folder (``persist.lock_state_dir``) unless this agent holds it."""
        assert self._store is not None
        if self._state_lock is None or not self._state_lock.held:
            self._state_lock = lock_state_dir(self._store.directory, self.site)

    def _release_state_dir(self) -> None:
        lock, self._state_lock = self._state_lock, None
        if lock is not None:
            lock.release()

    def _restore(self) -> None:
        """Take back the state a previous process of this site saved, if any: the weights,
        rounds, optimizer, data position and RNG now; the runner's part at the first join."""
        assert self._store is not None
        snapshot = self._store.load()
        if snapshot is None:
            return
        where = self._store.directory
        meta = snapshot.meta
        if meta.get("site") != self.site:
            raise SiteStateError(
                f"the site state in {where} belongs to site {meta.get('site')!r}, not {self.site!r}; "
                "give every site its own state_dir"
            )
        check_layout(meta.get("layout"), self.layout, where)
        tensors = snapshot.tensors
        self.state.restore(unprefixed("state.", tensors), meta["state"], self.trainer.device)
        self.trainer.restore(unprefixed("trainer.", tensors), meta["trainer"])
        if self.state.has_weights:
            self.trainer.load_(self.state.global_weights)
        self._restored = snapshot
        logger.info(
            "site %s: restored its state from %s (holding round %d, %d rounds trained%s)",
            self.site, where, self.state.held_round, self.state.rounds_trained,
            ", with an update awaiting its broadcast" if (meta.get("runner") or {}).get("pending") else "",
        )

    def _check_restored_run(self, config: pb.RunConfig) -> None:
        """Refuse to go on from a state saved in another run (other seed, algorithm, optimizers,
        workload or privacy settings): its optimizer, residuals and data position are not this
        run's."""
        if self._restored is None:
            return
        saved = self._restored.meta.get("run")
        theirs = run_fingerprint(config.config_json)
        if saved != theirs:
            differ = sorted(k for k in set(saved or {}) | set(theirs) if (saved or {}).get(k) != theirs.get(k))
            raise SiteStateError(
                f"the site state in {self.config.state_dir} was saved in another run (the "
                f"coordinator's {', '.join(differ)} differ); delete that folder to join this run "
                "afresh, or point state_dir elsewhere"
            )

    def _save_state(self) -> None:
        """Save the site's state (a round boundary). A failed save is logged, not fatal: the
        previous state stays on disk, and training goes on."""
        store, runner = self._store, self._rounds
        assert store is not None and runner is not None
        runner_part = runner.snapshot()
        if runner_part is None:
            if not self._not_saved_warned:
                logger.warning(
                    "site %s: state_dir is set but %s rounds are not saved (only plain DiLoCo "
                    "rounds without secure aggregation are); a restart starts this site afresh",
                    self.site, type(runner).__name__,
                )
                self._not_saved_warned = True
            return
        state_tensors, state_meta = self.state.snapshot()
        trainer_tensors, trainer_meta = self.trainer.snapshot()
        runner_tensors, runner_meta = runner_part
        tensors = {
            **prefixed("state.", state_tensors),
            **prefixed("trainer.", trainer_tensors),
            **prefixed("runner.", runner_tensors),
        }
        meta = {
            "site": self.site,
            "layout": layout_fingerprint(self.layout),
            "run": run_fingerprint(self.state.run_config.config_json),
            "session_id": self.client.session_id,
            "state": state_meta,
            "trainer": trainer_meta,
            "runner": runner_meta,
        }
        try:
            store.save(SiteSnapshot(tensors=tensors, meta=meta))
        except (OSError, ValueError) as err:
            logger.error("site %s: could not save its state in %s: %s", self.site, store.directory, err)

    # ---------------------------------------------------------------------------------------
    # Heartbeats

    def _start_heartbeat(self) -> None:
        self._heartbeat_thread = threading.Thread(
            target=self._heartbeat_loop, name=f"geoloco-heartbeat-{self.site}", daemon=True
        )
        self._heartbeat_thread.start()

    def _stop_heartbeat(self) -> None:
        self._stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=30)

    def _heartbeat_loop(self) -> None:
        state = self.state
        while True:
            interval = max(0.05, state.run_config.heartbeat_interval_ms / 1000 or 2.0)
            if self._stop.wait(interval):
                return
            try:
                response = self.client.heartbeat(
                    round_number=state.held_round, phase=state.phase,
                    inner_steps_done=self.trainer.steps_done,
                )
            except grpc.RpcError as error:
                if error_reason(error) == pb.ERROR_REASON_SITE_REPLACED:
                    # Another process holds the name: stop the run (which raises this) now,
                    # wherever it waits, rather than at its next call.
                    self._replaced = SiteReplaced(error.details() or str(error))
                    self.stop()
                    return
                logger.debug("heartbeat failed: %s", error)
                continue
            if response.rejoin_required:
                self._rejoin.set()

    # ---------------------------------------------------------------------------------------
    # Multi-rank sites

    def _follow(self) -> SiteRunSummary:
        """A non-leader rank: train when the leader says so, until it says stop."""
        outcome = self.trainer.follow()
        if outcome.weights is not None:
            self.state.adopt_weights(outcome.weights, outcome.round)
        self.state.take_leader_tally(
            finished=outcome.finished, rounds_trained=outcome.rounds_trained,
            rounds_included=outcome.rounds_included,
        )
        return self._summary()

"""The site agent: a user's model, optimizer, data and loss in; DiLoCo rounds against a coordinator.

Per round the agent holds ``θ_t`` (bit-identical to the coordinator's, checked by digest), runs
H inner steps with the user's optimizer (``run_inner_steps``, the simulator's own function),
computes the pseudo-gradient ``θ_t − θ_k``, encodes it with the run's uplink codec and error
feedback, uploads it (resumably), waits for the round's broadcast and applies the delta
(``apply_downlink``). The math is ``geoloco.algorithms``'; this module only decides *when*.

Rules the loop follows (the coordinator's side is in ``geoloco.coordinator.rounds``):

* **Straggler.** An upload refused as too late (WRONG_ROUND) is not an error: the site waits for
  that round's broadcast anyway. The header says whether its update was aggregated; if not, the
  encoded update goes back into the error-feedback residual (``UpdateEncoder.restore``), so the
  work reaches the model one round late instead of never. Holding ``θ_t`` it can apply round
  ``t``'s delta; if the coordinator moved further on, it chases the newer deltas without training
  or, when they are gone (RESYNC), fetches the full weights.
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
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from torch import nn

from geoloco.algorithms.config import config_from_dict
from geoloco.algorithms.diloco import UpdateEncoder, apply_downlink, pseudo_gradient, run_inner_steps
from geoloco.algorithms.lr_schedule import InnerLRSchedule
from geoloco.algorithms.params import ParamLayout, derive_seed, weights_digest
from geoloco.algorithms.privacy import PrivacyConfig
from geoloco.algorithms.strategy import UPLINK_SEED_PURPOSE, AlgorithmConfig
from geoloco.algorithms.time_budget import TimeBudget, run_inner_steps_within
from geoloco.compression import Encoded
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.identity import validate_site_name
from geoloco.protos.transport import TLSFiles
from geoloco.site_agent.client import (
    AgentStopped,
    CoordinatorClient,
    OpenBroadcast,
    RejoinRequired,
    RoundClosed,
    RunFinished,
    SiteAgentError,
    UpdateRejected,
)
from geoloco.site_agent.config import (
    JoinInfo,
    RoundResult,
    SiteAgentConfig,
    SiteHooks,
    resolve_device,
)
from geoloco.site_agent.distributed import IntraSiteGroup, unwrap_model
from geoloco.site_agent.secure_site import SecureUplink
from geoloco.site_agent.streaming import StreamingSite

__all__ = ["LossFn", "SiteAgent", "SiteRunSummary"]

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""``loss_fn(model, batch) -> scalar loss`` (the batch is already on the model's device)."""

ACTION_TRAIN = "train"
ACTION_STOP = "stop"
"""Control messages the leader rank sends to the other ranks of a multi-GPU site."""

_PENDING_NEW = "new"
_PENDING_UPLOADED = "uploaded"
_PENDING_LATE = "late"
_PENDING_DROPPED = "dropped"


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


@dataclass(slots=True)
class _Pending:
    round: int
    encoded: Encoded | None
    data: bytes
    sample_weight: float
    loss: float
    samples: int
    inner_steps: int
    inner_time_s: float
    started_s: float
    state: str = _PENDING_NEW
    fold_late: bool = False
    """Missed its round with ``late_updates = "fold"``: offered to the next round once the
    missed round's broadcast shows the next one is open."""


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple):
        return tuple(_to_device(b, device) for b in batch)
    if isinstance(batch, list):
        return [_to_device(b, device) for b in batch]
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


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
        """
        self.site = validate_site_name(site)
        self.config = config or SiteAgentConfig()
        self.hooks = hooks or SiteHooks()
        self.group = group
        distributed = group is not None and group.world_size > 1
        self.device = group.device if group is not None else resolve_device(self.config.device)
        self.module = unwrap_model(model).to(self.device)
        # Multi-rank sites train through DDP (gradients averaged every step); a model the user
        # already wrapped is used as is.
        needs_wrap = distributed and model is self.module
        self.train_model = group.wrap_model(model) if needs_wrap and group is not None else model
        self.layout = ParamLayout.from_model(self.module)
        self.optimizer = inner_optimizer
        self.lr_schedule = lr_schedule
        self._lr_round: int | None = None
        """The round the lr schedule's position belongs to (``None``: not positioned yet)."""
        self.loss_fn = loss_fn
        self._data = iter(data)
        self.is_leader = group is None or group.is_leader
        self._coordinator = coordinator
        self._tls = tls
        self._insecure = insecure
        self._server_name = server_name
        self._interceptors = list(interceptors)
        self._stop = threading.Event()
        self._rejoin = threading.Event()
        self._client: CoordinatorClient | None = None
        self._heartbeat_thread: threading.Thread | None = None

        self._global: torch.Tensor | None = None
        self._global_digest: str | None = None
        self._held_round = 0
        self._coordinator_round = 0
        self._round_info = pb.RoundInfo()
        self._run_config = pb.RunConfig()
        self._algorithm: AlgorithmConfig | None = None
        self._uplink: UpdateEncoder | None = None
        self._secure: SecureUplink | None = None
        """Secure aggregation (the run's ``[privacy]``): keys, masking, unmasking per round."""
        self._pending: _Pending | None = None
        self._finished = False
        self._rounds_trained = 0
        self._rounds_included = 0
        self._phase = pb.SITE_PHASE_UNSPECIFIED
        self._steps_done = 0
        self._streaming: StreamingSite | None = None
        """Set when the coordinator's run uses Streaming DiLoCo (``geoloco.site_agent.streaming``)."""

    # ---------------------------------------------------------------------------------------
    # Public surface

    @property
    def global_weights(self) -> torch.Tensor | None:
        """The global weights this site holds (flat fp32), or None before the first join."""
        return None if self._global is None else self._global.detach().cpu()

    @property
    def held_round(self) -> int:
        """The site holds ``θ_held_round``."""
        return self._held_round

    @property
    def weights_digest(self) -> str | None:
        return self._global_digest

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
        self._client = CoordinatorClient(
            self._coordinator,
            site=self.site,
            tls=self._tls,
            insecure=self._insecure,
            config=self.config,
            stop_event=self._stop,
            server_name=self._server_name,
            interceptors=self._interceptors,
        )
        reason = "run finished"
        needs_join = True
        try:
            while not self._finished:
                if self._stop.is_set():
                    reason = "stopped"
                    break
                if max_rounds is not None and self._rounds_trained >= max_rounds:
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
                    self._step()
                except RejoinRequired as why:
                    logger.info("site %s: re-joining (%s)", self.site, why)
                    needs_join = True
        except AgentStopped:
            reason = "stopped"
        finally:
            self._stop_heartbeat()
            self._stop_followers()
            if self._client is not None:
                if self._client.session_id and not needs_join:
                    self._client.leave(reason)
                self._client.close()
        logger.info(
            "site %s done (%s): %d rounds trained, %d included, holding round %d",
            self.site, reason, self._rounds_trained, self._rounds_included, self._held_round,
        )
        return self._summary()

    def _summary(self) -> SiteRunSummary:
        return SiteRunSummary(
            rounds_trained=self._rounds_trained,
            rounds_included=self._rounds_included,
            final_round=self._held_round,
            weights_digest=self._global_digest or "",
            run_finished=self._finished,
        )

    # ---------------------------------------------------------------------------------------
    # Joining and fetching

    @property
    def client(self) -> CoordinatorClient:
        assert self._client is not None
        return self._client

    def _join(self) -> None:
        previous_session = self.client.session_id
        has_weights = self._global is not None
        response = self.client.join(
            has_weights=has_weights,
            weights_round=self._held_round,
            digest_hex=self._global_digest,
        )
        self._check_layout(response.layout)
        new_session = response.session_id != previous_session
        self._apply_run_config(response.config)
        coordinator_round = response.round.round
        self._round_info = response.round

        pending = self._pending
        if pending is not None:
            if pending.round == coordinator_round and not response.must_fetch_model:
                if pending.state != _PENDING_DROPPED:
                    pending.state = _PENDING_NEW  # re-send; the coordinator deduplicates
            elif not new_session and pending.round < coordinator_round:
                # Same session, the round moved on: its broadcast says whether we counted.
                if pending.state == _PENDING_NEW:
                    pending.state = _PENDING_LATE
            else:
                logger.info(
                    "site %s: dropping its update for round %d (coordinator session %s is at round %d)",
                    self.site, pending.round, response.session_id[:8], coordinator_round,
                )
                self._pending = None
                pending = None

        chase = (
            has_weights
            and not new_session
            and self._held_round < coordinator_round
        )
        fetched = False
        if response.must_fetch_model and pending is None and not chase:
            self._fetch()
            fetched = True
        self._coordinator_round = coordinator_round
        total = self._run_config.total_rounds
        if total and self._held_round >= total and pending is None:
            self._finished = True
        logger.info(
            "site %s joined session %s at round %d%s",
            self.site, response.session_id[:8], coordinator_round, " (fetched weights)" if fetched else "",
        )
        if self.hooks.on_join is not None:
            self.hooks.on_join(
                JoinInfo(
                    session_id=response.session_id,
                    round=coordinator_round,
                    inner_steps=self._run_config.inner_steps,
                    uplink_codec=self._run_config.uplink_codec,
                    downlink_codec=self._run_config.downlink_codec,
                    total_rounds=total,
                    fetched_model=fetched,
                    config=json.loads(self._run_config.config_json or "{}"),
                )
            )

    def _check_layout(self, layout: pb.ModelLayout) -> None:
        ours = [(e.name, tuple(e.shape)) for e in self.layout.entries]
        theirs = [(t.name, tuple(t.shape)) for t in layout.tensors]
        if ours != theirs:
            first = next(
                (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs))
            )
            mine = ours[first] if first < len(ours) else "nothing"
            other = theirs[first] if first < len(theirs) else "nothing"
            raise SiteAgentError(
                f"this site's model does not match the coordinator's: parameter #{first} is {mine} "
                f"here and {other} there ({len(ours)} vs {len(theirs)} tensors); build the same "
                "model class with the same configuration on both sides"
            )

    def _apply_run_config(self, config: pb.RunConfig) -> None:
        data = json.loads(config.config_json or "{}")
        algorithm = config_from_dict(AlgorithmConfig, data.get("algorithm", {}))
        if self._uplink is None or self._run_config.uplink_codec != config.uplink_codec or (
            self._algorithm is not None
            and (
                algorithm.error_feedback != self._algorithm.error_feedback
                or algorithm.error_feedback_decay != self._algorithm.error_feedback_decay
            )
        ):
            self._uplink = UpdateEncoder(
                config.uplink_codec,
                error_feedback=algorithm.error_feedback,
                decay=algorithm.error_feedback_decay,
            )
        self._algorithm = algorithm
        self._run_config = config
        privacy = config_from_dict(PrivacyConfig, data.get("privacy", {}))
        if not privacy.secure_aggregation:
            self._secure = None
        elif self._secure is None or self._secure.privacy != privacy or self._secure.uplink_codec != config.uplink_codec:
            self._secure = SecureUplink(self.site, privacy, config.uplink_codec, tls=self._tls)
        # Streaming DiLoCo: the round loop moves to StreamingSite (per-fragment uplinks).
        if algorithm.streaming.enabled and (
            self._streaming is None or self._streaming.algorithm != algorithm
        ):
            self._streaming = StreamingSite(self, algorithm)
        elif not algorithm.streaming.enabled:
            self._streaming = None

    def _fetch(self) -> None:
        self._phase = pb.SITE_PHASE_FETCHING
        manifest, weights = self.client.fetch_model(self.layout.numel)
        if self._streaming is not None and self._global is not None:
            # Streaming: the site's own weights are kept; only the fragments it missed merge.
            self._streaming.fetched(weights.to(self.device), manifest.round)
        else:
            self._set_global(weights.to(self.device), manifest.round)
        logger.info("site %s fetched the weights of round %d", self.site, manifest.round)

    def _refresh_round_info(self) -> None:
        """Get the round info (seed, deadline) of the round the site holds weights for when the
        last broadcast it applied carried an older one: a straggler that fetched newer weights
        knows their round but not its seed. A heartbeat answers with the coordinator's round;
        if that is further on, the site chases it instead of training."""
        if self._round_info.round == self._held_round or self._global is None:
            return
        try:
            response = self.client.heartbeat(
                round_number=self._held_round, phase=pb.SITE_PHASE_WAITING, inner_steps_done=0
            )
        except grpc.RpcError as error:
            raise RejoinRequired(f"heartbeat for the round info failed: {error.code()}") from None
        if response.rejoin_required:
            raise RejoinRequired("the coordinator asks this site to join again")
        self._coordinator_round = max(self._coordinator_round, response.round.round)
        if response.round.round == self._held_round:
            self._round_info = response.round

    def _set_global(self, flat: torch.Tensor, round_number: int) -> None:
        self._global = flat
        self._global_digest = weights_digest(flat)
        self._held_round = round_number
        self.layout.load_(self.module, flat)

    # ---------------------------------------------------------------------------------------
    # One step of the loop

    def _step(self) -> None:
        if self._streaming is not None:
            self._streaming.step()
            return
        pending = self._pending
        if pending is None:
            self._refresh_round_info()
            if self._held_round < self._coordinator_round:
                self._await_and_apply(self._held_round, None)  # behind: chase without training
                return
            if self._run_config.total_rounds and self._held_round >= self._run_config.total_rounds:
                self._finished = True
                return
            pending = self._pending = self._train_round()
        opened = None
        if pending.state == _PENDING_NEW:
            opened = self.client.open_broadcast(pending.round)
            try:
                on_time = self._upload(pending)
            except BaseException:
                opened.cancel()
                raise
            if not on_time:
                # The round had closed: the early wait may already hold a header written before
                # a late update was folded in, so ask again.
                opened.cancel()
                opened = None
        self._await_and_apply(pending.round, pending, opened)

    def _train_round(self) -> _Pending:
        assert self._global is not None and self._uplink is not None
        round_number = self._held_round
        inner_steps = int(self._run_config.inner_steps)
        budget_s = self._algorithm.round_time_budget_s if self._algorithm is not None else None
        started = time.monotonic()
        self._tell_followers({"action": ACTION_TRAIN, "round": round_number, "inner_steps": inner_steps,
                              "time_budget_s": budget_s})
        if self._secure is not None:  # key stages run beside the inner steps
            self._secure.begin_round(
                self.client, session=self.client.session_id, round_number=round_number,
                round_seed=self._round_info.round_seed, numel=self.layout.numel,
            )
        loss, samples, inner_time, inner_steps = self._train(inner_steps, budget_s)
        local = self.layout.flatten(self.module)
        update = pseudo_gradient(self._global, local)
        del local
        if not bool(torch.isfinite(update).all()):
            logger.error(
                "site %s: the pseudo-gradient of round %d has NaN/Inf values (loss %.4g); not "
                "uploading it and resetting the error-feedback residual", self.site, round_number, loss,
            )
            self._uplink = UpdateEncoder(
                self._run_config.uplink_codec,
                error_feedback=self._algorithm.error_feedback if self._algorithm else True,
                decay=self._algorithm.error_feedback_decay if self._algorithm else 1.0,
            )
            return _Pending(
                round=round_number, encoded=None, data=b"", sample_weight=float(samples),
                loss=loss, samples=samples, inner_steps=inner_steps, inner_time_s=inner_time,
                started_s=started, state=_PENDING_DROPPED,
            )
        if self._round_info.round != round_number:
            raise SiteAgentError(
                f"internal error: training round {round_number} without its round seed "
                f"(latest round info is for round {self._round_info.round})"
            )
        if self._secure is not None:
            masked = self._secure.masked_update(update)
            return _Pending(
                round=round_number, encoded=None, data=masked or b"", sample_weight=1.0,
                loss=loss, samples=samples, inner_steps=inner_steps, inner_time_s=inner_time,
                started_s=started, state=_PENDING_NEW if masked is not None else _PENDING_DROPPED,
            )
        seed = derive_seed(self._round_info.round_seed, UPLINK_SEED_PURPOSE, self.site)
        encoded = self._uplink.encode(update, seed=seed)
        del update
        return _Pending(
            round=round_number,
            encoded=encoded,
            data=encoded.to_bytes(),
            sample_weight=float(max(samples, 1)),
            loss=loss,
            samples=samples,
            inner_steps=inner_steps,
            inner_time_s=inner_time,
            started_s=started,
        )

    def _train(
        self, inner_steps: int, budget_s: float | None = None
    ) -> tuple[float, int, float, int]:
        """H inner steps on every rank from the global weights, or as many as fit in
        ``budget_s`` seconds (time-budget rounds; every rank runs the same number); returns
        (mean loss, samples, seconds, steps)."""
        group = self.group
        if self._global is None:
            self._global = torch.empty(self.layout.numel, dtype=torch.float32, device=self.device)
        if group is not None:
            group.broadcast_flat_(self._global)
        self.layout.load_(self.module, self._global)
        self._position_lr_schedule(inner_steps)
        self._phase = pb.SITE_PHASE_TRAINING
        t0 = time.perf_counter()
        if budget_s is not None:
            result, _ = run_inner_steps_within(
                self.train_model, self.optimizer, self._batches(), TimeBudget(budget_s), self._loss,
                grad_clip_norm=self.config.grad_clip_norm, agree=self._agree_elapsed,
                sync=self._sync_device, lr_schedule=self.lr_schedule,
            )
        else:
            result = run_inner_steps(
                self.train_model,
                self.optimizer,
                self._batches(),
                inner_steps,
                self._loss,
                grad_clip_norm=self.config.grad_clip_norm,
                lr_schedule=self.lr_schedule,
            )
        self._lr_round = self._held_round + 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t0
        stats = torch.tensor(
            [sum(result.losses), float(len(result.losses)), float(result.samples)], dtype=torch.float64
        )
        if group is not None:
            group.all_reduce_(stats, "sum")
        loss = float(stats[0] / stats[1]) if stats[1] > 0 else float("nan")
        return loss, int(stats[2]), elapsed, len(result.losses)

    def _position_lr_schedule(self, inner_steps: int) -> None:
        """Resume the lr schedule at ``held_round × inner_steps`` unless the site trained the
        round before this one (then its cumulative count is already right). Exact for fixed-H
        rounds; with time-budget rounds (step counts vary) ``inner_steps`` is the nominal H, an
        estimate. Every rank calls it with the leader's round and H, so all ranks agree."""
        if self.lr_schedule is None or self._lr_round == self._held_round:
            return
        step = self._held_round * inner_steps
        logger.info("site %s: inner lr schedule at step %d (round %d)", self.site, step, self._held_round)
        self.lr_schedule.seek(step)
        self._lr_round = self._held_round

    def _agree_elapsed(self, elapsed_s: float) -> float:
        """The slowest rank's elapsed time, so every rank of a site stops after the same step."""
        if self.group is None or not self.group.is_distributed:
            return elapsed_s
        return float(self.group.all_reduce_(torch.tensor([elapsed_s], dtype=torch.float64), "max")[0])

    def _sync_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _batches(self) -> Iterator[Any]:
        # A single-process site stops between two inner steps, so SIGTERM does not wait for a
        # whole round of training. The ranks of a multi-GPU site finish the round together: one
        # rank leaving mid-round would leave the others waiting in a collective.
        interruptible = self.group is None or not self.group.is_distributed
        while True:
            if interruptible and self._stop.is_set():
                raise AgentStopped()
            try:
                batch = next(self._data)
            except StopIteration:
                raise SiteAgentError(
                    "the site's data iterator is exhausted; pass an endless iterator (e.g. "
                    "itertools.cycle over a DataLoader)"
                ) from None
            self._steps_done += 1
            yield _to_device(batch, self.device)

    def _loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if self.config.autocast_bf16:
            with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16):
                return self.loss_fn(model, batch)
        return self.loss_fn(model, batch)

    def _upload(self, pending: _Pending) -> bool:
        """Upload ``pending``; True when it reached its own round before that round closed."""
        self._phase = pb.SITE_PHASE_UPLOADING
        if self._secure is not None:
            kind = self._secure.upload_kwargs()
        else:
            assert pending.encoded is not None
            kind = {"codec": pending.encoded.spec, "shape": list(pending.encoded.shape)}
        try:
            response = self.client.upload(
                round_number=pending.round,
                data=pending.data,
                **kind,
                sample_weight=pending.sample_weight,
                inner_steps=pending.inner_steps,
                metrics={
                    "train_loss": pending.loss,
                    "samples": float(pending.samples),
                    "inner_steps": float(pending.inner_steps),
                    "inner_time_s": pending.inner_time_s,
                },
            )
            pending.state = _PENDING_UPLOADED
            if self._secure is not None:
                self._phase = pb.SITE_PHASE_WAITING
                self._secure.unmask()  # survivor list and unmask answer, before the broadcast
            return not response.folded_late
        except RoundClosed as why:
            logger.info("site %s: update for round %d is late (%s)", self.site, pending.round, why)
            pending.state = _PENDING_LATE
            folds = self._algorithm is not None and self._algorithm.late_updates == "fold"
            # A masked update belongs to its own round's sum. The missed round may still be
            # aggregating: the update is offered once its broadcast is here (the next round is
            # open by then), not on a timer that a slow aggregation would outlast.
            pending.fold_late = folds and self._secure is None
        except RunFinished as why:
            logger.info("site %s: update for round %d is late (%s)", self.site, pending.round, why)
            pending.state = _PENDING_LATE
        except UpdateRejected as why:
            logger.error("site %s: the coordinator rejected the update for round %d: %s",
                         self.site, pending.round, why)
            pending.state = _PENDING_DROPPED
        return False

    def _upload_late(self, pending: _Pending) -> bool:
        """``late_updates = "fold"``: offer the update that missed its round to the next one,
        which the coordinator opened before it broadcast the missed round. True when it was
        folded in (discounted); otherwise (two rounds late by now, the run over) it goes back to
        the residual like any update that missed its round."""
        assert pending.encoded is not None
        try:
            self.client.upload(
                round_number=pending.round,
                data=pending.data,
                codec=pending.encoded.spec,
                shape=list(pending.encoded.shape),
                sample_weight=pending.sample_weight,
                inner_steps=pending.inner_steps,
                metrics={"train_loss": pending.loss, "late": 1.0},
            )
        except (RoundClosed, RunFinished, UpdateRejected) as why:
            logger.info("site %s: late update for round %d not folded in (%s)",
                        self.site, pending.round, why)
            return False
        pending.state = _PENDING_UPLOADED
        logger.info("site %s: late update for round %d folded into the next round",
                    self.site, pending.round)
        return True

    def _await_and_apply(
        self, round_number: int, pending: _Pending | None, opened: OpenBroadcast | None = None
    ) -> None:
        assert self._global is not None
        self._phase = pb.SITE_PHASE_WAITING
        bytes_down_before = self.client.stats.received
        try:
            header, data = self.client.await_broadcast(
                round_number, on_progress=self._on_progress, opened=opened
            )
        except RunFinished:
            self._finished = True
            self._pending = None
            return
        except RoundClosed as why:
            # The coordinator is at an earlier round than this site (it restarted from an older
            # checkpoint): join again and take the weights it names.
            raise RejoinRequired(str(why)) from None
        included = bool(header.included)
        if pending is not None and pending.fold_late and not included:
            included = self._upload_late(pending)
        if pending is not None and not included and pending.encoded is not None:
            assert self._uplink is not None
            self._uplink.restore(pending.encoded)
        elif pending is not None and not included and self._secure is not None:
            # A masked update the round did not sum (aborted, refused): back into the residual.
            self._secure.restore()
        resynced = False
        if header.action == pb.BROADCAST_ACTION_APPLY_DELTA:
            assert data is not None
            new = apply_downlink(self._global, Encoded.from_bytes(data))
            digest = weights_digest(new)
            if digest != header.weights_digest.digest.hex():
                logger.warning(
                    "site %s: weights digest after round %d differs from the coordinator's; "
                    "fetching the full weights", self.site, round_number,
                )
                self._fetch()
                resynced = True
            else:
                self._set_global(new, round_number + 1)
        else:
            self._fetch()
            resynced = True
        self._pending = None
        self._coordinator_round = max(header.next_round.round, self._held_round)
        if header.next_round.round == self._held_round:
            self._round_info = header.next_round
        total = self._run_config.total_rounds
        if header.run_finished or (total and self._held_round >= total):
            self._finished = True
        if pending is None:
            return
        self._rounds_trained += 1
        self._rounds_included += int(included)
        result = RoundResult(
            round=pending.round,
            train_loss=pending.loss,
            samples=pending.samples,
            inner_steps=pending.inner_steps,
            included=included,
            num_contributors=header.num_contributors,
            resynced=resynced,
            bytes_up=len(pending.data) if pending.state == _PENDING_UPLOADED else 0,
            bytes_down=self.client.stats.received - bytes_down_before,
            inner_time_s=pending.inner_time_s,
            round_time_s=time.monotonic() - pending.started_s,
            weights_digest=self._global_digest or "",
            next_round=self._held_round,
        )
        logger.info(
            "site %s round %d: loss %.4f, %s (%d sites), now at round %d",
            self.site, pending.round, pending.loss,
            "included" if included else "NOT included", header.num_contributors,
            self._held_round,
        )
        if self.hooks.on_round_end is not None:
            self.hooks.on_round_end(result)

    def _on_progress(self, progress: pb.RoundProgress) -> None:
        logger.debug(
            "site %s waiting for round %d: %d uploads complete (quorum %d)",
            self.site, progress.round, progress.uploads_complete, progress.quorum,
        )

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
        while True:
            interval = max(0.05, self._run_config.heartbeat_interval_ms / 1000 or 2.0)
            if self._stop.wait(interval):
                return
            try:
                response = self.client.heartbeat(
                    round_number=self._held_round, phase=self._phase, inner_steps_done=self._steps_done
                )
            except grpc.RpcError as error:
                logger.debug("heartbeat failed: %s", error)
                continue
            if response.rejoin_required:
                self._rejoin.set()

    # ---------------------------------------------------------------------------------------
    # Multi-rank sites

    def _tell_followers(self, control: dict[str, Any]) -> None:
        if self.group is not None and self.group.is_distributed and self.is_leader:
            self.group.broadcast_object(control)

    def _stop_followers(self) -> None:
        """Tell the other ranks to stop, handing them the final global weights."""
        if self.group is None or not self.group.is_distributed:
            return
        has_weights = self._global is not None
        self.group.broadcast_object(
            {"action": ACTION_STOP, "weights": has_weights, "round": self._held_round,
             "finished": self._finished, "rounds_included": self._rounds_included}
        )
        if has_weights:
            assert self._global is not None
            self.group.broadcast_flat_(self._global)

    def _follow(self) -> SiteRunSummary:
        """Loop of a non-leader rank: train when the leader says so, with its weights."""
        assert self.group is not None
        while True:
            control = self.group.broadcast_object(None)
            if control["action"] == ACTION_STOP:
                if control["weights"]:
                    flat = torch.empty(self.layout.numel, dtype=torch.float32, device=self.device)
                    self.group.broadcast_flat_(flat)
                    self._set_global(flat, int(control["round"]))
                self._finished = bool(control["finished"])
                self._rounds_included = int(control["rounds_included"])
                break
            self._held_round = int(control["round"])
            self._train(int(control["inner_steps"]), control.get("time_budget_s"))
            self._rounds_trained += 1
        return self._summary()

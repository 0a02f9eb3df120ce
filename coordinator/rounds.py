"""The coordinator's round state machine: pure, lock-protected, testable without a socket.

Rounds are numbered from 0, on the wire and in the strategy: round ``r`` starts from ``θ_r`` and
its broadcast turns ``θ_r`` into ``θ_{r+1}``.

``RoundStateMachine`` is the one object the servicer calls; it owns the shared state
(``geoloco.coordinator.context``) and three parts that work on it:

* membership (``geoloco.coordinator.membership``): join, leave, heartbeats, dropping silent sites;
* upload intake (``geoloco.coordinator.intake``): plain or masked uploads behind one interface,
  late updates folded into the next round, and when the open round closes;
* round phases (``geoloco.coordinator.phases``): start, close, aggregate, checkpoint and the
  broadcast record, on the round core (``geoloco.algorithms.round``).

The rules, in a few lines:

* A round *starts* (its deadline clock begins) when at least ``min_sites`` sites are members.
  Uploads are accepted before the start too (sites may train while the quorum assembles).
* A round *closes* when ``RoundPolicy.decide`` says so: at least ``min_sites`` uploads are
  aggregated and either every current member has completed (or been rejected), or the deadline
  has passed. With fewer than ``min_sites`` uploads it keeps waiting, past its deadline if need
  be. A site that joins during a round is waited for like the others.
* At the close, members without a complete upload are *excluded* (stragglers): their later
  uploads are refused with FAILED_PRECONDITION / WRONG_ROUND (or, with ``late_updates =
  "fold"``, folded into the next round with a staleness discount); they catch up by applying
  the broadcast delta.
* Members that leave or stay silent longer than ``heartbeat_timeout_s`` are dropped.

Every method speaks domain objects (``geoloco.coordinator.domain``); the servicer translates
them to and from protobuf with ``geoloco.coordinator.translate``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from geoloco.algorithms.device import resolve_device
from geoloco.algorithms.engine import RoundEngine
from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.privacy.secagg_stages import StageMessage, StageReply
from geoloco.algorithms.record import RoundRecord
from geoloco.algorithms.round import RoundPolicy
from geoloco.algorithms.strategy import Strategy, build_strategy
from geoloco.algorithms.update_guard import UpdateGuard
from geoloco.compression import parse_codec
from geoloco.coordinator import events as ev
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.context import RoundContext
from geoloco.coordinator.domain import (
    HeartbeatResult,
    JoinResult,
    ModelSnapshot,
    RoundPhase,
    RoundProgress,
    UploadProgress,
    UploadSpec,
    WaitResult,
)
from geoloco.coordinator.errors import ShuttingDownError
from geoloco.coordinator.intake import Chunks, PlainIntake, UploadIntake
from geoloco.coordinator.membership import Membership
from geoloco.coordinator.phases import EvalFn, GlobalWeights, RoundPhases
from geoloco.coordinator.privacy_rounds import PrivateRounds
from geoloco.coordinator.resume import start_round as start_round_of
from geoloco.coordinator.secure_intake import SecureIntake
from geoloco.protos.errors import InvalidUpdateError, RunFinishedError, WrongRoundError

__all__ = [
    "SECURE_STAGE_WAIT_S",
    "EvalFn",
    "ModelSnapshot",
    "RoundPhase",
    "RoundStateMachine",
    "WaitResult",
    "canonical_codec",
]

logger = logging.getLogger(__name__)

SECURE_STAGE_WAIT_S = 1.0
"""Longest a SecureStage call is held waiting for its stage to close (the site calls again)."""


def canonical_codec(spec: str) -> str:
    """The canonical spelling of a codec spec (what ``Encoded.spec`` carries)."""
    return parse_codec(spec).spec


class RoundStateMachine:
    """Membership, rounds, uploads, aggregation and broadcasts of one coordinator session.

    Every public method is thread-safe. ``clock`` (seconds, monotonic) is injectable so tests can
    drive deadlines and heartbeat timeouts without sleeping; ``poll()`` advances time-driven
    transitions (drops silent sites, closes rounds, aggregates) and is called by the server's
    driver thread whenever something changes or a deadline comes due.
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        initial_weights: torch.Tensor,
        layout: ParamLayout,
        *,
        eval_fn: EvalFn | None = None,
        clock: Callable[[], float] = time.monotonic,
        session_id: str | None = None,
        set_aside_previous_run: bool = True,
    ) -> None:
        """``set_aside_previous_run=False``: with ``resume = false``, leave a previous run's
        files in ``checkpoint_dir``; the host moves them (``resume.set_aside_previous_run``)
        before a round can close, as ``CoordinatorServer.start`` does once its port is bound."""
        if initial_weights.dim() != 1 or initial_weights.numel() != layout.numel:
            raise ValueError(
                f"initial weights have shape {tuple(initial_weights.shape)}; the layout needs a flat "
                f"vector of {layout.numel} elements (use ParamLayout.flatten(model))"
            )
        if initial_weights.dtype != torch.float32:
            raise ValueError(f"initial weights must be float32, got {initial_weights.dtype}")
        self.config = config
        self.layout = layout
        self.numel = layout.numel
        self.device = resolve_device(config.device)
        self.session_id = session_id or uuid.uuid4().hex
        self.clock = clock
        self.events = ev.EventHub(clock)
        """Observers (metrics, status page) listen here; see ``geoloco.coordinator.events``."""
        self.uplink_codec = canonical_codec(config.algorithm.uplink_codec)
        self.downlink_codec = canonical_codec(config.algorithm.downlink_codec)
        def new_strategy() -> Strategy:
            return build_strategy(
                config.algorithm,
                numel=self.numel,
                outer_optimizer=config.outer_optimizer,
                inner_optimizer=config.inner_optimizer,
                seed=config.seed,
                device=self.device,
                layout=layout,
            )

        self.strategy = new_strategy()
        self.policy: RoundPolicy = config.training.round_policy()
        """Quorum, deadline in force (fixed or adaptive) and the late-update rule."""
        self.engine = RoundEngine(
            self.strategy, self.policy, UpdateGuard(config.update_guard), fresh_strategy=new_strategy
        )
        """The rounds' lifecycle (``geoloco.algorithms.engine``); this class does their I/O."""
        self.max_upload_bytes = config.max_upload_bytes or (2 * 4 * self.numel + (1 << 20))
        self.privacy: PrivateRounds | None = (
            PrivateRounds(
                config.privacy, self.uplink_codec, numel=self.numel, session=self.session_id,
                stage_timeout_s=config.secure_stage_timeout_s,
            )
            if config.privacy.enabled
            else None
        )
        """Secure aggregation / DP of this session (``geoloco.coordinator.privacy_rounds``)."""
        self._ctx = ctx = RoundContext(
            config, self.strategy, self.engine, session_id=self.session_id, clock=clock, events=self.events
        )
        if ctx.merge_rule is not None:
            self.engine.close_policy = ctx.merge_rule  # asynchronous merges close by their own rule
        self._cond = ctx.cond
        self._poll_lock = threading.Lock()
        self.membership = Membership(ctx)
        if self.privacy is not None and self.privacy.secure:
            secure = SecureIntake(ctx, self.membership, self.privacy)
            self.engine.close_policy = secure  # the protocol's stages close a secure round
            self.intake: UploadIntake = secure
        else:
            self.intake = PlainIntake(
                ctx, self.membership, uplink_codec=self.uplink_codec, numel=self.numel,
                max_upload_bytes=self.max_upload_bytes, device=self.device, privacy=self.privacy,
                shapes=[e.shape for e in layout.entries],
            )
        weights = initial_weights.detach().to(self.device, torch.float32).clone()
        self.phases = RoundPhases(
            ctx, self.intake, self.membership, layout=layout, weights=GlobalWeights.of(weights), privacy=self.privacy,
            eval_fn=eval_fn,
        )
        if config.checkpoint_dir is not None:
            # The rewind after a thrown-away step comes from the checkpoint of the unchanged
            # weights; without checkpoints the engine keeps a copy across each step instead.
            self.engine.restore_outer = self.phases.restore_outer
            self.phases.enable_round_log()
        start_round = start_round_of(config, self.phases, set_aside=set_aside_previous_run)
        now = self.clock()
        ctx.round = ctx.new_round(start_round, now)
        if config.total_rounds and start_round >= config.total_rounds:
            self.phases.finish_run(now)
        logger.info(
            "coordinator session %s: round %d, %d parameters, digest %s",
            self.session_id, start_round, self.numel, self.digest_hex[:16],
        )

    # ---------------------------------------------------------------------------------------
    # Read-only views (thread-safe snapshots)

    @property
    def eval_fn(self) -> EvalFn | None:
        return self.phases.eval_fn

    @property
    def round(self) -> int:
        """The round currently open (or ``total_rounds`` once finished)."""
        return self._ctx.round.number

    @property
    def phase(self) -> RoundPhase:
        return self._ctx.phase

    @property
    def weights(self) -> torch.Tensor:
        """``θ_round`` on the CPU (a tensor that is never modified in place)."""
        return self.phases.weights.cpu

    @property
    def digest_hex(self) -> str:
        return self.phases.weights.digest

    @property
    def members(self) -> list[str]:
        with self._cond:
            return sorted(self._ctx.members)

    @property
    def finished(self) -> bool:
        return self._ctx.phase is RoundPhase.FINISHED

    @property
    def secure(self) -> bool:
        """Uploads are masked (secure aggregation) and SecureStage calls run the protocol."""
        return self.intake.secure

    def fragment_of(self, round_number: int) -> int:
        """Fragment round ``round_number`` synchronises (0 without streaming)."""
        return self._ctx.fragment_of(round_number)

    def update_numel(self, round_number: int) -> int:
        """Elements of round ``round_number``'s uploads (its fragment's, or the model's)."""
        return self._ctx.update_numel(round_number)

    def round_seed(self, round_number: int) -> int:
        """Seed shared by every site for round ``round_number``."""
        return self._ctx.round_seed(round_number)

    def status(self) -> dict[str, Any]:
        """A JSON-able view for logs and tests."""
        with self._cond:
            ctx = self._ctx
            r = ctx.round
            return {
                "session_id": self.session_id,
                "round": r.number,
                "phase": ctx.phase.value,
                "members": sorted(ctx.members),
                "pending": sorted(r.core.pending(ctx.members)),
                "contributed": list(r.contributed),
                "rejected": sorted(r.rejected),
                "uploads": {
                    site: {
                        "received_chunks": a.received_count,
                        "num_chunks": a.num_chunks,
                        "aggregated": site in r.contributed,
                    }
                    for site, a in sorted(r.uploads.items())
                },
                "digest": self.digest_hex,
            }

    # ---------------------------------------------------------------------------------------
    # Membership

    def join(
        self,
        site: str,
        *,
        protocol_version: int,
        has_weights: bool = False,
        weights_digest: str | None = None,
        software_version: str = "",
        instance: str = "",
        peer: str = "",
        via: str = "",
    ) -> JoinResult:
        """Register (or re-register) ``site``; says whether it must fetch the model.
        ``weights_digest``: hex SHA-256 of the weights the site holds, if any. ``instance``:
        the joining process (``JoinRequest.instance_id``), which takes the name over from
        another live one (``geoloco.coordinator.membership``); ``peer``: where it joins from;
        ``via``: the relay the Join came through ("" for a direct call)."""
        Membership.check_protocol(protocol_version)
        self.membership.check_allowed(site)
        with self._cond:
            now = self.clock()
            self.membership.join(
                site, now, software_version=software_version, instance=instance, peer=peer, via=via
            )
            self.phases.maybe_start(now)
            result = JoinResult(
                session_id=self.session_id,
                site=site,
                round=self._ctx.round_info(now, site),
                weights_digest=self.digest_hex,
                must_fetch_model=not (has_weights and weights_digest == self.digest_hex),
            )
            self._cond.notify_all()
            return result

    def leave(self, site: str, session_id: str, reason: str = "", *, instance: str = "") -> None:
        with self._cond:
            self.membership.leave(site, session_id, reason, instance)
            self._cond.notify_all()

    def heartbeat(
        self,
        site: str,
        session_id: str,
        *,
        round_number: int = 0,
        phase: str = "",
        inner_steps_done: int = 0,
        instance: str = "",
        via: str = "",
    ) -> HeartbeatResult:
        """Record a sign of life; a stale session or a dropped site is told to re-join, a
        replaced process refused. ``phase``: what the site is doing
        (``geoloco.coordinator.domain.SITE_PHASES``)."""
        self.membership.check_allowed(site)
        self.membership.note_arrival(site, session_id, instance, self.clock())
        with self._cond:
            now = self.clock()
            rejoin = self.membership.heartbeat(
                site, session_id, now, round_number=round_number, phase=phase, inner_steps_done=inner_steps_done,
                instance=instance, via=via,
            )
            return HeartbeatResult(
                rejoin_required=rejoin,
                round=self._ctx.round_info(now, site),
                run_finished=self._ctx.phase is RoundPhase.FINISHED,
            )

    # ---------------------------------------------------------------------------------------
    # FetchModel

    def model_snapshot(self, site: str, session_id: str, *, instance: str = "") -> ModelSnapshot:
        with self._cond:
            self.membership.member(site, session_id, instance)
            w = self.phases.weights
            return ModelSnapshot(round=self._ctx.round.number, weights=w.cpu, digest=w.digest)

    def weights_with_digest(self, digest: str) -> torch.Tensor | None:
        """The current global weights (CPU fp32) if their digest is ``digest``, else None (a
        later round replaced them meanwhile)."""
        with self._cond:
            w = self.phases.weights
            return w.cpu if w.digest == digest else None

    def count_stage_bytes(self, site: str, up: int, down: int) -> None:
        """A secure-aggregation stage call's request (up) and reply (down), counted in the
        current round beside the masked upload and the broadcast: a secure round's protocol
        is on the site's link too (a long-polled stage asked again counts each time)."""
        with self._cond:
            self._ctx.count_up(site, up)
            self._ctx.count_down(site, down)

    def count_bytes_down(self, site: str, nbytes: int) -> None:
        """Bytes sent to ``site`` (FetchModel, AwaitBroadcast), counted in the current round."""
        with self._cond:
            self._ctx.count_down(site, nbytes)

    # ---------------------------------------------------------------------------------------
    # Uploads (plain or masked: ``self.intake``)

    def receive_upload(self, site: str, spec: UploadSpec, chunks: Chunks) -> UploadProgress:
        """One Upload stream: its manifest, then its chunks as ``(chunk, message bytes)``."""
        if spec.shard_count and self.intake.secure:
            raise InvalidUpdateError(
                "sharded uploads do not combine with secure aggregation (a masked update is one "
                "ring sum per site); run the site data-parallel (geoloco site --sharding none; "
                "SiteAgent instead of ShardedSite in Python) or "
                "turn [privacy] secure_aggregation off"
            )
        return self.intake.receive(site, spec, chunks)

    def upload_status(
        self, site: str, session_id: str, round_number: int, fragment: int, *, instance: str = ""
    ) -> UploadProgress:
        with self._cond:
            self.membership.member(site, session_id, instance)
            return self.intake.status(site, round_number, fragment)

    def secure_stage(
        self,
        site: str,
        session_id: str,
        round_number: int,
        stage: str,
        message: StageMessage,
        *,
        wait_s: float,
        instance: str = "",
    ) -> StageReply:
        """One SecureStage call: record the message, wait up to ``wait_s`` for the stage to close."""
        return self.intake.stage(site, session_id, round_number, stage, message, wait_s=wait_s, instance=instance)

    # ---------------------------------------------------------------------------------------
    # AwaitBroadcast

    def wait_broadcast(
        self,
        site: str,
        session_id: str,
        round_number: int,
        *,
        timeout_s: float,
        start_chunk: int = 0,
        check_member: bool = True,
        instance: str = "",
        withheld: str = "",
    ) -> WaitResult:
        """Block until round ``round_number`` is aggregated (then a header) or ``timeout_s``
        passes (then a progress message). Rounds older than the last broadcast get RESYNC.
        ``withheld``: the site sends no update to the round, and why (``intake.withdraw``).
        ``instance`` is checked again after the wait: a process replaced while it waited is
        refused instead of told whether "its" update -- perhaps its successor's -- counted."""
        ctx = self._ctx
        with self._cond:
            if check_member:
                self.membership.member(site, session_id, instance)
            else:
                self.membership.check_session(session_id)
                self.membership.check_instance(site, instance)
            if round_number > ctx.round.number:
                raise WrongRoundError(
                    f"round {round_number} is not open yet; the coordinator is at round {ctx.round.number}"
                )
            if round_number == ctx.round.number and ctx.phase is RoundPhase.FINISHED:
                raise RunFinishedError(
                    f"the run finished after round {round_number - 1}; there is no round "
                    f"{round_number} to wait for"
                )
            if check_member:
                self.intake.withdraw(site, round_number, withheld)
            ended = ctx.round.ended if ctx.round.number == round_number else None
        if ended is not None:
            ended.wait(timeout_s)  # outside the lock, woken once per round (``CoordinatorRound.ended``)
        with self._cond:
            if ctx.closing:
                raise ShuttingDownError("the coordinator is shutting down; retry to reach its successor")
            self.membership.check_instance(site, instance)
            now = self.clock()
            if ctx.round.number != round_number:
                return WaitResult(header=self.phases.header_for(site, round_number, now, start_chunk))
            r = ctx.round
            deadline_at = r.core.deadline_at
            return WaitResult(
                progress=RoundProgress(
                    round=round_number,
                    uploads_complete=len(r.contributed),
                    quorum=ctx.merge_rule.config.min_quorum if ctx.merge_rule is not None else self.policy.min_sites,
                    deadline_remaining_s=0.0 if deadline_at is None else max(0.0, deadline_at - now),
                )
            )

    # ---------------------------------------------------------------------------------------
    # Time-driven transitions

    def next_poll_in(self) -> float:
        """Seconds until ``poll`` has time-driven work (a deadline, a heartbeat check)."""
        with self._cond:
            now = self.clock()
            wait = min(self.config.heartbeat_timeout_s, self.membership.join_grace_s) / 4
            deadline_at = self._ctx.round.core.deadline_at
            merge_rule = self._ctx.merge_rule
            if merge_rule is not None:  # an asynchronous merge's grace window ends on a timer
                deadline_at = merge_rule.close_by(self._ctx.round.core)
            if deadline_at is not None and self._ctx.phase is RoundPhase.RUNNING:
                wait = min(wait, max(0.0, deadline_at - now))
            return max(0.005, wait)

    def wake(self) -> None:
        """Wake the driver and waiting calls (e.g. after an injected clock jumped forward)."""
        with self._cond:
            self._cond.notify_all()

    def wait_for_change(self, timeout_s: float) -> None:
        """Block until some state changes (an upload, a join) or ``timeout_s`` passes."""
        with self._cond:
            self._cond.wait(timeout=timeout_s)

    def poll(self) -> RoundRecord | None:
        """Drop silent sites, start or close the round; aggregate when it closes.

        Returns the round's record when a round was aggregated, else None. Polls are
        serialised so only one aggregation runs at a time.
        """
        with self._poll_lock:
            with self._cond:
                if self._ctx.closing:
                    return None
                now = self.clock()
                self.membership.drop_silent(now)
                self.phases.maybe_start(now)
                if not self.phases.close_if_due(now):
                    return None
            return self.phases.aggregate()

    # ---------------------------------------------------------------------------------------
    # End of the run

    def drained(self) -> bool:
        """Finished, and every site left or ``drain_timeout_s`` passed since the last round."""
        with self._cond:
            if self._ctx.phase is not RoundPhase.FINISHED:
                return False
            if not self._ctx.members:
                return True
            assert self.phases.finished_s is not None
            return self.clock() - self.phases.finished_s >= self.config.drain_timeout_s

    def close(self) -> None:
        """Wake every waiting call with UNAVAILABLE; later polls do nothing. A snapshot being
        written is finished, so a stopped coordinator leaves a short round log."""
        with self._cond:
            self._ctx.close()
            self._cond.notify_all()
        self.intake.shutdown()
        self.wait_for_snapshot()

    def wait_for_snapshot(self) -> None:
        """Return once the checkpoint being written in the background (if any) is on disk: the
        last round's, at the end of a run."""
        self.phases.snapshots.join()

"""Round phases: start a round, close it, aggregate it, checkpoint, and record the broadcast.

Phases of a round::

    WAITING_FOR_QUORUM --(min_sites members)--> RUNNING --(close)--> AGGREGATING --> next round
                                                                                 \\-> FINISHED

The round's lifecycle is the round engine's (``geoloco.algorithms.engine``): it starts and closes
the round by its close policy (the run's ``RoundPolicy``, or the secure aggregation protocol's
stages), and guards and steps it; this module does the coordinator's I/O around it. Aggregation
(outer step, downlink encoding, checkpoint) runs outside
the lock while the phase is AGGREGATING, so heartbeats and waiting sites are served meanwhile.
A checkpoint is written *before* the new weights are broadcast: no site ever holds weights newer
than the newest checkpoint (with ``checkpoint_every = 1``), so after a coordinator restart sites
find their own digest and simply re-send the update they already computed.

Before either, the engine checks the round's mean update and the new weights (``[update_guard]``):
a round whose arithmetic overflowed or went out of bounds, or failed in any other way, is
*aborted* instead of taking the coordinator down: no outer step, the broadcast carries the
unchanged model (``Strategy.no_change``), the outer state is rewound (from the checkpoint of the
unchanged weights when there is one: ``restore_outer``), and the reason is in the round's metrics
(``aborted``) and on the status page. The next round runs as usual.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from geoloco.algorithms.params import ParamLayout, weights_digest
from geoloco.algorithms.record import RoundRecord
from geoloco.algorithms.round import RoundOutcome
from geoloco.algorithms.strategy import RoundPlan, RoundUpdate
from geoloco.coordinator import events as ev
from geoloco.coordinator.broadcast_store import PreparedBroadcast
from geoloco.coordinator.checkpoint import FRESH_HINT, CheckpointError, load_latest_checkpoint, save_checkpoint
from geoloco.coordinator.context import CONTRIBUTOR_HISTORY, RoundContext
from geoloco.coordinator.domain import (
    OPEN_PHASES,
    BroadcastHeader,
    BroadcastRecord,
    CoordinatorRound,
    RoundPhase,
)
from geoloco.coordinator.intake import UploadIntake
from geoloco.coordinator.membership import Membership
from geoloco.coordinator.metrics import plain_record
from geoloco.coordinator.privacy_rounds import PrivateRounds
from geoloco.coordinator.round_log import LoggedRound, RoundLog, SnapshotWriter
from geoloco.protos.errors import InvalidUpdateError
from geoloco.protos.round_phases import site_phases_from_metrics
from geoloco.protos.wire_buffers import num_chunks_for
from geoloco.protos.wire_files import SPILL_MIN_BYTES

__all__ = ["HISTORY_KEY", "PRIVACY_KEY", "STRATEGY_PREFIX", "WEIGHTS_KEY", "EvalFn", "GlobalWeights", "RoundPhases"]

logger = logging.getLogger(__name__)

EvalFn = Callable[[torch.Tensor], float]
"""Held-out loss of flat fp32 global weights (on the CPU)."""

WEIGHTS_KEY = "weights"
"""Name of the global weights in a checkpoint's tensor file."""
STRATEGY_PREFIX = "strategy."
"""Prefix of the outer optimizer / downlink residual tensors in a checkpoint."""
PRIVACY_KEY = "privacy"
"""Checkpoint metadata key of the privacy accountant's state."""
HISTORY_KEY = "history"
"""Checkpoint metadata: recent rounds' contributors and folded late updates, the adaptive
deadline's observations (``RoundPolicy.state()``), and the site processes that another process
of their name replaced (``Membership.state()``)."""
REPLACED_KEY = "replaced"
"""``HISTORY_KEY`` entry of the replaced site processes; absent in checkpoints written before
they were kept (none is refused then)."""
ROUND_RECORD_KEY = "round_record"
"""Checkpoint metadata: the metrics record of the round the checkpoint follows (replayed)."""
BELOW_QUORUM_LOG_S = 30.0
"""A round waiting this long for its quorum is logged (who joined, who did not), then again at
doubling intervals."""
LOGGED_NAMES = 20
"""Site names a log line lists before it says how many more there are."""


@dataclass(slots=True)
class GlobalWeights:
    """``θ_round``: on the run's device, a CPU copy (never modified in place) and its digest."""

    flat: torch.Tensor
    """On the run's device."""
    cpu: torch.Tensor
    digest: str

    @classmethod
    def of(cls, weights: torch.Tensor, digest: str | None = None) -> GlobalWeights:
        """``digest``: the strategy's ``RoundUpdate.digest`` when the weights come from a round,
        so the new global weights are hashed once per round, not once per use."""
        cpu = weights.detach().to("cpu").contiguous()
        return cls(flat=weights, cpu=cpu, digest=digest if digest is not None else weights_digest(cpu))


@dataclass(slots=True)
class _Closed:
    """A round closed to uploads, waiting to be aggregated."""

    round: CoordinatorRound
    closed_s: float
    outcome: RoundOutcome
    partial: list[str]


class RoundPhases:
    """Starts, closes and aggregates the rounds of one session (module doc)."""

    def __init__(
        self,
        ctx: RoundContext,
        intake: UploadIntake,
        membership: Membership,
        *,
        layout: ParamLayout,
        weights: GlobalWeights,
        privacy: PrivateRounds | None,
        eval_fn: EvalFn | None,
    ) -> None:
        self.ctx = ctx
        self.intake = intake
        self.membership = membership
        """Its replaced site processes are part of the durable state (``HISTORY_KEY``)."""
        self.layout = layout
        self.weights = weights
        self.privacy = privacy
        self.eval_fn = eval_fn
        self.broadcast: BroadcastRecord | None = None
        self.spill_min_bytes = SPILL_MIN_BYTES
        """Broadcasts this large or larger are served from a file (``broadcast_store``)."""
        self.finished_s: float | None = None
        self._closed: _Closed | None = None
        self.round_log: RoundLog | None = None
        """Set by ``enable_round_log`` when the run has a ``checkpoint_dir``."""
        self.snapshots = SnapshotWriter()
        self._chain = False
        """A durable snapshot this session wrote or resumed from starts the round log's chain:
        until then a round is made durable by a full checkpoint."""
        self._below_quorum_since: float | None = None
        self._below_quorum_logged_s = 0.0

    # -- start --

    def maybe_start(self, now: float) -> None:
        """Start the open round's clock once ``min_sites`` sites are members (lock held)."""
        ctx = self.ctx
        r = ctx.round
        if ctx.phase is not RoundPhase.WAITING_FOR_QUORUM:
            return
        if not ctx.engine.maybe_start(r.core, now, members=len(ctx.members)):
            self._log_below_quorum(now)
            return
        self._below_quorum_since = None
        ctx.phase = RoundPhase.RUNNING
        self.intake.start_round(now)
        ctx.events.emit(ev.ROUND_STARTED, round=r.number, members=len(ctx.members))
        logger.info(
            "round %d started with %d sites%s", r.number, len(ctx.members),
            "" if r.core.deadline_s is None else
            f", {'adaptive ' if ctx.policy.deadline.is_adaptive else ''}deadline in "
            f"{r.core.deadline_s:.3g} s",
        )

    def _log_below_quorum(self, now: float) -> None:
        """Say who is missing while the round waits for its quorum: after the first
        ``BELOW_QUORUM_LOG_S`` seconds, then at doubling intervals (lock held). An operator
        looking at a silent coordinator otherwise cannot tell a wait from a hang."""
        ctx = self.ctx
        if self._below_quorum_since is None:
            self._below_quorum_since, self._below_quorum_logged_s = now, 0.0
            return
        waited = now - self._below_quorum_since
        if waited < max(BELOW_QUORUM_LOG_S, 2 * self._below_quorum_logged_s):
            return
        self._below_quorum_logged_s = waited
        members = sorted(ctx.members)
        allowed = ctx.config.allowed_sites
        missing = "" if allowed is None else f"; not joined: {_some(sorted(set(allowed) - set(members)))}"
        logger.warning(
            "round %d waits for its quorum: %d of min_sites = %d sites joined (%s)%s; waiting for %.0f s",
            ctx.round.number, len(members), ctx.policy.min_sites, _some(members), missing, waited,
        )

    def finish_run(self, now: float) -> None:
        self.ctx.phase = RoundPhase.FINISHED
        self.finished_s = now

    # -- close --

    def close_if_due(self, now: float) -> bool:
        """Close the open round if the intake says so, and say whether a closed round is ready
        to aggregate (lock held)."""
        ctx = self.ctx
        if self._closed is None:
            if ctx.phase not in OPEN_PHASES:
                return False
            r = ctx.round
            if ctx.merge_rule is not None:
                ctx.merge_rule.sites_up = len(ctx.members)
            if not ctx.engine.decide(r.core, now=now, expected=ctx.expected()).close:
                return False
            ctx.phase = RoundPhase.AGGREGATING
            if ctx.merge_rule is not None:
                ctx.merge_rule.closed(r.core)
            self._closed = _Closed(
                round=r,
                closed_s=now,
                outcome=ctx.engine.close(r.core, now=now, expected=ctx.expected()),
                partial=sorted(set(r.uploads) - set(r.contributed)),
            )
            ctx.cond.notify_all()
            self.intake.begin_close(now)
        return self.intake.ready(now)

    # -- aggregate --

    def aggregate(self) -> RoundRecord:
        """Aggregate the closed round (outside the lock; ``close_if_due`` said it is ready):
        outer step, downlink, checkpoint, then install the new weights and open the next round.
        Returns the round's record."""
        # Memory: the aggregation buffer and the encoded downlink are released as soon as they
        # are used (no caller frame holds them), so neither is alive while the checkpoint is
        # written. The weights and the aggregation cannot change meanwhile: the phase is
        # AGGREGATING (uploads are refused) and the state machine's poll lock is held.
        ctx = self.ctx
        assert self._closed is not None
        closed, self._closed = self._closed, None
        r, outcome = closed.round, closed.outcome
        timings = r.timings
        contributors = list(outcome.contributors)
        refused = frozenset(outcome.rejected) - r.left_out
        # The previous round's snapshot reads the live weights and outer state the step changes.
        # Its wait is the checkpoint's time, not the outer step's: t0 starts after it, or a slow
        # disk would be counted twice and the phases would sum to more than the round's wall.
        waited = time.perf_counter()  # also where the aggregation starts (aggregate_time_s)
        self.snapshots.join()
        timings.record("checkpoint", time.perf_counter() - waited)
        t0 = time.perf_counter()
        plan = ctx.strategy.configure_round(r.number, contributors)
        fragment_outer = ctx.strategy.fragments[plan.fragment]
        fragment_outer.last_step_s = {}
        stepped = ctx.engine.step(r.core, self.weights.flat, plan, contributors, self.intake.aggregate)
        result = stepped.result
        aborted = stepped.aborted
        update, contributors, update_norm, privacy_record = (
            result.update, result.contributors, result.update_norm, result.privacy
        )
        del result
        serialised = time.perf_counter()
        # The broadcast's manifest checksum, hashed beside the round log's commit (hashlib
        # releases the GIL) instead of by the first AwaitBroadcast after the round; a large
        # delta then moves to a file while it is served (``geoloco.coordinator.broadcast_store``).
        prepared = PreparedBroadcast(
            update.downlink, directory=ctx.config.checkpoint_dir, spill_min_bytes=self.spill_min_bytes
        )
        delta_size = prepared.nbytes
        downlink_s = fragment_outer.last_step_s.get("downlink_encode", 0.0) + time.perf_counter() - serialised
        timings.record("downlink_encode", downlink_s)
        timings.record("outer_step", time.perf_counter() - t0 - downlink_s)
        codec, shape = update.downlink.spec, tuple(update.downlink.shape)
        new_weights, new_digest = update.global_flat, update.digest
        del update
        next_round = r.number + 1
        finished = bool(ctx.config.total_rounds) and next_round >= ctx.config.total_rounds
        if privacy_record.get("budget_exhausted") and not finished:
            logger.info(
                "stopping after round %d: one more round would push epsilon above the budget %g",
                r.number, ctx.config.privacy.epsilon_budget,
            )
            finished = True
        site_metrics = {site: m for site, m in r.site_metrics.items() if site in contributors}
        losses = [m["train_loss"] for m in site_metrics.values() if math.isfinite(m.get("train_loss", math.nan))]
        with ctx.cond:
            totals = {"bytes_up_total": ctx.bytes_up_total, "bytes_down_total": ctx.bytes_down_total}
        round_record = RoundRecord.closed(
            outcome, stepped,
            session_id=ctx.session_id,
            # None without streaming, as the simulator's records have it.
            fragment=ctx.fragment_of(r.number) if ctx.config.algorithm.streaming.enabled else None,
            departed=sorted(r.departed),
            partial_uploads=closed.partial,
            bytes_up=dict(r.bytes_up),
            bytes_down=dict(r.bytes_down),
            downlink_bytes=delta_size,
            round_time_s=closed.closed_s - r.core.opened_s,
            wait_for_quorum_s=None if r.core.started_s is None else r.core.started_s - r.core.opened_s,
            next_deadline_s=ctx.policy.deadline_s(),
            inner_steps={site: r.inner_steps[site] for site in contributors if site in r.inner_steps},
            train_loss=sum(losses) / len(losses) if losses else None,
            staleness=(
                {site: r.staleness.get(site, 0) for site in contributors} if ctx.merge_rule is not None else None
            ),
            site_metrics=site_metrics,
            run_finished=finished,
            replayed=False,
            privacy=privacy_record or None,
            epsilon=privacy_record.get("epsilon"),
            privacy_delta=privacy_record.get("delta") if "epsilon" in privacy_record else None,
            **totals,
        )
        del stepped
        snapshot: dict[str, Any] | None = None
        if ctx.config.checkpoint_dir is not None:
            # The round's record goes into its durable state, so a restart replays it when the
            # process dies before writing it (members and totals as of now; eval recomputed).
            with ctx.cond:
                replay = dataclasses.replace(round_record, members=sorted(ctx.members), replayed=True)
            checkpoint_start = time.perf_counter()
            snapshot = self.make_durable(
                r.number, plan.fragment, contributors, new_weights, new_digest,
                frozenset(outcome.folded), refused, replay, sync=aborted is not None,
                snapshot_due=finished or next_round % ctx.config.checkpoint_every == 0,
            )
            timings.record("checkpoint", time.perf_counter() - checkpoint_start)
        broadcast_start = time.perf_counter()
        served, delta_sha256 = prepared.result()
        record = BroadcastRecord(
            round=r.number,
            data=served,
            codec=codec,
            shape=shape,
            chunk_size=ctx.config.chunk_size,
            weights_digest=new_digest,
            contributors=frozenset(contributors),
            run_finished=finished,
            data_sha256=delta_sha256,
        )
        with ctx.cond:
            self.weights = GlobalWeights.of(new_weights, new_digest)
            self.broadcast = record
            ctx.contributor_history[r.number] = record.contributors
            ctx.contributor_history.pop(r.number - CONTRIBUTOR_HISTORY, None)
            ctx.refused_history[r.number] = refused
            ctx.refused_history.pop(r.number - CONTRIBUTOR_HISTORY, None)
            ctx.folded_history[r.number - 1] = frozenset(outcome.folded)
            ctx.folded_history.pop(r.number - 1 - CONTRIBUTOR_HISTORY, None)
            now = ctx.clock()
            ctx.round = ctx.new_round(next_round, now)
            if finished:
                self.finish_run(now)
            else:
                ctx.phase = RoundPhase.WAITING_FOR_QUORUM
                self.maybe_start(now)
                self.intake.next_round(r, now)
            members = sorted(ctx.members)
            bytes_up_total, bytes_down_total = ctx.bytes_up_total, ctx.bytes_down_total
            ctx.cond.notify_all()
        published = time.perf_counter()
        timings.record("broadcast", published - broadcast_start)
        timings.published(time.monotonic())
        if snapshot is not None:
            self.start_snapshot(next_round, snapshot)
        logger.info(
            "round %d aggregated: %d sites (%s)%s%s, |update| %.4g, delta %d bytes, deadline %s",
            r.number, len(contributors), ", ".join(contributors),
            f", excluded {', '.join(outcome.excluded)}" if outcome.excluded else "",
            f", folded late {', '.join(outcome.folded)}" if outcome.folded else "",
            update_norm, delta_size,
            "none" if outcome.deadline_s is None else f"{outcome.deadline_s:.3g} s",
        )
        eval_loss = None
        if self.eval_fn is not None and (finished or next_round % ctx.config.eval_every == 0):
            try:
                eval_loss = float(self.eval_fn(self.weights.cpu))
            except Exception:
                # A broken evaluation must not stop the training of every site.
                logger.exception("eval_fn failed after round %d; training continues", r.number)
        round_record = dataclasses.replace(
            round_record, members=members, bytes_up_total=bytes_up_total, bytes_down_total=bytes_down_total,
            eval_loss=eval_loss, phases_s=timings.table(), round_wall_s=timings.wall_s(),
            aggregate_time_s=published - waited,
            site_phases_s={site: site_phases_from_metrics(m) for site, m in site_metrics.items()},
        )
        ctx.events.emit(ev.ROUND_AGGREGATED, round=r.number, data=round_record.to_dict())
        return round_record

    def restore_outer(self, weights: torch.Tensor) -> str | None:
        """The engine's rewind after an aborted step: the outer optimizer's state (momentum,
        downlink residual) of the newest checkpoint, when that checkpoint holds ``weights`` (the
        unchanged weights); None when none does (the engine then resets the state)."""
        config = self.ctx.config
        checkpoint = None if config.checkpoint_dir is None else load_latest_checkpoint(config.checkpoint_dir)
        if checkpoint is None:
            return None
        device = weights.device
        self.ctx.strategy.load_state(
            {
                k.removeprefix(STRATEGY_PREFIX): v.to(device)
                for k, v in checkpoint.tensors.items()
                if k.startswith(STRATEGY_PREFIX)
            },
            checkpoint.metadata["strategy"],
        )
        digest = checkpoint.metadata.get("weights_digest")
        if digest == self.weights.digest:
            return "; the outer optimizer state is restored from the checkpoint of these weights"
        # The rounds since that checkpoint are in the round log: redo them to these weights.
        flat = checkpoint.tensors[WEIGHTS_KEY].to(device, torch.float32)
        replayed = 0
        for entry in [] if self.round_log is None else self.round_log.entries(checkpoint.round):
            update = self._redo(flat, entry)
            flat, digest, replayed = update.global_flat, update.digest, replayed + 1
            if digest == self.weights.digest:
                return (
                    f"; the outer optimizer state is restored from the checkpoint of round "
                    f"{checkpoint.round} and {replayed} logged round(s) after it"
                )
        return None  # the state loaded above is not these weights': the engine resets it

    def _redo(self, flat: torch.Tensor, entry: LoggedRound) -> RoundUpdate:
        """A logged round's outer step again, on ``flat`` and the strategy's current state
        (which it advances), without logging it a second time."""
        strategy = self.ctx.strategy
        plan = strategy.configure_round(entry.round, list(entry.sites))
        if plan.fragment != entry.fragment:
            raise CheckpointError(
                f"round {entry.round} was logged for fragment {entry.fragment}, these settings give "
                f"fragment {plan.fragment}; resume with the run's [algorithm] settings, {FRESH_HINT}"
            )
        observer, strategy.on_mean = strategy.on_mean, None
        try:
            return strategy.apply_mean_update(flat, entry.read_mean(), entry.sites, plan, consume_mean=True)
        finally:
            strategy.on_mean = observer

    # -- broadcast --

    def was_folded(self, site: str, round_number: int) -> bool:
        """Whether ``site``'s update of ``round_number`` entered the next round (late)."""
        ctx = self.ctx
        if site in ctx.folded_history.get(round_number, frozenset()):
            return True
        return round_number + 1 == ctx.round.number and site in ctx.round.folded

    def header_for(self, site: str, round_number: int, now: float, start_chunk: int) -> BroadcastHeader:
        """What a site waiting for round ``round_number`` gets once it closed: the delta, or
        for an older round a resync to the current weights (lock held)."""
        ctx = self.ctx
        record = self.broadcast
        next_round = ctx.round_info(now, site)
        if record is not None and record.round == round_number:
            num_chunks = num_chunks_for(len(record.data), record.chunk_size)
            if start_chunk > num_chunks:
                raise InvalidUpdateError(f"start_chunk {start_chunk} is past the delta's {num_chunks} chunks")
            return BroadcastHeader(
                round=round_number,
                included=site in record.contributors or self.was_folded(site, round_number),
                refused=site in ctx.refused_history.get(round_number, frozenset()),
                num_contributors=len(record.contributors),
                next_round=next_round,
                run_finished=record.run_finished,
                weights_digest=record.weights_digest,
                record=record,
                start_chunk=start_chunk,
            )
        contributors = ctx.contributor_history.get(round_number, frozenset())
        return BroadcastHeader(
            round=round_number,
            included=site in contributors or self.was_folded(site, round_number),
            refused=site in ctx.refused_history.get(round_number, frozenset()),
            num_contributors=len(contributors),
            next_round=next_round,
            run_finished=ctx.phase is RoundPhase.FINISHED,
            weights_digest=self.weights.digest,
        )

    # -- checkpoints --

    def restore(self, tensors: dict[str, torch.Tensor], metadata: dict[str, Any], round_number: int) -> torch.Tensor:
        """Load a checkpoint's strategy, privacy and round history; returns its weights."""
        ctx = self.ctx
        config = ctx.config
        if WEIGHTS_KEY not in tensors:
            raise ValueError(f"checkpoint in {config.checkpoint_dir} holds no {WEIGHTS_KEY!r} tensor")
        weights = tensors[WEIGHTS_KEY]
        if weights.dim() != 1 or weights.numel() != self.layout.numel:
            raise ValueError(
                f"checkpoint in {config.checkpoint_dir} holds {weights.numel()} weights but the "
                f"model has {self.layout.numel}; point checkpoint_dir at this model's run or delete it"
            )
        saved = metadata.get("config", {}).get("algorithm")
        if saved is not None and saved != config.algorithm.to_dict():
            logger.warning(
                "checkpoint was written with algorithm settings %s; resuming with %s",
                saved, config.algorithm.to_dict(),
            )
        device = self.weights.flat.device
        strategy_tensors = {
            k.removeprefix(STRATEGY_PREFIX): v.to(device)
            for k, v in tensors.items()
            if k.startswith(STRATEGY_PREFIX)
        }
        ctx.strategy.load_state(strategy_tensors, metadata["strategy"])
        self.restore_state(metadata)
        self._chain = self.round_log is not None  # this checkpoint starts the log's chain
        logger.info("resumed from checkpoint in %s at round %d", config.checkpoint_dir, round_number)
        return weights.to(device, torch.float32).contiguous()

    def restore_state(self, metadata: dict[str, Any]) -> None:
        """The session's state besides tensors (privacy accounting, round history, deadline and
        guard observations, replaced site processes) from a checkpoint's or round-log entry's
        metadata."""
        ctx = self.ctx
        if self.privacy is not None:
            self.privacy.load_state(metadata.get(PRIVACY_KEY, {}))
        history = metadata.get(HISTORY_KEY, {})
        ctx.contributor_history = {
            int(t): frozenset(sites) for t, sites in history.get("contributors", {}).items()
        }
        ctx.folded_history = {int(t): frozenset(sites) for t, sites in history.get("folded", {}).items()}
        ctx.refused_history = {int(t): frozenset(sites) for t, sites in history.get("refused", {}).items()}
        ctx.policy.load_state(history.get("deadline", []))
        if ctx.engine.guard is not None:
            ctx.engine.guard.load_state(history.get("update_norms", []))
        self.membership.load_state(history.get(REPLACED_KEY, []))
        ctx.merged_updates = {
            site: (int(base), (int(algorithm), str(digest_hex)), int(merge))
            for site, (base, algorithm, digest_hex, merge) in history.get("merged", {}).items()
        }

    def enable_round_log(self) -> None:
        """Make rounds durable through the round log (``geoloco.coordinator.round_log``): the
        strategy hands each round's mean to it before the outer step."""
        config = self.ctx.config
        assert config.checkpoint_dir is not None
        log = self.round_log = RoundLog(config.checkpoint_dir)

        def observe(plan: RoundPlan, mean: torch.Tensor) -> None:
            if self._chain:  # else a full checkpoint makes the round durable: nothing to log
                log.observe(plan.round, mean)

        self.ctx.strategy.on_mean = observe

    def make_durable(
        self,
        round_number: int,
        fragment: int,
        contributors: list[str],
        weights: torch.Tensor,
        digest: str,
        folded: frozenset[str],
        refused: frozenset[str],
        record: RoundRecord,
        *,
        sync: bool,
        snapshot_due: bool,
    ) -> dict[str, Any] | None:
        """Make the state after round ``round_number`` durable before its broadcast: by the
        round log when the round's mean was logged and a snapshot starts the chain, else by a
        full checkpoint now (a new run's first round, ``sync``: an aborted round, whose
        rewound outer state the log cannot replay). Returns the snapshot to write in the
        background once the broadcast is out when ``snapshot_due``, else None."""
        ctx = self.ctx
        config = ctx.config
        assert config.checkpoint_dir is not None
        next_round = round_number + 1
        metadata = self._durable_metadata(
            digest, frozenset(contributors), folded, refused, last=round_number, record=record
        )
        log = self.round_log
        if log is not None and not sync and self._chain and log.observed == round_number:
            log.commit(
                round_number, fragment=fragment, sites=tuple(contributors), weights_digest=digest, metadata=metadata
            )
            ctx.events.emit(ev.CHECKPOINT_SAVED, round=next_round, data={"kind": "log"})
            return metadata if snapshot_due else None
        if log is not None:
            log.discard()
        save_checkpoint(config.checkpoint_dir, next_round, self._durable_tensors(weights), metadata,
                        keep=config.checkpoint_keep)
        if log is not None:
            log.compact(next_round)
        self._chain = log is not None
        ctx.events.emit(ev.CHECKPOINT_SAVED, round=next_round, data={"kind": "snapshot"})
        return None

    def start_snapshot(self, round_number: int, metadata: dict[str, Any]) -> None:
        """Write the full checkpoint of ``round_number`` (the installed weights and outer state)
        in the background; the round log's older entries go once it is durable."""
        config = self.ctx.config
        assert config.checkpoint_dir is not None and self.round_log is not None
        log = self.round_log
        self.snapshots.start(
            config.checkpoint_dir, round_number, self._durable_tensors(self.weights.cpu), metadata,
            keep=config.checkpoint_keep, on_durable=log.compact,
        )

    def replay_logged(self, entry: LoggedRound) -> None:
        """Redo a logged round's outer step on the restored state (resume); its weights must
        have the digest the entry recorded, or the log does not belong to these settings."""
        update = self._redo(self.weights.flat, entry)
        if update.digest != entry.weights_digest:
            raise CheckpointError(
                f"replaying logged round {entry.round} ({entry.mean_path}) gives weights "
                f"{update.digest[:16]}..., not the {entry.weights_digest[:16]}... it was broadcast "
                f"with: the algorithm settings changed since, or the log is damaged; resume with the "
                f"run's settings, {FRESH_HINT}"
            )
        self.weights = GlobalWeights.of(update.global_flat, update.digest)
        self._chain = True

    def _durable_tensors(self, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        tensors = {WEIGHTS_KEY: weights}
        tensors.update({STRATEGY_PREFIX + k: v for k, v in self.ctx.strategy.state_tensors().items()})
        return tensors

    def _durable_metadata(
        self,
        digest: str,
        contributors: frozenset[str],
        folded: frozenset[str],
        refused: frozenset[str],
        *,
        last: int,
        record: RoundRecord | None,
    ) -> dict[str, Any]:
        """What a checkpoint (or round-log entry) of round ``last + 1`` holds besides tensors,
        as plain JSON values: a snapshot written later must not see the next round's changes.
        ``contributors``/``folded``/``refused``: of round ``last``, just aggregated (the history
        does not hold it yet). The history lets a restarted coordinator still tell a site whether its
        update counted, so it neither loses nor resends it, and whether it was refused, so it
        drops it."""
        ctx = self.ctx
        with ctx.cond:  # joins go on while a round is made durable outside the lock
            replaced = self.membership.state()
        history = {
            "contributors": {
                str(t): sorted(sites) for t, sites in {**ctx.contributor_history, last: contributors}.items()
                if t > last - CONTRIBUTOR_HISTORY
            },
            "folded": {
                str(t): sorted(sites) for t, sites in {**ctx.folded_history, last - 1: folded}.items()
                if t > last - 1 - CONTRIBUTOR_HISTORY and sites
            },
            "refused": {
                str(t): sorted(sites) for t, sites in {**ctx.refused_history, last: refused}.items()
                if t > last - CONTRIBUTOR_HISTORY and sites
            },
            "deadline": ctx.policy.state(),
            "update_norms": [] if ctx.engine.guard is None else ctx.engine.guard.state(),
            REPLACED_KEY: replaced,
        }
        if ctx.merge_rule is not None:
            with ctx.cond:
                history["merged"] = {
                    site: [base, algorithm, digest_hex, merge]
                    for site, (base, (algorithm, digest_hex), merge) in ctx.merged_updates.items()
                }
        metadata: dict[str, Any] = {
            "config": ctx.config.to_dict(),
            "strategy": ctx.strategy.state_meta(),
            "layout": self.layout.to_dict(),
            "weights_digest": digest,
            "session_id": ctx.session_id,
            HISTORY_KEY: history,
        }
        if self.privacy is not None:
            metadata[PRIVACY_KEY] = self.privacy.state()
        if record is not None:
            metadata[ROUND_RECORD_KEY] = plain_record(record.to_dict())
        frozen: dict[str, Any] = json.loads(json.dumps(metadata))
        return frozen


def _some(names: list[str], most: int = LOGGED_NAMES) -> str:
    """``names`` for a log line, the first ``most`` of them and how many more: with a thousand
    sites a line that names them all is unreadable (the status page lists them all)."""
    if not names:
        return "none"
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown} and {len(names) - most} more"

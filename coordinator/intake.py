"""Upload intake: how updates get into the open round, plain or masked, behind one interface.

``UploadIntake`` is what ``RoundStateMachine`` calls; two implementations:

* ``PlainIntake``: every complete upload is verified (checksum, codec, shape, dtype, finite
  values, norm and weight within ``[update_guard]``) and added to the round's single aggregation
  buffer at once. Non-finite values or an absurd norm reject the site's update for the round
  (INVALID_ARGUMENT, the reason in the round's metrics) without touching the buffer. With
  ``late_updates = "fold"`` an update one round late is folded into the open round with the
  round policy's staleness discount. The round closes by the round policy.
* ``SecureIntake`` (``geoloco.coordinator.secure_intake``): masked chunks go straight into the
  secure-aggregation protocol's sum; the protocol decides when uploads close and the round
  waits for the survivors to unmask the sum before it is aggregated.

Chunks arrive as ``(chunk, nbytes)`` pairs (``chunk.index``, ``chunk.data``); no protobuf here.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from geoloco.algorithms.aggregation import Aggregation, RunningSum
from geoloco.algorithms.algorithm_config import AlgorithmConfig
from geoloco.algorithms.async_merge import stale_admission
from geoloco.algorithms.engine import UNSCREENED, RoundSum, Screen
from geoloco.algorithms.finite import withheld_reason
from geoloco.algorithms.privacy.secagg_stages import StageMessage, StageReply
from geoloco.algorithms.strategy import RoundPlan
from geoloco.algorithms.weighting import check_inner_steps, most_inner_steps, site_weight
from geoloco.compression import Encoded
from geoloco.coordinator import events as ev
from geoloco.coordinator.context import RoundContext
from geoloco.coordinator.domain import OPEN_PHASES, CoordinatorRound, RoundPhase, UploadProgress, UploadSpec
from geoloco.coordinator.errors import ShuttingDownError, rejection_message
from geoloco.coordinator.membership import Membership
from geoloco.coordinator.privacy_rounds import PrivateRounds
from geoloco.coordinator.round_timing import RoundTimings
from geoloco.coordinator.shards import ShardedUploads
from geoloco.protos.errors import (
    InvalidUpdateError,
    NotAMemberError,
    StatusError,
    UpdateRejectedError,
    WrongRoundError,
    quoted,
)
from geoloco.protos.upload_check import check_metrics, checked_update
from geoloco.protos.wire_assembly import UploadAssembler
from geoloco.protos.wire_buffers import MAX_CHUNK_SIZE, ManifestTooLargeError
from geoloco.protos.wire_files import BlobSpill

__all__ = [
    "Chunks",
    "PlainIntake",
    "PlainUpload",
    "UploadIntake",
    "run_most_inner_steps",
]

logger = logging.getLogger(__name__)

Chunks = Iterable[tuple[Any, int]]
"""An Upload stream's chunks after its manifest: (chunk with ``.index``/``.data``, message bytes)."""

def run_most_inner_steps(algorithm: AlgorithmConfig) -> int | None:
    """The most inner steps an update of this run may report (``weighting.most_inner_steps``);
    None: no bound (an asynchronous site whose uploader was busy sends one update covering
    several phases, ``geoloco.site_agent.async_rounds``; the update guard bounds its weight)."""
    if algorithm.asynchronous.enabled:
        return None
    return most_inner_steps(
        algorithm.inner_steps, round_time_budget_s=algorithm.round_time_budget_s,
        interval_steps_max=algorithm.streaming.interval_steps_max if algorithm.streaming.enabled else 0,
    )


def _discarded(site: str, round_number: int) -> NotAMemberError:
    return NotAMemberError(
        f"site {site!r}'s upload for round {round_number} was discarded (the site was dropped, "
        "or a newer upload replaced it); call Join again"
    )


class PlainUpload(UploadAssembler):
    """One site's upload for one round: the wire-level chunk buffer, kept across streams, and
    the spec it was opened with (what the intake reads; the buffer keeps the wire manifest)."""

    def __init__(
        self, spec: UploadSpec, *, max_total_bytes: int, timings: RoundTimings, spill: BlobSpill | None = None
    ) -> None:
        """``spill``: where a big upload arrives (a ``FileBuffer``), None to keep it in memory."""
        out = None if spill is None else spill.buffer(spec.total_bytes)
        super().__init__(spec.wire, max_total_bytes=max_total_bytes, max_chunk_size=MAX_CHUNK_SIZE, out=out)
        self.spec = spec
        self.timings = timings
        """The phase times of the round the upload arrives in (a late one's: the open round)."""
        self.base_round = spec.round
        """The version the update was computed from: its own round, except in an asynchronous
        merge (``spec.round`` is then the merge it was opened in)."""
        self.link_sample: tuple[int, float] | None = None
        """(bytes, seconds) of the one stream that brought the whole upload: a measurement of the
        site's uplink for adaptive codecs, taken only once the update is verified and admitted
        (junk that is refused must not tell the coordinator how fast a link is)."""


def _progress(
    assembler: PlainUpload, *, complete: bool | None = None, folded: bool = False, merged_round: int | None = None
) -> UploadProgress:
    return UploadProgress(
        complete=assembler.verified if complete is None else complete,
        folded_late=folded,
        merged_round=merged_round,
        received=tuple(assembler.received()),
        missing=tuple(assembler.missing()),
        received_bytes=assembler.received_bytes,
        manifest=assembler.spec.wire,
    )


@dataclass(slots=True)
class HeldUpdate:
    """An asynchronous site's verified update, held for the next merge (``_open_held``)."""

    assembler: PlainUpload
    decoded: Encoded | torch.Tensor
    screen: Screen


class UploadIntake(Protocol):
    """Uploads into the open round, and when that round may close."""

    secure: bool

    def receive(self, site: str, spec: UploadSpec, chunks: Chunks) -> UploadProgress:
        """One Upload stream (membership checked inside)."""
        ...

    def status(self, site: str, round_number: int, fragment: int) -> UploadProgress:
        """UploadStatus; called with the lock held, membership checked."""
        ...

    def start_round(self, now: float) -> None:
        """The open round's quorum is there and its clock started (lock held)."""
        ...

    def begin_close(self, now: float) -> None:
        """The round closed to uploads (lock held)."""
        ...

    def ready(self, now: float) -> bool:
        """The closed round's sum can be aggregated (lock held)."""
        ...

    def aggregate(
        self, global_flat: torch.Tensor, aggregation: Aggregation, plan: RoundPlan, contributors: list[str]
    ) -> RoundSum:
        """The closed round's outer step (outside the lock; the round is frozen)."""
        ...

    def stage(
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
        """One SecureStage call of the process ``instance`` (refused without secure aggregation)."""
        ...

    def withdraw(self, site: str, round_number: int, withheld: str = "") -> None:
        """``site`` waits for round ``round_number``'s broadcast (lock held); ``withheld``: it
        said it sends no update to that round, and why (``AwaitBroadcastRequest.withheld``)."""
        ...

    def next_round(self, previous: CoordinatorRound, now: float) -> None:
        """The round after ``previous`` just opened (lock held)."""
        ...

    def shutdown(self) -> None:
        ...


class PlainIntake:
    """Verified, decoded updates into the round's aggregation buffer (module doc)."""

    secure = False

    def __init__(
        self,
        ctx: RoundContext,
        membership: Membership,
        *,
        uplink_codec: str,
        numel: int,
        max_upload_bytes: int,
        device: torch.device,
        privacy: PrivateRounds | None,
        shapes: Iterable[tuple[int, ...]] = (),
    ) -> None:
        self.ctx = ctx
        self.uplink_codec = uplink_codec
        self.numel = numel
        self.max_upload_bytes = max_upload_bytes
        self.spill = BlobSpill(ctx.config.checkpoint_dir)
        """Where big uploads arrive (``BlobSpill``)."""
        self.device = device
        self.privacy = privacy
        """Central DP without secure aggregation: the trusted coordinator clips each update."""
        self.membership = membership
        self.verify_lock = threading.Lock()
        self.verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="geoloco-verify")
        self.shards = ShardedUploads(self, list(shapes))
        """Sharded sites' uploads (``shard_count > 0``), held until all of a site's arrived."""

    # -- the interface --

    def receive(self, site: str, spec: UploadSpec, chunks: Chunks) -> UploadProgress:
        if spec.shard_count:
            if self.ctx.merge_rule is not None:
                raise InvalidUpdateError(
                    "asynchronous merges take whole updates; a sharded site's shards belong to one "
                    "round (run the site unsharded, or disable [algorithm.asynchronous])"
                )
            return self.shards.receive(site, spec, chunks)
        if self.ctx.merge_rule is not None:
            merged = self._merged_before(site, spec)
            if merged is not None:
                return merged
        started = time.monotonic()
        assembler = self.open(site, spec)
        whole_stream = assembler.received_count == 0
        assembler.timings.upload_started(started)
        assembler.consume(self.live_chunks(site, assembler, chunks, instance=spec.instance_id))
        # Adaptive uplink codecs: only a stream that brought the whole upload measured the link;
        # any other stream's end clears what an earlier one (refused, reset) left.
        assembler.link_sample = None
        if assembler.complete:
            received = time.monotonic()
            assembler.timings.upload_received(received)
            if whole_stream:
                assembler.link_sample = (spec.total_bytes, received - started)
        return self.finish(site, assembler, instance=spec.instance_id)

    def status(self, site: str, round_number: int, fragment: int) -> UploadProgress:
        ctx = self.ctx
        r = ctx.round
        if ctx.merge_rule is not None:
            return self._status_async(site, round_number)
        assembler = (
            r.uploads.get(site)
            if round_number == r.number and fragment == ctx.fragment_of(round_number)
            else None
        )
        late = round_number + 1 == r.number and fragment == ctx.fragment_of(round_number)
        if late and site in r.stale_uploads:
            complete = site in r.folded
            return _progress(r.stale_uploads[site], complete=complete, folded=complete)
        if assembler is None:
            if round_number < r.number or ctx.phase is RoundPhase.FINISHED:
                ctx.check_upload_round(round_number)
            return UploadProgress(known=False)
        return _progress(assembler, complete=site in r.contributed)

    def start_round(self, now: float) -> None:
        """Nothing to set up: plain uploads need no per-round protocol state."""

    def begin_close(self, now: float) -> None:
        """Nothing to finish: the sum is complete the moment the round closes."""

    def ready(self, now: float) -> bool:
        return True

    def aggregate(
        self, global_flat: torch.Tensor, aggregation: Aggregation, plan: RoundPlan, contributors: list[str]
    ) -> RoundSum:
        strategy = self.ctx.strategy
        if self.privacy is not None:  # central DP: noise on the sum of the clipped updates
            return RoundSum(*self.privacy.finish_round(strategy, global_flat, aggregation, plan, contributors))
        update = strategy.aggregate_round(global_flat, aggregation, plan)
        return RoundSum(update, contributors, update.mean_norm)

    def stage(
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
        raise InvalidUpdateError(
            "secure aggregation is off in this run ([privacy] secure_aggregation = false); "
            "upload plain updates"
        )

    def withdraw(self, site: str, round_number: int, withheld: str = "") -> None:
        """A site that said it sends no update to the open round (its pseudo-gradient had
        NaN/Inf values) is rejected from it with its reason, so the round does not wait for it
        (with ``min_sites`` = every site it would wait until the deadline, or for ever without
        one); one whose update already counted stays counted. A site that only waits (it
        uploads after opening the wait) is waited for."""
        ctx = self.ctx
        r = ctx.round
        if not withheld or round_number != r.number or ctx.phase not in OPEN_PHASES:
            return
        if site in r.core.contributed or site in r.core.rejected:
            return
        why = withheld_reason(withheld)
        r.core.reject(site, why)
        self.rejected(site, round_number, why)
        logger.warning("site %s: %s (round %d)", site, why, round_number)

    def shutdown(self) -> None:
        self.verifier.shutdown(wait=False)

    # -- opening an upload --

    def validate(self, site: str, spec: UploadSpec, *, computed_from: int | None = None) -> None:
        """Refuse what the manifest alone shows is wrong. ``computed_from``: an asynchronous
        update's base version; its weight is held to the other sites' as it will enter the merge,
        discounted by its staleness (as the merge admits it and the simulator screens it)."""
        ctx = self.ctx
        if spec.site and spec.site != site:
            raise InvalidUpdateError(
                f"upload manifest names site {quoted(spec.site)} but the caller is {site!r}"
            )
        fragment = ctx.fragment_of(spec.round)
        if spec.fragment != fragment:
            raise InvalidUpdateError(
                f"upload for round {spec.round} names fragment {spec.fragment}; that round "
                f"synchronises fragment {fragment} (fragment = round mod fragments)"
            )
        try:
            numel = ctx.strategy.upload_numel(spec.round, site)  # partial updates: the site's group's
        except ValueError as err:
            raise InvalidUpdateError(str(err)) from None
        codec = ctx.uplink_codec_for(site, spec.round)
        if spec.codec != codec:
            raise InvalidUpdateError(
                f"upload codec {quoted(spec.codec)} is not {site!r}'s uplink codec {codec!r} for round "
                f"{spec.round}; encode with RoundInfo.uplink_codec (empty: RunConfig.uplink_codec)"
            )
        if spec.dtype != "float32":
            raise InvalidUpdateError(
                f"upload dtype {quoted(spec.dtype)} is not allowed; pseudo-gradients are 'float32'"
            )
        if list(spec.shape) != [numel]:
            what = (
                "" if numel == self.numel
                else " of this site's partial-updates group" if ctx.strategy.partial is not None
                else f" of fragment {fragment}"
            )
            raise InvalidUpdateError(
                f"upload shape {quoted(list(spec.shape))} does not match the model: expected "
                f"[{numel}] (the flat parameter vector{what})"
            )
        if ctx.config.algorithm.weighting == "steps" and spec.inner_steps < 1:
            raise InvalidUpdateError(
                "this run weights updates by inner steps (weighting = 'steps'); the manifest must "
                f"carry inner_steps >= 1, got {spec.inner_steps}"
            )
        weight = spec.sample_weight
        if not (math.isfinite(weight) and weight > 0):
            raise InvalidUpdateError(
                f"sample_weight {weight} is not allowed; send the samples (or tokens) trained on "
                "this round, a finite number > 0"
            )
        mean_weight = self.upload_weight(spec)
        if computed_from is not None:
            mean_weight = stale_admission(
                ctx.config.algorithm.asynchronous, base=computed_from, into=spec.round, weight=mean_weight
            ).weight
        why = check_inner_steps(int(spec.inner_steps), run_most_inner_steps(ctx.config.algorithm))
        if why is None:
            why = ctx.engine.screen(
                UNSCREENED,
                weights=[
                    ("sample_weight", weight),
                    (f"the update's weight under weighting {ctx.config.algorithm.weighting!r}", mean_weight),
                ],
                site=site,
                weight=mean_weight,
            )
        if why is not None:
            if spec.round == ctx.round.number and ctx.phase in OPEN_PHASES:
                # Refused like any other update of the open round: not waited for, in the record.
                ctx.round.core.reject(site, why)
                self.rejected(site, spec.round, why)
            raise InvalidUpdateError(f"upload refused: {why}")
        check_metrics(spec.metrics)
        if spec.total_bytes > self.max_upload_bytes:
            raise ManifestTooLargeError(
                f"upload announces {spec.total_bytes} bytes, more than the {self.max_upload_bytes} "
                "this coordinator accepts for this model"
            )

    def open(self, site: str, spec: UploadSpec) -> PlainUpload:
        """Check an Upload stream's manifest and return the (new or resumed) assembler."""
        ctx = self.ctx
        with ctx.cond:
            self.membership.member(site, spec.session_id, spec.instance_id)
            if ctx.merge_rule is not None:
                return self._open_async(site, spec)
            if self._folds_late(site, spec.round):
                return self._open_late(site, spec)
            ctx.check_upload_round(spec.round)
            r = ctx.round
            ctx.check_not_rejected(site)
            self.validate(site, spec)
            if self.shards.holds(site):
                raise InvalidUpdateError(
                    f"site {site!r} already sent shards of its update for round {r.number}; a site "
                    "uploads either one whole update or all of its shards"
                )
            existing = r.uploads.get(site)
            if existing is None and site in r.contributed:
                # Counted through a relay's partial or its shards: one update per site and round.
                raise UpdateRejectedError(
                    f"site {site!r}'s update already counts in round {r.number} (through a relay's "
                    "partial sum or its shards); wait for the broadcast (AwaitBroadcast)"
                )
            if existing is not None:
                if site in r.contributed or existing.spec == spec:
                    existing.check_same_manifest(spec.wire)  # MANIFEST_CONFLICT if it differs
                    return existing
                # A different update for the same round before the first completed: the site
                # restarted and recomputed it. The newest one wins; the partial one is dropped.
                logger.info("round %d: %s replaced its partial upload", r.number, site)
            assembler = PlainUpload(spec, max_total_bytes=self.max_upload_bytes, timings=r.timings, spill=self.spill)
            r.uploads[site] = assembler
            r.inner_steps[site] = spec.inner_steps
            ctx.events.emit(ev.UPLOAD_OPENED, site=site, round=r.number)
            ctx.count_up(site, spec.nbytes)
            return assembler

    def live_chunks(self, site: str, assembler: PlainUpload, chunks: Chunks, *, instance: str = "") -> Iterator[Any]:
        """The chunks of an Upload stream, counted as received bytes; stops the stream with
        WRONG_ROUND as soon as its round closes, so a straggler stops wasting its link, and
        with SITE_REPLACED as soon as another process of the site (``instance`` is the
        stream's) took the name over."""
        ctx = self.ctx
        for chunk, nbytes in chunks:
            with ctx.cond:
                ctx.count_up(site, nbytes)
                self.membership.check_instance(site, instance)
                r = ctx.round
                goes_on = (
                    (ctx.phase in OPEN_PHASES and r.stale_uploads.get(site) is assembler)
                    or (ctx.phase is not RoundPhase.FINISHED and r.held.get(site) is assembler)
                    or self._carried_over(site, assembler)
                )
                if not goes_on:
                    round_number = assembler.spec.round  # an asynchronous upload may have moved on
                    if r.number != round_number or ctx.phase not in OPEN_PHASES:
                        ctx.check_upload_round(round_number)
                    if r.uploads.get(site) is not assembler:
                        raise _discarded(site, round_number)
            yield chunk

    def _carried_over(self, site: str, assembler: PlainUpload) -> bool:
        """An asynchronous upload of the merge being applied, which the next merge takes over
        (``next_round``) instead of cutting it off (lock held)."""
        ctx = self.ctx
        r = ctx.round
        return (
            ctx.merge_rule is not None and ctx.phase is RoundPhase.AGGREGATING
            and r.uploads.get(site) is assembler and site not in r.contributed and site not in r.rejected
        )

    def finish(self, site: str, assembler: PlainUpload, *, instance: str = "") -> UploadProgress:
        """After a stream ended: if every chunk is there, verify and aggregate the update.

        Verification runs on the one verifier thread, so at most one decoded update exists
        besides the buffer whatever the number of sites (the memory bound of the aggregation),
        and the decoder's temporary buffers always come from the same malloc arena. Run on the
        gRPC thread that received the upload, each of dozens of threads would keep its own
        arena's worth of freed decoder memory (glibc arenas are per thread and, with the
        transport's trim threshold, rarely shrink): tens of MB per thread for a 50M-parameter
        model.
        """
        if not assembler.complete:
            return _progress(assembler)
        with self.ctx.cond:
            late = self.ctx.round.stale_uploads.get(site) is assembler
            held = self.ctx.round.held.get(site) is assembler or self._carried_over(site, assembler)
        verify = self._verify_and_fold if late else self._verify_and_hold if held else self._verify_and_add
        try:
            future = self.verifier.submit(verify, site, assembler, instance)
        except RuntimeError:  # the executor is shut down: close() was called
            raise ShuttingDownError(
                "the coordinator is shutting down; retry to reach its successor"
            ) from None
        return future.result()

    # -- verification --

    def upload_weight(self, spec: UploadSpec) -> float:
        """``w_k`` of an upload under the run's weighting (``geoloco.algorithms.weighting``)."""
        return site_weight(
            self.ctx.config.algorithm.weighting, samples=float(spec.sample_weight), inner_steps=int(spec.inner_steps)
        )

    def _verified(
        self, site: str, round_number: int, data: memoryview, spec: UploadSpec, *, dense: bool
    ) -> tuple[Encoded | torch.Tensor, float, bool]:
        """(update to add, its norm, all finite): encoded for a running sum (``upload_check``)."""
        with self.ctx.cond:
            codec = self.ctx.uplink_codec_for(site, round_number)
        return checked_update(
            f"site {site!r}'s update for round {round_number}", data, spec.checksum[0],
            codec=codec, numel=self.ctx.strategy.upload_numel(round_number, site),
            device=self.device, dense=dense,
        )

    def _verify_and_add(self, site: str, assembler: PlainUpload, instance: str = "") -> UploadProgress:
        ctx = self.ctx
        round_number = assembler.spec.round
        with self.verify_lock:
            with ctx.cond:
                if site in ctx.round.contributed and ctx.round.number == round_number:
                    return _progress(assembler, merged_round=round_number if ctx.merge_rule is not None else None)
                ctx.check_upload_round(round_number)
                dense = not isinstance(ctx.round.core.aggregation, RunningSum)
            verify_start = time.monotonic()
            data = assembler.finish()  # checksum; a mismatch resets the assembler (DATA_LOSS)
            decoded, norm, finite = self._verified(site, round_number, data, assembler.spec, dense=dense)
            del data
            assembler.timings.spent("verify", verify_start, time.monotonic())
            with ctx.cond:
                progress = self._admit_verified(site, assembler, decoded, Screen(norm, finite), instance)
            del decoded
            assembler.release()  # in the sum now
        return progress

    def _admit_verified(
        self, site: str, assembler: PlainUpload, decoded: Encoded | torch.Tensor, screen: Screen, instance: str,
        *, arrival: bool = True,
    ) -> UploadProgress:
        """Admit ``site``'s verified update into the open round, its own (lock held): accepted,
        or refused with the reason on the round and in the error raised. ``arrival`` False: an
        update held for this merge, which the adaptive grace window must not count as an
        arrival now (all of them enter at the merge's opening, gaps of zero)."""
        ctx = self.ctx
        round_number = assembler.spec.round
        merging = ctx.merge_rule is not None
        add_start = time.monotonic()
        weight = self.upload_weight(assembler.spec)
        if merging:  # computed from an older version: discounted by its staleness
            weight = stale_admission(
                ctx.config.algorithm.asynchronous, base=assembler.base_round, into=round_number, weight=weight
            ).weight
        ctx.check_upload_round(round_number)
        self.membership.check_instance(site, instance)  # replaced while it was verified
        r = ctx.round
        if r.uploads.get(site) is not assembler:
            raise _discarded(site, round_number)
        admission = ctx.engine.admit(r.core, site, decoded, weight, screen=screen, now=ctx.clock())
        if ctx.merge_rule is not None and arrival:
            ctx.merge_rule.observe_arrival(ctx.clock())
        if admission.verdict == "duplicate":
            raise UpdateRejectedError(f"{admission.reason}; wait for the broadcast (AwaitBroadcast)")
        if not admission.ok:
            assert admission.reason is not None
            self.rejected(site, round_number, admission.reason)
            raise InvalidUpdateError(rejection_message(
                f"site {site!r}'s update for round {round_number}", admission.reason,
                aborted=bool(r.core.aborted),
            ))
        assembler.timings.spent("add", add_start, time.monotonic())
        self._observe_link(site, assembler)
        r.site_metrics[site] = dict(assembler.spec.metrics)
        if merging:
            ctx.merged_updates[site] = (assembler.base_round, assembler.spec.checksum, round_number)
        ctx.events.emit(ev.UPDATE_AGGREGATED, site=site, round=round_number, weight=weight)
        logger.debug(
            "round %d: update of %s aggregated (%d of %d members)",
            round_number, site, len(r.contributed), len(ctx.members),
        )
        ctx.cond.notify_all()
        return _progress(assembler, merged_round=round_number if merging else None)

    # -- asynchronous merges (``[algorithm.asynchronous]``) --

    def _merged_before(self, site: str, spec: UploadSpec) -> UploadProgress | None:
        """A resend of the update that already entered a merge (its answer was lost, or this
        coordinator restarted after that merge became durable): complete, with that merge, and
        not counted twice; None for any other update."""
        ctx = self.ctx
        with ctx.cond:
            self.membership.member(site, spec.session_id, spec.instance_id)
            previous = ctx.merged_updates.get(site)
        if previous is None or previous[:2] != (spec.round, spec.checksum):
            return None
        logger.info("%s resent its update from version %d, which entered merge %d", site, spec.round, previous[2])
        return UploadProgress(complete=True, merged_round=previous[2], received_bytes=spec.total_bytes)

    def _open_async(self, site: str, spec: UploadSpec) -> PlainUpload:
        """The (new or resumed) assembler of an update computed from version ``spec.round``,
        offered to the open merge (lock held). It enters that merge whatever its base, within
        ``max_staleness``; one admitted update per site and merge (a refused one may be followed by another)."""
        ctx = self.ctx
        r = ctx.round
        # Its speed counts for Dynamic Local Updates even when the update itself is refused: a
        # slow site's first, too stale update is how the run learns how slow it is.
        ctx.observe_speed(site, int(spec.inner_steps), float(spec.metrics.get("inner_time_s", 0.0)))
        if ctx.phase not in OPEN_PHASES:
            ctx.check_upload_round(r.number)  # the run is over, or the merge is being applied
        staleness = self._admissible_staleness(site, spec, into=r.number)
        respec = dataclasses.replace(spec, round=r.number)
        existing = r.uploads.get(site)
        if existing is not None and existing.base_round == spec.round and (
            existing.spec == respec or (site in r.contributed and existing.spec.checksum == spec.checksum)
        ):
            existing.check_same_manifest(spec.wire)  # MANIFEST_CONFLICT if it differs
            return existing
        if site in r.contributed:
            return self._open_held(site, spec)
        assembler = self._new_async_upload(site, spec, respec)
        if site in r.rejected:
            logger.info("merge %d: %s sends another update after its last was refused", r.number, site)
            r.core.retry(site)
        r.uploads[site] = assembler
        r.inner_steps[site] = spec.inner_steps
        r.staleness[site] = staleness
        ctx.events.emit(ev.UPLOAD_OPENED, site=site, round=r.number)
        return assembler

    def _open_held(self, site: str, spec: UploadSpec) -> PlainUpload:
        """The next update of a site whose previous one is already in the open merge: held for
        the next merge (as the simulator holds it) instead of refused, so the site never waits
        for the merge to close before it sends (lock held). One held update per site."""
        ctx = self.ctx
        r = ctx.round
        into = r.number + 1
        self._admissible_staleness(site, spec, into=into)
        respec = dataclasses.replace(spec, round=into)
        existing = r.held.get(site)
        if existing is not None:
            if existing.base_round == spec.round and existing.spec == respec:
                existing.check_same_manifest(spec.wire)  # MANIFEST_CONFLICT if it differs
                return existing
            if site in ctx.held_updates:
                raise WrongRoundError(
                    f"site {site!r} already has an update held for merge {into}; send the next one "
                    f"after merge {r.number}'s broadcast"
                )
        assembler = r.held[site] = self._new_async_upload(site, spec, respec)
        return assembler

    def _admissible_staleness(self, site: str, spec: UploadSpec, *, into: int) -> int:
        """The staleness an update computed from version ``spec.round`` has in merge ``into``;
        WRONG_ROUND when it may not enter it (``stale_admission``)."""
        verdict = stale_admission(self.ctx.config.algorithm.asynchronous, base=spec.round, into=into, weight=1.0)
        if verdict.refused is not None:
            raise WrongRoundError(
                f"site {site!r}'s update cannot enter merge {into}: {verdict.refused}; drop it and go on "
                "from the newest broadcast"
            )
        return verdict.staleness

    def _new_async_upload(self, site: str, spec: UploadSpec, respec: UploadSpec) -> PlainUpload:
        """A checked assembler for an asynchronous update (``spec`` as sent, ``respec`` naming the
        merge it goes to); its manifest's bytes are counted (lock held)."""
        self.validate(site, respec, computed_from=spec.round)
        assembler = PlainUpload(
            respec, max_total_bytes=self.max_upload_bytes, timings=self.ctx.round.timings, spill=self.spill
        )
        assembler.base_round = spec.round
        self.ctx.count_up(site, spec.nbytes)
        return assembler

    def _verify_and_hold(self, site: str, assembler: PlainUpload, instance: str = "") -> UploadProgress:
        """Verify a held update now (the verifier is idle between the site's uploads) and keep it
        for the next merge; if that merge opened meanwhile, admit it at once."""
        ctx = self.ctx
        with self.verify_lock:
            with ctx.cond:
                r = ctx.round
                into = r.number + 1 if self._pending(site, assembler) else assembler.spec.round
                held = ctx.held_updates.get(site)
                if held is not None and held.assembler is assembler:
                    return _progress(assembler, complete=True, merged_round=into)
                dense = not isinstance(r.core.aggregation, RunningSum)
            data = assembler.finish()  # checksum; a mismatch resets the assembler (DATA_LOSS)
            decoded, norm, finite = self._verified(site, into, data, assembler.spec, dense=dense)
            del data
            with ctx.cond:
                self.membership.check_instance(site, instance)
                r = ctx.round
                if r.number == into and r.uploads.get(site) is assembler:
                    return self._admit_verified(site, assembler, decoded, Screen(norm, finite), instance)
                if r.number + 1 != into or not self._pending(site, assembler):
                    if site in ctx.members:  # left behind by ``next_round``: beyond max_staleness
                        raise WrongRoundError(
                            f"site {site!r}'s update could not enter merge {into}: it is too stale by "
                            "now; drop it and go on from the newest broadcast"
                        )
                    raise _discarded(site, into)
                ctx.held_updates[site] = HeldUpdate(assembler, decoded, Screen(norm, finite))
                if ctx.merge_rule is not None:  # it arrived now, though it enters the next merge
                    ctx.merge_rule.observe_arrival(ctx.clock())
        logger.debug("merge %d: the next update of %s is held for merge %d", into - 1, site, into)
        return _progress(assembler, complete=True, merged_round=into)

    def _pending(self, site: str, assembler: PlainUpload) -> bool:
        """The upload goes to the next merge: held, or carried over (lock held)."""
        return self.ctx.round.held.get(site) is assembler or self._carried_over(site, assembler)

    def next_round(self, previous: CoordinatorRound, now: float) -> None:
        """Asynchronous merges: the uploads held during ``previous``, and those it closed on
        before they were complete, enter the merge just opened (lock held): verified ones now,
        the others as uploads of it. One now beyond ``max_staleness`` is left behind (its
        stream ends with WRONG_ROUND, as for any closed round)."""
        ctx = self.ctx
        if ctx.merge_rule is None:
            return
        r = ctx.round
        unfinished = {
            site: a for site, a in previous.uploads.items()
            if site not in previous.contributed and site not in previous.rejected
        }
        for site, assembler in {**unfinished, **previous.held}.items():
            verdict = stale_admission(
                ctx.config.algorithm.asynchronous, base=assembler.base_round, into=r.number, weight=1.0
            )
            held = ctx.held_updates.pop(site, None)
            if verdict.refused is not None:
                logger.info("merge %d: the update of %s is left behind: %s", r.number, site, verdict.refused)
                continue
            assembler.spec = dataclasses.replace(assembler.spec, round=r.number)
            r.uploads[site] = assembler
            r.inner_steps[site] = assembler.spec.inner_steps
            r.staleness[site] = verdict.staleness
            if held is None:
                continue
            try:
                self._admit_verified(
                    site, assembler, held.decoded, held.screen, assembler.spec.instance_id, arrival=False
                )
            except StatusError as err:  # refused (e.g. by the update guard): on the round's record
                logger.info("merge %d: the held update of %s was not admitted: %s", r.number, site, err)

    def _status_async(self, site: str, base: int) -> UploadProgress:
        """UploadStatus of the update computed from version ``base`` (lock held): in the open
        merge or held for the next (the stored manifest lets the site check it is its own)."""
        ctx = self.ctx
        r = ctx.round
        assembler = r.uploads.get(site)
        if assembler is not None and assembler.base_round == base:
            counted = site in r.contributed
            return _progress(assembler, complete=counted, merged_round=r.number if counted else None)
        held = r.held.get(site)
        if held is not None and held.base_round == base:
            kept = ctx.held_updates.get(site)
            complete = kept is not None and kept.assembler is held
            return _progress(held, complete=complete, merged_round=held.spec.round if complete else None)
        # An update that already entered an earlier merge is not named here: two updates can
        # share a base version, and this answer could not tell them apart; resent, it is
        # recognised by its checksum (``_merged_before``).
        if ctx.phase is RoundPhase.FINISHED:
            ctx.check_upload_round(base)
        return UploadProgress(known=False)

    def _observe_link(self, site: str, assembler: PlainUpload) -> None:
        """An admitted upload that came whole in one stream measured ``site``'s uplink (lock
        held, in the same critical section as the admission, so any codec plan made after it,
        lazily at the first header or join that asks for a round's codec, has seen it; a late
        update folded into round t + 1 therefore informs round t + 2's plan)."""
        if assembler.link_sample is not None:
            self.ctx.observe_upload(site, *assembler.link_sample)
            assembler.link_sample = None

    def rejected(self, site: str, round_number: int, why: str) -> None:
        """The engine rejected ``site``'s update of the open round ``round_number`` (the reason
        is on the round): drop its upload and tell the observers (lock held)."""
        ctx = self.ctx
        if ctx.round.number == round_number:
            ctx.round.uploads.pop(site, None)
        ctx.cond.notify_all()
        ctx.events.emit(ev.UPDATE_REJECTED, site=site, round=round_number, why=why)

    # -- late updates (``late_updates = "fold"``) --

    def _folds_late(self, site: str, round_number: int) -> bool:
        """Whether an upload for ``round_number`` is a late update to fold into the open round:
        exactly one round late, folding on, and the site's update did not count in its round."""
        ctx = self.ctx
        # An update its own round refused is not offered again one round late either.
        counted = ctx.contributor_history.get(round_number, frozenset())
        refused = ctx.refused_history.get(round_number, frozenset())
        settled = site in counted or site in refused
        return ctx.phase in OPEN_PHASES and ctx.engine.late_foldable(round_number, ctx.round.number, counted=settled)

    def _open_late(self, site: str, spec: UploadSpec) -> PlainUpload:
        """The (new or resumed) assembler of a late update; called with the lock held."""
        ctx = self.ctx
        r = ctx.round
        self.validate(site, spec)
        existing = r.stale_uploads.get(site)
        if existing is not None and (site in r.folded or existing.spec == spec):
            existing.check_same_manifest(spec.wire)
            return existing
        assembler = PlainUpload(spec, max_total_bytes=self.max_upload_bytes, timings=r.timings, spill=self.spill)
        r.stale_uploads[site] = assembler
        ctx.count_up(site, spec.nbytes)
        logger.info("round %d: %s is sending its late update of round %d", r.number, site, spec.round)
        return assembler

    def _verify_and_fold(self, site: str, assembler: PlainUpload, instance: str = "") -> UploadProgress:
        """Verify a complete late update and add it to the open round with the staleness
        discount; it does not count towards the quorum (``contributed``)."""
        ctx = self.ctx
        round_number = assembler.spec.round
        with self.verify_lock:
            with ctx.cond:
                if site in ctx.round.folded:
                    return _progress(assembler, folded=True)
                dense = not isinstance(ctx.round.core.aggregation, RunningSum)
            verify_start = time.monotonic()
            data = assembler.finish()
            decoded, norm, finite = self._verified(site, round_number, data, assembler.spec, dense=dense)
            del data
            weight = self.upload_weight(assembler.spec)
            add_start = time.monotonic()
            assembler.timings.spent("verify", verify_start, add_start)
            with ctx.cond:
                r = ctx.round
                if r.number != round_number + 1 or ctx.phase not in OPEN_PHASES:
                    ctx.check_upload_round(round_number)  # raises WRONG_ROUND: it is too late
                self.membership.check_instance(site, instance)
                if r.stale_uploads.get(site) is not assembler:
                    raise _discarded(site, round_number)
                admission = ctx.engine.fold_late(r.core, site, decoded, weight, screen=Screen(norm, finite))
                if not admission.ok:
                    assert admission.reason is not None
                    ctx.events.emit(ev.UPDATE_REJECTED, site=site, round=round_number, why=admission.reason)
                    raise InvalidUpdateError(rejection_message(
                        f"site {site!r}'s late update for round {round_number}", admission.reason,
                        aborted=bool(r.core.aborted),
                    ))
                weight = admission.weight
                assembler.timings.spent("add", add_start, time.monotonic())
                self._observe_link(site, assembler)
                ctx.events.emit(ev.UPDATE_AGGREGATED, site=site, round=round_number, weight=weight, late=True)
                logger.info(
                    "round %d: late update of %s (round %d) folded in with weight %.4g",
                    r.number, site, round_number, weight,
                )
                ctx.cond.notify_all()
            del decoded
            assembler.release()  # in the sum now
        return _progress(assembler, folded=True)

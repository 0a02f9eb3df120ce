"""Secure-aggregation upload intake: masked uploads into the protocol's sum.

The ``UploadIntake`` of a run with ``privacy.secure_aggregation`` (``geoloco.coordinator.intake``
has the interface and the plain one). Masked chunks go straight into the secure-aggregation
protocol's running sum (``geoloco.coordinator.privacy_rounds``): no site's vector is assembled
here. The protocol, not the round policy, decides when uploads close (secure rounds have no
deadline), and the closed round waits for the survivors to unmask the sum before it is
aggregated.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Mapping

import torch

from geoloco.algorithms.aggregation import Aggregation
from geoloco.algorithms.engine import UNSCREENED, RoundSum
from geoloco.algorithms.fixed_point import MODULUS_DTYPES
from geoloco.algorithms.privacy.private_aggregation import SECURE_UPLOAD_CODEC
from geoloco.algorithms.privacy.secagg_crypto import num_chunks, site_index
from geoloco.algorithms.privacy.secagg_stages import StageMessage, StageReply
from geoloco.algorithms.round import CloseDecision, Round
from geoloco.algorithms.strategy import RoundPlan
from geoloco.coordinator import events as ev
from geoloco.coordinator.context import RoundContext
from geoloco.coordinator.domain import OPEN_PHASES, CoordinatorRound, RoundPhase, UploadProgress, UploadSpec
from geoloco.coordinator.intake import Chunks
from geoloco.coordinator.membership import Membership
from geoloco.coordinator.privacy_rounds import PrivateRounds, SecureUpload
from geoloco.protos.errors import InvalidUpdateError, UpdateRejectedError, WrongRoundError

__all__ = ["SecureIntake"]

_KEEP_OPEN = CloseDecision(close=False)

STAGE_POLL_S = 0.5
"""A waiting stage call looks again at least this often: a stage also closes at its deadline,
which no call announces."""


class SecureIntake:
    """Masked uploads into the secure-aggregation protocol's sum (module doc)."""

    secure = True

    def __init__(self, ctx: RoundContext, membership: Membership, privacy: PrivateRounds) -> None:
        self.ctx = ctx
        self.privacy = privacy
        self.membership = membership
        tls = ctx.config.tls_files
        self._ca_pem: bytes | None = tls.read()[0] if tls is not None else None
        """The run's CA: sites' identity bindings are checked against it before they are relayed."""
        self._partials: dict[str, tuple[tuple[str, ...], SecureUpload]] = {}
        """relay -> (its sites, its partial upload) of the open round (resumable like a site's)."""
        self._progressed = threading.Event()
        """Set (and replaced) when the protocol moved on (``PrivateRounds.progress``). Waiting
        stage calls wait on it, outside the lock: on the session's condition every message of
        every site would wake every waiting call, each of which re-runs the protocol's
        bookkeeping over all sites (the cube of the sites per stage)."""
        self._progress = privacy.progress()

    def receive(self, site: str, spec: UploadSpec, chunks: Chunks) -> UploadProgress:
        ctx, privacy = self.ctx, self.privacy
        with ctx.cond:
            self.membership.member(site, spec.session_id, spec.instance_id)
            ctx.check_upload_round(spec.round)
            if spec.site and spec.site != site:
                raise InvalidUpdateError(f"upload manifest names site {spec.site!r} but the caller is {site!r}")
            fragment = ctx.fragment_of(spec.round)
            if spec.fragment != fragment:
                raise InvalidUpdateError(
                    f"masked upload for round {spec.round} names fragment {spec.fragment}; "
                    f"that round's secure sum is over fragment {fragment}"
                )
            try:
                upload = privacy.open_upload(site, spec)
            finally:
                self._changed()  # a refused upload may let the key stage close now
            r = ctx.round
            ctx.events.emit(ev.UPLOAD_OPENED, site=site, round=r.number)
            r.site_metrics[site] = dict(spec.metrics)
            ctx.count_up(site, spec.nbytes)
        for chunk, nbytes in chunks:
            with ctx.cond:
                ctx.count_up(site, nbytes)
                if ctx.round.number != spec.round or ctx.phase not in OPEN_PHASES:
                    ctx.check_upload_round(spec.round)
                privacy.add_chunk(site, upload, chunk.index, chunk.data)
                if upload.complete and site not in ctx.round.contributed:
                    ctx.engine.admit(ctx.round.core, site, None, 1.0, screen=UNSCREENED, now=ctx.clock())
                    ctx.events.emit(ev.UPDATE_AGGREGATED, site=site, round=spec.round, weight=1.0)
                    self._changed()
        with ctx.cond:
            return privacy.upload_progress(upload)

    def receive_partial(
        self, relay: str, link: str, spec: UploadSpec, sites: Mapping[str, Mapping[str, float]], chunks: Chunks
    ) -> UploadProgress:
        """One Upload stream of a relay's masked partial sum over ``sites`` (site -> its own
        upload metrics; module doc); its bytes are counted on ``link``. Nothing the relay checked
        is relied on: every check of a site's masked upload is made here again, for each site."""
        ctx = self.ctx
        with ctx.cond:
            group, upload = self._open_partial(relay, spec, sites)
            ctx.count_up(link, spec.nbytes)
        indices = [site_index(s) for s in group]
        for chunk, nbytes in chunks:
            with ctx.cond:
                ctx.count_up(link, nbytes)
                if ctx.round.number != spec.round or ctx.phase not in OPEN_PHASES:
                    ctx.check_upload_round(spec.round)
                current = self.privacy.current
                if current is None or current.round_number != spec.round or current.aborted:
                    raise WrongRoundError(f"secure round {spec.round} is over or aborted; partial sum refused")
                if not 0 <= chunk.index < upload.num_chunks:
                    raise InvalidUpdateError(
                        f"relay {relay!r}: masked chunk {chunk.index} is outside the partial's "
                        f"{upload.num_chunks} chunks"
                    )
                try:
                    current.server.receive_masked_partial(indices, chunk.index, chunk.data)
                except ValueError as err:
                    raise InvalidUpdateError(f"relay {relay!r}: {err}") from None
                upload.received.add(chunk.index)
                if upload.complete:
                    self._count(group, spec.round, {s: {**sites[s], link: 1.0} for s in group})
        with ctx.cond:
            return self.privacy.upload_progress(upload)

    def _open_partial(
        self, relay: str, spec: UploadSpec, sites: Iterable[str]
    ) -> tuple[tuple[str, ...], SecureUpload]:
        """Check a partial's manifest as every listed site's own masked upload would be."""
        ctx, privacy = self.ctx, self.privacy
        group = tuple(sorted(sites))
        for site in group:
            self.membership.member(site, spec.session_id)
        ctx.check_upload_round(spec.round)
        if spec.fragment != ctx.fragment_of(spec.round):
            raise InvalidUpdateError(
                f"relay {relay!r}'s masked partial for round {spec.round} names fragment {spec.fragment}; "
                f"that round's secure sum is over fragment {ctx.fragment_of(spec.round)}"
            )
        if spec.codec != SECURE_UPLOAD_CODEC:
            raise InvalidUpdateError(
                f"secure aggregation is on: relay {relay!r}'s partial sum must be masked (codec "
                f"{SECURE_UPLOAD_CODEC!r}, the ring sum of its sites' masked uploads), got {spec.codec!r}"
            )
        current = privacy.current
        if current is None or current.round_number != spec.round:
            raise WrongRoundError(
                f"relay {relay!r} cannot upload to secure round {spec.round} (no secure round with that "
                "number is open here); its sites' updates stay out of this round"
            )
        width = privacy.privacy.modulus_bits // 8
        sent_values = current.context.numel
        dtype = MODULUS_DTYPES[privacy.privacy.modulus_bits]
        if spec.dtype != dtype.name or list(spec.shape) != [sent_values]:
            raise InvalidUpdateError(
                f"relay {relay!r}'s masked partial is {spec.dtype} {list(spec.shape)}; expected "
                f"{dtype.name} [{sent_values}]"
            )
        if spec.total_bytes != sent_values * width or spec.chunk_size != privacy.wire_chunk_bytes:
            raise InvalidUpdateError(
                f"relay {relay!r}'s masked partial is {spec.total_bytes} bytes in chunks of {spec.chunk_size}; "
                f"expected {sent_values * width} bytes in chunks of {privacy.wire_chunk_bytes}"
            )
        if current.aborted:
            raise WrongRoundError(
                f"relay {relay!r} cannot upload to secure round {spec.round} ({current.aborted}); its "
                "sites' updates stay out of this round: wait for the broadcast"
            )
        late = [s for s in group if not current.may_upload(s)]
        if late:
            raise WrongRoundError(
                f"relay {relay!r}'s partial lists sites {late} that may not upload to secure round "
                f"{spec.round} (they did not share keys before the key stage closed, or were left out); "
                "send a partial of the others"
            )
        existing = self._partials.get(relay)
        if existing is not None and existing[1].spec.round == spec.round:
            if existing[0] != group or existing[1].spec.total_bytes != spec.total_bytes:
                raise InvalidUpdateError(f"relay {relay!r} re-opened its masked partial with other sites or size")
            return existing
        r = ctx.round
        for site in group:
            if site in r.contributed or site in r.rejected:
                raise UpdateRejectedError(
                    f"site {site!r} already has an update for round {r.number}; drop it from the partial sum"
                )
        upload = SecureUpload(spec=spec, num_chunks=num_chunks(sent_values, privacy.privacy.chunk_size), received=set())
        self._partials[relay] = (group, upload)
        return group, upload

    def _count(self, group: tuple[str, ...], round_number: int, metrics: Mapping[str, dict[str, float]]) -> None:
        """A complete partial: each of its sites is a contributor (weight 1, as a masked upload)."""
        ctx = self.ctx
        r = ctx.round
        for site in group:
            if site not in r.contributed:
                ctx.engine.admit(r.core, site, None, 1.0, screen=UNSCREENED, now=ctx.clock())
                r.site_metrics[site] = metrics[site]
                ctx.events.emit(ev.UPDATE_AGGREGATED, site=site, round=round_number, weight=1.0)
        self._changed()

    def status(self, site: str, round_number: int, fragment: int) -> UploadProgress:
        ctx = self.ctx
        if round_number == ctx.round.number:
            return self.privacy.upload_status(site, round_number)
        if round_number < ctx.round.number or ctx.phase is RoundPhase.FINISHED:
            ctx.check_upload_round(round_number)
        return UploadProgress(known=False)

    def start_round(self, now: float) -> None:
        # Open the key-advertisement stage over the fragment the round synchronises.
        ctx = self.ctx
        number = ctx.round.number
        self.privacy.start_round(
            number, ctx.round_seed(number), now, numel=ctx.update_numel(number), ca_pem=self._ca_pem
        )
        self._wake_stage_calls()

    # -- the secure close rule (the round engine's ``ClosePolicy`` in a secure run) --

    def may_start(self, members: int) -> bool:
        """The quorum starts a secure round as it starts a plain one."""
        return self.ctx.policy.may_start(members)

    def decide_round(self, round_: Round, *, now: float, expected: Collection[str]) -> CloseDecision:
        """Secure rounds have no deadline (the config refuses one) and never close before their
        quorum started them: the protocol decides once key sharing ran. The poll calls this, so
        the key stages' deadlines hold even when no site calls, and a round whose quorum can no
        longer upload aborts (closing with "no change") instead of waiting forever."""
        if not round_.started:
            return _KEEP_OPEN
        close = self.privacy.close_decision(set(expected), set(round_.contributed), self.ctx.policy.min_sites, now)
        self._wake_stage_calls()  # a stage may have closed at its deadline
        return CloseDecision(close=close)

    def begin_close(self, now: float) -> None:
        # The survivors unmask the sum before it exists.
        self.privacy.close_upload(now)
        self._wake_stage_calls()

    def ready(self, now: float) -> bool:
        self.privacy.advance(set(self.ctx.members), now)
        self._changed()
        return self.privacy.unmasked

    def aggregate(
        self, global_flat: torch.Tensor, aggregation: Aggregation, plan: RoundPlan, contributors: list[str]
    ) -> RoundSum:
        # The unmasked sum of the survivors (or no change if the round was aborted).
        return RoundSum(*self.privacy.finish_round(self.ctx.strategy, global_flat, aggregation, plan, contributors))

    def _changed(self) -> None:
        """The protocol's state may have moved (lock held): wake the driver, and the waiting
        stage calls if their replies may have changed."""
        self.ctx.cond.notify_all()
        self._wake_stage_calls()

    def _wake_stage_calls(self) -> None:
        """Wake the waiting stage calls if the protocol moved on (lock held)."""
        progress = self.privacy.progress()
        if progress != self._progress:
            self._progress = progress
            moved, self._progressed = self._progressed, threading.Event()
            moved.set()

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
        """One SecureStage call: record the message, wait up to ``wait_s`` for the stage to close.
        A process of ``site`` replaced while it waits is refused (``SiteReplacedError``) instead
        of sending its message again in the name its successor holds."""
        ctx, privacy = self.ctx, self.privacy
        with ctx.cond:
            self.membership.member(site, session_id, instance)
            if ctx.phase is RoundPhase.FINISHED or round_number > ctx.round.number:
                ctx.check_upload_round(round_number)
            deadline = ctx.clock() + wait_s
            reply = privacy.stage(site, round_number, stage, message, set(ctx.members), ctx.clock())
            self._changed()
        while True:
            with ctx.cond:
                left = deadline - ctx.clock()
                if reply.ready or ctx.closing or left <= 0:
                    return reply
                progressed = self._progressed
            progressed.wait(min(left, STAGE_POLL_S))
            with ctx.cond:
                self.membership.check_instance(site, instance)
                # Sent again (an equal message is a no-op): the call advances the stages whose
                # deadline passed, and answers from the protocol as it is now.
                reply = privacy.stage(site, round_number, stage, message, set(ctx.members), ctx.clock())
                self._changed()

    def next_round(self, previous: CoordinatorRound, now: float) -> None:
        """Nothing carries over: each secure round has its own cohort."""

    def withdraw(self, site: str, round_number: int, withheld: str = "") -> None:
        # A site waiting for the broadcast without having advertised keys will not (e.g. its
        # key stages ran with this coordinator's predecessor); one that withholds its update
        # withdraws alike.
        if round_number == self.ctx.round.number:
            self.privacy.withdraw(site, round_number, set(self.ctx.members), self.ctx.clock())
            self._changed()

    def shutdown(self) -> None:
        """Nothing runs in the background (masked chunks are added on the stream's thread); the
        waiting stage calls wake to answer that the coordinator is shutting down."""
        self._progressed.set()

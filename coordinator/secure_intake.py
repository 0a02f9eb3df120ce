"""Secure-aggregation upload intake: masked uploads into the protocol's sum.

The ``UploadIntake`` of a run with ``privacy.secure_aggregation`` (``geoloco.coordinator.intake``
has the interface and the plain one). Masked chunks go straight into the secure-aggregation
protocol's running sum (``geoloco.coordinator.privacy_rounds``): no site's vector is assembled
here. The protocol, not the round policy, decides when uploads close (secure rounds have no
deadline), and the closed round waits for the survivors to unmask the sum before it is
aggregated.
"""

from __future__ import annotations

import torch

from geoloco.algorithms.aggregation import Aggregation
from geoloco.algorithms.round import CloseDecision
from geoloco.algorithms.secagg import StageMessage, StageReply
from geoloco.algorithms.strategy import RoundPlan
from geoloco.coordinator import events as ev
from geoloco.coordinator.context import RoundContext
from geoloco.coordinator.domain import OPEN_PHASES, RoundPhase, UploadProgress, UploadSpec
from geoloco.coordinator.errors import InvalidUpdateError
from geoloco.coordinator.intake import Chunks, RoundSum
from geoloco.coordinator.membership import Membership
from geoloco.coordinator.privacy_rounds import PrivateRounds

__all__ = ["SecureIntake"]

_CLOSED = CloseDecision(close=False)


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

    def receive(self, site: str, spec: UploadSpec, chunks: Chunks) -> UploadProgress:
        ctx, privacy = self.ctx, self.privacy
        with ctx.cond:
            self.membership.member(site, spec.session_id)
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
                ctx.cond.notify_all()  # a refused upload may let the key stage close now
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
                    ctx.round.core.count(site, 1.0, now=ctx.clock())
                    ctx.events.emit(ev.UPDATE_AGGREGATED, site=site, round=spec.round, weight=1.0)
                    ctx.cond.notify_all()
        with ctx.cond:
            return privacy.upload_progress(upload)

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

    def decide(self, now: float) -> CloseDecision:
        # Secure rounds have no deadline (the config refuses one) and never close before their
        # quorum started them: the protocol decides once key sharing ran. The poll calls this,
        # so the key stages' deadlines hold even when no site calls, and a round whose quorum
        # can no longer upload aborts (closing with "no change") instead of waiting forever.
        r = self.ctx.round.core
        if not r.started:
            return _CLOSED
        members = set(self.ctx.members)
        return CloseDecision(
            close=self.privacy.close_decision(members, set(r.contributed), self.ctx.policy.min_sites, now)
        )

    def begin_close(self, now: float) -> None:
        # The survivors unmask the sum before it exists.
        self.privacy.close_upload(now)

    def ready(self, now: float) -> bool:
        self.privacy.advance(set(self.ctx.members), now)
        self.ctx.cond.notify_all()
        return self.privacy.unmasked

    def aggregate(
        self, global_flat: torch.Tensor, aggregation: Aggregation, plan: RoundPlan, contributors: list[str]
    ) -> RoundSum:
        # The unmasked sum of the survivors (or no change if the round was aborted).
        return RoundSum(*self.privacy.finish_round(self.ctx.strategy, global_flat, aggregation, plan, contributors))

    def stage(
        self, site: str, session_id: str, round_number: int, stage: str, message: StageMessage, *, wait_s: float
    ) -> StageReply:
        """One SecureStage call: record the message, wait up to ``wait_s`` for the stage to close."""
        ctx, privacy = self.ctx, self.privacy
        with ctx.cond:
            self.membership.member(site, session_id)
            if ctx.phase is RoundPhase.FINISHED or round_number > ctx.round.number:
                ctx.check_upload_round(round_number)
            deadline = ctx.clock() + wait_s
            reply = privacy.stage(site, round_number, stage, message, set(ctx.members), ctx.clock())
            ctx.cond.notify_all()
            while not reply.ready and not ctx.closing:
                left = deadline - ctx.clock()
                if left <= 0:
                    break
                ctx.cond.wait(timeout=min(left, 0.25))
                reply = privacy.stage(site, round_number, stage, message, set(ctx.members), ctx.clock())
            return reply

    def withdraw(self, site: str, round_number: int) -> None:
        # A site waiting for the broadcast without having advertised keys will not (e.g. its
        # key stages ran with this coordinator's predecessor).
        if round_number == self.ctx.round.number:
            self.privacy.withdraw(site, round_number, set(self.ctx.members), self.ctx.clock())
            self.ctx.cond.notify_all()

    def shutdown(self) -> None:
        """Nothing runs in the background: masked chunks are added on the stream's thread."""

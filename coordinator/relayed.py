"""Regional relays at the coordinator: who a relay may speak for, and its partial sums.

A relay (``geoloco relay``, package ``geoloco.relay``) serves a region's sites with the
coordinator's own protocol and talks to the coordinator on their behalf with its own certificate
(URI SAN ``geoloco:relay:NAME``). Two things change here, nothing else:

* Identity. A call from a relay names the site it is made for (the request's ``site`` field);
  the site must be in the relay's ``[relays]`` list, otherwise the call is refused with
  PERMISSION_DENIED, so a relay cannot forge another region's sites. The site is then a member
  like any other: membership, heartbeats, quorum and broadcasts need no relay-specific code. A
  listed site dropped as silent (or gone) after its update reached the relay still counts
  through the partial, as a direct site's finished upload does when it leaves.
* Partial sums. A relay's Upload carries ``relayed_sites`` (site, weight, inner steps) and, as
  its blob, the weighted mean of those sites' verified updates (codec ``none``, float32, or the
  run's uplink codec with the relay's own error feedback). It
  enters the round's running sum once, with the sum of the weights, and each listed site counts
  as a contributor with its own weight: ``Σ_r W_r m_r / Σ_r W_r`` with ``W_r m_r = Σ_k w_k g_k``
  is the flat mean (up to float32 rounding of the partial mean: see ``docs/architecture.md``).

Secure aggregation. With ``[privacy] secure_aggregation`` the partial is instead the ring sum of
its sites' masked uploads (codec ``secagg``, each site weight 1): ``SecureIntake.receive_partial``
adds it to the protocol's sum and counts every listed site as a survivor-to-be; the stage calls
(keys, shares, unmasking) come through the relay like any call made for a site. Refusals at the
relay (``rejected``) do not exist there: the relay cannot read a masked update.

Relayed partials are verified like a site's update (checksum, codec, shape, finite values). The
norm and weight bounds of ``[update_guard]`` apply to each site's own update at the relay, which
reports the sites it refused (``RelayedSite.rejected``): they are recorded as rejected here, as
if the coordinator had refused them, so the round does not wait for them; so are the sites that
withheld their update (``AwaitBroadcastRequest.withheld``). A partial that counts no site carries
no values (float32 ``[0]``). The partial's own norm is not a site's, but a weighted mean of
updates within the guard's bound is within it too, so it is held to the same bound.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from geoloco.algorithms.engine import UNSCREENED, Screen, screen_update
from geoloco.algorithms.weighting import check_inner_steps
from geoloco.coordinator import events as ev
from geoloco.coordinator.domain import OPEN_PHASES, UploadProgress, UploadSpec
from geoloco.coordinator.errors import rejection_message
from geoloco.coordinator.intake import (
    Chunks,
    PlainIntake,
    PlainUpload,
    run_most_inner_steps,
)
from geoloco.coordinator.secure_intake import SecureIntake
from geoloco.protos.errors import (
    IdentityError,
    InvalidUpdateError,
    NotAMemberError,
    UpdateRejectedError,
    clip,
    quoted,
)
from geoloco.protos.identity import validate_site_name
from geoloco.protos.transport_tls import peer_relay
from geoloco.protos.upload_check import MAX_METRIC_NAME_CHARS, MAX_SITE_METRICS, checked_update

__all__ = ["RELAYED_CODEC", "RelayedSite", "RelayedUploads", "relay_link"]

logger = logging.getLogger(__name__)

RELAYED_CODEC = "none"
"""The lossless upward codec: with it the relayed result is the flat one. The run's uplink codec
is accepted too (the relay keeps its own error-feedback residual)."""

MAX_RELAYED_REASON_CHARS = 400
"""Characters of a relay's reason for refusing a site kept in the round's record."""
WEIGHT_SUM_RTOL = 1e-9
"""How far the manifest's ``sample_weight`` may be from the sum of the listed weights (the relay
adds the same float64 numbers; only the order of a float64 sum can differ)."""


def relay_link(relay: str) -> str:
    """The name a relay's bytes are counted under in a round's ``bytes_up``/``bytes_down``."""
    return f"relay:{relay}"


def _counting(relayed: Sequence[RelayedSite]) -> list[RelayedSite]:
    """The sites whose updates a partial's values hold (the others are refusals it reports)."""
    return [r for r in relayed if not r.rejected]


def _partial_numel(intake: PlainIntake, round_number: int, relayed: Sequence[RelayedSite]) -> int:
    """Values a relay's partial for ``round_number`` carries: the round's update size, or none
    when it counts no site (it only reports refusals; its relay may not know the size)."""
    return intake.ctx.update_numel(round_number) if _counting(relayed) else 0


@dataclass(frozen=True, slots=True)
class RelayedSite:
    """One site whose update a relay's partial sum contains."""

    site: str
    weight: float
    inner_steps: int
    metrics: dict[str, float] = field(default_factory=dict)
    """The site's own upload metrics, passed on by the relay."""
    rejected: str = ""
    """Non-empty: the relay refused the site's update (why); it is not in the sum."""
    left_out: bool = False
    """With ``rejected``: not judged, only left out (``pb.RelayedSite.left_out``)."""


class RelayedUploads:
    """The coordinator's side of regional relays (module doc)."""

    def __init__(self, intake: object, relays: Mapping[str, Sequence[str]], *, insecure: bool) -> None:
        self.intake = intake if isinstance(intake, PlainIntake) else None
        """The plain intake whose round the partials enter (None: a secure run)."""
        self.secure = intake if isinstance(intake, SecureIntake) else None
        """The secure intake whose protocol sum masked partials enter (None: a plain run)."""
        self.relays = {name: frozenset(sites) for name, sites in relays.items()}
        self.insecure = insecure
        self._uploads: dict[str, PlainUpload] = {}
        """relay -> its partial upload of the open round (resumable like a site's)."""
        self._lock = threading.Lock()

    # -- identity --

    def relay_of(self, context: grpc.ServicerContext) -> str | None:
        """The relay calling, or None for a site (or any call in plain-text mode)."""
        return None if self.insecure else peer_relay(context)

    def speak_for(self, relay: str, claimed: str) -> str:
        """The site a relay's call is made for: ``claimed``, if the relay may speak for it."""
        sites = self.relays.get(relay)
        if sites is None:
            raise IdentityError(
                f"relay {relay!r} is not in this coordinator's [relays] table "
                f"({', '.join(sorted(self.relays)) or 'none configured'}); add it with the sites "
                "it serves"
            )
        if not claimed:
            raise IdentityError(
                f"relay {relay!r} must name the site a call is made for (the request's site field)",
                code=grpc.StatusCode.INVALID_ARGUMENT,
            )
        if claimed not in sites:
            raise IdentityError(
                f"relay {relay!r} may not speak for site {quoted(claimed)}: its [relays] list is "
                f"{', '.join(sorted(sites))}"
            )
        return claimed

    def insecure_relay(self, claimed: str) -> str:
        """Plain-text mode: the relay named by the manifest's ``site`` field (trusted, as every
        name is without TLS)."""
        try:
            return validate_site_name(claimed)
        except ValueError as err:
            raise IdentityError(str(err), code=grpc.StatusCode.INVALID_ARGUMENT) from None

    # -- partial sums --

    def receive(self, relay: str, spec: UploadSpec, relayed: Sequence[RelayedSite], chunks: Chunks) -> UploadProgress:
        """One Upload stream of a relay's partial sum: check, assemble, verify, add."""
        if self.secure is not None:
            return self._receive_masked(self.secure, relay, spec, relayed, chunks)
        intake = self.intake
        if intake is None:
            raise InvalidUpdateError("this coordinator's round intake takes no relayed partial sums")
        assembler = self._open(intake, relay, spec, relayed)
        started = time.monotonic()
        assembler.timings.upload_started(started)
        assembler.consume(self._live_chunks(intake, relay, spec.round, chunks))
        if not assembler.complete:
            return UploadProgress(
                complete=False, received=tuple(assembler.received()), missing=tuple(assembler.missing()),
                received_bytes=assembler.received_bytes, manifest=spec.wire,
            )
        assembler.timings.upload_received(time.monotonic())
        with self._lock:
            self._add(intake, relay, assembler, relayed)
        return UploadProgress(
            complete=True, received=tuple(assembler.received()), received_bytes=assembler.received_bytes,
            manifest=spec.wire,
        )

    def _receive_masked(
        self, intake: SecureIntake, relay: str, spec: UploadSpec, relayed: Sequence[RelayedSite], chunks: Chunks
    ) -> UploadProgress:
        """A relay's masked partial (module doc): who it lists is checked here, the rest (the
        protocol's checks for every listed site) by the secure intake."""
        if not relayed:
            raise InvalidUpdateError(f"relay {relay!r}'s upload lists no relayed sites")
        names = [r.site for r in relayed]
        if len(set(names)) != len(names):
            raise InvalidUpdateError(f"relay {relay!r}'s upload lists a site twice: {sorted(names)}")
        most_steps = run_most_inner_steps(intake.ctx.config.algorithm)
        for r in relayed:
            self.speak_for(relay, r.site)
            if r.rejected or r.weight != 1.0:
                raise InvalidUpdateError(
                    f"relay {relay!r} lists site {r.site!r} with weight {r.weight} (rejected: {r.rejected!r}); "
                    "in a secure round every site of a masked partial counts with weight 1"
                )
            why = check_inner_steps(r.inner_steps, most_steps)
            if why is not None:
                raise InvalidUpdateError(f"relay {relay!r}'s partial refused: site {r.site!r}: {why}")
            if len(r.metrics) > MAX_SITE_METRICS or any(len(k) > MAX_METRIC_NAME_CHARS for k in r.metrics):
                raise InvalidUpdateError(
                    f"relay {relay!r} passes on {len(r.metrics)} metrics for site {r.site!r}; at most "
                    f"{MAX_SITE_METRICS}, names of at most {MAX_METRIC_NAME_CHARS} characters"
                )
        if spec.sample_weight != len(relayed):
            raise InvalidUpdateError(
                f"relay {relay!r}'s masked partial has sample_weight {spec.sample_weight}; it must be the "
                f"number of its sites ({len(relayed)})"
            )
        return intake.receive_partial(
            relay, relay_link(relay), spec, {r.site: r.metrics for r in relayed}, chunks
        )

    @staticmethod
    def _live_chunks(intake: PlainIntake, relay: str, round_number: int, chunks: Chunks) -> Iterator[Any]:
        """The stream's chunks, counted on the relay's link; stops with WRONG_ROUND as soon as
        the round closes."""
        ctx = intake.ctx
        for chunk, nbytes in chunks:
            with ctx.cond:
                ctx.count_up(relay_link(relay), nbytes)
                if ctx.round.number != round_number or ctx.phase not in OPEN_PHASES:
                    ctx.check_upload_round(round_number)
            yield chunk

    def _check(self, intake: PlainIntake, relay: str, spec: UploadSpec, relayed: Sequence[RelayedSite]) -> None:
        """Everything about a partial that can be refused before a byte of it is read."""
        if not relayed:
            raise InvalidUpdateError(f"relay {relay!r}'s upload lists no relayed sites")
        names = [r.site for r in relayed]
        if len(set(names)) != len(names):
            raise InvalidUpdateError(f"relay {relay!r}'s upload lists a site twice: {sorted(names)}")
        weighting = intake.ctx.config.algorithm.weighting
        most_steps = run_most_inner_steps(intake.ctx.config.algorithm)
        for r in relayed:
            self.speak_for(relay, r.site)
            if r.rejected:
                continue
            if not (math.isfinite(r.weight) and r.weight > 0):
                raise InvalidUpdateError(
                    f"relay {relay!r} gives site {r.site!r} weight {r.weight}; weights are finite and > 0"
                )
            # The weight a site's own upload would get: a relay cannot weigh its sites up.
            fixed = {"uniform": 1.0, "steps": float(r.inner_steps)}.get(weighting)
            if fixed is not None and r.weight != fixed:
                raise InvalidUpdateError(
                    f"relay {relay!r} gives site {r.site!r} weight {r.weight}; under weighting "
                    f"{weighting!r} its weight is {fixed:g}"
                )
            if len(r.metrics) > MAX_SITE_METRICS or any(len(k) > MAX_METRIC_NAME_CHARS for k in r.metrics):
                raise InvalidUpdateError(
                    f"relay {relay!r} passes on {len(r.metrics)} metrics for site {r.site!r}; at most "
                    f"{MAX_SITE_METRICS}, names of at most {MAX_METRIC_NAME_CHARS} characters"
                )
            # The bounds a site's own upload meets: its inner steps, and its weight, absolute and
            # against the other sites' recent weights (so a relay cannot weigh one of its sites up).
            # The history is read under the lock with the round open: the step that adds to it
            # runs while the round is aggregating.
            with intake.ctx.cond:
                intake.ctx.check_upload_round(spec.round)
                why = check_inner_steps(r.inner_steps, most_steps) or intake.ctx.engine.screen(
                    UNSCREENED, weights=[(f"site {r.site!r}'s weight", r.weight)], site=r.site, weight=r.weight
                )
            if why is not None:
                raise InvalidUpdateError(f"relay {relay!r}'s partial refused: site {r.site!r}: {why}")
        total = math.fsum(r.weight for r in _counting(relayed))
        if not math.isclose(spec.sample_weight, total, rel_tol=WEIGHT_SUM_RTOL):
            raise InvalidUpdateError(
                f"relay {relay!r}'s sample_weight {spec.sample_weight} is not the sum of its sites' "
                f"weights ({total})"
            )
        ctx = intake.ctx
        if spec.codec not in (RELAYED_CODEC, intake.uplink_codec):
            raise InvalidUpdateError(
                f"relay {relay!r}'s partial sum uses codec {quoted(spec.codec)}; a relay sends "
                f"{RELAYED_CODEC!r} (lossless) or the run's uplink codec {intake.uplink_codec!r} upward"
            )
        numel = _partial_numel(intake, spec.round, relayed)
        counts = numel > 0
        if spec.dtype != "float32" or list(spec.shape) != [numel]:
            needs = "the round needs" if counts else "a partial that counts no site (only refusals) carries no values:"
            raise InvalidUpdateError(
                f"relay {relay!r}'s partial sum is {quoted(spec.dtype)} {list(spec.shape)}; {needs} float32 [{numel}]"
            )
        if counts and spec.fragment != ctx.fragment_of(spec.round):
            raise InvalidUpdateError(
                f"relay {relay!r}'s upload for round {spec.round} names fragment {spec.fragment}; that "
                f"round synchronises fragment {ctx.fragment_of(spec.round)}"
            )

    def _open(self, intake: PlainIntake, relay: str, spec: UploadSpec, relayed: Sequence[RelayedSite]) -> PlainUpload:
        self._check(intake, relay, spec, relayed)
        ctx = intake.ctx
        with ctx.cond:
            for r in relayed:
                try:
                    intake.membership.member(r.site, spec.session_id)
                except NotAMemberError:
                    # Dropped as silent (or left) after its update reached the relay, which may
                    # wait longer than the heartbeat timeout for the region's other sites: its
                    # update counts, as a direct site's finished upload does when it leaves.
                    # Refusing the partial would leave out every site of the region.
                    logger.info(
                        "round %d: relay %s's partial carries site %s, no longer a member; it counts",
                        spec.round, relay, r.site,
                    )
            ctx.check_upload_round(spec.round)
            cr = ctx.round
            existing = self._uploads.get(relay)
            if existing is not None and existing.spec.round == spec.round:
                counted = any(f"relay:{relay}" in m for m in cr.site_metrics.values())
                if counted or existing.spec == spec:
                    existing.check_same_manifest(spec.wire)  # MANIFEST_CONFLICT if it differs
                    return existing
                # The previous partial never counted (refused, or cut off and recomputed by a
                # restarted relay): the newest one replaces it, as a site's newer upload does.
                logger.info("round %d: relay %s replaced its partial sum that did not count", cr.number, relay)
                del self._uploads[relay]
            for r in relayed:
                if not r.rejected:
                    self._check_not_in_round(intake, r.site)
            assembler = PlainUpload(
                spec, max_total_bytes=intake.max_upload_bytes, timings=cr.timings, spill=intake.spill
            )
            self._uploads[relay] = assembler
            ctx.count_up(relay_link(relay), spec.nbytes)
            return assembler

    @staticmethod
    def _in_round(intake: PlainIntake, site: str) -> bool:
        """Whether ``site`` already has an update in the open round: counted, rejected, or its
        own upload or shards under way (lock held)."""
        cr = intake.ctx.round
        return site in cr.rejected or site in cr.contributed or site in cr.uploads or intake.shards.holds(site)

    @classmethod
    def _check_not_in_round(cls, intake: PlainIntake, site: str) -> None:
        """Refuse a partial counting ``site`` when the site already has an update in the open
        round (lock held)."""
        cr = intake.ctx.round
        if cls._in_round(intake, site):
            raise UpdateRejectedError(
                f"site {site!r} already has an update for round {cr.number} (its own upload or "
                "shards, or another partial's); drop it from the partial sum"
            )

    def _add(self, intake: PlainIntake, relay: str, assembler: PlainUpload, relayed: Sequence[RelayedSite]) -> None:
        ctx = intake.ctx
        spec = assembler.spec
        what = f"relay {relay!r}'s partial sum for round {spec.round}"
        with ctx.cond:
            ctx.check_upload_round(spec.round)
            cr = ctx.round
            if all(f"relay:{relay}" in cr.site_metrics.get(r.site, {}) or r.site in cr.rejected for r in relayed):
                return  # a repeated stream of a partial that already counts
        verify_start = time.monotonic()
        data = assembler.finish()
        mean, norm, finite = checked_update(
            what, data, spec.checksum[0], codec=spec.codec, numel=_partial_numel(intake, spec.round, relayed),
            device=intake.device, dense=True,
        )
        del data
        # A weighted mean of updates each within the guard's norm bound is within it too: a
        # partial beyond it cannot come from the updates the relay was held to check.
        why = screen_update(ctx.engine.guard, Screen(norm, finite))
        if why is not None:
            raise InvalidUpdateError(rejection_message(what, why, aborted=False))
        add_start = time.monotonic()
        assembler.timings.spent("verify", verify_start, add_start)
        with ctx.cond:
            ctx.check_upload_round(spec.round)
            cr = ctx.round
            if self._uploads.get(relay) is not assembler:
                raise UpdateRejectedError(f"{what} was replaced by a newer one")
            for r in _counting(relayed):
                # Checked again under the lock the add holds: the site's own upload or shards may
                # have counted while this partial streamed in (a site counts once per round).
                self._check_not_in_round(intake, r.site)
            now = ctx.clock()
            counted = _counting(relayed)
            try:
                if counted:
                    cr.core.aggregation.add(mean, spec.sample_weight, site=relay_link(relay))
            except ValueError as err:
                raise InvalidUpdateError(f"{what} could not be added: {err}") from None
            for r in relayed:
                if r.rejected and not self._in_round(intake, r.site):
                    # Refused at the relay, as the coordinator would have: not waited for. A site
                    # already in the round by another path (its own upload after a failover) keeps
                    # that update: a relay's refusal speaks only of what reached the relay.
                    why = f"{clip(r.rejected, MAX_RELAYED_REASON_CHARS)} (at relay {relay})"
                    cr.core.reject(r.site, why)
                    if r.left_out:
                        cr.left_out.add(r.site)
                    ctx.events.emit(ev.UPDATE_REJECTED, site=r.site, round=spec.round, why=why)
            for r in counted:
                ctx.engine.admit(cr.core, r.site, None, r.weight, screen=UNSCREENED, now=now)
                if ctx.engine.guard is not None:
                    # The partial's norm stands for each of its sites in the guard's history (their
                    # own are not known here): otherwise a relay run's bounds come from the direct
                    # sites alone, and a lone direct site sets its own.
                    ctx.engine.guard.accepted(spec.round, r.site, norm, weight=r.weight)
                cr.inner_steps[r.site] = r.inner_steps
                cr.site_metrics[r.site] = {**r.metrics, f"relay:{relay}": 1.0}
                ctx.events.emit(ev.UPDATE_AGGREGATED, site=r.site, round=spec.round, weight=r.weight)
            assembler.timings.spent("add", add_start, time.monotonic())
            logger.info(
                "round %d: relay %s's partial sum of %s aggregated (weight %.6g)",
                spec.round, relay, ", ".join(r.site for r in relayed), spec.sample_weight,
            )
            ctx.cond.notify_all()

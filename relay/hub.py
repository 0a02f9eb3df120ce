"""The relay's state: which sites joined through it, the open round's partial sum, the cached
broadcasts, and when the partial goes upward.

Every method is thread-safe (one condition guards the state); the calls to the coordinator run
outside it. Rounds are the coordinator's: the relay learns the open round from the answers it
passes on (Join, Heartbeat, the broadcast's next round) and from its sites' uploads.

A site name is a lease held by one process (``geoloco.coordinator.membership``). The coordinator
decides who holds it; the relay follows the Joins it passes on: once the coordinator accepted a
Join of a site's process, a request that another process of the site makes at the relay (an
upload, UploadStatus, AwaitBroadcast, which the relay answers itself) is refused with
``SiteReplacedError``, so a replaced process's update cannot take the site's place in the
partial sum. A process that joined at the coordinator directly (a failover) is not known here
until it joins through the relay; the coordinator refuses the replaced one's heartbeat anyway.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from geoloco.algorithms.aggregation import CountingAggregation, RunningSum
from geoloco.algorithms.engine import UNSCREENED, RoundEngine, Screen
from geoloco.algorithms.finite import withheld_reason
from geoloco.algorithms.round import RoundPolicy
from geoloco.algorithms.update_guard import UpdateGuard, UpdateGuardConfig
from geoloco.algorithms.weighting import check_inner_steps, site_weight
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.errors import (
    InvalidUpdateError,
    NotAMemberError,
    SiteReplacedError,
    StaleSessionError,
    StatusError,
    UpdateRejectedError,
    WrongRoundError,
    clip,
    quoted,
)
from geoloco.protos.upload_check import check_metrics, checked_update, finite_metrics
from geoloco.protos.wire_assembly import Download, UploadAssembler, read_broadcast_stream
from geoloco.protos.wire_buffers import MAX_CHUNK_SIZE, ManifestTooLargeError
from geoloco.protos.wire_files import BlobSpill
from geoloco.protos.wire_manifests import blob_manifest
from geoloco.relay.config import RelayConfig
from geoloco.relay.masked import SecureRun, check_masked_manifest
from geoloco.relay.partial import RelayRound, RelayWait, SiteUpdate, encode_partial, masked_partial
from geoloco.relay.run_info import RunInfo
from geoloco.relay.upstream import Traffic, Upstream

__all__ = ["AskCoordinator", "CachedBroadcast", "RelayHub", "RunInfo"]

logger = logging.getLogger(__name__)

ACCEPT_WAIT_S = 20.0
"""Longest an Upload is held waiting for the coordinator to take its partial sum (below the
sites' 30 s minimum transfer deadline); the site then asks again."""
KEEP_BROADCASTS = 3
"""Rounds whose broadcast stays cached for sites that ask late."""
SHORT_INSTANCE = 8
"""Characters of an instance id in messages (as the coordinator writes them)."""


@dataclass(frozen=True, slots=True)
class AskCoordinator:
    """``RelayHub.wait_broadcast``'s answer when only the coordinator can tell the site whether
    its update counted: the relay asks it for the header alone (``start_chunk`` past the last
    chunk), takes its ``included`` and ``refused``, and serves ``header`` with them and the
    cached ``data``, so the delta crosses the relay's link once."""

    header: pb.BroadcastHeader
    data: bytes | None


@dataclass(slots=True)
class CachedBroadcast:
    """A round's broadcast as the coordinator sent it (served to every site of the relay), or
    the error the coordinator answered."""

    header: pb.BroadcastHeader | None = None
    data: bytes | None = None
    error: StatusError | None = None
    included: frozenset[str] = field(default_factory=frozenset)
    """Sites whose update the coordinator took through this relay's partial (its answer)."""
    sent: frozenset[str] = field(default_factory=frozenset)
    """Sites whose update went up in the relay's partial, whatever the answer said."""
    claim: str = ""
    """The site the relay asked the coordinator for (``header.included`` is about it)."""
    refused: frozenset[str] = field(default_factory=frozenset)
    """Sites whose update the relay refused this round (``header.refused`` for each): a site
    of a partial the coordinator refused is not among them; its update was never judged."""
    disowned: bool = False
    """The round's partial surely did not count (``RelayHub._disowned``): ``header`` speaks of
    the claim site's own update, and the other sites ask the coordinator themselves
    (``AskCoordinator``): one of them may have counted by its own upload after a failover."""

    def counts(self, site: str) -> bool:
        """Whether ``site``'s update is in the round's aggregate: the broadcast's word where it
        has one. Its header speaks of the claim site; when the claim went up in the partial, its
        ``included`` is the partial's, whatever the answer to the partial said: the round may
        have been aborted after the partial was taken (nobody counted), a secure sum may have
        left it out, or the answer may have been lost and the resend refused as late although
        the first try counted. Otherwise the answer decides, unless the round was aborted
        (``num_contributors`` 0)."""
        if self.header is None:
            return False
        if self.disowned:
            return site == self.claim and self.header.included
        if self.claim in self.sent:
            return site in self.sent and self.header.included
        return site in self.included and self.header.num_contributors > 0


class RelayHub:
    """Membership, the open round's partial sum and the broadcast cache (module doc)."""

    def __init__(
        self,
        config: RelayConfig,
        upstream: Upstream,
        traffic: Traffic,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_update: Callable[[int, str], None] | None = None,
    ) -> None:
        self.config = config
        self.upstream = upstream
        self.traffic = traffic
        self.clock = clock
        self.cond = threading.Condition(threading.RLock())
        self.session_id = ""
        self.run: RunInfo | None = None
        self.members: dict[str, float] = {}
        """site -> when the relay last heard of it."""
        self.ever_joined: set[str] = set()
        """Sites that joined through this relay at least once (left or silent ones included)."""
        self.instances: dict[str, str] = {}
        """site -> the process holding its name (``JoinRequest.instance_id``) as of the last Join
        through this relay the coordinator accepted ("" for a site older than the field)."""
        self._join_locks: dict[str, threading.Lock] = {}
        """site -> held while a Join of the site is passed on and its answer recorded (``join_lock``)."""
        self.round = RelayRound(number=0, opened_s=clock())
        self.broadcasts: dict[int, CachedBroadcast] = {}
        self._broadcast_waits: dict[int, threading.Event] = {}
        """round -> set once its broadcast is cached (or the relay closes). Its sites' AwaitBroadcast
        calls wait on it, not on ``cond``, which every upload and heartbeat notifies: a wake per
        site per event costs the square of the region's sites per round."""
        self.included: dict[int, frozenset[str]] = {}
        """round -> sites the coordinator counted through this relay's partial."""
        self.partials: dict[int, dict[str, float]] = {}
        """round -> site -> weight of the partial that went upward (for the metrics record)."""
        self.refused: dict[int, frozenset[str]] = {}
        """round -> sites whose update the relay refused (``CachedBroadcast.refused``)."""
        self.outcomes: dict[int, str] = {}
        """round -> the coordinator's answer to its partial (``RelayRound.outcome``), for the
        sites' answers."""
        self._fetching: set[int] = set()
        self._forwarding: set[int] = set()
        """Rounds whose partial is being built or went upward and whose answer has not come
        back. The relay asks for their broadcast as the partial goes up
        (``RelayServer.forward_if_due``), so the broadcast may arrive before that answer; its
        cached copy waits for it (``CachedBroadcast`` needs both to say who counted)."""
        self._verify_lock = threading.Lock()
        self.records: list[dict[str, Any]] = []
        """One record per round whose partial went upward (drained by the server's writer)."""
        self.engine = RoundEngine(
            None, RoundPolicy(), UpdateGuard(UpdateGuardConfig()), close=RelayWait(config.max_wait_s)
        )
        """The round engine (``geoloco.algorithms.engine``) as a relay drives it: admission with the
        run's ``[update_guard]`` (from the coordinator's config; the relay refuses what the
        coordinator would refuse of a site's own upload) and the relay's close rule
        (``RelayWait``); no outer step: the partial sum goes upward instead."""
        self.spill = BlobSpill(None)
        """Where big plain uploads arrive: a file in the system's temporary folder
        (``geoloco.protos.wire_files``)."""
        self.residuals: dict[int, torch.Tensor] = {}
        """fragment -> the relay's error-feedback residual of its upward codec (sum space)."""
        self._sent_residuals: dict[int, tuple[int, torch.Tensor | None]] = {}
        """round -> (fragment, the residual before its partial): settled with the round's broadcast
        (``_settle_residual``), which says whether the partial counted."""
        self._disowned: set[int] = set()
        """Rounds whose partial surely did not count: after refusing it, the coordinator took the
        report of its sites as left out (``refusals_only``), which replaces only a partial that
        never counted. The claim site's ``included`` then speaks of another path (its own upload
        after a failover), not of the partial."""
        self.closing = False
        self.run_finished = False
        """The coordinator said the run is over (a broadcast with ``run_finished``)."""
        self.on_update = on_update
        """Called with (round, site) when a site's verified update entered the partial sum."""

    # -- membership --

    def check_allowed(self, site: str) -> None:
        if self.config.sites and site not in self.config.sites:
            raise NotAMemberError(
                f"site {site!r} is not served by relay {self.config.name!r} (its sites: "
                f"{', '.join(self.config.sites)}); connect it to its own region's relay or the coordinator",
                code=grpc.StatusCode.PERMISSION_DENIED,
                reason=pb.ERROR_REASON_IDENTITY_MISMATCH,
            )

    def check_session(self, session_id: str) -> None:
        if session_id != self.session_id:
            raise StaleSessionError(
                f"session {session_id!r} is not the coordinator's current session; call Join again"
            )

    def check_instance(self, site: str, instance: str) -> None:
        """Refuse a request of a process of ``site`` other than the one whose Join the
        coordinator accepted last (module doc)."""
        holder = self.instances.get(site, "")
        if instance and holder and instance != holder:
            raise SiteReplacedError(
                f"another process joined as site {site!r} through relay {self.config.name!r} (instance "
                f"{clip(holder[:SHORT_INSTANCE])}); this one (instance {clip(instance[:SHORT_INSTANCE])}) "
                "was replaced and stops. Run one process per site name; a site restarted after a crash "
                "replaces its old process this way"
            )

    def join_lock(self, site: str) -> threading.Lock:
        """Hold it while a Join of ``site`` is passed on and ``joined`` records it: two processes
        of the site joining at once are then recorded in the order the coordinator saw them, so
        the relay never takes the process the coordinator let in for the replaced one."""
        with self.cond:
            return self._join_locks.setdefault(site, threading.Lock())

    def joined(self, site: str, response: pb.JoinResponse, instance: str = "") -> None:
        """The coordinator accepted ``site``'s Join by the process ``instance``, which holds the
        site's name from now on."""
        with self.cond:
            self.instances[site] = instance
            self.session_id = response.session_id
            run = RunInfo.of(response)
            if run.guard != (None if self.run is None else self.run.guard):
                self.engine.guard = UpdateGuard(run.guard)
            self.run = run
            self.members[site] = self.clock()
            self.ever_joined.add(site)
            self._learn_round(response.round)
            self.cond.notify_all()

    def heard(self, site: str, response: pb.HeartbeatResponse | None = None) -> None:
        with self.cond:
            if site in self.members:
                self.members[site] = self.clock()
            if response is not None and not response.rejoin_required:
                self._learn_round(response.round)
            self.cond.notify_all()

    def left(self, site: str) -> None:
        with self.cond:
            self.members.pop(site, None)
            self.cond.notify_all()

    def withheld(self, site: str, request: pb.AwaitBroadcastRequest) -> None:
        """``site`` sends no update to round ``request.round`` (``request.withheld`` says why):
        refused here, so the partial names it as rejected and the coordinator does not wait for
        it either (an upload of it still arriving is dropped); in a secure run it withdraws from
        the round instead. Only for the relay's open
        round: the round numbers the relay follows are the coordinator's, never a site's (one
        naming a later round would otherwise end the open round and every update in it), and
        the session and process are checked first, as for its wait."""
        round_number, why = int(request.round), request.withheld
        with self.cond:
            self.check_session(request.session_id)
            self.check_instance(site, request.instance_id)
            r = self.round
            if round_number != r.number:
                return
            plain = self.run is not None and self.run.secure is None
            if plain and not r.forwarded and site not in r.updates:
                self._reject(r, site, withheld_reason(why))
        self.withdrew(site, round_number)

    def _reject(self, r: RelayRound, site: str, why: str) -> None:
        """``site`` is refused from plain round ``r`` before its update was added (lock held):
        an upload of it still arriving is dropped (it would count the site twice)."""
        if site in r.updates:
            return  # its verified update is in the partial already; a later manifest cannot undo it
        r.assemblers.pop(site, None)
        if r.core is None:
            # No upload opened the round yet, and perhaps none will (every site of the relay
            # refused): the round opens here, so its close rule can send the partial that reports
            # the refusals. Its first upload sets its running sum.
            r.core = self.engine.open(r.number, CountingAggregation(), r.opened_s)
            self.engine.maybe_start(r.core, self.clock(), members=len(self.members))
        if site not in r.core.rejected:
            r.core.reject(site, why)

    def withdrew(self, site: str, round_number: int) -> None:
        """``site`` gave up secure round ``round_number`` (it will not upload): not waited for."""
        with self.cond:
            if self.round.number == round_number:
                self.round.withdrawn.add(site)
            self.cond.notify_all()

    def live_sites(self, now: float) -> set[str]:
        timeout = self.run.heartbeat_timeout_s if self.run is not None else 15.0
        with self.cond:
            return {s for s, seen in self.members.items() if now - seen <= timeout}

    def _learn_round(self, info: pb.RoundInfo) -> None:
        """The coordinator is at round ``info.round``: a partial of an older round that never
        went upward is too late (its sites catch up from the broadcast). The round's upload size
        and fragment, when the coordinator says them, are what the relay holds its uploads to."""
        number = int(info.round)
        r = self.round
        if number == r.number and r.expected is None and info.upload_numel:
            r.expected = (int(info.upload_numel), int(info.fragment))
        if number <= r.number:
            return
        if r.core is not None and not r.forwarded:
            # Its sites still ask for the round's broadcast: those refused here drop their updates.
            self.refused[r.number] = frozenset(r.rejected)
        if not r.empty and not r.forwarded:
            logger.warning(
                "relay %s: the coordinator moved on to round %d before round %d's partial of %s went up",
                self.config.name, number, r.number, ", ".join(r.updates) or "no complete upload",
            )
        self.round = RelayRound(
            number=number, opened_s=self.clock(),
            expected=(int(info.upload_numel), int(info.fragment)) if info.upload_numel else None,
        )

    # -- uploads from the sites --

    def open_upload(self, site: str, manifest: pb.UploadManifest) -> UploadAssembler:
        """Check an Upload stream's manifest; the new or resumed assembler of the site's upload."""
        with self.cond:
            self.check_session(manifest.session_id)
            self.check_instance(site, manifest.instance_id)
            if site not in self.members:
                raise NotAMemberError(f"site {site!r} has not joined through relay {self.config.name!r}; call Join")
            self.members[site] = self.clock()
            r = self.round
            if manifest.round > r.number:
                # The relay's rounds are the coordinator's: a site cannot move them on.
                raise WrongRoundError(
                    f"round {manifest.round} is not open yet; relay {self.config.name!r} is at round {r.number}"
                )
            if manifest.round < r.number or r.forwarded:
                raise WrongRoundError(
                    f"round {manifest.round} is closed at relay {self.config.name!r} (its partial sum "
                    "went to the coordinator); keep the update in the error-feedback residual and "
                    "apply the round's broadcast (AwaitBroadcast)"
                )
            if site in r.rejected:
                raise UpdateRejectedError(
                    f"site {site!r}'s update for round {r.number} was rejected ({r.rejected[site]}); "
                    "wait for the broadcast (AwaitBroadcast)"
                )
            self._validate(site, manifest, r)
            existing = r.assemblers.get(site)
            if existing is not None and (site in r.updates or existing.upload == _named(manifest, site)):
                existing.check_same_manifest(_named(manifest, site))
                return existing
            numel = manifest.blob.shape[0]
            secure = self.run is not None and self.run.secure is not None
            # A masked upload's buffer is the ring sum's input (``r.buffers``): memory. A plain
            # one of a big model arrives in a file, as at the coordinator (``BlobSpill``).
            buffer = None if secure else self.spill.buffer(manifest.blob.total_bytes)
            out = bytearray(manifest.blob.total_bytes) if buffer is None else buffer
            assembler = UploadAssembler(
                _named(manifest, site), max_total_bytes=2 * 4 * numel + (1 << 20), max_chunk_size=MAX_CHUNK_SIZE,
                out=out,
            )
            if secure:
                assert isinstance(out, bytearray)
                r.buffers[site] = out
            r.assemblers[site] = assembler
            if r.core is None:  # the round's first upload: its size and its clock
                r.core = self.engine.open(r.number, RunningSum(numel=int(numel)), r.opened_s)
                self.engine.maybe_start(r.core, self.clock(), members=len(self.members))
            elif isinstance(r.core.aggregation, CountingAggregation):  # opened by a withheld update
                r.core.aggregation = RunningSum(numel=int(numel))
            return assembler

    def _validate(self, site: str, manifest: pb.UploadManifest, r: RelayRound) -> None:
        run = self.run
        assert run is not None  # a member joined, so the run is known
        blob = manifest.blob
        if manifest.site and manifest.site != site:
            raise InvalidUpdateError(f"upload manifest names site {quoted(manifest.site)} but the caller is {site!r}")
        if run.secure is not None:
            check_masked_manifest(manifest, run.secure, run.numel)
        elif blob.codec != run.uplink_codec:
            raise InvalidUpdateError(
                f"upload codec {quoted(blob.codec)} is not the run's uplink codec {run.uplink_codec!r}"
            )
        plain_shape = blob.dtype == "float32" and len(blob.shape) == 1 and 0 < blob.shape[0] <= run.numel
        if run.secure is None and not plain_shape:
            raise InvalidUpdateError(
                f"upload is {quoted(blob.dtype)} {list(blob.shape)}; pseudo-gradients are float32 "
                f"[n] with n <= {run.numel} (the model's size)"
            )
        shape = (int(blob.shape[0]),)
        if run.secure is None and r.expected is not None and (shape[0], manifest.fragment) != r.expected:
            # The coordinator said what the round takes: a site's other manifest is refused for
            # the site alone, and cannot set the shape of the region's partial for the others.
            numel, fragment = r.expected
            wrong = (
                f"its upload for round {r.number} is fragment {manifest.fragment} of shape {list(shape)}; "
                f"the round takes fragment {fragment} of shape [{numel}]"
            )
            self._reject(r, site, wrong)
            raise InvalidUpdateError(f"upload refused: {wrong}")
        if r.shape is not None and (shape != r.shape or manifest.fragment != r.fragment):
            raise InvalidUpdateError(
                f"upload for round {r.number} is fragment {manifest.fragment} of shape {list(shape)}; the "
                f"round's other uploads are fragment {r.fragment} of shape {list(r.shape)}"
            )
        if blob.total_bytes > 2 * 4 * shape[0] + (1 << 20):
            raise ManifestTooLargeError(f"upload announces {blob.total_bytes} bytes, more than any codec produces")
        try:
            site_weight(run.weighting, samples=float(manifest.sample_weight), inner_steps=int(manifest.inner_steps))
        except ValueError as err:
            raise InvalidUpdateError(f"upload refused: {err}") from None
        # What the coordinator would refuse of this site's own upload, refused here for the site
        # alone (recorded, so the partial reports it and nobody waits for it): passed on, it
        # would make the coordinator refuse the whole partial and every site in it.
        why = check_inner_steps(int(manifest.inner_steps), run.most_inner_steps)
        if why is None:
            try:
                check_metrics(manifest.metrics)
            except InvalidUpdateError as err:
                why = str(err)
        if why is not None:
            # (``open_upload`` refused the upload already if the round went up.)
            if run.secure is None:
                self._reject(r, site, why)
            else:
                r.withdrawn.add(site)  # a secure round does not wait for it either
            raise InvalidUpdateError(f"upload refused: {why}")
        r.shape, r.fragment = shape, manifest.fragment

    def still_open(self, site: str, assembler: UploadAssembler, instance: str = "") -> None:
        """Between chunks: stop a stream whose round went upward without it, or whose process
        (``instance``) another one of the site replaced meanwhile."""
        with self.cond:
            self.check_instance(site, instance)
            r = self.round
            if r.assemblers.get(site) is not assembler or r.forwarded:
                raise WrongRoundError(
                    f"round {assembler.upload.round} is closed at relay {self.config.name!r}; apply "
                    "the round's broadcast (AwaitBroadcast)"
                )

    def finish_upload(self, site: str, assembler: UploadAssembler) -> pb.UploadResponse:
        """A complete stream: verify and add the update, then hold the answer until the
        coordinator took the partial sum that contains it (module doc of ``geoloco.relay``)."""
        self._verify_and_add(site, assembler)
        return self._await_acceptance(site, assembler)

    def _await_acceptance(self, site: str, assembler: UploadAssembler) -> pb.UploadResponse:
        """"Complete" only once the coordinator accepted the partial: if the relay dies before,
        the site's stream breaks and it uploads again to whatever address it fails over to, so
        nothing is lost. After ``ACCEPT_WAIT_S`` the answer is "all chunks in, not complete yet"
        and the site asks again (UploadStatus, then a stream of no chunks)."""
        number = assembler.upload.round
        with self.cond:
            self.cond.wait_for(
                lambda: self.closing or number in self.included or self.round.number != number,
                timeout=ACCEPT_WAIT_S,
            )
            if self.closing:
                raise StatusError("the relay is shutting down; upload again", code=grpc.StatusCode.UNAVAILABLE)
            if number in self.included:
                if site not in self.included[number]:
                    raise WrongRoundError(self._not_counted(number))
                return assembler.upload_response()
            if self.round.number != number:
                raise WrongRoundError(self._not_counted(number))
            return pb.UploadResponse(complete=False, received_bytes=assembler.received_bytes)

    def _not_counted(self, number: int) -> str:
        """Why a site's update of round ``number`` did not count through the relay (lock held)."""
        outcome = self.outcomes.get(number, "")
        what = (
            f"was {clip(outcome, 300)}" if outcome.startswith(("refused", "failed"))
            else "did not reach the coordinator in time"
        )
        return (
            f"round {number}'s partial sum from relay {self.config.name!r} {what}; the round's "
            "broadcast (AwaitBroadcast) says whether to keep the update for the next round"
        )

    def _verify_and_add(self, site: str, assembler: UploadAssembler) -> None:
        """Verify the update (checksum, codec, shape, finite values) and add it to the partial
        sum; one at a time, so at most one decoded update exists besides the sum."""
        manifest = assembler.upload
        with self._verify_lock:
            with self.cond:
                r = self.round
                if site in r.updates and r.assemblers.get(site) is assembler:
                    return
                self.still_open(site, assembler)
                run = self.run
                assert run is not None
            data = assembler.finish()  # a checksum mismatch resets the assembler (DATA_LOSS)
            if run.secure is not None:
                self._add_masked(site, assembler, data, run.secure)
                return
            what = f"site {site!r}'s update for round {manifest.round}"
            update, norm, finite = checked_update(
                what, data, manifest.blob.checksum.algorithm, codec=run.uplink_codec,
                numel=int(manifest.blob.shape[0]), device=torch.device("cpu"), dense=False,
            )
            weight = site_weight(
                run.weighting, samples=float(manifest.sample_weight), inner_steps=int(manifest.inner_steps)
            )
            screen, weights = Screen(norm, finite), [("the update's weight", weight)]
            with self.cond:
                if self.engine.screen(screen, weights=weights) is None:
                    self.still_open(site, assembler)
                assert r.core is not None  # opened with the round's first upload
                admission = self.engine.admit(
                    r.core, site, update, weight, screen=screen, weights=weights, now=self.clock()
                )
                if not admission.ok:
                    # Told upward with the round's partial, so the coordinator does not wait for it.
                    r.assemblers.pop(site, None)
                    self.cond.notify_all()
                    raise InvalidUpdateError(f"{what} is refused: {admission.reason}; it is dropped for this round")
                r.updates[site] = SiteUpdate(
                    weight=weight, inner_steps=int(manifest.inner_steps),
                    upload_bytes=int(manifest.blob.total_bytes), metrics=finite_metrics(manifest.metrics),
                )
                logger.debug("relay %s: round %d update of %s in", self.config.name, r.number, site)
                self.cond.notify_all()
            del update, data
            assembler.release()  # in the partial sum now
            if self.on_update is not None:
                self.on_update(int(manifest.round), site)

    def _add_masked(self, site: str, assembler: UploadAssembler, data: memoryview, secure: SecureRun) -> None:
        """Secure rounds: a masked upload goes into the ring sum as it is (the relay cannot read
        it, so no norm or weight check applies; the coordinator checks the partial's size)."""
        manifest = assembler.upload
        with self.cond:
            r = self.round
            try:
                self.still_open(site, assembler)
            except WrongRoundError:
                r.drop_masked(site)  # too late for the partial: nothing of it stays here
                raise
            r.add_masked(
                site, data, secure, inner_steps=int(manifest.inner_steps),
                upload_bytes=int(manifest.blob.total_bytes), metrics=finite_metrics(manifest.metrics),
            )
            assert r.core is not None  # opened with the round's first upload
            self.engine.admit(r.core, site, None, 1.0, screen=UNSCREENED, now=self.clock())
            self.cond.notify_all()
        if self.on_update is not None:
            self.on_update(int(manifest.round), site)

    def upload_status(self, site: str, request: pb.UploadStatusRequest) -> pb.UploadStatusResponse:
        with self.cond:
            self.check_session(request.session_id)
            self.check_instance(site, request.instance_id)
            r = self.round
            counted = self.included.get(request.round)
            if counted is not None:
                if site not in counted:
                    raise WrongRoundError(self._not_counted(request.round))
                return pb.UploadStatusResponse(known=True, complete=True)
            if request.round < r.number:
                raise WrongRoundError(self._not_counted(request.round))
            assembler = r.assemblers.get(site) if request.round == r.number else None
            if assembler is None:
                return pb.UploadStatusResponse(known=False)
            response = assembler.status_response()
            response.complete = False  # until the coordinator took the partial sum
            return response

    # -- the partial sum, upward --

    def take_due(self) -> tuple[RelayRound, pb.UploadManifest, bytes] | None:
        """The open round's partial, if it is due (``RelayRound.due``): marked forwarded, with
        its manifest and bytes."""
        now = self.clock()
        live = self.live_sites(now)
        with self.cond:
            if not self.partials:
                # Start-up: a listed site still starting would otherwise find the first round
                # closed here while the coordinator waits for it (bounded by max_wait_s). A site
                # that joined and then left or went silent is not waited for.
                live |= set(self.config.sites) - self.ever_joined
            r = self.round
            if r.forwarded or r.core is None:
                return None
            if not self.engine.decide(r.core, now=now, expected=live - r.withdrawn).close:
                return None
            r.forwarded = True
            self._forwarding.add(r.number)
            mean = r.mean()
            sites = list(r.updates)
            rejected = dict(r.rejected)
            session = self.session_id
            run = self.run
            assert run is not None
        try:
            if run.secure is not None:
                manifest, data = masked_partial(r, session, run.secure)
            else:
                manifest, data = self._plain_partial(r, session, run, mean, sites, rejected)
        except BaseException:
            # A partial that failed to build never goes up: nothing may wait for its answer.
            with self.cond:
                self._forwarding.discard(r.number)
                self.cond.notify_all()
            raise
        return r, manifest, data

    def _plain_partial(
        self, r: RelayRound, session: str, run: RunInfo, mean: torch.Tensor, sites: list[str],
        rejected: dict[str, str], *, left_out: frozenset[str] = frozenset(),
    ) -> tuple[pb.UploadManifest, bytes]:
        """A plain round's partial: the weighted mean, encoded for the way up, and its manifest;
        ``left_out``: refused sites whose updates were not judged (``pb.RelayedSite.left_out``)."""
        codec = run.uplink_codec if self.config.upward_codec == "uplink" else "none"
        fragment = r.fragment or 0
        if sites:
            before = self.residuals.get(fragment)
            encoded, residual = encode_partial(mean, r.weight, codec, before, seed=r.number)
            self._sent_residuals[r.number] = (fragment, before)
            if residual is not None:
                self.residuals[fragment] = residual
        else:  # every update was refused or withheld: the partial only reports that
            encoded, _ = encode_partial(mean, 1.0, "none", None)
        data = encoded.to_bytes()
        shape = list(mean.shape)
        del mean
        manifest = pb.UploadManifest(
            site="",
            session_id=session,
            round=r.number,
            fragment=r.fragment or 0,
            sample_weight=r.weight if sites else 0.0,
            inner_steps=sum(r.updates[s].inner_steps for s in sites),
            blob=blob_manifest(
                data, codec=encoded.spec, shape=shape, dtype="float32", chunk_size=self.config.chunk_size
            ),
            relayed_sites=[
                pb.RelayedSite(
                    site=s, weight=r.updates[s].weight, inner_steps=r.updates[s].inner_steps,
                    metrics=r.updates[s].metrics,
                )
                for s in sites
            ]
            + [
                pb.RelayedSite(site=s, weight=0.0, rejected=why, left_out=s in left_out)
                for s, why in rejected.items()
            ],
        )
        return manifest, data

    def refusals_only(
        self, r: RelayRound, why: str, *, judged: bool
    ) -> tuple[pb.UploadManifest, bytes] | None:
        """After the coordinator refused plain round ``r``'s partial: the partial that reports
        every site of it as refused (``why``), with no values, so the coordinator records them
        instead of waiting for sites whose updates cannot reach it any more (the relay holds only
        their sum). None in a secure run, where the coordinator counts sites through the protocol.
        ``judged``: the coordinator refused the partial's content (its norm, a weight), so its
        sites drop their updates as refused ones; otherwise it refused its place in the round (a
        site counted by another path) and they are only left out (``RelayedSite.left_out``), and
        keep them."""
        with self.cond:
            session, run = self.session_id, self.run
            if run is None or run.secure is not None:
                return None
            rejected = {**r.rejected, **dict.fromkeys(r.updates, why)}
            left_out = frozenset() if judged else frozenset(r.updates)
        return self._plain_partial(
            r, session, run, torch.zeros(0, dtype=torch.float32), [], rejected, left_out=left_out
        )

    def forwarded(
        self, r: RelayRound, outcome: str, sites: Iterable[str], *, disowned: bool = False,
        refused: frozenset[str] = frozenset(),
    ) -> None:
        """The coordinator's answer to round ``r``'s partial; then fetch its broadcast once.
        ``disowned``: the partial was refused and its sites reported as left out (``_disowned``);
        ``refused``: sites of a partial refused for its content, which drop their updates."""
        with self.cond:
            if disowned:
                self._disowned.add(r.number)
            self._disowned -= {n for n in self._disowned if n < r.number - KEEP_BROADCASTS}
            if self.engine.guard is not None:
                self.engine.guard.round_done(r.number, list(sites) if outcome == "accepted" else None)
            r.outcome = outcome
            self.included[r.number] = frozenset(sites) if outcome == "accepted" else frozenset()
            self._forwarding.discard(r.number)
            self.partials[r.number] = {s: r.updates[s].weight for s in r.updates}
            self.refused[r.number] = frozenset(r.rejected) | refused
            self.outcomes[r.number] = outcome
            for old in [n for n in self.partials if n < r.number - KEEP_BROADCASTS]:
                del self.partials[old], self.included[old], self.outcomes[old]
            for old in [n for n in self.refused if n < r.number - KEEP_BROADCASTS]:
                del self.refused[old]
            claim = next(iter(r.updates), None)
            self.cond.notify_all()
        if claim is not None:
            self.fetch_broadcast(r.number, claim)

    # -- the broadcast, downward --

    def fetch_broadcast(self, round_number: int, claim: str) -> None:
        """Start the one upstream AwaitBroadcast of ``round_number`` (made for site ``claim``)
        unless it is cached or on its way."""
        with self.cond:
            cached = self.broadcasts.get(round_number)
            if (cached is not None and cached.error is None) or round_number in self._fetching or self.closing:
                return
            self.broadcasts.pop(round_number, None)
            self._fetching.add(round_number)
            session = self.session_id
        thread = threading.Thread(
            target=self._fetch, args=(round_number, claim, session), name=f"geoloco-relay-broadcast-{round_number}",
            daemon=True,
        )
        thread.start()

    def _fetch(self, round_number: int, claim: str, session: str) -> None:
        request = pb.AwaitBroadcastRequest(site=claim, session_id=session, round=round_number)
        cached = CachedBroadcast(claim=claim)
        try:
            download = Download()
            header = read_broadcast_stream(self.upstream.stream("AwaitBroadcast", request), download)
            cached.header = header
            if header.action == pb.BROADCAST_ACTION_APPLY_DELTA:
                cached.data = bytes(download.result())
        except StatusError as err:
            cached.error = err
        except Exception as err:  # a malformed stream: the sites retry, and so does the relay
            logger.exception("relay %s: the broadcast of round %d could not be read", self.config.name, round_number)
            cached.error = StatusError(f"relay: broadcast unreadable ({err})", code=grpc.StatusCode.UNAVAILABLE)
        with self.cond:
            self.cond.wait_for(lambda: self.closing or round_number not in self._forwarding)
            self._fetching.discard(round_number)
            cached.included = self.included.get(round_number, frozenset())
            cached.disowned = round_number in self._disowned
            cached.sent = frozenset(self.partials.get(round_number, ()))
            cached.refused = self.refused.get(round_number, frozenset())
            self._settle_residual(round_number, cached)
            self.broadcasts[round_number] = cached
            for old in [n for n in self.broadcasts if n < round_number - KEEP_BROADCASTS]:
                del self.broadcasts[old]
            done = [n for n in self._broadcast_waits if n == round_number or n < round_number - KEEP_BROADCASTS]
            for number in done:
                self._broadcast_waits.pop(number).set()
            if cached.header is not None:
                self.run_finished = self.run_finished or cached.header.run_finished
                self._learn_round(cached.header.next_round)
                self._record(round_number)
            self.cond.notify_all()

    def _settle_residual(self, round_number: int, cached: CachedBroadcast) -> None:
        """The relay's upward error feedback follows what its sites are told (lock held): when
        the round's partial did not count (refused, aborted, left out), its sites keep their
        updates, so the relay's residual goes back to what it was before the partial. Without a
        broadcast (the wait failed) the partial's answer decides, and the next fetch of the round
        finds nothing left to settle."""
        sent = self._sent_residuals.pop(round_number, None)
        for old in [n for n in self._sent_residuals if n < round_number - KEEP_BROADCASTS]:
            del self._sent_residuals[old]
        if sent is None:
            return
        if cached.disowned:
            counted = False
        elif cached.header is not None:
            counted = cached.counts(cached.claim)
        else:
            counted = bool(cached.included)
        if counted:
            return
        fragment, before = sent
        if before is None:
            self.residuals.pop(fragment, None)
        else:
            self.residuals[fragment] = before

    def wait_broadcast(
        self, site: str, request: pb.AwaitBroadcastRequest, *, timeout_s: float
    ) -> tuple[pb.BroadcastHeader, bytes | None] | pb.RoundProgress | AskCoordinator:
        """Round ``request.round``'s broadcast for ``site`` (its own ``included``), or a progress
        message after ``timeout_s``, or ``AskCoordinator`` when only the coordinator knows
        whether the site counted (``CachedBroadcast.disowned``). A process replaced while it
        waits is refused (module doc): the header's ``included`` would speak of its successor's
        update."""
        round_number = request.round
        with self.cond:
            self.check_session(request.session_id)
            self.check_instance(site, request.instance_id)
            if site in self.members:
                self.members[site] = self.clock()
            r = self.round
            # While the open round's partial is still to go up, its upstream wait goes with it
            # (``RelayServer.forward_if_due``), claimed for a site of the partial, whose
            # ``included`` then speaks for the partial (``CachedBroadcast.counts``); a wait the
            # first waiting site started could be claimed for one that withheld.
            upward_pending = round_number in self._forwarding or (
                round_number == r.number and not r.forwarded and not (r.core is None and r.withdrawn)
            )
        if not upward_pending:
            self.fetch_broadcast(round_number, site)
        with self.cond:
            cached_already = self.closing or self._cached_ok_or_failed(round_number)
            event = None if cached_already else self._broadcast_waits.setdefault(round_number, threading.Event())
        if event is not None:
            event.wait(timeout_s)
        with self.cond:
            if self.closing:
                raise StatusError("the relay is shutting down; retry", code=grpc.StatusCode.UNAVAILABLE)
            self.check_instance(site, request.instance_id)
            cached = self.broadcasts.get(round_number)
            if cached is None:
                r = self.round
                return pb.RoundProgress(
                    round=round_number,
                    uploads_complete=len(r.updates) if r.number == round_number else 0,
                    quorum=self.run.quorum if self.run is not None else 0,
                )
            if cached.error is not None:
                self.broadcasts.pop(round_number, None)  # the next call asks the coordinator again
                raise cached.error
            assert cached.header is not None
            header = pb.BroadcastHeader()
            header.CopyFrom(cached.header)
            header.start_chunk = request.start_chunk
            if cached.disowned and site != cached.claim:
                return AskCoordinator(header, cached.data)
            header.included = cached.counts(site)
            # In a disowned round the claim's own header speaks of its own update, refusal too.
            header.refused = site in cached.refused or (cached.disowned and cached.header.refused)
            return header, cached.data

    def _cached_ok_or_failed(self, round_number: int) -> bool:
        return round_number in self.broadcasts

    # -- records --

    def _record(self, round_number: int) -> None:
        """One metrics record: the round's partial (which sites, their weights) and the bytes
        on every link since the previous record. Lock held."""
        self.records.append(
            {
                "relay": self.config.name,
                "round": round_number,
                "partial": self.partials.get(round_number, {}),
                "counted_by_coordinator": round_number in self.included and bool(self.included[round_number]),
                "bytes": self.traffic.take(),
                "time": time.time(),
            }
        )

    @property
    def done(self) -> bool:
        """The run finished and every site that joined through the relay left."""
        with self.cond:
            return self.run_finished and not self.members

    def close(self) -> None:
        with self.cond:
            self.closing = True
            for event in self._broadcast_waits.values():
                event.set()
            self._broadcast_waits.clear()
            self.cond.notify_all()


def _named(manifest: pb.UploadManifest, site: str) -> pb.UploadManifest:
    """The manifest as the relay stores it: naming the caller, without the sending process's
    instance_id (as the coordinator does: a restarted site's re-sent update is the same one)."""
    named = pb.UploadManifest()
    named.CopyFrom(manifest)
    named.site = site
    named.ClearField("instance_id")
    return named


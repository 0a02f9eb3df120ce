"""The coordinator's round state machine: pure, lock-protected, testable without a socket.

Rounds are numbered from 0, on the wire and in the strategy: round ``r`` starts from ``θ_r`` and
its broadcast turns ``θ_r`` into ``θ_{r+1}``.

Phases of a round::

    WAITING_FOR_QUORUM --(min_sites members)--> RUNNING --(close)--> AGGREGATING --> next round
                                                                                 \\-> FINISHED

* A round *starts* (its deadline clock begins) when at least ``min_sites`` sites are members.
  Uploads are accepted before the start too (sites may train while the quorum assembles).
* A round *closes* when at least ``min_sites`` uploads are aggregated and either every current
  member has completed (or been rejected), or the deadline has passed. With fewer than
  ``min_sites`` uploads it keeps waiting, past its deadline if need be. A site that joins during
  a round is waited for like the others (so sites that start a moment apart all make round 0);
  without a deadline that can stretch a round by one site's inner steps, which is what the
  deadline is for.
* At the close, members without a complete upload are *excluded* (stragglers): their later
  uploads are refused with FAILED_PRECONDITION / WRONG_ROUND and never applied; they keep their
  update in their error-feedback residual and catch up by applying the broadcast delta.
* Every complete upload is verified (checksum, codec, shape, dtype, finite values) and added to
  the single aggregation buffer at once. Non-finite values reject the site's update for the
  round (INVALID_ARGUMENT) without touching the buffer.
* Members that leave or stay silent longer than ``heartbeat_timeout_s`` are dropped; an upload
  they completed before vanishing stays in the aggregate (it was verified), a partial one is
  discarded. Quorum and weighting adapt because they only count what was aggregated.

Aggregation (outer step, downlink encoding, checkpoint) runs outside the state lock while the
phase is AGGREGATING, so heartbeats and waiting sites are served meanwhile; ``poll`` calls are
serialised so only one aggregation runs at a time. A checkpoint is written *before* the new
weights are broadcast: no site ever holds weights newer than the newest checkpoint (with
``checkpoint_every = 1``), so after a coordinator restart sites find their own digest and simply
re-send the update they already computed.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from geoloco.algorithms.params import ParamLayout, weights_digest
from geoloco.algorithms.round import CloseDecision, Round, RoundOutcome, RoundPolicy
from geoloco.algorithms.strategy import Strategy, build_strategy
from geoloco.algorithms.weighting import site_weight
from geoloco.compression import CodecError, Encoded, decode, parse_codec
from geoloco.coordinator import events as ev
from geoloco.coordinator.checkpoint import load_latest_checkpoint, save_checkpoint
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.privacy_rounds import PrivateRounds
from geoloco.coordinator.errors import (
    InvalidUpdateError,
    NotAMemberError,
    ProtocolVersionError,
    RunFinishedError,
    ShuttingDownError,
    SiteNotAllowedError,
    StaleSessionError,
    UpdateRejectedError,
    WrongRoundError,
)
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.wire import (
    MAX_CHUNK_SIZE,
    PROTOCOL_VERSION,
    ChunkRef,
    ManifestError,
    ManifestTooLargeError,
    UploadAssembler,
    blob_manifest,
    message_nbytes,
)

__all__ = [
    "BroadcastRecord",
    "EvalFn",
    "ModelSnapshot",
    "RoundPhase",
    "RoundStateMachine",
    "WaitResult",
    "canonical_codec",
    "resolve_device",
]

logger = logging.getLogger(__name__)

EvalFn = Callable[[torch.Tensor], float]
"""Held-out loss of flat fp32 global weights (on the CPU)."""

WEIGHTS_KEY = "weights"
"""Name of the global weights in a checkpoint's tensor file."""
STRATEGY_PREFIX = "strategy."
"""Prefix of the outer optimizer / downlink residual tensors in a checkpoint."""
PRIVACY_KEY = "privacy"
"""Checkpoint metadata key of the privacy accountant's state."""
SECURE_STAGE_WAIT_S = 1.0
"""Longest a SecureStage call is held waiting for its stage to close (the site calls again)."""


class RoundPhase(str, Enum):
    """Where the current round stands."""

    WAITING_FOR_QUORUM = "waiting_for_quorum"
    RUNNING = "running"
    AGGREGATING = "aggregating"
    FINISHED = "finished"


_OPEN_PHASES = (RoundPhase.WAITING_FOR_QUORUM, RoundPhase.RUNNING)
"""Phases in which the current round accepts uploads."""

CONTRIBUTOR_HISTORY = 64
"""Rounds whose contributor sets are kept, so a late site learns whether its update counted."""
HISTORY_KEY = "history"
"""Checkpoint metadata: recent rounds' contributors and folded late updates, and the adaptive
deadline's observations."""


def canonical_codec(spec: str) -> str:
    """The canonical spelling of a codec spec (what ``Encoded.spec`` carries)."""
    return parse_codec(spec).spec


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device = 'cuda' but CUDA is not available; use 'cpu' or 'auto'")
    return torch.device(device)


def _discarded(site: str, round_number: int) -> NotAMemberError:
    return NotAMemberError(
        f"site {site!r}'s upload for round {round_number} was discarded (the site was dropped, "
        "or a newer upload replaced it); call Join again"
    )


def sha256_checksum(hex_digest: str) -> pb.Checksum:
    return pb.Checksum(algorithm=pb.CHECKSUM_ALGORITHM_SHA256, digest=bytes.fromhex(hex_digest))


def _folded(response: pb.UploadResponse) -> pb.UploadResponse:
    response.folded_late = True
    return response


@dataclass(slots=True)
class _Member:
    name: str
    joined_s: float
    last_seen_s: float
    reported_round: int = 0
    reported_phase: int = pb.SITE_PHASE_UNSPECIFIED
    inner_steps_done: int = 0


@dataclass(frozen=True, slots=True)
class ModelSnapshot:
    """The current global weights as FetchModel serves them."""

    round: int
    weights: torch.Tensor
    """CPU, contiguous fp32 (never modified in place: each round installs a new tensor)."""
    digest: pb.Checksum


@dataclass(frozen=True, slots=True)
class BroadcastRecord:
    """What the coordinator broadcast at the end of ``round``."""

    round: int
    data: bytes
    """``Encoded.to_bytes()`` of the downlink delta."""
    blob: pb.BlobManifest
    weights_digest: pb.Checksum
    """Digest of ``θ_{round+1}``."""
    contributors: frozenset[str]
    run_finished: bool


@dataclass(frozen=True, slots=True)
class WaitResult:
    """Outcome of one ``wait_broadcast`` step: a header to send (with the delta's bytes for
    APPLY_DELTA), or a progress message while the round is still open."""

    header: pb.BroadcastHeader | None = None
    data: bytes | None = None
    progress: pb.RoundProgress | None = None


@dataclass(slots=True)
class _Round:
    """The open round: the round core's ``Round`` (contributors, weights, arrivals, folded late
    updates, rejected sites, the aggregation buffer, the deadline in force) plus what only the
    coordinator tracks: upload assemblers, bytes and the sites' own metrics."""

    core: Round
    departed: set[str] = field(default_factory=set)
    """Sites that left or were dropped during the round without contributing."""
    uploads: dict[str, UploadAssembler] = field(default_factory=dict)
    stale_uploads: dict[str, UploadAssembler] = field(default_factory=dict)
    """Uploads for the previous round, to be folded into this one (``late_updates = "fold"``)."""
    bytes_up: dict[str, int] = field(default_factory=dict)
    bytes_down: dict[str, int] = field(default_factory=dict)
    site_metrics: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def number(self) -> int:
        return self.core.number

    @property
    def contributed(self) -> dict[str, float]:
        return self.core.contributed

    @property
    def rejected(self) -> set[str]:
        return self.core.rejected

    @property
    def folded(self) -> dict[str, float]:
        return self.core.folded


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
    ) -> None:
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
        self.eval_fn = eval_fn
        self.clock = clock
        self.events = ev.EventHub(clock)
        """Observers (metrics, status page) listen here; see ``geoloco.coordinator.events``."""
        self.uplink_codec = canonical_codec(config.algorithm.uplink_codec)
        self.strategy = build_strategy(
            config.algorithm,
            numel=self.numel,
            outer_optimizer=config.outer_optimizer,
            inner_optimizer=config.inner_optimizer,
            seed=config.seed,
            device=self.device,
            layout=layout,
        )
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
        self._secure_closed: tuple[_Round, float, bool, RoundOutcome, list[str]] | None = None

        self._cond = threading.Condition(threading.RLock())
        self._poll_lock = threading.Lock()
        self._verify_lock = threading.Lock()
        self._verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="geoloco-verify")
        self._closing = False
        self._members: dict[str, _Member] = {}
        self._bytes_up_total = 0
        self._bytes_down_total = 0
        self._broadcast: BroadcastRecord | None = None
        self._contributor_history: dict[int, frozenset[str]] = {}
        self._finished_s: float | None = None
        algo = config.algorithm
        self.policy = RoundPolicy(
            min_sites=config.min_sites,
            round_deadline_s=config.round_deadline_s,
            adaptive_deadline=config.adaptive_deadline,
            late_updates=algo.late_updates,
            staleness_discount=algo.staleness_discount,
        )
        """Quorum, deadline in force (fixed or adaptive) and the late-update rule."""
        self._folded_history: dict[int, frozenset[str]] = {}
        """round t -> sites whose round-t update was folded into round t + 1."""

        weights = initial_weights.detach().to(self.device, torch.float32).clone()
        start_round = 0
        if config.checkpoint_dir is not None:
            checkpoint = load_latest_checkpoint(config.checkpoint_dir)
            if checkpoint is not None:
                weights, start_round = self._restore(checkpoint.tensors, checkpoint.metadata, checkpoint.round)
        self._set_weights(weights)
        now = self.clock()
        self._round = self._new_round(start_round, now)
        self._phase = RoundPhase.WAITING_FOR_QUORUM
        if config.total_rounds and start_round >= config.total_rounds:
            self._phase = RoundPhase.FINISHED
            self._finished_s = now
        self._pb_layout = self._build_pb_layout()
        self._run_config = self._build_run_config()
        logger.info(
            "coordinator session %s: round %d, %d parameters, digest %s",
            self.session_id, start_round, self.numel, self._digest_hex[:16],
        )

    # ---------------------------------------------------------------------------------------
    # Setup helpers

    def _restore(
        self, tensors: dict[str, torch.Tensor], metadata: dict[str, Any], round_number: int
    ) -> tuple[torch.Tensor, int]:
        if WEIGHTS_KEY not in tensors:
            raise ValueError(f"checkpoint in {self.config.checkpoint_dir} holds no {WEIGHTS_KEY!r} tensor")
        weights = tensors[WEIGHTS_KEY]
        if weights.dim() != 1 or weights.numel() != self.numel:
            raise ValueError(
                f"checkpoint in {self.config.checkpoint_dir} holds {weights.numel()} weights but the "
                f"model has {self.numel}; point checkpoint_dir at this model's run or delete it"
            )
        saved = metadata.get("config", {}).get("algorithm")
        if saved is not None and saved != self.config.algorithm.to_dict():
            logger.warning(
                "checkpoint was written with algorithm settings %s; resuming with %s",
                saved, self.config.algorithm.to_dict(),
            )
        strategy_tensors = {
            k.removeprefix(STRATEGY_PREFIX): v.to(self.device)
            for k, v in tensors.items()
            if k.startswith(STRATEGY_PREFIX)
        }
        self.strategy.load_state(strategy_tensors, metadata["strategy"])
        if self.privacy is not None:
            self.privacy.load_state(metadata.get(PRIVACY_KEY, {}))
        history = metadata.get(HISTORY_KEY, {})
        self._contributor_history = {
            int(t): frozenset(sites) for t, sites in history.get("contributors", {}).items()
        }
        self._folded_history = {int(t): frozenset(sites) for t, sites in history.get("folded", {}).items()}
        self.policy.load_state(history.get("deadline", []))
        logger.info(
            "resumed from checkpoint in %s at round %d", self.config.checkpoint_dir, round_number
        )
        return weights.to(self.device, torch.float32).contiguous(), round_number

    def _new_round(self, number: int, now: float) -> _Round:
        return _Round(core=Round(number=number, aggregation=self.strategy.new_aggregator(number), opened_s=now))

    def _set_weights(self, weights: torch.Tensor) -> None:
        self._weights = weights
        self._weights_cpu = weights.detach().to("cpu").contiguous()
        self._digest_hex = weights_digest(self._weights_cpu)
        self._digest = sha256_checksum(self._digest_hex)

    def _build_pb_layout(self) -> pb.ModelLayout:
        layout = pb.ModelLayout(numel=self.numel, dtype="float32")
        for entry in self.layout.entries:
            layout.tensors.add(
                name=entry.name, shape=list(entry.shape), offset=entry.offset, numel=entry.numel
            )
        return layout

    def _build_run_config(self) -> pb.RunConfig:
        c = self.config
        return pb.RunConfig(
            inner_steps=self.strategy.inner_steps,
            uplink_codec=self.uplink_codec,
            downlink_codec=canonical_codec(c.algorithm.downlink_codec),
            seed=c.seed,
            weighting={
                "samples": pb.WEIGHTING_SAMPLES, "steps": pb.WEIGHTING_STEPS
            }.get(c.algorithm.weighting, pb.WEIGHTING_UNIFORM),
            total_rounds=c.total_rounds,
            quorum=c.min_sites,
            round_deadline_ms=0 if c.round_deadline_s is None else int(c.round_deadline_s * 1000),
            heartbeat_interval_ms=int(c.heartbeat_interval_s * 1000),
            heartbeat_timeout_ms=int(c.heartbeat_timeout_s * 1000),
            config_json=json.dumps(c.to_dict(), sort_keys=True),
        )

    # ---------------------------------------------------------------------------------------
    # Read-only views (thread-safe snapshots)

    @property
    def round(self) -> int:
        """The round currently open (or ``total_rounds`` once finished)."""
        return self._round.number

    @property
    def phase(self) -> RoundPhase:
        return self._phase

    @property
    def weights(self) -> torch.Tensor:
        """``θ_round`` on the CPU (a tensor that is never modified in place)."""
        return self._weights_cpu

    @property
    def digest_hex(self) -> str:
        return self._digest_hex

    @property
    def members(self) -> list[str]:
        with self._cond:
            return sorted(self._members)

    @property
    def finished(self) -> bool:
        return self._phase is RoundPhase.FINISHED

    def run_config(self) -> pb.RunConfig:
        return self._run_config

    # -- Streaming DiLoCo: which fragment a round syncs --

    def fragment_of(self, round_number: int) -> int:
        """Fragment round ``round_number`` synchronises (0 without streaming)."""
        return self.strategy.fragment_for_round(round_number)

    def update_numel(self, round_number: int) -> int:
        """Elements of round ``round_number``'s uploads (its fragment's, or the model's)."""
        return self.strategy.update_numel(round_number)

    def round_seed(self, round_number: int) -> int:
        """Seed shared by every site for round ``round_number``."""
        return self.strategy.configure_round(round_number, ()).seed

    def _round_info(self, now: float) -> pb.RoundInfo:
        r = self._round
        if (deadline_at := r.core.deadline_at) is not None:
            remaining = max(0.0, deadline_at - now)
        elif (upcoming := self.policy.deadline_s()) is not None:
            remaining = upcoming
        else:
            remaining = 0.0
        return pb.RoundInfo(
            round=r.number,
            round_seed=self.round_seed(r.number),
            deadline_remaining_ms=int(remaining * 1000),
        )

    def round_info(self) -> pb.RoundInfo:
        with self._cond:
            return self._round_info(self.clock())

    def status(self) -> dict[str, Any]:
        """A JSON-able view for logs and tests."""
        with self._cond:
            r = self._round
            return {
                "session_id": self.session_id,
                "round": r.number,
                "phase": self._phase.value,
                "members": sorted(self._members),
                "pending": sorted(r.core.pending(self._members)),
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
                "digest": self._digest_hex,
            }

    # ---------------------------------------------------------------------------------------
    # Membership

    def _check_allowed(self, site: str) -> None:
        allowed = self.config.allowed_sites
        if allowed is not None and site not in allowed:
            raise SiteNotAllowedError(
                f"site {site!r} is not in this run's allowed_sites ({', '.join(allowed)}); add it "
                "to the coordinator's config"
            )

    def _check_session(self, session_id: str) -> None:
        if session_id != self.session_id:
            raise StaleSessionError(
                f"session {session_id!r} is not the coordinator's current session "
                f"{self.session_id!r} (it restarted); call Join again"
            )

    def _member(self, site: str, session_id: str) -> _Member:
        """Check session and membership, and count the call as a sign of life."""
        self._check_allowed(site)
        self._check_session(session_id)
        member = self._members.get(site)
        if member is None:
            raise NotAMemberError(
                f"site {site!r} is not a member of the run (never joined, left, or dropped after "
                f"{self.config.heartbeat_timeout_s:g} s without a heartbeat); call Join again"
            )
        member.last_seen_s = self.clock()
        return member

    def join(
        self,
        site: str,
        *,
        protocol_version: int,
        has_weights: bool = False,
        weights_digest: pb.Checksum | None = None,
        software_version: str = "",
    ) -> pb.JoinResponse:
        """Register (or re-register) ``site``; says whether it must fetch the model."""
        if protocol_version != PROTOCOL_VERSION:
            raise ProtocolVersionError(
                f"site speaks protocol version {protocol_version}, this coordinator speaks "
                f"{PROTOCOL_VERSION}; install the same geoloco version on both sides"
            )
        self._check_allowed(site)
        with self._cond:
            now = self.clock()
            member = self._members.get(site)
            if member is None:
                self._members[site] = _Member(name=site, joined_s=now, last_seen_s=now)
                logger.info(
                    "site %s joined at round %d (%d members)%s",
                    site, self._round.number, len(self._members),
                    f", software {software_version}" if software_version else "",
                )
            else:
                member.last_seen_s = now
                logger.info("site %s re-joined at round %d", site, self._round.number)
            self.events.emit(ev.SITE_JOINED, site=site, round=self._round.number, rejoin=member is not None)
            self._maybe_start(now)
            same = (
                has_weights
                and weights_digest is not None
                and weights_digest.algorithm == self._digest.algorithm
                and weights_digest.digest == self._digest.digest
            )
            response = pb.JoinResponse(
                session_id=self.session_id,
                site=site,
                config=self._run_config,
                round=self._round_info(now),
                layout=self._pb_layout,
                weights_digest=self._digest,
                must_fetch_model=not same,
                protocol_version=PROTOCOL_VERSION,
            )
            self._cond.notify_all()
            return response

    def leave(self, site: str, session_id: str, reason: str = "") -> None:
        with self._cond:
            self._member(site, session_id)
            self.events.emit(ev.SITE_LEFT, site=site, round=self._round.number, reason=reason)
            self._remove_member(site, f"left ({reason})" if reason else "left")
            self._cond.notify_all()

    def heartbeat(
        self,
        site: str,
        session_id: str,
        *,
        round_number: int = 0,
        phase: int = pb.SITE_PHASE_UNSPECIFIED,
        inner_steps_done: int = 0,
    ) -> pb.HeartbeatResponse:
        """Record a sign of life; a stale session or a dropped site is told to re-join."""
        self._check_allowed(site)
        with self._cond:
            now = self.clock()
            member = self._members.get(site)
            rejoin = session_id != self.session_id or member is None
            if member is not None and not rejoin:
                member.last_seen_s = now
                member.reported_round = round_number
                member.reported_phase = phase
                member.inner_steps_done = inner_steps_done
                self.events.emit(
                    ev.HEARTBEAT, site=site, round=round_number, phase=phase, inner_steps_done=inner_steps_done
                )
            return pb.HeartbeatResponse(
                rejoin_required=rejoin,
                round=self._round_info(now),
                run_finished=self._phase is RoundPhase.FINISHED,
            )

    def _remove_member(self, site: str, why: str) -> None:
        self._members.pop(site, None)
        r = self._round
        if site not in r.contributed:
            r.uploads.pop(site, None)
            r.departed.add(site)
        logger.info("site %s %s at round %d (%d members left)", site, why, r.number, len(self._members))

    def _maybe_start(self, now: float) -> None:
        r = self._round
        if self._phase is RoundPhase.WAITING_FOR_QUORUM and len(self._members) >= self.config.min_sites:
            r.core.start(now, self.policy)
            self._phase = RoundPhase.RUNNING
            if self.privacy is not None:
                self.privacy.start_round(
                    r.number, self.round_seed(r.number), now, numel=self.update_numel(r.number)
                )
            self.events.emit(ev.ROUND_STARTED, round=r.number, members=len(self._members))
            logger.info(
                "round %d started with %d sites%s", r.number, len(self._members),
                "" if r.core.deadline_s is None else
                f", {'adaptive ' if self.policy.deadline.is_adaptive else ''}deadline in "
                f"{r.core.deadline_s:.3g} s",
            )

    # ---------------------------------------------------------------------------------------
    # FetchModel

    def model_snapshot(self, site: str, session_id: str) -> ModelSnapshot:
        with self._cond:
            self._member(site, session_id)
            return ModelSnapshot(round=self._round.number, weights=self._weights_cpu, digest=self._digest)

    def model_layout(self) -> pb.ModelLayout:
        return self._pb_layout

    def count_bytes_down(self, site: str, nbytes: int) -> None:
        """Bytes sent to ``site`` (FetchModel, AwaitBroadcast), counted in the current round."""
        with self._cond:
            d = self._round.bytes_down
            d[site] = d.get(site, 0) + nbytes
            self._bytes_down_total += nbytes
            self.events.emit(ev.BYTES_SENT, site=site, nbytes=nbytes)

    # ---------------------------------------------------------------------------------------
    # Upload

    def _check_upload_round(self, round_number: int) -> None:
        current = self._round.number
        if self._phase is RoundPhase.FINISHED:
            raise RunFinishedError(
                f"the run finished after round {current - 1}; no more uploads are accepted"
            )
        if round_number < current or (
            round_number == current and self._phase is RoundPhase.AGGREGATING
        ):
            raise WrongRoundError(
                f"round {round_number} is closed (the coordinator is at round {current}"
                f"{', aggregating' if self._phase is RoundPhase.AGGREGATING else ''}); this update "
                "is not applied: keep it in the error-feedback residual and apply the round's "
                "broadcast (AwaitBroadcast)"
            )
        if round_number > current:
            raise WrongRoundError(
                f"round {round_number} is not open yet; the coordinator is at round {current}"
            )

    def _validate_upload_manifest(self, site: str, manifest: pb.UploadManifest) -> None:
        if manifest.site and manifest.site != site:
            raise InvalidUpdateError(
                f"upload manifest names site {manifest.site!r} but the caller is {site!r}"
            )
        fragment = self.fragment_of(manifest.round)
        if manifest.fragment != fragment:
            raise InvalidUpdateError(
                f"upload for round {manifest.round} names fragment {manifest.fragment}; that round "
                f"synchronises fragment {fragment} (fragment = round mod fragments)"
            )
        numel = self.update_numel(manifest.round)
        blob = manifest.blob
        if blob.codec != self.uplink_codec:
            raise InvalidUpdateError(
                f"upload codec {blob.codec!r} is not the run's uplink codec {self.uplink_codec!r}; "
                "encode with RunConfig.uplink_codec"
            )
        if blob.dtype != "float32":
            raise InvalidUpdateError(
                f"upload dtype {blob.dtype!r} is not allowed; pseudo-gradients are 'float32'"
            )
        if list(blob.shape) != [numel]:
            what = "" if numel == self.numel else f" of fragment {fragment}"
            raise InvalidUpdateError(
                f"upload shape {list(blob.shape)} does not match the model: expected "
                f"[{numel}] (the flat parameter vector{what})"
            )
        if self.config.algorithm.weighting == "steps" and manifest.inner_steps < 1:
            raise InvalidUpdateError(
                "this run weights updates by inner steps (weighting = 'steps'); the manifest must "
                f"carry inner_steps >= 1, got {manifest.inner_steps}"
            )
        weight = manifest.sample_weight
        if not (math.isfinite(weight) and weight > 0):
            raise InvalidUpdateError(
                f"sample_weight {weight} is not allowed; send the samples (or tokens) trained on "
                "this round, a finite number > 0"
            )
        if blob.total_bytes > self.max_upload_bytes:
            raise ManifestTooLargeError(
                f"upload announces {blob.total_bytes} bytes, more than the {self.max_upload_bytes} "
                "this coordinator accepts for this model"
            )

    def open_upload(self, site: str, manifest: pb.UploadManifest) -> UploadAssembler:
        """Check an Upload stream's manifest and return the (new or resumed) assembler."""
        with self._cond:
            self._member(site, manifest.session_id)
            if self._folds_late(site, manifest.round):
                return self._open_late_upload(site, manifest)
            self._check_upload_round(manifest.round)
            r = self._round
            if site in r.rejected:
                raise UpdateRejectedError(
                    f"site {site!r}'s update for round {r.number} was rejected (non-finite values) "
                    "and is dropped for this round; wait for the broadcast (AwaitBroadcast)"
                )
            self._validate_upload_manifest(site, manifest)
            normalized = pb.UploadManifest()
            normalized.CopyFrom(manifest)
            normalized.site = site
            existing = r.uploads.get(site)
            if existing is not None:
                if site in r.contributed or existing.upload == normalized:
                    existing.check_same_manifest(normalized)  # MANIFEST_CONFLICT if it differs
                    return existing
                # A different update for the same round before the first completed: the site
                # restarted and recomputed it. The newest one wins; the partial one is dropped.
                logger.info("round %d: %s replaced its partial upload", r.number, site)
            assembler = UploadAssembler(
                normalized, max_total_bytes=self.max_upload_bytes, max_chunk_size=MAX_CHUNK_SIZE
            )
            r.uploads[site] = assembler
            self.events.emit(ev.UPLOAD_OPENED, site=site, round=r.number)
            r.site_metrics[site] = dict(manifest.metrics)
            self._count_up(site, message_nbytes(manifest))
            return assembler

    def _count_up(self, site: str, nbytes: int) -> None:
        d = self._round.bytes_up
        d[site] = d.get(site, 0) + nbytes
        self._bytes_up_total += nbytes
        self.events.emit(ev.BYTES_RECEIVED, site=site, nbytes=nbytes)

    def live_chunks(
        self, site: str, assembler: UploadAssembler, requests: Iterable[pb.UploadRequest | ChunkRef]
    ) -> Iterator[pb.Chunk | ChunkRef]:
        """The chunks of an Upload stream, counted as received bytes; stops the stream with
        WRONG_ROUND as soon as its round closes, so a straggler stops wasting its link."""
        round_number = assembler.upload.round
        for request in requests:
            kind = request.WhichOneof("kind")
            if kind != "chunk":
                raise ManifestError(
                    f"Upload stream has a {kind!r} message after its manifest; only chunks may follow"
                )
            with self._cond:
                self._count_up(site, message_nbytes(request))
                if self._round.stale_uploads.get(site) is assembler and self._phase in _OPEN_PHASES:
                    yield request.chunk
                    continue
                if self._round.number != round_number or self._phase not in _OPEN_PHASES:
                    self._check_upload_round(round_number)
                if self._round.uploads.get(site) is not assembler:
                    raise _discarded(site, round_number)
            yield request.chunk

    def finish_upload(self, site: str, assembler: UploadAssembler) -> pb.UploadResponse:
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
            return assembler.upload_response()
        with self._cond:
            late = self._round.stale_uploads.get(site) is assembler
        try:
            future = self._verifier.submit(
                self._verify_and_fold if late else self._verify_and_add, site, assembler
            )
        except RuntimeError:  # the executor is shut down: close() was called
            raise ShuttingDownError(
                "the coordinator is shutting down; retry to reach its successor"
            ) from None
        return future.result()

    def _verify_and_add(self, site: str, assembler: UploadAssembler) -> pb.UploadResponse:
        round_number = assembler.upload.round
        with self._verify_lock:
            with self._cond:
                if site in self._round.contributed and self._round.number == round_number:
                    return assembler.upload_response()
                self._check_upload_round(round_number)
            data = assembler.finish()  # checksum; a mismatch resets the assembler (DATA_LOSS)
            decoded = self._decode_update(site, round_number, data)
            if not bool(torch.isfinite(decoded).all()):
                with self._cond:
                    if self._round.number == round_number:
                        self._round.core.reject(site)
                        self._round.uploads.pop(site, None)
                        self._cond.notify_all()
                self.events.emit(ev.UPDATE_REJECTED, site=site, round=round_number, why="NaN or Inf values")
                raise InvalidUpdateError(
                    f"site {site!r}'s update for round {round_number} contains NaN or Inf values; "
                    "it is dropped for this round (check the site's loss and learning rate)"
                )
            weight = self._upload_weight(assembler.upload)
            if self.privacy is not None:  # central DP: the trusted coordinator clips each update
                decoded = self.privacy.clip(decoded)
            with self._cond:
                self._check_upload_round(round_number)
                r = self._round
                if r.uploads.get(site) is not assembler:
                    raise _discarded(site, round_number)
                r.core.add(decoded, weight, site=site, now=self.clock())
                self.events.emit(ev.UPDATE_AGGREGATED, site=site, round=round_number, weight=weight)
                logger.debug(
                    "round %d: update of %s aggregated (%d of %d members)",
                    round_number, site, len(r.contributed), len(self._members),
                )
                self._cond.notify_all()
            del decoded
        return assembler.upload_response()

    # ---------------------------------------------------------------------------------------
    # Secure aggregation (the protocol itself is in geoloco.coordinator.privacy_rounds)

    @property
    def secure(self) -> bool:
        """Uploads are masked and go through ``secure_upload`` / ``secure_stage``."""
        return self.privacy is not None and self.privacy.secure

    def secure_stage(
        self, site: str, session_id: str, round_number: int, stage: str, payload: bytes, *, wait_s: float
    ) -> pb.SecureStageResponse:
        """One SecureStage call: record the message, wait up to ``wait_s`` for the stage to close."""
        if self.privacy is None or not self.privacy.secure:
            raise InvalidUpdateError(
                "secure aggregation is off in this run ([privacy] secure_aggregation = false); "
                "upload plain updates"
            )
        privacy = self.privacy
        with self._cond:
            self._member(site, session_id)
            if self._phase is RoundPhase.FINISHED or round_number > self._round.number:
                self._check_upload_round(round_number)
            deadline = self.clock() + wait_s
            reply = privacy.stage(site, round_number, stage, payload, set(self._members), self.clock())
            self._cond.notify_all()
            while not reply.ready and not self._closing:
                left = deadline - self.clock()
                if left <= 0:
                    break
                self._cond.wait(timeout=min(left, 0.25))
                reply = privacy.stage(site, round_number, stage, payload, set(self._members), self.clock())
            return pb.SecureStageResponse(
                ready=reply.ready, payload=reply.payload, aborted=bool(reply.aborted), abort_reason=reply.aborted
            )

    def secure_upload(
        self, site: str, manifest: pb.UploadManifest, requests: Iterable[pb.UploadRequest | ChunkRef]
    ) -> pb.UploadResponse:
        """A masked Upload stream: each chunk goes straight into the protocol's sum."""
        assert self.privacy is not None
        privacy = self.privacy
        with self._cond:
            self._member(site, manifest.session_id)
            self._check_upload_round(manifest.round)
            if manifest.site and manifest.site != site:
                raise InvalidUpdateError(f"upload manifest names site {manifest.site!r} but the caller is {site!r}")
            fragment = self.fragment_of(manifest.round)
            if manifest.fragment != fragment:
                raise InvalidUpdateError(
                    f"masked upload for round {manifest.round} names fragment {manifest.fragment}; "
                    f"that round's secure sum is over fragment {fragment}"
                )
            try:
                upload = privacy.open_upload(site, manifest)
            finally:
                self._cond.notify_all()  # a refused upload may let the key stage close now
            r = self._round
            self.events.emit(ev.UPLOAD_OPENED, site=site, round=r.number)
            r.site_metrics[site] = dict(manifest.metrics)
            self._count_up(site, message_nbytes(manifest))
        for request in requests:
            kind = request.WhichOneof("kind")
            if kind != "chunk":
                raise ManifestError(f"Upload stream has a {kind!r} message after its manifest; only chunks may follow")
            with self._cond:
                self._count_up(site, message_nbytes(request))
                if self._round.number != manifest.round or self._phase not in _OPEN_PHASES:
                    self._check_upload_round(manifest.round)
                privacy.add_chunk(site, upload, request.chunk.index, request.chunk.data)
                if upload.complete and site not in self._round.contributed:
                    self._round.core.count(site, 1.0, now=self.clock())
                    self.events.emit(ev.UPDATE_AGGREGATED, site=site, round=manifest.round, weight=1.0)
                    self._cond.notify_all()
        with self._cond:
            return privacy.upload_response(upload)

    def _decode_update(self, site: str, round_number: int, data: memoryview) -> torch.Tensor:
        what = f"site {site!r}'s update for round {round_number}"
        numel = self.update_numel(round_number)
        try:
            encoded = Encoded.from_bytes(data)
        except CodecError as err:
            raise InvalidUpdateError(f"{what} is not a valid encoded tensor: {err}") from None
        if encoded.spec != self.uplink_codec:
            raise InvalidUpdateError(
                f"{what} was encoded with {encoded.spec!r}; the run's uplink codec is "
                f"{self.uplink_codec!r}"
            )
        if encoded.shape != (numel,) or encoded.dtype != torch.float32:
            raise InvalidUpdateError(
                f"{what} decodes to {encoded.dtype} {list(encoded.shape)}; expected float32 "
                f"[{numel}]"
            )
        try:
            decoded = decode(encoded, device=self.device)
        except CodecError as err:
            raise InvalidUpdateError(f"{what} cannot be decoded: {err}") from None
        if decoded.shape != (numel,) or decoded.dtype != torch.float32:
            raise InvalidUpdateError(
                f"{what} decoded to {decoded.dtype} {list(decoded.shape)}; expected float32 [{numel}]"
            )
        return decoded

    # ---------------------------------------------------------------------------------------
    # Heterogeneous sites: work-based weights and late updates (``late_updates = "fold"``)

    def _upload_weight(self, manifest: pb.UploadManifest) -> float:
        """``w_k`` of an upload under the run's weighting (``geoloco.algorithms.weighting``)."""
        return site_weight(
            self.config.algorithm.weighting,
            samples=float(manifest.sample_weight),
            inner_steps=int(manifest.inner_steps),
        )

    def _folds_late(self, site: str, round_number: int) -> bool:
        """Whether an upload for ``round_number`` is a late update to fold into the open round:
        exactly one round late, folding on, and the site's update did not count in its round."""
        r = self._round
        return (
            self.policy.folds_late_updates
            and round_number + 1 == r.number
            and self._phase in _OPEN_PHASES
            and site not in self._contributor_history.get(round_number, frozenset())
        )

    def _open_late_upload(self, site: str, manifest: pb.UploadManifest) -> UploadAssembler:
        """The (new or resumed) assembler of a late update; called with the lock held."""
        r = self._round
        self._validate_upload_manifest(site, manifest)
        normalized = pb.UploadManifest()
        normalized.CopyFrom(manifest)
        normalized.site = site
        existing = r.stale_uploads.get(site)
        if existing is not None and (site in r.folded or existing.upload == normalized):
            existing.check_same_manifest(normalized)
            return existing
        assembler = UploadAssembler(
            normalized, max_total_bytes=self.max_upload_bytes, max_chunk_size=MAX_CHUNK_SIZE
        )
        r.stale_uploads[site] = assembler
        self._count_up(site, message_nbytes(manifest))
        logger.info("round %d: %s is sending its late update of round %d", r.number, site, manifest.round)
        return assembler

    def _verify_and_fold(self, site: str, assembler: UploadAssembler) -> pb.UploadResponse:
        """Verify a complete late update and add it to the open round with the staleness
        discount; it does not count towards the quorum (``r.contributed``)."""
        round_number = assembler.upload.round
        with self._verify_lock:
            with self._cond:
                if site in self._round.folded:
                    return _folded(assembler.upload_response())
            data = assembler.finish()
            decoded = self._decode_update(site, round_number, data)
            if not bool(torch.isfinite(decoded).all()):
                raise InvalidUpdateError(
                    f"site {site!r}'s late update for round {round_number} contains NaN or Inf "
                    "values; it is dropped"
                )
            weight = self._upload_weight(assembler.upload)
            with self._cond:
                r = self._round
                if r.number != round_number + 1 or self._phase not in _OPEN_PHASES:
                    self._check_upload_round(round_number)  # raises WRONG_ROUND: it is too late
                if r.stale_uploads.get(site) is not assembler:
                    raise _discarded(site, round_number)
                weight = r.core.fold(decoded, weight, site=site, policy=self.policy)
                self.events.emit(
                    ev.UPDATE_AGGREGATED, site=site, round=round_number, weight=weight, late=True
                )
                logger.info(
                    "round %d: late update of %s (round %d) folded in with weight %.4g",
                    r.number, site, round_number, weight,
                )
                self._cond.notify_all()
            del decoded
        return _folded(assembler.upload_response())

    def _was_folded(self, site: str, round_number: int) -> bool:
        """Whether ``site``'s update of ``round_number`` entered the next round (late)."""
        if site in self._folded_history.get(round_number, frozenset()):
            return True
        return round_number + 1 == self._round.number and site in self._round.folded

    def upload_status(
        self, site: str, session_id: str, round_number: int, fragment: int
    ) -> pb.UploadStatusResponse:
        with self._cond:
            self._member(site, session_id)
            r = self._round
            if self.privacy is not None and self.privacy.secure and round_number == r.number:
                return self.privacy.upload_status(site, round_number)
            assembler = (
                r.uploads.get(site)
                if round_number == r.number and fragment == self.fragment_of(round_number)
                else None
            )
            late = round_number + 1 == r.number and fragment == self.fragment_of(round_number)
            if late and site in r.stale_uploads:
                assembler = r.stale_uploads[site]
                response = assembler.status_response()
                response.complete = site in r.folded
                response.folded_late = response.complete
                return response
            if assembler is None:
                if round_number < r.number or self._phase is RoundPhase.FINISHED:
                    self._check_upload_round(round_number)
                return pb.UploadStatusResponse(known=False)
            response = assembler.status_response()
            response.complete = site in r.contributed
            return response

    # ---------------------------------------------------------------------------------------
    # AwaitBroadcast

    def _header_for(self, site: str, round_number: int, now: float, start_chunk: int) -> WaitResult:
        record = self._broadcast
        next_round = self._round_info(now)
        finished = self._phase is RoundPhase.FINISHED
        if record is not None and record.round == round_number:
            if start_chunk > record.blob.num_chunks:
                raise InvalidUpdateError(
                    f"start_chunk {start_chunk} is past the delta's {record.blob.num_chunks} chunks"
                )
            header = pb.BroadcastHeader(
                action=pb.BROADCAST_ACTION_APPLY_DELTA,
                round=round_number,
                included=site in record.contributors or self._was_folded(site, round_number),
                num_contributors=len(record.contributors),
                delta=record.blob,
                weights_digest=record.weights_digest,
                next_round=next_round,
                run_finished=record.run_finished,
                start_chunk=start_chunk,
            )
            return WaitResult(header=header, data=record.data)
        contributors = self._contributor_history.get(round_number, frozenset())
        header = pb.BroadcastHeader(
            action=pb.BROADCAST_ACTION_RESYNC,
            round=round_number,
            included=site in contributors or self._was_folded(site, round_number),
            num_contributors=len(contributors),
            weights_digest=self._digest,
            next_round=next_round,
            run_finished=finished,
        )
        return WaitResult(header=header)

    def wait_broadcast(
        self,
        site: str,
        session_id: str,
        round_number: int,
        *,
        timeout_s: float,
        start_chunk: int = 0,
        check_member: bool = True,
    ) -> WaitResult:
        """Block until round ``round_number`` is aggregated (then a header) or ``timeout_s``
        passes (then a progress message). Rounds older than the last broadcast get RESYNC."""
        with self._cond:
            if check_member:
                self._member(site, session_id)
            else:
                self._check_session(session_id)
            if round_number > self._round.number:
                raise WrongRoundError(
                    f"round {round_number} is not open yet; the coordinator is at round "
                    f"{self._round.number}"
                )
            if round_number == self._round.number and self._phase is RoundPhase.FINISHED:
                raise RunFinishedError(
                    f"the run finished after round {round_number - 1}; there is no round "
                    f"{round_number} to wait for"
                )
            if self.secure and round_number == self._round.number and check_member:
                # A site waiting for the broadcast without having advertised keys will not
                # (e.g. its key stages ran with this coordinator's predecessor).
                assert self.privacy is not None
                self.privacy.withdraw(site, round_number, set(self._members), self.clock())
                self._cond.notify_all()
            self._cond.wait_for(
                lambda: self._closing or self._round.number != round_number,
                timeout=timeout_s,
            )
            if self._closing:
                raise ShuttingDownError("the coordinator is shutting down; retry to reach its successor")
            now = self.clock()
            if self._round.number != round_number:
                return self._header_for(site, round_number, now, start_chunk)
            r = self._round
            deadline_at = r.core.deadline_at
            remaining = 0.0 if deadline_at is None else max(0.0, deadline_at - now)
            return WaitResult(
                progress=pb.RoundProgress(
                    round=round_number,
                    uploads_complete=len(r.contributed),
                    quorum=self.config.min_sites,
                    deadline_remaining_ms=int(remaining * 1000),
                )
            )

    # ---------------------------------------------------------------------------------------
    # Time-driven transitions

    def _drop_silent(self, now: float) -> None:
        limit = self.config.heartbeat_timeout_s
        for name, member in list(self._members.items()):
            if now - member.last_seen_s > limit:
                self.events.emit(
                    ev.SITE_DROPPED, site=name, round=self._round.number, silent_s=now - member.last_seen_s
                )
                self._remove_member(name, f"dropped after {now - member.last_seen_s:.1f} s of silence")

    def _decide(self, now: float) -> CloseDecision:
        """Whether the open round closes now: the round policy's rule, or with secure
        aggregation the protocol's (``PrivateRounds.close_decision``)."""
        if self._phase not in _OPEN_PHASES:
            return CloseDecision(close=False)
        r = self._round.core
        if self.privacy is not None and self.privacy.secure:
            # Secure rounds have no deadline (the config refuses one) and never close before
            # their quorum started them: the protocol decides once key sharing ran.
            if not r.started:
                return CloseDecision(close=False)
            return CloseDecision(
                close=self.privacy.close_decision(set(self._members), set(r.contributed), self.config.min_sites, False)
            )
        return r.decide(self.policy, now=now, expected=self._members)

    def next_poll_in(self) -> float:
        """Seconds until ``poll`` has time-driven work (a deadline, a heartbeat check)."""
        with self._cond:
            now = self.clock()
            wait = self.config.heartbeat_timeout_s / 4
            deadline_at = self._round.core.deadline_at
            if deadline_at is not None and self._phase is RoundPhase.RUNNING:
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

    def poll(self) -> dict[str, Any] | None:
        """Drop silent sites, start or close the round; aggregate when it closes.

        Returns the round's metrics record when a round was aggregated, else None.
        """
        with self._poll_lock:
            with self._cond:
                if self._closing:
                    return None
                now = self.clock()
                self._drop_silent(now)
                self._maybe_start(now)
                if self._secure_closed is None:
                    decision = self._decide(now)
                    if not decision.close:
                        return None
                    self._phase = RoundPhase.AGGREGATING
                    r = self._round
                    outcome = r.core.close(now=now, expected=self._members)
                    partial = sorted(set(r.uploads) - set(r.contributed))
                    self._cond.notify_all()
                    args = (r, now, decision.deadline_hit, outcome, partial)
                    if self.privacy is not None and self.privacy.secure:
                        # Secure aggregation: the survivors unmask the sum before it exists.
                        self.privacy.close_upload(now)
                        self._secure_closed = args
                if self._secure_closed is not None:
                    assert self.privacy is not None
                    self.privacy.advance(set(self._members), now)
                    self._cond.notify_all()
                    if not self.privacy.unmasked:
                        return None
                    args, self._secure_closed = self._secure_closed, None
            return self._aggregate(*args)

    def _aggregate(
        self,
        r: _Round,
        closed_s: float,
        deadline_hit: bool,
        outcome: RoundOutcome,
        partial: list[str],
    ) -> dict[str, Any]:
        # Memory: the aggregation buffer and the encoded downlink are released as soon as they
        # are used (no caller frame holds them), so neither is alive while the checkpoint is
        # written. The weights and the aggregator cannot change meanwhile: the phase is
        # AGGREGATING (uploads are refused) and ``_poll_lock`` is held.
        t0 = time.perf_counter()
        contributors = list(outcome.contributors)
        excluded = list(outcome.excluded)
        self.policy.observe(outcome)
        aggregation = r.core.aggregation
        plan = self.strategy.configure_round(r.number, contributors)
        privacy_record: dict[str, Any] = {}
        if self.privacy is not None:
            update, contributors, update_norm, privacy_record = self.privacy.finish_round(
                self.strategy, self._weights, aggregation, plan, contributors
            )
        else:
            update_norm = float(torch.linalg.vector_norm(aggregation.result()))
            update = self.strategy.aggregate_round(self._weights, aggregation, plan)
        del aggregation
        delta_bytes = update.downlink.to_bytes()
        blob = blob_manifest(
            delta_bytes,
            codec=update.downlink.spec,
            shape=list(update.downlink.shape),
            dtype="float32",
            chunk_size=self.config.chunk_size,
        )
        new_weights, new_digest = update.global_flat, update.digest
        del update
        next_round = r.number + 1
        finished = bool(self.config.total_rounds) and next_round >= self.config.total_rounds
        if privacy_record.get("budget_exhausted") and not finished:
            logger.info(
                "stopping after round %d: one more round would push epsilon above the budget %g",
                r.number, self.config.privacy.epsilon_budget,
            )
            finished = True
        aggregate_s = time.perf_counter() - t0
        if self.config.checkpoint_dir is not None and (
            finished or next_round % self.config.checkpoint_every == 0
        ):
            self._save_checkpoint(
                next_round, new_weights, frozenset(contributors), frozenset(outcome.folded)
            )
            self.events.emit(ev.CHECKPOINT_SAVED, round=next_round)
        record = BroadcastRecord(
            round=r.number,
            data=delta_bytes,
            blob=blob,
            weights_digest=sha256_checksum(new_digest),
            contributors=frozenset(contributors),
            run_finished=finished,
        )
        with self._cond:
            self._set_weights(new_weights)
            self._broadcast = record
            self._contributor_history[r.number] = record.contributors
            self._contributor_history.pop(r.number - CONTRIBUTOR_HISTORY, None)
            self._folded_history[r.number - 1] = frozenset(outcome.folded)
            self._folded_history.pop(r.number - 1 - CONTRIBUTOR_HISTORY, None)
            now = self.clock()
            # allocates on the first add; with streaming sized for the next round's fragment
            self._round = self._new_round(next_round, now)
            if finished:
                self._phase = RoundPhase.FINISHED
                self._finished_s = now
            else:
                self._phase = RoundPhase.WAITING_FOR_QUORUM
                self._maybe_start(now)
            members = sorted(self._members)
            bytes_up_total, bytes_down_total = self._bytes_up_total, self._bytes_down_total
            self._cond.notify_all()
        logger.info(
            "round %d aggregated: %d sites (%s)%s%s, |update| %.4g, delta %d bytes, deadline %s",
            r.number, len(contributors), ", ".join(contributors),
            f", excluded {', '.join(excluded)}" if excluded else "",
            f", folded late {', '.join(outcome.folded)}" if outcome.folded else "",
            update_norm, len(delta_bytes),
            "none" if outcome.deadline_s is None else f"{outcome.deadline_s:.3g} s",
        )
        eval_loss = None
        if self.eval_fn is not None and (finished or next_round % self.config.eval_every == 0):
            try:
                eval_loss = float(self.eval_fn(self._weights_cpu))
            except Exception:
                # A broken evaluation must not stop the training of every site.
                logger.exception("eval_fn failed after round %d; training continues", r.number)
        metrics = {
            "session_id": self.session_id,
            "round": r.number,
            "fragment": self.fragment_of(r.number),
            "participants": contributors,
            "sample_weights": dict(outcome.weights),
            "excluded": excluded,
            "rejected": list(outcome.rejected),
            "departed": sorted(r.departed),
            "partial_uploads": partial,
            "members": members,
            "bytes_up": dict(r.bytes_up),
            "bytes_down": dict(r.bytes_down),
            "bytes_up_total": bytes_up_total,
            "bytes_down_total": bytes_down_total,
            "downlink_bytes": len(delta_bytes),
            "round_time_s": closed_s - r.core.opened_s,
            "wait_for_quorum_s": None if r.core.started_s is None else r.core.started_s - r.core.opened_s,
            "aggregate_time_s": aggregate_s,
            "deadline_s": outcome.deadline_s,
            "deadline_hit": deadline_hit,
            "next_deadline_s": self.policy.deadline_s(),
            "arrival_s": dict(outcome.arrivals_s),
            "inner_steps": {
                site: int(r.uploads[site].upload.inner_steps) for site in contributors if site in r.uploads
            },
            "folded_late": dict(outcome.folded),
            "update_norm": update_norm,
            "eval_loss": eval_loss,
            "site_metrics": r.site_metrics,
            "weights_digest": new_digest,
            "run_finished": finished,
        }
        if privacy_record:
            metrics["privacy"] = privacy_record
            if "epsilon" in privacy_record:
                metrics["epsilon"] = privacy_record["epsilon"]
                metrics["privacy_delta"] = privacy_record["delta"]
        self.events.emit(ev.ROUND_AGGREGATED, round=r.number, data=metrics)
        return metrics

    def _save_checkpoint(
        self,
        round_number: int,
        weights: torch.Tensor,
        contributors: frozenset[str],
        folded: frozenset[str],
    ) -> None:
        """``contributors``/``folded``: of round ``round_number - 1``, just aggregated (the
        history does not hold it yet). The history lets a restarted coordinator still tell a
        site whether its update counted, so it neither loses nor resends it."""
        assert self.config.checkpoint_dir is not None
        last = round_number - 1
        history = {
            "contributors": {
                str(t): sorted(sites) for t, sites in {**self._contributor_history, last: contributors}.items()
                if t > last - CONTRIBUTOR_HISTORY
            },
            "folded": {
                str(t): sorted(sites) for t, sites in {**self._folded_history, last - 1: folded}.items()
                if t > last - 1 - CONTRIBUTOR_HISTORY and sites
            },
            "deadline": self.policy.state(),
        }
        tensors = {WEIGHTS_KEY: weights}
        tensors.update({STRATEGY_PREFIX + k: v for k, v in self.strategy.state_tensors().items()})
        metadata = {
            "config": self.config.to_dict(),
            "strategy": self.strategy.state_meta(),
            "layout": self.layout.to_dict(),
            "weights_digest": weights_digest(weights.detach().to("cpu")),
            "session_id": self.session_id,
            HISTORY_KEY: history,
        }
        if self.privacy is not None:
            metadata[PRIVACY_KEY] = self.privacy.state()
        save_checkpoint(
            self.config.checkpoint_dir, round_number, tensors, metadata, keep=self.config.checkpoint_keep
        )

    # ---------------------------------------------------------------------------------------
    # End of the run

    def drained(self) -> bool:
        """Finished, and every site left or ``drain_timeout_s`` passed since the last round."""
        with self._cond:
            if self._phase is not RoundPhase.FINISHED:
                return False
            if not self._members:
                return True
            assert self._finished_s is not None
            return self.clock() - self._finished_s >= self.config.drain_timeout_s

    def wait_finished(self, timeout_s: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._phase is RoundPhase.FINISHED, timeout=timeout_s)

    def close(self) -> None:
        """Wake every waiting call with UNAVAILABLE; later polls do nothing."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._verifier.shutdown(wait=False)


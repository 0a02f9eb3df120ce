"""Sharded sites at the coordinator: a site's shards are one update, counted all or nothing.

A sharded site (FSDP inside the site, ``geoloco.site_agent.sharded``) has every rank upload its
own shard of the site's pseudo-gradient under the site's identity and session, in parallel. The
manifest says which shard (``shard_index`` of ``shard_count``) and by which rule its elements map
into the flat vector (``shard_split``, ``geoloco.algorithms.shard_split``: FSDP2's dim-0 split,
computed here from the model layout, so shards cannot overlap and always tile the vector once
every index arrived).

Each shard is checked and verified like a whole upload (membership, round, codec, dtype, weight,
checksum, finite values) and then *held*, still encoded, until all ``shard_count`` shards of the
site arrived. Then the site's update norm (over all shards) meets ``[update_guard]``, the shards
are decoded and enter the round's sum once, each into its rows, with the site's weight,
and the site counts once (all or nothing). A site missing a shard when the round closes never
entered the sum: it is a straggler like any other, and its held shards are dropped with the
round. A non-finite shard rejects the whole site for the round.

What does not combine (refused with a clear error): secure aggregation (masked uploads are one
ring sum per site; ``SecureIntake`` never sees shard fields as anything but a wrong shape),
Streaming DiLoCo fragments, partial updates, late folding (a sharded update one round late is
refused like with ``late_updates = "drop"``) and relays.

Memory: the held shards are the encoded uploads (one site's update in total, compressed); they
are decoded on the one verifier thread (one site's update at a time, whatever the number of
sharded sites) and added row range by row range into the plain sum (``RunningSum.add_rows``),
with no model-sized vector assembled; aggregations that keep or clip whole updates (robust,
central DP) get them assembled.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from geoloco.algorithms.engine import NOT_FINITE, Screen
from geoloco.algorithms.shard_split import SHARD_SPLITS, shard_numel, shard_ranges
from geoloco.compression import CodecError, Encoded, decode, slicing
from geoloco.coordinator import events as ev
from geoloco.coordinator.context import RoundContext
from geoloco.coordinator.domain import OPEN_PHASES, UploadProgress, UploadSpec
from geoloco.coordinator.errors import ShuttingDownError, rejection_message
from geoloco.coordinator.membership import Membership
from geoloco.coordinator.round_timing import RoundTimings
from geoloco.protos.errors import InvalidUpdateError, NotAMemberError, UpdateRejectedError, quoted
from geoloco.protos.upload_check import checked_update
from geoloco.protos.wire_assembly import UploadAssembler
from geoloco.protos.wire_buffers import MAX_CHUNK_SIZE

__all__ = ["MAX_SHARDS", "ShardHost", "ShardedUploads"]

logger = logging.getLogger(__name__)

MAX_SHARDS = 4096
"""Most shards one site may split its update into (ranks of one FSDP group)."""
SHARD_OVERHEAD_BYTES = 4096
"""Bytes a shard's encoding may add beyond its share of the whole update's (header, spec, shape).
A site's open shard manifests together may announce at most a whole upload plus this per shard:
each manifest's buffer is allocated when it opens, so 4,096 empty manifests of the largest shard
size once held 512 MiB per site, whatever the model."""

Chunks = Any


class ShardHost(Protocol):
    """What the plain intake lends the shard intake (its checks, verifier and round)."""

    ctx: RoundContext
    membership: Membership
    uplink_codec: str
    numel: int
    max_upload_bytes: int
    device: torch.device
    verifier: ThreadPoolExecutor
    """The one thread that verifies and adds updates (the aggregation's memory bound)."""
    verify_lock: threading.Lock

    def validate(self, site: str, spec: UploadSpec) -> None: ...

    def upload_weight(self, spec: UploadSpec) -> float: ...

    def rejected(self, site: str, round_number: int, why: str) -> None: ...


class ShardUpload(UploadAssembler):
    """One shard's chunk buffer, kept across streams, and the spec it was opened with."""

    def __init__(self, spec: UploadSpec, *, max_total_bytes: int, timings: RoundTimings) -> None:
        super().__init__(spec.wire, max_total_bytes=max_total_bytes, max_chunk_size=MAX_CHUNK_SIZE)
        self.spec = spec
        self.timings = timings


@dataclass(slots=True)
class _SiteShards:
    """One site's shards of the open round."""

    count: int
    split: str
    first: UploadSpec
    """The first shard's spec: every other shard must agree with its weight and steps."""
    uploads: dict[int, ShardUpload] = field(default_factory=dict)
    verified: dict[int, tuple[Encoded, float]] = field(default_factory=dict)
    """index -> (encoded shard, its L2 norm), held until every shard is here."""
    added: bool = False
    declared_bytes: int = 0
    """Sum of the open shard manifests' ``total_bytes`` (their buffers are allocated at open)."""


def _progress(upload: ShardUpload, *, complete: bool) -> UploadProgress:
    return UploadProgress(
        complete=complete,
        received=tuple(upload.received()),
        missing=tuple(upload.missing()),
        received_bytes=upload.received_bytes,
        manifest=upload.spec.wire,
    )


class ShardedUploads:
    """The shards of sharded sites in the open round (module doc)."""

    def __init__(self, host: ShardHost, shapes: Sequence[Sequence[int]]) -> None:
        self.host = host
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self._round = -1
        self._sites: dict[str, _SiteShards] = {}

    # -- the open round's state (lock held) --

    def _current(self) -> dict[str, _SiteShards]:
        number = self.host.ctx.round.number
        if number != self._round:  # a new round: the last one's held shards go
            self._round = number
            self._sites = {}
        return self._sites

    def holds(self, site: str) -> bool:
        """``site`` has shards in the open round (lock held)."""
        return site in self._current()

    # -- one Upload stream --

    def receive(self, site: str, spec: UploadSpec, chunks: Chunks) -> UploadProgress:
        started = time.monotonic()
        upload = self.open(site, spec)
        upload.timings.upload_started(started)
        upload.consume(self._live_chunks(site, upload, chunks))
        if upload.complete:
            upload.timings.upload_received(time.monotonic())
        return self._finish(site, upload)

    def open(self, site: str, spec: UploadSpec) -> ShardUpload:
        """Check a shard's manifest; the (new or resumed) assembler of that shard."""
        host, ctx = self.host, self.host.ctx
        with ctx.cond:
            host.membership.member(site, spec.session_id, spec.instance_id)
            ctx.check_upload_round(spec.round)  # a late shard is refused: no late folding
            r = ctx.round
            ctx.check_not_rejected(site)
            self._check_combination(site, spec)
            numel = self._check_shard(spec)
            # The plain checks (site, fragment, codec, dtype, weight, metrics, size) on the
            # shard as if it were the whole vector; the shape was checked against the split.
            host.validate(site, replace(spec, shape=(host.numel,)))
            sites = self._current()
            shards = sites.get(site)
            if shards is not None and shards.added:
                existing = shards.uploads.get(spec.shard_index)
                if existing is not None:
                    existing.check_same_manifest(spec.wire)
                    return existing
            if shards is None or shards.count != spec.shard_count or shards.split != spec.shard_split:
                if shards is not None:
                    raise InvalidUpdateError(
                        f"site {site!r}'s shard {spec.shard_index} says {spec.shard_count} shards "
                        f"split {quoted(spec.shard_split)}, but its other shards of round {r.number} "
                        f"say {shards.count} split {shards.split!r}; every rank of a sharded site "
                        "must upload with the same shard_count and shard_split"
                    )
                shards = sites[site] = _SiteShards(spec.shard_count, spec.shard_split, spec)
                ctx.events.emit(ev.UPLOAD_OPENED, site=site, round=r.number)
            elif (spec.sample_weight, spec.inner_steps) != (shards.first.sample_weight, shards.first.inner_steps):
                raise InvalidUpdateError(
                    f"site {site!r}'s shard {spec.shard_index} says sample_weight {spec.sample_weight} "
                    f"and inner_steps {spec.inner_steps}, its other shards {shards.first.sample_weight} and "
                    f"{shards.first.inner_steps}; a site's shards are one update with one weight"
                )
            existing = shards.uploads.get(spec.shard_index)
            if existing is not None and existing.spec == spec:
                existing.check_same_manifest(spec.wire)
                return existing
            replaced = 0 if existing is None else existing.spec.total_bytes
            declared = shards.declared_bytes - replaced + spec.total_bytes
            allowed = self.host.max_upload_bytes + spec.shard_count * SHARD_OVERHEAD_BYTES
            if declared > allowed:
                raise InvalidUpdateError(
                    f"site {site!r}'s shard manifests for round {r.number} announce {declared} bytes "
                    f"together, more than one whole update may ({allowed} bytes: max_upload_bytes "
                    f"{self.host.max_upload_bytes} + {SHARD_OVERHEAD_BYTES} per shard); a site's shards "
                    "are one update"
                )
            if existing is not None:
                logger.info("round %d: %s replaced its shard %d", r.number, site, spec.shard_index)
                shards.verified.pop(spec.shard_index, None)
            upload = ShardUpload(spec, max_total_bytes=self._max_shard_bytes(numel), timings=r.timings)
            shards.uploads[spec.shard_index] = upload
            shards.declared_bytes = declared
            r.inner_steps[site] = spec.inner_steps
            ctx.count_up(site, spec.nbytes)
            return upload

    def _check_combination(self, site: str, spec: UploadSpec) -> None:
        """Refuse what sharded uploads do not combine with, saying what works."""
        ctx = self.host.ctx
        if ctx.strategy.partial is not None:
            raise InvalidUpdateError(
                "sharded uploads do not combine with partial updates ([algorithm] partial_updates); "
                "run the site data-parallel (SiteAgent; geoloco site without --sharding) or turn partial updates off"
            )
        if ctx.update_numel(spec.round) != self.host.numel:
            raise InvalidUpdateError(
                "sharded uploads do not combine with Streaming DiLoCo fragments; run the site "
                "data-parallel (SiteAgent; geoloco site without --sharding) or use fragments = 1"
            )
        if spec.raw is not None and len(getattr(spec.raw, "relayed_sites", ())) > 0:
            raise InvalidUpdateError("a relay's partial sum cannot be sharded; relays upload whole partials")
        if site in ctx.round.contributed and site not in self._current():
            raise UpdateRejectedError(
                f"site {site!r}'s update already counts in round {spec.round} (its own upload or a "
                "relay's partial sum); wait for the broadcast (AwaitBroadcast)"
            )
        if site in ctx.round.uploads:
            raise InvalidUpdateError(
                f"site {site!r} already sent a whole (unsharded) update for round {spec.round}; "
                "a site uploads either one whole update or all of its shards"
            )

    def _check_shard(self, spec: UploadSpec) -> int:
        """The shard's element count, or a clear error when its fields do not name a shard."""
        if spec.shard_split not in SHARD_SPLITS:
            raise InvalidUpdateError(
                f"upload names shard_split {quoted(spec.shard_split)}; the known splits are "
                f"{list(SHARD_SPLITS)} (\"dim0\": FSDP2's row split of every parameter)"
            )
        if not 1 <= spec.shard_count <= MAX_SHARDS or not 0 <= spec.shard_index < spec.shard_count:
            raise InvalidUpdateError(
                f"upload names shard {spec.shard_index} of {spec.shard_count}; shard_count must be "
                f"1 .. {MAX_SHARDS} and shard_index 0 .. shard_count-1 (each index once: the shards "
                "tile the flat vector)"
            )
        numel = shard_numel(self.shapes, spec.shard_index, spec.shard_count, spec.shard_split)
        if list(spec.shape) != [numel]:
            raise InvalidUpdateError(
                f"shard {spec.shard_index} of {spec.shard_count} has shape {quoted(list(spec.shape))}; "
                f"split {spec.shard_split!r} of this model gives it [{numel}] elements (its rows of "
                "every parameter, in layout order)"
            )
        return numel

    def _max_shard_bytes(self, numel: int) -> int:
        """A shard's byte bound: the whole update's, scaled to its share (at least 64 KiB)."""
        host = self.host
        return max(1 << 16, -(-host.max_upload_bytes * max(numel, 1) // max(host.numel, 1)) + (1 << 16))

    def _live_chunks(self, site: str, upload: ShardUpload, chunks: Chunks) -> Iterator[Any]:
        """The stream's chunks; stops it as soon as its round closes or the shard is replaced."""
        ctx = self.host.ctx
        round_number = upload.spec.round
        for chunk, nbytes in chunks:
            with ctx.cond:
                ctx.count_up(site, nbytes)
                if ctx.round.number != round_number or ctx.phase not in OPEN_PHASES:
                    ctx.check_upload_round(round_number)
                shards = self._current().get(site)
                if shards is None or shards.uploads.get(upload.spec.shard_index) is not upload:
                    raise NotAMemberError(
                        f"site {site!r}'s shard {upload.spec.shard_index} for round {round_number} "
                        "was discarded (replaced by a newer one, or the site was dropped)"
                    )
            yield chunk

    def _finish(self, site: str, upload: ShardUpload) -> UploadProgress:
        if not upload.complete:
            return _progress(upload, complete=False)
        try:
            future = self.host.verifier.submit(self._verify, site, upload)
        except RuntimeError:
            raise ShuttingDownError("the coordinator is shutting down; retry to reach its successor") from None
        result: UploadProgress = future.result()
        return result

    # -- verification and the all-or-nothing add (on the verifier thread) --

    def _verify(self, site: str, upload: ShardUpload) -> UploadProgress:
        host, ctx = self.host, self.host.ctx
        spec = upload.spec
        index, round_number = spec.shard_index, spec.round
        what = f"site {site!r}'s shard {index} of {spec.shard_count} for round {round_number}"
        numel = shard_numel(self.shapes, index, spec.shard_count, spec.shard_split)
        with host.verify_lock:
            with ctx.cond:
                ctx.check_upload_round(round_number)
                shards = self._current().get(site)
                if shards is None or shards.uploads.get(index) is not upload:
                    raise NotAMemberError(f"{what} was discarded (replaced, or the site was dropped)")
                if shards.added or index in shards.verified:
                    return _progress(upload, complete=True)
            data = upload.finish()  # checksum; a mismatch resets the assembler (DATA_LOSS)
            encoded, norm, finite = checked_update(
                what, data, spec.checksum[0], codec=host.uplink_codec, numel=numel, device=host.device, dense=False
            )
            assert isinstance(encoded, Encoded)
            if not finite:
                self._drop_site(site, round_number, f"{NOT_FINITE} in a shard")
                raise InvalidUpdateError(
                    f"{what} contains NaN or Inf values; the site's whole update is dropped for this "
                    "round (check the site's loss and learning rate)"
                )
            with ctx.cond:
                ctx.check_upload_round(round_number)
                shards = self._current().get(site)
                if shards is None or shards.uploads.get(index) is not upload:
                    raise NotAMemberError(f"{what} was discarded (replaced, or the site was dropped)")
                shards.verified[index] = (encoded, norm)
                if len(shards.verified) < shards.count:
                    logger.debug("round %d: %s holds %d of %d shards", round_number, site,
                                 len(shards.verified), shards.count)
                    return _progress(upload, complete=True)
                held = sorted(shards.verified.items())
            self._add_site(site, shards, held, round_number)
        return _progress(upload, complete=True)

    def _add_site(
        self, site: str, shards: _SiteShards, held: list[tuple[int, tuple[Encoded, float]]], round_number: int
    ) -> None:
        """Every shard is here (``held``, taken under the lock): check the site's norm, build
        its update, add it once."""
        host, ctx = self.host, self.host.ctx
        started = time.monotonic()
        norm = math.sqrt(sum(n * n for _, (_, n) in held))
        screen = Screen(norm)
        why = ctx.engine.screen(screen)
        if why is not None:
            self._drop_site(site, round_number, why)
            raise InvalidUpdateError(
                f"site {site!r}'s update for round {round_number} (all {shards.count} shards) is "
                f"refused: {why}; it is dropped for this round"
            )
        rows: list[tuple[int, Encoded | torch.Tensor]] = []
        for index, (encoded, _) in held:
            ranges = shard_ranges(self.shapes, index, shards.count, shards.split)
            pieces = slicing.element_pieces(encoded, [n for _, n in ranges])
            if pieces is not None:  # ``none`` or a cast: each range added from the received bytes
                rows.extend((offset, piece) for (offset, _), piece in zip(ranges, pieces, strict=True))
                continue
            try:
                values = decode(encoded, device=host.device).reshape(-1)
            except CodecError as err:
                self._drop_site(site, round_number, f"shard {index} cannot be decoded")
                raise InvalidUpdateError(f"site {site!r}'s shard {index} cannot be decoded: {err}") from None
            at = 0
            for offset, n in ranges:
                rows.append((offset, values[at : at + n]))
                at += n
        weight = host.upload_weight(shards.first)
        with ctx.cond:
            ctx.check_upload_round(round_number)
            r = ctx.round
            if self._current().get(site) is not shards or len(shards.verified) < shards.count:
                # A rank re-sent a different shard meanwhile: its verification adds the site.
                raise NotAMemberError(f"site {site!r}'s shards for round {round_number} were discarded or replaced")
            admission = ctx.engine.admit(r.core, site, rows, weight, numel=host.numel, screen=screen, now=ctx.clock())
            if admission.verdict == "duplicate":
                self._current().pop(site, None)
                raise UpdateRejectedError(f"{admission.reason}; wait for the broadcast (AwaitBroadcast)")
            if not admission.ok:
                assert admission.reason is not None
                self._current().pop(site, None)
                host.rejected(site, round_number, admission.reason)
                raise InvalidUpdateError(rejection_message(
                    f"site {site!r}'s sharded update for round {round_number}", admission.reason,
                    aborted=bool(r.core.aborted),
                ))
            shards.added = True
            shards.verified.clear()  # the encoded shards are in the sum now
            for upload in shards.uploads.values():
                upload.release()
            r.site_metrics[site] = dict(shards.first.metrics)
            ctx.events.emit(ev.UPDATE_AGGREGATED, site=site, round=round_number, weight=weight)
            logger.debug("round %d: sharded update of %s aggregated (%d shards)", round_number, site, shards.count)
            ctx.cond.notify_all()
        next(iter(shards.uploads.values())).timings.spent("add", started, time.monotonic())

    def _drop_site(self, site: str, round_number: int, why: str) -> None:
        """Reject ``site`` for the round: its held shards go, it is not waited for."""
        ctx = self.host.ctx
        with ctx.cond:
            if ctx.round.number == round_number:
                self._current().pop(site, None)
                ctx.round.core.reject(site, why)
            self.host.rejected(site, round_number, why)

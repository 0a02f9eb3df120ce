"""One round at a relay: its sites' verified uploads, combined into one weighted partial sum.

The partial is the coordinator's own ``RunningSum`` (``geoloco.algorithms.aggregation``): each
site's encoded update is decoded into it with the site's weight ``w_k`` exactly as the
coordinator would add it, and what goes upward is its mean ``Σ w_k g_k / W`` with ``W = Σ w_k``,
which the coordinator adds back with weight ``W``. In a secure round the partial is instead the
ring sum of the sites' masked uploads (``geoloco.relay.masked``). Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from geoloco.algorithms.aggregation import RunningSum
from geoloco.algorithms.privacy.private_aggregation import SECURE_UPLOAD_CODEC
from geoloco.algorithms.round import CloseDecision, Round
from geoloco.compression import Encoded, decode, parse_codec
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.wire_assembly import UploadAssembler
from geoloco.protos.wire_manifests import blob_manifest
from geoloco.relay.masked import MaskedSum, SecureRun

__all__ = ["RelayRound", "RelayWait", "SiteUpdate", "encode_partial", "masked_partial"]


def encode_partial(
    mean: torch.Tensor, weight: float, codec: str, residual: torch.Tensor | None, *, seed: int = 0
) -> tuple[Encoded, torch.Tensor | None]:
    """The partial ``mean`` (sent with weight ``W = weight``) encoded with ``codec``, and the
    relay's new error-feedback residual.

    The residual lives in sum space (``W · mean`` units) because ``W`` changes from round to
    round: ``u = mean + E / W``, ``c = C(u)``, ``E' = W · (u − D(c))``, so what the coordinator
    adds (``W · D(c)``) plus ``E'`` is ``W · mean + E``: nothing the codec dropped is lost, it goes
    up in a later round. Lossless ``none``: ``u = mean`` and no residual.
    """
    spec = parse_codec(codec)
    if spec.spec == "none":
        return spec.encode(mean), None
    u = mean if residual is None else mean + residual / weight
    encoded = spec.encode(u, seed=seed)
    return encoded, (u - decode(encoded, device=u.device).reshape(u.shape)) * weight


@dataclass(frozen=True, slots=True)
class SiteUpdate:
    """What the partial keeps of one site's upload besides its decoded values."""

    weight: float
    inner_steps: int
    upload_bytes: int
    metrics: dict[str, float]
    """The site's own upload metrics (loss, phase times), passed on to the coordinator."""


class RelayWait:
    """A relay's close rule (the round engine's ``ClosePolicy``): its partial goes upward when
    every site it waits for is in, refused or withdrew, or ``max_wait_s`` after the round's
    first upload or withheld update opened it (its clock). A round whose every update was
    refused or withheld still goes up, to tell the coordinator so; a round without any update
    waits."""

    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s

    def may_start(self, members: int) -> bool:
        """The relay's round clock starts with its first upload, whoever else is there."""
        return True

    def decide_round(self, round_: Round, *, now: float, expected: Collection[str]) -> CloseDecision:
        if not (round_.contributed or round_.rejected):
            return CloseDecision(close=False)
        if set(expected) <= set(round_.contributed) | set(round_.rejected):
            return CloseDecision(close=True)
        started = round_.started_s
        waited = started is not None and now - started >= self.max_wait_s
        return CloseDecision(close=waited, deadline_hit=waited)


@dataclass(slots=True)
class RelayRound:
    """The relay's state of one training round (numbered as the coordinator numbers it): the
    engine's ``Round`` (``core``: who is in, who was refused and why, the partial's running sum)
    plus what only a relay keeps."""

    number: int
    opened_s: float
    core: Round | None = None
    """The round as the engine keeps it, from its first upload (which fixes its size)."""
    fragment: int | None = None
    shape: tuple[int, ...] | None = None
    """Fragment and shape of the round's uploads, fixed by its first upload."""
    expected: tuple[int, int] | None = None
    """(upload size, fragment) the coordinator said the round takes (``pb.RoundInfo``); None
    from a coordinator that does not say, and the first upload's manifest decides."""
    assemblers: dict[str, UploadAssembler] = field(default_factory=dict)
    """site -> its upload's chunks (resumable across streams, as at the coordinator)."""
    updates: dict[str, SiteUpdate] = field(default_factory=dict)
    """site -> its verified update's weight, in arrival order."""
    withdrawn: set[str] = field(default_factory=set)
    """Sites that gave the round up (a secure ``withdraw`` stage call, or a withheld update):
    not waited for."""
    forwarded: bool = False
    """The partial went upward (or is going): later uploads are too late for this round."""
    outcome: str = ""
    """After forwarding: "accepted", or why the coordinator refused the partial."""
    masked: MaskedSum | None = None
    """Secure rounds: the ring sum of the masked uploads (the plain partial is ``core``'s sum)."""
    buffers: dict[str, bytearray] = field(default_factory=dict)
    """Secure rounds: site -> the buffer its masked upload is assembled in (zeroed once added)."""

    @property
    def empty(self) -> bool:
        return not self.assemblers and not self.updates

    @property
    def rejected(self) -> dict[str, str]:
        """site -> why its upload was refused this round, or why it sent none."""
        return {} if self.core is None else dict(self.core.rejected)

    @property
    def weight(self) -> float:
        """``W = Σ w_k`` of the updates added so far (the number of sites in a secure round)."""
        if self.masked is not None:
            return float(len(self.masked.sites))
        if self.core is None or not isinstance(self.core.aggregation, RunningSum):
            return 0.0
        return self.core.aggregation.total_weight

    def add_masked(
        self, site: str, data: memoryview, secure: SecureRun, *, inner_steps: int, upload_bytes: int,
        metrics: dict[str, float] | None = None,
    ) -> None:
        """A site's verified masked upload, added into the ring sum; its buffer is then zeroed,
        so the relay holds no site's masked vector, only the sum (``geoloco.relay.masked``)."""
        if self.shape is None:
            raise ValueError("the round's shape is set by its first upload")
        if self.masked is None:
            self.masked = MaskedSum(self.shape[0], secure)
        self.masked.add(site, data)
        self.drop_masked(site)
        self.updates[site] = SiteUpdate(
            weight=1.0, inner_steps=inner_steps, upload_bytes=upload_bytes, metrics=dict(metrics or {})
        )

    def drop_masked(self, site: str) -> None:
        """Overwrite ``site``'s masked upload buffer with zeros (added, or too late)."""
        buffer = self.buffers.pop(site, None)
        if buffer is not None:
            buffer[:] = bytes(len(buffer))

    def mean(self) -> torch.Tensor:
        """``Σ w_k g_k / W``, the partial the relay sends upward with weight ``W``; empty when no
        update counted (every one refused or withheld): the partial then only reports the
        refusals, and carries no values (float32 ``[0]``), whatever size the round's updates
        would have had (the relay may not know it: none of its sites uploaded)."""
        aggregation = None if self.core is None else self.core.aggregation
        if not isinstance(aggregation, RunningSum) or aggregation.total_weight == 0:
            return torch.zeros(0, dtype=torch.float32)
        return aggregation.result()


def masked_partial(r: RelayRound, session: str, secure: SecureRun) -> tuple[pb.UploadManifest, bytes]:
    """A secure round's partial upward: the ring sum, lossless (a masked sum cannot be
    compressed), listing its sites, each with weight 1 (the coordinator counts sites)."""
    assert r.masked is not None and r.shape is not None
    data = r.masked.to_bytes()
    sites = list(r.masked.sites)
    manifest = pb.UploadManifest(
        session_id=session, round=r.number, fragment=r.fragment or 0, sample_weight=float(len(sites)),
        inner_steps=sum(r.updates[s].inner_steps for s in sites),
        blob=blob_manifest(
            data, codec=SECURE_UPLOAD_CODEC, shape=list(r.shape), dtype=secure.dtype.name,
            chunk_size=secure.wire_chunk_bytes,
        ),
        relayed_sites=[
            pb.RelayedSite(site=s, weight=1.0, inner_steps=r.updates[s].inner_steps, metrics=r.updates[s].metrics)
            for s in sites
        ],
    )
    return manifest, data

"""The coordinator's privacy layer: secure aggregation per round, DP noise, the privacy accountant.

``RoundStateMachine`` owns one ``PrivateRounds`` when the coordinator's ``[privacy]`` table
enables anything, and calls it (always under its own lock, except ``finish_round``) at a few
well-defined points; all privacy decisions live here:

* **Secure aggregation** (``privacy.secure_aggregation``). One ``SecureRound`` per wire round,
  created once the round has started (its quorum of members joined), so the key-advertisement
  stage never closes over the first site to arrive alone. Masked uploads (codec
  ``SECURE_UPLOAD_CODEC``, ``uint32`` values in ``Z_{2^b}``) are added into the protocol's sum
  chunk by chunk as they arrive (``add_chunk``): the wire chunks of a masked upload are exactly the
  protocol's chunks (``privacy.chunk_size`` values each), and no site's vector, masked or not,
  is ever assembled. Resent identical chunks are ignored (the protocol keeps a CRC-32 per chunk,
  never the values). When uploads close, the survivors sign the survivor list and answer the
  unmask request; a site killed after uploading stays in the sum as long as at least the
  threshold of sites answer. Fewer: the round is aborted, nothing is revealed and the round
  broadcasts "no change" (``num_contributors = 0``); the next round proceeds with whoever is left.
* **Differential privacy.** ``central``: with secure aggregation the coordinator adds Gaussian
  noise to the unmasked sum; without it the (trusted) coordinator clips each decoded update to
  ``clip_norm`` before summing and adds the noise to the sum. ``distributed``: sites add Skellam
  noise before masking (``geoloco.algorithms.privacy.private_aggregation``). Either way every site counts the same
  in the mean (uniform weighting: per-site sample weights would change the sensitivity).
* **Accounting.** After every released round the accountant (Google's ``dp-accounting``)
  composes the round's noise multiplier; ε at ``privacy.delta`` goes into the round's metrics
  record (``epsilon``), hence ``metrics.jsonl``, ``/api/status``, Prometheus and the run summary.
  With ``epsilon_budget`` set, the run finishes after the last round whose successor would push
  ε above the budget. The accountant's state travels in checkpoints.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from geoloco.algorithms.aggregation import Aggregation
from geoloco.algorithms.fixed_point import MODULUS_DTYPES
from geoloco.algorithms.privacy.private_aggregation import (
    SECURE_UPLOAD_CODEC,
    PrivacyAccountant,
    PrivacyConfig,
    central_dp_mean,
    secure_context,
    secure_index_seed,
)
from geoloco.algorithms.privacy.secagg_crypto import num_chunks, site_index
from geoloco.algorithms.privacy.secagg_messages import SecAggAbort, SecAggViolation
from geoloco.algorithms.privacy.secagg_stages import (
    STAGE_CONSISTENCY,
    STAGE_UNMASK,
    STAGE_UNMASK_RESPONSE,
    StageMessage,
)
from geoloco.algorithms.strategy import RoundPlan, RoundUpdate, Strategy
from geoloco.coordinator.domain import UploadProgress, UploadSpec
from geoloco.coordinator.secure_round import SecureRound, StageReply
from geoloco.protos.errors import InvalidUpdateError, LateStageAnswerError, WrongRoundError

__all__ = ["PrivateRounds", "SecureUpload", "epsilon_text"]

logger = logging.getLogger(__name__)

AFTER_UPLOAD_STAGES = frozenset({STAGE_CONSISTENCY, STAGE_UNMASK, STAGE_UNMASK_RESPONSE})
"""Stages a site answers after its upload: one that arrives once its round finished is late,
not a replay (``LateStageAnswerError``)."""


@dataclass(slots=True)
class SecureUpload:
    """What the coordinator keeps of one site's masked upload: its manifest, never its values."""

    spec: UploadSpec
    num_chunks: int
    received: set[int]

    @property
    def complete(self) -> bool:
        return len(self.received) == self.num_chunks

    def missing(self) -> list[tuple[int, int]]:
        return [(i, i + 1) for i in range(self.num_chunks) if i not in self.received]


class PrivateRounds:
    """Secure aggregation, DP noise and accounting for a coordinator session (see module doc)."""

    def __init__(
        self,
        privacy: PrivacyConfig,
        uplink_codec: str,
        *,
        numel: int,
        session: str,
        stage_timeout_s: float,
    ) -> None:
        self.privacy = privacy
        self.uplink_codec = uplink_codec
        self.numel = numel
        self.session = session
        self.stage_timeout_s = stage_timeout_s
        self.accountant = PrivacyAccountant(privacy.delta) if privacy.dp != "off" else None
        self.current: SecureRound | None = None
        self._uploads: dict[str, SecureUpload] = {}
        self._unmasking = False
        self.wire_chunk_bytes = privacy.chunk_size * (privacy.modulus_bits // 8)

    def sent_values(self, numel: int | None = None) -> int:
        """Values of a masked upload of an update of ``numel`` elements (``k`` with random-k);
        default: the current secure round's (a Streaming DiLoCo fragment's), else the model's."""
        if numel is None:
            numel = self.current.numel if self.current is not None else self.numel
        return secure_context(
            self.privacy, self.uplink_codec, numel=numel, session=self.session, round_index=0
        ).numel

    @property
    def secure(self) -> bool:
        return self.privacy.secure_aggregation

    # ------------------------------------------------------------------------------------------
    # Secure rounds (called under the state machine's lock)

    def start_round(
        self, round_number: int, round_seed: int, now: float, *, numel: int | None = None, ca_pem: bytes | None = None
    ) -> None:
        """The round's quorum is there: open its key-advertisement stage.

        ``numel``: elements of the round's update; with Streaming DiLoCo the size of the
        fragment the round synchronises (each fragment sync is its own secure sum), else the
        model's. ``ca_pem``: the run's CA, against which sites' identity bindings are checked
        before they are relayed (None: --insecure).
        """
        if not self.secure or (self.current is not None and self.current.round_number == round_number):
            return
        self.current = SecureRound(
            self.privacy, self.uplink_codec, numel=self.numel if numel is None else numel, session=self.session,
            round_number=round_number, index_seed=secure_index_seed(round_seed),
            stage_timeout_s=self.stage_timeout_s, now=now, ca_pem=ca_pem,
        )
        self._uploads = {}
        self._unmasking = False

    def _round(self, round_number: int) -> SecureRound | None:
        current = self.current
        return current if current is not None and current.round_number == round_number else None

    def stage(
        self, site: str, round_number: int, stage: str, message: StageMessage, live: set[str], now: float
    ) -> StageReply:
        """Record a stage call and answer it if its stage has closed (``ready=False``: call again)."""
        current = self._round(round_number)
        if current is None:
            if self.current is not None and round_number < self.current.round_number:
                if stage in AFTER_UPLOAD_STAGES:
                    raise LateStageAnswerError(
                        f"secure-aggregation stage {stage!r} of round {round_number} came after the round "
                        f"finished without it (the coordinator is at round {self.current.round_number}); "
                        "the broadcast says whether this site's update counted"
                    )
                raise WrongRoundError(
                    f"secure-aggregation stage {stage!r} for round {round_number}, but the coordinator "
                    f"is at round {self.current.round_number}; a replay or a late call is refused"
                )
            return StageReply(ready=False)  # the round has not started yet
        try:
            current.submit(site, stage, message)
        except (SecAggViolation, ValueError) as err:
            raise InvalidUpdateError(f"secure aggregation, round {round_number}: {err}") from None
        current.advance(live, now)
        return current.reply(site, stage)

    def withdraw(self, site: str, round_number: int, live: set[str], now: float) -> None:
        """``site`` waits for round ``round_number``'s broadcast: if it never advertised keys in
        that secure round, it will not (``SecureRound.withdraw``)."""
        current = self._round(round_number)
        if current is not None and not current.aborted:
            current.withdraw(site)
            current.advance(live, now)

    def progress(self) -> tuple[int, ...]:
        """The open secure round's number and ``SecureRound.progress`` (changes when a stage
        call's reply may have)."""
        current = self.current
        return (-1,) if current is None else (current.round_number, *current.progress())

    def advance(self, live: set[str], now: float) -> None:
        if self.current is not None:
            self.current.advance(live, now)

    def open_upload(self, site: str, spec: UploadSpec) -> SecureUpload:
        """Check a masked upload's manifest; only sites that shared keys in time may upload."""
        if spec.codec != SECURE_UPLOAD_CODEC:
            raise InvalidUpdateError(
                f"secure aggregation is on: uploads must be masked (codec {SECURE_UPLOAD_CODEC!r}), got "
                f"{spec.codec!r}; the site must run with the coordinator's [privacy] settings"
            )
        dtype = MODULUS_DTYPES[self.privacy.modulus_bits]
        current = self._round(spec.round)
        if current is None:
            # No key stage ran for this round here (e.g. this coordinator restarted): there is no
            # size to check against, and nothing it could unmask.
            raise WrongRoundError(
                f"site {site!r} cannot upload to secure round {spec.round} (no secure round "
                "with that number is open here); its update stays out of this round: wait for "
                "the broadcast"
            )
        sent_values = current.context.numel
        upload_bytes = sent_values * (self.privacy.modulus_bits // 8)
        if spec.dtype != dtype.name or list(spec.shape) != [sent_values]:
            raise InvalidUpdateError(
                f"masked upload of {spec.dtype} {list(spec.shape)}; expected {dtype.name} [{sent_values}]"
            )
        if spec.total_bytes != upload_bytes or spec.chunk_size != self.wire_chunk_bytes:
            raise InvalidUpdateError(
                f"masked upload of {spec.total_bytes} bytes in chunks of {spec.chunk_size}; expected "
                f"{upload_bytes} bytes in chunks of {self.wire_chunk_bytes} (one protocol chunk each)"
            )
        if not current.aborted and not current.may_upload(site):
            current.withdraw(site)  # masked for another protocol instance: don't wait for it
        if current.aborted or not current.may_upload(site):
            why = current.aborted or "the site did not share keys before the key stage closed"
            raise WrongRoundError(
                f"site {site!r} cannot upload to secure round {spec.round} ({why}); its update "
                "stays out of this round: wait for the broadcast"
            )
        existing = self._uploads.get(site)
        if existing is not None:
            if existing.spec.total_bytes != spec.total_bytes:
                raise InvalidUpdateError(f"site {site!r} re-opened its masked upload with another size")
            return existing
        upload = SecureUpload(spec=spec, num_chunks=num_chunks(sent_values, self.privacy.chunk_size), received=set())
        self._uploads[site] = upload
        return upload

    def add_chunk(self, site: str, upload: SecureUpload, index: int, data: bytes) -> None:
        """Add one masked chunk into the protocol's sum (a resent identical chunk is a no-op)."""
        current = self._round(upload.spec.round)
        if current is None or current.aborted:
            raise WrongRoundError(f"secure round {upload.spec.round} is over or aborted; upload refused")
        if not 0 <= index < upload.num_chunks:
            raise InvalidUpdateError(f"masked chunk {index} is outside the upload's {upload.num_chunks} chunks")
        try:
            current.server.receive_masked_chunk(site_index(site), index, data)
        except ValueError as err:
            raise InvalidUpdateError(f"site {site!r}: {err}") from None
        upload.received.add(index)

    def upload_status(self, site: str, round_number: int) -> UploadProgress:
        upload = self._uploads.get(site)
        if upload is None or upload.spec.round != round_number:
            return UploadProgress(known=False)
        done = sorted(upload.received)
        return UploadProgress(
            manifest=upload.spec.raw, received=tuple((i, i + 1) for i in done),
            missing=tuple(upload.missing()), complete=upload.complete,
        )

    def upload_progress(self, upload: SecureUpload) -> UploadProgress:
        return UploadProgress(
            complete=upload.complete, missing=tuple(upload.missing()),
            received_bytes=len(upload.received) * self.wire_chunk_bytes,
        )

    def close_decision(self, members: set[str], contributed: set[str], min_sites: int, now: float) -> bool:
        """Whether uploads of the current secure round close now (``SecureRound.uploads_close``:
        also when a key stage timed out or the quorum can no longer upload, aborting the round)."""
        current = self.current
        return current is not None and current.uploads_close(members, contributed, min_sites, now)

    def close_upload(self, now: float) -> None:
        """Uploads closed: freeze the survivors; the consistency and unmask stages begin."""
        if self.current is not None:
            self.current.close_upload(now)
            self._unmasking = True

    @property
    def unmasked(self) -> bool:
        """Unmasking finished (or the round was aborted): the round can be aggregated."""
        return self.current is None or self.current.done

    # ------------------------------------------------------------------------------------------
    # Aggregation (outside the lock; the round is frozen)

    def finish_round(
        self,
        strategy: Strategy,
        global_flat: torch.Tensor,
        aggregator: Aggregation,
        plan: RoundPlan,
        contributors: list[str],
    ) -> tuple[RoundUpdate, list[str], float, dict[str, Any]]:
        """Outer step for a privacy round: (update, contributors, |mean update|, metrics)."""
        p = self.privacy
        info: dict[str, Any] = {"secure_aggregation": p.secure_aggregation, "dp": p.dp}
        mean: torch.Tensor | None
        noise_multiplier = p.noise_multiplier
        if self.secure:
            current = self.current
            try:
                if current is None:
                    raise SecAggAbort("no secure round was started")
                mean = current.result()
                survivors = current.survivors
                if p.dp != "off":
                    noise_multiplier = current.noise_multiplier()
                info["survivors"] = survivors
                info["dropped_after_upload"] = sorted(set(survivors) - set(current.unmask_answered))
            except SecAggAbort as why:
                mean, survivors = None, []
                info["aborted"] = str(why) or (current.aborted if current is not None else "")
            self.current = None
            self._uploads = {}
            contributors = survivors
            if mean is not None and p.dp == "central":
                mean = central_dp_mean(mean, len(survivors), p)
        elif contributors:
            # Central DP without secure aggregation: the round's CentralDPSum clipped each update
            # and noises the sum as it hands the mean over.
            mean = aggregator.take_result()
        else:
            mean = None
        if mean is None:
            update = strategy.no_change(global_flat, plan)
            norm = 0.0
        else:
            update = strategy.apply_mean_update(
                global_flat, mean.to(torch.float32), tuple(contributors), plan, consume_mean=True
            )
            del mean
            norm = update.mean_norm
            if self.accountant is not None:
                self.accountant.step(noise_multiplier)
        if self.accountant is not None:
            info["epsilon"] = self.accountant.epsilon()
            info["delta"] = p.delta
            info["noise_multiplier"] = noise_multiplier
            info["budget_exhausted"] = not self.accountant.allows(noise_multiplier, p.epsilon_budget)
        return update, contributors, norm, info

    # ------------------------------------------------------------------------------------------
    # Checkpoints

    def state(self) -> dict[str, Any]:
        return {} if self.accountant is None else {"accountant": self.accountant.state()}

    def load_state(self, state: dict[str, Any]) -> None:
        if self.accountant is not None and "accountant" in state:
            self.accountant.load_state(state["accountant"])


def epsilon_text(record: dict[str, Any]) -> str:
    """``eps=1.23 (delta=1e-05)`` for log lines and summaries; empty without DP."""
    eps = record.get("epsilon")
    if eps is None or not math.isfinite(float(eps)):
        return ""
    return f"eps={float(eps):.4g} (delta={record.get('privacy_delta', record.get('delta', 0)):g})"

"""Synchronous DiLoCo rounds on a real site: train from ``θ_t``, upload, wait, apply.

Per round the site trains H inner steps from the global weights it holds (every rank of a
multi-rank site), computes the pseudo-gradient ``θ_t − θ_k``, encodes it with the strategy's
uplink (one fragment: the whole model) or masks it (secure aggregation), opens the wait for the
round's broadcast, uploads, and applies the broadcast with ``strategy.apply_downlink``; the
model then starts the next round from the new ``θ_{t+1}``. The rules for stragglers, restarts,
drops and non-finite updates are in ``geoloco.site_agent.agent``'s docstring; this module keeps
the update a site trained until its round's broadcast resolves it (``PendingUpdate``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final, Literal

import torch

from geoloco.algorithms.diloco import pseudo_gradient
from geoloco.compression import Encoded
from geoloco.protos import geoloco_pb2 as pb
from geoloco.site_agent.client import OpenBroadcast, RoundClosed, RunFinished, UpdateRejected
from geoloco.site_agent.persist import prefixed, unprefixed
from geoloco.site_agent.runner import RoundRunner, TrainedUpdate
from geoloco.site_agent.trainer import SiteTrainer
from geoloco.site_agent.uplink import StrategyUplink, UplinkUpdate, keep_or_drop

__all__ = ["PendingUpdate", "PlainRounds", "SyncRounds"]

logger = logging.getLogger(__name__)

PENDING_NEW: Final = "new"
"""Not uploaded yet (or to be sent again after a re-join: the coordinator deduplicates)."""
PENDING_UPLOADED: Final = "uploaded"
PENDING_LATE: Final = "late"
"""Its round closed before the upload completed: the round's broadcast resolves it."""
PENDING_DROPPED: Final = "dropped"
"""Nothing to send (non-finite, refused, not in the secure round): only the broadcast is taken."""

PendingState = Literal["new", "uploaded", "late", "dropped"]

_PIECE_ELEMENTS: Final = 1 << 20
"""Values per piece of a pseudo-gradient formed in the residual (a 4 MB temporary)."""


@dataclass(slots=True)
class PendingUpdate:
    """An update the site trained, kept until its round's broadcast says what became of it."""

    trained: TrainedUpdate
    state: PendingState = PENDING_NEW
    fold_late: bool = False
    """Missed its round with ``late_updates = "fold"``: offered to the next round once the
    missed round's broadcast shows the next one is open."""
    withheld: str = ""
    """Why there is no update to send (NaN/Inf values), told to the coordinator with the wait
    for the round's broadcast so the round does not wait for it; empty when there is one."""

    @property
    def round(self) -> int:
        return self.trained.round


class SyncRounds(RoundRunner):
    """Synchronous DiLoCo rounds, whatever trains them (see the module docstring): a subclass
    trains the held round and hands its update to ``_sync``."""

    pending: PendingUpdate | None = None
    """The update trained for ``pending.round``, until that round's broadcast resolves it."""

    folds_late = True
    """An update that missed its round may be offered to the next one (``late_updates =
    "fold"``, when the uplink can too)."""

    def _ready_to_train(self) -> bool:
        """True when the held round is the one to train now; otherwise chase the coordinator's
        broadcasts (behind it after a re-join) or mark the run finished (its end reached)."""
        state = self.state
        if state.is_behind:
            self._chase()
            return False
        if state.at_end:
            state.mark_finished()
            return False
        self._check_round_info()
        return True

    def _pending(self, trained: TrainedUpdate) -> PendingUpdate:
        """``trained`` kept until its round's broadcast: to be sent, or (nothing to send) only
        the broadcast to take, with why."""
        if trained.update is not None:
            return PendingUpdate(trained)
        return PendingUpdate(trained, state=PENDING_DROPPED, withheld=self.withheld)

    def _sync(self, pending: PendingUpdate) -> None:
        """Upload ``pending`` (unless it was sent already, or there is nothing to send), then
        take its round's broadcast."""
        opened = None
        if pending.state == PENDING_NEW:
            opened = self.client.open_broadcast(pending.round)
            try:
                on_time = self._upload(pending)
            except BaseException:
                opened.cancel()
                raise
            if not on_time:
                # The round had closed: the early wait may already hold a header written before
                # a late update was folded in, so ask again.
                opened.cancel()
                opened = None
        self._resolve(pending, opened)

    def rejoined(self, *, coordinator_round: int, new_session: bool, must_fetch: bool) -> bool:
        pending = self.pending
        if pending is None:
            return False
        if pending.round == coordinator_round and not must_fetch:
            if pending.state != PENDING_DROPPED:
                pending.state = PENDING_NEW  # re-send; the coordinator deduplicates
        elif not new_session and pending.round < coordinator_round:
            # Same session, the round moved on: its broadcast says whether we counted.
            if pending.state == PENDING_NEW:
                pending.state = PENDING_LATE
        else:
            logger.info(
                "site %s: dropping its update for round %d (the coordinator is at round %d%s)",
                self.site, pending.round, coordinator_round, " in a new session" if new_session else "",
            )
            self.pending = None
            return False
        return True

    def snapshot(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """The uplink's residuals and the update awaiting its round's broadcast; None with
        secure aggregation, whose masks and key stages belong to one process's round."""
        uplink = self.uplink
        if not isinstance(uplink, StrategyUplink):
            return None
        uplink_tensors, uplink_meta = uplink.state()
        tensors = prefixed("uplink.", uplink_tensors)
        meta: dict[str, Any] = {"uplink": uplink_meta, "pending": None}
        pending = self.pending
        if pending is not None:
            trained = pending.trained
            update = trained.update
            meta["pending"] = {
                "round": trained.round, "state": pending.state, "fold_late": pending.fold_late,
                "loss": trained.loss, "samples": trained.samples, "inner_steps": trained.inner_steps,
                "inner_time_s": trained.inner_time_s,
                # The phase times are part of the upload's manifest (its metrics): a restarted
                # process resends them, or the coordinator refuses the resend as another manifest.
                "phases_s": dict(trained.phases_s),
                "update": None if update is None else {
                    "fragment": update.fragment, "sample_weight": update.sample_weight,
                    "wire": update.wire,
                },
            }
            if update is not None:
                data = bytearray(update.data)
                tensors["pending.data"] = (
                    torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
                )
        return tensors, meta

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        uplink = self.uplink
        if not isinstance(uplink, StrategyUplink):
            return
        uplink.load_state(unprefixed("uplink.", tensors), meta["uplink"], self.trainer.device)
        saved = meta.get("pending")
        if saved is None:
            return
        update = None
        if saved["update"] is not None:
            data = tensors["pending.data"].numpy().tobytes()
            Encoded.from_bytes(data)  # a damaged saved update fails here, at the restore
            update = UplinkUpdate(
                fragment=int(saved["update"]["fragment"]), data=data,
                sample_weight=float(saved["update"]["sample_weight"]),
                wire=dict(saved["update"]["wire"]),
            )
        trained = TrainedUpdate(
            round=int(saved["round"]), update=update, loss=float(saved["loss"]),
            samples=int(saved["samples"]), inner_steps=int(saved["inner_steps"]),
            inner_time_s=float(saved["inner_time_s"]), started_s=time.monotonic(),
            phases_s={str(k): float(v) for k, v in saved.get("phases_s", {}).items()},
        )
        self.pending = PendingUpdate(trained, state=saved["state"], fold_late=bool(saved["fold_late"]))
        logger.info("site %s: restored its update for round %d (%s)", self.site, trained.round, saved["state"])

    def _load_fetched(self, weights: torch.Tensor, held_before: int | None, round_number: int) -> None:
        self.trainer.load_(weights)

    def _load_broadcast(self, round_number: int) -> None:
        self.trainer.load_(self.state.global_weights)

    # ---------------------------------------------------------------------------------------

    def _upload(self, pending: PendingUpdate) -> bool:
        """Upload ``pending``; True when it reached its own round before that round closed."""
        trained = pending.trained
        assert trained.update is not None
        self.state.phase = pb.SITE_PHASE_UPLOADING
        started = time.monotonic()
        try:
            response = self.uplink.upload(
                self.client, trained.update, round_number=trained.round,
                inner_steps=trained.inner_steps, metrics=trained.metrics(),
            )
            self.transfer_phases_s["upload"] = time.monotonic() - started
            pending.state = PENDING_UPLOADED
            self.state.phase = pb.SITE_PHASE_WAITING
            self.uplink.uploaded()  # secure: survivor list and unmask answer, before the broadcast
            return not response.folded_late
        except RoundClosed as why:
            logger.info("site %s: update for round %d is late (%s)", self.site, trained.round, why)
            pending.state = PENDING_LATE
            # A masked update belongs to its own round's sum. The missed round may still be
            # aggregating: the update is offered once its broadcast is here (the next round is
            # open by then), not on a timer that a slow aggregation would outlast.
            pending.fold_late = (
                self.state.algorithm.late_updates == "fold" and self.folds_late and self.uplink.folds_late
            )
        except RunFinished as why:
            logger.info("site %s: update for round %d is late (%s)", self.site, trained.round, why)
            pending.state = PENDING_LATE
        except UpdateRejected as why:
            logger.error("site %s: the coordinator rejected the update for round %d: %s",
                         self.site, trained.round, why)
            pending.state = PENDING_DROPPED
        return False

    def _upload_late(self, pending: PendingUpdate) -> tuple[bool, bool]:
        """``late_updates = "fold"``: offer the update that missed its round to the next one,
        which the coordinator opened before it broadcast the missed round. (folded, refused):
        folded in (discounted); refused by the next round (dropped, as a refused update of its
        own round is); otherwise (two rounds late by now, the run over) it goes back to the
        residual like any update that missed its round."""
        trained = pending.trained
        assert trained.update is not None
        try:
            self.uplink.upload(
                self.client, trained.update, round_number=trained.round,
                inner_steps=trained.inner_steps, metrics={"train_loss": trained.loss, "late": 1.0},
            )
        except UpdateRejected as why:
            logger.info("site %s: late update for round %d refused (%s)", self.site, trained.round, why)
            return False, True
        except (RoundClosed, RunFinished) as why:
            logger.info("site %s: late update for round %d not folded in (%s)",
                        self.site, trained.round, why)
            return False, False
        pending.state = PENDING_UPLOADED
        logger.info("site %s: late update for round %d folded into the next round",
                    self.site, trained.round)
        return True, False

    def _resolve(self, pending: PendingUpdate, opened: OpenBroadcast | None) -> None:
        """Wait for ``pending``'s round's broadcast and apply it; the update goes back into
        the residual when the round did not aggregate it, unless it refused it
        (``keep_or_drop``)."""
        bytes_down_before = self.client.stats.received
        answer = self._await_broadcast(pending.round, opened, withheld=pending.withheld)
        if answer is None:
            self.pending = None
            return
        header, data = answer
        trained = pending.trained
        included, refused = bool(header.included), bool(header.refused)
        if pending.fold_late and not included and not refused:
            included, refused = self._upload_late(pending)
        if not included and trained.update is not None:
            keep_or_drop(self.uplink, trained.update, refused=refused, site=self.site, round_number=trained.round)
        resynced = self._apply_broadcast(pending.round, header, data)
        del answer, data  # the download buffer (model-sized for a lossless downlink) goes now
        self.pending = None
        self.state.take_broadcast_header(header)
        uploaded = pending.state == PENDING_UPLOADED and trained.update is not None
        self._report(
            trained, header, included=included, resynced=resynced,
            bytes_up=len(trained.update.data) if uploaded and trained.update is not None else 0,
            bytes_down=self.client.stats.received - bytes_down_before,
        )
        self._boundary()


class PlainRounds(SyncRounds):
    """Synchronous DiLoCo rounds trained by the site's ``SiteTrainer`` (see the module
    docstring)."""

    trainer: SiteTrainer
    """A data-parallel site's trainer: every rank holds the whole model."""

    def step(self) -> None:
        pending = self.pending
        if pending is None:
            if not self._ready_to_train():
                return
            pending = self.pending = self._train_round()
            # Saved before the upload: a site killed after it re-sends the very same bytes.
            self._boundary()
        self._sync(pending)

    def _train_round(self) -> PendingUpdate:
        state, trainer = self.state, self.trainer
        round_number = state.held_round
        inner_steps = int(state.run_config.inner_steps)
        budget_s = state.algorithm.round_time_budget_s
        round_seed = state.round_seed(round_number)
        started = time.monotonic()
        trainer.tell_followers_to_train(round_number, inner_steps, budget_s)
        # Secure aggregation: the key stages run beside the inner steps.
        self.uplink.begin_round(
            self.client, round_number=round_number, round_seed=round_seed,
            numel=self.strategy.update_numel(round_number),
        )
        state.phase = pb.SITE_PHASE_TRAINING
        # The previous round's transfers are reported with this round's upload.
        phases = self.transfer_phases_s
        self.transfer_phases_s = {}
        training_at = time.monotonic()
        result = trainer.train_round(state.global_weights, round_number, inner_steps, budget_s)
        trained_at = time.monotonic()
        if isinstance(self.uplink, StrategyUplink) and state.algorithm.adaptive_uplink.enabled:
            # The coordinator's codec for this site and round (empty: the run's uplink codec).
            self.uplink.use_codec(state.uplink_codec(round_number) or state.algorithm.uplink_codec)
        encoded = self._encode_added(round_number, result.samples)
        encoding_at = time.monotonic()
        if encoded is None:
            update = self._pseudo_gradient()
            encoding_at = time.monotonic()
            encoded = self._encode(update, round_number, 0, result.samples)
            del update
        else:
            encoding_at = trained_at  # formed in the residual as it was encoded: all "encode"
        phases.update(
            train=trained_at - training_at, pseudo_gradient=encoding_at - trained_at,
            encode=time.monotonic() - encoding_at,
        )
        trained = TrainedUpdate(
            round=round_number, update=encoded, loss=result.loss, samples=result.samples,
            inner_steps=result.steps, inner_time_s=result.seconds, started_s=started, phases_s=phases,
        )
        return self._pending(trained)

    def _encode_added(self, round_number: int, samples: int) -> UplinkUpdate | None:
        """The round's update encoded with the pseudo-gradient ``θ_t − θ_k`` added into the
        uplink's error-feedback residual piece by piece (``StrategyUplink.encode_added``), so
        no model-sized update vector exists; None where the dense path must run instead (no
        error feedback, secure aggregation, weights not fp32 on one device, a non-finite or
        unencodable update)."""
        uplink, trainer = self.uplink, self.trainer
        held = self.state.global_weights
        if not isinstance(uplink, StrategyUplink) or uplink.encoders.encoders[0].error_feedback is None:
            return None
        tensors = list(trainer.layout.tensors(trainer.module))
        if held.dtype != torch.float32 or not held.is_contiguous() or any(
            p.dtype != torch.float32 or p.device != held.device for _, p in tensors
        ):
            return None

        def pieces() -> Iterator[tuple[int, torch.Tensor]]:
            with torch.no_grad():
                for entry, param in tensors:
                    local = param.detach().reshape(-1)
                    for start in range(0, entry.numel, _PIECE_ELEMENTS):
                        stop = min(entry.numel, start + _PIECE_ELEMENTS)
                        at = entry.offset + start
                        yield at, pseudo_gradient(held[at : at + stop - start], local[start:stop])

        return uplink.encode_added(
            pieces, trainer.layout.numel, device=held.device,
            round_seed=self.state.round_seed(round_number), fragment=0, samples=samples,
        )

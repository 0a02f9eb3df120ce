"""What every round runner does the same way: fetch, apply a broadcast, chase, report.

A round runner drives a site's rounds against the coordinator through the public methods of
the site's parts: ``SiteState`` (the global weights and rounds), a ``RoundTrainer`` (the model
as the rounds see it: ``SiteTrainer`` for a data-parallel site, a sharded rank's rows for an
FSDP site) and a ``SiteUplink`` (plain or masked encoding), with the run's ``Strategy`` for the
math the simulator shares (downlink application, fragments, schedule). ``PlainRounds``
(``geoloco.site_agent.plain``) and ``ShardedRounds`` (``geoloco.site_agent.sharded``) run
synchronous DiLoCo rounds on the same ``SyncRounds`` mechanics, ``StreamingRounds``
(``geoloco.site_agent.streaming``) Streaming DiLoCo's overlapped fragment syncs and
``AsyncRounds`` (``geoloco.site_agent.async_rounds``) asynchronous DiLoCo; what differs is only
what the model does with new global weights, and when training and transfers happen.
"""

from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from geoloco.algorithms.diloco import pseudo_gradient_into_local
from geoloco.algorithms.finite import WITHHELD_NON_FINITE, all_finite
from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.strategy import Strategy
from geoloco.compression import Encoded
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.round_phases import site_metric_name
from geoloco.site_agent.client import (
    CoordinatorClient,
    OpenBroadcast,
    RejoinRequired,
    RoundClosed,
    RunFinished,
)
from geoloco.site_agent.config import RoundResult, SiteHooks
from geoloco.site_agent.state import SiteState
from geoloco.site_agent.uplink import SiteUplink, UplinkUpdate

__all__ = ["RoundRunner", "RoundTrainer", "TrainedUpdate"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TrainedUpdate:
    """One round's training and its encoded update (None: nothing to send — non-finite, or the
    site is not part of the round's secure sum)."""

    round: int
    update: UplinkUpdate | None
    loss: float
    samples: int
    inner_steps: int
    inner_time_s: float
    started_s: float
    """``time.monotonic()`` when the round's training began."""
    phases_s: dict[str, float] = field(default_factory=dict)
    """Seconds per site phase (``geoloco.protos.round_phases``): this round's train,
    pseudo_gradient and encode, and the *previous* round's upload, wait, download, apply and
    verify (over only after that round's broadcast, so reported with this upload)."""
    loop_metrics: dict[str, float] = field(default_factory=dict)
    """What the site's own training loop reports beside these (a sharded site's loop metrics,
    averaged over its ranks)."""

    def metrics(self) -> dict[str, float]:
        """The training metrics sent with the upload, and the site's phase times; the finite
        ones only (a loop that reports no loss has a NaN ``train_loss``): the coordinator keeps
        finite numbers, and a manifest holding a NaN is not equal to itself, so each of an
        upload's parallel streams would take it for a new upload replacing the others'."""
        metrics = {
            "train_loss": self.loss,
            "samples": float(self.samples),
            "inner_steps": float(self.inner_steps),
            "inner_time_s": self.inner_time_s,
        }
        metrics.update({site_metric_name(phase): seconds for phase, seconds in self.phases_s.items()})
        metrics.update(self.loop_metrics)
        return {name: value for name, value in metrics.items() if math.isfinite(value)}


class RoundTrainer(Protocol):
    """What the shared round mechanics touch of a site's training: the weights the rounds
    exchange, as one flat vector in ``ParamLayout`` order (the whole model on a data-parallel
    site, one rank's rows on a sharded one)."""

    device: torch.device
    """Where the global weights and the update are kept."""
    layout: ParamLayout
    """The whole model's layout (its ``numel`` is what a full fetch downloads)."""

    def load_(self, flat: torch.Tensor) -> None:
        """Set the trained weights to ``flat``."""

    def flatten(self) -> torch.Tensor:
        """The trained weights as one flat fp32 vector (a copy the caller may overwrite)."""

    def reset_optimizer_state(self) -> None:
        """Forget the inner optimizer's state after a non-finite update."""


class RoundRunner(ABC):
    """Shared round mechanics (see the module docstring); subclasses run the rounds."""

    def __init__(
        self,
        *,
        site: str,
        state: SiteState,
        trainer: RoundTrainer,
        client: Callable[[], CoordinatorClient],
        hooks: SiteHooks,
        strategy: Strategy,
        uplink: SiteUplink,
        on_boundary: Callable[[], None] | None = None,
    ) -> None:
        self.site = site
        self.state = state
        self.trainer = trainer
        self.hooks = hooks
        self.strategy = strategy
        self.uplink = uplink
        self._client = client
        self._on_boundary = on_boundary
        """Called at every round boundary (the agent saves the site's state there)."""
        self.withheld = ""
        """Why the latest ``_encode`` sent nothing (``WITHHELD_NON_FINITE``); empty otherwise."""
        self.transfer_phases_s: dict[str, float] = {}
        """The upload, wait, download, apply and verify seconds of the latest round (sent with
        the next upload: ``TrainedUpdate.phases_s``)."""
        self._setup()

    @property
    def client(self) -> CoordinatorClient:
        """The leader's coordinator client (one per ``SiteAgent.run``)."""
        return self._client()

    # ---------------------------------------------------------------------------------------
    # What a runner does

    def _setup(self) -> None:  # noqa: B027 (an optional hook: a runner may need no setup)
        """Check the site can run these rounds and set up the runner's own state."""

    @abstractmethod
    def step(self) -> None:
        """Run, chase or finish one round (one turn of ``SiteAgent.run``'s loop)."""

    def close(self) -> None:  # noqa: B027 (an optional hook: most runners hold no threads)
        """The agent's loop ended (finished, stopped or failed): stop what the runner runs
        beside it."""

    def rejoined(self, *, coordinator_round: int, new_session: bool, must_fetch: bool) -> bool:
        """The site joined again (coordinator at ``coordinator_round``, ``new_session`` after
        a coordinator restart); True while an update it trained is still to be resolved (so
        the join does not fetch weights over it)."""
        return False

    def snapshot(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """The runner's part of the site's saved state (``geoloco.site_agent.persist``); None
        when this runner's rounds are not saved (the default)."""
        return None

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Take a ``snapshot`` back, right after the runner was built at a restarted site's
        first join."""
        raise NotImplementedError(f"{type(self).__name__} does not restore saved state")

    def _boundary(self) -> None:
        if self._on_boundary is not None:
            self._on_boundary()

    @abstractmethod
    def _load_fetched(self, weights: torch.Tensor, held_before: int | None, round_number: int) -> None:
        """Bring the model in line with fetched global weights (``held_before``: the round the
        site held before, None when it held none)."""

    @abstractmethod
    def _load_broadcast(self, round_number: int) -> None:
        """Bring the model in line with round ``round_number``'s applied broadcast."""

    # ---------------------------------------------------------------------------------------
    # Shared mechanics

    def fetch(self) -> None:
        """Fetch the coordinator's full global weights and hold them."""
        self.state.phase = pb.SITE_PHASE_FETCHING
        manifest, weights = self.client.fetch_model(self.trainer.layout.numel)
        weights = weights.to(self.trainer.device)
        before = self.state.adopt_weights(weights, manifest.round)
        self._load_fetched(weights, before, manifest.round)
        logger.info("site %s fetched the weights of round %d", self.site, manifest.round)

    def _apply_broadcast(
        self, round_number: int, header: pb.BroadcastHeader, data: bytes | memoryview | None
    ) -> bool:
        """Apply round ``round_number``'s broadcast (digest-checked); True when the full
        weights had to be fetched instead. The seconds spent go into ``transfer_phases_s``:
        parsing the delta and loading the model count as ``apply``, the digest as ``verify``."""
        if header.action == pb.BROADCAST_ACTION_APPLY_DELTA and data is not None:
            timings: dict[str, float] = {}
            try:
                started = time.monotonic()
                # A view of the download (decoded once), whose SHA-256 the download verified: the
                # container's CRC-32 pass would add nothing.
                downlink = Encoded.from_bytes(
                    data, copy=False,
                    check_crc=header.delta.checksum.algorithm != pb.CHECKSUM_ALGORITHM_SHA256,
                )
                timings["apply"] = time.monotonic() - started
                # Into the held weights (no second model-sized vector); a mismatch drops them.
                if self.state.apply_broadcast_in_place(
                    self.strategy, round_number, downlink, header.weights_digest.digest.hex(), timings=timings,
                ):
                    del downlink
                    started = time.monotonic()
                    self._load_broadcast(round_number)
                    timings["apply"] += time.monotonic() - started
                    return False
            finally:
                self._add_phases(timings)
            logger.warning(
                "site %s: weights digest after round %d differs from the coordinator's; "
                "fetching the full weights", self.site, round_number,
            )
        self.fetch()
        return True

    def _await_broadcast(
        self, round_number: int, opened: OpenBroadcast | None = None, *, withheld: str = ""
    ) -> tuple[pb.BroadcastHeader, memoryview | None] | None:
        """Round ``round_number``'s broadcast (through ``opened`` when the wait was opened
        before the upload); None when the run finished instead. The seconds until its header
        (``wait``) and then until its last byte (``download``) go into ``transfer_phases_s``.
        ``withheld``: the site sends no update to the round, and why."""
        self.state.phase = pb.SITE_PHASE_WAITING
        started = time.monotonic()
        try:
            answer = self.client.await_broadcast(
                round_number, on_progress=self._on_progress, opened=opened, withheld=withheld
            )
            done = time.monotonic()
            header_at = min(max(self.client.stats.broadcast_header_s, started), done)
            self._add_phases({"wait": header_at - started, "download": done - header_at})
            return answer
        except RunFinished:
            self.state.mark_finished()
            return None
        except RoundClosed as why:
            # The coordinator is at an earlier round than this site (it restarted from an older
            # checkpoint): join again and take the weights it names.
            raise RejoinRequired(str(why)) from None

    def _add_phases(self, seconds: dict[str, float]) -> None:
        """Add ``seconds`` per phase to ``transfer_phases_s``. A runner whose transfers run on a
        thread of their own (``AsyncRounds``) does it under the lock its trainer takes the
        seconds with: a phase is never added into a table the trainer is emptying."""
        phases = self.transfer_phases_s
        for phase, spent in seconds.items():
            phases[phase] = phases.get(phase, 0.0) + spent

    def _check_round_info(self) -> None:
        """Before training the held round: a site that fetched weights newer than its round info
        (a straggler whose last broadcast carried an older round, or a round that closed between
        a join and its fetch) knows their round but not its seed; a join answers with the
        coordinator's current round, or tells it to chase."""
        held = self.state.held_round
        if not self.state.knows_round(held):
            raise RejoinRequired(f"holding the weights of round {held} without that round's info")

    def _chase(self) -> None:
        """Behind the coordinator (after a re-join): apply its broadcasts without training."""
        round_number = self.state.held_round
        answer = self._await_broadcast(round_number)
        if answer is None:
            return
        header, data = answer
        self._apply_broadcast(round_number, header, data)
        self.state.take_broadcast_header(header)
        self._boundary()

    def _pseudo_gradient(self) -> torch.Tensor:
        """The round's ``θ_t − θ_k`` of the weights the rounds exchange (the whole model, or a
        sharded rank's rows), formed in the copy of the trained weights ``trainer.flatten()``
        gives, so it costs one model-sized vector."""
        return pseudo_gradient_into_local(self.state.global_weights, self.trainer.flatten())

    def _encode(
        self, update: torch.Tensor, round_number: int, fragment: int, samples: float
    ) -> UplinkUpdate | None:
        """``update`` (the round's pseudo-gradient) for the wire; None for a non-finite update
        (``_withhold``) or one the secure sum cannot take."""
        if not all_finite(update):
            self._withhold(round_number, fragment)
            return None
        self.withheld = ""
        return self.uplink.encode(
            update, round_seed=self.state.round_seed(round_number), fragment=fragment, samples=samples
        )

    def _withhold(self, round_number: int, fragment: int, where: str = "") -> None:
        """Send nothing for a non-finite update: the fragment's residual and the inner
        optimizer's state are reset (a NaN in AdamW's moments would make every later update
        NaN too) and the wait for the broadcast says why (``withheld``). ``where``: which
        ranks had the NaN/Inf values, when the site's ranks agreed on it."""
        logger.error(
            "site %s: the pseudo-gradient of round %d (fragment %d) has NaN/Inf values%s; not "
            "uploading it, resetting the error-feedback residual and the inner optimizer's "
            "state", self.site, round_number, fragment, where,
        )
        self.uplink.reset(fragment)
        self.trainer.reset_optimizer_state()
        self.withheld = WITHHELD_NON_FINITE

    def _report(
        self, trained: TrainedUpdate, header: pb.BroadcastHeader, *, included: bool, resynced: bool,
        bytes_up: int, bytes_down: int, fragment: int | None = None,
    ) -> None:
        """Count the round, log it and call ``hooks.on_round_end``."""
        logger.info(
            "site %s round %d%s: loss %.4f, %s (%d sites), now at round %d",
            self.site, trained.round, "" if fragment is None else f" (fragment {fragment})",
            trained.loss, "included" if included else "NOT included", header.num_contributors,
            self.state.held_round,
        )
        self._round_end(
            trained, round_number=trained.round, included=included, num_contributors=header.num_contributors,
            resynced=resynced, bytes_up=bytes_up, bytes_down=bytes_down,
        )

    def _round_end(
        self, trained: TrainedUpdate, *, round_number: int, included: bool, num_contributors: int,
        resynced: bool, bytes_up: int, bytes_down: int,
    ) -> None:
        """Count the round and call ``hooks.on_round_end`` with its ``RoundResult``."""
        state = self.state
        state.count_round(included=included)
        if self.hooks.on_round_end is not None:
            self.hooks.on_round_end(
                RoundResult(
                    round=round_number,
                    train_loss=trained.loss,
                    samples=trained.samples,
                    inner_steps=trained.inner_steps,
                    included=included,
                    num_contributors=num_contributors,
                    resynced=resynced,
                    bytes_up=bytes_up,
                    bytes_down=bytes_down,
                    inner_time_s=trained.inner_time_s,
                    round_time_s=time.monotonic() - trained.started_s,
                    weights_digest=state.digest or "",
                    next_round=state.held_round,
                )
            )

    def _on_progress(self, progress: pb.RoundProgress) -> None:
        logger.debug(
            "site %s waiting for round %d: %d uploads complete (quorum %d)",
            self.site, progress.round, progress.uploads_complete, progress.quorum,
        )

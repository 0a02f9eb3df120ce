"""Sharded sites: FSDP inside a site, every rank uploading its own shard in parallel.

A data-parallel site (``geoloco.site_agent.distributed``) needs the model on every rank and
has rank 0 alone move the whole update. A sharded site wraps the model with FSDP2
(``torch.distributed.fsdp.fully_shard`` over a 1-D device mesh; gloo on CPU, NCCL on GPU) and
every rank takes part in the run under the site's identity (the same certificate) as rank ``r``
of ``n``:

* rank 0 joins; the session, the run config, the round and the site process's instance id
  (``JoinRequest.instance_id``: every rank's requests are the one process's) are shared with the
  other ranks over the site's process group, and rank 0 alone sends heartbeats;
* every rank keeps the global weights of its own shard only (FSDP2's dim-0 rows of every
  parameter, ``param.to_local()``; ``geoloco.algorithms.shard_split``), trains the inner steps
  with FSDP (gradients reduce-scattered across ranks) in the user's own loop (``rounds()``) or
  in ``run()``, forms the pseudo-gradient of its shard, encodes it with its own error-feedback
  residual (shard-sized) and uploads it itself (``UploadManifest.shard_index/shard_count/
  shard_split``), in parallel with the other ranks; when any rank's shard has NaN or Inf values
  no rank uploads and every rank resets its residual, as every other site runner does with a
  non-finite update (the ranks agree in the all-reduce that sums the site's samples);
* the round itself is a data-parallel site's (``ShardedRounds`` runs ``SyncRounds``, as
  ``PlainRounds`` does: the pseudo-gradient, the withheld non-finite update, the upload, the
  broadcast's resolution, the report), with the rank's rows as the weights it exchanges and
  ``ShardTrainer`` as what trains them;
* the coordinator holds the shards until all of the site's arrived and counts the site once
  (``geoloco.coordinator.shards``);
* every rank downloads its own rows (``ShardRef`` on FetchModel and AwaitBroadcast;
  ``geoloco.coordinator.shard_views``): of the weights at join, and of the broadcast delta when
  the downlink codec has no sparsifier (``none``, the casts, the block quantizers), so the site
  downloads one model's worth in total; then it checks its rows against the coordinator's
  digest of them.

``offload=True`` keeps the global rows and the residual in CPU memory (the outer optimizer's
state lives on the coordinator already), so a GPU holds only the training state.

Limits of this version, said where they bite:

* A sparse downlink codec (``topk`` ...) cannot be sliced: every rank then downloads the whole
  (compressed) delta, decodes it transiently and keeps its rows. With a block quantizer
  (``int8`` ...) a rank gets the whole blocks around its rows.
* A rank that loses its session stops with an error; restarting the site's ranks (torchrun
  ``--max-restarts``) joins them again as the same site. With ``state_dir`` each rank takes up
  its error-feedback residual as of the last round boundary; the model, the inner optimizer and
  the data position are the user's (``torch.distributed.checkpoint``). No late folding and no
  inner lr schedule of the coordinator's (the user steps their own scheduler). Secure
  aggregation, Streaming DiLoCo fragments, partial updates and relays are refused (by the site
  at join and by the coordinator).
* Tested on CPU with gloo; the code moves tensors between the model's device and ``held``'s, but
  no run on GPUs with NCCL has been made.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
import torch.distributed as dist
from torch import nn

from geoloco.algorithms.finite import all_finite
from geoloco.algorithms.params import ParamEntry, ParamLayout
from geoloco.algorithms.shard_split import DIM0, ShardRange, shard_ranges
from geoloco.algorithms.strategy import build_strategy
from geoloco.compression import Encoded, add_decoded_into, decode, slicing
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.folder_lock import FolderLock
from geoloco.protos.transport_errors import error_reason
from geoloco.protos.transport_tls import TLSFiles
from geoloco.site_agent.client import CoordinatorClient
from geoloco.site_agent.config import SiteAgentConfig, SiteHooks
from geoloco.site_agent.errors import SiteAgentError
from geoloco.site_agent.persist import (
    SiteSnapshot,
    SiteStateError,
    SiteStateStore,
    layout_fingerprint,
    lock_state_dir,
    run_fingerprint,
)
from geoloco.site_agent.plain import PendingUpdate, SyncRounds
from geoloco.site_agent.runner import TrainedUpdate
from geoloco.site_agent.state import SiteState
from geoloco.site_agent.uplink import StrategyUplink

__all__ = [
    "ShardTrainer", "ShardedRound", "ShardedRounds", "ShardedRunSummary", "ShardedSite", "local_shard",
    "rank_state_dir",
]

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, Any], torch.Tensor]

JOIN_ATTEMPTS = 5
"""Joins a sharded site makes before it gives up on holding one round's rows on every rank."""


def rank_state_dir(state_dir: str | os.PathLike[str], rank: int, world_size: int) -> Path:
    """Where rank ``rank`` of ``world_size`` saves its state under a site's ``state_dir``."""
    return Path(state_dir) / f"rank-{rank}-of-{world_size}"


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """This rank's rows of an FSDP2 parameter (``DTensor.to_local()``), or the tensor itself."""
    to_local = getattr(param, "to_local", None)
    return param if to_local is None else to_local()


def _samples(batch: Any) -> int:
    """Samples in a batch: the leading size of its first tensor (1 when there is none)."""
    first = batch[0] if isinstance(batch, list | tuple) and batch else batch
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() > 0 else 1


@dataclass(slots=True)
class ShardedRound:
    """One round's inner training, handed to the user's loop by ``ShardedSite.rounds()``."""

    number: int
    """The round being trained (the model holds its start weights ``θ_number``)."""
    inner_steps: int
    """Optimizer steps the coordinator asks of every rank this round."""
    total_rounds: int = 0
    """Rounds the run has (0: unbounded), so the loop can size its own lr schedule."""
    samples: float = 0.0
    """What this rank trained on this round (samples or tokens, as the run's weighting counts);
    the loop adds to it. The site's weight is the sum over its ranks; left at 0, each rank
    counts its inner steps instead."""
    metrics: dict[str, float] = field(default_factory=dict)
    """What the loop wants the coordinator's metrics to show for the site (e.g. ``{"loss": x}``,
    which is also the site's ``train_loss``); averaged over the ranks key by key, reported with
    the upload beside the site's own (at most 12; the coordinator takes 32 in all)."""


@dataclass(slots=True)
class ShardedRunSummary:
    """What one rank of a sharded site did (the test and the user's logs read it)."""

    rounds_trained: int = 0
    rounds_included: int = 0
    final_round: int = 0
    run_finished: bool = False
    resyncs: int = 0
    """Rounds after which this rank's rows did not match the coordinator's digest and were fetched."""
    digests_checked: int = 0
    """Broadcasts after which this rank's rows were checked against the coordinator's digest."""
    restored_round: int | None = None
    """The round this rank's saved state was taken at (``state_dir``), when one was taken up."""
    bytes_received: int = 0
    """Message bytes this rank received from the coordinator (its rows, not the model)."""
    upload_spans: list[tuple[int, float, float]] = field(default_factory=list)
    """(round, start, end) of every upload, ``time.time()`` seconds (comparable across ranks)."""


class ShardTrainer:
    """What a sharded rank trains, as the rounds see it (``RoundTrainer``): the rank's rows of
    every parameter (FSDP2's local shards) as one flat vector in ``ranges`` order, and
    ``run()``'s inner loop."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, data: Iterable[Any] | None,
        loss_fn: LossFn | None, *, layout: ParamLayout, views: list[tuple[int, torch.Tensor]],
        numel: int, device: torch.device,
    ) -> None:
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.layout = layout
        self.device = device
        """Where the global rows and the residual live (``ShardedSite``'s ``offload``)."""
        self._data: Iterator[Any] | None = None if data is None else iter(data)
        self._views = views
        """(position in the rank's rows, flat view of the parameter's local rows)."""
        self._numel = numel

    @property
    def trains_itself(self) -> bool:
        """It was given data and a loss (``ShardedSite.run()``)."""
        return self._data is not None and self.loss_fn is not None

    def load_(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for at, view in self._views:
                view.copy_(flat[at : at + view.numel()].view_as(view))

    def flatten(self) -> torch.Tensor:
        flat = torch.empty(self._numel, dtype=torch.float32, device=self.device)
        for at, view in self._views:
            flat[at : at + view.numel()].copy_(view.detach().reshape(-1))
        return flat

    def reset_optimizer_state(self) -> None:
        self.optimizer.state.clear()  # every rank does it: the ranks agreed the update was not finite

    def train(self, current: ShardedRound) -> None:
        """``current.inner_steps`` steps of ``loss_fn`` on ``data``: backward and an optimizer
        step per batch; the samples and the mean loss go into ``current``."""
        if self._data is None or self.loss_fn is None:
            raise SiteAgentError("run() trains on data with loss_fn; pass both to ShardedSite, or write "
                                 "the inner loop yourself with rounds()")
        losses = []
        for _ in range(current.inner_steps):
            batch = next(self._data)
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.loss_fn(self.model, batch)
            loss.backward()
            self.optimizer.step()
            current.samples += _samples(batch)
            losses.append(loss.detach())
        if losses:
            current.metrics["loss"] = float(torch.stack(losses).float().mean())


class ShardedRounds(SyncRounds):
    """A sharded rank's synchronous rounds: ``SyncRounds`` with the rank's rows as the weights
    (see the module docstring). ``ShardedSite.rounds()`` runs the training between ``begin``
    and ``finish`` (the user's loop, or ``ShardTrainer.train`` for ``run()``); ``step`` is the
    same round in one call, the turn every runner offers a caller that drives it itself."""

    trainer: ShardTrainer
    folds_late = False
    """The coordinator refuses a late shard: a site's shards are one update of one round."""

    def __init__(
        self, *, group: dist.ProcessGroup | None, collective_device: torch.device, rows: torch.Tensor,
        ranges: list[ShardRange], rank: int, world_size: int, **runner: Any,
    ) -> None:
        self.group, self.collective_device = group, collective_device
        self.rows = rows
        """The global weights of this rank's rows (``θ_t``; pinned when offloaded from a GPU): the
        state holds this very tensor."""
        self.ranges, self.rank, self.world_size = ranges, rank, world_size
        self.resyncs = 0
        self.digests_checked = 0
        self.upload_spans: list[tuple[int, float, float]] = []
        self.last_broadcast: pb.BroadcastHeader | None = None
        self._started_s = 0.0
        super().__init__(**runner)

    def begin(self) -> ShardedRound | None:
        """The next round to train, the model's rows holding its start weights; None when the
        run is over."""
        state = self.state
        while not state.finished:
            if self._ready_to_train():
                self._started_s = time.monotonic()
                state.phase = pb.SITE_PHASE_TRAINING
                return ShardedRound(
                    number=state.held_round, inner_steps=int(state.algorithm.inner_steps),
                    total_rounds=state.total_rounds,
                )
        return None

    def finish(self, current: ShardedRound) -> None:
        """Upload this rank's rows of ``current``'s pseudo-gradient and take the broadcast."""
        pending = self.pending = self._take(current)
        self._sync(pending)

    def step(self) -> None:
        current = self.begin()
        if current is not None:
            self.trainer.train(current)
            self.finish(current)

    def _take(self, current: ShardedRound) -> PendingUpdate:
        """The round the user's loop trained, as the update every rank sends its rows of: the
        site's weight is the sum over its ranks (``current.samples``, or each rank's inner
        steps), its metrics the ranks' mean, and it is sent only when every rank's rows are
        finite (a site missing a shard is never counted)."""
        round_number, inner_steps = current.number, current.inner_steps
        trained_at = time.monotonic()
        self.trainer.optimizer.zero_grad(set_to_none=True)  # spent: a shard of gradients less through the sync
        update = self._pseudo_gradient()
        own = float(current.samples) if current.samples > 0 else float(inner_steps)
        totals = torch.tensor([own, float(all_finite(update))], dtype=torch.float64, device=self.collective_device)
        dist.all_reduce(totals, group=self.group)
        sample_weight, finite_ranks = totals.tolist()
        metrics = self._site_metrics(current.metrics)
        encoding_at = time.monotonic()
        if finite_ranks < self.world_size:
            del update
            self._withhold(round_number, 0, f" on {self.world_size - int(finite_ranks)} of {self.world_size} ranks")
            encoded = None
        else:
            encoded = self._encode(update, round_number, 0, sample_weight)
            del update
        phases = self.transfer_phases_s
        self.transfer_phases_s = {}
        phases.update(
            train=trained_at - self._started_s, pseudo_gradient=encoding_at - trained_at,
            encode=time.monotonic() - encoding_at,
        )
        return self._pending(TrainedUpdate(
            round=round_number, update=encoded, loss=metrics.get("loss", math.nan), samples=int(sample_weight),
            inner_steps=inner_steps, inner_time_s=trained_at - self._started_s, started_s=self._started_s,
            phases_s=phases, loop_metrics=metrics,
        ))

    def _site_metrics(self, own: dict[str, float]) -> dict[str, float]:
        """The ranks' metrics averaged key by key (a key some rank lacks is averaged over those
        that have it), so every shard reports the same site-level numbers."""
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, {str(k): float(v) for k, v in own.items()}, group=self.group)
        keys = sorted({key for ranks in everyone for key in ranks})
        return {key: sum(r[key] for r in everyone if key in r) / sum(key in r for r in everyone) for key in keys}

    def _upload(self, pending: PendingUpdate) -> bool:
        started = time.time()
        try:
            return super()._upload(pending)
        finally:
            self.upload_spans.append((pending.round, started, time.time()))

    def fetch(self) -> None:
        """The global weights' rows of this rank, and only those (``ModelManifest.shard_rows``;
        their checksum, checked by the download, is the SHA-256 of the coordinator's rows)."""
        self.state.phase = pb.SITE_PHASE_FETCHING
        manifest, rows = self.client.fetch_model(self.rows.numel())
        if not manifest.shard_rows:
            raise SiteAgentError("the coordinator served the whole model to a rank that asked for its rows; "
                                 "run a coordinator of this version with sharded sites")
        self.rows.copy_(rows)
        self.state.adopt_weights(self.rows, manifest.round)
        self.trainer.load_(self.rows)

    def _apply_broadcast(
        self, round_number: int, header: pb.BroadcastHeader, data: bytes | memoryview | None
    ) -> bool:
        """Add this rank's rows of the broadcast delta (the same float sum as the coordinator's),
        then check them against the coordinator's digest of its rows; True when they had to be
        fetched instead."""
        self.last_broadcast = header
        if header.action != pb.BROADCAST_ACTION_APPLY_DELTA or data is None:
            self.fetch()
            return True
        started = time.monotonic()
        encoded = Encoded.from_bytes(data, copy=False)
        rows = self.rows
        block = slicing.slice_block(header.delta.codec) if header.shard_rows else None
        if block == 1:  # ``none`` or a cast: exactly the rank's rows, added piece by piece
            add_decoded_into(encoded.to(rows.device), rows)
        else:  # quantizer blocks around the rows, or (sparse downlink) the whole delta
            delta = decode(encoded, device=rows.device).reshape(-1)
            positions = (
                [offset for offset, _ in self.ranges] if block is None
                else slicing.row_positions(self.ranges, block, self.trainer.layout.numel)
            )
            at = 0
            for (_, n), position in zip(self.ranges, positions, strict=True):
                rows[at : at + n].add_(delta[position : position + n])
                at += n
            del delta
        del encoded
        applied = time.monotonic()
        self.state.adopt_weights(rows, round_number + 1)
        self._add_phases({"apply": applied - started, "verify": time.monotonic() - applied})
        expected = header.shard_weights_digest.digest if header.HasField("shard_weights_digest") else b""
        if expected:
            self.digests_checked += 1
            if self.state.digest != expected.hex():
                logger.warning("site %s rank %d: rows after round %d differ from the coordinator's; fetching them",
                               self.site, self.rank, round_number)
                self.resyncs += 1
                self.fetch()
                return True
        self._load_broadcast(round_number)
        return False


class ShardedSite:
    """One rank of a sharded (FSDP) site; every rank iterates ``rounds()`` or calls ``run()``
    (module doc)."""

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        data: Iterable[Any] | None = None,
        loss_fn: LossFn | None = None,
        *,
        coordinator: str,
        site: str,
        tls: TLSFiles | None = None,
        insecure: bool = False,
        config: SiteAgentConfig | None = None,
        group: dist.ProcessGroup | None = None,
        server_name: str | None = None,
        offload: bool = False,
        state_dir: str | os.PathLike[str] | None = None,
        instance_id: str | None = None,
        state_lock: FolderLock | None = None,
    ) -> None:
        """
        Args:
            model: the user's model, already wrapped with ``fully_shard`` over this site's
                1-D mesh (every parameter a DTensor sharded on dim 0), on CPU or a GPU.
            inner_optimizer: optimizer over ``model.parameters()`` (the DTensors); ``run()``
                steps it, a ``rounds()`` loop steps it itself.
            data: endless iterable of this rank's batches (``run()`` only).
            loss_fn: ``loss_fn(model, batch) -> scalar`` (``run()`` only).
            group: the site's process group (default: the world group torchrun made).
            offload: keep the global copy of this rank's rows and its error-feedback residual
                in CPU memory (pinned when the model is on CUDA) instead of beside the model,
                so the GPU holds only the training state; they are touched once per round.
            state_dir: save this rank's error-feedback residual at every round boundary in
                ``state_dir/rank-R-of-N`` and take it up again when the site restarts (module
                doc: saved state); the model, optimizer and data position are the user's to
                checkpoint (``torch.distributed.checkpoint``). The rank holds its folder's lock
                (``persist.lock_state_dir``) until ``rounds()`` ends.
            instance_id: rank 0's site-process id at the coordinator (``SiteAgent``'s
                ``instance_id``); the other ranks take rank 0's at the join.
            state_lock: this rank's folder lock when the caller took it already (``geoloco
                site`` takes rank 0's before its first join); None: the rank takes it here.
        """
        if not dist.is_initialized():
            raise SiteAgentError(
                "a sharded site runs under torchrun with an initialised process group "
                "(torch.distributed.init_process_group); start it with torchrun --nproc_per_node=N"
            )
        self.site, self.model, self.optimizer = site, model, inner_optimizer
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.config = config or SiteAgentConfig(device="cpu")
        self.layout = ParamLayout.from_model(model)  # DTensor shapes are the global ones
        shapes = [e.shape for e in self.layout.entries]
        self.ranges: list[ShardRange] = shard_ranges(shapes, self.rank, self.world_size, DIM0)
        views = self._local_views(shapes)
        self.shard_numel = sum(n for _, n in self.ranges)
        model_device = views[0][1].device if views else torch.device("cpu")
        self.device = torch.device("cpu") if offload else model_device
        """Where the global rows and the residual live (module doc: offload)."""
        nccl = dist.get_backend(group) == dist.Backend.NCCL
        self._collective_device = model_device if nccl else torch.device("cpu")
        """Where tensors of the site's own collectives live: NCCL reduces CUDA tensors only."""
        self.held = torch.zeros(self.shard_numel, dtype=torch.float32, device=self.device,
                                pin_memory=offload and model_device.type == "cuda")
        """The global weights of this rank's shard (``θ_t`` rows), never the whole vector."""
        self.trainer = ShardTrainer(
            model, inner_optimizer, data, loss_fn, layout=self.layout, views=views, numel=self.shard_numel,
            device=self.device,
        )
        self.state = SiteState()
        self._rounds: ShardedRounds | None = None
        self._stop = threading.Event()
        self.client = CoordinatorClient(
            coordinator, site=site, tls=tls, insecure=insecure, config=self.config,
            stop_event=self._stop, server_name=server_name, instance_id=instance_id,
        )
        self.client.shard = pb.ShardRef(index=self.rank, count=self.world_size, split=DIM0)
        self.store = None if state_dir is None else SiteStateStore(
            rank_state_dir(state_dir, self.rank, self.world_size)
        )
        self._state_lock = state_lock
        if self.store is not None and (state_lock is None or not state_lock.held):
            self._state_lock = lock_state_dir(self.store.directory, site)
        self._run_identity: dict[str, Any] = {}
        self._heartbeat_s = 1.0
        self._restored_round: int | None = None

    def _local_views(self, shapes: list[tuple[int, ...]]) -> list[tuple[int, torch.Tensor]]:
        """(position in the rank's shard, flat view of the local rows) per parameter with rows
        here, checked against the split the coordinator computes."""
        views: list[tuple[int, torch.Tensor]] = []
        ranges = iter(self.ranges)
        at = 0
        for (name, param), shape in zip(self.model.named_parameters(), shapes, strict=True):
            local = local_shard(param).detach()
            n = local.numel()
            if n == 0:
                continue
            _, expected = next(ranges, (0, -1))
            if expected != n:
                raise SiteAgentError(
                    f"parameter {name!r} {list(shape)}: this rank holds {n} elements but FSDP2's dim-0 "
                    f"split gives rank {self.rank} of {self.world_size} {max(expected, 0)}; wrap the model "
                    "with fully_shard over a 1-D mesh of the site's ranks (Shard(0) placements)"
                )
            if not local.is_contiguous():
                raise SiteAgentError(f"parameter {name!r}: this rank's rows are not contiguous; FSDP2 keeps them so")
            views.append((at, local.view(-1)))
            at += n
        return views

    @property
    def last_broadcast(self) -> pb.BroadcastHeader | None:
        """The header of the last broadcast applied (whether this site was included, how many
        sites were, the weights digest, the next round): what a loop logs after each round."""
        return None if self._rounds is None else self._rounds.last_broadcast

    @property
    def residual(self) -> torch.Tensor | None:
        """This rank's error-feedback residual (None before the join, or without error feedback)."""
        return None if self._rounds is None else self._rounds.uplink.residual(0)

    @property
    def summary(self) -> ShardedRunSummary:
        """What this rank did so far."""
        state, rounds = self.state, self._rounds
        return ShardedRunSummary(
            rounds_trained=state.rounds_trained, rounds_included=state.rounds_included,
            final_round=state.held_round if state.has_weights else 0, run_finished=state.finished,
            resyncs=0 if rounds is None else rounds.resyncs,
            digests_checked=0 if rounds is None else rounds.digests_checked,
            restored_round=self._restored_round, bytes_received=self.client.stats.received,
            upload_spans=[] if rounds is None else list(rounds.upload_spans),
        )

    # -- the run --

    def rounds(self, max_rounds: int | None = None) -> Generator[ShardedRound, None, None]:
        """The run as a loop the user writes: join, then one ``ShardedRound`` per round.

        When a round is yielded the model's local rows hold the round's global weights; the
        loop body runs ``round.inner_steps`` optimizer steps its own way (its optimizer, LR
        scheduler, autocast, gradient clipping) and adds what it trained on to
        ``round.samples``. Asking for the next round uploads this rank's shard, waits for the
        broadcast and applies it (``ShardedRounds``, the same synchronous round as a
        data-parallel site's). Every rank iterates alike (the collectives inside must match);
        leaving the loop early leaves the run (the client closes).
        """
        heartbeat: threading.Thread | None = None
        leaving = "run finished"
        try:
            rounds = self._rounds = self._join()
            if self.rank == 0:
                heartbeat = threading.Thread(target=self._heartbeats, name="geoloco-heartbeat", daemon=True)
                heartbeat.start()
            state = self.state
            while not state.finished and (max_rounds is None or state.rounds_trained < max_rounds):
                current = rounds.begin()
                if current is None:
                    break
                leaving = "the site's loop stopped"
                yield current
                rounds.finish(current)
                leaving = "run finished"
            else:
                if not state.finished:
                    leaving = f"max_rounds={max_rounds} trained"
        except GeneratorExit:  # the loop left early (break, or the generator was closed)
            raise
        except BaseException:
            leaving = ""  # a failure: the coordinator drops the site by its heartbeat timeout
            raise
        finally:
            self._stop.set()
            if heartbeat is not None:
                heartbeat.join(timeout=5.0)
            if leaving and self.rank == 0 and self.client.session_id:
                self.client.leave(leaving)  # the coordinator need not wait for a silent site
            self.client.close()
            if self._state_lock is not None:
                self._state_lock.release()

    def run(self, max_rounds: int | None = None) -> ShardedRunSummary:
        """``rounds()`` with the inner loop written for you: ``loss_fn(model, batch)``, backward
        and ``inner_optimizer.step()`` per batch of ``data`` (``ShardTrainer.train``); every rank
        calls it."""
        if not self.trainer.trains_itself:
            raise SiteAgentError("run() trains on data with loss_fn; pass both to ShardedSite, or write "
                                 "the inner loop yourself with rounds()")
        with contextlib.closing(self.rounds(max_rounds)) as rounds:
            for current in rounds:
                self.trainer.train(current)
        return self.summary

    def _join(self) -> ShardedRounds:
        """Rank 0 joins; every rank takes its session, run config and its rows of the weights.
        A round that closes between the join and the ranks' fetches leaves a rank holding rows
        of a round whose seed it does not know, or the ranks holding rows of different rounds:
        the site then joins again (as a data-parallel site does, ``RejoinRequired``)."""
        for attempt in range(1, JOIN_ATTEMPTS + 1):
            self._join_run()
            rounds = self._rounds
            if rounds is None:
                rounds = self._rounds = self._build_rounds()
                self._restore(rounds)
            rounds.fetch()
            if self._ranks_agree():
                return rounds
            logger.info("site %s rank %d: a round closed while the ranks fetched their rows (join %d of %d); "
                        "joining again", self.site, self.rank, attempt, JOIN_ATTEMPTS)
        raise SiteAgentError(
            f"site {self.site}: rounds closed during each of {JOIN_ATTEMPTS} joins before every rank held its rows "
            "of the round it joined; the coordinator's rounds are shorter than a join takes"
        )

    def _join_run(self) -> None:
        """Rank 0 joins (again); every rank takes the session, the run config and the round."""
        shared: list[Any] = [None]
        failure: BaseException | None = None
        if self.rank == 0:
            try:
                response = self.client.join(has_weights=False, weights_round=0, digest_hex=None)
                shared[0] = (response.session_id, response.config.SerializeToString(),
                             response.round.SerializeToString(), self.client.instance_id)
            except Exception as err:  # noqa: BLE001 - re-raised once the other ranks heard of it
                failure, shared[0] = err, f"{type(err).__name__}: {err}"
        dist.broadcast_object_list(shared, src=0, group=self.group)
        if failure is not None:
            raise failure
        if isinstance(shared[0], str):
            raise SiteAgentError(f"site {self.site}: rank 0 could not join the run ({shared[0]})")
        session_id, config_bytes, round_bytes, instance_id = shared[0]
        self.client.session_id = session_id
        self.client.instance_id = instance_id
        run_config = pb.RunConfig.FromString(config_bytes)
        state = self.state
        state.adopt_run_config(run_config)
        state.joined(pb.RoundInfo.FromString(round_bytes))
        if state.privacy.secure_aggregation:
            raise SiteAgentError(
                "sharded sites do not combine with secure aggregation; run the site data-parallel "
                "(SiteAgent with an IntraSiteGroup) or turn [privacy] secure_aggregation off"
            )
        self._heartbeat_s = max(0.05, run_config.heartbeat_interval_ms / 1000.0 or 1.0)
        self._run_identity = run_fingerprint(run_config.config_json)

    def _build_rounds(self) -> ShardedRounds:
        """The rank's round runner for the joined run's algorithm."""
        algorithm = self.state.algorithm
        strategy = build_strategy(algorithm, numel=self.layout.numel, layout=self.layout)
        if not strategy.partition.is_whole or strategy.partial is not None:
            raise SiteAgentError(
                "sharded sites do not combine with Streaming DiLoCo fragments or partial updates; "
                "run the site data-parallel or use fragments = 1 without partial_updates"
            )
        # The rank's rows encoded as a model of their own: one 1-D tensor, with its own residual.
        rows = ParamLayout(entries=(ParamEntry("rows", (self.shard_numel,), 0),), numel=self.shard_numel)
        return ShardedRounds(
            group=self.group, collective_device=self._collective_device, rows=self.held, ranges=self.ranges,
            rank=self.rank, world_size=self.world_size,
            site=self.site, state=self.state, trainer=self.trainer, client=lambda: self.client, hooks=SiteHooks(),
            strategy=strategy, uplink=StrategyUplink(build_strategy(algorithm, numel=self.shard_numel, layout=rows),
                                                     self.site),
            on_boundary=self._save,
        )

    def _ranks_agree(self) -> bool:
        """Every rank holds rows of the same round, one whose seed the join told."""
        state = self.state
        held = float(state.held_round)
        known = 1.0 if state.knows_round(state.held_round) else 0.0
        votes = torch.tensor([held, -held, -known], dtype=torch.float64, device=self._collective_device)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=self.group)
        highest, lowest, any_unknown = float(votes[0]), -float(votes[1]), float(votes[2])
        return highest == lowest and any_unknown < 0

    # -- saved state --

    def _state_meta(self) -> dict[str, Any]:
        """What a saved state must match to be taken up: the site, the rank's rows, the model, the run."""
        return {
            "site": self.site,
            "shard": [self.rank, self.world_size, DIM0],
            "layout": layout_fingerprint(self.layout),
            "run": self._run_identity,
        }

    def _save(self) -> None:
        """This rank's uplink state as of the round boundary just passed (atomically, on every
        rank; the runner's snapshot, which holds no pending update at a boundary)."""
        if self.store is None or self._rounds is None:
            return
        saved = self._rounds.snapshot()
        assert saved is not None  # a StrategyUplink's state
        tensors, meta = saved
        meta = {**meta, **self._state_meta(), "round": self.state.held_round}
        self.store.save(SiteSnapshot(tensors=tensors, meta=meta))

    def _restore(self, rounds: ShardedRounds) -> None:
        """Take up this rank's saved uplink state, or refuse a state of another site, shard,
        model or run."""
        snapshot = None if self.store is None else self.store.load()
        if snapshot is None:
            return
        assert self.store is not None
        saved = {key: snapshot.meta.get(key) for key in self._state_meta()}
        if saved != self._state_meta():
            differs = [key for key, value in self._state_meta().items() if saved[key] != value]
            raise SiteStateError(
                f"the state in {self.store.directory} was saved for another {' and '.join(differs)} "
                f"(site {saved['site']!r}, shard {saved['shard']}); point state_dir at this site's own "
                "folder, or delete it to start this rank afresh"
            )
        if "uplink" not in snapshot.meta:
            raise SiteStateError(
                f"the state in {self.store.directory} was saved by an earlier geoloco version; delete it to "
                "start this rank afresh"
            )
        rounds.restore(snapshot.tensors, snapshot.meta)
        self._restored_round = int(snapshot.meta.get("round", 0))
        logger.info("site %s rank %d: took up the residual saved after round %d", self.site, self.rank,
                    self._restored_round - 1)

    def _heartbeats(self) -> None:
        while not self._stop.wait(self._heartbeat_s):
            try:
                self.client.heartbeat(round_number=self.state.held_round, phase=self.state.phase,
                                      inner_steps_done=0)
            except grpc.RpcError as error:
                if error_reason(error) == pb.ERROR_REASON_SITE_REPLACED:
                    # Every rank's next request is refused alike and raises SiteReplaced.
                    logger.error("site %s: %s", self.site, error.details())
                    return
                logger.debug("site %s: heartbeat failed", self.site, exc_info=True)
            except Exception:  # a missed heartbeat is retried at the next tick
                logger.debug("site %s: heartbeat failed", self.site, exc_info=True)

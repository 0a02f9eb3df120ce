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

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
import torch.distributed as dist
from torch import nn

from geoloco.algorithms.diloco import UpdateEncoder, pseudo_gradient_into_local
from geoloco.algorithms.finite import all_finite
from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.shard_split import DIM0, ShardRange, shard_ranges
from geoloco.algorithms.strategy import AlgorithmConfig, build_strategy, uplink_seed
from geoloco.compression import Encoded, add_decoded_into, decode, parse_codec, slicing
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.folder_lock import FolderLock
from geoloco.protos.transport_errors import error_reason
from geoloco.protos.transport_tls import TLSFiles
from geoloco.protos.wire_buffers import as_byte_view
from geoloco.site_agent.client import CoordinatorClient, OpenBroadcast, RoundClosed, RunFinished, UpdateRejected
from geoloco.site_agent.config import SiteAgentConfig
from geoloco.site_agent.errors import SiteAgentError
from geoloco.site_agent.persist import (
    SiteSnapshot,
    SiteStateError,
    SiteStateStore,
    layout_fingerprint,
    lock_state_dir,
    run_fingerprint,
)
from geoloco.site_agent.runner import WITHHELD_NON_FINITE
from geoloco.site_agent.state import SiteState

__all__ = ["ShardedRound", "ShardedRunSummary", "ShardedSite", "local_shard", "rank_state_dir"]

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, Any], torch.Tensor]


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
    """What the loop wants the coordinator's metrics to show for the site (e.g. ``{"loss": x}``);
    averaged over the ranks key by key, reported with the upload."""


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
        self.site, self.model, self.optimizer, self.loss_fn = site, model, inner_optimizer, loss_fn
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.config = config or SiteAgentConfig(device="cpu")
        self._data: Iterator[Any] | None = None if data is None else iter(data)
        self.layout = ParamLayout.from_model(model)  # DTensor shapes are the global ones
        shapes = [e.shape for e in self.layout.entries]
        self.ranges: list[ShardRange] = shard_ranges(shapes, self.rank, self.world_size, DIM0)
        self._locals = self._local_views(shapes)
        self.shard_numel = sum(n for _, n in self.ranges)
        model_device = self._locals[0][1].device if self._locals else torch.device("cpu")
        self.device = torch.device("cpu") if offload else model_device
        """Where the global rows and the residual live (module doc: offload)."""
        nccl = dist.get_backend(group) == dist.Backend.NCCL
        self._collective_device = model_device if nccl else torch.device("cpu")
        """Where tensors of the site's own collectives live: NCCL reduces CUDA tensors only."""
        self.held = torch.zeros(self.shard_numel, dtype=torch.float32, device=self.device,
                                pin_memory=offload and model_device.type == "cuda")
        """The global weights of this rank's shard (``θ_t`` rows), never the whole vector."""
        self._stop = threading.Event()
        self.client = CoordinatorClient(
            coordinator, site=site, tls=tls, insecure=insecure, config=self.config,
            stop_event=self._stop, server_name=server_name, instance_id=instance_id,
        )
        self.client.shard = pb.ShardRef(index=self.rank, count=self.world_size, split=DIM0)
        self.encoder: UpdateEncoder | None = None
        self.last_broadcast: pb.BroadcastHeader | None = None
        """The header of the last broadcast applied (whether this site was included, how many
        sites were, the weights digest, the next round): what a loop logs after each round."""
        self.store = None if state_dir is None else SiteStateStore(
            rank_state_dir(state_dir, self.rank, self.world_size)
        )
        self._state_lock = state_lock
        if self.store is not None and (state_lock is None or not state_lock.held):
            self._state_lock = lock_state_dir(self.store.directory, site)
        self._run_identity: dict[str, Any] = {}
        self._heartbeat_s = 1.0
        self.summary = ShardedRunSummary()

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

    # -- the run --

    def rounds(self, max_rounds: int | None = None) -> Iterator[ShardedRound]:
        """The run as a loop the user writes: join, then one ``ShardedRound`` per round.

        When a round is yielded the model's local rows hold the round's global weights; the
        loop body runs ``round.inner_steps`` optimizer steps its own way (its optimizer, LR
        scheduler, autocast, gradient clipping) and adds what it trained on to
        ``round.samples``. Asking for the next round uploads this rank's shard, waits for the
        broadcast and applies it. Every rank iterates alike (the collectives inside must
        match); leaving the loop early leaves the run (the client closes).
        """
        heartbeat: threading.Thread | None = None
        leaving = "run finished"
        try:
            round_number, round_seed, algorithm, total_rounds = self._join()
            if self.rank == 0:
                heartbeat = threading.Thread(target=self._heartbeats, name="geoloco-heartbeat", daemon=True)
                heartbeat.start()
            unbounded = total_rounds == 0  # the coordinator's total_rounds = 0: until it stops
            while (unbounded or round_number < total_rounds) and (
                max_rounds is None or self.summary.rounds_trained < max_rounds
            ):
                self._load_held()
                current = ShardedRound(
                    number=round_number, inner_steps=int(algorithm.inner_steps), total_rounds=total_rounds
                )
                leaving = "the site's loop stopped"
                yield current
                header = self._sync(current, round_seed, algorithm)
                leaving = "run finished"
                if header is None or header.run_finished:
                    self.summary.run_finished = True
                    break
                round_number, round_seed = header.next_round.round, header.next_round.round_seed
            else:
                self.summary.run_finished = not unbounded and round_number >= total_rounds
                if not self.summary.run_finished:
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
            self.summary.bytes_received = self.client.stats.received
            self.client.close()
            if self._state_lock is not None:
                self._state_lock.release()

    def run(self, max_rounds: int | None = None) -> ShardedRunSummary:
        """``rounds()`` with the inner loop written for you: ``loss_fn(model, batch)``, backward
        and ``inner_optimizer.step()`` per batch of ``data``; every rank calls it."""
        if self._data is None or self.loss_fn is None:
            raise SiteAgentError("run() trains on data with loss_fn; pass both to ShardedSite, or write "
                                 "the inner loop yourself with rounds()")
        for current in self.rounds(max_rounds):
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
        return self.summary

    def _join(self) -> tuple[int, int, AlgorithmConfig, int]:
        """Rank 0 joins; every rank takes its session, run config and its rows of the weights."""
        shared: list[Any] = [None]
        failure: BaseException | None = None
        if self.rank == 0:
            try:
                response = self.client.join(has_weights=False, weights_round=0, digest_hex=None)
                shared[0] = (response.session_id, response.config.SerializeToString(), response.round.round,
                             response.round.round_seed, self.client.instance_id)
            except Exception as err:  # noqa: BLE001 - re-raised once the other ranks heard of it
                failure, shared[0] = err, f"{type(err).__name__}: {err}"
        dist.broadcast_object_list(shared, src=0, group=self.group)
        if failure is not None:
            raise failure
        if isinstance(shared[0], str):
            raise SiteAgentError(f"site {self.site}: rank 0 could not join the run ({shared[0]})")
        session_id, config_bytes, round_number, round_seed, instance_id = shared[0]
        self.client.session_id = session_id
        self.client.instance_id = instance_id
        run_config = pb.RunConfig.FromString(config_bytes)
        state = SiteState()
        state.adopt_run_config(run_config)
        algorithm, privacy = state.algorithm, state.privacy
        if privacy.secure_aggregation:
            raise SiteAgentError(
                "sharded sites do not combine with secure aggregation; run the site data-parallel "
                "(SiteAgent with an IntraSiteGroup) or turn [privacy] secure_aggregation off"
            )
        strategy = build_strategy(algorithm, numel=self.layout.numel, layout=self.layout)
        if not strategy.partition.is_whole or strategy.partial is not None:
            raise SiteAgentError(
                "sharded sites do not combine with Streaming DiLoCo fragments or partial updates; "
                "run the site data-parallel or use fragments = 1 without partial_updates"
            )
        self._heartbeat_s = max(0.05, run_config.heartbeat_interval_ms / 1000.0 or 1.0)
        self.encoder = self._new_encoder(algorithm)
        self._run_identity = run_fingerprint(run_config.config_json)
        self._restore()
        self._fetch()
        return int(round_number), int(round_seed), algorithm, int(run_config.total_rounds)

    def _new_encoder(self, algorithm: AlgorithmConfig) -> UpdateEncoder:
        """This rank's uplink encoder, with an empty residual of its shard's size."""
        return UpdateEncoder(
            parse_codec(algorithm.uplink_codec).with_shapes([(self.shard_numel,)]),
            error_feedback=algorithm.error_feedback, decay=algorithm.error_feedback_decay,
        )

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
        """This rank's residual as of the round boundary just passed (atomically, on every rank)."""
        if self.store is None or self.encoder is None:
            return
        residual = self.encoder.residual
        tensors = {} if residual is None else {"residual": residual.detach().cpu().contiguous()}
        self.store.save(SiteSnapshot(tensors=tensors, meta={**self._state_meta(), "round": self.summary.final_round}))

    def _restore(self) -> None:
        """Take up this rank's saved residual, or refuse a state of another site, shard, model or run."""
        snapshot = None if self.store is None else self.store.load()
        if snapshot is None or self.encoder is None:
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
        saved_residual = snapshot.tensors.get("residual")
        feedback = self.encoder.error_feedback
        if feedback is not None and saved_residual is not None:
            feedback.residual = saved_residual.to(device=self.device, dtype=torch.float32).reshape(self.shard_numel)
        self.summary.restored_round = int(snapshot.meta.get("round", 0))
        logger.info("site %s rank %d: took up the residual saved after round %d", self.site, self.rank,
                    self.summary.restored_round - 1)

    def _fetch(self) -> None:
        """The global weights' rows of this rank, and only those (``ModelManifest.shard_rows``;
        their checksum, checked by the download, is the SHA-256 of the coordinator's rows)."""
        manifest, rows = self.client.fetch_model(self.shard_numel)
        if not manifest.shard_rows:
            raise SiteAgentError("the coordinator served the whole model to a rank that asked for its rows; "
                                 "run a coordinator of this version with sharded sites")
        self.held.copy_(rows)

    def _heartbeats(self) -> None:
        while not self._stop.wait(self._heartbeat_s):
            try:
                self.client.heartbeat(round_number=self.summary.final_round, phase=pb.SITE_PHASE_TRAINING,
                                      inner_steps_done=0)
            except grpc.RpcError as error:
                if error_reason(error) == pb.ERROR_REASON_SITE_REPLACED:
                    # Every rank's next request is refused alike and raises SiteReplaced.
                    logger.error("site %s: %s", self.site, error.details())
                    return
                logger.debug("site %s: heartbeat failed", self.site, exc_info=True)
            except Exception:  # a missed heartbeat is retried at the next tick
                logger.debug("site %s: heartbeat failed", self.site, exc_info=True)

    def _load_held(self) -> None:
        with torch.no_grad():
            for at, view in self._locals:
                view.copy_(self.held[at : at + view.numel()].view_as(view))

    def _local_flat(self) -> torch.Tensor:
        """This rank's trained rows, concatenated like ``held`` on its device (a shard-sized copy)."""
        flat = torch.empty_like(self.held)
        for at, view in self._locals:
            flat[at : at + view.numel()].copy_(view.detach().reshape(-1))
        return flat

    def _site_metrics(self, own: dict[str, float]) -> dict[str, float]:
        """The ranks' metrics averaged key by key (a key some rank lacks is averaged over those
        that have it), so every shard reports the same site-level numbers."""
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, {str(k): float(v) for k, v in own.items()}, group=self.group)
        keys = sorted({key for ranks in everyone for key in ranks})
        return {key: sum(r[key] for r in everyone if key in r) / sum(key in r for r in everyone) for key in keys}

    def _sync(self, current: ShardedRound, round_seed: int, algorithm: AlgorithmConfig) -> pb.BroadcastHeader | None:
        """Upload this rank's shard of the round's pseudo-gradient, then apply the broadcast;
        None when the run finished meanwhile."""
        assert self.encoder is not None
        round_number, inner_steps = current.number, current.inner_steps
        self.optimizer.zero_grad(set_to_none=True)  # spent: a shard of gradients less through the sync
        update = pseudo_gradient_into_local(self.held, self._local_flat())
        own = float(current.samples) if current.samples > 0 else float(inner_steps)
        # The site's weight covers every rank's batches; the site uploads only when every
        # rank's shard is finite (a site missing a shard is never counted anyway).
        totals = torch.tensor([own, float(all_finite(update))], dtype=torch.float64, device=self._collective_device)
        dist.all_reduce(totals, group=self.group)
        sample_weight, finite_ranks = totals.tolist()
        metrics = self._site_metrics(current.metrics)
        self.summary.rounds_trained += 1
        if finite_ranks < self.world_size:
            # As every site runner does (``RoundRunner._encode``): not sent, the residual reset.
            logger.error(
                "site %s rank %d: the pseudo-gradient of round %d has NaN/Inf values on %d of %d ranks; "
                "not uploading it, resetting the error-feedback residual and the inner optimizer's "
                "state (lower the inner lr if it happens again)", self.site, self.rank, round_number,
                self.world_size - int(finite_ranks), self.world_size,
            )
            del update
            self.encoder = self._new_encoder(algorithm)
            self.optimizer.state.clear()  # AdamW's moments hold the NaN now; every later step would too
            return self._take_broadcast(round_number, None, None, withheld=WITHHELD_NON_FINITE)
        seed = uplink_seed(round_seed, self.site, algorithm.uplink_codec)
        encoded = self.encoder.encode(update, seed=seed)
        del update
        opened: OpenBroadcast | None = self.client.open_broadcast(round_number)
        started = time.time()
        on_time = True
        try:
            self.client.upload(
                round_number=round_number, data=encoded.to_bytes(), codec=encoded.spec,
                shape=list(encoded.shape), sample_weight=sample_weight, inner_steps=inner_steps,
                metrics=metrics,
            )
        except (RoundClosed, UpdateRejected) as why:
            logger.info("site %s rank %d: shard of round %d not counted (%s)", self.site, self.rank, round_number, why)
            on_time = False
        except RunFinished:
            assert opened is not None
            opened.cancel()
            return None
        self.summary.upload_spans.append((round_number, started, time.time()))
        if not on_time and opened is not None:
            opened.cancel()
            opened = None
        return self._take_broadcast(round_number, encoded, opened)

    def _take_broadcast(
        self, round_number: int, encoded: Encoded | None, opened: OpenBroadcast | None, *, withheld: str = ""
    ) -> pb.BroadcastHeader | None:
        """Wait for round ``round_number``'s broadcast and apply it; ``encoded`` (this rank's
        upload, None when nothing was sent) goes back into the residual when the round did not
        count it; ``withheld``: why the site sends nothing (the round stops waiting for it).
        None when the run finished meanwhile."""
        assert self.encoder is not None
        try:
            header, data = self.client.await_broadcast(round_number, opened=opened, withheld=withheld)
        except RunFinished:
            return None
        if header.included:
            self.summary.rounds_included += 1
        elif encoded is not None:
            self.encoder.restore(encoded)  # the update goes back into the residual
        self._apply(header, data)
        self.last_broadcast = header
        self.summary.final_round = round_number + 1
        self._save()
        return header

    def _apply(self, header: pb.BroadcastHeader, data: memoryview | bytes | None) -> None:
        """Add this rank's rows of the broadcast delta (the same float sum as the coordinator's),
        then check them against the coordinator's digest of its rows."""
        if header.action != pb.BROADCAST_ACTION_APPLY_DELTA or data is None:
            self._fetch()
            return
        encoded = Encoded.from_bytes(data, copy=False)
        block = slicing.slice_block(header.delta.codec) if header.shard_rows else None
        if block == 1:  # ``none`` or a cast: exactly the rank's rows, added piece by piece
            add_decoded_into(encoded.to(self.held.device), self.held)
        else:  # quantizer blocks around the rows, or (sparse downlink) the whole delta
            delta = decode(encoded, device=self.held.device).reshape(-1)
            positions = (
                [offset for offset, _ in self.ranges] if block is None
                else slicing.row_positions(self.ranges, block, self.layout.numel)
            )
            at = 0
            for (_, n), position in zip(self.ranges, positions, strict=True):
                self.held[at : at + n].add_(delta[position : position + n])
                at += n
            del delta
        del encoded
        expected = header.shard_weights_digest.digest if header.HasField("shard_weights_digest") else b""
        if not expected:
            return
        self.summary.digests_checked += 1
        if hashlib.sha256(as_byte_view(self.held.cpu())).digest() != expected:
            logger.warning("site %s rank %d: rows after round %d differ from the coordinator's; fetching them",
                           self.site, self.rank, header.round)
            self.summary.resyncs += 1
            self._fetch()

"""Intra-site data parallelism: one site as a multi-GPU ``torchrun`` job.

A site (one data center) may train on several GPUs. Its ranks form a ``torch.distributed``
process group and run the inner steps as ordinary data parallelism: gradients are averaged across
ranks every step (``DistributedDataParallel``), so every rank holds bit-identical weights and inner
optimizer state, and the site behaves like one faster replica with a larger batch. Only the
*leader* (rank 0) talks to the coordinator; the site's link to the coordinator is the slow, far
one, so there is one uploader per site, never one per GPU. After the leader has applied the
coordinator's broadcast it sends the new global weights to the other ranks over the fast local
fabric (:meth:`IntraSiteGroup.broadcast_flat_`), and tells them what to do next with a small
control object (:meth:`IntraSiteGroup.broadcast_object`), so non-leaders never need a coordinator
client.

Launch a site with ``torchrun --nproc_per_node=<gpus> ...``; :func:`init_from_env` reads the
variables torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``). Started without torchrun (or with one process) it returns a trivial group of
world size 1 that creates no process group and whose collectives are no-ops, so the agent runs
the same code path on one GPU, on a laptop CPU and on a multi-GPU node.

Public API (all on CPU with ``gloo`` or on CUDA with ``nccl``):

- :func:`init_from_env` -> :class:`IntraSiteGroup` with ``rank``, ``world_size``, ``local_rank``,
  ``is_leader``, ``device``, ``backend``.
- :meth:`IntraSiteGroup.wrap_model` (DDP when ``world_size > 1``) and :func:`unwrap_model`.
- :meth:`IntraSiteGroup.broadcast_flat_`, :meth:`IntraSiteGroup.broadcast_object`,
  :meth:`IntraSiteGroup.all_reduce_`, :meth:`IntraSiteGroup.barrier`.
- :func:`rank_data_seed` / :meth:`IntraSiteGroup.data_seed` and :func:`shard_range` /
  :meth:`IntraSiteGroup.shard`: every rank reads different data.
- :meth:`IntraSiteGroup.close` (also a context manager): destroys the process group it created.

A site agent's life, every rank running the same code::

    with init_from_env() as group:
        model = group.wrap_model(workload.build_model(seed))     # DDP: rank 0's init everywhere
        module, layout = unwrap_model(model), ParamLayout.from_model(unwrap_model(model))
        optimizer = torch.optim.AdamW(model.parameters())
        batches = workload.site_batches(site, num_sites, group.data_seed(site_seed))
        while True:
            flat = client.fetch_weights() if group.is_leader else torch.empty(layout.numel)
            layout.load_(module, group.broadcast_flat_(flat))    # theta_t, bit-identical
            control = group.broadcast_object(client.round_plan() if group.is_leader else None)
            if control["action"] == "stop":
                break
            for _ in range(control["inner_steps"]):               # grads averaged by DDP
                optimizer.zero_grad(); workload.loss(model, next(batches)).backward()
                optimizer.step()
            samples = group.all_reduce_(torch.tensor([float(local_samples)]), "sum")
            if group.is_leader:                                   # replicas are equal: one upload
                client.upload(flat - layout.flatten(module), weight=samples.item())

(``client`` stands for the leader's coordinator client.) Create the group once per process and
close it at exit. Every rank must call the collectives
(``broadcast_*``, ``all_reduce_``, ``barrier``) in the same order; a rank that skips one makes
the others wait until the group's timeout.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from types import TracebackType
from typing import Any, Final, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from geoloco.algorithms.params import derive_seed

__all__ = [
    "BACKENDS",
    "IntraSiteGroup",
    "ReduceOpName",
    "init_from_env",
    "rank_data_seed",
    "shard_range",
    "unwrap_model",
]

logger = logging.getLogger(__name__)

_created_process_group = False
"""Whether :func:`init_from_env` already created a process group in this process (see there)."""

ENV_RANK: Final = "RANK"
ENV_WORLD_SIZE: Final = "WORLD_SIZE"
ENV_LOCAL_RANK: Final = "LOCAL_RANK"
ENV_MASTER_ADDR: Final = "MASTER_ADDR"
ENV_MASTER_PORT: Final = "MASTER_PORT"

BACKEND_NCCL: Final = "nccl"
BACKEND_GLOO: Final = "gloo"
BACKENDS: Final = (BACKEND_NCCL, BACKEND_GLOO)
"""Process-group backends a site may use: ``nccl`` for CUDA tensors, ``gloo`` for CPU."""

LEADER_RANK: Final = 0
"""The rank that talks to the coordinator and is the source of every intra-site broadcast."""

RANK_SEED_PURPOSE: Final = "intra-site-rank"
"""Domain-separation tag hashed into per-rank data seeds."""

ReduceOpName = Literal["sum", "mean", "max", "min"]
"""Reductions :meth:`IntraSiteGroup.all_reduce_` accepts."""

_REDUCE_OPS: Final = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,  # gloo has no AVG: sum, then divide by the world size
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def rank_data_seed(site_seed: int, rank: int) -> int:
    """The data seed rank ``rank`` of a site uses, so that ranks read different samples.

    Rank 0 keeps ``site_seed`` itself: a one-GPU site then reads exactly the stream the
    simulator uses for that site, and adding GPUs adds streams without changing rank 0's. Other
    ranks hash ``(site_seed, rank)`` (see :func:`geoloco.algorithms.params.derive_seed`), which
    cannot collide the way ``site_seed + rank`` does with the next site's seed.
    """
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    if rank == 0:
        return site_seed
    return derive_seed(site_seed, RANK_SEED_PURPOSE, rank)


def shard_range(num_items: int, rank: int, world_size: int) -> range:
    """The contiguous indices ``[start, stop)`` of ``num_items`` that rank ``rank`` owns.

    For datasets addressed by index rather than by a seeded stream. Shards are disjoint, cover
    every item, and differ in size by at most one (the first ``num_items % world_size`` ranks get
    the extra item), so no rank idles on a much smaller share.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if num_items < 0:
        raise ValueError(f"num_items must be >= 0, got {num_items}")
    base, extra = divmod(num_items, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside a :meth:`IntraSiteGroup.wrap_model` result (itself if unwrapped).

    Flatten, load and checkpoint the unwrapped module: DDP prefixes parameter names with
    ``module.``, which would not match a :class:`~geoloco.algorithms.params.ParamLayout` built from
    the plain model class on the coordinator.
    """
    return model.module if isinstance(model, DistributedDataParallel) else model


class IntraSiteGroup:
    """The ranks of one site: who leads, which device each rank uses, and their collectives.

    Build it with :func:`init_from_env`. With ``world_size == 1`` there is no process group and
    every collective returns its input unchanged.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        device: torch.device,
        backend: str,
        owns_process_group: bool,
    ) -> None:
        self._rank = rank
        self._world_size = world_size
        self._local_rank = local_rank
        self._device = device
        self._backend = backend
        self._owns_process_group = owns_process_group
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"IntraSiteGroup(rank={self._rank}, world_size={self._world_size}, "
            f"local_rank={self._local_rank}, device={self._device}, backend={self._backend!r})"
        )

    @property
    def rank(self) -> int:
        """This process's rank within the site, ``0 <= rank < world_size``."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of processes (usually GPUs) training for this site."""
        return self._world_size

    @property
    def local_rank(self) -> int:
        """Rank on this node; selects the CUDA device."""
        return self._local_rank

    @property
    def is_leader(self) -> bool:
        """Whether this rank talks to the coordinator (rank 0)."""
        return self._rank == LEADER_RANK

    @property
    def device(self) -> torch.device:
        """Device this rank trains on (``cuda:LOCAL_RANK`` with nccl, otherwise as chosen)."""
        return self._device

    @property
    def backend(self) -> str:
        """Process-group backend (``nccl`` or ``gloo``), recorded even when world size is 1."""
        return self._backend

    @property
    def is_distributed(self) -> bool:
        """Whether collectives really communicate (world size > 1 and not closed)."""
        return self._world_size > 1 and not self._closed

    def data_seed(self, site_seed: int) -> int:
        """This rank's data seed; see :func:`rank_data_seed`."""
        return rank_data_seed(site_seed, self._rank)

    def shard(self, num_items: int) -> range:
        """This rank's share of ``num_items`` indexed items; see :func:`shard_range`."""
        return shard_range(num_items, self._rank, self._world_size)

    def wrap_model(self, model: nn.Module, **ddp_kwargs: Any) -> nn.Module:
        """Move ``model`` to this rank's device and, if the site has several ranks, wrap it in DDP.

        DDP averages gradients across ranks during ``backward()`` (bucketed and overlapped with
        the backward pass, which an explicit all-reduce after ``backward()`` cannot do), so one
        ``optimizer.step()`` per rank applies the same averaged gradient everywhere and the
        replicas stay bit-identical. Building the wrapper also copies rank 0's parameters and
        buffers to every rank, so replicas start equal even if each rank initialised its own.
        ``ddp_kwargs`` go to :class:`~torch.nn.parallel.DistributedDataParallel` (e.g.
        ``find_unused_parameters=True``). Create the optimizer over the *returned* module's
        parameters (they are the same tensors as the original module's) and use
        :func:`unwrap_model` to flatten or load weights.
        """
        self._check_open()
        model = model.to(self._device)
        if self._world_size == 1:
            return model
        device_ids = [self._device.index] if self._device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, **ddp_kwargs)

    def broadcast_flat_(
        self, flat: torch.Tensor, src: int = LEADER_RANK, *, verify: bool = True
    ) -> torch.Tensor:
        """Overwrite ``flat`` on every rank with rank ``src``'s values, in place; returns ``flat``.

        The leader calls it with the global weights it has just set from the coordinator's
        broadcast (or the initial weights); the other ranks pass a buffer of the same size and
        dtype (``torch.empty(layout.numel)``) and load it into their model afterwards. The copy is
        exact, so every rank's weights digest matches the coordinator's. With ``verify`` (the
        default) the ranks first agree on shape and dtype and all raise the same ``ValueError`` on
        a mismatch, instead of hanging or reading garbage; the check costs two tiny collectives.
        """
        self._check_open()
        self._check_src(src)
        if not self.is_distributed:
            return flat
        if verify:
            self._verify_same_buffer(flat, src)
        staged = self._staged(flat)
        dist.broadcast(staged, src=src)
        if staged is not flat:
            with torch.no_grad():
                flat.copy_(staged)
        return flat

    def broadcast_object(self, obj: Any, src: int = LEADER_RANK) -> Any:
        """Rank ``src``'s ``obj`` on every rank (picklable; for small control messages).

        Non-leaders pass anything (conventionally ``None``) and get the leader's object back,
        e.g. ``{"round": 7, "action": "continue"}``. Pickle runs code on load, which is
        acceptable only because every rank of a site is the same trusted job; never use this for
        data from outside the site.
        """
        self._check_open()
        self._check_src(src)
        if not self.is_distributed:
            return obj
        holder = [obj if self._rank == src else None]
        device = self._device if self._backend == BACKEND_NCCL else None
        dist.broadcast_object_list(holder, src=src, device=device)
        return holder[0]

    def all_reduce_(self, tensor: torch.Tensor, op: ReduceOpName = "sum") -> torch.Tensor:
        """Reduce ``tensor`` across ranks in place (``sum``, ``mean``, ``max``, ``min``).

        For what DDP does not cover: the site's sample count for the pseudo-gradient weight
        (``sum``), a site-wide training loss for metrics (``mean``), or gradients of a model that
        is not wrapped in DDP (``mean`` over a flat gradient vector).
        """
        self._check_open()
        if op not in _REDUCE_OPS:
            raise ValueError(f"unknown reduce op {op!r}; valid ops: {sorted(_REDUCE_OPS)}")
        if op == "mean" and not tensor.is_floating_point():
            raise ValueError(
                f"all_reduce_ op 'mean' needs a floating-point tensor, got {tensor.dtype}; "
                "use op='sum' and divide yourself"
            )
        if not self.is_distributed:
            return tensor
        staged = self._staged(tensor)
        dist.all_reduce(staged, op=_REDUCE_OPS[op])
        if op == "mean":
            staged.div_(self._world_size)
        if staged is not tensor:
            with torch.no_grad():
                tensor.copy_(staged)
        return tensor

    def barrier(self) -> None:
        """Wait until every rank of the site gets here."""
        self._check_open()
        if self.is_distributed:
            if self._backend == BACKEND_NCCL:
                dist.barrier(device_ids=[self._device.index])
            else:
                dist.barrier()

    def close(self) -> None:
        """Destroy the process group if this object created it; safe to call twice.

        A group adopted from the caller (one that was already initialised) is left alone: whoever
        created it destroys it.
        """
        if self._closed:
            return
        self._closed = True
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            logger.debug("rank %d: destroyed the intra-site process group", self._rank)

    def __enter__(self) -> IntraSiteGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is None and not self._closed and self._owns_process_group and dist.is_initialized():
            # Leave together: a rank that tears its gloo connections down while another still
            # finishes its run can die in gloo's teardown ("terminate called without an active
            # exception", SIGABRT; once in a CI run). After an error, no wait: the others may
            # be gone, and torchrun stops the job anyway.
            self.barrier()
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                "this IntraSiteGroup was closed; keep one group open for the whole process and "
                "close it only at exit"
            )

    def _check_src(self, src: int) -> None:
        if not 0 <= src < self._world_size:
            raise ValueError(f"src must be a rank in [0, {self._world_size}), got {src}")

    def _staged(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` itself if the backend can use it directly, else a contiguous device copy.

        nccl only moves CUDA tensors on this rank's device and every backend needs contiguous
        memory; a caller holding weights on the CPU or in a strided view still gets an in-place
        result through the copy back.
        """
        needs_device = self._backend == BACKEND_NCCL and tensor.device != self._device
        if not needs_device and tensor.is_contiguous():
            return tensor
        target = self._device if needs_device else tensor.device
        return tensor.detach().to(target, copy=True).contiguous()

    def _verify_same_buffer(self, flat: torch.Tensor, src: int) -> None:
        mine = (tuple(flat.shape), str(flat.dtype))
        theirs = self.broadcast_object(mine, src=src)
        mismatch = torch.tensor(
            [self._rank + 1 if mine != theirs else 0], dtype=torch.int64, device=self._comm_device()
        )
        dist.all_reduce(mismatch, op=dist.ReduceOp.MAX)
        bad_rank = int(mismatch.item()) - 1
        if bad_rank >= 0:
            raise ValueError(
                f"broadcast_flat_ buffers differ across ranks: rank {src} sends shape "
                f"{theirs[0]} {theirs[1]} but rank {bad_rank} passed a different shape or dtype "
                f"(rank {self._rank} has {mine[0]} {mine[1]}); allocate the buffer on every rank "
                "from the same ParamLayout, e.g. torch.empty(layout.numel, dtype=torch.float32)"
            )

    def _comm_device(self) -> torch.device:
        return self._device if self._backend == BACKEND_NCCL else torch.device("cpu")


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ValueError(
                f"environment variable {name} is not set; launch the site with torchrun, which "
                f"sets {ENV_RANK}, {ENV_WORLD_SIZE}, {ENV_LOCAL_RANK}, {ENV_MASTER_ADDR} and "
                f"{ENV_MASTER_PORT}"
            )
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def _resolve_device(device: str | torch.device | None, local_rank: int) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise ValueError(
            f"device {str(device)!r} is not supported for intra-site training; use 'cuda' "
            "(one GPU per rank, chosen by LOCAL_RANK) or 'cpu'"
        )
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {str(device)!r} requested but CUDA is not available on this machine; "
            "pass device='cpu' (and backend='gloo') or run on a machine with GPUs"
        )
    index = local_rank if resolved.index is None else resolved.index
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(
            f"rank needs CUDA device {index} (LOCAL_RANK={local_rank}) but only {count} are "
            f"visible; start torchrun with --nproc_per_node <= {count} or widen "
            "CUDA_VISIBLE_DEVICES"
        )
    return torch.device("cuda", index)


def _resolve_backend(backend: str | None, device: torch.device) -> str:
    if backend is None:
        return BACKEND_NCCL if device.type == "cuda" else BACKEND_GLOO
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {list(BACKENDS)}")
    if backend == BACKEND_NCCL:
        if device.type != "cuda":
            raise ValueError(
                f"backend 'nccl' needs CUDA tensors but this rank's device is {device}; "
                "use backend='gloo' for CPU training, or device='cuda' on a machine with GPUs"
            )
        if not dist.is_nccl_available():
            raise ValueError(
                "backend 'nccl' is not available in this PyTorch build; use backend='gloo' or "
                "install a CUDA build of PyTorch"
            )
    elif not dist.is_gloo_available():
        raise ValueError("backend 'gloo' is not available in this PyTorch build; use 'nccl'")
    return backend


def init_from_env(
    backend: str | None = None,
    *,
    device: str | torch.device | None = None,
    timeout: timedelta | None = None,
) -> IntraSiteGroup:
    """The site's rank group, from the environment torchrun sets up.

    ``device`` defaults to ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU;
    ``backend`` defaults to ``nccl`` on CUDA and ``gloo`` on the CPU. Without ``WORLD_SIZE`` in
    the environment (not launched by torchrun), or with a world size of 1, no process group is
    created and the group's collectives are no-ops. If the caller already initialised the default
    process group, it is adopted (and not destroyed by :meth:`IntraSiteGroup.close`).
    ``timeout`` bounds how long a collective waits for a missing rank (PyTorch's default if None).

    Call it once per process: after :meth:`IntraSiteGroup.close` a second process group cannot
    be created (under torchrun the new rendezvous reads the old one's addresses from the shared
    store and times out), so a second call raises ``RuntimeError`` at once instead.
    """
    global _created_process_group
    launched = ENV_WORLD_SIZE in os.environ
    world_size = _env_int(ENV_WORLD_SIZE) if launched else 1
    if world_size < 1:
        raise ValueError(f"environment variable {ENV_WORLD_SIZE} must be >= 1, got {world_size}")
    rank = _env_int(ENV_RANK) if launched else 0
    if not 0 <= rank < world_size:
        raise ValueError(
            f"environment variable {ENV_RANK}={rank} must be in [0, {ENV_WORLD_SIZE}={world_size})"
        )
    local_rank = _env_int(ENV_LOCAL_RANK, default=0 if world_size == 1 else None)
    if local_rank < 0:
        raise ValueError(f"environment variable {ENV_LOCAL_RANK} must be >= 0, got {local_rank}")

    resolved_device = _resolve_device(device, local_rank)
    resolved_backend = _resolve_backend(backend, resolved_device)
    if resolved_device.type == "cuda":
        # Collectives and DDP use the *current* CUDA device; without this every rank of a node
        # would put its buffers on cuda:0.
        torch.cuda.set_device(resolved_device)

    owns = False
    if world_size > 1:
        if not dist.is_available():
            raise ValueError(
                "this PyTorch build has no torch.distributed; install a build with it or run "
                "the site with a single process"
            )
        if dist.is_initialized():
            if dist.get_world_size() != world_size or dist.get_rank() != rank:
                raise ValueError(
                    f"an existing process group has rank {dist.get_rank()} of "
                    f"{dist.get_world_size()} but the environment says {rank} of {world_size}; "
                    "destroy it first or launch with matching torchrun settings"
                )
            existing = str(dist.get_backend())
            if backend is not None and existing != resolved_backend:
                raise ValueError(
                    f"backend {backend!r} requested but the existing process group uses "
                    f"{existing!r}; pass backend=None to adopt it or destroy it first"
                )
            resolved_backend = existing
        else:
            if _created_process_group:
                raise RuntimeError(
                    "init_from_env() already created (and closed) a process group in this "
                    "process; a second rendezvous on torchrun's store hangs and then fails, so "
                    "create the group once per process and keep it open until exit"
                )
            for name in (ENV_MASTER_ADDR, ENV_MASTER_PORT):
                if not os.environ.get(name):
                    raise ValueError(
                        f"environment variable {name} is not set but {ENV_WORLD_SIZE}="
                        f"{world_size}; launch the site with torchrun (it sets {ENV_MASTER_ADDR} "
                        f"and {ENV_MASTER_PORT}) or set both to the rank-0 host and a free port"
                    )
            dist.init_process_group(
                backend=resolved_backend,
                init_method="env://",
                rank=rank,
                world_size=world_size,
                timeout=timeout,
                device_id=resolved_device if resolved_device.type == "cuda" else None,
            )
            owns = True
            _created_process_group = True

    group = IntraSiteGroup(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=resolved_device,
        backend=resolved_backend,
        owns_process_group=owns,
    )
    logger.info("intra-site group ready: %r", group)
    return group

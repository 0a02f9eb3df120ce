"""``geoloco site --sharding fsdp``: a site whose ranks shard the model instead of copying it.

Under ``torchrun --nproc_per_node=N`` (N >= 2) the workload's model is wrapped with FSDP2
(``fully_shard`` per transformer block, or per ``Linear`` layer for a model without blocks, then
the whole model) over a 1-D device mesh of the site's ranks (gloo on CPU, NCCL on CUDA), and
``geoloco.site_agent.sharded.ShardedSite`` runs it: every rank uploads its own shard of the
pseudo-gradient and applies its rows of the broadcast. The model is built on the meta device and
only its rows get storage, so no rank ever holds the whole model (the coordinator's weights fill
the rows at join). The inner loop is the data-parallel site's (``run_inner_steps``: the coordinator's
``[inner_optimizer]`` with its lr schedule and gradient clipping, the same per-rank data seeds),
and rank 0 prints the same stdout lines (``site_cmd``'s module doc).

``--state-dir`` saves each rank's error-feedback residual at round boundaries and takes it up
after a restart (``ShardedSite(state_dir=...)``); the inner optimizer and the data position start
afresh, unlike a data-parallel site's saved state.

What a sharded site does not do yet is refused at start with exit status 2, before anything
joins: ``--metrics-port`` (no /metrics), a single process
(nothing to shard over: use ``--sharding none``), and a run with secure aggregation, Streaming
DiLoCo fragments or partial updates (the coordinator's config says so at the probe).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from geoloco.scenarios.config_file import COMMAND_LINE, EXIT_OK, EXIT_RUNTIME_ERROR, ConfigFileError
from geoloco.scenarios.site_lines import ADVERTISED, PROGRAM, join_line, round_line, summary_line

logger = logging.getLogger(__name__)

SHARDINGS = ("none", "fsdp")
"""Values of ``--sharding``: data-parallel (every rank a whole copy, DDP) or FSDP2 shards."""


@dataclass(slots=True)
class _RoundOutcome:
    """A sharded round as ``round_line`` prints it (the fields of ``RoundResult`` it names)."""

    round: int
    train_loss: float
    included: bool
    num_contributors: int
    next_round: int
    weights_digest: str


@dataclass(slots=True)
class _Outcome:
    """The site's end as ``summary_line`` prints it."""

    run_finished: bool
    final_round: int
    rounds_trained: int
    rounds_included: int
    weights_digest: str


def add_sharding_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sharding",
        choices=SHARDINGS,
        default="none",
        help="how the ranks of a torchrun site split the work: 'none' (default) = data-parallel, "
        "every rank holds the whole model and rank 0 alone uploads; 'fsdp' = the model is sharded "
        "with FSDP2 over the ranks and every rank uploads its own shard (needs torchrun with "
        "--nproc_per_node >= 2)",
    )
    parser.add_argument(
        "--offload",
        action="store_true",
        help="with --sharding fsdp: keep each rank's copy of the global weights and its "
        "error-feedback residual in CPU memory, so the GPU holds only the training state",
    )


def check_sharding_flags(args: argparse.Namespace) -> None:
    """Refuse, before anything starts, flags that do not combine with the chosen sharding."""
    if args.sharding != "fsdp":
        if args.offload:
            raise ConfigFileError(
                COMMAND_LINE, "--offload",
                "only applies with --sharding fsdp (a data-parallel rank keeps the whole model on its "
                "device); add --sharding fsdp or drop --offload",
            )
        return
    if args.metrics_port is not None:
        raise ConfigFileError(
            COMMAND_LINE, "--metrics-port",
            "sharded sites serve no /metrics yet; drop --metrics-port (the coordinator's metrics "
            "cover the site), or use --sharding none",
        )
    world_size = os.environ.get("WORLD_SIZE", "1")
    if world_size.isdecimal() and int(world_size) < 2:  # a malformed value: init_from_env names it
        raise ConfigFileError(
            COMMAND_LINE, "--sharding",
            f"fsdp shards the model over the site's ranks, but this process is alone (world size "
            f"{world_size}); start it with torchrun --nproc_per_node=N (N >= 2), or use "
            "--sharding none: one process holds the whole model anyway",
        )


def check_sharded_run(advertised: dict[str, Any]) -> None:
    """Refuse a run whose settings sharded sites do not combine with (README table)."""
    algorithm = dict(advertised.get("algorithm") or {})
    streaming = dict(algorithm.get("streaming") or {})
    refused = {
        "privacy.secure_aggregation": (
            bool(dict(advertised.get("privacy") or {}).get("secure_aggregation")),
            "secure aggregation (a masked update is one ring sum per site)",
        ),
        "algorithm.streaming.fragments": (
            bool(streaming.get("enabled")) and int(streaming.get("fragments", 1)) > 1,
            "Streaming DiLoCo fragments",
        ),
        "algorithm.partial_updates.enabled": (
            bool(dict(algorithm.get("partial_updates") or {}).get("enabled")), "partial updates",
        ),
    }
    for key, (on, what) in refused.items():
        if on:
            raise ConfigFileError(
                ADVERTISED, key,
                f"the run uses {what}, which sharded sites do not combine with; run this site "
                "with --sharding none (data-parallel)",
            )


def shard_model(build: Callable[[], Any], device: Any, world_size: int) -> Any:
    """The model ``build()`` makes, wrapped with FSDP2 over a 1-D mesh of the site's ranks: one
    all-gather unit per transformer block (every child of a ``ModuleList``), else per ``Linear``
    layer, then the root for what is left (embeddings, tied heads, norms). Innermost first, as
    FSDP2 wants. Built on the meta device and given storage for this rank's rows only: no rank
    holds the whole model, and the coordinator's weights fill the rows at join (the built-in
    workloads keep no buffers besides parameters)."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = build()
    mesh = init_device_mesh(device.type, (world_size,))
    blocks = [child for module in model.modules() if isinstance(module, nn.ModuleList) for child in module]
    for unit in reversed(blocks or [m for m in model.modules() if isinstance(m, nn.Linear)]):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model.to_empty(device=device)


def run_sharded(
    args: argparse.Namespace,
    *,
    advertised: dict[str, Any],
    group: Any,
    tls: Any,
    agent_config: Any,
    stop: Any,
    probe_client: Any,
    setup: Callable[[], tuple[Any, Any, Any]],
    lr_schedule_for: Callable[[Any, Any], Any],
    state_lock: Any = None,
) -> int:
    """Build the sharded site and train it; every rank calls it. ``advertised`` is the
    coordinator's config, ``setup()`` gives the plan, the inner optimizer's config and the
    workload, ``lr_schedule_for(inner, optimizer)`` the coordinator's lr schedule, and
    ``probe_client`` (rank 0) the probe's still open client: a site that cannot start leaves
    through it; ``state_lock`` (rank 0) its ``--state-dir`` folder's lock, taken before the probe
    joined (the site owns it from then on)."""
    from geoloco.site_agent.errors import SiteAgentError
    from geoloco.site_agent.sharded import ShardedSite

    try:
        try:
            check_sharded_run(advertised)
            plan, inner, workload = setup()
            model = shard_model(lambda: workload.build_model(plan.seed), group.device, group.world_size)
            optimizer = inner.build(model.parameters())
            lr_schedule = lr_schedule_for(inner, optimizer)
            site = ShardedSite(
                model, optimizer, coordinator=args.coordinator, site=args.name, tls=tls,
                insecure=args.insecure, config=agent_config,
                server_name=args.server_name, offload=args.offload, state_dir=args.state_dir,
                instance_id=None if probe_client is None else probe_client.instance_id,
                state_lock=state_lock,
            )
        except (ConfigFileError, SiteAgentError) as err:
            if probe_client is not None:
                probe_client.leave(f"site could not start: {err}")
            if isinstance(err, ConfigFileError):
                raise
            print(f"geoloco site: error: {err}", file=sys.stderr)
            return EXIT_RUNTIME_ERROR
    finally:
        if probe_client is not None:
            probe_client.close()
    logger.info(
        "site %s: sharded (FSDP2) rank %d of %d, workload %s, data shard %d of %d, %d of %d parameters here",
        args.name, group.rank, group.world_size, plan.workload.name, plan.site_index, plan.num_sites,
        site.shard_numel, site.layout.numel,
    )
    loss_fn = workload.loss
    if args.bf16:
        loss_fn = _autocast_bf16(loss_fn, group.device.type)
    if args.speed_factor != 1.0:
        from geoloco.scenarios.throttle import ComputeThrottle

        throttle = ComputeThrottle(args.speed_factor)
        throttle.attach(optimizer)
        loss_fn = throttle.wrap_loss(loss_fn)
    data = workload.site_batches(plan.site_index, plan.num_sites, group.data_seed(plan.seed))
    stopping = threading.Event()
    stop.on_stop = stopping.set
    if stop.requested.is_set():
        stopping.set()
    try:
        outcome = _train(args, site, group, data, loss_fn, inner.grad_clip_norm, lr_schedule, stopping)
    except SiteAgentError as err:
        print(f"geoloco site: error: {err}", file=sys.stderr)
        return EXIT_RUNTIME_ERROR
    if group.is_leader:
        print(summary_line(args.name, outcome, stop.signal_name), flush=True)
    return EXIT_OK


def _autocast_bf16(loss_fn: Callable[[Any, Any], Any], device_type: str) -> Callable[[Any, Any], Any]:
    """``loss_fn`` with its forward pass under bf16 autocast (``--bf16``), as the data-parallel
    site's trainer runs it."""
    import torch

    def loss(model: Any, batch: Any) -> Any:
        with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
            return loss_fn(model, batch)

    return loss


def _train(
    args: argparse.Namespace, site: Any, group: Any, data: Any, loss_fn: Callable[[Any, Any], Any],
    grad_clip_norm: float | None, lr_schedule: Any, stopping: threading.Event,
) -> _Outcome:
    """The ``rounds()`` loop with the data-parallel site's inner steps, printing the stdout
    contract from rank 0. A stop request ends the loop at a round boundary agreed by every rank
    (a rank leaving alone would leave the others waiting in a collective)."""
    import torch

    from geoloco.algorithms.diloco import run_inner_steps

    pending: tuple[int, float] | None = None
    lr_round: int | None = None
    digest = ""
    rounds = site.rounds(args.max_rounds)
    try:
        for current in rounds:
            if pending is not None:
                digest = _report(args.name, group, pending, site.last_broadcast, current.number) or digest
                pending = None
            elif group.is_leader:
                print(join_line(args.name, _Joined(site.client.session_id, current.number)), flush=True)
            flag = torch.tensor([1.0 if stopping.is_set() else 0.0], dtype=torch.float64)
            if float(group.all_reduce_(flag, "max")[0]) > 0:
                break  # closing the rounds leaves the run (rank 0)
            if group.is_leader:
                print(f"{PROGRAM} {args.name} round {current.number} training", flush=True)
            if lr_schedule is not None and lr_round != current.number:
                lr_schedule.seek(current.number * current.inner_steps)
            result = run_inner_steps(
                site.model, site.optimizer, data, current.inner_steps, loss_fn,
                grad_clip_norm=grad_clip_norm, lr_schedule=lr_schedule,
            )
            lr_round = current.number + 1
            current.samples += result.samples
            stats = torch.tensor([sum(result.losses), float(len(result.losses))], dtype=torch.float64)
            group.all_reduce_(stats, "sum")
            pending = (current.number, float(stats[0] / stats[1]) if stats[1] > 0 else float("nan"))
            current.metrics["loss"] = pending[1]  # the site's train_loss in the record (sent when finite)
    finally:
        rounds.close()
    summary = site.summary
    if pending is not None:
        digest = _report(args.name, group, pending, site.last_broadcast, summary.final_round) or digest
    return _Outcome(
        run_finished=summary.run_finished, final_round=summary.final_round,
        rounds_trained=summary.rounds_trained, rounds_included=summary.rounds_included, weights_digest=digest,
    )


@dataclass(slots=True)
class _Joined:
    session_id: str
    round: int


def _report(site: str, group: Any, pending: tuple[int, float], header: Any, next_round: int) -> str:
    """Print the round line of ``pending`` (round, loss) once its broadcast came (``header``,
    the site's last applied one); the new weights' digest ("" when the broadcast never came:
    the run finished meanwhile)."""
    number, loss = pending
    if header is None or header.round != number:
        return ""
    digest = header.weights_digest.digest.hex()
    if group.is_leader:
        outcome = _RoundOutcome(
            round=number, train_loss=loss, included=header.included, num_contributors=header.num_contributors,
            next_round=next_round, weights_digest=digest,
        )
        print(round_line(site, outcome), flush=True)
    return digest

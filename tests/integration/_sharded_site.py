"""One rank of a 2-process site (torchrun, gloo, CPU): sharded with FSDP2 or data-parallel.

Started by ``test_sharded_site.py``. Both modes build the same model, read the same per-rank
batches and step plain SGD, so a sharded site and a data-parallel site end their runs on the
same weights up to the float order of the gradient reduction. Each rank saves what the test
checks to ``OUT_DIR/<mode>-rank<r>.pt``.

Usage: ``torchrun --standalone --nproc_per_node=2 _sharded_site.py MODE SITE COORDINATOR CERTS OUT_DIR``
(MODE ``fsdp`` or ``dp``; with ``KILL_AT_ROUND=k`` the fsdp rank 1 SIGKILLs itself during its
upload of round k; with ``NAN_AT_ROUND=k`` the fsdp rank 1's first loss of round k is NaN).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from geoloco.algorithms.params import ParamLayout
from geoloco.protos.transport_tls import TLSFiles
from geoloco.scenarios.workloads.mlp import MLPWorkload, MLPWorkloadConfig
from geoloco.site_agent.agent import SiteAgent
from geoloco.site_agent.config import SiteAgentConfig
from geoloco.site_agent.distributed import init_from_env, rank_data_seed

SEED = 0
LR = 0.05
INNER_STEPS = 3
"""The coordinator's H in ``test_sharded_site.py``."""
CHUNK_SIZE = 512
"""Small chunks: an upload is a stream of many messages, as a big model's is."""
WORKLOAD = MLPWorkloadConfig(input_dim=16, hidden_dim=256, num_classes=5)
"""5 classes: the last layer's 5 rows split 3 + 2, FSDP2's uneven case; 256 wide: ~72k parameters, so a
rank's shard is ~140 KB, ~280 chunks, and the two uploads last long enough to overlap."""


def site_config() -> SiteAgentConfig:
    return SiteAgentConfig(device="cpu", backoff_initial_s=0.05, chunk_size=CHUNK_SIZE)


def run_fsdp(site: str, coordinator: str, certs: Path) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from geoloco.site_agent.sharded import ShardedSite

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    workload = MLPWorkload(WORKLOAD)
    model = workload.build_model(SEED)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    kill_at = int(os.environ.get("KILL_AT_ROUND", "-1"))
    nan_at = int(os.environ.get("NAN_AT_ROUND", "-1"))
    losses = 0

    def loss(module: nn.Module, batch: Any) -> torch.Tensor:
        nonlocal losses
        value = workload.loss(module, batch)
        if rank == 1 and losses == nan_at * INNER_STEPS:
            value = value * float("nan")  # NaN gradients, reduce-scattered into both ranks' rows
        losses += 1
        return value

    sharded = ShardedSite(
        model, optimizer, workload.site_batches(0, 1, rank_data_seed(SEED, rank)), loss,
        coordinator=coordinator, site=site, tls=TLSFiles.from_dir(certs, site), config=site_config(),
    )
    if kill_at >= 0 and rank == 1:
        _kill_during_upload(kill_at)
    summary = sharded.run()
    result = {
        "held": sharded.held.clone(), "ranges": sharded.ranges, "summary": dataclasses.asdict(summary),
        "residual": sharded.residual,
    }
    dist.destroy_process_group()
    return result


def _kill_during_upload(kill_at: int) -> None:
    """Rank 1 sends the first half of its shard's chunks of round ``kill_at`` (the coordinator
    holds a partial shard), then dies by SIGKILL."""
    from geoloco.site_agent import client as client_module

    real = client_module.upload_in_streams

    def half_then_die(stub: Any, channels: Any, manifest: Any, data: Any, ranges: Any, **kwargs: Any) -> Any:
        if manifest.round == kill_at:
            num_chunks = manifest.blob.num_chunks
            real(stub, channels, manifest, data, [(0, max(1, num_chunks // 2))], **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(stub, channels, manifest, data, ranges, **kwargs)

    client_module.upload_in_streams = half_then_die


def run_dp(site: str, coordinator: str, certs: Path) -> dict[str, Any]:
    group = init_from_env(backend="gloo", device="cpu", timeout=timedelta(seconds=120))
    with group:
        workload = MLPWorkload(WORKLOAD)
        model = workload.build_model(SEED)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        agent = SiteAgent(
            model, optimizer, workload.site_batches(0, 1, group.data_seed(SEED)), workload.loss,
            coordinator=coordinator, site=site, tls=TLSFiles.from_dir(certs, site),
            config=site_config(), group=group,
        )
        summary = agent.run()
        return {"weights": ParamLayout.from_model(model).flatten(model), "summary": dataclasses.asdict(summary),
                "rank": group.rank}


def main(mode: str, site: str, coordinator: str, certs: Path, out_dir: Path) -> None:
    result = run_fsdp(site, coordinator, certs) if mode == "fsdp" else run_dp(site, coordinator, certs)
    rank = int(os.environ["RANK"])
    torch.save(result, out_dir / f"{mode}-rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5]))

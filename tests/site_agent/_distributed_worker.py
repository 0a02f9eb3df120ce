"""One rank of a real 2-process site, started by torchrun from ``test_distributed.py``.

Runs what the site agent does, on CPU with gloo: DDP inner steps on per-rank data, the leader
"applies the coordinator's broadcast" and sends the new weights and a control message to the
other ranks, then one more inner step. Everything the test checks is saved to
``OUT_DIR/rank<r>.pt``; the assertions live in the test (the parent process), which also computes
the single-process reference.

Usage: ``torchrun --standalone --nproc_per_node=2 _distributed_worker.py {train,adopt} OUT_DIR``
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from geoloco.algorithms.params import ParamLayout, flatten_params
from geoloco.scenarios.workloads import MLPWorkload
from geoloco.site_agent.distributed import init_from_env, unwrap_model

SITE_SEED = 11
INNER_STEPS = 3
LEARNING_RATE = 0.5
COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def train(out_dir: Path) -> None:
    """The site agent's life in miniature: inner steps, leader broadcast, resume, close."""
    group = init_from_env(backend="gloo", device="cpu", timeout=COLLECTIVE_TIMEOUT)
    with group:
        workload = MLPWorkload()
        # Each rank initialises differently on purpose: wrap_model must make rank 0's copy win.
        model = workload.build_model(seed=100 + group.rank)
        own_init = flatten_params(model)
        ddp_model = group.wrap_model(model)
        module = unwrap_model(ddp_model)
        layout = ParamLayout.from_model(module)
        synced_init = layout.flatten(module)

        optimizer = torch.optim.SGD(ddp_model.parameters(), lr=LEARNING_RATE)
        stream = workload.site_batches(site=0, num_sites=1, seed=group.data_seed(SITE_SEED))
        batches, after_step = [], []
        for _ in range(INNER_STEPS):
            batch = next(stream)
            optimizer.zero_grad(set_to_none=True)
            workload.loss(ddp_model, batch).backward()
            optimizer.step()
            batches.append(batch)
            after_step.append(layout.flatten(module))

        samples = torch.tensor([float(INNER_STEPS * len(batches[0][0]))])
        group.all_reduce_(samples, "sum")
        mean_rank = torch.tensor([float(group.rank)])
        group.all_reduce_(mean_rank, "mean")
        max_rank = torch.tensor([group.rank], dtype=torch.int64)
        group.all_reduce_(max_rank, "max")

        # The leader stands in for "apply the coordinator's downlink delta"; the others hold
        # garbage (NaN) that the broadcast must overwrite completely.
        if group.is_leader:
            flat = layout.flatten(module) * 0.5 + 0.25
            control = {"round": 1, "action": "continue"}
        else:
            flat = torch.full((layout.numel,), float("nan"))
            control = None
        sent = flat.clone()
        group.broadcast_flat_(flat)
        layout.load_(module, flat)
        control = group.broadcast_object(control)
        after_broadcast = layout.flatten(module)

        # A strided (non-contiguous) destination exercises the staged copy-back path.
        strided = torch.zeros(layout.numel, 2)
        if group.is_leader:
            strided[:, 0] = sent
        group.broadcast_flat_(strided[:, 0])
        strided_received = strided[:, 0].clone()

        # Training continues from the broadcast weights, still in lockstep.
        batch = next(stream)
        optimizer.zero_grad(set_to_none=True)
        workload.loss(ddp_model, batch).backward()
        optimizer.step()
        batches.append(batch)
        after_resume = layout.flatten(module)

        # A wrongly sized buffer on one rank must fail on *every* rank with a clear error.
        wrong = torch.empty(layout.numel + (0 if group.is_leader else 1))
        try:
            group.broadcast_flat_(wrong)
            mismatch_error = ""
        except ValueError as error:
            mismatch_error = str(error)
        group.barrier()

    closed_after_with = not dist.is_initialized()
    try:
        init_from_env(backend="gloo", device="cpu", timeout=COLLECTIVE_TIMEOUT)
        second_init_error = ""
    except RuntimeError as error:
        second_init_error = str(error)

    torch.save(
        {
            "rank": group.rank,
            "inner_steps": INNER_STEPS,
            "learning_rate": LEARNING_RATE,
            "world_size": group.world_size,
            "is_leader": group.is_leader,
            "data_seed": group.data_seed(SITE_SEED),
            "wrapped_type": type(ddp_model).__name__,
            "own_init": own_init,
            "synced_init": synced_init,
            "batches": batches,
            "after_step": after_step,
            "samples": samples,
            "mean_rank": mean_rank,
            "max_rank": max_rank,
            "sent": sent,
            "after_broadcast": after_broadcast,
            "control": control,
            "strided_received": strided_received,
            "after_resume": after_resume,
            "mismatch_error": mismatch_error,
            "closed_after_with": closed_after_with,
            "second_init_error": second_init_error,
        },
        out_dir / f"rank{group.rank}.pt",
    )


def adopt(out_dir: Path) -> None:
    """A process group the caller created is adopted, used, and left for the caller to destroy."""
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    group = init_from_env(device="cpu")
    control = group.broadcast_object("stop" if group.is_leader else None)
    group.close()
    left_open = dist.is_initialized()
    dist.destroy_process_group()
    torch.save(
        {"backend": group.backend, "control": control, "left_open": left_open},
        out_dir / f"rank{group.rank}.pt",
    )


MODES = {"train": train, "adopt": adopt}

if __name__ == "__main__":
    MODES[sys.argv[1]](Path(sys.argv[2]))

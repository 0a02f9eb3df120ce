"""One rank of a 2-process site (torchrun, gloo, CPU) training through ``SiteAgent``.

Started by ``test_multi_rank_site.py``. Every rank builds the model and optimizer and calls
``run()``; only rank 0 talks to the coordinator. Each rank saves its final weights and summary to
``OUT_DIR/rank<r>.pt`` for the test to check, with the inner lr of each of its steps (a cosine
schedule over ``ROUNDS × INNER_STEPS`` steps, which every rank must step alike).

Usage: ``torchrun --standalone --nproc_per_node=2 _multi_rank_site.py COORDINATOR CERTS OUT_DIR``
"""

from __future__ import annotations

import dataclasses
import sys
from datetime import timedelta
from pathlib import Path

import torch

from geoloco.algorithms.optimizers import InnerOptimizerConfig
from geoloco.algorithms.params import ParamLayout
from geoloco.protos.transport_tls import TLSFiles
from geoloco.scenarios.workloads import MLPWorkload
from geoloco.site_agent.agent import SiteAgent
from geoloco.site_agent.config import SiteAgentConfig
from geoloco.site_agent.distributed import init_from_env

SITE = "duo"
SEED = 0
ROUNDS = 2
INNER_STEPS = 3
LR_SCHEDULE = InnerOptimizerConfig(lr=3e-3, schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)


def main(coordinator: str, certs: Path, out_dir: Path) -> None:
    group = init_from_env(backend="gloo", device="cpu", timeout=timedelta(seconds=120))
    with group:
        workload = MLPWorkload()
        model = workload.build_model(SEED)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        lr_schedule = LR_SCHEDULE.build_schedule(optimizer, total_rounds=ROUNDS, inner_steps=INNER_STEPS)
        lrs: list[float] = []
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: lrs.append(opt.param_groups[0]["lr"]))
        agent = SiteAgent(
            model,
            optimizer,
            workload.site_batches(0, 1, group.data_seed(SEED)),
            workload.loss,
            coordinator=coordinator,
            site=SITE,
            tls=TLSFiles.from_dir(certs, SITE),
            config=SiteAgentConfig(device="cpu", backoff_initial_s=0.05),
            group=group,
            lr_schedule=lr_schedule,
        )
        summary = agent.run()
        torch.save(
            {
                "weights": ParamLayout.from_model(model).flatten(model),
                "summary": dataclasses.asdict(summary),
                "lrs": lrs,
            },
            out_dir / f"rank{group.rank}.pt",
        )


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))

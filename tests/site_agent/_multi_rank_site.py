"""One rank of a 2-process site (torchrun, gloo, CPU) training through ``SiteAgent``.

Started by ``test_multi_rank_site.py``. Every rank builds the model and optimizer and calls
``run()``; only rank 0 talks to the coordinator. Each rank saves its final weights and summary to
``OUT_DIR/rank<r>.pt`` for the test to check.

Usage: ``torchrun --standalone --nproc_per_node=2 _multi_rank_site.py COORDINATOR CERTS OUT_DIR``
"""

from __future__ import annotations

import dataclasses
import sys
from datetime import timedelta
from pathlib import Path

import torch

from geoloco.algorithms.params import ParamLayout
from geoloco.protos.transport import TLSFiles
from geoloco.scenarios.workloads import MLPWorkload
from geoloco.site_agent.agent import SiteAgent
from geoloco.site_agent.config import SiteAgentConfig
from geoloco.site_agent.distributed import init_from_env

SITE = "duo"
SEED = 0


def main(coordinator: str, certs: Path, out_dir: Path) -> None:
    group = init_from_env(backend="gloo", device="cpu", timeout=timedelta(seconds=120))
    with group:
        workload = MLPWorkload()
        model = workload.build_model(SEED)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
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
        )
        summary = agent.run()
        torch.save(
            {
                "weights": ParamLayout.from_model(model).flatten(model),
                "summary": dataclasses.asdict(summary),
            },
            out_dir / f"rank{group.rank}.pt",
        )


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))

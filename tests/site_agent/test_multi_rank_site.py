"""A multi-GPU-style site: 2 ranks under torchrun (gloo, CPU) train as ONE site via SiteAgent.

Only rank 0 talks to the coordinator; the ranks train with DDP and end with the coordinator's
weights. The coordinator sees one site whose sample weight covers both ranks' batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _agent_helpers import make_certs, start_coordinator
from _torchrun import finish, torchrun

from geoloco.algorithms.async_merge import AsyncConfig
from geoloco.algorithms.lr_schedule import lr_multiplier
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.metrics import read_metrics
from geoloco.coordinator.server import CoordinatorServer
from geoloco.scenarios.workloads import MLPWorkload

WORKER = Path(__file__).with_name("_multi_rank_site.py")
LAUNCH_TIMEOUT_S = 180.0
"""Upper bound for the torchrun launch (a few seconds when idle); only a hang gets near it."""
INNER_STEPS = 3
ROUNDS = 2


def _run_duo(tmp_path: Path, algorithm: AlgorithmConfig, **coordinator: Any) -> tuple[int, str, CoordinatorServer]:
    """The two-rank site ``duo`` under torchrun against a coordinator of ``algorithm`` until it
    exits: its exit code, its output and the (stopped) server; the ranks save into tmp_path/out."""
    certs = make_certs(tmp_path / "certs", ["duo"])
    server = start_coordinator(
        certs, MLPWorkload().build_model(0), algorithm=algorithm, total_rounds=ROUNDS, min_sites=1, **coordinator
    )
    out = tmp_path / "out"
    out.mkdir()
    proc = torchrun([str(WORKER), f"localhost:{server.port}", str(certs), str(out)])
    try:
        output = finish(proc, LAUNCH_TIMEOUT_S)
    finally:
        server.stop(grace=0)
    return proc.returncode, output, server


def test_two_rank_site_trains_as_one_site_and_every_rank_ends_in_sync(tmp_path: Path) -> None:
    workload = MLPWorkload()
    metrics = tmp_path / "metrics.jsonl"
    returncode, output, server = _run_duo(
        tmp_path, AlgorithmConfig(inner_steps=INNER_STEPS, uplink_codec="int8", weighting="samples"),
        metrics_path=str(metrics),
    )
    out = tmp_path / "out"
    assert returncode == 0, f"torchrun failed:\n{output[-6000:]}"
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    for rank, saved in enumerate(ranks):
        assert torch.equal(saved["weights"], server.rounds.weights), f"rank {rank} is out of sync"
        assert saved["summary"]["final_round"] == ROUNDS
        assert saved["summary"]["rounds_included"] == ROUNDS
    # Every rank stepped the same inner lr schedule, over the site's cumulative steps.
    expected = [
        3e-3 * lr_multiplier(s, schedule="cosine", warmup_steps=2, decay_steps=ROUNDS * INNER_STEPS,
                             min_lr_ratio=0.1)
        for s in range(ROUNDS * INNER_STEPS)
    ]
    assert ranks[0]["lrs"] == ranks[1]["lrs"] == pytest.approx(expected)
    records = read_metrics(metrics)
    assert [r["participants"] for r in records] == [["duo"]] * ROUNDS
    # One site, two ranks: the sample weight counts both ranks' batches.
    batch = workload.config.batch_size
    assert all(r["sample_weights"]["duo"] == 2 * INNER_STEPS * batch for r in records)


def test_a_multi_rank_site_refuses_rebase_with_the_reason(tmp_path: Path) -> None:
    """``[algorithm.asynchronous] rebase`` takes merges in between single inner steps, which the
    ranks of a multi-rank site do not agree on yet: the site stops with the reason and what to
    change, and no rank hangs."""
    merge = AsyncConfig(enabled=True, min_quorum=1, rebase=True)
    returncode, output, _ = _run_duo(tmp_path, AlgorithmConfig(inner_steps=INNER_STEPS, asynchronous=merge))
    assert returncode != 0
    assert "rebase" in output and "run this site on one rank or turn rebase off" in output, output[-4000:]

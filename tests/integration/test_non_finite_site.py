"""A site whose update has NaN/Inf values: withheld, said so, and the site recovers.

Three sites over gRPC with mutual TLS; every round waits for every member site (no round
deadline; ``min_sites`` = 2 lets a round close with two). Site 2's first inner step of round 1
has a NaN loss, which makes its gradients, its weights and its AdamW moments NaN. The site does
not upload that round, tells the coordinator so with its wait for the broadcast
(``AwaitBroadcastRequest.withheld``), resets its error-feedback residual and its inner
optimizer's state, and counts again from round 2. Before, the round waited for the site for ever
(nothing closes a round that waits for every site without a deadline), and with the NaN moments
every later update of the site was NaN too.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from _cluster import AgentThread, Run, make_certs

from geoloco.algorithms.simulation.clock import SiteConfig
from geoloco.algorithms.simulation.simulator import SimulationConfig, Simulator, SimulatorConfig
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.algorithms.streaming import StreamingConfig
from geoloco.coordinator.metrics import read_metrics
from geoloco.scenarios.workloads import build_workload

INNER_STEPS = 4
POISONED_CALL = INNER_STEPS  # the first inner step of round 1


@pytest.mark.parametrize(
    "streaming", [None, StreamingConfig(enabled=True, fragments=2, overlap_steps=1)], ids=["plain", "streaming"]
)
def test_a_site_withholds_a_non_finite_update_and_counts_again_after_it(
    tmp_path: Path, streaming: StreamingConfig | None
) -> None:
    """Plain rounds, and Streaming DiLoCo (whose site keeps its own weights across rounds, so it
    must also go back to the global weights after the NaN)."""
    certs = make_certs(tmp_path / "certs", ["0", "1", "2"])
    algorithm = AlgorithmConfig(inner_steps=INNER_STEPS, uplink_codec="int8")
    if streaming is not None:
        algorithm = AlgorithmConfig(inner_steps=INNER_STEPS, uplink_codec="int8", streaming=streaming)
    run = Run(workload=build_workload("mlp"), num_sites=3, rounds=4, seed=1, algorithm=algorithm)
    calls = [0]

    def poisoned(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        loss = run.workload.loss(model, batch)
        calls[0] += 1
        return loss * math.nan if calls[0] - 1 == POISONED_CALL else loss

    metrics = tmp_path / "metrics.jsonl"
    server = run.start_coordinator(certs, metrics_path=str(metrics), min_sites=2)
    threads = [
        AgentThread(run.agent(certs, server.port, k, loss_fn=poisoned if k == 2 else None)) for k in range(3)
    ]
    try:
        for thread in threads:
            thread.start()
        summaries = [thread.finish(90) for thread in threads]
        assert server.wait_until_finished(30)
    finally:
        server.stop(grace=0)
    records = read_metrics(metrics)
    # The NaN step falls in round 1 (plain) or 2 (streaming: the overlap steps shift the steps
    # to later rounds); that round closes without site 2, every other round counts all three.
    (withheld,) = [r for r in records if "2" not in r["participants"]]
    assert withheld["round"] in (1, 2) and sorted(withheld["participants"]) == ["0", "1"]
    assert withheld["rejected_reasons"]["2"].startswith("the site sent no update: its pseudo-gradient had NaN/Inf")
    assert all(sorted(r["participants"]) == ["0", "1", "2"] for r in records if r is not withheld)
    assert len(records) == run.rounds
    assert all(s.run_finished for s in summaries)
    assert {s.weights_digest for s in summaries} == {server.rounds.digest_hex}
    assert bool(torch.isfinite(server.rounds.weights).all())
    assert summaries[2].rounds_included == 3
    if streaming is None:
        # The simulator withholds the same update and recovers the same way: the same weights
        # bit for bit (it used to stop on the codec's NaN refusal).
        simulated = _simulate_poisoned(run, site=2, call=POISONED_CALL)
        assert torch.equal(server.rounds.weights, simulated)
    else:
        # Streaming's recovery is not simulated: a clear error, not the codec's.
        with pytest.raises(ValueError, match="does not model a streaming site's recovery"):
            _simulate_poisoned(run, site=2, call=POISONED_CALL)


class _PoisonedWorkload:
    """The run's workload with one NaN loss: site ``site``'s inner step number ``call`` (the
    simulator trains the sites of a round one after another, ``INNER_STEPS`` steps each)."""

    def __init__(self, base: Any, *, num_sites: int, site: int, call: int) -> None:
        self.base = base
        round_number, step = divmod(call, INNER_STEPS)
        self.poisoned = (round_number * num_sites + site) * INNER_STEPS + step
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        loss = self.base.loss(model, batch)
        self.calls += 1
        return loss * math.nan if self.calls - 1 == self.poisoned else loss


def _simulate_poisoned(run: Run, *, site: int, call: int) -> torch.Tensor:
    config = SimulatorConfig(
        algorithm=run.algorithm, inner_optimizer=run.inner,
        sites=[SiteConfig() for _ in range(run.num_sites)],
        simulation=SimulationConfig(rounds=run.rounds, seed=run.seed, device="cpu", eval_every=10**6, min_sites=2),
    )
    simulator = Simulator(config, _PoisonedWorkload(run.workload, num_sites=run.num_sites, site=site, call=call))
    records = list(simulator.run())
    withheld = [r for r in records if str(site) not in r.participants]
    assert [r.round for r in withheld] == [1], [r.participants for r in records]
    reason = withheld[0].rejected_reasons[str(site)]
    assert reason.startswith("the site sent no update: its pseudo-gradient had NaN/Inf"), reason
    return simulator.global_flat

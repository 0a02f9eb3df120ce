"""The memory-saving paths of the coordinator's round give exactly the plain paths' numbers."""

from __future__ import annotations

import pytest
import torch

from geoloco.algorithms.aggregation import RunningSum
from geoloco.algorithms.optimizers import OuterOptimizer, OuterOptimizerConfig


def _vectors(n: int, count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(n, generator=g) for _ in range(count)]


def test_take_result_equals_result_and_spends_the_aggregator() -> None:
    updates = _vectors(1000, 3)
    plain, taken = RunningSum(1000), RunningSum(1000)
    for site, (u, w) in enumerate(zip(updates, [1.0, 2.0, 0.5])):
        plain.add(u, w, site=site)
        taken.add(u, w, site=site)
    expected = plain.result()
    assert torch.equal(taken.take_result(), expected)
    with pytest.raises(ValueError, match="already taken"):
        taken.add(updates[0], site=9)
    with pytest.raises(ValueError, match="already taken"):
        taken.result()


@pytest.mark.parametrize("name", ["nesterov", "sgd", "adam"])
def test_consumed_gradient_gives_the_same_steps(name: str) -> None:
    theta, *grads = _vectors(500, 4)
    config = OuterOptimizerConfig(name=name).resolved()
    copying, consuming = OuterOptimizer(config, 500), OuterOptimizer(config, 500)
    a = b = theta
    for g in grads:
        a = copying.step(a, g)
        b = consuming.step(b, g.clone(), consume_gradient=True)
        assert torch.equal(a, b)
    assert theta.equal(_vectors(500, 1)[0]), "step must leave the caller's weights untouched"


def test_state_meta_reads_the_live_state_without_cloning_it() -> None:
    # state_meta runs during every checkpoint write; a clone of the momentum there is one more
    # model-sized buffer at the coordinator's peak.
    numel = 1 << 16
    outer = OuterOptimizer(OuterOptimizerConfig(name="nesterov").resolved(), numel)
    outer.step(torch.zeros(numel), torch.ones(numel))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        meta = outer.state_meta()
    allocated = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    assert max(allocated, default=0) < numel * 4 // 2, f"state_meta allocated {max(allocated)} bytes"
    assert meta["param_groups"][0]["momentum"] == outer.optimizer.param_groups[0]["momentum"]

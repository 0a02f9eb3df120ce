"""Delayed Nesterov (Liu et al. 2024; ``nesterov`` with ``momentum_period`` > 1): torch's Nesterov
at period 1, and the rule of ``DelayedNesterov``'s docstring computed by hand."""

from __future__ import annotations

import pytest
import torch

from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.optimizers import DelayedNesterov, OuterOptimizer, OuterOptimizerConfig


def _gradients(count: int, numel: int = 64) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(numel, generator=generator) for _ in range(count)]


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_period_one_is_torch_nesterov_bit_for_bit(weight_decay: float) -> None:
    plain = OuterOptimizer(OuterOptimizerConfig(name="nesterov", weight_decay=weight_decay), 64)
    delayed = OuterOptimizer(OuterOptimizerConfig(name="nesterov", weight_decay=weight_decay), 64)
    delayed.optimizer = DelayedNesterov([delayed.param], lr=0.7, momentum=0.9, period=1, weight_decay=weight_decay)
    assert isinstance(plain.optimizer, torch.optim.SGD)  # period 1 builds torch's own
    a = b = torch.linspace(-1, 1, 64)
    for gradient in _gradients(6):
        a, b = plain.step(a, gradient), delayed.step(b, gradient)
        assert torch.equal(a, b)


def test_three_arrivals_by_hand_with_period_two() -> None:
    """b ← b + g; every 2nd step m ← βm + b/2, θ ← θ − η(g/2 + βm), b ← 0; else θ ← θ − η·g/2."""
    lr, beta = 0.5, 0.9
    outer = OuterOptimizer(
        OuterOptimizerConfig(name="nesterov", lr=lr, momentum=beta, momentum_period=2), 3
    )
    assert isinstance(outer.optimizer, DelayedNesterov)
    theta = torch.tensor([1.0, -2.0, 0.5])
    g1, g2, g3 = torch.tensor([0.1, 0.2, -0.3]), torch.tensor([-0.05, 0.4, 0.1]), torch.tensor([0.3, 0.0, 0.2])
    t, d1, d2, d3 = theta.double(), g1.double(), g2.double(), g3.double()
    expected1 = t - lr * d1 / 2  # a plain step: no momentum yet
    m = beta * 0 + (d1 + d2) / 2  # the momentum update from the two buffered arrivals
    expected2 = expected1 - lr * (d2 / 2 + beta * m)
    expected3 = expected2 - lr * d3 / 2  # plain again, the momentum is held
    got = theta
    for g, expected in ((g1, expected1), (g2, expected2), (g3, expected3)):
        got = outer.step(got, g)
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-6)
    state = outer.state_tensors()
    torch.testing.assert_close(state["state.0.momentum_buffer"].double(), m, rtol=0, atol=1e-7)
    torch.testing.assert_close(state["state.0.delay_buffer"], g3)  # the next period's first arrival
    assert int(state["state.0.step"]) == 3


def test_resuming_mid_period_continues_the_same_steps() -> None:
    config = OuterOptimizerConfig(name="nesterov", momentum_period=3)
    grads = _gradients(5)
    straight = OuterOptimizer(config, 64)
    theta = torch.zeros(64)
    for g in grads:
        theta = straight.step(theta, g)
    first = OuterOptimizer(config, 64)
    resumed_theta = torch.zeros(64)
    for g in grads[:2]:
        resumed_theta = first.step(resumed_theta, g)
    second = OuterOptimizer(config, 64)
    second.load_state({k: v.clone() for k, v in first.state_tensors().items()}, first.state_meta())
    for g in grads[2:]:
        resumed_theta = second.step(resumed_theta, g)
    assert torch.equal(theta, resumed_theta)


def test_a_period_needs_nesterov() -> None:
    with pytest.raises(ConfigError, match="momentum_period"):
        OuterOptimizerConfig(name="sgd", momentum_period=4)
    with pytest.raises(ConfigError, match="momentum_period"):
        OuterOptimizerConfig(momentum_period=2)  # unset: FedAvg's default would have no momentum
    with pytest.raises(ConfigError, match="momentum_period"):
        OuterOptimizerConfig(name="nesterov", momentum_period=0)
    resolved = OuterOptimizerConfig(name="nesterov", momentum_period=4).resolved()
    assert resolved.momentum_period == 4 and resolved.lr == 0.7

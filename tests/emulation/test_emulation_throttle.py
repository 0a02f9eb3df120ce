"""ComputeThrottle stretches each optimizer step by 1/speed_factor (fake clock: exact numbers)."""

from __future__ import annotations

import pytest
import torch

from geoloco.scenarios.throttle import ComputeThrottle


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.mark.parametrize(("speed", "extra"), [(1.0, 0.0), (0.5, 0.2), (0.25, 0.6)])
def test_each_step_is_followed_by_a_proportional_sleep(speed: float, extra: float) -> None:
    clock = FakeClock()
    throttle = ComputeThrottle(speed, clock=clock, sleep=clock.sleep)
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    throttle.attach(optimizer)
    loss_fn = throttle.wrap_loss(lambda w: (w**2).sum())
    for _ in range(3):
        loss = loss_fn(weight)
        clock.now += 0.2  # the forward, backward and step take 0.2 s of "compute"
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert throttle.steps == 3
    assert throttle.compute_s == pytest.approx(0.6)
    assert throttle.slept_s == pytest.approx(3 * extra)
    assert clock.now == pytest.approx(0.6 / speed)
    assert float(weight.detach()[0]) < 1.0  # the math is untouched: the optimizer still stepped


def test_speed_factor_outside_range_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        ComputeThrottle(2.0)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        ComputeThrottle(0.0)

"""The chaos schedule (deterministic from its seed) and the goodput and downtime arithmetic."""

from __future__ import annotations

import pytest

from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.simulation.chaos import ChaosConfig, ChaosSchedule, StepLedger, global_downtime


def _downs(schedule: ChaosSchedule, site: int, until: float) -> list[tuple[float, float]]:
    t, out = 0.0, []
    while True:
        failed, repaired = schedule.site(site).next_failure(t)
        if failed > until:
            return out
        out.append((failed, repaired))
        t = repaired


def test_the_schedule_is_a_function_of_its_seed_only() -> None:
    config = ChaosConfig(enabled=True, seed=3, mtbf_s=10.0, repair_s=2.0)
    first, second = ChaosSchedule(config), ChaosSchedule(config)
    # Asked in another order and another pattern: the same failures.
    a = [_downs(first, k, 200.0) for k in range(4)]
    second.site(2).down_at(150.0)
    b = [_downs(second, k, 200.0) for k in reversed(range(4))][::-1]
    assert a == b and all(len(d) > 5 for d in a) and a[0] != a[1]
    assert all(0 < f < r for d in a for f, r in d)
    with_slowdowns = ChaosSchedule(ChaosConfig(enabled=True, seed=3, mtbf_s=10.0, repair_s=2.0, slowdown_every_s=5.0))
    assert [_downs(with_slowdowns, k, 200.0) for k in range(4)] == a  # slowdowns draw from their own stream
    other = ChaosSchedule(ChaosConfig(enabled=True, seed=4, mtbf_s=10.0, repair_s=2.0))
    assert _downs(other, 0, 200.0) != a[0]
    assert ChaosSchedule(ChaosConfig(enabled=True)).site(0).next_failure(0.0) == (float("inf"), float("inf"))


def test_a_site_is_down_exactly_between_failure_and_repair() -> None:
    timeline = ChaosSchedule.fixed({0: [(2.0, 5.0), (9.0, 10.0)]}).site(0)
    assert timeline.down_at(1.9) is None and timeline.down_at(2.0) == (2.0, 5.0)
    assert timeline.down_at(4.99) == (2.0, 5.0) and timeline.down_at(5.0) is None
    assert timeline.next_failure(5.0) == (9.0, 10.0)


def test_slowdowns_stretch_compute_by_hand() -> None:
    """3 s of work from t = 1 with steps 2x slower over [2, 4): 1 s at full speed, 2 s giving 1 s
    of work, the last 1 s at full speed: done at 5."""
    timeline = ChaosSchedule.fixed(slows={0: [(2.0, 4.0, 2.0)]}).site(0)
    assert timeline.finish_time(1.0, 3.0) == 5.0
    assert timeline.work_between(1.0, 5.0) == pytest.approx(3.0)
    assert timeline.work_between(2.0, 3.0) == pytest.approx(0.5)
    assert timeline.finish_time(4.0, 2.5) == 6.5  # after the episode: exactly start + work
    assert ChaosSchedule.fixed().site(7).finish_time(0.1, 0.2) == 0.1 + 0.2


def test_global_downtime_of_hand_made_spans() -> None:
    spans = [(1.0, 3.0), (2.0, 4.0), (6.0, 7.0), (8.0, 12.0)]
    assert global_downtime(spans, 0.0, 10.0) == pytest.approx(1.0 + 2.0 + 1.0)
    assert global_downtime([], 0.0, 5.0) == 5.0
    assert global_downtime([(0.0, 5.0)], 0.0, 5.0) == 0.0


def test_the_ledger_counts_goodput_and_refuses_unknown_reasons() -> None:
    ledger = StepLedger()
    assert ledger.goodput == 1.0
    ledger.useful(8, 0.0, 4.0)
    ledger.lost(2, "failed")
    ledger.lost(0, "stale")
    assert ledger.goodput == 0.8 and ledger.lost_steps == 2
    assert ledger.downtime(0.0, 6.0, running=[(5.0, 6.0)]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="unknown reason"):
        ledger.lost(1, "cosmic rays")
    with pytest.raises(ConfigError, match="slowdown_factor"):
        ChaosConfig(slowdown_factor=1.0)

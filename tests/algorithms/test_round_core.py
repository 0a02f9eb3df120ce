"""The round core on its own: the close rule, the outcome, folding, and the adaptive deadline."""

from __future__ import annotations

import pytest
import torch

from geoloco.algorithms.aggregation import CentralDPSum, RunningSum
from geoloco.algorithms.deadline import AdaptiveDeadlineConfig
from geoloco.algorithms.round import Round, RoundPolicy


def _round(policy: RoundPolicy, *, start: float = 0.0) -> Round:
    round_ = Round(number=3, aggregation=RunningSum(numel=2), opened_s=0.0)
    round_.start(start, policy)
    return round_


def test_quorum_then_everyone_or_the_deadline_closes_the_round() -> None:
    policy = RoundPolicy(min_sites=2, round_deadline_s=5.0)
    round_ = _round(policy)
    expected = ["a", "b", "c"]
    round_.add(torch.ones(2), 1.0, site="a", now=1.0)
    assert not policy.decide_round(round_, now=6.0, expected=expected).close, "below quorum, even past the deadline"
    round_.add(torch.ones(2), 1.0, site="b", now=2.0)
    assert not policy.decide_round(round_, now=4.9, expected=expected).close
    decision = policy.decide_round(round_, now=5.0, expected=expected)
    assert decision.close and decision.deadline_hit
    round_.add(torch.ones(2), 1.0, site="c", now=5.5)
    decision = policy.decide_round(round_, now=5.5, expected=expected)
    assert decision.close and not decision.deadline_hit, "nobody pending: closed by completion"


def test_a_round_that_never_started_closes_once_the_quorums_updates_are_in() -> None:
    policy = RoundPolicy(min_sites=2)
    round_ = Round(number=0, aggregation=RunningSum(numel=2), opened_s=0.0)
    round_.add(torch.ones(2), 1.0, site="a", now=1.0)
    round_.add(torch.ones(2), 1.0, site="b", now=1.5)
    # Members left after uploading: nobody is expected any more, but the quorum's updates count.
    assert policy.decide_round(round_, now=2.0, expected=["c"]).close


def test_outcome_lists_contributors_excluded_rejected_and_folded() -> None:
    policy = RoundPolicy(round_deadline_s=2.0, late_updates="fold", staleness_discount=0.25)
    round_ = _round(policy, start=10.0)
    round_.add(torch.tensor([2.0, 0.0]), 2.0, site="b", now=11.0)
    round_.add(torch.tensor([0.0, 2.0]), 1.0, site="a", now=11.5)
    assert round_.fold(torch.tensor([4.0, 4.0]), 2.0, site="c", policy=policy) == 0.5
    round_.reject("d", "NaN or Inf values")
    outcome = round_.close(now=12.0, expected=["a", "b", "c", "d", "e"])
    assert outcome.contributors == ("b", "a")
    assert outcome.weights == {"b": 2.0, "a": 1.0}
    assert outcome.excluded == ("c", "e") and outcome.rejected == {"d": "NaN or Inf values"}
    assert outcome.folded == {"c": 0.5}
    assert outcome.arrivals_s == {"b": 1.0, "a": 1.5}
    assert outcome.deadline_s == 2.0 and outcome.deadline_hit and outcome.closed_after_s == 2.0
    # (2·[2,0] + 1·[0,2] + 0.5·[4,4]) / 3.5
    assert torch.allclose(round_.aggregation.take_result(), torch.tensor([6.0, 4.0]) / 3.5)


def test_policy_learns_the_adaptive_deadline_from_outcomes() -> None:
    adaptive = AdaptiveDeadlineConfig(enabled=True, window=2, margin=2.0, min_s=0.5, max_s=100.0, quantile=1.0)
    policy = RoundPolicy(round_deadline_s=9.0, adaptive_deadline=adaptive)
    assert policy.deadline_s() == 9.0, "the fixed deadline before anything was observed"
    round_ = _round(policy)
    round_.add(torch.ones(2), 1.0, site="a", now=1.0)
    round_.add(torch.ones(2), 1.0, site="b", now=3.0)
    policy.observe(round_.close(now=3.0, expected=["a", "b"]))
    assert policy.deadline_s() == pytest.approx(6.0)  # margin x the slowest arrival
    state = policy.state()
    restored = RoundPolicy(round_deadline_s=9.0, adaptive_deadline=adaptive)
    restored.load_state(state)
    assert restored.deadline_s() == policy.deadline_s()


def test_central_dp_sum_clips_each_update_and_refuses_late_folds() -> None:
    agg = CentralDPSum(numel=2, clip_norm=1.0, noise_multiplier=0.0)
    agg.add(torch.tensor([3.0, 4.0]), site="a")  # norm 5 -> clipped to 1
    agg.add(torch.tensor([0.0, 0.5]), site="b")  # inside the ball: unchanged
    assert agg.norms == {"a": 5.0, "b": 0.5}
    assert torch.allclose(agg.take_result(), torch.tensor([0.6, 0.8 + 0.5]) / 2)
    with pytest.raises(ValueError, match="does not fold late updates"):
        CentralDPSum(numel=2, clip_norm=1.0, noise_multiplier=1.0).add(torch.zeros(2), site="a", stale=True)

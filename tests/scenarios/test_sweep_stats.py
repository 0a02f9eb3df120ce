"""Statistics over a sweep's seeds (``sweep_stats``): the t-interval, paired differences, the
Pareto front; naming a baseline point; the front on the Pareto plot. Pure numbers, no runs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from geoloco.scenarios.config_file import ConfigFileError
from geoloco.scenarios.research import CurvePoint
from geoloco.scenarios.sweep import expand_grid, find_point, parse_grid
from geoloco.scenarios.sweep_plots import pareto_indices, write_sweep_plots
from geoloco.scenarios.sweep_stats import paired_difference, pareto_front, seed_stats, t_quantile


@pytest.mark.parametrize(
    ("df", "published"),
    # Two-sided 95 % quantiles of Student's t as printed in every statistics table.
    [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (9, 2.262), (30, 2.042)],
)
def test_the_t_quantile_matches_the_published_table(df: int, published: float) -> None:
    assert t_quantile(df) == pytest.approx(published, abs=5e-4)


def test_the_t_quantile_refuses_what_has_no_quantile() -> None:
    with pytest.raises(ValueError, match="df >= 1"):
        t_quantile(0)
    with pytest.raises(ValueError, match="confidence"):
        t_quantile(3, confidence=1.0)


def test_seed_stats_of_a_known_sample() -> None:
    st = seed_stats([1.0, 2.0, 3.0, 4.0])
    assert st is not None
    # By hand: mean 2.5, s = sqrt(5/3) (ddof 1), half-width t(0.975, 3) * s / sqrt(4).
    std = math.sqrt(5.0 / 3.0)
    half = 3.182446305 * std / 2.0
    assert (st.n, st.mean, st.min, st.max) == (4, 2.5, 1.0, 4.0)
    assert st.std == pytest.approx(std, rel=1e-12)
    assert (st.ci_low, st.ci_high) == (pytest.approx(2.5 - half, rel=1e-9), pytest.approx(2.5 + half, rel=1e-9))
    assert st.ci_high is not None and st.ci_high - st.mean == pytest.approx(half, rel=1e-9)
    assert st.to_dict()["confidence"] == 0.95


def test_seed_stats_of_one_value_has_no_spread_and_of_none_is_none() -> None:
    one = seed_stats([7.0])
    assert one is not None and (one.n, one.mean, one.std, one.ci_low, one.ci_high) == (1, 7.0, None, None, None)
    assert seed_stats([]) is None
    same = seed_stats([3.0, 3.0, 3.0])
    assert same is not None and (same.std, same.ci_low, same.ci_high) == (0.0, 3.0, 3.0)


def test_paired_differences_pair_by_seed() -> None:
    baseline = {0: 1.0, 1: 2.0, 2: 3.0}
    point = {2: 5.0, 0: 2.0, 1: 3.5, 7: 100.0}  # seed 7 is not the baseline's: not paired
    diff = paired_difference(point, baseline)
    assert diff.unpaired is None and diff.seeds == (0, 1, 2)
    assert diff.stats is not None
    # Differences 1.0, 1.5, 2.0: mean 1.5, s 0.5, half-width t(0.975, 2) * 0.5 / sqrt(3).
    half = 4.302652730 * 0.5 / math.sqrt(3.0)
    assert (diff.stats.n, diff.stats.mean) == (3, 1.5)
    assert diff.stats.std == pytest.approx(0.5)
    assert diff.stats.ci_low == pytest.approx(1.5 - half) and diff.stats.ci_high == pytest.approx(1.5 + half)
    assert diff.to_dict()["difference"]["mean"] == 1.5


def test_a_point_without_every_baseline_seed_is_unpaired_with_the_reason() -> None:
    diff = paired_difference({0: 1.0, 2: 1.0}, {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0})
    assert diff.stats is None and diff.unpaired == "no value for seeds 1, 3 of the baseline"
    assert diff.to_dict() == {"seeds": [0, 1, 2, 3], "unpaired": "no value for seeds 1, 3 of the baseline"}
    assert paired_difference({0: 1.0}, {}).unpaired == "the baseline has no value for any seed"


def test_pareto_front_of_a_hand_made_set() -> None:
    points = [
        (1.0, 5.0),   # 0: fewest bytes: on the front
        (2.0, 3.0),   # 1: on the front
        (3.0, 4.0),   # 2: dominated by 1
        (4.0, 1.0),   # 3: lowest loss: on the front
        (2.0, 3.0),   # 4: equal to 1: neither dominates the other
        (5.0, 1.0),   # 5: same loss as 3 for more bytes: dominated
        (2.0, 3.5),   # 6: same bytes as 1 for a higher loss: dominated
        (math.nan, 0.0),  # 7: not comparable: never on the front
    ]
    assert pareto_front(points) == [0, 1, 4, 3]
    assert pareto_front([]) == []
    assert pareto_front([(1.0, 1.0)]) == [0]


@dataclass
class _Point:
    """What the plots need of a point: a label, runs with curves, ``stat``."""

    label: str
    means: dict[str, float]
    runs: list[Any] = field(default_factory=lambda: [_OneEvaluation()])

    def stat(self, key: str) -> tuple[float, float, float] | None:
        return None if key not in self.means else (self.means[key], self.means[key], self.means[key])


@dataclass
class _OneEvaluation:
    """A run as the loss plots read it: its curve."""

    curve: list[CurvePoint] = field(default_factory=lambda: [CurvePoint(5, 0, 1.0, 1.0, 10, 10, 1.0)])


def test_the_pareto_plot_draws_the_front_as_a_step_line_and_dims_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib.axes

    points = [
        _Point("a", {"bytes_up": 100.0, "final_eval_loss": 2.0}),
        _Point("b", {"bytes_up": 10.0, "final_eval_loss": 3.0}),
        _Point("c", {"bytes_up": 50.0, "final_eval_loss": 3.5}),  # dominated by b
        _Point("d", {"bytes_up": 1000.0, "final_eval_loss": 1.0}),
        _Point("no eval", {"bytes_up": 1.0}),  # no loss: on no front
    ]
    assert pareto_indices(points) == [1, 0, 3]
    steps: list[tuple[list[float], list[float], dict[str, Any]]] = []
    bars: dict[str, float] = {}
    real_step, real_errorbar = matplotlib.axes.Axes.step, matplotlib.axes.Axes.errorbar

    def step(self: Any, x: Any, y: Any, *args: Any, **kwargs: Any) -> Any:
        steps.append((list(x), list(y), kwargs))
        return real_step(self, x, y, *args, **kwargs)

    def errorbar(self: Any, x: Any, y: Any, *args: Any, **kwargs: Any) -> Any:
        bars[kwargs["label"]] = kwargs["alpha"]
        return real_errorbar(self, x, y, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "step", step)
    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", errorbar)
    written = write_sweep_plots(tmp_path, points, num_seeds=1)
    assert (tmp_path / "pareto.png") in written
    ((xs, ys, kwargs),) = steps
    assert (xs, ys, kwargs["where"]) == ([10.0, 100.0, 1000.0], [3.0, 2.0, 1.0], "post")
    assert bars == {"a": 1.0, "b": 1.0, "c (dominated)": 0.3, "d": 1.0}


POINTS = expand_grid([parse_grid("algorithm.inner_steps=5,10"), parse_grid("algorithm.uplink_codec=none,int8")])


@pytest.mark.parametrize(
    ("spec", "index"),
    [
        ("inner_steps=10 uplink_codec=none", 2),  # the label
        ("uplink_codec=int8 inner_steps=5", 1),  # pairs, in any order
        ("algorithm.inner_steps=10 algorithm.uplink_codec=int8", 3),  # dotted keys
        ({"algorithm.inner_steps": 5, "uplink_codec": "none"}, 0),  # a mapping, values as Python values
        ("inner_steps=5.0 uplink_codec=none", 0),  # the same number written otherwise
    ],
)
def test_find_point_by_label_or_pairs(spec: Any, index: int) -> None:
    assert find_point(POINTS, spec) == index


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("uplink_codec=none", "matches 2 points"),
        ("inner_steps=7", "matches no point"),
        ("lr=0.1", "lr is not a swept key"),
        ("nonsense", "neither a point's label nor KEY=VALUE"),
        ("", "names no point"),
    ],
)
def test_find_point_says_which_points_exist(spec: str, words: str) -> None:
    with pytest.raises(ConfigFileError, match=words) as info:
        find_point(POINTS, spec)
    assert info.value.key == "--baseline"
    assert "inner_steps=5 uplink_codec=none" in info.value.message or "swept:" in info.value.message


def test_find_point_without_a_grid_is_the_base() -> None:
    assert find_point(expand_grid([]), "base") == 0

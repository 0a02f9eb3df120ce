"""Heterogeneous sites: weighting by work done, time-budget rounds, adaptive deadline, late folding."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from geoloco.algorithms.aggregation import RunningSum
from geoloco.algorithms.config import ConfigError, config_from_dict
from geoloco.algorithms.deadline import AdaptiveDeadlineConfig, RoundDeadline, quantile
from geoloco.algorithms.diloco import run_inner_steps
from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.simulation.clock import transfer_time
from geoloco.algorithms.simulation.simulator import Simulator, SimulatorConfig, simulate
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.algorithms.time_budget import TimeBudget, run_inner_steps_within, steps_in_budget
from geoloco.algorithms.weighting import (
    WEIGHTINGS,
    check_inner_steps,
    most_inner_steps,
    site_weight,
    stale_weight,
)


def _config(**sections) -> SimulatorConfig:
    base = {
        "algorithm": {"inner_steps": 4, "uplink_codec": "none", "downlink_codec": "none"},
        "inner_optimizer": {"lr": 0.02},
        "sites": {"count": 3},
        "simulation": {"rounds": 3, "eval_every": 1, "device": "cpu", "step_time_s": 0.1},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values} if isinstance(values, dict) else values
    return SimulatorConfig.from_dict(base)


# -- weighting ---------------------------------------------------------------------------------


def test_site_weight_by_name() -> None:
    assert site_weight("uniform", samples=64, inner_steps=8) == 1.0
    assert site_weight("steps", samples=64, inner_steps=8) == 8.0
    assert site_weight("samples", samples=64, inner_steps=8) == 64.0
    with pytest.raises(ValueError, match="valid names: uniform, steps, samples"):
        site_weight("tokens", samples=1, inner_steps=1)
    with pytest.raises(ValueError, match="finite amount of work > 0"):
        site_weight("steps", samples=8, inner_steps=0)
    assert stale_weight(6.0, discount=0.5, staleness=1) == 3.0
    assert stale_weight(6.0, discount=0.5, staleness=2) == 1.5
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        stale_weight(1.0, discount=0.0, staleness=1)


def test_the_inner_steps_a_round_may_report() -> None:
    # A plain round runs H; an adaptive streaming cadence up to interval_steps_max (if larger);
    # a time budget fits as many as the hardware allows, so nothing configured bounds them.
    assert most_inner_steps(1) == 1
    assert most_inner_steps(6, interval_steps_max=9) == 9 and most_inner_steps(6, interval_steps_max=2) == 6
    assert most_inner_steps(1000, round_time_budget_s=3.0) is None
    assert check_inner_steps(1, 1) is None and check_inner_steps(10**12, None) is None
    why = check_inner_steps(10**12, 1)
    assert why is not None and "inner_steps 1000000000000" in why and "at most 1" in why


def test_algorithm_config_heterogeneous_keys() -> None:
    config = config_from_dict(
        AlgorithmConfig,
        {"weighting": "steps", "round_time_budget_s": 2.5, "late_updates": "fold",
         "staleness_discount": 0.25},
    )
    assert config.round_time_budget_s == 2.5 and config.late_updates == "fold"
    for data, key, fragment in [
        ({"weighting": "work"}, "weighting", "'uniform' | 'steps' | 'samples'"),
        ({"round_time_budget_s": 0}, "round_time_budget_s", "> 0 seconds"),
        ({"late_updates": "queue"}, "late_updates", "'drop' | 'fold'"),
        ({"staleness_discount": 1.5}, "staleness_discount", "(0, 1]"),
        ({"name": "ddp", "round_time_budget_s": 1.0}, "round_time_budget_s", "every step"),
    ]:
        with pytest.raises(ConfigError) as err:
            config_from_dict(AlgorithmConfig, data, prefix="algorithm")
        assert err.value.key == f"algorithm.{key}" and fragment in err.value.message
    # Built in code, an unknown weighting is caught by validate() too and lists the names.
    with pytest.raises(ConfigError, match=", ".join(WEIGHTINGS)):
        AlgorithmConfig(weighting="tokens")  # type: ignore[arg-type]


def test_aggregator_takes_a_stale_and_a_fresh_update_of_one_site() -> None:
    agg = RunningSum(numel=2)
    agg.add(torch.tensor([4.0, 0.0]), 3.0, site=1)
    agg.add(torch.tensor([0.0, 4.0]), 1.0, site=1, stale=True)
    with pytest.raises(ValueError, match="late update"):
        agg.add(torch.zeros(2), 1.0, site=1, stale=True)
    assert agg.sites == [1] and agg.stale_sites == [1]
    assert torch.equal(agg.result(), torch.tensor([3.0, 1.0]))


# -- time budget -------------------------------------------------------------------------------


def test_steps_in_budget_and_stopping_rule_agree() -> None:
    assert steps_in_budget(0.3, 0.1) == 3  # float round-off does not lose a step
    assert steps_in_budget(1.0, 0.4) == 2
    assert steps_in_budget(0.05, 0.4) == 1  # a site always contributes one step
    assert steps_in_budget(10.0, 0.1, max_steps=7) == 7
    with pytest.raises(ValueError, match="> 0 seconds"):
        steps_in_budget(0.0, 0.1)
    for budget_s, step_s in [(1.0, 0.1), (1.0, 0.3), (2.0, 0.25), (0.1, 0.5)]:
        rule = TimeBudget(budget_s)
        n = 0
        while rule.another_step_fits(n, n * step_s):
            n += 1
        assert n == steps_in_budget(budget_s, step_s), (budget_s, step_s)
    assert not TimeBudget(10.0, max_steps=2).another_step_fits(2, 0.1)


def test_run_inner_steps_within_counts_the_clock(make_workload) -> None:
    """A fake clock advancing 0.1 s per read-out: a 0.25x site (time_scale 4) fits a quarter."""
    workload = make_workload()
    results = {}
    for scale in (1.0, 4.0):
        model = workload.build_model(0)
        ticks = itertools.count()
        result, elapsed = run_inner_steps_within(
            model, torch.optim.SGD(model.parameters(), lr=0.01), workload.site_batches(0, 1, 0),
            TimeBudget(2.0), workload.loss, clock=lambda: 0.1 * next(ticks), time_scale=scale,
        )
        results[scale] = (len(result.losses), result.samples, elapsed)
    assert results[1.0][:2] == (20, 20 * workload.batch)
    assert results[4.0][:2] == (5, 5 * workload.batch)
    assert results[4.0][2] == pytest.approx(2.0)


# -- adaptive deadline -------------------------------------------------------------------------


def test_quantile_interpolates() -> None:
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([1.0, 2.0], 0.9) == pytest.approx(1.9)
    assert quantile([5.0], 0.9) == 5.0


def test_adaptive_deadline_shrinks_for_a_fast_fleet_and_grows_for_a_cut_off_site() -> None:
    policy = RoundDeadline(None, AdaptiveDeadlineConfig(
        enabled=True, quantile=1.0, margin=1.5, window=2, min_s=1.0, max_s=60.0))
    assert policy.current_s() == 60.0  # nothing observed: nobody is cut off
    policy.observe([2.0, 3.0, 4.0])
    assert policy.current_s() == pytest.approx(6.0)  # 1.5 x the slowest arrival
    policy.observe([0.2, 0.3])
    assert policy.current_s() == pytest.approx(6.0)  # round 1 still in the window
    policy.observe([0.2, 0.4])
    assert policy.current_s() == pytest.approx(1.0)  # bounded below by min_s
    # A site that missed a 5 s deadline counts as "at least 5 s": the deadline grows by margin.
    policy.observe([0.5], missed_s=[5.0])
    assert policy.current_s() == pytest.approx(7.5)
    policy.observe([0.5], missed_s=[7.5])
    assert policy.current_s() == pytest.approx(11.25)
    for _ in range(10):
        policy.observe([], missed_s=[policy.current_s()])
    assert policy.current_s() == 60.0  # bounded above by max_s


def test_fixed_deadline_and_initial_deadline() -> None:
    fixed = RoundDeadline(30.0, AdaptiveDeadlineConfig(enabled=False))
    fixed.observe([1.0])
    assert fixed.current_s() == 30.0 and not fixed.is_adaptive
    assert RoundDeadline(None).current_s() is None
    adaptive = RoundDeadline(12.0, AdaptiveDeadlineConfig(enabled=True, max_s=100.0))
    assert adaptive.current_s() == 12.0  # round_deadline_s is the deadline before observations


@pytest.mark.parametrize(
    ("data", "key", "fragment"),
    [
        ({"quantile": 0}, "quantile", "(0, 1]"),
        ({"margin": 0.9}, "margin", ">= 1"),
        ({"window": 0}, "window", ">= 1"),
        ({"min_s": 10.0, "max_s": 5.0}, "max_s", ">= min_s"),
        ({"policy": "ewma"}, "policy", "allowed keys"),
    ],
)
def test_adaptive_deadline_config_errors(data, key, fragment) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict(AdaptiveDeadlineConfig, data, prefix="adaptive_deadline")
    assert err.value.key == f"adaptive_deadline.{key}" and fragment in err.value.message


# -- the simulator -----------------------------------------------------------------------------


def test_time_budget_round_weights_by_steps_exactly(make_workload) -> None:
    """Sites at 1x, 0.5x, 0.25x with a 0.8 s budget run 8, 4, 2 steps; with weighting = "steps"
    and FedAvg (outer SGD lr 1, lossless codecs) θ_1 = θ_0 − Σ n_k g_k / Σ n_k, recomputed here
    from the same per-site optimizers and data streams."""
    config = _config(
        algorithm={"name": "fedavg", "weighting": "steps", "round_time_budget_s": 0.8},
        sites=[{"speed_factor": 1.0}, {"speed_factor": 0.5}, {"speed_factor": 0.25}],
        simulation={"rounds": 1},
    )
    workload = make_workload(hidden=4)
    sim = Simulator(config, workload)
    theta0 = sim.global_flat.clone()
    (record,) = list(sim.run())
    assert record.inner_steps == {"0": 8, "1": 4, "2": 2}
    assert list(record.compute_s.values()) == pytest.approx([0.8, 0.8, 0.8])

    model = workload.build_model(0)
    layout = ParamLayout.from_model(model)
    total = torch.zeros_like(theta0)
    for k, steps in enumerate([8, 4, 2]):
        layout.load_(model, theta0)
        optimizer = config.inner_optimizer.build(model.parameters())
        run_inner_steps(model, optimizer, workload.site_batches(k, 3, 0), steps, workload.loss)
        total += steps * (theta0 - layout.flatten(model))
    expected = theta0 - total / 14
    assert torch.allclose(sim.global_flat, expected, atol=1e-6)
    uniform = Simulator(
        _config(algorithm={"name": "fedavg", "weighting": "uniform", "round_time_budget_s": 0.8},
                sites=[{"speed_factor": 1.0}, {"speed_factor": 0.5}, {"speed_factor": 0.25}],
                simulation={"rounds": 1}),
        workload,
    )
    list(uniform.run())
    assert not torch.allclose(uniform.global_flat, expected, atol=1e-6)


def test_time_budget_keeps_every_site_busy(make_workload) -> None:
    """Fixed H: the 1x site idles while the 0.25x site computes; a budget evens it out."""
    sites = [{"speed_factor": 1.0}, {"speed_factor": 0.5}, {"speed_factor": 0.25}]
    fixed = list(simulate(_config(sites=sites, algorithm={"inner_steps": 8}), make_workload()))
    budget = list(simulate(
        _config(sites=sites, algorithm={"round_time_budget_s": 0.8, "weighting": "steps"}),
        make_workload(),
    ))
    assert fixed[-1].utilization["0"] < 0.3 < 0.85 < min(budget[-1].utilization.values())
    assert budget[-1].round_time_s < 0.5 * fixed[-1].round_time_s


def test_adaptive_deadline_in_the_simulator(make_workload) -> None:
    """Identical sites: round 1 runs under max_s, later rounds under margin x the arrival time."""
    config = _config(
        sites={"count": 2, "latency_s": 0.05, "uplink_bps": 1e6},
        simulation={"adaptive_deadline": {"enabled": True, "quantile": 0.9, "margin": 2.0,
                                          "min_s": 0.1, "max_s": 100.0}},
    )
    records = list(simulate(config, make_workload()))
    arrival = 0.4 + transfer_time(records[0].bytes_up["0"], 1e6, 0.05)
    assert records[0].deadline_s == 100.0
    assert records[1].deadline_s == pytest.approx(2.0 * arrival)
    assert all(r.excluded == [] for r in records)


def _recording(sim: Simulator) -> list[tuple[str, float, bool]]:
    """Every ``add`` of the simulator's aggregators: (site, weight, stale)."""
    adds: list[tuple[str, float, bool]] = []

    class Recording(RunningSum):
        def add(self, update, weight=1.0, *, site, stale=False):  # type: ignore[override]
            adds.append((site, weight, stale))
            super().add(update, weight, site=site, stale=stale)

    sim.uplinks.begin = (  # type: ignore[method-assign]
        lambda plan: Recording(numel=sim.strategy.update_numel(plan.round), device=sim.strategy.device)
    )
    return adds


@pytest.mark.parametrize("late_updates", ["drop", "fold"])
def test_late_update_is_folded_with_discount_or_dropped(make_workload, late_updates) -> None:
    """Site 2 (2.5x slower) misses a 0.8 s deadline every round. "fold": its update enters the next
    round with weight 0.25 (uniform weight 1 x discount); "drop": it goes to its residual."""
    config = _config(
        algorithm={"late_updates": late_updates, "staleness_discount": 0.25, "uplink_codec": "int8"},
        sites=[{}, {}, {"speed_factor": 0.4}],
        simulation={"round_deadline_s": 0.8, "min_sites": 2},
    )
    sim = Simulator(config, make_workload())
    adds = _recording(sim)
    records = list(sim.run())
    assert [r.excluded for r in records] == [["2"], ["2"], ["2"]]
    stale = [(site, w) for site, w, is_stale in adds if is_stale]
    if late_updates == "fold":
        assert [sorted(r.folded_late) for r in records] == [[], ["2"], ["2"]]
        assert stale == [("2", 0.25), ("2", 0.25)]
    else:
        assert [r.folded_late for r in records] == [{}, {}, {}] and stale == []
        # Dropped, the update sits in the site's residual: error feedback keeps all of it.
        assert sim.sites[2].uplink.encoders[0].error_feedback.residual.abs().sum() > 0


def test_simulator_config_rejects_adaptive_deadline_with_ddp() -> None:
    with pytest.raises(ConfigError) as err:
        _config(algorithm={"name": "ddp"},
                simulation={"adaptive_deadline": {"enabled": True}})
    assert err.value.key == "simulation.adaptive_deadline.enabled"


def test_adaptive_deadline_state_survives_a_checkpoint_round_trip() -> None:
    policy = AdaptiveDeadlineConfig(enabled=True, quantile=0.5, margin=2.0, window=2, min_s=0.1, max_s=99.0)
    before = RoundDeadline(None, policy)
    for durations in ([1.0, 2.0], [3.0], [4.0, 5.0]):
        before.observe(durations)
    after = RoundDeadline(None, policy)
    after.load_state(json.loads(json.dumps(before.state())))  # as checkpoint metadata travels
    assert after.observed == before.observed == [3.0, 4.0, 5.0]  # the window keeps 2 rounds
    assert after.current_s() == before.current_s() == 8.0
    fixed = RoundDeadline(5.0)
    fixed.load_state([[1.0]])  # a fixed deadline learns nothing, restored or not
    assert fixed.current_s() == 5.0

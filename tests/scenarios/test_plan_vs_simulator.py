"""The planner against the simulator: same config, same virtual times and bytes, round for round.

The planner runs the simulator's clock functions without training, and codec sizes do not depend
on the values encoded, so with a fixed ``step_time_s`` the two agree exactly (``==`` on floats:
the planner repeats the simulator's arithmetic in the same order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.simulation.clock import SiteConfig
from geoloco.algorithms.simulation.planner import (
    Plan,
    PlanError,
    encoded_nbytes,
    fragment_numels,
    plan,
    rounds_for_steps,
)
from geoloco.algorithms.simulation.simulator import SimulatorConfig, simulate


class TinyWorkload:
    """Four layer groups (``0``, ``2``, ``4``, ``6``) of a small MLP on random regression data."""

    name = "tiny"

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(),
            nn.Linear(8, 1),
        )

    def site_batches(self, site: int, num_sites: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed * 100 + site)
        while True:
            x = torch.randn(8, 4, generator=g)
            yield x, x.sum(dim=1, keepdim=True)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    def eval_loss(self, model: nn.Module) -> float:
        with torch.no_grad():
            return float(self.loss(model, next(self.site_batches(0, 1, 99))))


SITES = [
    {"uplink_bps": 2e5, "downlink_bps": 4e5, "latency_s": 0.01, "speed_factor": 1.0},
    {"uplink_bps": 5e4, "downlink_bps": 1e5, "latency_s": 0.08, "speed_factor": 0.5},
    {"uplink_bps": 1e5, "downlink_bps": 1e5, "latency_s": 0.03, "speed_factor": 0.8},
]


STREAMING_ADAPTIVE: dict[str, Any] = {
    "name": "diloco", "inner_steps": 8, "uplink_codec": "int8", "downlink_codec": "int8",
    "streaming": {"enabled": True, "fragments": 4, "overlap_steps": 1, "adaptive_overlap": True,
                  "interval_steps_max": 6},
}


ADAPTIVE_UPLINK: dict[str, Any] = {
    "name": "diloco", "inner_steps": 4, "uplink_codec": "int8",
    "adaptive_uplink": {"enabled": True, "min_density": 0.05, "min_upload_s": 0.001},
}


TWO_REGIONS: dict[str, Any] = {
    "regions": [
        {"name": "eu", "sites": ["site-0", "site-1"], "uplink_bps": 3e5, "downlink_bps": 3e5, "latency_s": 0.04},
        {"name": "us", "sites": ["site-2"], "uplink_bps": 2e5, "downlink_bps": 2e5, "latency_s": 0.02,
         "upward_codec": "uplink"},
    ],
    "coordinator_link": {"ingress_bps": 2.5e5, "egress_bps": 1.5e5},
}
"""Two relays (one sending float32 partials, one its uplink codec) behind a slow coordinator link."""


SECURE: dict[str, Any] = {"secure_aggregation": True, "clip_norm": 1.0}
"""Secure aggregation (its stage calls and barriers on the clock, ``secure_clock``)."""


def _config(
    algorithm: dict[str, Any], simulation: dict[str, Any] | None = None, tiers: dict[str, Any] | None = None,
    privacy: dict[str, Any] | None = None,
) -> SimulatorConfig:
    return SimulatorConfig.from_dict({
        "algorithm": algorithm,
        "sites": SITES,
        "simulation": {"rounds": 5, "step_time_s": 0.05, "device": "cpu", "eval_every": 100, **(simulation or {})},
        **(tiers or {}),
        **({"privacy": privacy} if privacy else {}),
    })


def _both(config: SimulatorConfig) -> tuple[list[Any], Plan]:
    workload = TinyWorkload()
    records = list(simulate(config, workload))
    layout = ParamLayout.from_model(workload.build_model(0))
    predicted = plan(
        config.training, numel=layout.numel, sites=config.sites,
        step_time_s=float(config.simulation.step_time_s), layout=layout, tiers=config.tier_clock(),
    )
    return records, predicted


def _assert_same(records: list[Any], predicted: Plan) -> None:
    assert len(predicted.rounds) == len(records)
    for sim, mine in zip(records, predicted.rounds, strict=True):
        names = list(sim.bytes_up)
        assert mine.round == sim.round and mine.phase == sim.phase
        assert mine.inner_steps == max(sim.inner_steps.values())
        assert mine.bytes_up == [sim.bytes_up[n] for n in names]
        assert mine.bytes_down == [sim.bytes_down[n] for n in names]
        assert mine.wall_clock_s == sim.wall_clock_s
        assert mine.round_time_s == sim.round_time_s
        assert mine.compute_s == [sim.compute_s[n] for n in names]
        assert mine.utilization == [sim.utilization[n] for n in names]
        assert [names[int(s.split("-")[1])] for s in mine.excluded] == sim.excluded
        assert mine.fragment == sim.fragment


@pytest.mark.parametrize(
    ("algorithm", "simulation"),
    [
        pytest.param(
            {"name": "diloco", "inner_steps": 5, "uplink_codec": "int8", "downlink_codec": "int4"}, None,
            id="diloco-int8",
        ),
        pytest.param({"name": "fedavg", "inner_steps": 3, "uplink_codec": "topk:0.1|int4"}, None, id="fedavg-topk"),
        pytest.param(
            {"name": "diloco", "inner_steps": 4, "uplink_codec": "int8", "late_updates": "fold"},
            {"round_deadline_s": 0.35, "min_sites": 1}, id="deadline-fold",
        ),
        pytest.param(
            {"name": "diloco", "inner_steps": 4, "uplink_codec": "int8"},
            {"round_deadline_s": 0.3, "min_sites": 2,
             "adaptive_deadline": {"enabled": True, "quantile": 0.5, "window": 2, "margin": 1.1}},
            id="adaptive-deadline",
        ),
        pytest.param(
            {"name": "diloco", "inner_steps": 4, "warmup_steps": 3, "uplink_codec": "int8"}, None, id="warmup"
        ),
        pytest.param(
            {"name": "diloco", "inner_steps": 4, "round_time_budget_s": 0.22, "weighting": "steps"}, None,
            id="time-budget",
        ),
        pytest.param({"name": "ddp", "inner_steps": 3, "uplink_codec": "bf16"}, {"rounds": 3}, id="ddp"),
        pytest.param(
            {"name": "diloco", "inner_steps": 8, "uplink_codec": "int8", "downlink_codec": "int8",
             "streaming": {"enabled": True, "fragments": 4, "overlap_steps": 1}},
            {"rounds": 9}, id="streaming",
        ),
        pytest.param(
            {"name": "diloco", "inner_steps": 6, "uplink_codec": "int4",
             "streaming": {"enabled": True, "fragments": 3, "overlap_steps": 2, "split": "contiguous"}},
            {"rounds": 7, "round_deadline_s": 0.5, "min_sites": 2}, id="streaming-deadline",
        ),
        pytest.param(STREAMING_ADAPTIVE, {"rounds": 10}, id="streaming-adaptive-overlap"),
        pytest.param(ADAPTIVE_UPLINK, {"rounds": 6}, id="adaptive-uplink"),
        pytest.param(
            {**ADAPTIVE_UPLINK, "late_updates": "fold"}, {"rounds": 6, "round_deadline_s": 0.4, "min_sites": 1},
            id="adaptive-uplink-folded-stragglers",
        ),
        pytest.param(
            {**ADAPTIVE_UPLINK, "late_updates": "drop"}, {"rounds": 6, "round_deadline_s": 0.4, "min_sites": 1},
            id="adaptive-uplink-dropped-stragglers",
        ),
    ],
)
def test_planner_reproduces_the_simulators_clock_and_bytes(
    algorithm: dict[str, Any], simulation: dict[str, Any] | None
) -> None:
    records, predicted = _both(_config(algorithm, simulation))
    _assert_same(records, predicted)


@pytest.mark.parametrize(
    ("algorithm", "tiers"),
    [
        pytest.param(
            {"name": "diloco", "inner_steps": 4, "warmup_steps": 2, "uplink_codec": "int8", "downlink_codec": "int8"},
            TWO_REGIONS, id="regions",
        ),
        pytest.param(
            {"name": "fedavg", "inner_steps": 3, "uplink_codec": "topk:0.1|int4"},
            {"coordinator_link": {"ingress_bps": 1e5}}, id="shared-coordinator-link",
        ),
    ],
)
def test_planner_reproduces_the_simulators_two_tier_clock(algorithm: dict[str, Any], tiers: dict[str, Any]) -> None:
    records, predicted = _both(_config(algorithm, None, tiers))
    _assert_same(records, predicted)


@pytest.mark.parametrize(
    ("algorithm", "privacy"),
    [
        # 11 rounds: the round number's length changes the messages' sizes at round 10.
        pytest.param({"name": "diloco", "inner_steps": 2, "weighting": "uniform"}, SECURE, id="secure"),
        pytest.param(
            {"name": "fedavg", "inner_steps": 1, "uplink_codec": "randk:0.25", "weighting": "uniform"},
            {**SECURE, "dp": "distributed", "noise_multiplier": 0.5, "modulus_bits": 16}, id="secure-distributed-dp",
        ),
        pytest.param(
            {"name": "diloco", "inner_steps": 4, "weighting": "uniform",
             "streaming": {"enabled": True, "fragments": 2, "overlap_steps": 1}},
            SECURE, id="secure-streaming",
        ),
    ],
)
def test_planner_reproduces_the_simulators_secure_rounds(algorithm: dict[str, Any], privacy: dict[str, Any]) -> None:
    records, predicted = _both(_config(algorithm, {"rounds": 11}, privacy=privacy))
    _assert_same(records, predicted)


def test_planner_reproduces_secagg_plus_neighbours_drawn_each_round() -> None:
    """Twelve sites on SecAgg+'s graph: each round draws every site's neighbours anew, and the
    messages name them as decimal text, so one- and two-digit neighbours change the sizes from
    round to round (by a byte or two): the planner sizes every round, as the simulator's
    protocol run does."""
    config = SimulatorConfig.from_dict({
        "algorithm": {"name": "diloco", "inner_steps": 1, "weighting": "uniform"},
        "sites": [{**SITES[k % 3], "name": f"s{k}"} for k in range(12)],
        "simulation": {"rounds": 3, "step_time_s": 0.05, "device": "cpu", "eval_every": 100},
        "privacy": {**SECURE, "neighbours": "secagg+"},
    })
    records, predicted = _both(config)
    _assert_same(records, predicted)
    per_round = [r.bytes_up for r in predicted.rounds]
    assert len({tuple(b) for b in per_round}) > 1, per_round


def test_planner_stops_where_the_privacy_budget_stops_the_simulator() -> None:
    records, predicted = _both(_config(
        {"name": "fedavg", "inner_steps": 1, "weighting": "uniform"}, {"rounds": 6},
        privacy={"dp": "central", "clip_norm": 1.0, "noise_multiplier": 2.0, "epsilon_budget": 4.5},
    ))
    _assert_same(records, predicted)
    assert 0 < len(predicted.rounds) < 6


def test_the_regions_case_is_slower_than_the_flat_network() -> None:
    """The relays and the coordinator's 150-250 kbit/s link must set the clock in the regions
    case, or it compares only the flat links."""
    algorithm = {"name": "diloco", "inner_steps": 4, "uplink_codec": "int8", "downlink_codec": "int8"}
    _, tiered = _both(_config(algorithm, None, TWO_REGIONS))
    _, flat = _both(_config(algorithm))
    assert tiered.total_s > flat.total_s * 1.05


@pytest.mark.parametrize(
    ("algorithm", "simulation"),
    [
        ({"name": "ddp", "inner_steps": 3}, None),
        ({"name": "diloco", "inner_steps": 8, "streaming": {"enabled": True, "fragments": 4}}, None),
        ({"name": "diloco", "inner_steps": 4}, {"round_deadline_s": 0.5, "min_sites": 2}),
    ],
    ids=["ddp", "streaming", "deadline"],
)
def test_two_tiers_plan_only_rounds_that_wait_for_every_site(
    algorithm: dict[str, Any], simulation: dict[str, Any] | None
) -> None:
    """What the simulator's two-tier clock refuses, the planner refuses with the way out."""
    flat = _config(algorithm, simulation)
    tiers = _config({"name": "diloco", "inner_steps": 4}, None, TWO_REGIONS).tier_clock()
    with pytest.raises(PlanError, match="wait for every site"):
        plan(flat.training, numel=100, sites=flat.sites, step_time_s=0.05, tiers=tiers)


def test_the_adaptive_overlap_case_stretches_rounds() -> None:
    """The sites' links hide a fragment behind no fewer than two steps: the rule lengthens τ and
    the rounds, or the case above compares only the fixed cadence."""
    _, predicted = _both(_config(STREAMING_ADAPTIVE, {"rounds": 10}))
    interval = STREAMING_ADAPTIVE["inner_steps"] // STREAMING_ADAPTIVE["streaming"]["fragments"]
    assert predicted.rounds[0].inner_steps == interval
    assert max(r.inner_steps for r in predicted.rounds) > interval


def test_the_adaptive_uplink_case_gives_the_slow_link_a_sparser_codec() -> None:
    """Site 1's 50 kbit/s uplink gets a top-k codec once measured, or the case above compares only
    the dense codec's sizes."""
    _, predicted = _both(_config(ADAPTIVE_UPLINK, {"rounds": 6}))
    dense = predicted.rounds[0].bytes_up
    assert dense[0] == dense[1]
    assert any(r.bytes_up[1] < dense[1] for r in predicted.rounds[1:])


@pytest.mark.parametrize("late_updates", ["fold", "drop"])
def test_a_stragglers_upload_measures_its_link_only_when_the_coordinator_takes_it(late_updates: str) -> None:
    """The coordinator measures the uploads it admits: on time, or one round late when it folds
    them. Site 1 (50 kbit/s) misses every deadline from round 1 on: with its late uploads folded
    they measure its link and it gets a sparser codec; with them dropped its link is never
    measured and it keeps the run's codec. The simulator measured every upload the guard would
    take, so it gave the dropped straggler a codec the coordinator never would."""
    records, predicted = _both(_config(
        {**ADAPTIVE_UPLINK, "late_updates": late_updates}, {"rounds": 6, "round_deadline_s": 0.4, "min_sites": 1},
    ))
    assert all("1" in r.excluded for r in records[1:])
    dense = records[0].bytes_up["1"]
    later = [r.bytes_up["1"] for r in records[2:]]
    if late_updates == "fold":
        # Folded during round 1, its round-0 upload informs round 2's plan, not round 1's.
        assert records[1].bytes_up["1"] == dense
        assert all(b < dense for b in later), later
    else:
        assert later == [dense] * len(later)
    assert [r.bytes_up for r in predicted.rounds] == [list(r.bytes_up.values()) for r in records]


def test_deadline_case_excludes_a_straggler() -> None:
    """The deadline configurations above must exercise exclusion, or they prove nothing more."""
    _, predicted = _both(
        _config(
            {"name": "diloco", "inner_steps": 4, "uplink_codec": "int8", "late_updates": "fold"},
            {"round_deadline_s": 0.35, "min_sites": 1},
        )
    )
    assert any(r.excluded for r in predicted.rounds)


def test_codec_sizes_match_encoded_nbytes() -> None:
    from geoloco.compression import parse_codec

    x = torch.randn(10_001)
    for spec in ("none", "bf16", "int8", "int4:block=64", "topk:0.01|int4", "randk:0.05|int8"):
        assert encoded_nbytes(spec, x.numel()) == parse_codec(spec).encode(x, seed=3).nbytes, spec


def test_fragments_without_layout_are_equal_shares() -> None:
    assert fragment_numels(10, 3) == [4, 3, 3]
    with pytest.raises(PlanError, match="fragments need at least"):
        fragment_numels(2, 3)


def test_run_totals_and_rounds_for_steps() -> None:
    config = _config({"name": "diloco", "inner_steps": 5, "uplink_codec": "int8"})
    _, predicted = _both(config)
    assert predicted.total_s == predicted.rounds[-1].wall_clock_s
    up, down = predicted.site_bytes()["site-0"]
    assert up == 5 * predicted.rounds[0].bytes_up[0] and down == 5 * predicted.rounds[0].bytes_down[0]
    assert all(0 < u <= 1 for u in predicted.site_utilization().values())
    assert rounds_for_steps(config.training, 12) == 3
    streaming = _config({"name": "diloco", "inner_steps": 8, "streaming": {"enabled": True, "fragments": 4}})
    assert rounds_for_steps(streaming.training, 16) == 8


def test_memory_estimate_counts_adamw_and_residuals() -> None:
    config = _config({"name": "diloco", "inner_steps": 5, "uplink_codec": "int8", "downlink_codec": "none"})
    memory = plan(config.training, numel=1000, sites=[SiteConfig()], step_time_s=0.1).memory
    assert memory.site["inner_optimizer"] == 8000 and memory.site["uplink_residual"] == 4000
    assert memory.coordinator["outer_optimizer"] == 4000  # Nesterov momentum
    assert memory.coordinator["downlink_residual"] == 0  # lossless downlink keeps no residual
    ddp = _config({"name": "ddp", "inner_steps": 1})
    memory = plan(ddp.training, numel=1000, sites=[SiteConfig()], step_time_s=0.1).memory
    assert "inner_optimizer" not in memory.site and memory.coordinator["outer_optimizer"] == 8000


def test_planner_refuses_what_it_cannot_predict() -> None:
    config = _config({"name": "diloco"})
    with pytest.raises(PlanError, match="numel"):
        plan(config.training, numel=0, sites=[SiteConfig()], step_time_s=0.1)
    with pytest.raises(PlanError, match="step time"):
        plan(config.training, numel=10, sites=[SiteConfig()], step_time_s=-1)
    secure = SimulatorConfig.from_dict({
        "algorithm": {"name": "diloco"}, "privacy": {"secure_aggregation": True, "clip_norm": 1.0},
        "sites": SITES,
    })
    adaptive = dataclasses.replace(
        secure.training.algorithm, adaptive_uplink=dataclasses.replace(
            secure.training.algorithm.adaptive_uplink, enabled=True
        ),
    )
    with pytest.raises(PlanError, match="adaptive_uplink"):
        plan(dataclasses.replace(secure.training, algorithm=adaptive), numel=10, sites=secure.sites, step_time_s=0.1)
    tiers = _config({"name": "diloco", "inner_steps": 4}, None, TWO_REGIONS).tier_clock()
    with pytest.raises(PlanError, match="stage by stage"):
        plan(secure.training, numel=10, sites=secure.sites, step_time_s=0.1, tiers=tiers)
    asynchronous = SimulatorConfig.from_dict({
        "algorithm": {"name": "diloco", "asynchronous": {"enabled": True}}, "sites": SITES,
    })
    with pytest.raises(PlanError, match="geoloco simulate"):
        plan(asynchronous.training, numel=10, sites=asynchronous.sites, step_time_s=0.1)

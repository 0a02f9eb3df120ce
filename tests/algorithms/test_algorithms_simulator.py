"""The single-process simulator: records, determinism, clock wiring, stragglers, warm-up, stopping."""

from __future__ import annotations

import json

import pytest
import torch

from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.simulation.clock import transfer_time
from geoloco.algorithms.simulation.simulator import Simulator, SimulatorConfig, simulate
from geoloco.compression import parse_codec


def _config(**sections) -> SimulatorConfig:
    base = {
        "algorithm": {"inner_steps": 4, "uplink_codec": "int8", "downlink_codec": "none"},
        "inner_optimizer": {"lr": 0.02},
        "sites": {"count": 3},
        "simulation": {"rounds": 4, "eval_every": 2, "device": "cpu", "step_time_s": 0.1},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values} if isinstance(values, dict) else values
    return SimulatorConfig.from_dict(base)


def test_records_have_every_field_and_are_json(make_workload) -> None:
    workload = make_workload(hidden=8)
    records = list(simulate(_config(), workload))
    assert [r.round for r in records] == [0, 1, 2, 3]
    assert [r.eval_loss is not None for r in records] == [False, True, False, True]
    last = records[-1].to_dict()
    json.dumps(last)
    for key in ("train_loss", "eval_loss", "bytes_up", "bytes_down", "bytes_up_total",
                "bytes_down_total", "wall_clock_s", "utilization", "compute_s", "weights_digest",
                "participants", "excluded", "folded_late"):
        assert key in last
    assert list(last["bytes_up"]) == ["0", "1", "2"] and len(last["utilization"]) == 3
    assert records[-1].bytes_up_total == sum(sum(r.bytes_up.values()) for r in records)
    assert all(0 < u <= 1 for r in records for u in r.utilization.values())
    initial = workload.eval_loss(workload.build_model(0))
    assert records[1].eval_loss < initial and records[-1].eval_loss < initial
    assert [r.wall_clock_s for r in records] == sorted(r.wall_clock_s for r in records)


def test_two_runs_are_identical(make_workload) -> None:
    config = _config(
        algorithm={"uplink_codec": "randk:0.3|int4:block=16,stochastic", "downlink_codec": "int8"},
        sites=[{"speed_factor": 1.0}, {"speed_factor": 1 / 3}, {}],
        simulation={"round_deadline_s": 1.5},
    )
    a, b = Simulator(config, make_workload(hidden=8)), Simulator(config, make_workload(hidden=8))
    ra = [r.to_dict() for r in a.run()]
    rb = [r.to_dict() for r in b.run()]
    assert ra == rb
    assert torch.equal(a.global_flat, b.global_flat)
    assert len({r["weights_digest"] for r in ra}) == len(ra), "weights must change every round"
    other = _config(
        algorithm={"uplink_codec": "randk:0.3|int4:block=16,stochastic", "downlink_codec": "int8"},
        sites=[{"speed_factor": 1.0}, {"speed_factor": 1 / 3}, {}],
        simulation={"round_deadline_s": 1.5, "seed": 1},
    )
    other_records = [r.to_dict() for r in simulate(other, make_workload(hidden=8))]
    assert other_records[-1]["weights_digest"] != ra[-1]["weights_digest"]


def test_clock_matches_hand_formula(make_workload) -> None:
    """Two sites, H=4 steps of 0.25 s, lossless codecs: round 1 ends at compute + up + down."""
    sites = [
        {"uplink_bps": 1e6, "downlink_bps": 2e6, "latency_s": 0.1},
        {"uplink_bps": 5e5, "downlink_bps": 2e6, "latency_s": 0.2, "speed_factor": 0.5},
    ]
    config = _config(algorithm={"uplink_codec": "none"}, sites=sites,
                     simulation={"rounds": 2, "step_time_s": 0.25})
    workload = make_workload()
    records = list(simulate(config, workload))
    numel = sum(p.numel() for p in workload.build_model(0).parameters())
    nbytes = parse_codec("none").encode(torch.zeros(numel)).nbytes
    assert records[0].bytes_up == {"0": nbytes, "1": nbytes} and records[0].bytes_down == {"0": nbytes, "1": nbytes}
    a0 = 1.0 + transfer_time(nbytes, 1e6, 0.1)
    a1 = 2.0 + transfer_time(nbytes, 5e5, 0.2)
    r0 = max(a0, a1) + transfer_time(nbytes, 2e6, 0.1)
    r1 = max(a0, a1) + transfer_time(nbytes, 2e6, 0.2)
    assert records[0].wall_clock_s == pytest.approx(max(r0, r1))
    assert list(records[0].compute_s.values()) == pytest.approx([1.0, 2.0])
    assert list(records[0].utilization.values()) == pytest.approx([1.0 / r0, 2.0 / r1])
    # Round 2: each site starts from its own download end; aggregation waits for the later one.
    a0b, a1b = r0 + 1.0 + transfer_time(nbytes, 1e6, 0.1), r1 + 2.0 + transfer_time(nbytes, 5e5, 0.2)
    end2 = max(a0b, a1b) + transfer_time(nbytes, 2e6, 0.2)
    assert records[1].wall_clock_s == pytest.approx(end2)
    assert records[1].round_time_s == pytest.approx(end2 - max(r0, r1))


def test_deadline_leaves_out_the_straggler_and_keeps_its_update(make_workload) -> None:
    config = _config(
        sites=[{}, {}, {"speed_factor": 0.1}],
        simulation={"round_deadline_s": 2.0, "rounds": 2},
    )
    sim = Simulator(config, make_workload(hidden=8))
    records = list(sim.run())
    assert records[0].excluded == ["2"] and records[0].participants == ["0", "1"]
    assert records[0].bytes_up["2"] > 0, "a straggler's upload was still sent"
    # Its residual now holds its whole (unsent) update, far larger than an int8 rounding error.
    straggler = sim.sites[2].uplink.encoders[0].residual.abs().max()
    on_time = sim.sites[0].uplink.encoders[0].residual.abs().max()
    assert straggler > 10 * on_time


def test_warmup_is_round_zero_and_counts_ddp_bytes(make_workload) -> None:
    config = _config(algorithm={"warmup_steps": 3}, simulation={"rounds": 1})
    workload = make_workload(hidden=8)
    sim = Simulator(config, workload)
    records = list(sim.run())
    assert [(r.round, r.phase) for r in records] == [(-1, "warmup"), (0, "train")]
    warm = records[0]
    grad_bytes = parse_codec("none").encode(torch.zeros(sim.layout.numel)).nbytes
    assert list(warm.bytes_up.values()) == [3 * grad_bytes] * 3
    assert list(warm.bytes_down.values()) == [3 * grad_bytes] * 3
    assert warm.eval_loss is not None and set(warm.inner_steps.values()) == {3}
    # Every site's AdamW continues from the warm-up's shared state (3 warm-up + 4 inner steps).
    for site in sim.sites:
        steps = {float(s["step"]) for s in site.optimizer.state.values()}
        assert steps == {7.0}


def test_stops_at_target_eval_loss(make_workload) -> None:
    config = _config(simulation={"rounds": 50, "eval_every": 1, "target_eval_loss": 1e9})
    records = list(simulate(config, make_workload()))
    assert len(records) == 1 and records[0].eval_loss is not None


def test_samples_weighting_runs_and_fedopt_runs(make_workload) -> None:
    for algorithm in ({"weighting": "samples"}, {"name": "fedopt"}, {"name": "fedavg"}):
        records = list(simulate(_config(algorithm=algorithm, simulation={"rounds": 2}), make_workload()))
        assert records[-1].eval_loss is not None and len(records[-1].participants) == 3


def test_measured_step_time_advances_the_clock(make_workload) -> None:
    config = _config(simulation={"rounds": 1, "step_time_s": "measure"})
    (record,) = simulate(config, make_workload())
    assert all(c > 0 for c in record.compute_s.values())


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"simulation": {"rounds": 0}}, "simulation.rounds"),
        ({"simulation": {"device": "tpu"}}, "simulation.device"),
        ({"simulation": {"step_time_s": "fast"}}, "simulation.step_time_s"),
        ({"simulation": {"min_sites": 9}}, "simulation.min_sites"),
        ({"simulation": {"bogus": 1}}, "simulation.bogus"),
        ({"sites": {"count": 0}}, "sites.count"),
        ({"sites": {"count": 2, "latency": 1}}, "sites.latency"),
        ({"sites": [{}, {"uplink_bps": -1}]}, "sites[1].uplink_bps"),
        ({"sites": "four"}, "sites"),
        ({"algorithm": {"name": "ddp"}, "simulation": {"round_deadline_s": 1.0}}, "simulation.round_deadline_s"),
        ({"inner_optimizer": {"grad_clip_norm": 0}}, "inner_optimizer.grad_clip_norm"),
        ({"workload": {"name": "gpt"}}, "workload"),
    ],
)
def test_simulator_config_errors_name_the_key(data, key) -> None:
    with pytest.raises(ConfigError) as info:
        SimulatorConfig.from_dict(data)
    assert info.value.key == key


def test_config_to_dict_roundtrips() -> None:
    config = _config(sites=[{"name": "eu"}, {"speed_factor": 0.5}])
    again = SimulatorConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config

"""The simulator runs the same privacy math: secure aggregation matches plain training, DP is accounted."""

from __future__ import annotations

import pytest

from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.simulation.simulator import SimulatorConfig, simulate
from geoloco.scenarios.workloads.mlp import MLPWorkload


def _config(privacy: dict | None, rounds: int = 3, **algorithm: object) -> SimulatorConfig:
    data = {
        "algorithm": {"inner_steps": 4, **algorithm},
        "sites": {"count": 4},
        "simulation": {"rounds": rounds, "eval_every": rounds, "device": "cpu", "step_time_s": 0.01},
    }
    if privacy is not None:
        data["privacy"] = privacy
    return SimulatorConfig.from_dict(data)


def test_secure_aggregation_in_the_simulator_matches_plain_training() -> None:
    plain = list(simulate(_config(None), MLPWorkload()))
    secure = list(simulate(_config({"secure_aggregation": True, "clip_norm": 100.0}), MLPWorkload()))
    assert secure[-1].eval_loss == pytest.approx(plain[-1].eval_loss, abs=1e-4)
    assert secure[-1].epsilon is None
    # Masked values at 4 bytes each, plus key agreement: a bit more than the fp32 upload.
    assert plain[-1].bytes_up["0"] < secure[-1].bytes_up["0"] < plain[-1].bytes_up["0"] + 4096


def test_distributed_dp_reports_epsilon_and_stops_at_the_budget() -> None:
    privacy = {"secure_aggregation": True, "dp": "distributed", "clip_norm": 1.0,
               "noise_multiplier": 1.0, "delta": 1e-5}
    records = list(simulate(_config(privacy, rounds=3), MLPWorkload()))
    eps = [r.epsilon for r in records]
    assert all(e is not None for e in eps) and eps[0] < eps[1] < eps[2]
    budget = (eps[1] + eps[2]) / 2
    capped = list(simulate(_config({**privacy, "epsilon_budget": budget}, rounds=3), MLPWorkload()))
    assert len(capped) == 2 and capped[-1].epsilon <= budget


def test_central_dp_with_any_codec_and_randk_with_secure_aggregation() -> None:
    central = list(simulate(_config({"dp": "central", "clip_norm": 1.0}, rounds=2, uplink_codec="topk:0.1"),
                            MLPWorkload()))
    assert central[-1].epsilon > 0
    secure = list(simulate(_config({"secure_aggregation": True, "clip_norm": 10.0}, rounds=2,
                                   uplink_codec="randk:0.5"), MLPWorkload()))
    assert secure[-1].eval_loss is not None


def test_simulator_rejects_topk_and_ddp_with_secure_aggregation() -> None:
    with pytest.raises(ConfigError, match="algorithm.uplink_codec.*randk"):
        _config({"secure_aggregation": True, "clip_norm": 1.0}, uplink_codec="topk:0.01")
    with pytest.raises(ConfigError, match="privacy"):
        _config({"secure_aggregation": True, "clip_norm": 1.0}, name="ddp")


@pytest.mark.parametrize("error_feedback", [True, False])
def test_an_aborted_secure_round_gives_the_masked_updates_back_to_the_residuals(error_feedback: bool) -> None:
    """A secure round the update guard aborts after the sum (site 1 scales its update so the
    mean pushes a weight beyond max_abs_weight): with error feedback every site's update goes
    back into its residual whole, as the real masked site restores an update its round did not
    sum; the simulator used to keep only what the fixed-point encoding lost."""
    from geoloco.algorithms.simulation.simulator import Simulator
    from geoloco.scenarios.workloads import build_workload

    config = SimulatorConfig.from_dict({
        "algorithm": {
            "inner_steps": 3, "weighting": "uniform", "uplink_codec": "none", "error_feedback": error_feedback,
        },
        "sites": [{}, {"attack": "scale:100000"}, {}],
        "run": {"rounds": 1, "eval_every": 10},
        "simulation": {"device": "cpu"},
        "update_guard": {"max_abs_weight": 2.0},
        "privacy": {"secure_aggregation": True, "clip_norm": 100000.0},
    })
    simulator = Simulator(config, build_workload("mlp"))
    (record,) = list(simulator.run())
    assert record.aborted is not None and "max_abs_weight" in record.aborted
    for site in ("0", "2"):
        residual = simulator.uplinks.inner.encoders[0][site].residual  # type: ignore[attr-defined]
        if error_feedback:
            assert residual is not None and float(residual.norm()) > 0.02  # the whole update (~0.1)
        else:
            assert residual is None

"""The adaptive uplink codec on the simulator's virtual clock: the same rule as the coordinator,
measured on the simulated transfers."""

from __future__ import annotations

import math

import pytest

from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.simulation.simulator import Simulator, SimulatorConfig

SLOW_BPS, FAST_BPS = 1e6, 1e7


def _config(adaptive: bool) -> SimulatorConfig:
    link = {"downlink_bps": FAST_BPS, "latency_s": 0.0}
    return SimulatorConfig.from_dict({
        "algorithm": {
            "inner_steps": 2, "uplink_codec": "int8", "downlink_codec": "none",
            "adaptive_uplink": {"enabled": adaptive, "min_density": 0.01},
        },
        "inner_optimizer": {"lr": 0.02},
        "sites": [{"uplink_bps": SLOW_BPS, **link}] + [{"uplink_bps": FAST_BPS, **link}] * 3,
        "simulation": {"rounds": 4, "eval_every": 4, "device": "cpu", "step_time_s": 0.1},
    })


def _upload_s(record, site: str, bps: float) -> float:
    return 8 * record.bytes_up[site] / bps


def test_slow_link_gets_a_sparser_codec_and_about_the_fast_sites_upload_time(make_workload) -> None:
    records = list(Simulator(_config(adaptive=True), make_workload(hidden=2048)).run())
    first, *later = records
    assert len(set(first.bytes_up.values())) == 1  # nothing measured yet: int8 for everyone
    for record in later:
        assert record.bytes_up["1"] == record.bytes_up["2"] == record.bytes_up["3"]
        assert record.bytes_up["0"] * 5 < record.bytes_up["1"]
        slow, fast = _upload_s(record, "0", SLOW_BPS), _upload_s(record, "1", FAST_BPS)
        assert slow <= 1.5 * fast, (slow, fast)
    assert all(r.eval_loss is None or math.isfinite(r.eval_loss) for r in records)


def test_without_adaptive_uplink_every_site_sends_the_same_bytes(make_workload) -> None:
    records = list(Simulator(_config(adaptive=False), make_workload(hidden=2048)).run())
    assert all(len(set(r.bytes_up.values())) == 1 for r in records)
    assert _upload_s(records[-1], "0", SLOW_BPS) > 5 * _upload_s(records[-1], "1", FAST_BPS)


def test_a_rejected_upload_measures_no_link(make_workload) -> None:
    """The coordinator measures only uploads it verified and admitted; so does the simulator. A
    slow site whose (poisoned) update the guard rejects every round is never measured, so it
    keeps the run's codec where, measured, it would have been given a sparse one."""
    data = _config(adaptive=True).to_dict()
    data["sites"][0]["attack"] = "scale:1e9"
    records = list(Simulator(SimulatorConfig.from_dict(data), make_workload(hidden=2048)).run())
    first = records[0]
    for record in records:
        assert "0" in record.rejected, record.rejected
        assert record.bytes_up["0"] == first.bytes_up["0"] == record.bytes_up["1"]


def test_adaptive_uplink_with_secure_aggregation_is_refused(make_workload) -> None:
    data = _config(adaptive=True).to_dict()
    data["privacy"] = {"secure_aggregation": True, "clip_norm": 1.0}
    data["algorithm"]["uplink_codec"] = "none"
    with pytest.raises(ConfigError, match="adaptive_uplink.enabled.*secure"):
        Simulator(SimulatorConfig.from_dict(data), make_workload(hidden=4))

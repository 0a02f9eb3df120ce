"""Golden regression: a handful of small fixed runs must reproduce committed numbers exactly.

The fixture pins the round's behaviour through refactors of the round core: eval losses, bytes
moved per site, who was aggregated, excluded or folded, the deadline in force, the virtual clock,
epsilon and the weights digest of every round. Any change to those numbers is a change of
behaviour and must be deliberate: regenerate with ``GEOLOCO_REGENERATE_GOLDEN=1 pytest
tests/algorithms/test_golden_rounds.py`` and say why in the commit.

Records are reduced to one canonical set of keys (``_canonical``) so that renaming a record field
does not invalidate the numbers; only the reduction changes then.

Bit-for-bit holds only on the CPU model the fixture was recorded on: torch picks its vectorised
kernels by the CPU's instruction set (AVX2, AVX512, ...), and even two CPUs with the same label
(AVX512 with and without its FP16/BF16 extensions) round float sums differently (about 1e-7
relative over these runs). The fixture names the CPU model, the kernel set and the torch version it
was recorded with; where any differs, every count, name and byte must still match exactly,
losses, clock and epsilon agree to 1e-5 relative, and the weights digest (which no tolerance can
compare) is left out. Bit equality between two computations of one machine (the real system
against the simulator) is tested elsewhere and does not depend on this file.
"""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path
from typing import Any

import pytest
import torch

from geoloco.algorithms.config import config_from_dict
from geoloco.algorithms.simulation.simulator import Simulator, SimulatorConfig
from geoloco.scenarios.workloads import build_workload

GOLDEN = Path(__file__).parent / "golden" / "rounds.json"
REGENERATE = os.environ.get("GEOLOCO_REGENERATE_GOLDEN") == "1"
RECORDED_ON = "_recorded_on"
"""Fixture key naming the machine the numbers were recorded on (not a case)."""
CROSS_MACHINE_RTOL = 1e-5

_BASE: dict[str, Any] = {
    "inner_optimizer": {"lr": 3e-3},
    "simulation": {"rounds": 4, "eval_every": 1, "seed": 3, "device": "cpu", "step_time_s": 0.1},
}

CASES: dict[str, dict[str, Any]] = {
    "plain": {"algorithm": {"inner_steps": 4}},
    "int8_error_feedback": {
        "algorithm": {"inner_steps": 4, "uplink_codec": "int8", "downlink_codec": "int8"},
    },
    "randk_stochastic": {
        "algorithm": {"inner_steps": 3, "uplink_codec": "randk:0.25|int4:stochastic"},
    },
    "streaming_p2": {
        "algorithm": {
            "inner_steps": 4,
            "uplink_codec": "int8",
            "streaming": {"enabled": True, "fragments": 2, "overlap_steps": 1},
        },
    },
    "adaptive_deadline_slow_site": {
        "algorithm": {"inner_steps": 4, "late_updates": "fold"},
        "slow_site": 3.0,
        "simulation": {
            "round_deadline_s": 0.6,
            "min_sites": 2,
            "adaptive_deadline": {"enabled": True, "window": 3, "min_s": 0.2, "margin": 1.2},
        },
    },
    "secure": {
        "algorithm": {"inner_steps": 3, "uplink_codec": "randk:0.5"},
        "privacy": {"secure_aggregation": True, "clip_norm": 1.0},
    },
    "secure_dp": {
        "algorithm": {"inner_steps": 3, "uplink_codec": "randk:0.5"},
        "privacy": {
            "secure_aggregation": True,
            "clip_norm": 1.0,
            "dp": "distributed",
            "noise_multiplier": 0.5,
        },
    },
    "central_dp": {
        "algorithm": {"inner_steps": 3},
        "privacy": {"clip_norm": 1.0, "dp": "central", "noise_multiplier": 0.5},
    },
}


NOISY = {"secure", "secure_dp", "central_dp"}
"""DP noise and secure aggregation's stochastic rounding draw from the OS CSPRNG by design (they
must be unpredictable), so these cases pin only what that randomness cannot change: bytes,
participants, clock, epsilon, fragments."""
NOISE_DEPENDENT = ("eval_loss", "train_loss", "weights_digest")


def _config(case: dict[str, Any]) -> SimulatorConfig:
    data = json.loads(json.dumps(_BASE))
    case = dict(case)
    slow = case.pop("slow_site", None)
    for section, values in case.items():
        data.setdefault(section, {}).update(values)
    sites = [{"latency_s": 0.01, "uplink_bps": 2e6, "downlink_bps": 4e6} for _ in range(3)]
    if slow is not None:
        sites[-1]["speed_factor"] = 1 / slow
    data["sites"] = sites
    return config_from_dict(SimulatorConfig, data)


def _rounded(value: float | None) -> float | None:
    """Floats as their exact repr survive JSON; NaN never appears in a healthy run."""
    if value is None:
        return None
    assert math.isfinite(value)
    return float(value)


def _canonical(record: Any) -> dict[str, Any]:
    """The facts of one round, under one set of names (independent of record field names)."""
    d = record.to_dict()
    return {
        "round": d["round"] + 1,  # recorded when the simulator numbered rounds from 1
        "eval_loss": _rounded(d["eval_loss"]),
        "train_loss": _rounded(d["train_loss"]),
        "participants": len(d["participants"]),
        "excluded": d["excluded"],
        "folded_late": sorted(d["folded_late"]),
        "bytes_up": list(d["bytes_up"].values()),  # in site order
        "bytes_down": list(d["bytes_down"].values()),
        "deadline_s": _rounded(d["deadline_s"]),
        "wall_clock_s": _rounded(d["wall_clock_s"]),
        "epsilon": _rounded(d["epsilon"]),
        "fragment": d["fragment"],
        "weights_digest": d["weights_digest"],
    }


def _run(name: str) -> list[dict[str, Any]]:
    workload = build_workload("mlp")
    simulator = Simulator(_config(CASES[name]), workload)
    records = [_canonical(r) for r in simulator.run()]
    if name in NOISY:
        for record in records:
            for key in NOISE_DEPENDENT:
                record[key] = None
    return records


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    if REGENERATE:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        data: dict[str, Any] = {name: _run(name) for name in CASES}
        data[RECORDED_ON] = _machine()
        GOLDEN.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        return data
    return json.loads(GOLDEN.read_text())


def _machine() -> dict[str, str]:
    return {
        "cpu_model": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__.split("+")[0],
    }


def _cpu_model() -> str:
    """The CPU's model name (Linux), else what the platform says: the same ISA label is not
    enough to round alike."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _within_tolerance(got: dict[str, Any], expected: dict[str, Any]) -> dict[str, Any]:
    """``got`` with the floats that agree with ``expected`` to ``CROSS_MACHINE_RTOL`` replaced by
    the expected values and the digest taken from ``expected``: what is left to differ differs."""
    out = dict(got)
    for key, value in got.items():
        want = expected.get(key)
        both_floats = isinstance(value, float) and isinstance(want, float)
        if both_floats and math.isclose(value, want, rel_tol=CROSS_MACHINE_RTOL):
            out[key] = want
    out["weights_digest"] = expected.get("weights_digest")
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_round_reproduces_golden(golden: dict[str, Any], name: str) -> None:
    assert name in golden, f"no golden record for {name!r}; regenerate with GEOLOCO_REGENERATE_GOLDEN=1"
    got = _run(name)
    expected = golden[name]
    assert len(got) == len(expected)
    exact = golden.get(RECORDED_ON) == _machine()
    for g, e in zip(got, expected, strict=True):
        if not exact:
            g = _within_tolerance(g, e)
        assert g == e, f"{name} round {e['round']} differs from the golden record (bitwise: {exact})"


def test_tolerance_still_sees_a_changed_loss() -> None:
    record = {"eval_loss": 2.0, "bytes_up": [10], "weights_digest": "a"}
    assert _within_tolerance({**record, "eval_loss": 2.0 * (1 + 1e-6), "weights_digest": "b"}, record) == record
    assert _within_tolerance({**record, "eval_loss": 2.0 * (1 + 1e-4)}, record) != record
    assert _within_tolerance({**record, "bytes_up": [11]}, record) != record


def test_golden_cases_exercise_their_feature(golden: dict[str, Any]) -> None:
    """The fixture is only worth something if each case really hits its feature."""
    deadline = golden["adaptive_deadline_slow_site"]
    assert any(r["excluded"] for r in deadline), "the slow site was never excluded"
    assert any(r["folded_late"] for r in deadline), "no late update was folded"
    assert len({r["deadline_s"] for r in deadline}) > 1, "the adaptive deadline never moved"
    assert {r["fragment"] for r in golden["streaming_p2"]} == {0, 1}
    assert all(r["epsilon"] is not None for r in golden["secure_dp"])
    assert all(r["epsilon"] is not None for r in golden["central_dp"])
    assert golden["int8_error_feedback"][0]["bytes_up"][0] < golden["plain"][0]["bytes_up"][0]

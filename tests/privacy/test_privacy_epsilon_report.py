"""Reports that print epsilon say when it means no privacy, and sweep tables show epsilon."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from geoloco.algorithms.privacy.dp_accountant import MEANINGFUL_EPSILON, describe_epsilon
from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
from geoloco.scenarios.cli import main
from geoloco.scenarios.report import _privacy_lines
from geoloco.scenarios.sweep import sweep

FLAG = "no meaningful privacy"

CENTRAL_DP: dict[str, Any] = {
    "workload": {"name": "mlp", "batch_size": 8, "hidden_dim": 8, "eval_size": 64},
    "algorithm": {"name": "diloco", "inner_steps": 2},
    "sites": {"count": 3},
    "simulation": {"rounds": 2, "eval_every": 1, "device": "cpu"},
    "privacy": {"dp": "central", "clip_norm": 1.0, "noise_multiplier": 0.05},
}


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_epsilon_above_ten_is_flagged_and_below_is_not() -> None:
    assert FLAG in describe_epsilon(6.6e4, 1e-5)
    assert FLAG in describe_epsilon(MEANINGFUL_EPSILON + 0.01, 1e-5)
    assert FLAG not in describe_epsilon(MEANINGFUL_EPSILON, 1e-5)
    assert describe_epsilon(7.5, 1e-5) == "epsilon = 7.5 at delta = 1e-05"


@pytest.mark.parametrize(("epsilon", "flagged"), [(6.6e4, True), (3.2, False)])
def test_emulation_summary_flags_a_demonstration_epsilon(epsilon: float, flagged: bool) -> None:
    privacy = PrivacyConfig(secure_aggregation=True, clip_norm=2.0, dp="distributed", noise_multiplier=0.01)
    records = [{"round": 0, "epsilon": epsilon, "privacy": {}}]
    result = SimpleNamespace(scenario=SimpleNamespace(privacy=privacy), records=records)
    (line,) = _privacy_lines(result)  # type: ignore[arg-type]
    assert f"epsilon = {epsilon:.4g}" in line
    assert (FLAG in line) is flagged


def test_simulate_summary_prints_epsilon_with_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "dp.toml"
    config.write_text(
        "[workload]\nname = \"mlp\"\nbatch_size = 8\nhidden_dim = 8\neval_size = 64\n"
        "[algorithm]\ninner_steps = 2\n[sites]\ncount = 3\n"
        "[simulation]\nrounds = 2\neval_every = 1\ndevice = \"cpu\"\n"
        "[privacy]\ndp = \"central\"\nclip_norm = 1.0\nnoise_multiplier = 0.05\n"
    )
    assert main(["simulate", "--config", str(config), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.strip().startswith("privacy")]
    assert "epsilon = " in line and FLAG in line


def test_sweep_table_has_an_epsilon_column_only_with_dp(tmp_path: Path) -> None:
    private = sweep(CENTRAL_DP, grid={"privacy.noise_multiplier": [0.05, 5.0]}, out=tmp_path / "dp", plots=False)
    header, _, *rows = private.table().splitlines()
    assert header.rstrip(" |").endswith("epsilon")
    epsilons = [float(row.strip(" |").split(" | ")[-1]) for row in rows]
    assert epsilons[0] > MEANINGFUL_EPSILON > epsilons[1] > 0
    plain = {**CENTRAL_DP, "privacy": {}}
    assert "epsilon" not in sweep(plain, out=tmp_path / "plain", plots=False).table()


def test_coordinator_privacy_summary_keeps_its_fields_and_flags_a_large_epsilon() -> None:
    from geoloco.scenarios.coordinator_cmd import privacy_summary_line

    demo = privacy_summary_line({"epsilon": 6.6e4, "privacy_delta": 1e-5, "round": 11})
    assert demo.startswith("geoloco-coordinator privacy summary: epsilon=66000 delta=1e-05 rounds=12")
    assert FLAG in demo
    assert FLAG not in privacy_summary_line({"epsilon": 7.5, "privacy_delta": 1e-5, "round": 4})

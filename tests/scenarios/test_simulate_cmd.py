"""``geoloco simulate`` end to end (real subprocess) and its config errors."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from geoloco.scenarios.cli import main
from geoloco.scenarios.simulate_cmd import EXAMPLE_CONFIG, load_config

GEOLOCO = [sys.executable, "-m", "geoloco.scenarios.cli"]

MLP_CONFIG = """
[workload]
name = "mlp"
batch_size = 16

[algorithm]
name = "diloco"
inner_steps = 5
uplink_codec = "int8"

[inner_optimizer]
lr = 0.01

[sites]
count = 3
uplink_bps = 1e7
latency_s = 0.02

[simulation]
rounds = 4
eval_every = 2
device = "cpu"
"""


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    # Generous timeout: importing torch in a fresh process is slow on a loaded 2-core machine.
    return subprocess.run([*GEOLOCO, "simulate", *args], capture_output=True, text=True, timeout=timeout)


def test_simulate_writes_metrics_config_and_summary(tmp_path: Path) -> None:
    config = tmp_path / "sim.toml"
    config.write_text(MLP_CONFIG)
    out = tmp_path / "out"
    proc = _run("--config", str(config), "--out", str(out), "--rounds", "3", "--seed", "7")
    assert proc.returncode == 0, proc.stderr
    lines = (out / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["round"] for r in records] == [0, 1, 2]
    assert records[-1]["eval_loss"] is not None and len(records[-1]["bytes_up"]) == 3
    assert records[-1]["bytes_up_total"] > 0 and records[-1]["wall_clock_s"] > 0
    resolved = json.loads((out / "config.json").read_text())
    assert resolved["simulation"]["rounds"] == 3 and resolved["simulation"]["seed"] == 7
    assert resolved["outer_optimizer"]["name"] == "nesterov" and resolved["outer_optimizer"]["lr"] == 0.7
    assert resolved["workload"]["name"] == "mlp" and resolved["workload"]["batch_size"] == 16
    assert len(resolved["sites"]) == 3 and resolved["sites"][0]["uplink_bps"] == 1e7
    assert "final eval loss" in proc.stdout and "virtual wall-clock" in proc.stdout
    assert f"{records[-1]['eval_loss']:.4f}" in proc.stdout


def test_bad_config_subprocess_exits_2_without_traceback(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(MLP_CONFIG.replace("inner_steps = 5", "inner_stepz = 5"))
    proc = _run("--config", str(config), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert str(config) in proc.stderr and "algorithm.inner_stepz" in proc.stderr
    assert "allowed keys" in proc.stderr and "inner_steps" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("replace", "key", "allowed"),
    [
        (('uplink_codec = "int8"', "uplink_codec = 8"), "algorithm.uplink_codec", "expected a string"),
        (('uplink_codec = "int8"', 'uplink_codec = "int9"'), "algorithm.uplink_codec", "accepted codecs"),
        (("count = 3", "count = -1"), "sites.count", "integer >= 1"),
        (('name = "diloco"', 'name = "diloko"'), "algorithm.name", "valid names"),
        (("rounds = 4", "rounds = 4.5"), "simulation.rounds", "expected an integer"),
        (("batch_size = 16", "batchsize = 16"), "workload", "allowed options"),
        (('name = "mlp"', 'name = "resnet"'), "workload.name", "allowed values: gpt, mlp"),
        (("[sites]", "[sitez]"), "sitez", "unknown section"),
        (("rounds = 4", "rounds = = 4"), "", "not valid TOML"),
    ],
)
def test_bad_config_exits_2_naming_file_and_key(tmp_path: Path, capsys, replace, key, allowed) -> None:
    """The same CLI entry point in-process (a subprocess per case would mostly time torch's import)."""
    config = tmp_path / "bad.toml"
    config.write_text(MLP_CONFIG.replace(*replace))
    assert main(["simulate", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{config}: {key}" in err and allowed in err
    assert not (tmp_path / "out").exists()


def _args(**kwargs) -> argparse.Namespace:
    base = dict(config=None, workload=None, rounds=None, sites=None, seed=None, device=None, out=None)
    return argparse.Namespace(**{**base, **kwargs})


def test_shipped_example_config_is_valid_and_documented() -> None:
    workload, config = load_config(_args(config=EXAMPLE_CONFIG))
    assert workload.name == "gpt" and workload.options["size"] == "small"
    assert config.algorithm.name == "diloco" and config.algorithm.uplink_codec == "int8"
    assert len(config.sites) == 4
    # Every group of key lines starts right after a comment line (a comment per key or key group).
    lines = [line.strip() for line in EXAMPLE_CONFIG.read_text().splitlines()]
    for i, line in enumerate(lines):
        if line and not line.startswith(("#", "[")):
            assert lines[i - 1].startswith("#") or lines[i - 1].startswith(tuple("abcdefghijklmnopqrstuvwxyz")), line


def test_flags_override_the_file(tmp_path: Path) -> None:
    config = tmp_path / "sim.toml"
    config.write_text(MLP_CONFIG)
    workload, cfg = load_config(_args(config=config, sites=5, rounds=9, workload="gpt"))
    assert workload.name == "gpt" and workload.options == {} and len(cfg.sites) == 5 and cfg.simulation.rounds == 9
    assert cfg.sites[0].uplink_bps == 1e7


def test_sites_flag_cannot_resize_an_explicit_list(tmp_path: Path) -> None:
    config = tmp_path / "sim.toml"
    config.write_text('[[sites]]\nlatency_s = 0.1\n[[sites]]\nlatency_s = 0.2\n')
    from geoloco.scenarios.config_file import ConfigFileError

    with pytest.raises(ConfigFileError, match="cannot resize an explicit"):
        load_config(_args(config=config, sites=3))
    with pytest.raises(ConfigFileError, match="unknown section; allowed: workload"):
        config.write_text("[simulaton]\nrounds = 1\n")
        load_config(_args(config=config))

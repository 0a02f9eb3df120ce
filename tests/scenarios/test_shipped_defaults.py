"""One source of defaults: a shipped simulator config sets a key to a value other than the
built-in default only where ``DELIBERATE`` lists that key with its reason.

Without this a config written from scratch and one copied from an example silently train
different baselines (issue 16, item 4). A new difference fails here until it is either removed
(the example follows the default) or listed below with why the example needs it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import tomllib

from geoloco.algorithms.algorithm_config import DEFAULT_OUTER_OPTIMIZERS
from geoloco.algorithms.simulation.clock import SiteConfig
from geoloco.algorithms.simulation.sim_config import SimulatorConfig
from geoloco.scenarios.config_kinds import SIMULATE, detect_config_kind
from geoloco.scenarios.workloads import DEFAULT_WORKLOAD, workload_config

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"
DEFAULT_SITE_COUNT = 4
"""Sites of a ``[sites]`` table without ``count`` (``SimulatorConfig.prepare_config_dict``)."""

RUN_LENGTH = "the example's run length and evaluation points, not a training setting"
DELIBERATE: dict[str, dict[str, str]] = {
    "simulate.toml": {
        "algorithm.uplink_codec": "the example shows int8 + error feedback (same loss as 'none' at a "
        "quarter of the bytes, benchmarks/README.md sweep); the default stays the exact 'none' baseline, "
        "which the real system and the golden round fixtures also use",
        "inner_optimizer.lr": "3e-3 is tuned for the 0.5M-parameter GPT; the default 1e-3 is the safer "
        "AdamW rate for an unknown model, and the sites of the real system share it",
        "inner_optimizer.grad_clip_norm": "clipping suits the GPT; the default (no clipping) is what the "
        "golden round fixtures and the real system's tests record",
        "workload.seq_len": "64-byte windows halve the example's step time (default: the model's block size)",
        "run.rounds": RUN_LENGTH,
        "run.eval_every": RUN_LENGTH,
    },
    "sweep.toml": {
        "": "the README's recorded H x codec study (benchmarks/README.md): its settings are the "
        "study's, kept so the table can be reproduced",
    },
    "headline.toml": {
        "": "the headline table's base (benchmarks/bench_headline.py): the tiny GPT at a fixed "
        "number of inner steps, tuned inner optimizer, 100 Mbit/s links",
    },
    "uneven_links.toml": {
        "": "the adaptive uplink codec study (benchmarks/bench_uneven_links.py): one site behind "
        "10 Mbit/s and three on 1 Gbit/s are what it measures",
    },
    "async_chaos.toml": {
        "": "the failure study of benchmarks/bench_async.py (issue 28): asynchronous merges, Delayed "
        "Nesterov and a failure schedule on 32 MLP sites are what it measures",
    },
    "privacy_frontier.toml": {
        "": "the privacy-utility frontier study (benchmarks/bench_privacy_frontier.py): a tiny "
        "workload, many sites and [privacy] are what it measures",
    },
}
"""file -> dotted key (or prefix; ``""``: every key of a study file) -> why it differs."""


def simulator_configs() -> list[Path]:
    files = []
    for path in sorted(SCENARIOS.glob("*.toml")):
        if detect_config_kind(tomllib.loads(path.read_text())) == SIMULATE:
            files.append(path)
    return files


def _plain(value: Any) -> Any:
    """Tuples as lists, ints as floats where they compare equal: TOML and dataclass forms alike."""
    return json.loads(json.dumps(value))


def flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def defaults_for(raw: dict[str, Any]) -> dict[str, Any]:
    """The built-in value of every key a file may set (outer optimizer resolved for the file's
    algorithm, workload options for the file's workload)."""
    config = SimulatorConfig()
    data = config.to_file_dict()
    algorithm = raw.get("algorithm", {}).get("name", config.algorithm.name)
    outer = SimulatorConfig.from_dict({"algorithm": {"name": algorithm}}).outer_optimizer
    data["outer_optimizer"] = outer.resolved(DEFAULT_OUTER_OPTIMIZERS.get(algorithm, "nesterov")).to_dict()
    data["sites"] = {"count": DEFAULT_SITE_COUNT, **SiteConfig().to_dict()}
    workload = raw.get("workload", {}).get("name", DEFAULT_WORKLOAD)
    data["workload"] = {"name": DEFAULT_WORKLOAD, **dataclasses.asdict(workload_config(workload))}
    return flatten(_plain(data))


def differences(path: Path) -> dict[str, tuple[Any, Any]]:
    """dotted key -> (file's value, default) where they differ (``[[sites]]`` lists per site)."""
    raw = tomllib.loads(path.read_text())
    defaults = defaults_for(raw)
    sites = raw.pop("sites", None)
    found = flatten(_plain(raw))
    if isinstance(sites, list):
        for k, site in enumerate(sites):
            found.update({f"sites[{k}].{key}": v for key, v in _plain(site).items()})
    elif isinstance(sites, dict):
        found.update(flatten(_plain(sites), "sites."))
    out = {}
    for key, value in found.items():
        default_key = "sites." + key.split("].", 1)[1] if key.startswith("sites[") else key
        if default_key not in defaults:
            pytest.fail(f"{path.name}: {key} is not a simulator config key")
        if value != defaults[default_key]:
            out[key] = (value, defaults[default_key])
    return out


def _allowed(file: str, key: str) -> bool:
    return any(key == k or key.startswith(k + ".") or k == "" for k in DELIBERATE.get(file, {}))


def test_the_shipped_simulator_configs_are_found() -> None:
    names = {p.name for p in simulator_configs()}
    assert {"simulate.toml", "sweep.toml", "privacy_frontier.toml"} <= names
    assert not {"secure.toml", "quickstart.toml", "coordinator.toml"} & names


@pytest.mark.parametrize("path", simulator_configs(), ids=lambda p: p.name)
def test_a_shipped_config_differs_from_the_defaults_only_where_listed(path: Path) -> None:
    undocumented = {k: v for k, v in differences(path).items() if not _allowed(path.name, k)}
    assert not undocumented, (
        f"{path.name} sets keys to values other than the built-in defaults (file value, default): "
        f"{undocumented}; follow the default or list the key in DELIBERATE with its reason"
    )


@pytest.mark.parametrize("file", sorted(DELIBERATE), ids=str)
def test_every_listed_difference_still_exists(file: str) -> None:
    """The allow-list must not go stale: a listed key that now equals the default is removed."""
    found = differences(SCENARIOS / file)
    for key in DELIBERATE[file]:
        assert any(k == key or k.startswith(key + ".") or key == "" for k in found), (
            f"{file}: {key!r} is listed as a deliberate difference but equals the default now"
        )

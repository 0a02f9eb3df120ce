"""What the emulator tells its child processes: the coordinator's config file and each site's
command line, derived from a ``Scenario``.

Pure functions of the scenario and the run's paths (no processes, no sockets), so a test can check
that a scenario reaches the coordinator and the sites as intended. ``speed_factor`` of a
``[[sites]]`` table reaches a site here, as ``geoloco site --speed-factor``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from geoloco.scenarios.scenario import Scenario

__all__ = [
    "COORDINATOR_DRAIN_S",
    "SITE_BACKOFF_MAX_S",
    "coordinator_table",
    "geoloco_command",
    "site_command",
    "site_state_dir",
]

COORDINATOR_DRAIN_S = 10.0
"""The coordinator waits this long for sites to fetch the final broadcast before it exits."""

SITE_BACKOFF_MAX_S = 2.0
"""Longest pause between a site's reconnection attempts: short, so recoveries after a fault are
measured in the emulated faults' seconds rather than in backoff."""


def geoloco_command(*args: str) -> list[str]:
    """``python -m geoloco.scenarios.cli ARGS`` with this interpreter (no PATH lookup)."""
    return [sys.executable, "-m", "geoloco.scenarios.cli", *args]


def coordinator_table(
    scenario: Scenario, *, certs_dir: Path, checkpoint_dir: Path, metrics_path: Path
) -> dict[str, Any]:
    """The ``geoloco coordinator --config`` table for ``scenario`` (port 0, mutual TLS): the
    scenario's ``[run]`` keys under the coordinator file's ``[run]``, with the same names."""
    s = scenario
    run = s.run
    return {
        "run": {
            "rounds": run.rounds,
            "seed": run.seed,
            "min_sites": s.quorum,
            **({"round_deadline_s": run.round_deadline_s} if run.round_deadline_s is not None else {}),
            "adaptive_deadline": run.adaptive_deadline.to_dict(),
            "eval_every": run.eval_every,
            "heartbeat_interval_s": run.heartbeat_interval_s,
            "heartbeat_timeout_s": run.heartbeat_timeout_s,
        },
        "host": "127.0.0.1",
        "port": 0,
        "certs_dir": str(certs_dir.resolve()),
        "allowed_sites": [site.name for site in s.sites],
        "checkpoint_dir": str(checkpoint_dir.resolve()),
        "checkpoint_every": 1,
        "metrics_path": str(metrics_path.resolve()),
        "drain_timeout_s": COORDINATOR_DRAIN_S,
        "device": "cpu",
        "algorithm": s.algorithm.to_dict(),
        "inner_optimizer": s.inner_optimizer.to_dict(),
        "outer_optimizer": s.outer_optimizer.to_dict(),
        "workload": s.workload.to_table(),
        "http": {"enabled": True, "host": "127.0.0.1", "port": 0},
        **({"privacy": s.privacy.to_dict()} if s.privacy.enabled else {}),
        **({"relays": {r.name: list(r.sites) for r in s.regions}} if s.regions else {}),
    }


def site_state_dir(certs_dir: Path, site: str) -> Path:
    """Where an emulated site keeps its state: ``OUT/site-state/NAME``, next to the run's
    certificates in ``OUT/certs``, so a killed site restarts from its own saved state."""
    return certs_dir.resolve().parent / "site-state" / site


def site_command(
    scenario: Scenario, index: int, *, coordinator: str, certs_dir: Path, log_level: str
) -> list[str]:
    """``geoloco site ...`` for site ``index``, dialling ``coordinator`` (its link's relay)."""
    site = scenario.sites[index]
    return geoloco_command(
        "--log-level", log_level,
        "site",
        "--coordinator", coordinator,
        "--name", site.name,
        "--certs", str(certs_dir.resolve()),
        "--device", "cpu",
        "--site-index", str(scenario.shard_of(index)),
        "--num-sites", str(len(scenario.sites)),
        "--backoff-max", repr(SITE_BACKOFF_MAX_S),
        "--state-dir", str(site_state_dir(certs_dir, site.name)),
        *(["--speed-factor", repr(site.speed_factor)] if site.speed_factor != 1.0 else []),
    )

"""geoloco.coordinator: the coordinator process as a Python API.

- ``config``: ``CoordinatorConfig`` (one dataclass, validated, TOML-mappable).
- ``rounds``: ``RoundStateMachine``, the pure, lock-protected round logic (quorum, deadlines,
  stragglers, membership, verification and streaming aggregation, checkpoints, metrics records).
- ``servicer``: the thin gRPC servicer; ``server``: ``CoordinatorServer`` (start, wait, stop).
- ``checkpoint``: crash-safe safetensors + JSON checkpoints; ``metrics``: JSON-lines records.

Typical use::

    server = CoordinatorServer.from_model(CoordinatorConfig(certs_dir="certs", min_sites=3), model)
    port = server.start()
    server.wait_until_finished()
    server.stop()
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> defining module, resolved lazily (PEP 562) so that importing
# ``geoloco.coordinator.checkpoint`` alone does not start up gRPC.
_EXPORTS: dict[str, str] = {
    "CoordinatorConfig": "geoloco.coordinator.config",
    "CoordinatorServer": "geoloco.coordinator.server",
    "CoordinatorServicer": "geoloco.coordinator.servicer",
    "RoundPhase": "geoloco.coordinator.rounds",
    "RoundStateMachine": "geoloco.coordinator.rounds",
    "MetricsWriter": "geoloco.coordinator.metrics",
    "read_metrics": "geoloco.coordinator.metrics",
    "load_latest_checkpoint": "geoloco.coordinator.checkpoint",
    "save_checkpoint": "geoloco.coordinator.checkpoint",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'geoloco.coordinator' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

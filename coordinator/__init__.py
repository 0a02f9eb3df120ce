"""geoloco.coordinator: the coordinator process as a Python API.

- ``config``: ``CoordinatorConfig`` (one dataclass, validated, TOML-mappable); ``http_config``
  its ``[http]`` table.
- ``rounds``: ``RoundStateMachine``, the pure, lock-protected session the servicer calls. It
  composes ``membership`` (join, leave, heartbeats, silent sites), ``intake`` (plain or masked
  uploads behind one interface, late updates, the close rule) and ``phases`` (start, close,
  aggregate, checkpoint, broadcast record) over the round core (``geoloco.algorithms.round``);
  they share a ``context.RoundContext`` and speak ``domain`` objects.
- ``translate``: protobuf <-> domain objects (the only module below the servicer that touches
  ``pb``); ``servicer``: the thin gRPC servicer; ``server``: ``CoordinatorServer``.
- ``privacy_rounds`` / ``secure_round``: secure aggregation, DP and accounting.
- ``checkpoint``: crash-safe safetensors + JSON checkpoints; ``metrics``: JSON-lines records;
  ``events``, ``prometheus``, ``status_board``, ``http_status``: observers and the status page.

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

__all__ = sorted(_EXPORTS)  # noqa: PLE0605 (built from the lazy export table)


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

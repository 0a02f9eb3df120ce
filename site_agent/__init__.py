"""geoloco.site_agent: one site of a run, as a Python API around the user's own training.

- ``agent``: ``SiteAgent(model, inner_optimizer, data, loss_fn, coordinator=..., site=..., tls=...)``
  with ``run(max_rounds=None)`` and ``stop()``: membership (join, heartbeats, leave) over the
  parts below.
- ``state``: ``SiteState``, the global weights the site holds, its rounds and the run config.
- ``trainer``: ``SiteTrainer``, inner steps, lr schedule, batches, loss, follower ranks.
- ``runner`` / ``plain`` / ``streaming``: the round runners (shared mechanics, synchronous DiLoCo
  rounds, Streaming DiLoCo rounds), over an ``uplink`` (the strategy's encoders, or secure
  aggregation's masking from ``secure_site``).
- ``config``: ``SiteAgentConfig`` (device, bf16 autocast, clipping, retries), ``SiteHooks``,
  ``RoundResult``, ``JoinInfo``.
- ``client``: ``CoordinatorClient`` (retries with backoff and jitter, resumable transfers) and the
  errors the agent raises (``SiteAgentError``, ``CoordinatorUnreachableError``, ``TLSSetupError``).
- ``distributed``: intra-site ``torch.distributed`` groups for multi-GPU sites (``init_from_env``).
- ``connectivity``: prompt reconnection when the path to the coordinator comes back.
- ``persist``: the site's state saved under ``state_dir`` at every round boundary (written with
  ``geoloco.protos.atomic_files``), so a killed and restarted site goes on as if it never stopped.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> defining module, resolved lazily (PEP 562): torchrun workers and the CLI import
# only what they use.
_EXPORTS: dict[str, str] = {
    "SiteAgent": "geoloco.site_agent.agent",
    "SiteRunSummary": "geoloco.site_agent.agent",
    "SiteAgentConfig": "geoloco.site_agent.config",
    "SiteHooks": "geoloco.site_agent.config",
    "RoundResult": "geoloco.site_agent.config",
    "JoinInfo": "geoloco.site_agent.config",
    "CoordinatorClient": "geoloco.site_agent.client",
    "CoordinatorUnreachableError": "geoloco.site_agent.client",
    "SiteAgentError": "geoloco.site_agent.client",
    "TLSSetupError": "geoloco.site_agent.client",
    "IntraSiteGroup": "geoloco.site_agent.distributed",
    "init_from_env": "geoloco.site_agent.distributed",
}

__all__ = sorted(_EXPORTS)  # noqa: PLE0605 (built from the lazy export table)


def __getattr__(name: str) -> Any:
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'geoloco.site_agent' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

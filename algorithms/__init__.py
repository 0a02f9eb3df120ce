"""geoloco.algorithms: the training math of the DiLoCo family and the single-process simulator.

Pure functions and small classes over tensors (no I/O), called by the simulator here and by the
real coordinator and site agents, so both produce the same weights:

- ``params``: the flat fp32 global vector (``ParamLayout``, ``flatten_params``, ``load_flat_``,
  ``weights_digest``, ``derive_seed``).
- ``optimizers``: inner / outer optimizer configs and registries (``register_outer_optimizer``
  adds a plug-in's), ``OuterOptimizer`` (a real ``torch.optim`` optimizer fed the
  pseudo-gradient in ``.grad``), state as tensors + JSON.
- ``diloco``: the round's math (``run_inner_steps``, ``pseudo_gradient``, ``UpdateEncoder`` with
  error feedback, ``encode_downlink`` / ``apply_downlink``); ``aggregation``: ``RunningSum``.
- ``strategy``: the ``Strategy`` interface (fragments built in: plain DiLoCo is one fragment)
  and ``DiLoCo`` / ``FedAvg`` / ``FedOpt`` / ``DataParallel``, found by name in ``ALGORITHMS``.
- ``streaming``: Streaming DiLoCo's pieces (``StreamingConfig``, ``FragmentPartition``,
  ``StreamingSchedule``, ``merge_fragment_``); ``streaming_sim`` runs it in the simulator.
- ``clock``: the virtual network clock; ``simulator``: ``simulate(config, workload)``.
- ``workload``: the ``Workload`` protocol models and data plug into.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> defining module. Resolved lazily (PEP 562) so that importing one submodule, e.g.
# ``geoloco.algorithms.workload`` from a workload, does not pull in torch.optim, the codecs and
# the simulator.
_EXPORTS: dict[str, str] = {
    "ALGORITHMS": "geoloco.algorithms.strategy",
    "AlgorithmConfig": "geoloco.algorithms.strategy",
    "ConfigError": "geoloco.algorithms.config",
    "DataParallel": "geoloco.algorithms.strategy",
    "DiLoCo": "geoloco.algorithms.strategy",
    "FedAvg": "geoloco.algorithms.strategy",
    "FedOpt": "geoloco.algorithms.strategy",
    "INNER_OPTIMIZERS": "geoloco.algorithms.optimizers",
    "InnerOptimizerConfig": "geoloco.algorithms.optimizers",
    "InnerResult": "geoloco.algorithms.diloco",
    "OUTER_OPTIMIZERS": "geoloco.algorithms.optimizers",
    "OuterOptimizer": "geoloco.algorithms.optimizers",
    "OuterOptimizerConfig": "geoloco.algorithms.optimizers",
    "OuterOptimizerSpec": "geoloco.algorithms.optimizers",
    "ParamLayout": "geoloco.algorithms.params",
    "RoundPlan": "geoloco.algorithms.strategy",
    "Round": "geoloco.algorithms.round",
    "RoundPolicy": "geoloco.algorithms.round",
    "RoundRecord": "geoloco.algorithms.record",
    "RoundUpdate": "geoloco.algorithms.strategy",
    "SimulationConfig": "geoloco.algorithms.simulation.simulator",
    "Simulator": "geoloco.algorithms.simulation.simulator",
    "SimulatorConfig": "geoloco.algorithms.simulation.simulator",
    "SiteConfig": "geoloco.algorithms.simulation.clock",
    "Strategy": "geoloco.algorithms.strategy",
    "RunningSum": "geoloco.algorithms.aggregation",
    "FragmentPartition": "geoloco.algorithms.streaming",
    "StreamingConfig": "geoloco.algorithms.streaming",
    "StreamingSchedule": "geoloco.algorithms.streaming",
    "merge_fragment_": "geoloco.algorithms.streaming",
    "UpdateEncoder": "geoloco.algorithms.diloco",
    "Workload": "geoloco.algorithms.workload",
    "apply_delta": "geoloco.algorithms.diloco",
    "apply_downlink": "geoloco.algorithms.diloco",
    "build_strategy": "geoloco.algorithms.strategy",
    "compute_gradient": "geoloco.algorithms.diloco",
    "config_from_dict": "geoloco.algorithms.config",
    "config_to_dict": "geoloco.algorithms.config",
    "derive_seed": "geoloco.algorithms.params",
    "encode_downlink": "geoloco.algorithms.diloco",
    "flatten_params": "geoloco.algorithms.params",
    "load_flat_": "geoloco.algorithms.params",
    "load_optimizer_state_": "geoloco.algorithms.optimizers",
    "optimizer_state_tensors": "geoloco.algorithms.optimizers",
    "pseudo_gradient": "geoloco.algorithms.diloco",
    "register_outer_optimizer": "geoloco.algorithms.optimizers",
    "run_inner_steps": "geoloco.algorithms.diloco",
    "simulate": "geoloco.algorithms.simulation.simulator",
    "transfer_time": "geoloco.algorithms.simulation.clock",
    "weights_digest": "geoloco.algorithms.params",
}

__all__ = sorted(_EXPORTS)  # noqa: PLE0605 (built from the lazy export table)


def __getattr__(name: str) -> Any:
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'geoloco.algorithms' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

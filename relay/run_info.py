"""What a relay needs of the coordinator's run settings, read from a Join answer."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from geoloco.algorithms.algorithm_config import AlgorithmConfig
from geoloco.algorithms.config import ConfigError, config_from_dict
from geoloco.algorithms.update_guard import UpdateGuardConfig
from geoloco.coordinator.intake import run_most_inner_steps
from geoloco.protos import geoloco_pb2 as pb
from geoloco.relay.masked import SecureRun

__all__ = ["RunInfo"]

logger = logging.getLogger(__name__)

_WEIGHTING = {pb.WEIGHTING_SAMPLES: "samples", pb.WEIGHTING_UNIFORM: "uniform", pb.WEIGHTING_STEPS: "steps"}


@dataclass(frozen=True, slots=True)
class RunInfo:
    """What the relay needs of the coordinator's ``RunConfig``."""

    weighting: str
    uplink_codec: str
    numel: int
    quorum: int
    heartbeat_timeout_s: float
    guard: UpdateGuardConfig
    secure: SecureRun | None = None
    """Secure aggregation: the partial is the ring sum of masked uploads (``relay.masked``)."""
    most_inner_steps: int | None = None
    """The most inner steps a site's update may report, as the coordinator bounds it (None: no
    bound, or a coordinator whose settings do not say)."""

    @classmethod
    def of(cls, response: pb.JoinResponse) -> RunInfo:
        c = response.config
        return cls(
            guard=_guard_config(c.config_json),
            weighting=_WEIGHTING.get(c.weighting, "uniform"),
            uplink_codec=c.uplink_codec,
            numel=int(response.layout.numel),
            quorum=int(c.quorum),
            heartbeat_timeout_s=c.heartbeat_timeout_ms / 1000 if c.heartbeat_timeout_ms else 15.0,
            secure=SecureRun.of(c.config_json),
            most_inner_steps=_most_inner_steps(c.config_json),
        )


def _most_inner_steps(config_json: str) -> int | None:
    """``run_most_inner_steps`` of the coordinator's ``[algorithm]``; None when it cannot be read."""
    try:
        table = json.loads(config_json or "{}").get("algorithm") or {}
        return run_most_inner_steps(config_from_dict(AlgorithmConfig, table))
    except (ValueError, AttributeError, TypeError, ConfigError):
        logger.warning("the coordinator's algorithm settings cannot be read; the relay does not bound inner steps")
        return None


def _guard_config(config_json: str) -> UpdateGuardConfig:
    """The coordinator's ``[update_guard]`` from ``RunConfig.config_json`` (defaults when it has
    none, e.g. an older coordinator)."""
    try:
        table = json.loads(config_json or "{}").get("update_guard") or {}
        return config_from_dict(UpdateGuardConfig, table)
    except (ValueError, AttributeError, ConfigError):
        logger.warning("the coordinator's update_guard settings cannot be read; the relay uses the defaults")
        return UpdateGuardConfig()

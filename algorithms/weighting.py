"""How much each site's update counts in the average, and how much a late one still counts.

With a step-count round every site runs the same ``H`` inner steps, so the only thing that can
differ is the batch size (``samples``). With a time-budget round (``round_time_budget_s``) a
site runs as many inner steps as fit in the budget, so a site at half speed does half the work;
averaging its pseudo-gradient with the same weight as a full-speed site's would let the slow
site pull the model as hard as the fast one. ``w_k`` is therefore configurable:

- ``uniform``: ``w_k = 1`` (every contributing site counts the same; DiLoCo's default);
- ``steps``: ``w_k = inner steps the site ran this round`` (work done, whatever the batch);
- ``samples``: ``w_k = samples (or tokens) the site trained on this round``.

A *stale* update (computed from ``θ_{t−s}`` and folded into round ``t``, ``s`` rounds late)
counts ``w_k · discount^s`` (``stale_weight``): it points the right way but from older weights.

The inner steps a site reports are a claim, and under ``steps`` they are its weight: a site
reporting 1e12 steps of a round of ``H = 1`` would set the mean. ``most_inner_steps`` says how
many a round can legitimately hold (``H``; a Streaming DiLoCo round with an adaptive cadence up
to ``interval_steps_max``; no bound under a time budget, where a site runs as many as fit and
only ``[update_guard] weight_factor`` bounds it against the others), and ``check_inner_steps``
refuses more.

Pure functions; the coordinator and the simulator call the same ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = [
    "LATE_UPDATE_POLICIES",
    "WEIGHTINGS",
    "check_inner_steps",
    "check_weighting",
    "most_inner_steps",
    "site_weight",
    "stale_weight",
]

WEIGHTINGS: dict[str, Callable[[float, int], float]] = {
    "uniform": lambda samples, inner_steps: 1.0,
    "steps": lambda samples, inner_steps: float(inner_steps),
    "samples": lambda samples, inner_steps: float(samples),
}
"""Weighting name -> ``w_k(samples, inner_steps)``."""

LATE_UPDATE_POLICIES = ("drop", "fold")
"""What happens to an update that arrives after its round closed: ``drop`` (the site keeps it in
its error-feedback residual, so it reaches the model inside its next update) or ``fold`` (one
round late, it enters the next round's average with weight ``w_k · staleness_discount``)."""


def check_weighting(name: str) -> str:
    """``name`` if it is a known weighting, else a ``ValueError`` listing the known ones."""
    if name not in WEIGHTINGS:
        raise ValueError(f"unknown weighting {name!r}; valid names: {', '.join(WEIGHTINGS)}")
    return name


def site_weight(weighting: str, *, samples: float, inner_steps: int) -> float:
    """``w_k`` of a site that ran ``inner_steps`` steps on ``samples`` samples this round.

    Raises ``ValueError`` for an unknown weighting or a weight that could not enter an average
    (the aggregator needs ``w_k > 0``): a site that reports zero steps or samples did no work.
    """
    weight = WEIGHTINGS[check_weighting(weighting)](samples, inner_steps)
    if not (math.isfinite(weight) and weight > 0):
        raise ValueError(
            f"weighting {weighting!r} gives weight {weight} (samples {samples}, inner steps "
            f"{inner_steps}); a contributing site must report a finite amount of work > 0"
        )
    return weight


def stale_weight(weight: float, *, discount: float, staleness: int) -> float:
    """``w · discount^staleness``: the weight of an update computed ``staleness`` rounds ago."""
    if not 0 < discount <= 1:
        raise ValueError(f"staleness discount must be in (0, 1], got {discount}")
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0 rounds, got {staleness}")
    return weight * discount**staleness


def most_inner_steps(
    inner_steps: int, *, round_time_budget_s: float | None = None, interval_steps_max: int = 0
) -> int | None:
    """The most inner steps one site's update of a round may report, or None when nothing
    configured bounds them.

    ``inner_steps``: the run's ``H`` (a plain round runs exactly ``H``, a Streaming DiLoCo round
    ``H/P``, a sharded site reports ``H``); ``interval_steps_max``: the streaming adaptive
    cadence's longest round (0: none), which may exceed ``H/P`` and, configured so, ``H``;
    ``round_time_budget_s``: time-budget rounds, where a site runs as many steps as fit in the
    budget, so their number depends on its hardware and is not bounded here."""
    if round_time_budget_s is not None:
        return None
    return max(inner_steps, interval_steps_max)


def check_inner_steps(inner_steps: int, most: int | None) -> str | None:
    """Why an update reporting ``inner_steps`` for a round is refused (more than ``most``, from
    ``most_inner_steps``), or None."""
    if most is None or inner_steps <= most:
        return None
    return (
        f"inner_steps {inner_steps} is more than a round of this run runs (at most {most}: "
        "[algorithm] inner_steps, or [algorithm.streaming] interval_steps_max when larger); "
        "report the inner steps trained on this round"
    )

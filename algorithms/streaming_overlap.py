"""Adaptive overlap for Streaming DiLoCo: how many steps a fragment's transfer must hide behind.

A fixed ``overlap_steps`` (τ) hides a fragment's transfer only while ``τ × step time`` is longer
than the transfer: on a slow CPU step it may be, on a GPU step (orders of magnitude shorter) it
hides almost nothing. With ``adaptive_overlap = true`` a site chooses τ, and where the user allows
it (``interval_steps_max``) the number of steps of its next round, from what it measured:

* ``step_s``: its seconds per inner step (recent rounds);
* ``transfer_s``: how long its fragments were away, from the start of the upload until the round's
  broadcast had arrived (upload, waiting for the other sites, aggregation, broadcast), as a peak
  that decays by ``TRANSFER_DECAY`` per measured fragment: a long transfer is covered at once, and
  the overlap shrinks gradually once transfers are quicker. Gradually matters: rounds are
  synchronous, so a site that shortens its rounds abruptly waits for the sites still running
  long ones, measures that wait as a long transfer and lengthens them again (an oscillation that
  a plain maximum over a window, dropping at once when its peak leaves, was seen to drive up to
  ``interval_steps_max`` in emulated runs).

The rule (``choose_overlap``):

    needed = ceil(transfer_s × (1 + overlap_margin) / step_s)
    τ      = clamp(needed, overlap_steps_min, overlap_steps_max)       (max 0: no cap of its own)
    s      = clamp(τ + H/P − overlap_steps, H/P, interval_steps_max)  (max 0: s = H/P, fixed cadence)
    τ      = min(τ, s)                                                 (one fragment in flight)

so the broadcast is back before the site needs it whenever the bounds allow that. A stretched
round keeps the configured ``H/P − overlap_steps`` steps after the merge: the steps a fragment
trains between its merge and its next upload are what its pseudo-gradient carries (the τ steps
before a merge are overwritten by it, with ``mix = 0``), so with ``P = 1`` and ``τ = s`` a site
would send nothing. Before
anything is measured the configured ``overlap_steps`` and ``H/P`` apply. A site stretching its
rounds (``s > H/P``) runs more steps between two syncs of a fragment: it trades some of the
algorithm's sync frequency for not idling, within the user's bound.

The same functions run on the real site (wall clock) and in the simulator (virtual clock), and the
emulator's fidelity check replays them on what the sites reported.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from geoloco.algorithms.streaming import StreamingConfig

__all__ = ["OverlapBounds", "OverlapChoice", "OverlapMeter", "choose_overlap"]

STEP_WINDOW = 4
"""Rounds of inner-step timings averaged into the step time."""
TRANSFER_DECAY = 0.9
"""The transfer estimate: ``max(measured, TRANSFER_DECAY × previous estimate)``."""


@dataclass(frozen=True, slots=True)
class OverlapBounds:
    """What ``choose_overlap`` may choose, from the run's ``[algorithm.streaming]`` settings."""

    interval: int
    """H/P: a round's steps with the fixed cadence (the least a round runs)."""
    overlap_steps: int
    """τ before anything is measured (and always, without ``adaptive``)."""
    adaptive: bool = False
    overlap_min: int = 0
    overlap_max: int = 0
    """0: τ is bounded by the round's steps only."""
    interval_max: int = 0
    """0: the cadence stays ``interval``."""
    margin: float = 0.1

    @classmethod
    def from_config(cls, inner_steps: int, config: StreamingConfig) -> OverlapBounds:
        return cls(
            interval=inner_steps // config.fragments,
            overlap_steps=config.overlap_steps,
            adaptive=config.adaptive_overlap,
            overlap_min=config.overlap_steps_min,
            overlap_max=config.overlap_steps_max,
            interval_max=config.interval_steps_max,
            margin=config.overlap_margin,
        )

    @property
    def fixed(self) -> OverlapChoice:
        """The configured τ and cadence."""
        return OverlapChoice(overlap_steps=self.overlap_steps, round_steps=self.interval)


@dataclass(frozen=True, slots=True)
class OverlapChoice:
    """τ for the fragment about to travel, and the steps of the round that τ belongs to."""

    overlap_steps: int
    """Steps run while the fragment travels, before its broadcast is merged."""
    round_steps: int
    """Steps of the next round (its first ``overlap_steps`` are the overlap)."""
    needed_steps: int | None = None
    """Steps that would hide the measured transfer (None: nothing measured yet)."""

    @property
    def hidden(self) -> bool:
        """Whether τ covers the measured transfer (True while nothing is measured)."""
        return self.needed_steps is None or self.needed_steps <= self.overlap_steps


def choose_overlap(bounds: OverlapBounds, *, step_s: float | None, transfer_s: float | None) -> OverlapChoice:
    """τ and the next round's steps from the measured step and transfer times (module docstring)."""
    if not bounds.adaptive or step_s is None or transfer_s is None or step_s <= 0:
        return bounds.fixed
    needed = max(0, math.ceil(transfer_s * (1.0 + bounds.margin) / step_s))
    tau = max(needed, bounds.overlap_min)
    if bounds.overlap_max:
        tau = min(tau, bounds.overlap_max)
    steps = max(bounds.interval, tau + bounds.interval - bounds.overlap_steps)
    steps = min(steps, max(bounds.interval_max, bounds.interval))
    return OverlapChoice(overlap_steps=min(tau, steps), round_steps=steps, needed_steps=needed)


class OverlapMeter:
    """One site's measurements for ``choose_overlap``: recent step timings and fragment transfers.

    Pure bookkeeping (no clock of its own): the real site feeds wall-clock seconds, the simulator
    virtual ones.
    """

    def __init__(self) -> None:
        self._steps: deque[tuple[int, float]] = deque(maxlen=STEP_WINDOW)
        self._transfer: float | None = None
        self._skip_transfer = True

    def record_steps(self, steps: int, seconds: float) -> None:
        if steps > 0 and seconds >= 0:
            self._steps.append((steps, seconds))

    def record_transfer(self, seconds: float) -> None:
        """A fragment was away ``seconds``: from its upload's start to its broadcast's arrival.

        The first one after start (or ``reset_transfers``) is left out: its round also waited for
        the other sites to start and join, which says nothing about the rounds after it."""
        if self._skip_transfer:
            self._skip_transfer = False
        elif seconds >= 0:
            decayed = 0.0 if self._transfer is None else TRANSFER_DECAY * self._transfer
            self._transfer = max(seconds, decayed)

    def reset_transfers(self) -> None:
        """Forget transfers (after a re-join the old ones say nothing about the new session)."""
        self._transfer = None
        self._skip_transfer = True

    @property
    def step_s(self) -> float | None:
        steps = sum(n for n, _ in self._steps)
        return sum(s for _, s in self._steps) / steps if steps else None

    @property
    def transfer_s(self) -> float | None:
        return self._transfer

    def choose(self, bounds: OverlapBounds) -> OverlapChoice:
        return choose_overlap(bounds, step_s=self.step_s, transfer_s=self.transfer_s)

"""Magnitude bounds on what enters a round and on what leaves it: the coordinator's safety net.

A finite value can still be absurd: an update near the float32 maximum passes ``isfinite``
and overflows the aggregate, and a finite ``sample_weight`` of 1e38 overflows the buffer it
scales. One site must not be able to take the run down that way, so:

* each update's L2 norm must stay within ``max(norm_floor, norm_factor * median)``, the median
  of the norms of the updates aggregated in the last ``norm_window`` rounds (only the floor
  applies before any round was aggregated), and within the same bound taken over the *other*
  sites' norms only (``peer_bound``, below); its ``sample_weight`` and its weight under the
  run's weighting within ``max_sample_weight``, and that weight within ``weight_factor`` times
  the other sites' recent weights (``peer_bound`` again). An update outside is rejected for its
  round (INVALID_ARGUMENT with the reason);
* the round's mean update must be finite before the outer step uses it, and the new weights
  finite and within ``max_abs_weight`` before they are checkpointed or broadcast; otherwise the
  round is aborted with the model unchanged (``RoundAbortedError``).

Why the relative bounds look at the *other* sites. A median that
includes a site's own values lets that site move its own bound: with two sites, the median of
the last rounds' norms is half the hostile site's, so an update growing 1.4x a round stays
within ``norm_factor x median`` for ever (2,296x after 24 rounds), and a weight of 1e12 against
honest hundreds sets the mean. ``peer_bound`` therefore takes, for site ``s``:

    max(factor * median(the other sites' values in the window), max(s's own values in the window))

* a site cannot raise its own bound: the first term ignores its values, and the second only lets
  it repeat what was already accepted, never grow; so with two sites the bound stays at
  ``factor x`` the honest site's values instead of drifting;
* another site cannot lock it out by reporting tiny values (with two sites "the others" is that
  one site): what the site itself had accepted in the window stays allowed (and for norms
  ``norm_floor`` always is);
* the history is of *closed* rounds only (like the pooled median), so the bound is the same for
  every arrival of a round, the first included, whatever the arrival order (the simulator, which
  admits in site order, decides exactly as the coordinator does);
* without another site's value in the window (round 0, a lone site) only the absolute bounds
  apply (``norm_floor``, ``max_sample_weight``): in round 0 the first arrivals are bounded by
  nothing relative, which one round of history fixes.

This is a sanity check on absurd inputs, not robust aggregation: updates within the bounds are
averaged as the run's aggregation says. Pure checks plus the norm and weight history; no I/O, no
locks (the intake and the round phases call it under the round context's lock).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from geoloco.algorithms.aggregation import Aggregation
from geoloco.algorithms.config import require
from geoloco.compression import Encoded

__all__ = ["GuardedAggregation", "RoundAbortedError", "UpdateGuard", "UpdateGuardConfig", "value_range"]


@dataclass(kw_only=True, slots=True)
class UpdateGuardConfig:
    """``[update_guard]``: how large an update, a weight and the global weights may be."""

    norm_factor: float = 100.0
    """An update's L2 norm may be at most this many times the median norm of the updates
    aggregated in the last ``norm_window`` rounds (or ``norm_floor``, whichever is larger), and
    at most this many times the median norm of the *other* sites' updates there (or
    ``norm_floor``, or the site's own largest norm there), so that no site moves its own bound."""
    norm_floor: float = 1e4
    """Norm every update may have whatever the history (the only bound before the first round
    is aggregated): far above any real pseudo-gradient, far below float32 overflow."""
    norm_window: int = 10
    """Rounds whose aggregated updates' norms (and weights, for ``weight_factor``) make the
    medians."""
    max_sample_weight: float = 1e12
    """Largest ``sample_weight`` (samples or tokens of one round) and largest weight under the
    run's weighting (``steps``: inner steps) an update may carry."""
    weight_factor: float = 100.0
    """An update's weight under the run's weighting may be at most this many times the median
    weight of the *other* sites' updates aggregated in the last ``norm_window`` rounds (or the
    site's own largest weight there, whichever is larger; no bound before another site's update
    was aggregated). Caps what one site's claimed samples can do to the mean: 1e12 samples
    against honest hundreds is refused instead of taking 99.99999998 % of it. Honest sites differ
    by batch size, GPUs and (time-budget rounds) speed; raise it for sites more than 100x apart,
    lower it where every site trains alike."""
    max_abs_weight: float = 1e6
    """Largest absolute value of a global weight after a round; a round whose outer step goes
    beyond it is aborted with the model unchanged."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for key in ("norm_factor", "norm_floor", "max_sample_weight", "weight_factor", "max_abs_weight"):
            value = getattr(self, key)
            require(
                math.isfinite(value) and value > 0,
                key,
                f"must be a finite number > 0, got {value}",
            )
        require(self.norm_factor >= 1, "norm_factor", f"must be >= 1, got {self.norm_factor}")
        require(
            self.weight_factor >= 1, "weight_factor",
            f"must be >= 1 (a multiple of the other sites' median weight), got {self.weight_factor}",
        )
        require(self.norm_window >= 1, "norm_window", f"must be >= 1 round, got {self.norm_window}")


class RoundAbortedError(Exception):
    """The round's arithmetic went out of bounds: abort it with the model unchanged."""


def value_range(values: torch.Tensor) -> tuple[float, float]:
    """(min, max) of ``values`` in one reduction, no temporary of its size; NaN propagates."""
    low, high = torch.aminmax(values.detach().reshape(-1))
    return float(low), float(high)


def _out_of_range(values: torch.Tensor, limit: float) -> str | None:
    """Why ``values`` is not finite or not within ``[-limit, limit]``; None when it is."""
    if values.numel() == 0:
        return None
    low, high = value_range(values)
    if not (math.isfinite(low) and math.isfinite(high)):
        return "are not finite (NaN, Inf or float32 overflow)"
    largest = max(-low, high)
    if largest > limit:
        return f"reach |value| {largest:.4g}, beyond max_abs_weight {limit:.4g}"
    return None


def update_norm(update: torch.Tensor) -> float:
    """L2 norm of a finite update; computed again in float64 where float32 squares overflow, so
    a large-but-finite update gets its true norm rather than inf."""
    norm = float(torch.linalg.vector_norm(update))
    if not math.isfinite(norm):
        norm = float(torch.linalg.vector_norm(update, dtype=torch.float64))
    return norm


@dataclass(frozen=True, slots=True)
class _Aggregated:
    """What one round taught the guard: each counted site's update norm and weight."""

    norms: dict[str, float]
    weights: dict[str, float]


@dataclass(frozen=True, slots=True)
class _Window:
    """One kind of value (norms or weights) over the window, sorted once per closed round so
    that each upload's bounds cost a few bisections, not a pass over every site's history (which
    made the guard's cost per round grow as the square of the sites)."""

    values: list[float]
    """Every value in the window, sorted."""
    by_site: dict[str, list[float]]
    """site -> its own values in the window, sorted."""

    @classmethod
    def of(cls, rounds: Iterable[dict[str, float]]) -> _Window:
        by_site: dict[str, list[float]] = {}
        for values in rounds:
            for site, value in values.items():
                by_site.setdefault(site, []).append(value)
        for own in by_site.values():
            own.sort()
        return cls(sorted(v for own in by_site.values() for v in own), by_site)

    def median(self) -> float | None:
        """``statistics.median`` of every value (None: none)."""
        return _median(self.values, [])

    def median_without(self, site: str) -> float | None:
        """The median of the other sites' values (None: none)."""
        return _median(self.values, self.by_site.get(site, []))

    def largest(self, site: str) -> float:
        own = self.by_site.get(site)
        return own[-1] if own else 0.0


def _median(values: list[float], removed: list[float]) -> float | None:
    """``statistics.median`` of the sorted ``values`` less the sorted sub-multiset ``removed``,
    found by bisection (the same float, bit for bit)."""
    n = len(values) - len(removed)
    if n <= 0:
        return None

    def kth(k: int) -> float:
        lo, hi = 0, len(values) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            v = values[mid]
            if bisect.bisect_right(values, v) - bisect.bisect_right(removed, v) >= k + 1:
                hi = mid
            else:
                lo = mid + 1
        return values[lo]

    if n % 2:
        return kth(n // 2)
    return (kth(n // 2 - 1) + kth(n // 2)) / 2


@dataclass(slots=True)
class UpdateGuard:
    """The bounds of ``UpdateGuardConfig`` and the recent rounds' update norms and weights they
    use (module doc)."""

    config: UpdateGuardConfig
    _rounds: deque[_Aggregated] = field(init=False)
    """Norms and weights of the updates aggregated in each of the last ``norm_window`` rounds."""
    _pending: dict[int, _Aggregated] = field(default_factory=dict, init=False)
    """round -> what the updates accepted into that open round carried."""
    _windows: dict[str, _Window] = field(default_factory=dict, init=False)
    """kind -> the window's values, sorted (rebuilt after the window changed)."""

    def __post_init__(self) -> None:
        self._rounds = deque(maxlen=self.config.norm_window)

    def _window(self, kind: Literal["norm", "weight"]) -> _Window:
        window = self._windows.get(kind)
        if window is None:
            window = _Window.of(r.norms if kind == "norm" else r.weights for r in self._rounds)
            self._windows[kind] = window
        return window

    # -- intake --

    def norm_bound(self) -> float:
        """The pooled bound: ``max(norm_floor, norm_factor x median)`` of every recent norm."""
        median = self._window("norm").median()
        relative = self.config.norm_factor * median if median is not None else 0.0
        return max(self.config.norm_floor, relative)

    def peer_bound(self, site: str, kind: Literal["norm", "weight"]) -> float | None:
        """``max(factor x median of the other sites' values, site's own largest value)`` over
        the last ``norm_window`` rounds (``factor``: ``norm_factor`` or ``weight_factor``), or
        None while no other site's value is in the window. Module doc for why."""
        factor = self.config.norm_factor if kind == "norm" else self.config.weight_factor
        window = self._window(kind)
        median = window.median_without(site)
        if median is None:
            return None
        return max(factor * median, window.largest(site))

    def check_norm(self, norm: float, *, site: str | None = None) -> str | None:
        """Why an update of L2 norm ``norm`` is refused, or None. The norm comes from
        ``update_norm`` of a decoded update or, without one, ``geoloco.compression.decoded_norm``.
        ``site``: whose update it is, for the bound over the other sites' norms (None: a sum of
        several sites' updates, held to the pooled bound only)."""
        c = self.config
        bound = self.norm_bound()
        if not norm <= bound:
            return (
                f"its L2 norm {norm:.4g} exceeds the bound {bound:.4g} (update_guard: the larger "
                f"of norm_floor {c.norm_floor:.4g} and norm_factor {c.norm_factor:g} x the median "
                f"norm of the last {c.norm_window} rounds' updates)"
            )
        peer = None if site is None else self.peer_bound(site, "norm")
        if peer is not None and not norm <= max(c.norm_floor, peer):
            return (
                f"its L2 norm {norm:.4g} exceeds the bound {max(c.norm_floor, peer):.4g} set by the "
                f"other sites (update_guard: the largest of norm_floor {c.norm_floor:.4g}, "
                f"norm_factor {c.norm_factor:g} x the median norm of the other sites' updates in the "
                f"last {c.norm_window} rounds, and this site's own largest norm there)"
            )
        return None

    def check_weight(self, what: str, value: float) -> str | None:
        """Why ``what`` (``sample_weight``, or the weight under the run's weighting) is refused."""
        limit = self.config.max_sample_weight
        if not value <= limit:
            return (
                f"{what} {value:.4g} exceeds update_guard.max_sample_weight {limit:.4g}; send the "
                "samples (or tokens) trained on this round"
            )
        return None

    def check_site_weight(self, site: str, weight: float) -> str | None:
        """Why ``site``'s update, entering the mean with ``weight`` (under the run's weighting),
        is refused for weighing too much against the other sites (``weight_factor``), or None."""
        bound = self.peer_bound(site, "weight")
        if bound is None or weight <= bound:
            return None
        c = self.config
        return (
            f"its weight {weight:.4g} exceeds {bound:.4g} (update_guard: weight_factor "
            f"{c.weight_factor:g} x the median weight of the other sites' updates in the last "
            f"{c.norm_window} rounds, or this site's own largest weight there); send the samples "
            "(or tokens) trained on this round, or raise update_guard.weight_factor if the sites "
            "really differ this much"
        )

    def accepted(self, round_number: int, site: str, norm: float | None, *, weight: float | None = None) -> None:
        """``site``'s update of norm ``norm`` (None: not measurable, a masked update) and weight
        ``weight`` under the run's weighting entered the open round ``round_number``."""
        pending = self._pending.setdefault(round_number, _Aggregated({}, {}))
        if norm is not None:
            pending.norms[site] = norm
        if weight is not None:
            pending.weights[site] = weight

    def round_done(self, round_number: int, contributors: Iterable[str] | None) -> None:
        """Round ``round_number`` was aggregated by ``contributors`` (None: it was aborted,
        its norms and weights do not count)."""
        pending = self._pending.pop(round_number, None)
        for stale in [r for r in self._pending if r < round_number]:
            del self._pending[stale]
        if contributors is None or pending is None:
            return
        counted = list(contributors)
        kept = _Aggregated(
            {site: pending.norms[site] for site in counted if site in pending.norms},
            {site: pending.weights[site] for site in counted if site in pending.weights},
        )
        if kept.norms or kept.weights:
            self._rounds.append(kept)
            self._windows.clear()

    # -- aggregation --

    def check_mean(self, mean: torch.Tensor) -> None:
        """Raise ``RoundAbortedError`` unless the round's mean update is finite."""
        low, high = value_range(mean) if mean.numel() else (0.0, 0.0)
        if not (math.isfinite(low) and math.isfinite(high)):
            raise RoundAbortedError(
                "the round's mean update is not finite (the accepted updates overflowed float32 "
                "when summed)"
            )

    def check_weights(self, weights: torch.Tensor) -> None:
        """Raise ``RoundAbortedError`` unless the new global weights are finite and within
        ``max_abs_weight`` (checked before they are checkpointed or broadcast)."""
        why = _out_of_range(weights, self.config.max_abs_weight)
        if why is not None:
            raise RoundAbortedError(f"the new global weights {why}")

    # -- checkpoints --

    def state(self) -> list[dict[str, dict[str, float]]]:
        """The window as JSON: one ``{"norms": {site: n}, "weights": {site: w}}`` per round."""
        return [{"norms": dict(r.norms), "weights": dict(r.weights)} for r in self._rounds]

    def load_state(self, rounds: Sequence[Any]) -> None:
        """Restore ``state()``; a checkpoint written before sites were named (one list of norms
        per round) loads its norms under placeholder names, other sites' to every site."""
        self._rounds.clear()
        self._windows.clear()
        for entry in rounds:
            if isinstance(entry, Mapping):
                norms = _kept(entry.get("norms", {}), positive=False)
                weights = _kept(entry.get("weights", {}), positive=True)
            else:
                norms = _kept({f"#{k}": value for k, value in enumerate(entry)}, positive=False)
                weights = {}
            if norms or weights:
                self._rounds.append(_Aggregated(norms, weights))


def _kept(values: Any, *, positive: bool) -> dict[str, float]:
    """The finite, non-negative (``positive``: > 0) numbers of a checkpoint's ``{site: value}``."""
    if not isinstance(values, Mapping):
        return {}
    kept: dict[str, float] = {}
    for site, value in values.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(number) and (number > 0 if positive else number >= 0):
            kept[str(site)] = number
    return kept


class GuardedAggregation:
    """A round's aggregation whose mean is checked (``UpdateGuard.check_mean``) as it is
    handed to the outer step: an overflowed sum aborts the round before the outer optimizer's
    state or the weights see it."""

    def __init__(self, inner: Aggregation, guard: UpdateGuard) -> None:
        self.inner = inner
        self.guard = guard

    @property
    def sites(self) -> list[str]:
        return self.inner.sites

    def add(self, update: Encoded | torch.Tensor, weight: float = 1.0, *, site: str, stale: bool = False) -> None:
        self.inner.add(update, weight, site=site, stale=stale)

    def take_result(self) -> torch.Tensor:
        mean = self.inner.take_result()
        self.guard.check_mean(mean)
        return mean

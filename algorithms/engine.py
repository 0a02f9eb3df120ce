"""The round engine: one round's whole lifecycle, written once, without I/O.

Every host of a round drives this engine and does only its own I/O around it: the coordinator
from gRPC events (``geoloco.coordinator.phases``, ``geoloco.coordinator.intake``), the simulator
and the planner from arrival times they computed on a virtual clock. The engine owns, in the
order a round meets them:

* **start** — ``maybe_start``: the round's clock starts when the close policy says enough
  members are present (``ClosePolicy.may_start``);
* **admit** — ``admit``/``fold_late``: an update is screened by the update guard (finite values,
  norm, weight; ``geoloco.algorithms.update_guard``) and either enters the round's aggregation
  or is rejected *with its reason* on the ``Round`` (a rejection counts for the quorum and the
  record the same way whatever refused it); a late update is folded into the next round by the
  one rule ``late_foldable`` with the policy's staleness discount;
* **close** — ``decide`` asks the ``ClosePolicy`` (the plain ``RoundPolicy``: quorum, fixed or
  adaptive deadline; the coordinator's secure stages plug in their own), ``close`` freezes the
  ``RoundOutcome`` and lets the policy learn from it; on a virtual clock ``admit_arrivals``
  admits the arrivals the policy's rule lets in (``RoundPolicy.close_time``, the same rule
  replayed over known arrival times);
* **step** — ``step``: the guarded outer step. The mean must be finite before the outer
  optimizer sees it and the new weights finite and within bounds before anyone else does;
  otherwise, or if the arithmetic fails in any other way, the round is *aborted*: the model is
  unchanged (``Strategy.no_change``) and the outer optimizer's state is rewound to what goes with
  the unchanged weights: the coordinator's checkpoint of them, or in a host without checkpoints
  (the simulators, a coordinator without ``checkpoint_dir``) a copy the engine keeps while the
  step runs. Because this lives here, the
  simulator predicts an aborted round exactly as the coordinator has it.

The engine takes time as an argument and never sleeps, reads a socket or writes a file; hosts
pass what only they can do (restoring the outer state from a checkpoint) as a callable.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from geoloco.algorithms.aggregation import Aggregation
from geoloco.algorithms.finite import all_finite
from geoloco.algorithms.round import CloseDecision, Round, RoundOutcome, RoundPolicy
from geoloco.algorithms.strategy import FragmentOuter, RoundPlan, RoundUpdate, Strategy
from geoloco.algorithms.update_guard import GuardedAggregation, RoundAbortedError, UpdateGuard, update_norm
from geoloco.compression import Encoded, decoded_norm

__all__ = [
    "NOT_FINITE",
    "UNSCREENED",
    "Admission",
    "ClosePolicy",
    "RoundEngine",
    "RoundSum",
    "Screen",
    "Stepped",
    "screen_update",
]

logger = logging.getLogger(__name__)

NOT_FINITE = "NaN or Inf values"
"""The reason recorded for an update with non-finite values."""


class ClosePolicy(Protocol):
    """When a round's clock starts and when the round closes. ``RoundPolicy`` is the plain rule
    (quorum, fixed or adaptive deadline); other rules (the secure stages, an asynchronous merge)
    implement this without touching the engine."""

    def may_start(self, members: int) -> bool:
        """Whether a round with ``members`` present starts its clock."""
        ...

    def decide_round(self, round_: Round, *, now: float, expected: Collection[str]) -> CloseDecision:
        """Whether ``round_`` closes at ``now``; ``expected``: the sites it waits for."""
        ...


@dataclass(frozen=True, slots=True)
class Screen:
    """What a host measured of an update before it asks to admit it: its L2 norm (None where no
    one may look at it: a masked update) and whether its values are all finite."""

    norm: float | None
    finite: bool = True

    @classmethod
    def of(cls, update: Encoded | torch.Tensor, *, device: torch.device | str | None = None) -> Screen:
        """Measure ``update`` (encoded: piece by piece, no dense copy; see ``decoded_norm``)."""
        if isinstance(update, Encoded):
            norm, finite = decoded_norm(update, device=device)
            return cls(norm, finite)
        norm = update_norm(update)
        return cls(norm, all_finite(update, norm))


UNSCREENED = Screen(None)
"""An update nobody may measure (secure aggregation): only the weight bound applies."""


def screen_update(
    guard: UpdateGuard | None,
    screen: Screen,
    *,
    weights: Sequence[tuple[str, float]] = (),
    site: str | None = None,
    weight: float | None = None,
) -> str | None:
    """Why an update so measured (and carrying ``weights``: ``(what, value)`` pairs) is refused,
    or None: the one place an update is judged, by the engine's hosts and by a relay, which
    refuses what the coordinator would refuse of a site's own upload.

    ``site`` and ``weight`` (its weight under the run's weighting, the one it enters the mean
    with): whose update it is, for the bounds relative to the *other* sites' recent norms and
    weights (``UpdateGuard.peer_bound``: no site can raise its own bound); without ``site`` (a
    relay's partial sum, several sites' updates) only the pooled and absolute bounds apply."""
    if not screen.finite:
        return NOT_FINITE
    if guard is None:
        return None
    for what, value in weights:
        why = guard.check_weight(what, value)
        if why is not None:
            return why
    if site is not None and weight is not None:
        why = guard.check_site_weight(site, weight)
        if why is not None:
            return why
    return None if screen.norm is None else guard.check_norm(screen.norm, site=site)


@dataclass(frozen=True, slots=True)
class Admission:
    """What became of an update: ``accepted`` into its round, ``folded`` into the next one,
    ``rejected`` (``reason`` says why), or refused as a ``duplicate`` of the site's update that
    already counts (through a relay's partial, its shards or its own upload; the round is left
    as it was)."""

    verdict: Literal["accepted", "folded", "rejected", "duplicate"]
    weight: float
    """The weight it entered with (a folded update's is discounted); 0 when rejected."""
    reason: str | None = None

    @property
    def ok(self) -> bool:
        """The update is in the aggregate (its round's, or folded into the next)."""
        return self.verdict in ("accepted", "folded")


@dataclass(slots=True)
class RoundSum:
    """A closed round's aggregate, applied: the new weights and downlink, who counted."""

    update: RoundUpdate
    contributors: list[str]
    update_norm: float
    """L2 norm of the mean update (0 for a round that changed nothing)."""
    privacy: dict[str, Any] = field(default_factory=dict)
    """Privacy metrics of the round (secure aggregation survivors, epsilon...); empty without."""


@dataclass(slots=True)
class Stepped:
    """The round's step: its result (``no_change`` when aborted) and why it was aborted."""

    result: RoundSum
    aborted: str | None


OuterStep = Callable[[torch.Tensor, Aggregation, RoundPlan, list[str]], RoundSum]
"""``(θ_t, the round's aggregation, its plan, contributors) -> RoundSum``: how a host turns the
aggregate into new weights (plain: ``Strategy.aggregate_round``; central DP adds noise, secure
aggregation unmasks first)."""


@dataclass(slots=True)
class _OuterCopy:
    """One fragment's outer state (``FragmentOuter``) as it was before a step."""

    fragment: FragmentOuter
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]


class RoundEngine:
    """The lifecycle of a run's rounds (module doc): one per coordinator, simulator or planner.

    ``strategy``: the run's outer optimizer and downlink; None for a host that only counts
    arrivals and never steps (the planner). ``guard``: the update guard, or None (the planner).
    ``fresh_strategy``: builds the strategy anew; its state is the rewind of last resort.
    ``restore_outer``: a host's own rewind (the checkpoint that holds the unchanged weights);
    returns a sentence saying what it did, or None when it could not. Without one (the
    simulators, a coordinator without checkpoints) the engine copies the state of the fragment
    the step changes before each step the guard may throw away (its momentum, or Adam's two
    moments, and its downlink residual: up to three copies of the fragment while the step runs),
    so every host rewinds alike and exactly.
    """

    def __init__(
        self,
        strategy: Strategy | None,
        policy: RoundPolicy,
        guard: UpdateGuard | None,
        *,
        close: ClosePolicy | None = None,
        fresh_strategy: Callable[[], Strategy] | None = None,
        restore_outer: Callable[[torch.Tensor], str | None] | None = None,
    ) -> None:
        self.strategy = strategy
        self.policy = policy
        self.guard = guard
        self.close_policy: ClosePolicy = close if close is not None else policy
        self.fresh_strategy = fresh_strategy
        self.restore_outer = restore_outer

    # -- start --

    def open(self, number: int, aggregation: Aggregation, now: float) -> Round:
        """Round ``number``, opened at ``now``; its clock starts with ``maybe_start``."""
        return Round(number=number, aggregation=aggregation, opened_s=now)

    def maybe_start(self, round_: Round, now: float, *, members: int) -> bool:
        """Start ``round_``'s clock if the close policy lets ``members`` start it; says whether
        it started now."""
        if round_.started or not self.close_policy.may_start(members):
            return False
        round_.start(now, self.policy)
        return True

    # -- admit --

    def screen(
        self,
        screen: Screen,
        *,
        weights: Sequence[tuple[str, float]] = (),
        site: str | None = None,
        weight: float | None = None,
    ) -> str | None:
        """Why ``site``'s update so measured (and carrying ``weights``, entering the mean with
        ``weight``) is refused, or None (``screen_update``)."""
        return screen_update(self.guard, screen, weights=weights, site=site, weight=weight)

    def admit(
        self,
        round_: Round,
        site: str,
        update: Encoded | torch.Tensor | list[tuple[int, Encoded | torch.Tensor]] | None,
        weight: float,
        *,
        screen: Screen,
        now: float,
        numel: int = 0,
        weights: Sequence[tuple[str, float]] = (),
    ) -> Admission:
        """``site``'s update for ``round_``, arriving at ``now``: into the aggregation, or
        rejected with the reason on the round. ``update`` None: a sum kept outside the
        aggregation (secure aggregation's masked sum) already holds it; it is counted only. A
        list: pieces ``(offset, values)`` tiling a vector of ``numel`` (a sharded site).
        ``weights``: ``(what, value)`` pairs the guard bounds too, where no earlier check did."""
        if site in round_.contributed:
            return Admission("duplicate", 0.0, f"site {site!r}'s update already counts in round {round_.number}")
        why = self.screen(screen, weights=weights, site=site, weight=weight)
        if why is not None:
            round_.reject(site, why)
            return Admission("rejected", 0.0, why)
        try:
            if update is None:
                round_.count(site, weight, now=now)
            elif isinstance(update, list):
                round_.add_rows(update, weight, numel=numel, site=site, now=now)
            else:
                round_.add(update, weight, site=site, now=now)
        except Exception as err:
            # The sum may hold part of this update: the round cannot be trusted any more.
            logger.exception("round %d: adding the update of %s failed", round_.number, site)
            round_.abort(f"adding the update of {site} failed ({type(err).__name__})")
            why = f"it could not be added to the aggregate ({type(err).__name__})"
            round_.reject(site, why)
            return Admission("rejected", 0.0, why)
        if self.guard is not None:
            self.guard.accepted(round_.number, site, screen.norm, weight=weight)
        return Admission("accepted", weight)

    def late_foldable(self, update_round: int, open_round: int, *, counted: bool) -> bool:
        """Whether an update for ``update_round`` that did not count there (``counted``) is
        folded into ``open_round``: folding on, and exactly one round late, no later."""
        return self.policy.folds_late_updates and update_round + 1 == open_round and not counted

    def fold_late(
        self, round_: Round, site: str, update: Encoded | torch.Tensor, weight: float, *, screen: Screen
    ) -> Admission:
        """``site``'s update of the previous round, folded into ``round_`` with the policy's
        staleness discount; it does not count towards the quorum."""
        why = self.screen(screen, site=site, weight=weight)
        if why is not None:
            return Admission("rejected", 0.0, why)
        try:
            discounted = round_.fold(update, weight, site=site, policy=self.policy)
        except Exception as err:
            logger.exception("round %d: folding the late update of %s failed", round_.number, site)
            round_.abort(f"folding the late update of {site} failed ({type(err).__name__})")
            return Admission("rejected", 0.0, f"it could not be added to the aggregate ({type(err).__name__})")
        return Admission("folded", discounted)

    # -- close --

    def decide(self, round_: Round, *, now: float, expected: Collection[str]) -> CloseDecision:
        return self.close_policy.decide_round(round_, now=now, expected=expected)

    def close(self, round_: Round, *, now: float, expected: Collection[str]) -> RoundOutcome:
        """The outcome of ``round_`` closed at ``now``; the policy learns from it (the adaptive
        deadline must cover the sites that had not arrived)."""
        if self.close_policy is self.policy and len(round_.contributed) < self.policy.min_sites and round_.rejected:
            round_.abort(
                f"the quorum of {self.policy.min_sites} updates can no longer be met: "
                f"{len(round_.contributed)} counted, the update of {', '.join(sorted(round_.rejected))} "
                "was rejected"
            )
        outcome = round_.close(now=now, expected=expected)
        self.policy.observe(outcome)
        return outcome

    def admit_arrivals(
        self,
        round_: Round,
        *,
        sites: Sequence[str],
        arrivals: Sequence[float],
        payloads: Sequence[Encoded | torch.Tensor | None],
        weights: Sequence[float],
        screen: Callable[[Encoded | torch.Tensor], Screen],
    ) -> float:
        """A round on a virtual clock, where every site's arrival time is known up front: when
        the policy closes it, and every update in by then admitted, in site order (those before
        the deadline first, then those the quorum rule pulled in after it). Returns the close
        time. A ``None`` payload is an update already admitted when it arrived before the
        deadline (a host that knew its size at once need not hold every update until the close).
        """
        start = round_.started_s if round_.started_s is not None else round_.opened_s
        screens = [None if p is None else screen(p) for p in payloads]
        refused = [
            sites[k] in round_.rejected if s is None else self.screen(s, site=sites[k], weight=weights[k]) is not None
            for k, s in enumerate(screens)
        ]
        closed = self.policy.close_time(arrivals, start_s=start, deadline_s=round_.deadline_s, rejected=refused)
        deadline = round_.deadline_at
        on_time = [k for k, a in enumerate(arrivals) if deadline is None or a <= deadline]
        pulled_in = [k for k, a in enumerate(arrivals) if k not in on_time and a <= closed]
        for k in on_time + pulled_in:
            payload, measured = payloads[k], screens[k]
            if payload is not None and measured is not None:
                self.admit(round_, sites[k], payload, weights[k], screen=measured, now=arrivals[k])
        return closed

    def admit_if_on_time(
        self,
        round_: Round,
        site: str,
        update: Encoded | torch.Tensor,
        weight: float,
        *,
        screen: Screen,
        arrival: float,
    ) -> bool:
        """A virtual clock's update whose arrival is known at once: within the deadline (or
        without one) it surely enters the round, so it is admitted now and no host holds every
        update until the close. Says whether it was admitted (accepted or rejected)."""
        if round_.deadline_at is not None and arrival > round_.deadline_at:
            return False
        self.admit(round_, site, update, weight, screen=screen, now=arrival)
        return True

    # -- step --

    def step(
        self,
        round_: Round,
        global_flat: torch.Tensor,
        plan: RoundPlan,
        contributors: list[str],
        outer_step: OuterStep | None = None,
    ) -> Stepped:
        """The closed round's outer step, guarded (module doc). ``outer_step``: the host's, or
        the strategy's plain ``aggregate_round``. The guard's norm history learns the round's
        norms only when it was not aborted."""
        strategy = self.strategy
        if strategy is None:
            raise ValueError("this round engine counts arrivals only (no strategy): it cannot step a round")
        step = outer_step if outer_step is not None else self._plain_step
        why: str | None = round_.aborted or None
        result: RoundSum | None = None
        if why is None:
            before = self._outer_copy(plan)
            stepped = False
            aggregation = round_.aggregation
            if self.guard is not None:
                aggregation = GuardedAggregation(aggregation, self.guard)
            try:
                result = step(global_flat, aggregation, plan, contributors)
                stepped = True
                if self.guard is not None:
                    self.guard.check_weights(result.update.global_flat)
            except RoundAbortedError as err:  # the mean's check runs before the outer step
                why = str(err)
                result = None
            except Exception as err:
                stepped = True
                logger.exception("round %d: aggregation failed", round_.number)
                text = str(err)
                why = f"the aggregation failed: {type(err).__name__}: {text[:200]}"
                result = None
            if why is not None and stepped:
                why += self._rewind(global_flat, before)
            del before
        if self.guard is not None:
            self.guard.round_done(round_.number, None if why is not None or result is None else result.contributors)
        if why is not None:
            logger.warning("round %d aborted, the model is unchanged: %s", round_.number, why)
            return Stepped(RoundSum(strategy.no_change(global_flat, plan), [], 0.0), why)
        assert result is not None
        return Stepped(result, None)

    def _plain_step(
        self, global_flat: torch.Tensor, aggregation: Aggregation, plan: RoundPlan, contributors: list[str]
    ) -> RoundSum:
        assert self.strategy is not None
        update = self.strategy.aggregate_round(global_flat, aggregation, plan)
        return RoundSum(update, contributors, update.mean_norm)

    def _outer_copy(self, plan: RoundPlan) -> _OuterCopy | None:
        """The outer state of the fragment ``plan`` steps, as it is before the step, for a host
        that cannot restore it itself (``restore_outer``); None for one that can, or when no
        guard could refuse the step."""
        if self.restore_outer is not None or self.guard is None or self.strategy is None:
            return None
        fragment = self.strategy.fragments[plan.fragment]
        tensors = {k: v.detach().clone() for k, v in fragment.state_tensors().items()}
        meta = {"outer": fragment.outer.state_meta(), "downlink": fragment.downlink.state_meta()}
        return _OuterCopy(fragment, tensors, copy.deepcopy(meta))

    def _rewind(self, global_flat: torch.Tensor, before: _OuterCopy | None) -> str:
        """After an outer step whose result is thrown away, put the outer optimizer's state
        (momentum, downlink residual) back to what goes with the unchanged weights: the host's
        (a checkpoint of these weights) when it has it, or ``before`` (the copy taken before the
        step), else a fresh state. Left as the step made it, the refused step's momentum would
        push every following round out of bounds too."""
        assert self.strategy is not None
        try:
            if self.restore_outer is not None:
                said = self.restore_outer(global_flat)
                if said is not None:
                    return said
            if before is not None:
                before.fragment.load_state(before.tensors, before.meta)
                return "; the outer optimizer state is put back as it was before the step"
            if self.fresh_strategy is None:
                return "; the outer optimizer state could not be rewound (no way to build it anew)"
            fresh = self.fresh_strategy()
            self.strategy.load_state(fresh.state_tensors(), fresh.state_meta())
            return "; the outer optimizer state is reset (no checkpoint holds these weights)"
        except Exception:
            logger.exception("could not rewind the outer optimizer state")
            return "; the outer optimizer state could not be rewound"

"""One description of *what is trained and how*, shared by the simulator, the coordinator and the
emulator's scenarios, and checked in one place.

Each of those configs keeps its own file layout (the round policy sits under ``[simulation]`` in
a simulator file, at the top of a coordinator file and under ``[run]`` in a scenario), so each
hands its values over as a ``TrainingConfig`` (``.training``) together with ``TrainingKeys``,
the dotted names those values have in its file. ``TrainingConfig.validate`` then runs every
cross-field rule once, with errors that name the user's own key: the inner lr schedule's horizon,
the quorum and deadline, what the ddp baseline and privacy cannot do. ``round_policy()`` builds the
``RoundPolicy`` the simulator's virtual clock and the coordinator's real clock both close rounds by.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from geoloco.algorithms.config import ConfigError, require
from geoloco.algorithms.deadline import AdaptiveDeadlineConfig
from geoloco.algorithms.optimizers import InnerOptimizerConfig, OuterOptimizerConfig
from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig, check_privacy_setup
from geoloco.algorithms.robust import check_robust_privacy
from geoloco.algorithms.round import RoundPolicy
from geoloco.algorithms.strategy import AlgorithmConfig

__all__ = ["TrainingConfig", "TrainingKeys"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingKeys:
    """Where a config file keeps the round policy and the run length (for error messages)."""

    min_sites: str = "min_sites"
    round_deadline_s: str = "round_deadline_s"
    adaptive_deadline: str = "adaptive_deadline"
    rounds: str = "rounds"
    sites: str = "sites"
    """What the config calls its list of sites (``allowed_sites`` for a coordinator)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingConfig:
    """The algorithm, both optimizers, privacy, the round policy, the seed and the run length."""

    algorithm: AlgorithmConfig
    inner_optimizer: InnerOptimizerConfig
    outer_optimizer: OuterOptimizerConfig
    privacy: PrivacyConfig
    seed: int = 0
    rounds: int = 0
    """Rounds to run; 0 = no fixed length (a coordinator or scenario bounded otherwise)."""
    min_sites: int | None = None
    """Quorum; None = every site (the scenario's default)."""
    round_deadline_s: float | None = None
    adaptive_deadline: AdaptiveDeadlineConfig | None = None

    @property
    def deadline_enabled(self) -> bool:
        return self.round_deadline_s is not None or (
            self.adaptive_deadline is not None and self.adaptive_deadline.enabled
        )

    def validate(
        self, keys: TrainingKeys, *, num_sites: int | None = None, every_site_reports: bool = False
    ) -> None:
        """Every rule that needs more than one section; ``num_sites`` when the config knows it.

        ``every_site_reports``: sites never fail (the simulator), so a round without a deadline
        always has every site, whatever its quorum."""
        require(self.rounds >= 0, keys.rounds, f"must be >= 0, got {self.rounds}")
        try:  # a decaying inner lr schedule needs a horizon: decay_steps or a fixed run length
            self.inner_optimizer.resolved_decay_steps(
                total_rounds=self.rounds, inner_steps=self.algorithm.inner_steps
            )
        except ConfigError as err:
            raise err.under("inner_optimizer") from None
        if self.min_sites is not None:
            require(self.min_sites >= 1, keys.min_sites, f"must be >= 1, got {self.min_sites}")
            if num_sites is not None:
                require(
                    self.min_sites <= num_sites,
                    keys.min_sites,
                    f"must be <= the number of {keys.sites} ({num_sites}), got {self.min_sites}",
                )
        require(
            self.round_deadline_s is None or (math.isfinite(self.round_deadline_s) and self.round_deadline_s > 0),
            keys.round_deadline_s,
            f"must be > 0 seconds or unset, got {self.round_deadline_s}",
        )
        if self.algorithm.name == "ddp":
            require(
                not self.deadline_enabled,
                keys.round_deadline_s if self.round_deadline_s is not None else f"{keys.adaptive_deadline}.enabled",
                "the ddp baseline waits for every site each step; unset the round deadline",
            )
        if self.privacy.enabled:
            require(
                self.algorithm.name != "ddp" and self.algorithm.warmup_steps == 0,
                "privacy",
                "privacy applies to pseudo-gradient rounds; use diloco, fedavg or fedopt with warmup_steps = 0",
            )
            require(
                not self.algorithm.partial_updates.enabled,
                "algorithm.partial_updates.enabled",
                "partial updates are not combined with [privacy] (secure sums and DP clip whole "
                "updates); disable one of them",
            )
        merge = self.algorithm.asynchronous
        if merge.enabled:
            require(
                not self.privacy.enabled,
                "algorithm.asynchronous.enabled",
                "asynchronous merges take each update on its own clock, while a secure sum needs a "
                "cohort that agrees its masks for one round and DP accounts for rounds of a fixed "
                "cohort; disable [privacy] or [algorithm.asynchronous]",
            )
            require(
                not self.deadline_enabled,
                keys.round_deadline_s if self.round_deadline_s is not None else f"{keys.adaptive_deadline}.enabled",
                "asynchronous merges close by [algorithm.asynchronous] min_quorum and the grace "
                "window, not by a round deadline: unset the round deadline",
            )
            if num_sites is not None:
                require(
                    merge.min_quorum <= num_sites,
                    "algorithm.asynchronous.min_quorum",
                    f"must be <= the number of {keys.sites} ({num_sites}), got {merge.min_quorum}",
                )
        check_robust_privacy(
            self.algorithm.robust_rule, secure_aggregation=self.privacy.secure_aggregation,
            dp=self.privacy.dp, num_sites=num_sites,
        )
        quorum = (
            num_sites if every_site_reports and not self.deadline_enabled
            else self.min_sites if self.min_sites is not None
            else num_sites
        )
        check_privacy_setup(
            self.privacy,
            weighting=self.algorithm.weighting,
            late_updates=self.algorithm.late_updates,
            uplink_codec=self.algorithm.uplink_codec,
            num_sites=num_sites,
            quorum=quorum,
            quorum_key=keys.min_sites,
            deadline_key=(
                f"{keys.adaptive_deadline}.enabled"
                if self.adaptive_deadline is not None and self.adaptive_deadline.enabled
                else keys.round_deadline_s if self.round_deadline_s is not None
                else None
            ),
        )

    def round_policy(self, num_sites: int | None = None) -> RoundPolicy:
        """The policy rounds close by: quorum (``min_sites``, else every site), deadline, late rule."""
        quorum = self.min_sites if self.min_sites is not None else (num_sites or 1)
        return RoundPolicy(
            min_sites=quorum,
            round_deadline_s=self.round_deadline_s,
            adaptive_deadline=self.adaptive_deadline,
            late_updates=self.algorithm.late_updates,
            staleness_discount=self.algorithm.staleness_discount,
        )

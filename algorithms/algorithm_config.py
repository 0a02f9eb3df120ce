"""``[algorithm]``: which algorithm, how often sites synchronise, how updates are compressed,
weighted and streamed, validated in one place (``geoloco.algorithms.strategy`` builds the
``Strategy`` from it)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from geoloco.algorithms.async_merge import AsyncConfig
from geoloco.algorithms.config import ConfigError, config_from_dict, config_to_dict, require
from geoloco.algorithms.link_codec import AdaptiveUplinkConfig
from geoloco.algorithms.partial import PartialUpdatesConfig
from geoloco.algorithms.robust import RobustRule, check_robust_config
from geoloco.algorithms.streaming import StreamingConfig
from geoloco.algorithms.weighting import LATE_UPDATE_POLICIES, WEIGHTINGS
from geoloco.compression import CodecError, parse_codec
from geoloco.compression.sparsify import TopK
from geoloco.compression.tiles import TileTopK

__all__ = ["ALGORITHM_NAMES", "DEFAULT_OUTER_OPTIMIZERS", "DISTRIBUTED_ALGORITHM_NAMES", "PRESETS", "AlgorithmConfig"]

ALGORITHM_NAMES: tuple[str, ...] = ("diloco", "fedavg", "fedopt", "ddp", "sparseloco", "sparseloco-tiles")
DISTRIBUTED_ALGORITHM_NAMES: tuple[str, ...] = tuple(name for name in ALGORITHM_NAMES if name != "ddp")
"""What the real coordinator (and so the emulator) runs: ``ddp`` is the simulator's baseline of
full gradients every step, which no deployment would send over a WAN."""
"""The names ``[algorithm] name`` takes (``geoloco.algorithms.strategy.ALGORITHMS`` maps each to
its strategy class: ``Strategy`` for all but ``ddp``)."""

SPARSELOCO_TILE = 64
"""SparseLoCo's top-k chunk side: the authors chunk each dimension by its largest divisor <= 64,
so a weight matrix of sides divisible by 64 in 64 x 64 = 4096-value chunks."""

SPARSELOCO_DENSITY = 1 / 64
"""The authors' top-k share of a full 64 x 64 chunk: ``topk_compression = 64`` values of 4096."""

PRESETS: dict[str, dict[str, Any]] = {
    "sparseloco": {
        "uplink_codec": f"tiletopk:{SPARSELOCO_DENSITY!r},tile={SPARSELOCO_TILE},divisors|int2mean",
        "error_feedback": True,
        "error_feedback_decay": 0.95,
        "clip_to_median_norm": 1.0,
    },
    "sparseloco-tiles": {
        "uplink_codec": f"tiletopk:0.03,tile={SPARSELOCO_TILE}|int2",
        "error_feedback": True,
        "error_feedback_decay": 0.95,
    },
}
"""``[algorithm]`` keys an algorithm name implies (a preset). ``config_from_dict`` fills in those a
file or dict leaves out; keys given explicitly win.

``sparseloco`` is SparseLoCo (Sarfi et al. 2025) as the authors' code runs it: each dimension of
a tensor chunked by its largest divisor <= 64 (1-D tensors in chunks of <= 64 values), 64 values
kept per chunk (1/64 of a full 64 x 64 chunk; at least 2, even, at most the chunk), the kept
values in 2 bits decoded to per-tensor bin means (``int2mean``), error feedback whose residual
decays by 0.95 per round, and every site's update scaled down to the round's median update norm
(``clip_to_median_norm = 1``; the authors clip tensor by tensor, geoloco the whole update). Its
outer optimizer, plain SGD lr 1, is the name's default (``DEFAULT_OUTER_OPTIMIZERS``).

``sparseloco-tiles`` is what ``sparseloco`` meant before (#27): fixed 64 x 64 tiles (1-D tensors
in 4096-value runs) keeping 3 % of each, values on the block-absmax 2-bit grid (``int2``), the
same error feedback, no clipping. The flat-chunk codec ``topk:0.03,chunk=4096|int2`` is still
accepted for either name."""


DEFAULT_OUTER_OPTIMIZERS: dict[str, str] = {
    "diloco": "nesterov",
    "fedavg": "sgd",
    "fedopt": "fedadam",
    "sparseloco": "sgd",
    "sparseloco-tiles": "sgd",
}
"""The outer optimizer an algorithm name implies when ``[outer_optimizer] name`` is unset (the
strategies differ in nothing else: one ``Strategy`` class runs them all). DiLoCo (Douillard et al.
2023): outer Nesterov SGD, lr 0.7, momentum 0.9. FedAvg / Local SGD (McMahan et al. 2017): outer
SGD lr 1, i.e. the mean of the sites' weights. FedOpt (Reddi et al. 2021): an adaptive outer
optimizer on the pseudo-gradient, FedAdam unless ``outer_optimizer.name`` picks ``fedyogi`` or
torch's bias-corrected ``adam``. SparseLoCo (Sarfi et al. 2025): plain outer SGD lr 1, the paper's
step, and with a sparse codec also the one whose loss fell steadily here (outer Nesterov on sparse
updates rose late in training, #16). ``ddp`` steps the inner optimizer instead."""


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    """Which algorithm, how often sites synchronise, and how updates are compressed and weighted."""

    name: str = "diloco"
    """One of ``ALGORITHM_NAMES``: ``"diloco"``, ``"fedavg"``, ``"fedopt"``, ``"sparseloco"`` or
    ``"sparseloco-tiles"`` (presets: their ``PRESETS`` keys fill in what the file leaves out) or
    ``"ddp"`` (baseline)."""
    inner_steps: int = 50
    """H: inner steps per round (for ``"ddp"``: synchronous steps per reported round)."""
    uplink_codec: str = "none"
    """Codec spec for site -> coordinator updates, e.g. ``"int8"``, ``"topk:0.01|int4"``."""
    downlink_codec: str = "none"
    """Codec spec for the coordinator -> site delta ``θ' − θ_t``."""
    error_feedback: bool = True
    """Keep what a lossy codec dropped and add it to the next update (uplink and downlink)."""
    error_feedback_decay: float = 1.0
    """Factor on the kept residual (1 = keep all; < 1 forgets old errors)."""
    weighting: Literal["uniform", "steps", "samples"] = "uniform"
    """Average site updates uniformly, or weighted by the inner steps each site ran (for
    time-budget rounds), or by the samples it trained on (``geoloco.algorithms.weighting``)."""
    warmup_steps: int = 0
    """Synchronous data-parallel steps before the first round (their bytes are counted)."""
    # -- heterogeneous sites (geoloco.algorithms.time_budget / weighting) --
    round_time_budget_s: float | None = None
    """Time-budget rounds: each site runs as many inner steps as fit in this many seconds of
    training (at least one) instead of ``inner_steps``; unset = ``inner_steps`` per round."""
    late_updates: Literal["drop", "fold"] = "drop"
    """An update that misses its round's deadline: ``"drop"`` (the site keeps it in its
    error-feedback residual) or ``"fold"`` (arriving one round late, it enters the next round's
    average with weight ``w_k · staleness_discount``)."""
    staleness_discount: float = 0.5
    """Factor on the weight of an update folded in one round late (``late_updates = "fold"``)."""
    # -- robust aggregation (geoloco.algorithms.robust; only without secure aggregation and DP) --
    aggregation: Literal["mean", "trimmed_mean", "median"] = "mean"
    """How a round's updates are combined: ``"mean"`` (the weighted mean, one running buffer),
    ``"trimmed_mean"`` (per coordinate, drop the ``trim_fraction`` largest and smallest values)
    or ``"median"`` (per coordinate). The last two are unweighted and hold every update of the
    round (``N × model`` memory at the coordinator)."""
    trim_fraction: float = 0.25
    """``"trimmed_mean"``: share of the round's updates dropped at each end, in [0, 0.5)."""
    clip_to_median_norm: float | None = None
    """Scale every update whose L2 norm exceeds this multiple (>= 1) of the round's median
    update norm down to it, before combining; unset = no clipping. Holds every update of the
    round (the median needs all norms first)."""
    partial_updates: PartialUpdatesConfig = field(default_factory=PartialUpdatesConfig)
    """Partial Parameter Updates (``[algorithm.partial_updates]``): each site trains a fixed
    subset of the parameters and uploads only that; see ``geoloco.algorithms.partial``."""
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    """Streaming DiLoCo (``[algorithm.streaming]``): fragments on a staggered schedule, transfers
    overlapped with training; see ``geoloco.algorithms.streaming``."""
    adaptive_uplink: AdaptiveUplinkConfig = field(default_factory=AdaptiveUplinkConfig)
    """Per-site uplink codecs that fit each site's measured link (``[algorithm.adaptive_uplink]``);
    see ``geoloco.algorithms.link_codec``."""
    asynchronous: AsyncConfig = field(default_factory=AsyncConfig)
    """Decoupled (asynchronous) DiLoCo (``[algorithm.asynchronous]``): no round barrier, the
    synchronizer merges what has arrived; see ``geoloco.algorithms.async_merge``."""

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def prepare_config_dict(cls, data: Mapping[str, Any]) -> Mapping[str, Any]:
        """The preset of ``data["name"]`` (``PRESETS``) under the keys ``data`` sets itself."""
        name = data.get("name")
        preset = PRESETS.get(name) if isinstance(name, str) else None
        return data if preset is None else {**preset, **data}

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> AlgorithmConfig:
        """``name``'s preset with ``overrides`` on top, checked like a file's ``[algorithm]``;
        for code, since ``AlgorithmConfig(name="sparseloco")`` alone does not fill a preset in."""
        return config_from_dict(cls, {"name": name, **overrides})

    def validate(self) -> None:
        require(
            self.name in ALGORITHM_NAMES,
            "name",
            f"unknown algorithm {self.name!r}; valid names: {', '.join(ALGORITHM_NAMES)}",
        )
        require(self.inner_steps >= 1, "inner_steps", f"must be >= 1, got {self.inner_steps}")
        for key in ("uplink_codec", "downlink_codec"):
            try:
                parse_codec(getattr(self, key))
            except (CodecError, ValueError) as err:
                raise ConfigError(key, str(err)) from None
        if self.name in PRESETS:
            require(
                isinstance(getattr(parse_codec(self.uplink_codec), "sparsifier", None), (TopK, TileTopK)),
                "uplink_codec",
                f"{self.name} sends chunked top-k updates, got {self.uplink_codec!r}; leave "
                f"uplink_codec unset for the preset's {PRESETS[self.name]['uplink_codec']!r} "
                f"(in code: AlgorithmConfig.preset(\"{self.name}\", ...)) or give a 'tiletopk:F' or "
                "'topk:F' codec",
            )
        require(
            0 < self.error_feedback_decay <= 1,
            "error_feedback_decay",
            f"must be in (0, 1], got {self.error_feedback_decay}",
        )
        require(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        require(
            self.weighting in WEIGHTINGS,
            "weighting",
            f"got {self.weighting!r}; allowed values: {', '.join(WEIGHTINGS)}",
        )
        require(
            self.round_time_budget_s is None
            or (math.isfinite(self.round_time_budget_s) and self.round_time_budget_s > 0),
            "round_time_budget_s",
            f"must be > 0 seconds or unset, got {self.round_time_budget_s}",
        )
        require(
            self.late_updates in LATE_UPDATE_POLICIES,
            "late_updates",
            f"got {self.late_updates!r}; allowed values: {', '.join(LATE_UPDATE_POLICIES)}",
        )
        require(
            0 < self.staleness_discount <= 1,
            "staleness_discount",
            f"must be in (0, 1], got {self.staleness_discount}",
        )
        require(
            not (self.name == "ddp" and self.round_time_budget_s is not None),
            "round_time_budget_s",
            "the ddp baseline synchronises every step; unset round_time_budget_s",
        )
        require(
            not (self.name == "ddp" and self.warmup_steps > 0),
            "warmup_steps",
            "the ddp baseline is data-parallel throughout; set warmup_steps = 0",
        )
        check_robust_config(
            self.robust_rule, algorithm=self.name, weighting=self.weighting, late_updates=self.late_updates
        )
        if self.partial_updates.enabled:
            require(
                self.name != "ddp",
                "partial_updates.enabled",
                "the ddp baseline uploads full gradients every step; partial updates need "
                "diloco, fedavg, fedopt or sparseloco",
            )
            require(
                not self.streaming.enabled,
                "partial_updates.enabled",
                "partial updates and streaming fragments both cut the model; use one of them",
            )
            require(
                not self.robust_rule.enabled,
                "partial_updates.enabled",
                "robust aggregation compares whole updates coordinate by coordinate; partial "
                "updates cover different coordinates per site: use aggregation = \"mean\""
                + (
                    " (the sparseloco preset clips to the median norm: use name = \"sparseloco-tiles\", "
                    "which does not)"
                    if self.name == "sparseloco"
                    else ""
                ),
            )
        if self.adaptive_uplink.enabled:
            why = self.adaptive_uplink.check_base_codec(self.uplink_codec)
            require(why is None, "uplink_codec", why or "")
            require(
                self.name != "ddp" and not self.streaming.enabled and not self.partial_updates.enabled,
                "adaptive_uplink.enabled",
                "per-site codecs apply to plain DiLoCo-family rounds; disable ddp, streaming or "
                "partial_updates, or adaptive_uplink",
            )
        # Streaming DiLoCo: checks that need H and the algorithm.
        if self.streaming.enabled:
            require(
                self.name != "ddp",
                "streaming.enabled",
                "the ddp baseline synchronises every step; streaming needs diloco, fedavg or fedopt",
            )
            require(
                self.round_time_budget_s is None,
                "round_time_budget_s",
                "streaming rounds are H/P inner steps on a schedule every site derives from the "
                "step counter, so they cannot be time budgets; unset round_time_budget_s or "
                "disable algorithm.streaming",
            )
            require(
                self.late_updates == "drop",
                "late_updates",
                "with streaming the next round syncs a different fragment, so a late update cannot "
                "be folded into it; set late_updates = \"drop\" (the site keeps it in its residual)",
            )
            try:
                self.streaming.check_inner_steps(self.inner_steps)
            except ConfigError as err:
                raise err.under("streaming") from None

        if self.asynchronous.enabled:
            self._validate_asynchronous()

    def shared_round_features(self) -> list[str]:
        """The enabled settings that assume one round every site trains for, named for a
        message: what asynchronous merges (every host) and the event-driven simulator's sites on
        their own clocks (chaos) cannot run."""
        features = [
            (self.name == "ddp", "the ddp baseline (set name to diloco, fedavg, fedopt or sparseloco)"),
            (self.streaming.enabled, "Streaming DiLoCo ([algorithm.streaming])"),
            (self.adaptive_uplink.enabled, "adaptive uplink codecs ([algorithm.adaptive_uplink])"),
            (self.late_updates == "fold", "folding late updates (late_updates = \"fold\")"),
            (self.round_time_budget_s is not None,
             "time-budget rounds (round_time_budget_s; dynamic_local_updates sizes phases by speed)"),
            (self.warmup_steps > 0, "a data-parallel warm-up (warmup_steps)"),
        ]
        return [what for enabled, what in features if enabled]

    def _validate_asynchronous(self) -> None:
        """What asynchronous merges cannot take, for every host that runs them."""
        unsupported = self.shared_round_features()
        if self.partial_updates.enabled:
            unsupported.append("partial updates ([algorithm.partial_updates])")
        if unsupported:
            raise ConfigError(
                "asynchronous.enabled",
                f"asynchronous merges do not run with {unsupported[0]}; change that, or disable "
                "[algorithm.asynchronous]",
            )

    @property
    def robust_rule(self) -> RobustRule:
        """The round aggregation rule these keys describe (``RobustRule.enabled`` is False for
        the plain mean)."""
        return RobustRule(
            aggregation=self.aggregation,
            trim_fraction=self.trim_fraction,
            clip_to_median_norm=self.clip_to_median_norm,
        )

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)

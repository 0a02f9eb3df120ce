"""What a simulated run is told: the run's length and round policy, the sites, and the record
each round yields. TOML sections map onto these dataclasses one to one."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from geoloco.algorithms.config import ConfigError, config_from_dict, config_to_dict, require
from geoloco.algorithms.deadline import AdaptiveDeadlineConfig
from geoloco.algorithms.optimizers import InnerOptimizerConfig, OuterOptimizerConfig
from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
from geoloco.algorithms.simulation.chaos import ChaosConfig
from geoloco.algorithms.simulation.clock import SiteConfig
from geoloco.algorithms.simulation.sim_regions import CoordinatorLinkSpec, RegionSpec, TwoTierClock, check_regions
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.algorithms.training import RUN_KEYS, RunLayout, TrainingConfig
from geoloco.algorithms.update_guard import UpdateGuardConfig

__all__ = [
    "DEFAULT_EVAL_EVERY",
    "DEFAULT_ROUNDS",
    "MEASURE",
    "SIMULATE_RUN",
    "SIMULATOR_KEYS",
    "SimulationConfig",
    "SimulatorConfig",
]

logger = logging.getLogger(__name__)

SIMULATOR_KEYS = RUN_KEYS
"""Where a simulator file keeps the round policy and the run length (``[run]``)."""

SIMULATE_RUN = RunLayout(
    {
        key: f"simulation.{key}"
        for key in (
            "rounds", "total_inner_steps", "target_eval_loss", "eval_every", "eval_every_steps", "seed",
            "min_sites", "round_deadline_s", "adaptive_deadline", "max_wall_clock_s",
        )
    },
    kind="a simulate file",
)
"""The fields of ``SimulationConfig`` a simulate file writes under ``[run]`` (before: under
``[simulation]``, which keeps the simulator's own keys: ``step_time_s``, ``device``, ``chaos``)."""

DEFAULT_ROUNDS = 100
"""Run length when neither ``rounds`` nor ``total_inner_steps`` is set."""
DEFAULT_EVAL_EVERY = 10
"""Evaluation period in rounds when neither ``eval_every`` nor ``eval_every_steps`` is set."""

MEASURE = "measure"
"""``step_time_s`` value that uses the measured wall time of the real inner steps."""


@dataclass(kw_only=True, slots=True)
class SimulationConfig:
    """The simulator's virtual clock, device and failure model; in Python also how long to run,
    what to measure and the coordinator's round policy, which a file writes under ``[run]``.

    (``SIMULATE_RUN`` says which fields those are.)"""

    MOVED_TO_RUN: ClassVar[frozenset[str]] = frozenset(
        path.split(".", 1)[1] for path in SIMULATE_RUN.fields.values()
    )
    """Fields a file writes under ``[run]``: not offered as ``[simulation]`` keys in errors."""

    rounds: int | None = None
    """Maximum number of rounds (the run stops earlier once ``target_eval_loss`` is reached).
    Set this or ``total_inner_steps``, not both; neither = 100 rounds."""
    total_inner_steps: int | None = None
    """Run length in inner steps per site, warm-up included, the same for every algorithm (for
    ``ddp`` each synchronous step is one): the rounds are derived
    (``SimulatorConfig.run_rounds``), so runs with different H train on the same data."""
    target_eval_loss: float | None = None
    """Stop at the first evaluation whose loss is <= this (time-to-target runs); unset = never."""
    eval_every: int | None = None
    """Evaluate the global model every this many rounds (and always after the last round). Set
    this or ``eval_every_steps``, not both; neither = every 10 rounds."""
    eval_every_steps: int | None = None
    """Evaluate after the first round that reaches each multiple of this many cumulative inner
    steps per site (and always after the last round): the same points whatever H is, where H
    divides it."""
    seed: int = 0
    """Seed of the model initialisation, the data streams and the codecs' randomness."""
    step_time_s: float | Literal["measure"] = 0.1
    """Virtual seconds per inner step of a reference site, or ``"measure"`` (real wall time)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model trains: ``"auto"`` picks CUDA when available."""
    round_deadline_s: float | None = None
    """Uploads arriving later than this after the round opened are left out (stragglers keep
    their update in their error-feedback residual); unset = wait for every site."""
    min_sites: int = 1
    """Quorum: with a deadline, wait past it until at least this many uploads arrived."""
    adaptive_deadline: AdaptiveDeadlineConfig = field(default_factory=AdaptiveDeadlineConfig)
    """``[run.adaptive_deadline]``: learn each round's deadline from recent arrivals
    (``geoloco.algorithms.deadline``); ``round_deadline_s`` is then the first rounds' deadline."""
    max_wall_clock_s: float | None = None
    """Stop the run when the virtual clock reaches this many seconds, the global model evaluated
    then (runs compared at equal wall-clock); only for the event-driven simulator
    (``[algorithm.asynchronous]`` or ``[simulation.chaos]`` enabled), where a merge is a
    round and ``rounds`` still bounds the run. Required when sites fail."""
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    """``[simulation.chaos]``: failures, repairs and slowdowns of the sites, from a seed."""

    def __post_init__(self) -> None:
        # Defaults only where the other key of the pair is unset, so "both set" stays an error.
        if self.rounds is None and self.total_inner_steps is None:
            self.rounds = DEFAULT_ROUNDS
        if self.eval_every is None and self.eval_every_steps is None:
            self.eval_every = DEFAULT_EVAL_EVERY
        self.validate()

    @classmethod
    def prepare_config_dict(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        """Run-length keys may be unset but, when set, are whole numbers: say so plainly rather
        than naming the ``int | None`` annotation."""
        for key in ("rounds", "total_inner_steps", "eval_every", "eval_every_steps"):
            value = data.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(key, f"got {value!r}; expected an integer")
        return dict(data)

    def validate(self) -> None:
        for count, steps in (("rounds", "total_inner_steps"), ("eval_every", "eval_every_steps")):
            a, b = getattr(self, count), getattr(self, steps)
            require(
                (a is None) != (b is None),
                steps if b is not None else count,
                f"set either {count} (in rounds) or {steps} (in inner steps per site), not both"
                if a is not None else f"set one of {count} (in rounds) or {steps} (in inner steps per site)",
            )
            for key, value in ((count, a), (steps, b)):
                require(value is None or value >= 1, key, f"must be >= 1, got {value}")
        if not isinstance(self.step_time_s, str):
            require(
                self.step_time_s >= 0,
                "step_time_s",
                f"must be >= 0 seconds or \"{MEASURE}\", got {self.step_time_s}",
            )
        else:
            require(
                self.step_time_s == MEASURE,
                "step_time_s",
                f"must be a number of seconds or \"{MEASURE}\", got {self.step_time_s!r}",
            )
        require(
            self.target_eval_loss is None or math.isfinite(self.target_eval_loss),
            "target_eval_loss",
            f"must be a finite number or unset, got {self.target_eval_loss}",
        )
        require(self.min_sites >= 1, "min_sites", f"must be >= 1, got {self.min_sites}")
        require(
            self.max_wall_clock_s is None or (math.isfinite(self.max_wall_clock_s) and self.max_wall_clock_s > 0),
            "max_wall_clock_s", f"must be > 0 seconds or unset, got {self.max_wall_clock_s}",
        )

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


def _default_sites() -> list[SiteConfig]:
    return [SiteConfig() for _ in range(4)]


@dataclass(kw_only=True, slots=True)
class SimulatorConfig:
    """Everything a simulated run needs besides the workload; TOML sections map onto the fields
    (``[run]`` onto ``simulation``'s run fields: ``SIMULATE_RUN``)."""

    RUN_LAYOUT: ClassVar[RunLayout] = SIMULATE_RUN
    """Where a file's ``[run]`` keys go among the fields (``SIMULATE_RUN``)."""

    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Algorithm, H, codecs, error feedback, weighting, warm-up."""
    inner_optimizer: InnerOptimizerConfig = field(default_factory=InnerOptimizerConfig)
    """Each site's optimizer for its inner steps (the shared optimizer for ``ddp``)."""
    outer_optimizer: OuterOptimizerConfig = field(default_factory=OuterOptimizerConfig)
    """The coordinator's optimizer on the averaged pseudo-gradient (unused by ``ddp``)."""
    sites: list[SiteConfig] = field(default_factory=_default_sites)
    """One entry per site (in a file: ``[[sites]]`` entries, or a ``[sites]`` table with
    ``count`` plus the fields every site shares)."""
    simulation: SimulationConfig = field(default_factory=SimulationConfig)
    """The virtual clock, the device and the failure model; in Python also the run's length,
    evaluation, seed and round policy, which a file writes under ``[run]`` (``SIMULATE_RUN``)."""
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    """Secure aggregation and differential privacy (``geoloco.algorithms.privacy.private_aggregation``)."""
    regions: list[RegionSpec] = field(default_factory=list)
    """``[[regions]]``: relays, as in an emulator scenario; the clock then charges two tiers
    (``geoloco.algorithms.simulation.sim_regions``). Sites are named by ``name`` (unset: ``site-K``)."""
    coordinator_link: CoordinatorLinkSpec = field(default_factory=CoordinatorLinkSpec)
    """``[coordinator_link]``: the coordinator's link, shared by every transfer crossing it."""
    update_guard: UpdateGuardConfig = field(default_factory=UpdateGuardConfig)
    """``[update_guard]``: the coordinator's bounds on each update and on the new weights, the
    same section as a coordinator file's; an update outside is rejected and a round whose mean
    or weights go out of bounds is aborted, as the real coordinator does."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def site_names(self) -> list[str]:
        return [site.name or f"site-{k}" for k, site in enumerate(self.sites)]

    def tier_clock(self) -> TwoTierClock | None:
        """The two-tier clock when regions or a shaped coordinator link are declared, else None
        (every site on its own link: ``geoloco.algorithms.simulation.clock``)."""
        if not self.regions and not self.coordinator_link.shaped:
            return None
        return TwoTierClock.from_specs(self.sites, self.site_names, self.regions, self.coordinator_link)

    def validate(self) -> None:
        require(len(self.sites) >= 1, "sites", "at least one site is needed")
        check_regions(self.regions, self.site_names, privacy=self.privacy, algorithm=self.algorithm)
        if self.regions or self.coordinator_link.shaped:
            algo = self.algorithm
            require(
                algo.name != "ddp" and not algo.streaming.enabled and self.simulation.round_deadline_s is None,
                "regions",
                "the two-tier clock models rounds that wait for every site: drop "
                "run.round_deadline_s, streaming and the ddp baseline, or drop [[regions]] "
                "and [coordinator_link]",
            )
        for k, site in enumerate(self.sites):
            require(
                site.attack is None or self.algorithm.name != "ddp",
                f"sites[{k}].attack",
                "poisoned sites replace a round's pseudo-gradient; the ddp baseline uploads plain "
                "gradients every step: use diloco, fedavg or fedopt, or unset attack",
            )
        self._validate_step_run_length()
        self._validate_event_driven()
        self.training.validate(SIMULATOR_KEYS, num_sites=len(self.sites), every_site_reports=True)

    @property
    def event_driven(self) -> bool:
        """The run needs the event-driven simulator (``geoloco.algorithms.simulation.async_sim``): sites on
        their own clocks, asynchronous merges or failures."""
        return self.algorithm.asynchronous.enabled or self.simulation.chaos.enabled

    def _validate_event_driven(self) -> None:
        """What the event-driven simulator (asynchronous merges, chaos) models, checked in one
        place; everything else keeps the round-by-round simulator."""
        sim, algo = self.simulation, self.algorithm
        merge = algo.asynchronous
        if not self.event_driven:
            require(
                sim.max_wall_clock_s is None,
                "run.max_wall_clock_s",
                "only the event-driven simulator stops on the virtual clock: enable "
                "[algorithm.asynchronous] or [simulation.chaos], or set rounds instead",
            )
            return
        key = "algorithm.asynchronous" if merge.enabled else "simulation.chaos"
        # AlgorithmConfig refuses these for asynchronous merges already; chaos alone meets them here.
        unsupported = [(True, what) for what in algo.shared_round_features()] + [
            (self.privacy.secure_aggregation or self.privacy.dp != "off", "secure aggregation or DP ([privacy])"),
            (bool(self.regions) or self.coordinator_link.shaped, "regions and a shaped coordinator link"),
            (sim.step_time_s == MEASURE, "measured step times (step_time_s = \"measure\"; give seconds)"),
            (sim.total_inner_steps is not None or sim.eval_every_steps is not None,
             "run lengths in inner steps (total_inner_steps, eval_every_steps; use rounds, eval_every "
             "and max_wall_clock_s)"),
        ]
        for refused, what in unsupported:
            require(
                not refused, key,
                f"the event-driven simulator does not model {what}; change that, or disable "
                "[algorithm.asynchronous] and [simulation.chaos]",
            )
        require(
            not sim.chaos.failures or sim.max_wall_clock_s is not None,
            "run.max_wall_clock_s",
            "sites fail ([simulation.chaos] mtbf_s): bound the run on the virtual clock too, or a "
            "rule that cannot finish its rounds (a lock-step restart) runs for ever",
        )

    def _validate_step_run_length(self) -> None:
        sim, algo = self.simulation, self.algorithm
        if sim.total_inner_steps is None and sim.eval_every_steps is None:
            return
        key = "run.total_inner_steps" if sim.total_inner_steps is not None else "run.eval_every_steps"
        require(
            algo.round_time_budget_s is None,
            key,
            "the inner steps of a round vary with algorithm.round_time_budget_s; set "
            "run.rounds and run.eval_every instead, or unset round_time_budget_s",
        )
        if sim.total_inner_steps is not None:
            require(
                sim.total_inner_steps > algo.warmup_steps,
                "run.total_inner_steps",
                f"counts the warm-up too: must be > algorithm.warmup_steps ({algo.warmup_steps}), "
                f"got {sim.total_inner_steps}",
            )

    @property
    def steps_per_round(self) -> int:
        """Inner steps each site runs in one round: H, or H / fragments with Streaming DiLoCo; a
        ``ddp`` round reports H synchronous steps. Without meaning under ``round_time_budget_s``."""
        algo = self.algorithm
        return algo.inner_steps // (algo.streaming.fragments if algo.streaming.enabled else 1)

    @property
    def run_rounds(self) -> int:
        """The run's number of rounds: ``run.rounds``, or the fewest rounds whose inner
        steps (after the warm-up) reach ``run.total_inner_steps``."""
        sim = self.simulation
        if sim.rounds is not None:
            return sim.rounds
        assert sim.total_inner_steps is not None  # SimulationConfig.validate: exactly one is set
        return -(-(sim.total_inner_steps - self.algorithm.warmup_steps) // self.steps_per_round)

    def evaluates_after(self, round_number: int, steps_before: int, steps_after: int) -> bool:
        """Whether the global model is evaluated after ``round_number`` (from 0), whose inner steps
        per site took the cumulative count from ``steps_before`` to ``steps_after``."""
        sim = self.simulation
        if round_number == self.run_rounds - 1:
            return True
        if sim.eval_every_steps is not None:
            return steps_after // sim.eval_every_steps > steps_before // sim.eval_every_steps
        assert sim.eval_every is not None
        return (round_number + 1) % sim.eval_every == 0

    @property
    def training(self) -> TrainingConfig:
        """What is trained and how, as the coordinator and the emulator describe it too."""
        sim = self.simulation
        return TrainingConfig(
            algorithm=self.algorithm,
            inner_optimizer=self.inner_optimizer,
            outer_optimizer=self.outer_optimizer,
            privacy=self.privacy,
            seed=sim.seed,
            rounds=self.run_rounds,
            min_sites=sim.min_sites,
            round_deadline_s=sim.round_deadline_s,
            adaptive_deadline=sim.adaptive_deadline,
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SimulatorConfig:
        """Build from a parsed TOML/JSON dict; errors name the dotted key and what is allowed.

        ``sites`` may be a list of site tables, or one table with ``count`` (default 4) and the
        fields all sites share; the run's knobs sit under ``[run]`` (``SIMULATE_RUN``). Errors
        name the key as ``data`` has it. ``to_file_dict()`` writes this form; ``to_dict()``'s
        field form is the old layout, read with its deprecation warning.
        """
        return config_from_dict(cls, data)

    def to_file_dict(self) -> dict[str, Any]:
        """``to_dict`` in the file form (``[run]``), for a file that is read again."""
        return SIMULATE_RUN.lower(self.to_dict())

    @classmethod
    def prepare_config_dict(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        """The file form as fields (``[run]`` is already lifted into ``simulation`` by
        ``config_from_dict``, from ``RUN_LAYOUT``): a ``[sites]`` table with ``count`` becomes
        the site list; ``[simulation.asynchronous]`` (its place until the
        coordinator ran asynchronous merges too) is read as ``[algorithm.asynchronous]``, with a
        warning that shows the new key."""
        data = dict(data)
        simulation = data.get("simulation")
        if isinstance(simulation, Mapping) and "asynchronous" in simulation:
            simulation = dict(simulation)
            moved = simulation.pop("asynchronous")
            algorithm = data.get("algorithm", {})
            if isinstance(algorithm, Mapping) and "asynchronous" in algorithm:
                raise ConfigError(
                    "simulation.asynchronous",
                    "is the old place of [algorithm.asynchronous], and the file sets both: keep "
                    "only [algorithm.asynchronous]",
                )
            if isinstance(algorithm, Mapping):
                logger.warning(
                    "[simulation.asynchronous] is deprecated and will stop being read in the next "
                    "release: rename the table to [algorithm.asynchronous] (same keys)"
                )
                data["algorithm"] = {**algorithm, "asynchronous": moved}
                data["simulation"] = simulation
        sites = data.get("sites")
        for key, table in _site_tables(sites):
            if isinstance(table, Mapping) and "step_time_factor" in table:
                raise ConfigError(
                    f"{key}.step_time_factor",
                    "was renamed: use speed_factor = 1 / step_time_factor (compute speed relative to "
                    "the reference site, 0.5 = half as fast), the name scenario files use",
                )
        if isinstance(sites, Mapping):
            shared = dict(sites)
            count = shared.pop("count", 4)
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ConfigError("sites.count", f"must be an integer >= 1, got {count!r}")
            template = config_from_dict(SiteConfig, shared, prefix="sites")
            data["sites"] = [config_to_dict(template) for _ in range(count)]
        elif sites is not None and not isinstance(sites, list):
            raise ConfigError(
                "sites", "expected a list of [[sites]] tables or a [sites] table with count"
            )
        return data

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


def _site_tables(sites: Any) -> list[tuple[str, Any]]:
    if isinstance(sites, Mapping):
        return [("sites", sites)]
    if isinstance(sites, list):
        return [(f"sites[{i}]", table) for i, table in enumerate(sites)]
    return []

"""Emulation scenarios: one TOML file describes a whole experiment, validated before anything starts.

A scenario file has these sections (the shipped ``scenarios/*.toml`` show every key with a
comment):

- ``[workload]``: ``name`` (``gpt`` or ``mlp``) plus the workload's options (its config dataclass).
- ``[algorithm]``, ``[inner_optimizer]``, ``[outer_optimizer]``: the same dataclasses the simulator
  and the coordinator use (``AlgorithmConfig``, ``InnerOptimizerConfig``, ``OuterOptimizerConfig``).
- ``[run]``: rounds or a time budget, seed, quorum, round deadline, heartbeats (``RunSettings``).
- ``[[sites]]``: one table per site: link (bandwidth, latency, jitter, loss), compute speed factor,
  data shard (``EmulatedSite``).
- ``[[faults]]``: faults fired on schedule (``Fault``).
- ``[privacy]``: secure aggregation and differential privacy (``PrivacyConfig``, the same table as
  ``geoloco simulate`` and ``geoloco coordinator`` take).
- ``[[regions]]`` and ``[coordinator_link]``: regional relays and the coordinator's shared link
  (``RegionSpec``, ``CoordinatorLinkSpec`` in ``geoloco.algorithms.simulation.sim_regions``).

Every error names the file, the dotted key and what is allowed (``ScenarioError``), and is raised
by ``load_scenario`` before any process starts. The parsing reuses the simulator's machinery:
``geoloco.algorithms.config.config_from_dict`` for keys and types, and ``ConfigFileError``
and the TOML reader of ``geoloco simulate`` for the file-level wording.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from geoloco.algorithms.algorithm_config import DISTRIBUTED_ALGORITHM_NAMES
from geoloco.algorithms.config import ConfigError, config_from_dict, config_to_dict, require
from geoloco.algorithms.deadline import AdaptiveDeadlineConfig
from geoloco.algorithms.optimizers import InnerOptimizerConfig, OuterOptimizerConfig
from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
from geoloco.algorithms.simulation.clock import SiteConfig
from geoloco.algorithms.simulation.sim_regions import CoordinatorLinkSpec, RegionSpec, TwoTierClock, check_regions
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.algorithms.training import TrainingConfig, TrainingKeys
from geoloco.protos.identity import validate_site_name
from geoloco.scenarios.config_file import ConfigFileError, read_toml
from geoloco.scenarios.workloads import WorkloadSpec, parse_workload

__all__ = [
    "FAULT_KINDS",
    "SECTIONS",
    "EmulatedSite",
    "Fault",
    "RunSettings",
    "Scenario",
    "ScenarioError",
    "load_scenario",
    "parse_scenario",
]

SCENARIO_KEYS = TrainingKeys(
    min_sites="run.min_sites",
    round_deadline_s="run.round_deadline_s",
    adaptive_deadline="run.adaptive_deadline",
    rounds="run.rounds",
)
"""Where a scenario file keeps the round policy and the run length."""

ScenarioError = ConfigFileError
"""A problem in a scenario file: ``ScenarioError(source, key, message)``, printed as
``FILE: key: message``. The same class as ``geoloco simulate``'s, so both commands word errors
alike."""

SECTIONS = (
    "workload", "algorithm", "inner_optimizer", "outer_optimizer", "run", "sites", "faults", "privacy",
    "regions", "coordinator_link",
)
"""Top-level keys of a scenario file."""

KILL_SITE = "kill_site"
KILL_COORDINATOR = "kill_coordinator"
CUT_LINK = "cut_link"
FAULT_KINDS = (KILL_SITE, KILL_COORDINATOR, CUT_LINK)
"""What a ``[[faults]]`` entry can do."""



@dataclass(kw_only=True, slots=True)
class EmulatedSite:
    """One site process and its shaped link to the coordinator."""

    name: str
    """Site name: certificate name, metrics label (letters, digits, '.', '_', '-')."""
    uplink_bps: float = 1e8
    """Site -> coordinator bandwidth in bits per second."""
    downlink_bps: float = 1e8
    """Coordinator -> site bandwidth in bits per second."""
    latency_s: float = 0.05
    """One-way latency in seconds, added to every byte in each direction."""
    jitter_s: float = 0.0
    """Extra one-way delay drawn uniformly from ``[0, jitter_s]`` per forwarded segment (bytes
    stay in order, as over TCP)."""
    loss: float = 0.0
    """Probability that a TCP segment (1448 bytes) is lost; modelled as a retransmission delay
    (``RETRANSMIT_MIN_S`` + one round trip) that holds the rest of the stream back."""
    flow_window_bytes: int | None = None
    """Bytes one TCP connection of the site may have in flight: each connection then moves at
    most ``flow_window_bytes / (2 * latency_s)``, as a real one whose window is below the link's
    bandwidth-delay product (so K parallel streams move up to K times that). Unset: connections
    are bounded by the bandwidth alone."""
    speed_factor: float = 1.0
    """Compute speed relative to this machine: 0.5 trains at half speed (each inner step is
    followed by a sleep as long as the step itself)."""
    data_shard: int | None = None
    """Which part of the workload's data split this site trains on (0 .. number of sites - 1);
    unset = the site's position in the list. Two sites on the same shard hold the same data."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        try:
            validate_site_name(self.name)
        except ValueError as err:
            raise ConfigError("name", str(err)) from None
        for key in ("uplink_bps", "downlink_bps"):
            value = getattr(self, key)
            require(
                math.isfinite(value) and value >= 1000,
                key,
                f"must be a bandwidth >= 1000 bits/s (e.g. 1e8 for 100 Mbit/s), got {value}",
            )
        require(
            0 <= self.latency_s <= 10, "latency_s", f"must be in 0..10 seconds, got {self.latency_s}"
        )
        require(0 <= self.jitter_s <= 10, "jitter_s", f"must be in 0..10 seconds, got {self.jitter_s}")
        require(
            0 <= self.loss < 0.5,
            "loss",
            f"must be a probability in [0, 0.5) per segment, got {self.loss}",
        )
        require(
            self.flow_window_bytes is None or self.flow_window_bytes >= 1448,
            "flow_window_bytes",
            f"must be >= 1448 bytes (one TCP segment; e.g. 4194304 for 4 MiB) or unset, got {self.flow_window_bytes}",
        )
        require(
            0 < self.speed_factor <= 1,
            "speed_factor",
            f"must be in (0, 1]: 1 is this machine's speed, 0.25 four times slower (the emulator "
            f"can only slow compute down), got {self.speed_factor}",
        )
        require(
            self.data_shard is None or self.data_shard >= 0,
            "data_shard",
            f"must be >= 0 or unset, got {self.data_shard}",
        )

    def clock_site(self) -> SiteConfig:
        """The simulator's view of this site (same link, same speed factor)."""
        return SiteConfig(
            name=self.name,
            uplink_bps=self.uplink_bps,
            downlink_bps=self.downlink_bps,
            latency_s=self.latency_s,
            speed_factor=self.speed_factor,
        )

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


@dataclass(kw_only=True, slots=True)
class RunSettings:
    """How long the run lasts and the coordinator's round policy."""

    rounds: int = 10
    """Rounds to train; 0 = until ``time_budget_s`` runs out."""
    time_budget_s: float | None = None
    """Stop the run (cleanly, with a report) after this many seconds; unset = no limit."""
    seed: int = 0
    """Seed of the model initialisation, the data streams and the codecs."""
    eval_every: int = 1
    """The coordinator evaluates the global weights every this many rounds (and after the last)."""
    min_sites: int | None = None
    """Quorum: rounds start with and aggregate at least this many sites; unset = every site."""
    round_deadline_s: float | None = None
    """Uploads later than this after the round opened are left out (stragglers catch up);
    unset = every round waits for every member. With ``adaptive_deadline``: the first rounds'."""
    adaptive_deadline: AdaptiveDeadlineConfig = field(default_factory=AdaptiveDeadlineConfig)
    """``[run.adaptive_deadline]``: each round's deadline from recent arrival times (quantile x
    margin, bounded by min_s/max_s), passed to the coordinator."""
    heartbeat_interval_s: float = 1.0
    """Sites send a heartbeat this often."""
    heartbeat_timeout_s: float = 6.0
    """A site silent this long is dropped from the run (how fast a killed site is noticed)."""
    timeout_s: float = 1800.0
    """The emulator gives up (and reports a failure) after this many seconds."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        require(self.rounds >= 0, "rounds", f"must be >= 0, got {self.rounds}")
        require(
            self.rounds > 0 or self.time_budget_s is not None,
            "rounds",
            "rounds = 0 runs until a time budget runs out; set rounds >= 1 or time_budget_s",
        )
        require(
            self.time_budget_s is None or (math.isfinite(self.time_budget_s) and self.time_budget_s > 0),
            "time_budget_s",
            f"must be > 0 seconds or unset, got {self.time_budget_s}",
        )
        require(self.eval_every >= 1, "eval_every", f"must be >= 1, got {self.eval_every}")
        require(
            self.heartbeat_interval_s > 0,
            "heartbeat_interval_s",
            f"must be > 0 seconds, got {self.heartbeat_interval_s}",
        )
        require(
            self.heartbeat_timeout_s >= 2 * self.heartbeat_interval_s,
            "heartbeat_timeout_s",
            f"must be at least twice heartbeat_interval_s ({self.heartbeat_interval_s}), "
            f"got {self.heartbeat_timeout_s}",
        )
        require(self.timeout_s > 0, "timeout_s", f"must be > 0 seconds, got {self.timeout_s}")

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


@dataclass(kw_only=True, slots=True)
class Fault:
    """One fault, fired once when round ``at_round`` is under way (plus ``after_s``)."""

    kind: Literal["kill_site", "kill_coordinator", "cut_link"]
    """``kill_site`` (SIGKILL the site, restart it after ``down_s``), ``kill_coordinator``
    (SIGKILL, restart with the same command: it resumes from its checkpoint) or ``cut_link``
    (the site's link drops every connection and refuses new ones for ``down_s``)."""
    at_round: int
    """Fire once the coordinator is working on this round (0 = the first round)."""
    after_s: float = 0.0
    """Seconds to wait after ``at_round`` began (to hit the middle of training)."""
    down_s: float = 5.0
    """How long the process stays dead or the link stays cut."""
    site: str | None = None
    """The site to kill or cut (required for ``kill_site`` and ``cut_link``)."""
    after_upload: bool = False
    """``kill_site`` only: fire once the coordinator reports the site's upload for ``at_round``
    complete (plus ``after_s``), e.g. to drop a site between its masked upload and the unmasking
    of a secure-aggregation round."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        require(
            self.kind in FAULT_KINDS,
            "kind",
            f"got {self.kind!r}; allowed values: {', '.join(FAULT_KINDS)}",
        )
        require(self.at_round >= 0, "at_round", f"must be >= 0, got {self.at_round}")
        require(self.after_s >= 0, "after_s", f"must be >= 0 seconds, got {self.after_s}")
        require(
            0 <= self.down_s <= 600, "down_s", f"must be in 0..600 seconds, got {self.down_s}"
        )
        if self.kind == KILL_COORDINATOR:
            require(
                self.site is None,
                "site",
                "kill_coordinator takes no site; remove the key",
            )
        else:
            require(self.site is not None, "site", f"{self.kind} needs the name of a site")
        require(
            not self.after_upload or self.kind == KILL_SITE,
            "after_upload",
            f"only kill_site can wait for the site's upload; remove it from this {self.kind} fault",
        )

    def describe(self) -> str:
        what = {
            KILL_SITE: f"kill site {self.site} (SIGKILL), restart after {self.down_s:g} s",
            KILL_COORDINATOR: f"kill the coordinator (SIGKILL), restart after {self.down_s:g} s",
            CUT_LINK: f"cut the link of site {self.site} for {self.down_s:g} s",
        }[self.kind]
        delay = f" + {self.after_s:g} s" if self.after_s else ""
        when = f"round {self.at_round}, once {self.site} uploaded" if self.after_upload else f"round {self.at_round}"
        return f"{when}{delay}: {what}"

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


@dataclass(kw_only=True, slots=True)
class Scenario:
    """A whole emulated experiment."""

    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    """``[workload]``: ``name`` of a built-in workload plus its options (passed to sites and the
    coordinator); read by ``parse_workload`` like every command's."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Algorithm, H, codecs, error feedback, weighting."""
    inner_optimizer: InnerOptimizerConfig = field(default_factory=InnerOptimizerConfig)
    """Each site's optimizer for its inner steps."""
    outer_optimizer: OuterOptimizerConfig = field(default_factory=OuterOptimizerConfig)
    """The coordinator's optimizer (unset fields take the algorithm's defaults)."""
    run: RunSettings = field(default_factory=RunSettings)
    """Run length and round policy."""
    sites: list[EmulatedSite] = field(default_factory=list)
    """One entry per site process."""
    faults: list[Fault] = field(default_factory=list)
    """Faults fired on schedule."""
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    """``[privacy]``: secure aggregation / differential privacy, passed to the coordinator (which
    sends it to the sites)."""
    regions: list[RegionSpec] = field(default_factory=list)
    """``[[regions]]``: a relay per region; empty = every site talks to the coordinator."""
    coordinator_link: CoordinatorLinkSpec = field(default_factory=CoordinatorLinkSpec)
    """``[coordinator_link]``: the coordinator's own link, shared by everything crossing it."""
    source: str = "scenario"
    """Where the scenario came from (the file name in messages)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        require(len(self.sites) >= 1, "sites", "at least one [[sites]] table is needed")
        require(
            self.algorithm.name in DISTRIBUTED_ALGORITHM_NAMES,
            "algorithm.name",
            f"the emulator runs the real coordinator, which runs {', '.join(DISTRIBUTED_ALGORITHM_NAMES)}; "
            f"for a data-parallel baseline use name = \"fedavg\" with inner_steps = 1, "
            f"[inner_optimizer] name = \"sgd\" and no compression (exactly synchronous SGD), or "
            f"run {self.algorithm.name!r} in `geoloco simulate`",
        )
        require(
            self.algorithm.warmup_steps == 0,
            "algorithm.warmup_steps",
            "a data-parallel warm-up exists only in the simulator; set warmup_steps = 0",
        )
        names = [s.name for s in self.sites]
        for i, name in enumerate(names):
            require(
                names.index(name) == i,
                f"sites[{i}].name",
                f"site name {name!r} is used twice; every site needs its own name",
            )
            require(
                name != "coordinator",
                f"sites[{i}].name",
                "'coordinator' is the coordinator's certificate name; pick another site name",
            )
        for i, site in enumerate(self.sites):
            require(
                site.data_shard is None or site.data_shard < len(self.sites),
                f"sites[{i}].data_shard",
                f"must be in 0..{len(self.sites) - 1} (one shard per site), got {site.data_shard}",
            )
        check_regions(self.regions, names, privacy=self.privacy, algorithm=self.algorithm)
        self.training.validate(SCENARIO_KEYS, num_sites=len(self.sites))
        for i, fault in enumerate(self.faults):
            key = f"faults[{i}]"
            if fault.site is not None:
                require(
                    fault.site in names,
                    f"{key}.site",
                    f"no site named {fault.site!r}; sites: {', '.join(names)}",
                )
            if self.run.rounds:
                require(
                    fault.at_round < self.run.rounds,
                    f"{key}.at_round",
                    f"must be < run.rounds ({self.run.rounds}), got {fault.at_round}",
                )
            if fault.kind == KILL_COORDINATOR:
                require(
                    self.run.rounds > 0,
                    f"{key}.kind",
                    "kill_coordinator needs a fixed number of rounds (run.rounds >= 1)",
                )

    @property
    def training(self) -> TrainingConfig:
        """What is trained and how, as the simulator and the coordinator describe it too."""
        run = self.run
        return TrainingConfig(
            algorithm=self.algorithm,
            inner_optimizer=self.inner_optimizer,
            outer_optimizer=self.outer_optimizer,
            privacy=self.privacy,
            seed=run.seed,
            rounds=run.rounds,
            min_sites=run.min_sites,
            round_deadline_s=run.round_deadline_s,
            adaptive_deadline=run.adaptive_deadline,
        )

    @property
    def workload_name(self) -> str:
        return self.workload.name

    @property
    def workload_options(self) -> dict[str, Any]:
        return dict(self.workload.options)

    @property
    def quorum(self) -> int:
        return self.run.min_sites if self.run.min_sites is not None else len(self.sites)

    def shard_of(self, index: int) -> int:
        shard = self.sites[index].data_shard
        return index if shard is None else shard

    def site(self, name: str) -> EmulatedSite:
        return next(s for s in self.sites if s.name == name)

    def tier_clock(self) -> TwoTierClock | None:
        """The simulator's two-tier clock for the relays and the coordinator's shared link, or
        None when every site has its own link (``SimulatorConfig.tier_clock``)."""
        if not self.regions and not self.coordinator_link.shaped:
            return None
        return TwoTierClock.from_specs(
            [s.clock_site() for s in self.sites], [s.name for s in self.sites], self.regions, self.coordinator_link
        )

    def region_of(self, site: str) -> RegionSpec | None:
        """The region whose relay ``site`` talks to, or None (flat)."""
        return next((r for r in self.regions if site in r.sites), None)

    def to_dict(self) -> dict[str, Any]:
        data = config_to_dict(self)
        data.pop("source")
        data["workload"] = self.workload.to_table()  # the TOML table, one to one
        return data


def _table_list(raw: Any, key: str) -> list[Any]:
    if isinstance(raw, Mapping):
        raise ConfigError(key, f"expected a list of [[{key}]] tables (double brackets), got one [{key}] table")
    if not isinstance(raw, list):
        raise ConfigError(key, f"expected a list of [[{key}]] tables, got {raw!r}")
    return raw


def parse_scenario(raw: Mapping[str, Any], source: str = "scenario") -> Scenario:
    """A validated ``Scenario`` from a parsed TOML dict; raises ``ScenarioError``."""
    try:
        unknown = sorted(set(raw) - set(SECTIONS))
        if unknown:
            raise ConfigError(unknown[0], f"unknown section; allowed: {', '.join(SECTIONS)}")
        data = dict(raw)
        data["workload"] = parse_workload(data.get("workload"))
        data["sites"] = _table_list(data.get("sites", []), "sites")
        data["faults"] = _table_list(data.get("faults", []), "faults")
        data["regions"] = _table_list(data.get("regions", []), "regions")
        return config_from_dict(Scenario, {**data, "source": source})
    except ConfigError as err:
        raise ScenarioError(source, err.key, err.message) from None


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file; every problem is a ``ScenarioError`` naming the file."""
    path = Path(path)
    return parse_scenario(read_toml(path), str(path))

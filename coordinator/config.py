"""The coordinator's configuration: one dataclass, validated in one place, written into every
checkpoint and metrics file.

A TOML file maps onto it one to one (``[algorithm]``, ``[outer_optimizer]``, ``[inner_optimizer]``
tables plus top-level keys), except the run's knobs, which every file kind keeps under ``[run]``
(``COORDINATOR_RUN``: ``[run] rounds`` is ``total_rounds``); ``CoordinatorConfig.from_dict``
reports unknown keys and wrong types with their dotted path, so the ``geoloco coordinator
--config FILE`` command can point at the line to change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from geoloco.algorithms.algorithm_config import DISTRIBUTED_ALGORITHM_NAMES
from geoloco.algorithms.config import ConfigError, config_from_dict, config_to_dict, require
from geoloco.algorithms.deadline import AdaptiveDeadlineConfig
from geoloco.algorithms.optimizers import InnerOptimizerConfig, OuterOptimizerConfig
from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.algorithms.training import RUN_KEYS, RunLayout, TrainingConfig
from geoloco.algorithms.update_guard import UpdateGuardConfig
from geoloco.coordinator.admission_config import AdmissionConfig, AdmissionLimits
from geoloco.coordinator.http_config import HTTPStatusConfig
from geoloco.protos.identity import validate_site_name
from geoloco.protos.transport_tls import TLSFiles
from geoloco.protos.wire_buffers import DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE

__all__ = ["COORDINATOR_KEYS", "COORDINATOR_RUN", "CoordinatorConfig"]

COORDINATOR_KEYS = dataclasses.replace(RUN_KEYS, sites="allowed_sites")
"""Where a coordinator file keeps the round policy and the run length (``[run]``)."""

COORDINATOR_RUN = RunLayout(
    {
        "rounds": "total_rounds",
        "seed": "seed",
        "min_sites": "min_sites",
        "round_deadline_s": "round_deadline_s",
        "adaptive_deadline": "adaptive_deadline",
        "eval_every": "eval_every",
        "heartbeat_interval_s": "heartbeat_interval_s",
        "heartbeat_timeout_s": "heartbeat_timeout_s",
    },
    kind="a coordinator file",
)
"""The fields a coordinator file writes under ``[run]`` (before: at the top level, the run
length as ``total_rounds``)."""



@dataclass(kw_only=True, slots=True)
class CoordinatorConfig:
    """Everything one coordinator process needs besides the model's initial weights."""

    RUN_LAYOUT: ClassVar[RunLayout] = COORDINATOR_RUN
    """Where a file's ``[run]`` keys go among the fields (``COORDINATOR_RUN``)."""

    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Algorithm, H (``inner_steps``), uplink/downlink codecs, error feedback, weighting. Sites
    receive it in ``RunConfig`` and never override it."""
    outer_optimizer: OuterOptimizerConfig = field(default_factory=OuterOptimizerConfig)
    """The coordinator's optimizer on the averaged pseudo-gradient (unset fields take the
    algorithm's defaults: DiLoCo -> Nesterov lr 0.7 momentum 0.9)."""
    inner_optimizer: InnerOptimizerConfig = field(default_factory=InnerOptimizerConfig)
    """Inner optimizer that sites built by the CLI construct (sent in ``RunConfig.config_json``);
    Python-API sites bring their own optimizer and may ignore it."""
    workload: dict[str, Any] = field(default_factory=dict)
    """``[workload]``: the built-in workload (e.g. ``{"name": "gpt"}``). ``geoloco coordinator``
    builds the initial model and its evaluation from it, and every site gets the table in
    ``RunConfig.config_json`` so that CLI sites build the same model; a coordinator started from
    Python gets its model from its caller and only passes the table on."""
    seed: int = 0
    """Run seed: per-round codec seeds derive from it (must equal the simulator's seed to
    reproduce a simulated run)."""
    total_rounds: int = 100
    """Rounds in the run; 0 runs until the coordinator is stopped."""
    min_sites: int = 1
    """Quorum: a round opens its deadline clock once this many sites have joined, and is never
    aggregated with fewer uploads than this (it waits past its deadline instead)."""
    round_deadline_s: float | None = None
    """Uploads must complete this many seconds after the round opened; later ones are refused
    and those sites (stragglers) catch up by applying the broadcast delta. Unset: the round waits
    for every site that was a member when it opened. With ``adaptive_deadline`` enabled: the
    deadline of the rounds before any arrival was observed."""
    adaptive_deadline: AdaptiveDeadlineConfig = field(default_factory=AdaptiveDeadlineConfig)
    """``[run.adaptive_deadline]``: set each round's deadline from the arrival times of recent rounds
    (``geoloco.algorithms.deadline``); the deadline in force is logged and in metrics."""
    heartbeat_interval_s: float = 2.0
    """Sites send a heartbeat at least this often."""
    heartbeat_timeout_s: float = 15.0
    """A site silent this long (no heartbeat, no other call) is dropped from the run."""
    host: str = "127.0.0.1"
    """Address to listen on (``0.0.0.0`` for every interface)."""
    port: int = 0
    """Port to listen on; 0 picks a free one (``CoordinatorServer.start()`` returns it)."""
    certs_dir: str | None = None
    """Folder made by ``geoloco certs`` holding ``ca.crt`` and this coordinator's cert/key."""
    cert_name: str = "coordinator"
    """Name of the coordinator's certificate in ``certs_dir`` (``NAME.crt`` / ``NAME.key``)."""
    insecure: bool = False
    """Plain-text gRPC without authentication, for local experiments only; the request's
    ``site`` field is then trusted as the site's identity."""
    allowed_sites: list[str] | None = None
    """Site names allowed to join (others get PERMISSION_DENIED); unset admits every site with
    a certificate from the CA (or any name in insecure mode)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; a restart with the same config resumes from the newest one. One
    coordinator at a time: while it runs it holds ``coordinator.lock`` there, and a second one
    on the same folder is refused with the holder's pid and host. Unset: no checkpoints."""
    checkpoint_every: int = 1
    """Write a full checkpoint (weights, outer state) after every this many rounds and after
    the last one, in the background while the sites train. Every round is durable before its
    broadcast regardless: the round log in ``checkpoint_dir/round-log`` keeps each round's mean
    update since the newest full checkpoint, and a restart replays them. Larger: less I/O per
    round, a longer log (one model-sized file per round) and a longer replay on restart."""
    checkpoint_keep: int = 2
    """Tensor files kept in ``checkpoint_dir`` (older ones are deleted)."""
    resume: bool = True
    """Resume from the checkpoint in ``checkpoint_dir``; previous-run files there that cannot be
    resumed (tensor files without ``checkpoint.json``, a pointer that fails its checks) stop the
    start with an error instead of a silent new run. False (``geoloco coordinator --fresh``)
    starts a new run at round 0 and, once the port is bound, moves the previous run's files (its
    checkpoints and its ``metrics_path`` file) into ``checkpoint_dir/previous-run-N``."""
    metrics_path: str | None = None
    """JSON-lines file receiving one record per round (appended across restarts that resume; a
    new run with ``resume = false`` moves the previous run's file into ``previous-run-N``)."""
    tensorboard_dir: str | None = None
    """Also write each round's scalars (losses, bytes, round time, epsilon) as TensorBoard events
    into this folder (``geoloco.protos.tensorboard``); needs ``metrics_path`` and the
    ``tensorboard`` extra."""
    eval_every: int = 1
    """Evaluate the global weights every this many rounds (and after the last) when the server
    was given an ``eval_fn``."""
    chunk_size: int = DEFAULT_CHUNK_SIZE
    """Bytes per chunk of the streams the coordinator sends (weights, deltas)."""
    max_upload_bytes: int | None = None
    """Largest encoded upload accepted; unset = twice the dense fp32 size of the model plus
    1 MiB (no codec produces more)."""
    progress_interval_s: float = 5.0
    """AwaitBroadcast sends a progress message this often while a round is open."""
    drain_timeout_s: float = 30.0
    """After the last round, ``wait_until_finished`` waits this long for sites to collect the
    final broadcast and leave."""
    max_sites: int = 64
    """Sizes the server's thread pool (each waiting site holds a thread)."""
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    """Where the global weights, the outer optimizer and the aggregation buffer live."""
    http: HTTPStatusConfig = field(default_factory=HTTPStatusConfig)
    """``[http]``: Prometheus ``/metrics`` and the live status page (off unless ``enabled``)."""
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    """``[privacy]``: secure aggregation and differential privacy of the uplink (the same table
    as the simulator's); sites receive it in ``RunConfig.config_json`` and follow it."""
    secure_stage_timeout_s: float = 60.0
    """With secure aggregation: a protocol stage (key advertisement, key shares, unmasking)
    closes when every live member answered or after this long; a site that vanished is waited
    for no longer than this, or than ``heartbeat_timeout_s`` (which drops it)."""
    update_guard: UpdateGuardConfig = field(default_factory=UpdateGuardConfig)
    """``[update_guard]``: bounds on each update's norm and weight and on the global weights;
    an update beyond them is rejected, a round whose aggregate goes beyond them is aborted with
    the model unchanged (``geoloco.algorithms.update_guard``)."""

    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    """``[admission]``: bounds on the calls the gRPC server takes on (per peer, in total, idle
    stream reads) and how long a joined site may stay silent before it is dropped."""

    relays: dict[str, list[str]] = field(default_factory=dict)
    """``[relays]``: regional relays (``geoloco relay``) and the sites each may speak for, e.g.
    ``eu = ["site-a", "site-b"]``; a relay's certificate names it (``geoloco certs issue DIR eu
    --relay``). A relay that forwards for a site outside its list is refused."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        require(
            self.algorithm.name in DISTRIBUTED_ALGORITHM_NAMES,
            "algorithm.name",
            f"the coordinator runs {', '.join(DISTRIBUTED_ALGORITHM_NAMES)}; "
            f"{self.algorithm.name!r} (the per-step data-parallel baseline) runs in the simulator "
            "(`geoloco simulate`)",
        )
        require(
            self.algorithm.warmup_steps == 0,
            "algorithm.warmup_steps",
            "a data-parallel warm-up is only available in the simulator; set warmup_steps = 0",
        )
        num_sites = len(self.allowed_sites) if self.allowed_sites is not None else None
        self.training.validate(COORDINATOR_KEYS, num_sites=num_sites)
        require(
            self.heartbeat_interval_s > 0,
            "heartbeat_interval_s",
            f"must be > 0, got {self.heartbeat_interval_s}",
        )
        require(
            self.heartbeat_timeout_s >= 2 * self.heartbeat_interval_s,
            "heartbeat_timeout_s",
            f"must be at least twice heartbeat_interval_s ({self.heartbeat_interval_s} s) so one "
            f"lost heartbeat does not drop a site, got {self.heartbeat_timeout_s}",
        )
        require(0 <= self.port <= 65535, "port", f"must be in 0..65535, got {self.port}")
        require(bool(self.host), "host", "must not be empty; use 127.0.0.1 or 0.0.0.0")
        require(
            not (self.insecure and self.certs_dir is not None),
            "insecure",
            "insecure = true and certs_dir are mutually exclusive; drop one",
        )
        require(
            self.insecure or self.certs_dir is not None,
            "certs_dir",
            "set certs_dir (made by `geoloco certs init/issue`) for mutual TLS, or insecure = true "
            "for an unauthenticated local run",
        )
        if self.allowed_sites is not None:
            require(len(self.allowed_sites) > 0, "allowed_sites", "must list at least one site or be unset")
            for i, name in enumerate(self.allowed_sites):
                try:
                    validate_site_name(name)
                except ValueError as err:
                    raise ConfigError(f"allowed_sites[{i}]", str(err)) from None
        require(
            self.checkpoint_every >= 1, "checkpoint_every", f"must be >= 1, got {self.checkpoint_every}"
        )
        require(self.checkpoint_keep >= 1, "checkpoint_keep", f"must be >= 1, got {self.checkpoint_keep}")
        require(self.eval_every >= 1, "eval_every", f"must be >= 1, got {self.eval_every}")
        require(
            self.tensorboard_dir is None or self.metrics_path is not None,
            "tensorboard_dir",
            "TensorBoard shows the records of metrics_path: set metrics_path (--metrics FILE) too",
        )
        require(
            0 < self.chunk_size <= MAX_CHUNK_SIZE,
            "chunk_size",
            f"must be in 1..{MAX_CHUNK_SIZE} bytes, got {self.chunk_size}",
        )
        require(
            self.max_upload_bytes is None or self.max_upload_bytes > 0,
            "max_upload_bytes",
            f"must be > 0 or unset, got {self.max_upload_bytes}",
        )
        require(
            self.progress_interval_s > 0,
            "progress_interval_s",
            f"must be > 0, got {self.progress_interval_s}",
        )
        require(self.drain_timeout_s >= 0, "drain_timeout_s", f"must be >= 0, got {self.drain_timeout_s}")
        require(self.max_sites >= 1, "max_sites", f"must be >= 1, got {self.max_sites}")
        require(
            self.device in ("cpu", "cuda", "auto"),
            "device",
            f"got {self.device!r}; allowed values: 'cpu', 'cuda', 'auto'",
        )
        self.http.check_exposure(has_certificates=self.certs_dir is not None)
        _ = self.admission_limits
        self._validate_privacy()
        self._validate_relays()
        self._validate_asynchronous()

    def _validate_asynchronous(self) -> None:
        """What the real system's asynchronous merges cannot take yet (the simulator's can)."""
        merge = self.algorithm.asynchronous
        if not merge.enabled:
            return
        require(
            not self.relays,
            "relays",
            "relays forward one partial sum per round, asynchronous merges take each site's update "
            "on its own clock: leave [relays] empty or disable [algorithm.asynchronous]",
        )

    def _validate_relays(self) -> None:
        """Names, one relay per site, and the combinations a relayed round cannot run yet."""
        if not self.relays:
            return
        owner: dict[str, str] = {}
        for relay, sites in self.relays.items():
            try:
                validate_site_name(relay)
            except ValueError as err:
                raise ConfigError(f"relays.{relay}", f"relay name: {err}") from None
            require(len(sites) > 0, f"relays.{relay}", "must list at least one site")
            for i, site in enumerate(sites):
                try:
                    validate_site_name(site)
                except ValueError as err:
                    raise ConfigError(f"relays.{relay}[{i}]", str(err)) from None
                require(
                    site not in owner,
                    f"relays.{relay}[{i}]",
                    f"site {site!r} is already listed under relay {owner.get(site)!r}; a site "
                    "belongs to one relay",
                )
                owner[site] = relay
                require(
                    self.allowed_sites is None or site in self.allowed_sites,
                    f"relays.{relay}[{i}]",
                    f"site {site!r} is not in allowed_sites; add it there too",
                )
        works = (
            "relays run plain rounds (aggregation = 'mean', late_updates = 'drop') and secure rounds "
            "(secure_aggregation = true, with or without dp); leave [relays] empty to run this "
            "configuration flat"
        )
        require(
            self.privacy.unmasked_central_dp is None,
            "relays",
            "dp = 'central' without secure aggregation clips and noises each site's update at the "
            "coordinator, which sees only a relay's partial sum; set secure_aggregation = true (the "
            f"sites clip, the sum is noised) or run flat: {works}",
        )
        require(
            not self.algorithm.robust_rule.enabled,
            "relays",
            f"robust aggregation needs every site's own update, a relay sends a partial sum: {works}",
        )
        require(
            self.algorithm.late_updates == "drop",
            "relays",
            f"late updates are not folded through relays: {works}",
        )
        require(
            not self.algorithm.partial_updates.enabled,
            "relays",
            "partial parameter updates: each site uploads only its own group's parameters, a relay "
            f"adds updates of one shape, so every partial would be refused: {works}",
        )

    def _validate_privacy(self) -> None:
        """What only the coordinator adds to ``TrainingConfig.validate``: wire limits."""
        privacy = self.privacy
        if not privacy.secure_aggregation:
            return
        require(
            not self.algorithm.adaptive_uplink.enabled,
            "algorithm.adaptive_uplink.enabled",
            "a secure sum adds every site's masked update in one codec; disable adaptive_uplink "
            "or [privacy] secure_aggregation",
        )
        width = privacy.modulus_bits // 8
        require(
            privacy.chunk_size * width <= MAX_CHUNK_SIZE,
            "privacy.chunk_size",
            f"{privacy.chunk_size} values of {width} bytes exceed the {MAX_CHUNK_SIZE}-byte wire "
            f"chunk limit (each masked chunk travels as one message); use at most "
            f"{MAX_CHUNK_SIZE // width}",
        )
        require(
            self.secure_stage_timeout_s > 0,
            "secure_stage_timeout_s",
            f"must be > 0 seconds, got {self.secure_stage_timeout_s}",
        )

    @property
    def training(self) -> TrainingConfig:
        """What is trained and how, as the simulator and the emulator describe it too."""
        return TrainingConfig(
            algorithm=self.algorithm,
            inner_optimizer=self.inner_optimizer,
            outer_optimizer=self.outer_optimizer,
            privacy=self.privacy,
            seed=self.seed,
            rounds=self.total_rounds,
            min_sites=self.min_sites,
            round_deadline_s=self.round_deadline_s,
            adaptive_deadline=self.adaptive_deadline,
        )

    @property
    def admission_limits(self) -> AdmissionLimits:
        """``admission`` with its defaults derived from ``max_sites`` and the heartbeat settings."""
        sites = self.max_sites if self.allowed_sites is None else len(self.allowed_sites)
        return self.admission.resolve(
            max_sites=self.max_sites,
            heartbeat_interval_s=self.heartbeat_interval_s,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            identities=sites + len(self.relays),
        )

    @property
    def tls_files(self) -> TLSFiles | None:
        """The coordinator's CA, certificate and key, or None in insecure mode."""
        if self.certs_dir is None:
            return None
        return TLSFiles.from_dir(Path(self.certs_dir), self.cert_name)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CoordinatorConfig:
        """Build from a parsed TOML/JSON table (the file form, ``[run]`` included); errors name
        the dotted key as the table has it and what is allowed. ``to_file_dict()`` writes that
        form; ``to_dict()``'s field form is the old layout, read with its deprecation warning."""
        return config_from_dict(cls, data)

    def to_file_dict(self) -> dict[str, Any]:
        """``to_dict`` in the file form (``[run]``), for a file that is read again."""
        return COORDINATOR_RUN.lower(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (written into checkpoints, metrics and ``RunConfig.config_json``)."""
        return config_to_dict(self)

"""The single-process simulator: N sites in a loop on a virtual network clock, same math as the real system.

Scaling choice: there is ONE model instance for all sites. Before a site's inner steps the global
weights are loaded into it; what each site owns is only its inner-optimizer state (one torch
optimizer instance per site over the same shared parameters — each instance keeps its own state),
its uplink error-feedback residual and its data stream. Sites run one after another within a round,
so memory is ``model + N × (optimizer state + residual)``: 64 sites of a 0.45M-parameter GPT fit
in well under a gigabyte.

Time is virtual (``geoloco.algorithms.clock``): compute is ``step_time_s × step_time_factor`` per
step (or the measured wall time of the real steps with ``step_time_s = "measure"``) and every
transfer costs ``latency + 8 · Encoded.nbytes / bandwidth``, from the bytes really produced by
the codecs.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from geoloco.algorithms.clock import (
    SiteConfig,
    download_ends,
    upload_arrivals,
)
from geoloco.algorithms.config import ConfigError, config_from_dict, config_to_dict, require
from geoloco.algorithms.deadline import AdaptiveDeadlineConfig
from geoloco.algorithms.device import resolve_device as _resolve_device
from geoloco.algorithms.diloco import (
    UpdateEncoder,
    batch_size,
    compute_gradient,
    pseudo_gradient,
    run_inner_steps,
)
from geoloco.algorithms.fixed_point import clip_l2
from geoloco.algorithms.lr_schedule import InnerLRSchedule
from geoloco.algorithms.optimizers import (
    InnerOptimizerConfig,
    OuterOptimizerConfig,
    load_optimizer_state_,
    optimizer_state_tensors,
    split_flat_optimizer_state,
)
from geoloco.algorithms.params import ParamLayout, derive_seed, weights_digest
from geoloco.algorithms.privacy import (
    PrivacyAccountant,
    PrivacyConfig,
    PrivateUpdateEncoder,
    add_central_noise,
    check_aggregation,
    check_composition,
    effective_noise_multiplier,
    plan_secure_round,
    private_round_in_memory,
    secure_index_seed,
)
from geoloco.algorithms.round import Round, RoundPolicy, close_time
from geoloco.algorithms.streaming_sim import StreamingRounds
from geoloco.algorithms.streaming import FragmentUplink
from geoloco.algorithms.strategy import (
    UPDATE_GRADIENT,
    AlgorithmConfig,
    DataParallel,
    Strategy,
    build_strategy,
)
from geoloco.algorithms.time_budget import TimeBudget, run_inner_steps_within, steps_in_budget
from geoloco.algorithms.workload import Workload
from geoloco.compression import Encoded, decode

__all__ = [
    "RoundRecord",
    "SimulationConfig",
    "Simulator",
    "SimulatorConfig",
    "resolve_device",
    "simulate",
]

logger = logging.getLogger(__name__)

MEASURE = "measure"
"""``step_time_s`` value that uses the measured wall time of the real inner steps."""


@dataclass(kw_only=True, slots=True)
class SimulationConfig:
    """How long to run, what to measure, and the coordinator's round policy."""

    rounds: int = 100
    """Maximum number of rounds (the run stops earlier once ``target_eval_loss`` is reached)."""
    target_eval_loss: float | None = None
    """Stop at the first evaluation whose loss is <= this (time-to-target runs); unset = never."""
    eval_every: int = 10
    """Evaluate the global model every this many rounds (and always after the last round)."""
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
    """``[simulation.adaptive_deadline]``: learn each round's deadline from recent arrivals
    (``geoloco.algorithms.deadline``); ``round_deadline_s`` is then the first rounds' deadline."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        require(self.rounds >= 1, "rounds", f"must be >= 1, got {self.rounds}")
        require(self.eval_every >= 1, "eval_every", f"must be >= 1, got {self.eval_every}")
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
        require(
            self.round_deadline_s is None or self.round_deadline_s > 0,
            "round_deadline_s",
            f"must be > 0 seconds or unset, got {self.round_deadline_s}",
        )
        require(self.min_sites >= 1, "min_sites", f"must be >= 1, got {self.min_sites}")

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


def _default_sites() -> list[SiteConfig]:
    return [SiteConfig() for _ in range(4)]


@dataclass(kw_only=True, slots=True)
class SimulatorConfig:
    """Everything a simulated run needs besides the workload; TOML sections map onto the fields."""

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
    """Run length, evaluation, clock and round policy."""
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    """Secure aggregation and differential privacy (``geoloco.algorithms.privacy``)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        require(len(self.sites) >= 1, "sites", "at least one site is needed")
        try:
            self.inner_optimizer.resolved_decay_steps(
                total_rounds=self.simulation.rounds, inner_steps=self.algorithm.inner_steps
            )
        except ConfigError as err:
            raise err.under("inner_optimizer") from None
        require(
            self.simulation.min_sites <= len(self.sites),
            "simulation.min_sites",
            f"must be <= the number of sites ({len(self.sites)}), got {self.simulation.min_sites}",
        )
        require(
            not (self.algorithm.name == "ddp" and self.simulation.round_deadline_s is not None),
            "simulation.round_deadline_s",
            "the ddp baseline waits for every site each step; unset round_deadline_s",
        )
        require(
            not (self.algorithm.name == "ddp" and self.simulation.adaptive_deadline.enabled),
            "simulation.adaptive_deadline.enabled",
            "the ddp baseline waits for every site each step; set enabled = false",
        )
        if self.privacy.enabled:
            require(
                self.algorithm.name != "ddp" and self.algorithm.warmup_steps == 0,
                "privacy",
                "privacy applies to pseudo-gradient rounds; use diloco, fedavg or fedopt with "
                "warmup_steps = 0",
            )
            require(
                self.simulation.round_deadline_s is None,
                "simulation.round_deadline_s",
                "with privacy on, every site's update enters the round; unset round_deadline_s",
            )
            require(
                not self.simulation.adaptive_deadline.enabled,
                "simulation.adaptive_deadline.enabled",
                "with privacy on, every site's update enters the round; set enabled = false",
            )
            check_aggregation(
                self.privacy,
                weighting=self.algorithm.weighting,
                late_updates=self.algorithm.late_updates,
            )
            try:
                check_composition(self.privacy, self.algorithm.uplink_codec, len(self.sites))
            except ConfigError as err:
                raise err.under("algorithm" if err.key == "uplink_codec" else "") from None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SimulatorConfig:
        """Build from a parsed TOML/JSON dict; errors name the dotted key and what is allowed.

        ``sites`` may be a list of site tables, or one table with ``count`` (default 4) and the
        fields all sites share.
        """
        data = dict(data)
        sites = data.get("sites")
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
        return config_from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


@dataclass(slots=True)
class RoundRecord:
    """What one round (or the warm-up, ``round = 0``) cost and achieved."""

    round: int
    """Round index; 0 is the data-parallel warm-up."""
    phase: Literal["warmup", "train"]
    """``"warmup"`` for the synchronous warm-up, ``"train"`` for algorithm rounds."""
    inner_steps: int
    """Training steps each site ran in this record."""
    train_loss: float
    """Mean of the sites' inner-step losses."""
    eval_loss: float | None
    """Held-out loss of the global weights after the round (``None`` when not evaluated)."""
    sites_aggregated: int
    """Sites whose updates entered the aggregate (for ddp/warm-up: per step, all)."""
    stragglers: list[int]
    """Sites left out by the round deadline."""
    bytes_up: list[int]
    """Bytes each site uploaded in this record (``Encoded.nbytes``)."""
    bytes_down: list[int]
    """Bytes each site downloaded in this record."""
    bytes_up_total: int
    """Cumulative upload bytes of all sites since the start."""
    bytes_down_total: int
    """Cumulative download bytes of all sites since the start."""
    round_time_s: float
    """Virtual seconds from the previous record's end to this one's."""
    wall_clock_s: float
    """Virtual time when every site held the new weights."""
    compute_s: list[float]
    """Per site, virtual seconds spent computing in this record."""
    utilization: list[float]
    """Per site, the share of its round spent computing (``compute_s`` / its round span)."""
    digest: str
    """``weights_digest`` of the global weights after the round."""
    epsilon: float | None = None
    """Accounted epsilon (at ``privacy.delta``) after this round; ``None`` without DP."""
    site_inner_steps: list[int] = field(default_factory=list)
    """Per site, inner steps run in this record (they differ with ``round_time_budget_s``;
    ``inner_steps`` is then the most any site ran)."""
    deadline_s: float | None = None
    """The round deadline in force (seconds after the round opened); ``None``: none."""
    folded: list[int] = field(default_factory=list)
    """Sites whose previous round's late update was folded into this round (discounted)."""
    peak_bytes_in_flight: list[int] | None = None
    """Per site, the largest single transfer of this record (one upload or one broadcast): the
    whole model's update in plain DiLoCo, one fragment's with streaming; ``None`` where not
    tracked (ddp, privacy rounds)."""
    fragment: int | None = None
    """Streaming DiLoCo: the fragment this round synchronised; ``None`` otherwise."""

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


def resolve_device(device: str) -> torch.device:
    """``geoloco.algorithms.device.resolve_device`` for ``simulation.device``."""
    return _resolve_device(device, "simulation.device")


@dataclass(slots=True)
class _Site:
    index: int
    name: str
    """The site's identity in plans, seeds and aggregation: ``str(index)``."""
    config: SiteConfig
    batches: Iterator[Any]
    optimizer: torch.optim.Optimizer | None
    uplink: FragmentUplink
    lr_schedule: InnerLRSchedule | None = None
    """The inner lr schedule over ``optimizer``, positioned by this site's cumulative inner steps."""
    ready_s: float = 0.0
    """Virtual time at which this site holds the current global weights."""
    late: tuple[Encoded, float, float] | None = None
    """Its last round's update that missed the deadline, its weight and its arrival time, kept
    to be folded into the next round (``late_updates = "fold"``)."""


class Simulator:
    """A simulated run; iterate ``run()`` for records. ``global_flat`` holds the current weights."""

    def __init__(self, config: SimulatorConfig, workload: Workload) -> None:
        self.config = config
        self.workload = workload
        sim = config.simulation
        self.device = resolve_device(sim.device)
        self.model = workload.build_model(sim.seed).to(self.device)
        self.layout = ParamLayout.from_model(self.model)
        self.global_flat = self.layout.flatten(self.model)
        self.strategy = build_strategy(
            config.algorithm,
            numel=self.layout.numel,
            outer_optimizer=config.outer_optimizer,
            inner_optimizer=config.inner_optimizer,
            seed=sim.seed,
            device=self.device,
            layout=self.layout,
        )
        self.data_parallel = self.strategy.update_kind == UPDATE_GRADIENT
        num_sites = len(config.sites)
        self.sites = [
            _Site(
                index=k,
                name=str(k),
                config=site,
                batches=workload.site_batches(k, num_sites, sim.seed),
                optimizer=None if self.data_parallel else config.inner_optimizer.build(
                    self.model.parameters()
                ),
                uplink=self.strategy.build_uplink(),
            )
            for k, site in enumerate(config.sites)
        ]
        # Inner lr schedule (geoloco.algorithms.lr_schedule): one per site, over its cumulative
        # inner steps of the rounds (the data-parallel warm-up runs at the constant lr); for the
        # ddp baseline, one over the shared optimizer's steps. Horizon: rounds x inner_steps.
        # A Streaming DiLoCo round is one fragment sync: H / fragments inner steps.
        streaming = config.algorithm.streaming
        per_round = config.algorithm.inner_steps // (streaming.fragments if streaming.enabled else 1)
        horizon = {"total_rounds": sim.rounds, "inner_steps": per_round}
        for site in self.sites:
            if site.optimizer is not None:
                site.lr_schedule = config.inner_optimizer.build_schedule(site.optimizer, **horizon)
        self.ddp_lr_schedule: InnerLRSchedule | None = None
        if self.data_parallel:
            shared = self.strategy.outer.optimizer
            self.ddp_lr_schedule = config.inner_optimizer.build_schedule(shared, **horizon)
        privacy = config.privacy
        # One private encoder (own error-feedback residual) per site, and with Streaming DiLoCo
        # per site and fragment: each fragment sync is its own secure sum.
        fragments = (
            config.algorithm.streaming.fragments if config.algorithm.streaming.enabled else 1
        )
        self.private_fragments: list[dict[int, PrivateUpdateEncoder]] = [
            {k: PrivateUpdateEncoder(privacy, config.algorithm.uplink_codec,
                                     error_feedback=config.algorithm.error_feedback)
             for k in range(num_sites)} if privacy.secure_aggregation else {}
            for _ in range(fragments)
        ]
        # Simulated sites still run the real protocol, so each needs an identity key.
        self.identity_keys: dict[int, Ed25519PrivateKey] = (
            {k: Ed25519PrivateKey.generate() for k in range(num_sites)}
            if privacy.secure_aggregation else {}
        )
        self.accountant = PrivacyAccountant(privacy.delta) if privacy.dp != "off" else None
        self.policy = RoundPolicy(
            min_sites=sim.min_sites,
            round_deadline_s=sim.round_deadline_s,
            adaptive_deadline=sim.adaptive_deadline,
            late_updates=config.algorithm.late_updates,
            staleness_discount=config.algorithm.staleness_discount,
        )
        self.clock_s = 0.0
        self.open_s = 0.0
        self.bytes_up_total = 0
        self.bytes_down_total = 0
        # Streaming DiLoCo (geoloco.algorithms.streaming_sim): per-site weights and overlap.
        self.streaming: StreamingRounds | None = (
            StreamingRounds(self) if config.algorithm.streaming.enabled else None
        )

    # -- helpers -----------------------------------------------------------------------------

    def _step_seconds(self, site: _Site, steps: int, measured_s: float) -> float:
        step_time = self.config.simulation.step_time_s
        base = measured_s if step_time == MEASURE else steps * float(step_time)
        return base * site.config.step_time_factor

    def _sync_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _evaluate(self) -> float:
        self.layout.load_(self.model, self.global_flat)
        self.model.eval()
        try:
            with torch.no_grad():
                return float(self.workload.eval_loss(self.model))
        finally:
            self.model.train()

    # -- data-parallel steps (the ddp baseline and the warm-up) ------------------------------

    def _data_parallel_steps(
        self, strategy: Strategy, uplinks: list[FragmentUplink], steps: int, first_index: int
    ) -> dict[str, Any]:
        """``steps`` synchronous DDP steps through ``strategy`` (a ``DataParallel``)."""
        n = len(self.sites)
        bytes_up = [0] * n
        bytes_down = [0] * n
        compute = [0.0] * n
        starts0 = [s.ready_s for s in self.sites]
        losses: list[float] = []
        for step in range(steps):
            plan = strategy.configure_round(first_index + step, [s.name for s in self.sites])
            aggregator = strategy.new_aggregator(plan.round)
            self.layout.load_(self.model, self.global_flat)
            step_compute = []
            upload_sizes = []
            for site, uplink in zip(self.sites, uplinks):
                self._sync_device()
                t0 = time.perf_counter()
                batch = next(site.batches)
                grad, loss = compute_gradient(self.model, self.layout, batch, self.workload.loss)
                self._sync_device()
                seconds = self._step_seconds(site, 1, time.perf_counter() - t0)
                encoded = uplink.encode(grad, seed=plan.uplink_seed(site.name))
                aggregator.add(encoded, strategy.site_weight(batch_size(batch)), site=site.name)
                losses.append(loss)
                step_compute.append(seconds)
                upload_sizes.append(encoded.nbytes)
            update = strategy.aggregate_round(self.global_flat, aggregator, plan)
            self.global_flat = update.global_flat
            if strategy is self.strategy and self.ddp_lr_schedule is not None:
                self.ddp_lr_schedule.step()
            arrivals = upload_arrivals(
                [s.ready_s for s in self.sites], step_compute, upload_sizes,
                [s.config for s in self.sites],
            )
            aggregate_s = max(arrivals)  # data-parallel: every site, every step
            ends = download_ends(
                aggregate_s, arrivals, update.downlink.nbytes, [s.config for s in self.sites]
            )
            self.open_s = aggregate_s
            for k, site in enumerate(self.sites):
                site.ready_s = ends[k]
                compute[k] += step_compute[k]
                bytes_up[k] += upload_sizes[k]
                bytes_down[k] += update.downlink.nbytes
        spans = [s.ready_s - start for s, start in zip(self.sites, starts0)]
        return {
            "train_loss": sum(losses) / len(losses),
            "bytes_up": bytes_up,
            "bytes_down": bytes_down,
            "compute_s": compute,
            "utilization": [c / span if span > 0 else 1.0 for c, span in zip(compute, spans)],
            "stragglers": [],
            "sites_aggregated": n,
        }

    # -- one DiLoCo-family round -------------------------------------------------------------

    def _round_noise_multiplier(self, round_index: int) -> float:
        """What the accountant composes for one round (see ``effective_noise_multiplier``);
        with streaming one release of the round's fragment update."""
        privacy = self.config.privacy
        if privacy.dp != "distributed":
            return privacy.noise_multiplier
        numel = (
            self.strategy.update_numel(round_index - 1)
        )
        context, fixed = plan_secure_round(
            privacy, self.config.algorithm.uplink_codec, numel=numel,
            num_sites=len(self.sites), session="simulation", round_index=0,
        )
        return effective_noise_multiplier(privacy, fixed, context.numel)

    def _private_aggregate(
        self, round_index: int, updates: dict[int, torch.Tensor], plan: Any,
        fragment: int | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """Mean update under the privacy config, and each site's upload bytes.

        ``fragment``: Streaming DiLoCo's fragment of this round (``updates`` are that
        fragment's); its secure sum, clip and noise cover the fragment only.
        """
        privacy = self.config.privacy
        codec = self.config.algorithm.uplink_codec
        numel = next(iter(updates.values())).numel()
        if privacy.secure_aggregation:
            traffic: dict[int, int] = {}
            mean, survivors = private_round_in_memory(
                privacy, codec, updates, self.private_fragments[fragment or 0], self.identity_keys,
                session=f"simulation-{self.config.simulation.seed}", round_index=round_index,
                index_seed=secure_index_seed(plan.seed), traffic=traffic,
            )
            if privacy.dp == "central":
                mean = add_central_noise(mean * len(survivors), privacy) / len(survivors)
            return mean.to(self.global_flat.device), [traffic[k] for k in sorted(updates)]
        # Central DP without secure aggregation: the trusted coordinator clips each decoded
        # upload, sums, and adds Gaussian noise to the sum.
        assert privacy.clip_norm is not None
        total = torch.zeros(numel, dtype=torch.float32)
        sizes = []
        for k in sorted(updates):
            uplink = self.sites[k].uplink
            encoded = uplink.encode(updates[k], seed=plan.uplink_seed(str(k)), fragment=plan.fragment)
            sizes.append(encoded.nbytes)
            total += clip_l2(decode(encoded, device="cpu").reshape(-1), privacy.clip_norm)[0]
        mean = add_central_noise(total, privacy) / len(updates)
        return mean.to(self.global_flat.device), sizes

    def _diloco_round(self, round_index: int) -> dict[str, Any]:
        sim = self.config.simulation
        strategy = self.strategy
        plan = strategy.configure_round(round_index - 1, [s.name for s in self.sites])
        round_ = Round(number=plan.round, aggregation=strategy.new_aggregator(plan.round), opened_s=self.open_s)
        round_.start(self.open_s, self.policy)
        deadline_s = round_.deadline_s
        deadline = round_.deadline_at
        pending: dict[int, Encoded] = {}
        site_steps: list[int] = []
        arrivals: list[float] = []
        compute: list[float] = []
        upload_sizes: list[int] = []
        losses: list[float] = []
        weights: dict[int, float] = {}
        private_updates: dict[int, torch.Tensor] = {}
        for site in self.sites:
            assert site.optimizer is not None
            self.layout.load_(self.model, self.global_flat)
            result, seconds = self._inner_steps(site, plan.inner_steps)
            steps = len(result.losses)
            site_steps.append(steps)
            update = pseudo_gradient(self.global_flat, self.layout.flatten(self.model))
            if self.config.privacy.enabled:
                private_updates[site.index] = update.to("cpu")
                compute.append(seconds)
                losses.extend(result.losses)
                continue
            encoded = site.uplink.encode(update, seed=plan.uplink_seed(site.name))
            del update
            (arrival,) = upload_arrivals([site.ready_s], [seconds], [encoded.nbytes], [site.config])
            weights[site.index] = strategy.site_weight(result.samples, steps)
            if deadline is None or arrival <= deadline:
                round_.add(encoded, weights[site.index], site=site.name, now=arrival)
            else:
                pending[site.index] = encoded
            arrivals.append(arrival)
            compute.append(seconds)
            upload_sizes.append(encoded.nbytes)
            losses.extend(result.losses)
        if private_updates:
            stats = self._private_round_finish(round_index, plan, private_updates, compute, losses)
            return {**stats, "site_inner_steps": site_steps, "deadline_s": None, "folded": []}
        aggregate_s = close_time(self.policy, arrivals, start_s=self.open_s, deadline_s=deadline_s)
        included = [k for k, a in enumerate(arrivals) if a <= aggregate_s]
        # Late uploads the quorum rule pulled in are aggregated.
        for k in included:
            if k in pending:
                round_.add(pending.pop(k), weights[k], site=self.sites[k].name, now=arrivals[k])
        outcome = round_.close(now=aggregate_s, expected=[s.name for s in self.sites])
        self.policy.observe(outcome)
        folded = self._fold_late_updates(round_, aggregate_s)
        # The others go back to the sites' residuals (with error feedback) so their work arrives
        # next round, or wait to be folded into the next round's average.
        for k, encoded in pending.items():
            if self.policy.folds_late_updates:
                self.sites[k].late = (encoded, weights[k], arrivals[k])
            else:
                self.sites[k].uplink.restore(encoded)
        update = strategy.aggregate_round(self.global_flat, round_.aggregation, plan)
        self.global_flat = update.global_flat
        utilization = self._close_round_clock(aggregate_s, arrivals, update.downlink.nbytes, compute)
        return {
            "train_loss": sum(losses) / len(losses),
            "bytes_up": upload_sizes,
            "bytes_down": [update.downlink.nbytes] * len(self.sites),
            "compute_s": compute,
            "utilization": utilization,
            "stragglers": sorted(pending),
            "sites_aggregated": len(included),
            "site_inner_steps": site_steps,
            "deadline_s": deadline_s,
            "folded": folded,
            "peak_bytes_in_flight": [max(up, update.downlink.nbytes) for up in upload_sizes],
        }

    def _inner_steps(self, site: _Site, inner_steps: int) -> tuple[Any, float]:
        """One site's inner steps of a round: ``inner_steps``, or as many as fit in the time
        budget on the virtual clock (``steps_in_budget``, or measured step by step in
        ``"measure"`` mode). Returns the ``InnerResult`` and the virtual compute seconds."""
        sim = self.config.simulation
        budget_s = self.config.algorithm.round_time_budget_s
        assert site.optimizer is not None
        clip = self.config.inner_optimizer.grad_clip_norm
        if budget_s is not None and sim.step_time_s == MEASURE:
            result, seconds = run_inner_steps_within(
                self.model, site.optimizer, site.batches, TimeBudget(budget_s),
                self.workload.loss, grad_clip_norm=clip, lr_schedule=site.lr_schedule,
                time_scale=site.config.step_time_factor, sync=self._sync_device,
            )
            return result, seconds
        if budget_s is not None:
            step_s = float(sim.step_time_s) * site.config.step_time_factor
            inner_steps = steps_in_budget(budget_s, step_s, max_steps=None if step_s > 0 else 1)
        self._sync_device()
        t0 = time.perf_counter()
        result = run_inner_steps(
            self.model, site.optimizer, site.batches, inner_steps, self.workload.loss,
            grad_clip_norm=clip, lr_schedule=site.lr_schedule,
        )
        self._sync_device()
        return result, self._step_seconds(site, inner_steps, time.perf_counter() - t0)

    def _fold_late_updates(self, round_: Round, aggregate_s: float) -> list[int]:
        """Add last round's late updates that arrived before this round aggregated, with the
        policy's staleness discount; those that did not go back into their site's residual (the
        real coordinator accepts an update exactly one round late, no later)."""
        folded = []
        for site in self.sites:
            if site.late is None:
                continue
            encoded, weight, arrival = site.late
            site.late = None
            if arrival <= aggregate_s:
                round_.fold(encoded, weight, site=site.name, policy=self.policy)
                folded.append(site.index)
            else:
                site.uplink.restore(encoded)
        return folded

    def _private_round_finish(
        self, round_index: int, plan: Any, updates: dict[int, torch.Tensor],
        compute: list[float], losses: list[float],
    ) -> dict[str, Any]:
        """Aggregate a privacy round (every site enters), outer step, clock and downlink."""
        mean, upload_sizes = self._private_aggregate(round_index, updates, plan)
        update = self.strategy.apply_mean_update(
            self.global_flat, mean, tuple(str(k) for k in sorted(updates)), plan
        )
        self.global_flat = update.global_flat
        arrivals = [
            upload_arrivals([site.ready_s], [compute[k]], [upload_sizes[k]], [site.config])[0]
            for k, site in enumerate(self.sites)
        ]
        # Privacy rounds have no deadline: every site's update enters.
        included, aggregate_s = list(range(len(arrivals))), max(arrivals)
        utilization = self._close_round_clock(aggregate_s, arrivals, update.downlink.nbytes, compute)
        return {
            "train_loss": sum(losses) / len(losses),
            "bytes_up": upload_sizes,
            "bytes_down": [update.downlink.nbytes] * len(self.sites),
            "compute_s": compute,
            "utilization": utilization,
            "stragglers": [],
            "sites_aggregated": len(included),
        }

    def _close_round_clock(
        self, aggregate_s: float, arrivals: list[float], downlink_bytes: int, compute: list[float]
    ) -> list[float]:
        """Advance every site to the end of its broadcast download and the round clock to
        ``aggregate_s``; returns each site's compute share of its round (utilization)."""
        ends = download_ends(aggregate_s, arrivals, downlink_bytes, [s.config for s in self.sites])
        utilization = []
        for k, site in enumerate(self.sites):
            span = ends[k] - site.ready_s
            utilization.append(compute[k] / span if span > 0 else 1.0)
            site.ready_s = ends[k]
        self.open_s = aggregate_s
        return utilization

    # -- the run ------------------------------------------------------------------------------

    def _record(self, round_index: int, phase: str, steps: int, stats: dict[str, Any],
                eval_loss: float | None) -> RoundRecord:
        self.bytes_up_total += sum(stats["bytes_up"])
        self.bytes_down_total += sum(stats["bytes_down"])
        end = stats.get("end_s", max(s.ready_s for s in self.sites))
        record = RoundRecord(
            round=round_index,
            phase=phase,  # type: ignore[arg-type]
            inner_steps=steps,
            train_loss=stats["train_loss"],
            eval_loss=eval_loss,
            sites_aggregated=stats["sites_aggregated"],
            stragglers=stats["stragglers"],
            bytes_up=stats["bytes_up"],
            bytes_down=stats["bytes_down"],
            bytes_up_total=self.bytes_up_total,
            bytes_down_total=self.bytes_down_total,
            round_time_s=end - self.clock_s,
            wall_clock_s=end,
            compute_s=stats["compute_s"],
            utilization=stats["utilization"],
            digest=weights_digest(self.global_flat),
            epsilon=None if self.accountant is None else self.accountant.epsilon(),
            site_inner_steps=stats.get("site_inner_steps", [steps] * len(self.sites)),
            deadline_s=stats.get("deadline_s"),
            folded=stats.get("folded", []),
            peak_bytes_in_flight=stats.get("peak_bytes_in_flight"),
            fragment=stats.get("fragment"),
        )
        self.clock_s = end
        return record

    def run(self) -> Iterator[RoundRecord]:
        """Warm-up (if any), then rounds until ``rounds`` or ``target_eval_loss`` is reached."""
        sim = self.config.simulation
        algo = self.config.algorithm
        # Dropout and anything else drawing from the global generator; seeded when the run starts
        # (not at construction), so runs consumed one after another in a process are identical.
        torch.manual_seed(sim.seed)
        if algo.warmup_steps > 0:
            warmup = DataParallel(
                AlgorithmConfig(name="ddp", inner_steps=1),
                numel=self.layout.numel,
                inner_optimizer=self.config.inner_optimizer,
                seed=sim.seed,
                device=self.device,
            )
            stats = self._data_parallel_steps(
                warmup, [warmup.build_uplink() for _ in self.sites], algo.warmup_steps, 0
            )
            self._seed_site_optimizers(warmup)
            yield self._record(0, "warmup", algo.warmup_steps, stats, self._evaluate())
        for round_index in range(1, sim.rounds + 1):
            if self.data_parallel:
                first = (round_index - 1) * algo.inner_steps
                stats = self._data_parallel_steps(
                    self.strategy, [s.uplink for s in self.sites], algo.inner_steps, first
                )
            else:
                z = self._round_noise_multiplier(round_index)
                if self.accountant is not None and not self.accountant.allows(
                    z, self.config.privacy.epsilon_budget
                ):
                    logger.info(
                        "stopping before round %d: epsilon would reach %.3f, budget %.3f",
                        round_index, self.accountant.epsilon_after(z),
                        self.config.privacy.epsilon_budget,
                    )
                    return
                stats = (
                    self.streaming.round(round_index)
                    if self.streaming is not None
                    else self._diloco_round(round_index)
                )
                if self.accountant is not None:
                    self.accountant.step(z)
            last = round_index == sim.rounds
            eval_loss = (
                self._evaluate() if last or round_index % sim.eval_every == 0 else None
            )
            if self.streaming is not None:
                steps = self.strategy.inner_steps
            else:
                steps = max(stats["site_inner_steps"]) if stats.get("site_inner_steps") else algo.inner_steps
            yield self._record(round_index, "train", steps, stats, eval_loss)
            if (
                sim.target_eval_loss is not None
                and eval_loss is not None
                and eval_loss <= sim.target_eval_loss
            ):
                logger.info(
                    "eval loss %.4f reached target %.4f after round %d",
                    eval_loss, sim.target_eval_loss, round_index,
                )
                return

    def _seed_site_optimizers(self, warmup: Strategy) -> None:
        """Give every site the warm-up's shared optimizer state (as if each had run it)."""
        tensors, meta = optimizer_state_tensors(warmup.outer.optimizer)
        entries = [(e.offset, e.shape) for e in self.layout.entries]
        per_param, per_meta = split_flat_optimizer_state(tensors, meta, entries)
        for site in self.sites:
            assert site.optimizer is not None
            load_optimizer_state_(site.optimizer, per_param, per_meta)
            if site.lr_schedule is not None:
                site.lr_schedule.seek(0)  # the loaded param groups carry the warm-up's lr


def simulate(config: SimulatorConfig, workload: Workload) -> Iterator[RoundRecord]:
    """Run ``config`` on ``workload`` and yield one ``RoundRecord`` per round (warm-up first)."""
    return Simulator(config, workload).run()

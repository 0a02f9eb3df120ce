"""One interface for "how a round is planned and aggregated" (Flower's ``Strategy``).

The coordinator (real or simulated) drives a round through a ``Strategy``:

1. ``plan = strategy.configure_round(round, sites)`` — rounds from 0, sites by name: the
   fragment, inner steps, codec and seeds (sent to the sites).
2. Each site builds its ``strategy.build_uplink()`` encoders once and, per round, uploads
   ``encode(update, seed=plan.uplink_seed(site), fragment=plan.fragment)`` with
   ``strategy.site_weight(samples)``.
3. ``agg = strategy.new_aggregator(round)``; ``agg.add(encoded, weight, site=name)`` per arrival.
4. ``update = strategy.aggregate_round(θ_t, agg, plan)`` — outer step and downlink encoding;
   ``update.global_flat`` is ``θ_{t+1}``, ``update.downlink`` the bytes to broadcast.

DiLoCo, FedAvg and FedOpt differ only in their default outer optimizer. The data-parallel
baseline (``DataParallel``) is the same machinery with ``H = 1``, sites uploading gradients
instead of pseudo-gradients, and the coordinator applying the *inner* optimizer (one shared
AdamW state) to the averaged gradient: exactly one DDP step, whose delta every replica applies.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from geoloco.algorithms.aggregation import Aggregation, RunningSum
from geoloco.algorithms.algorithm_config import ALGORITHM_NAMES, DEFAULT_OUTER_OPTIMIZERS, AlgorithmConfig
from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.diloco import UpdateEncoder, apply_downlink, encode_downlink
from geoloco.algorithms.optimizers import InnerOptimizerConfig, OuterOptimizer, OuterOptimizerConfig
from geoloco.algorithms.params import ParamLayout, derive_seed, weights_digest
from geoloco.algorithms.partial import PartialAssignment
from geoloco.algorithms.privacy.private_aggregation import secure_index_seed
from geoloco.algorithms.streaming import (
    FRAGMENT_PREFIX,
    Fragment,
    FragmentPartition,
    FragmentUplink,
    StreamingConfig,
    StreamingSchedule,
)
from geoloco.algorithms.weighting import site_weight as weighting_site_weight
from geoloco.compression import Encoded, parse_codec

__all__ = [
    "ALGORITHMS",
    "UPDATE_GRADIENT",
    "UPDATE_PSEUDO_GRADIENT",
    "UPLINK_SEED_PURPOSE",
    "AlgorithmConfig",
    "DataParallel",
    "FragmentOuter",
    "RoundPlan",
    "RoundUpdate",
    "Strategy",
    "build_strategy",
    "uplink_seed",
]

UPDATE_PSEUDO_GRADIENT: str = "pseudo_gradient"
"""Sites run H inner steps and upload ``θ_t − θ_k``."""
UPDATE_GRADIENT: str = "gradient"
"""Sites compute one batch's gradient and upload it (data-parallel)."""

UpdateKind = Literal["pseudo_gradient", "gradient"]

UPLINK_SEED_PURPOSE = "uplink"
"""Domain tag of a site's per-round uplink codec seed, ``derive_seed(round_seed, tag, site)``:
the simulator, the site agent and a streaming site derive the same seed from it."""


def uplink_seed(round_seed: int, site: str, uplink_codec: str) -> int:
    """The seed site ``site`` encodes its upload of a round with ``round_seed``.

    Per site and round (``derive_seed(round_seed, UPLINK_SEED_PURPOSE, site)``), so ``randk:F``
    keeps different coordinates at every site; for a codec with ``shared_coordinates``
    (``randk:F,shared``) the round's shared seed, the one a secure round takes its coordinates
    from (``secure_index_seed``), so every site keeps the same coordinates. The simulator
    (``RoundPlan.uplink_seed``) and the site agent both call this.
    """
    if parse_codec(uplink_codec).shared_coordinates:
        return secure_index_seed(round_seed)
    return derive_seed(round_seed, UPLINK_SEED_PURPOSE, site)


@dataclass(frozen=True, slots=True)
class RoundPlan:
    """What the coordinator tells the sites at the start of a round."""

    round: int
    """Round number, from 0 (the same number the wire carries)."""
    fragment: int
    """Streaming DiLoCo fragment the round synchronises (0: the whole model without streaming)."""
    inner_steps: int
    """Steps each site runs before uploading."""
    sites: tuple[str, ...]
    """Sites asked to train this round."""
    update_kind: UpdateKind
    """What the sites upload: pseudo-gradients or gradients."""
    uplink_codec: str
    """Codec spec for the uploads."""
    seed: int
    """Round seed; per-site codec seeds derive from it (``uplink_seed``)."""

    def uplink_seed(self, site: str) -> int:
        """Seed for site ``site``'s uplink codec this round (random-k, stochastic rounding)."""
        return uplink_seed(self.seed, site, self.uplink_codec)

    @property
    def downlink_seed(self) -> int:
        return derive_seed(self.seed, "downlink")


@dataclass(slots=True)
class RoundUpdate:
    """Result of aggregating a round."""

    global_flat: torch.Tensor
    """``θ_{t+1} = θ_t + D(d_t)`` (identical to what each site computes from ``downlink``)."""
    downlink: Encoded
    """``d_t``, the bytes broadcast to every site (the round's fragment only, when streaming)."""
    digest: str
    """``weights_digest(global_flat)``, sent with the broadcast: computed once, here."""
    sites: tuple[str, ...]
    """Sites whose uploads were aggregated."""
    mean_norm: float = 0.0
    """L2 norm of the mean update the outer step took (0 for a round that changed nothing)."""


@dataclass(slots=True)
class FragmentOuter:
    """The coordinator's state for one fragment: its outer optimizer and downlink residual.

    Momentum, Adam moments and step counts advance only when the fragment syncs; plain DiLoCo
    has one of these over the whole model.
    """

    outer: OuterOptimizer
    downlink: UpdateEncoder
    last_step_s: dict[str, float] = field(default_factory=dict)
    """Seconds the last ``step`` spent in ``outer_step`` and ``downlink_encode`` (the
    coordinator's round phases)."""

    def step(
        self, global_part: torch.Tensor, mean_box: list[torch.Tensor], seed: int, *, consume_mean: bool
    ) -> tuple[Encoded, torch.Tensor]:
        """Outer step on the fragment, then ``d_t`` and the fragment's ``θ_{t+1}``.

        The mean comes in a one-element list that this call empties, and ``θ'`` goes to the
        downlink encoder straight from a list too: a local name in any frame would keep a
        model-sized tensor alive through the downlink encode, the coordinator's peak.
        """
        started = time.perf_counter()
        new_box = [self.outer.step(global_part, mean_box.pop(), consume_gradient=consume_mean)]
        stepped = time.perf_counter()
        # θ' is this call's own tensor: θ' − θ_t is computed in its memory.
        result = encode_downlink(
            self.downlink, global_part, new_box.pop(), seed=seed, consume_new_flat=True
        )
        self.last_step_s = {"outer_step": stepped - started, "downlink_encode": time.perf_counter() - stepped}
        return result

    def state_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {f"outer.{k}": v for k, v in self.outer.state_tensors().items()}
        tensors.update({f"downlink.{k}": v for k, v in self.downlink.state_tensors().items()})
        return tensors

    def load_state(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        self.outer.load_state(_under(tensors, "outer."), meta["outer"])
        self.downlink.load_state(_under(tensors, "downlink."), meta["downlink"])


def _under(tensors: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}


class Strategy:
    """Plans rounds and turns aggregated updates into new global weights (one outer step).

    Fragments are built in: the model is a ``FragmentPartition`` of ``P`` fragments, each with
    its own ``FragmentOuter``, and round ``r`` synchronises fragment ``r mod P``. Plain DiLoCo is
    the case ``P = 1`` without overlap (one fragment over the whole model, gathered and scattered
    without a copy), Streaming DiLoCo (Douillard et al. 2025) is ``P > 1``; the coordinator, the
    sites and the simulator call the same methods either way. DiLoCo, FedAvg, FedOpt and
    SparseLoCo are this class under their name, which sets the default outer optimizer
    (``algorithm_config.DEFAULT_OUTER_OPTIMIZERS``) and, for SparseLoCo, a preset of codec keys
    (``PRESETS``); only the DDP baseline (``DataParallel``) behaves differently. State is exposed
    as tensors + JSON metadata for safetensors checkpoints.
    """

    update_kind: ClassVar[UpdateKind] = "pseudo_gradient"

    def __init__(
        self,
        config: AlgorithmConfig,
        *,
        numel: int,
        layout: ParamLayout | None = None,
        outer_optimizer: OuterOptimizerConfig | None = None,
        inner_optimizer: InnerOptimizerConfig | None = None,
        seed: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        self.config = config
        self.name: str = config.name
        """The algorithm's name (``[algorithm] name``): seeds, checkpoints and records carry it."""
        self.numel = numel
        self.seed = seed
        self.device = device
        self.streaming = config.streaming if config.streaming.enabled else StreamingConfig()
        if self.streaming.enabled and self.update_kind != UPDATE_PSEUDO_GRADIENT:
            raise ValueError(
                f"streaming needs a pseudo-gradient algorithm (diloco, fedavg, fedopt), not {self.name!r}"
            )
        if self.streaming.fragments > 1:
            if layout is None:
                raise ValueError("streaming needs the model's ParamLayout: pass layout= to build_strategy")
            if layout.numel != numel:
                raise ValueError(f"layout has {layout.numel} elements but numel = {numel}")
            self.partition = FragmentPartition.from_layout(
                layout, self.streaming.fragments, self.streaming.split
            )
        else:
            self.partition = FragmentPartition.whole(numel)
        self.layout = layout
        """The model's parameter layout, when given: uplink codecs that tile per tensor use it."""
        self.partial: PartialAssignment | None = None
        """Partial Parameter Updates: which tensors each site trains (None: all of them)."""
        if config.partial_updates.enabled:
            if layout is None:
                raise ValueError("partial updates need the model's ParamLayout: pass layout= to build_strategy")
            try:
                self.partial = PartialAssignment.build(config.partial_updates, layout)
            except ConfigError as err:
                raise err.under("algorithm") from None
        self.schedule = StreamingSchedule.from_config(self._round_steps(), self.streaming)
        self.on_mean: Callable[[RoundPlan, torch.Tensor], None] | None = None
        """Called with each round's mean update before the outer step may overwrite it: the
        coordinator's round log (``geoloco.coordinator.round_log``) writes it there, because the
        round's new state is a deterministic function of the old state and this one vector."""
        self.inner_optimizer_config = inner_optimizer or InnerOptimizerConfig()
        self.outer_optimizer_config = (outer_optimizer or OuterOptimizerConfig()).resolved(
            DEFAULT_OUTER_OPTIMIZERS.get(config.name, "nesterov")
        )
        self.fragments = [
            FragmentOuter(outer=self._build_outer(fragment.numel), downlink=self._build_encoder("downlink"))
            for fragment in self.partition.fragments
        ]

    def _round_steps(self) -> int:
        """Inner steps between two syncs of the same fragment (H)."""
        return self.config.inner_steps

    def _build_outer(self, numel: int) -> OuterOptimizer:
        return OuterOptimizer(self.outer_optimizer_config, numel, device=self.device)

    def _build_encoder(
        self, direction: Literal["uplink", "downlink"], shapes: Sequence[tuple[int, ...]] | None = None
    ) -> UpdateEncoder:
        codec = parse_codec(self.config.uplink_codec if direction == "uplink" else self.config.downlink_codec)
        if direction == "downlink":
            shapes = self.update_shapes()
        return UpdateEncoder(
            codec if shapes is None else codec.with_shapes(shapes),
            error_feedback=self.config.error_feedback,
            decay=self.config.error_feedback_decay,
        )

    @property
    def outer(self) -> OuterOptimizer:
        """The outer optimizer of an unfragmented strategy (the ddp baseline's shared one)."""
        if len(self.fragments) != 1:
            raise ValueError("a streaming strategy has one outer optimizer per fragment: use .fragments")
        return self.fragments[0].outer

    @property
    def inner_steps(self) -> int:
        """Inner steps per round that the sites run: H / P (one fragment syncs per round)."""
        return self.schedule.interval

    def fragment_for_round(self, round_index: int) -> int:
        """The fragment round ``round_index`` synchronises (0 without streaming)."""
        return self.schedule.fragment_for_round(round_index)

    def fragment(self, round_index: int) -> Fragment:
        return self.partition[self.fragment_for_round(round_index)]

    def update_numel(self, round_index: int) -> int:
        """Elements of round ``round_index``'s uploads and broadcast (its fragment's)."""
        return self.fragment(round_index).numel

    def upload_numel(self, round_index: int, site: str) -> int:
        """Elements of site ``site``'s upload for round ``round_index``: its partial-updates
        group's subset, or the round's update (``update_numel``)."""
        if self.partial is not None:
            return self.partial.partial_numel(self.partial.site_group(site))
        return self.update_numel(round_index)

    def upload_part(self, update: torch.Tensor, site: str) -> torch.Tensor:
        """What site ``site`` encodes of its update: its group's subset with partial updates
        (in layout order), else the update itself."""
        if self.partial is None:
            return update
        return self.partial.gather(update, self.partial.site_group(site))

    def configure_round(self, round_index: int, sites: Sequence[str]) -> RoundPlan:
        """The plan of round ``round_index`` (from 0, as on the wire)."""
        return RoundPlan(
            round=round_index,
            fragment=self.fragment_for_round(round_index),
            inner_steps=self.inner_steps,
            sites=tuple(sites),
            update_kind=self.update_kind,
            uplink_codec=self.config.uplink_codec,
            seed=derive_seed(self.seed, self.name, round_index),
        )

    def update_shapes(self, site: str | None = None) -> list[tuple[int, ...]] | None:
        """The parameter tensors an update vector is made of, in order, where the strategy
        knows them (for codecs that tile per tensor, ``tiletopk``): the model's, or with partial
        updates site ``site``'s group's; None with streaming fragments, without a layout, or
        with partial updates but no site (such codecs then read the vector as one 1-D tensor)."""
        if self.layout is None or len(self.partition.fragments) > 1:
            return None
        if self.partial is None:
            return [entry.shape for entry in self.layout.entries]
        if site is None:
            return None
        trained = self.partial.trained(self.partial.site_group(site))
        return [entry.shape for entry, on in zip(self.layout.entries, trained, strict=True) if on]

    def build_uplink(self, site: str | None = None) -> FragmentUplink:
        """A site's uplink encoders (one per fragment, kept across rounds for their residuals);
        ``site`` names whose group's tensors a partial-updates upload holds."""
        return FragmentUplink([self.uplink_encoder(site) for _ in self.partition.fragments])

    def uplink_encoder(self, site: str | None = None) -> UpdateEncoder:
        """One fresh uplink encoder (empty residual), e.g. to reset a fragment's after NaNs."""
        return self._build_encoder("uplink", self.update_shapes(site))

    def site_weight(self, samples: int, inner_steps: int = 1) -> float:
        """``w_k`` for a site that ran ``inner_steps`` steps on ``samples`` samples this round."""
        return weighting_site_weight(self.config.weighting, samples=samples, inner_steps=inner_steps)

    def new_aggregator(self, round_index: int) -> RunningSum:
        """The aggregation buffer of round ``round_index`` (sized for its fragment)."""
        return RunningSum(numel=self.update_numel(round_index), device=self.device)

    def aggregate_round(
        self,
        global_flat: torch.Tensor,
        aggregator: Aggregation,
        plan: RoundPlan,
    ) -> RoundUpdate:
        """Outer step on the aggregated update, then the downlink encoding of the change.

        The aggregator hands its buffer over (``take_result``) and the outer optimizer uses it as
        ``.grad`` without a copy, so the mean costs no vector of its own and is freed right after
        the outer step, before the downlink is built (coordinator peak memory).
        """
        sites = tuple(aggregator.sites)
        return self.apply_mean_update(
            global_flat, aggregator.take_result(), sites, plan, consume_mean=True
        )

    def apply_mean_update(
        self,
        global_flat: torch.Tensor,
        mean_update: torch.Tensor,
        sites: tuple[str, ...],
        plan: RoundPlan,
        *,
        consume_mean: bool = False,
    ) -> RoundUpdate:
        """Outer step on an already averaged update of the round's fragment (e.g. a secure
        aggregate), then the downlink. ``global_flat`` is always the full vector.

        ``consume_mean=True``: the caller passes its last reference to ``mean_update``, which the
        outer optimizer may overwrite and which is freed right after the step.
        """
        fragment = self.partition[plan.fragment]
        whole = self.partition.is_whole
        # A secure or DP mean may come from the CPU. The list is the only holder from here on, so
        # the step frees the mean before the downlink encode (see ``FragmentOuter.step``).
        mean_box = [mean_update.to(global_flat.device)]
        del mean_update
        if self.on_mean is not None:
            self.on_mean(plan, mean_box[0])
        # Taken before the outer step, which may overwrite the mean (consume_mean).
        mean_norm = float(torch.linalg.vector_norm(mean_box[0]))
        downlink, next_part = self.fragments[plan.fragment].step(
            global_flat if whole else fragment.gather(global_flat), mean_box,
            plan.downlink_seed, consume_mean=consume_mean,
        )
        next_flat = next_part if whole else fragment.scatter_(global_flat.clone(), next_part)
        return RoundUpdate(
            global_flat=next_flat, downlink=downlink, digest=weights_digest(next_flat), sites=sites,
            mean_norm=mean_norm,
        )

    def no_change(self, global_flat: torch.Tensor, plan: RoundPlan) -> RoundUpdate:
        """An aborted round: no outer step; the downlink carries ``θ' = θ_t`` plus the round
        fragment's downlink residual, applied like any other broadcast of that round."""
        fragment = self.partition[plan.fragment]
        whole = self.partition.is_whole
        part = global_flat if whole else fragment.gather(global_flat)
        downlink, next_part = encode_downlink(
            self.fragments[plan.fragment].downlink, part, part.clone(),
            seed=plan.downlink_seed, consume_new_flat=True,
        )
        next_flat = next_part if whole else fragment.scatter_(global_flat.clone(), next_part)
        return RoundUpdate(
            global_flat=next_flat, downlink=downlink, digest=weights_digest(next_flat), sites=()
        )

    def apply_downlink(
        self, global_flat: torch.Tensor, encoded: Encoded, round_index: int
    ) -> torch.Tensor:
        """What a site does with round ``round_index``'s broadcast: the new full ``θ_g``, by the
        same addition as the coordinator's, so the replicas stay bit-identical."""
        if self.partition.is_whole:
            return apply_downlink(global_flat, encoded)
        fragment = self.fragment(round_index)
        new_part = apply_downlink(fragment.gather(global_flat), encoded)
        return fragment.scatter_(global_flat.clone(), new_part)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Outer optimizer state and downlink residual per fragment, named for one safetensors
        file (an unfragmented strategy keeps the plain ``outer.``/``downlink.`` names)."""
        if len(self.fragments) == 1:
            return self.fragments[0].state_tensors()
        out: dict[str, torch.Tensor] = {}
        for p, frag in enumerate(self.fragments):
            out.update({f"{FRAGMENT_PREFIX}{p}.{k}": v for k, v in frag.state_tensors().items()})
        return out

    def _fragment_meta(self, frag: FragmentOuter) -> dict[str, Any]:
        return {
            "algorithm": self.name,
            "config": self.config.to_dict(),
            "outer_optimizer": self.outer_optimizer_config.to_dict(),
            "outer": frag.outer.state_meta(),
            "downlink": frag.downlink.state_meta(),
        }

    def state_meta(self) -> dict[str, Any]:
        """JSON-able rest of the state, with the configs it was built from."""
        if len(self.fragments) == 1:
            return self._fragment_meta(self.fragments[0])
        return {
            "algorithm": self.name,
            "config": self.config.to_dict(),
            "streaming": self.streaming.to_dict(),
            "partition": self.partition.to_dict(),
            "fragments": [self._fragment_meta(frag) for frag in self.fragments],
        }

    def load_state(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Restore what ``state_tensors()`` / ``state_meta()`` returned."""
        if meta.get("algorithm") != self.name:
            raise ValueError(
                f"state was saved by algorithm {meta.get('algorithm')!r}; this is {self.name!r}"
            )
        saved = meta.get("fragments")
        if len(self.fragments) == 1:
            if saved is not None:
                raise ValueError(
                    f"state was saved by Streaming DiLoCo with {len(saved)} fragments; resume "
                    "with the same [algorithm.streaming] settings or start a fresh checkpoint_dir"
                )
            self.fragments[0].load_state(tensors, meta)
            return
        if not isinstance(saved, list) or len(saved) != len(self.fragments):
            got = "plain (unfragmented) state" if saved is None else f"{len(saved)} fragments"
            raise ValueError(
                f"state holds {got}; this run streams {len(self.fragments)} fragments: resume "
                "with the streaming settings the checkpoint was written with, or start a fresh "
                "checkpoint_dir"
            )
        if meta.get("partition") != self.partition.to_dict():
            raise ValueError(
                "checkpoint's fragment partition differs from this run's (different model or "
                "streaming.split); resume with the same settings or start a fresh checkpoint_dir"
            )
        for p, frag in enumerate(self.fragments):
            frag.load_state(_under(tensors, f"{FRAGMENT_PREFIX}{p}."), saved[p])


class DataParallel(Strategy):
    """The data-parallel baseline: synchronous DDP, one shared inner-optimizer state.

    Every step, sites upload one batch's gradient; the coordinator averages them and applies one
    step of the *inner* optimizer (e.g. AdamW, with gradient clipping) over the flat weights —
    the step every DDP replica would take after its all-reduce — and broadcasts the change. With
    the default ``"none"`` codecs that is each site's fp32 gradient up and one fp32 vector down
    per step, DDP's traffic. ``θ_t + (θ' − θ_t)`` can differ from ``θ'`` in the last bit; all
    replicas apply the same addition, so they stay identical.
    """

    update_kind = "gradient"

    def _build_outer(self, numel: int) -> OuterOptimizer:
        return OuterOptimizer.from_inner(self.inner_optimizer_config, numel, device=self.device)

    def _round_steps(self) -> int:
        return 1


ALGORITHMS: dict[str, type[Strategy]] = {
    "diloco": Strategy,
    "fedavg": Strategy,
    "fedopt": Strategy,
    "ddp": DataParallel,
    "sparseloco": Strategy,
    "sparseloco-tiles": Strategy,
}
"""Algorithm name -> strategy class (the names of ``ALGORITHM_NAMES``)."""
assert tuple(ALGORITHMS) == ALGORITHM_NAMES


def build_strategy(
    config: AlgorithmConfig,
    *,
    numel: int,
    outer_optimizer: OuterOptimizerConfig | None = None,
    inner_optimizer: InnerOptimizerConfig | None = None,
    seed: int = 0,
    device: torch.device | str | None = None,
    layout: ParamLayout | None = None,
) -> Strategy:
    """The strategy named by ``config.name``; with ``config.streaming.enabled`` it syncs
    fragments, which needs the model's ``layout``."""
    try:
        cls = ALGORITHMS[config.name]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {config.name!r}; valid names: {', '.join(ALGORITHMS)}"
        ) from None
    return cls(
        config,
        numel=numel,
        layout=layout,
        outer_optimizer=outer_optimizer,
        inner_optimizer=inner_optimizer,
        seed=seed,
        device=device,
    )

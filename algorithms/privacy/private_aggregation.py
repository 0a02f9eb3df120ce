"""Privacy settings and the site/coordinator math that composes secure aggregation, DP and codecs.

* ``PrivacyConfig`` — secure aggregation on/off and its protocol knobs, DP mode, clip, noise,
  accounting target and budget; ``check_composition`` rejects what cannot work (top-k with secure
  aggregation, fewer than 3 sites).
* ``PrivateUpdateEncoder`` (site) — ``u = g + e`` (error feedback), the shared random-k
  coordinates if any, L2 clip, fixed-point with stochastic rounding, distributed Skellam noise;
  then the integers are handed, chunk by chunk, to ``SecAggClient.mask_chunk``.
* ``decode_secure_sum`` (coordinator) — the lifted integer sum back to a float mean update.
* ``add_central_noise`` — central DP: Gaussian noise on the coordinator's sum.
* ``PrivacyAccountant`` — epsilon at ``delta`` from Google's ``dp-accounting`` RDP accountant.

**Distributed noise: the Skellam mechanism** (Agarwal, Kairouz, Liu, "The Skellam Mechanism for
Differentially Private Federated Learning", NeurIPS 2021). Each site adds
``Poisson(μ_k/2) − Poisson(μ_k/2)`` per integer coordinate; Skellam variables are closed under
summation, so the sum carries Skellam noise of variance ``Σ μ_k`` — an integer mechanism that
survives modular arithmetic, unlike continuous Gaussian noise. Every site uses ``μ_k = σ² / t``
(``σ = noise_multiplier · clip · scale``, ``t`` the secure-aggregation threshold), so any ``t``
surviving sites already carry the full variance ``σ²``: dropouts cannot weaken the guarantee.
Accounting composes a Gaussian event whose noise multiplier is ``σ / Δ`` with the L2 sensitivity
``Δ = clip · scale + sqrt(k)`` (``sqrt(k)``: stochastic rounding can move each of the ``k`` sent
coordinates by < 1). The Skellam RDP bound of Agarwal et al. is the Gaussian one,
``α Δ² / (2 μ)``, plus a correction of order ``α Δ² / μ²`` (and an l1-sensitivity term of the
same order), i.e. a relative excess of order ``1 / μ``. The encoding keeps at least 256 integer
levels per ``clip``, so ``μ ≥ (256 · noise_multiplier)²`` and the excess is of order
``1e-5 / noise_multiplier²``. ``dp-accounting`` has no Skellam event, so the Gaussian event is
what is composed; this is a documented approximation of that size, not a hidden one.

**Streaming DiLoCo.** With ``[algorithm.streaming]`` each round synchronises one fragment ``p``
of the weights, and every privacy step works on that fragment's update only: the secure sum has
``numel = |fragment p|`` (or random-k's ``k`` of it, from the round's shared seed), the clip
bounds the L2 norm of the *fragment's* update to ``clip_norm``, the fixed-point scale, masks and
Skellam noise are those of that sum, and each site keeps one error-feedback residual per
fragment (``PrivateUpdateEncoder`` per fragment). A round releases one fragment of each site's
update, so the accountant composes **one release per fragment sync**, with the clipped fragment
update as the sensitivity: P fragment rounds cost P releases, as P plain rounds would (each
release reveals less of the model, but the accounting does not take credit for that; a site's
whole-model change over P rounds is bounded by ``sqrt(P) · clip_norm``).

The guarantee is **site-level** (adding or removing one site's whole update), with every site
participating each round (no subsampling amplification), for ``dp = "central"`` or
``"distributed"``.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from geoloco.algorithms.aggregation import add_gaussian_noise
from geoloco.algorithms.config import ConfigError, config_to_dict, require
from geoloco.algorithms.fixed_point import FixedPoint, plan_fixed_point, secure_generator, stochastic_round
from geoloco.algorithms.privacy.dp_accountant import PrivacyAccountant
from geoloco.algorithms.privacy.secagg_crypto import (
    DEFAULT_COLLUDING_SITES,
    check_threshold,
    neighbour_graph,
    secure_threshold,
)
from geoloco.algorithms.privacy.secagg_messages import MIN_SITES, RoundContext
from geoloco.compression import parse_codec
from geoloco.compression.sparsify import RandK, random_indices

if TYPE_CHECKING:
    from geoloco.algorithms.privacy.secagg_in_memory import SiteTraffic

__all__ = [
    "DP_MODES",
    "SECURE_INDEX_SEED_PURPOSE",
    "SECURE_UPLOAD_CODEC",
    "PrivacyAccountant",
    "PrivacyConfig",
    "PrivateUpdateEncoder",
    "add_central_noise",
    "central_dp_mean",
    "check_composition",
    "check_privacy_setup",
    "check_threshold_bound",
    "decode_secure_sum",
    "effective_noise_multiplier",
    "noise_generator",
    "plan_secure_round",
    "private_round_in_memory",
    "secure_context",
    "secure_fixed_point",
    "secure_index_seed",
    "skellam_noise",
]

DP_MODES = ("off", "central", "distributed")
SECURE_UPLOAD_CODEC = "secagg"
"""``BlobManifest.codec`` of a masked upload: integers in ``Z_{2^b}``, ``b / 8`` bytes each."""
MAX_NOISE_STD_UNITS = float(1 << 20)
"""Distributed DP caps the scale so the sum's noise std is at most 2^20 integer units: Poisson
samplers lose accuracy for rates far above 1e12 (measured: +17% variance at 1.5e15), and at 2^20
units the rounding noise (std < 1 unit) is still negligible beside the DP noise."""
SECURE_INDEX_SEED_PURPOSE = "secure-randk"
"""Random-k under secure aggregation: ONE seed per round shared by every site (masked sums only
add up on shared coordinates), so a private round reads ``randk:F`` as ``randk:F,shared``; plain
rounds use per-site seeds unless the codec says ``shared`` (then this same seed,
``geoloco.algorithms.strategy.uplink_seed``)."""


def secure_index_seed(round_seed: int) -> int:
    """The random-k seed of a secure round, from the round seed every site and the coordinator share."""
    from geoloco.algorithms.params import derive_seed

    return derive_seed(round_seed, SECURE_INDEX_SEED_PURPOSE)


@dataclass(kw_only=True, slots=True)
class PrivacyConfig:
    """Secure aggregation and differential privacy for the uplink (the ``[privacy]`` table)."""

    secure_aggregation: bool = False
    """Mask uploads so the coordinator learns only the sum (Bonawitz et al. 2017)."""
    threshold: int | None = None
    """Shares needed to unmask (sites that must answer); unset: ceil(2/3) of the share holders, or
    more if ``2 t > holders + colluding_sites`` needs it. A set threshold must satisfy that bound
    (else a hostile coordinator can show two groups of sites different survivor lists and unmask
    every update): checked here against the configured sites and by every site each round."""
    colluding_sites: int = DEFAULT_COLLUDING_SITES
    """Sites assumed to collude with a hostile coordinator (0: the coordinator acts alone). It
    raises the default threshold and bounds a set one here; each site checks the round's
    threshold against its own assumption too (``SiteAgentConfig.colluding_sites``, ``geoloco site
    --colluding-sites``, default 1) and refuses one below it, so a lower value here than the
    sites' only makes them refuse the rounds."""
    neighbours: Literal["full", "secagg+"] = "full"
    """Pairwise masks with every site, or the SecAgg+ graph of O(log n) neighbours (Bell et al. 2020)."""
    modulus_bits: Literal[8, 16, 32] = 32
    """Integer width of masked values (bytes on the wire per value = bits / 8)."""
    chunk_size: int = 1 << 18
    """Values per masked upload chunk; site memory for masks is O(chunk_size)."""
    clip_norm: float | None = None
    """L2 bound of each site's update; required with secure aggregation (fixed-point range) or DP."""
    dp: Literal["off", "central", "distributed"] = "off"
    """No DP, Gaussian noise added by the coordinator, or Skellam noise shared across sites."""
    noise_multiplier: float = 1.0
    """Noise standard deviation of the sum, in units of ``clip_norm``."""
    delta: float = 1e-5
    """The delta at which epsilon is reported."""
    epsilon_budget: float | None = None
    """Stop training before a round that would push epsilon above this."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        require(self.threshold is None or self.threshold >= 2, "threshold", f"must be >= 2, got {self.threshold}")
        require(self.colluding_sites >= 0, "colluding_sites", f"must be >= 0, got {self.colluding_sites}")
        require(self.chunk_size >= 1, "chunk_size", f"must be >= 1, got {self.chunk_size}")
        require(self.dp in DP_MODES, "dp", f"got {self.dp!r}; allowed: {', '.join(DP_MODES)}")
        require(
            self.clip_norm is None or self.clip_norm > 0, "clip_norm", f"must be > 0, got {self.clip_norm}"
        )
        require(
            not (self.secure_aggregation or self.dp != "off") or self.clip_norm is not None,
            "clip_norm",
            "must be set when secure_aggregation is on or dp is not 'off' (it bounds each site's update)",
        )
        require(
            self.dp != "distributed" or self.secure_aggregation,
            "dp",
            "'distributed' noise only protects the sum when secure_aggregation = true; "
            "use dp = 'central' without secure aggregation",
        )
        require(self.noise_multiplier > 0, "noise_multiplier", f"must be > 0, got {self.noise_multiplier}")
        require(0 < self.delta < 1, "delta", f"must be in (0, 1), got {self.delta}")
        require(
            self.epsilon_budget is None or self.epsilon_budget > 0,
            "epsilon_budget",
            f"must be > 0, got {self.epsilon_budget}",
        )

    @property
    def enabled(self) -> bool:
        return self.secure_aggregation or self.dp != "off"

    @property
    def unmasked_central_dp(self) -> tuple[float, float] | None:
        """``(clip_norm, noise_multiplier)`` when a trusted aggregator clips and noises updates it
        sees one by one (central DP without secure aggregation); else None."""
        if self.dp != "central" or self.secure_aggregation:
            return None
        assert self.clip_norm is not None  # validate() requires it for DP
        return self.clip_norm, self.noise_multiplier

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


def check_aggregation(
    privacy: PrivacyConfig, *, weighting: str, late_updates: str, deadline_key: str | None = None
) -> None:
    """Reject aggregation options privacy cannot honour (keys as in ``[algorithm]``).

    ``deadline_key`` names the round-deadline setting in force (fixed or adaptive), if any.
    Streaming DiLoCo needs no check: each round's secure sum, clip and DP release cover that
    round's fragment only (see the module docstring, "Streaming DiLoCo").
    """
    if not privacy.enabled:
        return
    if privacy.secure_aggregation and deadline_key is not None:
        raise ConfigError(
            deadline_key,
            "a secure round must not close at a deadline: masked chunks enter one running sum as "
            "they arrive, so an upload cut off mid-way cannot be taken out again and would abort "
            "the round for every site; unset it (a site that vanishes is dropped after "
            "heartbeat_timeout_s, and the round then aborts or completes without it)",
        )
    require(
        weighting == "uniform",
        "algorithm.weighting",
        "with [privacy] on every site counts the same in the mean (per-site weights would change "
        "the DP sensitivity and, under secure aggregation, cannot be applied to masked values); "
        "set weighting = \"uniform\"",
    )
    require(
        late_updates == "drop",
        "algorithm.late_updates",
        "with [privacy] on an update counts only in its own round (a masked update belongs to that "
        "round's secure sum, and a folded one would change the DP sensitivity); set "
        "late_updates = \"drop\"",
    )


def check_composition(privacy: PrivacyConfig, uplink_codec: str, num_sites: int | None = None) -> None:
    """Reject configurations secure aggregation cannot serve, saying what to use instead."""
    if not privacy.secure_aggregation:
        return
    codec = parse_codec(uplink_codec)
    sparsifier = getattr(codec, "sparsifier", None)
    values = getattr(codec, "values", None)
    if sparsifier is not None and not isinstance(sparsifier, RandK):
        raise ConfigError(
            "uplink_codec",
            f"uplink codec {uplink_codec!r} cannot be combined with secure aggregation: each site "
            "would choose different coordinates and masked sums only add up on shared "
            "coordinates; use 'randk:F' (a private round reads it as 'randk:F,shared': every "
            "site keeps the coordinates of the round's shared seed) or 'none'",
        )
    if isinstance(sparsifier, RandK) and sparsifier.unbiased:
        raise ConfigError(
            "uplink_codec",
            f"uplink codec {uplink_codec!r}: the 'unbiased' random-k scaling is not supported with "
            "secure aggregation (error feedback keeps the unsent coordinates); drop ',unbiased'",
        )
    if values is not None and values.name != "none":
        raise ConfigError(
            "uplink_codec",
            f"uplink codec {uplink_codec!r} cannot be combined with secure aggregation: values are "
            "fixed-point encoded with a shared scale for masking instead of quantized per site; "
            "use 'none' or 'randk:F'",
        )
    if num_sites is not None and num_sites < MIN_SITES:
        raise ConfigError(
            "privacy.secure_aggregation",
            f"{num_sites} sites: secure aggregation needs at least {MIN_SITES} sites, since with 2 "
            "the sum reveals each site's update to the other",
        )
    if num_sites is not None and privacy.threshold is not None and privacy.threshold > num_sites:
        raise ConfigError(
            "privacy.threshold", f"threshold {privacy.threshold} exceeds the {num_sites} sites"
        )
    if num_sites is not None and num_sites >= MIN_SITES:
        check_threshold_bound(privacy, num_sites)


def _holders(privacy: PrivacyConfig, num_sites: int) -> int:
    """Share holders of each secret in a round of ``num_sites`` (all sites, or a SecAgg+ neighbourhood)."""
    graph = neighbour_graph(range(num_sites), privacy.neighbours, session="", round_index=0)
    return min(len(v) for v in graph.values()) + 1


def check_threshold_bound(privacy: PrivacyConfig, num_sites: int, *, key: str = "privacy.threshold") -> None:
    """Refuse a threshold that lets a hostile coordinator split the sites' views (``2 t <= h + c``,
    ``split_view_bound``) in a round of ``num_sites``; ``key`` names the setting to change."""
    holders = _holders(privacy, num_sites)
    t = secure_threshold(privacy.threshold, holders, privacy.colluding_sites)
    unsafe = check_threshold(t, holders, privacy.colluding_sites)
    if unsafe:
        if privacy.threshold is None:
            key = "privacy.colluding_sites"
        raise ConfigError(key, f"with {num_sites} sites: {unsafe}; sites refuse such a round")


def check_privacy_setup(
    privacy: PrivacyConfig,
    *,
    weighting: str,
    late_updates: str,
    uplink_codec: str,
    num_sites: int | None,
    quorum: int | None,
    quorum_key: str,
    deadline_key: str | None = None,
) -> None:
    """Every check a config with ``[privacy]`` beside ``[algorithm]`` needs, in one place:
    ``check_aggregation``, ``check_composition`` (its codec key under ``algorithm.``) and, under
    secure aggregation, rounds of at least ``MIN_SITES`` sites. ``quorum_key`` and ``deadline_key``
    name the config's own settings (``run.min_sites``, ``run.round_deadline_s``, ...)."""
    if not privacy.enabled:
        return
    check_aggregation(privacy, weighting=weighting, late_updates=late_updates, deadline_key=deadline_key)
    try:
        check_composition(privacy, uplink_codec, num_sites)
    except ConfigError as err:
        raise err.under("algorithm" if err.key == "uplink_codec" else "") from None
    if privacy.secure_aggregation and quorum is not None:
        require(
            quorum >= MIN_SITES,
            quorum_key,
            f"secure aggregation needs rounds of at least {MIN_SITES} sites (with 2 the sum "
            f"reveals each site's update to the other); got a quorum of {quorum}",
        )
        if num_sites is None and privacy.threshold is not None:
            # The rounds will have at least the quorum: a threshold unsafe there is unsafe always.
            check_threshold_bound(privacy, quorum)


def _randk(uplink_codec: str) -> RandK | None:
    sparsifier = getattr(parse_codec(uplink_codec), "sparsifier", None)
    return sparsifier if isinstance(sparsifier, RandK) else None


def _sent_count(uplink_codec: str, numel: int) -> int:
    randk = _randk(uplink_codec)
    return numel if randk is None else randk.num_selected(numel)


def _threshold(privacy: PrivacyConfig, num_sites: int) -> int:
    return secure_threshold(privacy.threshold, num_sites, privacy.colluding_sites)


def secure_context(
    privacy: PrivacyConfig, uplink_codec: str, *, numel: int, session: str, round_index: int
) -> RoundContext:
    """The protocol parameters of a round (values sent: ``numel``, or ``k`` with random-k)."""
    check_composition(privacy, uplink_codec)
    return RoundContext(
        session=session,
        round_index=round_index,
        numel=_sent_count(uplink_codec, numel),
        modulus_bits=privacy.modulus_bits,
        chunk_size=privacy.chunk_size,
        neighbours=privacy.neighbours,
        threshold=privacy.threshold,
        colluding_sites=privacy.colluding_sites,
    )


def secure_fixed_point(privacy: PrivacyConfig, num_sites: int) -> FixedPoint:
    """The shared clip and scale for ``num_sites`` participants, with headroom and DP noise."""
    if num_sites < MIN_SITES:
        raise ConfigError(
            "privacy.secure_aggregation",
            f"{num_sites} sites: secure aggregation needs at least {MIN_SITES} sites, since with 2 "
            "the sum reveals each site's update to the other",
        )
    assert privacy.clip_norm is not None
    noise = privacy.noise_multiplier * privacy.clip_norm if privacy.dp == "distributed" else 0.0
    t = _threshold(privacy, num_sites)
    # Sites add noise for t survivors; all n surviving raises the sum's std by sqrt(n / t).
    return plan_fixed_point(
        privacy.clip_norm,
        num_sites,
        modulus_bits=privacy.modulus_bits,
        noise_std=noise * math.sqrt(num_sites / t),
        max_scale=MAX_NOISE_STD_UNITS / noise if noise > 0 else None,
    )


def plan_secure_round(
    privacy: PrivacyConfig,
    uplink_codec: str,
    *,
    numel: int,
    num_sites: int,
    session: str,
    round_index: int,
) -> tuple[RoundContext, FixedPoint]:
    """The round context and the shared fixed-point encoding both sides derive from the config."""
    check_composition(privacy, uplink_codec, num_sites)
    context = secure_context(privacy, uplink_codec, numel=numel, session=session, round_index=round_index)
    return context, secure_fixed_point(privacy, num_sites)


def noise_generator() -> np.random.Generator:
    """A NumPy PCG64 generator seeded from the OS CSPRNG (DP noise must be unpredictable)."""
    return np.random.default_rng(secrets.randbits(128))


def skellam_noise(shape: int, variance: float, rng: np.random.Generator) -> torch.Tensor:
    """Symmetric Skellam integers ``Poisson(v/2) − Poisson(v/2)`` (variance ``v``), int64."""
    if variance <= 0:
        return torch.zeros(shape, dtype=torch.int64)
    a = rng.poisson(variance / 2, shape)
    b = rng.poisson(variance / 2, shape)
    return torch.from_numpy(a - b)


@dataclass(slots=True)
class PrivateUpdateEncoder:
    """A site's uplink under privacy: error feedback, shared coordinates, clip, fixed point, noise.

    Each site keeps its own error-feedback residual ``e_k`` (what clipping and rounding removed,
    and the coordinates random-k did not send); DP noise is never fed back.
    """

    privacy: PrivacyConfig
    uplink_codec: str = "none"
    error_feedback: bool = True
    residual: torch.Tensor | None = field(default=None, init=False)
    _sent: tuple[torch.Tensor, torch.Tensor | None] | None = field(default=None, init=False)
    """What the last ``encode`` sent (float values, random-k index or None), for ``restore``."""

    def encode(
        self,
        update: torch.Tensor,
        fixed: FixedPoint,
        context: RoundContext,
        *,
        index_seed: int,
        num_sites: int,
        generator: torch.Generator | None = None,
        noise_rng: np.random.Generator | None = None,
    ) -> Iterator[np.ndarray]:
        """The integer chunks to mask (``context.chunk_size`` values each); the residual is updated
        once the last chunk has been taken.

        ``index_seed`` is the shared round seed for random-k (every site passes the same one).
        Noise is drawn per chunk, so no full-size noise array exists beside the update.
        """
        generator = generator if generator is not None else secure_generator()
        noise_rng = noise_rng if noise_rng is not None else noise_generator()
        u = update.detach().to("cpu", torch.float32).reshape(-1)
        if self.error_feedback and self.residual is not None:
            u = u + self.residual
        randk = _randk(self.uplink_codec)
        index = None
        if randk is not None:
            index = random_indices(index_seed, u.numel(), randk.num_selected(u.numel()))
            values = u[index]
        else:
            values = u
        if values.numel() != context.numel:
            raise ValueError(f"the update has {values.numel()} values to send, the round expects {context.numel}")
        norm = float(torch.linalg.vector_norm(values, dtype=torch.float64))
        factor = fixed.scale * min(1.0, fixed.clip_norm / norm) if norm > 0 else fixed.scale
        residual = u.clone() if self.error_feedback else None
        sent_values = torch.empty(context.numel, dtype=torch.float32) if self.error_feedback else None
        self._sent = None
        variance = 0.0
        if self.privacy.dp == "distributed":
            assert self.privacy.clip_norm is not None
            sigma = self.privacy.noise_multiplier * self.privacy.clip_norm * fixed.scale
            variance = sigma**2 / _threshold(self.privacy, num_sites)
        # Chunk by chunk: clip factor, stochastic rounding, residual, noise; temporaries stay O(chunk).
        for start in range(0, context.numel, context.chunk_size):
            stop = min(context.numel, start + context.chunk_size)
            ints = stochastic_round(values[start:stop].to(torch.float64) * factor, generator)
            if residual is not None:
                sent = (ints.to(torch.float64) / fixed.scale).to(torch.float32)
                assert sent_values is not None
                sent_values[start:stop] = sent
                if index is None:
                    residual[start:stop] -= sent
                else:
                    residual[index[start:stop]] -= sent
            if variance > 0:
                ints += skellam_noise(ints.numel(), variance, noise_rng)
            yield ints.numpy()
        self.residual = residual
        if sent_values is not None:
            self._sent = (sent_values, index)

    def restore(self) -> None:
        """The last encoded update was not summed (the secure round aborted, or the coordinator
        refused the masked upload): put what it sent back into the residual, so the residual is
        the whole ``u`` again and the work is sent next time, like ``UpdateEncoder.restore`` for
        a plain upload that missed its round. Without error feedback the update is dropped.

        Under DP this is safe: nothing of the update was released, and whatever is sent later
        is clipped and noised again.
        """
        if self._sent is None or self.residual is None:
            return
        values, index = self._sent
        self._sent = None
        if index is None:
            self.residual += values
        else:
            self.residual.index_add_(0, index, values)

    def keep(self, update: torch.Tensor) -> None:
        """An update that never reached ``encode`` (the site sat the secure round out, e.g. its
        key stages failed): add it to the residual whole (with error feedback; else dropped)."""
        if not self.error_feedback:
            return
        u = update.detach().to("cpu", torch.float32).reshape(-1)
        self.residual = u.clone() if self.residual is None else self.residual + u
        self._sent = None


def decode_secure_sum(
    total: torch.Tensor, fixed: FixedPoint, *, count: int, numel: int, uplink_codec: str, index_seed: int
) -> torch.Tensor:
    """The lifted integer sum of ``count`` sites -> the mean update as a full fp32 vector."""
    if count < 1:
        raise ValueError("cannot take the mean of zero sites")
    mean = fixed.dequantize(total) / count
    randk = _randk(uplink_codec)
    if randk is None:
        return mean
    out = torch.zeros(numel, dtype=torch.float32)
    out[random_indices(index_seed, numel, randk.num_selected(numel))] = mean
    return out


def add_central_noise(
    total: torch.Tensor, privacy: PrivacyConfig, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Central DP: ``sum + N(0, (noise_multiplier · clip)^2)`` per coordinate (a new tensor on
    ``total``'s device)."""
    assert privacy.clip_norm is not None
    return add_gaussian_noise(total, privacy.noise_multiplier * privacy.clip_norm, generator)


def central_dp_mean(mean: torch.Tensor, count: int, privacy: PrivacyConfig) -> torch.Tensor:
    """The mean of ``count`` clipped updates with central DP's noise added to their sum (what a
    secure round with ``dp = "central"`` releases once the sum is unmasked)."""
    return add_central_noise(mean * count, privacy) / count


def effective_noise_multiplier(privacy: PrivacyConfig, fixed: FixedPoint | None, count: int) -> float:
    """Noise std of the sum over its L2 sensitivity (what the accountant composes).

    Distributed mode inflates the sensitivity by ``sqrt(count)`` rounding units (see module doc).
    """
    if privacy.dp == "central" or fixed is None:
        return privacy.noise_multiplier
    assert privacy.clip_norm is not None
    sensitivity = privacy.clip_norm * fixed.scale + math.sqrt(count)
    return privacy.noise_multiplier * privacy.clip_norm * fixed.scale / sensitivity


def private_round_in_memory(
    privacy: PrivacyConfig,
    uplink_codec: str,
    updates: dict[int, torch.Tensor],
    encoders: dict[int, PrivateUpdateEncoder],
    identity_keys: dict[int, Any],
    *,
    session: str,
    round_index: int,
    index_seed: int,
    drop_after_upload: tuple[int, ...] = (),
    traffic: dict[int, SiteTraffic] | None = None,
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """One secure (and optionally DP) round with all parties in this process: the mean update.

    The simulator and tests use it; the real system runs the same ``SecAggClient`` /
    ``SecAggServer`` stages over gRPC. Raises ``SecAggAbort`` when too few sites remain.
    """
    from geoloco.algorithms.fixed_point import lift
    from geoloco.algorithms.privacy.secagg_in_memory import run_round_in_memory

    numel = next(iter(updates.values())).numel()
    context, fixed = plan_secure_round(
        privacy, uplink_codec, numel=numel, num_sites=len(updates), session=session, round_index=round_index
    )
    inputs = {
        site: np.concatenate(
            list(encoders[site].encode(update, fixed, context, index_seed=index_seed, num_sites=len(updates)))
        )
        for site, update in updates.items()
    }
    total, survivors = run_round_in_memory(
        context, inputs, identity_keys, drop_after_upload=drop_after_upload, traffic=traffic,
    )
    mean = decode_secure_sum(
        lift(total, context.modulus_bits), fixed, count=len(survivors), numel=numel,
        uplink_codec=uplink_codec, index_seed=index_seed,
    )
    return mean, survivors

"""Per-site uplink codecs that fit each site's link (``[algorithm.adaptive_uplink]``).

With one codec for every site a round waits for the slowest link. With the adaptive uplink the
coordinator measures each site's upload throughput from the transfers it already receives
(``LinkMeter``) and, when it opens a round, gives every site its own codec
(``choose_codecs``) so that every upload takes about the same time:

* the reference time ``t_ref`` is the run's ``uplink_codec`` payload (e.g. ``int8``) over the
  median measured throughput: the time a typical site needs for the dense upload, but never
  less than ``min_upload_s`` (the noise floor, below);
* a site that can send the dense payload within ``tolerance · t_ref`` sends it;
* a slower site sends ``topk:D|<uplink_codec>`` with the largest density ``D`` (two significant
  digits, rounded down) whose payload fits in ``throughput · t_ref`` bytes, never below
  ``min_density`` nor above ``max_density``;
* a site without a measurement yet (first round, just joined) sends the dense codec.

Nothing else changes: each site's decoded update enters the weighted mean with the weight it
has under ``[algorithm] weighting``; the codec only changes which part of the site's update
travels this round. Error feedback keeps the rest in the site's residual (``switch_codec``
keeps the residual when the codec changes between rounds), so every coordinate arrives
eventually, as with a fixed top-k codec.

What counts as a measurement. Only an upload the coordinator verified and admitted into a round
measures a link (the coordinator observes it in the same critical section as the admission, or of
the fold of a late update one round on; an upload that missed its round and was dropped is never
measured; the simulator and the planner measure the same uploads in the same order): the bytes a
site streams before they are checked are its claim, and 1 MB of refused junk sent at loopback speed
would otherwise make it the "typical" site and give an honest site ``topk:0.001`` for rounds. And a
time below ``min_upload_s`` is not told apart from another: timer resolution, thread scheduling and
the RPC's own costs dominate it (on loopback, sub-millisecond uploads jitter by 2x). So ``t_ref`` is
at least ``min_upload_s``: a site whose dense upload takes no longer keeps the dense codec however
its time compares with the others' (sparsifying an upload that short would save nothing), and a slow
site is given a payload that takes about ``t_ref`` on its link, not a share of the noise.

Each round's plan (``CodecPlans``) is made the first time the round's codec is asked for (the
coordinator: the round's info in a join or a broadcast header, or an upload's check; the
simulator: the first site's encode) from the throughputs measured until then, and never changes
afterwards, so what a site was told and what its upload is checked against are the same. A site
outside the plan (not measured when it was made) uses the run's ``uplink_codec``.

Pure: no I/O, no clocks; the coordinator (``RoundContext.link_codecs``, measured on the uploads
it receives) and the simulator (measured on its virtual clock) use the same class.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from geoloco.algorithms.config import config_to_dict, require
from geoloco.algorithms.diloco import UpdateEncoder
from geoloco.compression import CodecError, parse_codec
from geoloco.compression.error_feedback import ErrorFeedback

__all__ = [
    "ADAPTIVE_TARGETS",
    "KEPT_PLANS",
    "AdaptiveUplinkConfig",
    "CodecPlans",
    "LinkMeter",
    "choose_codecs",
    "codec_nbytes",
    "sparse_spec",
    "switch_codec",
]

logger = logging.getLogger(__name__)

KEPT_PLANS = 4
"""Rounds whose codec plan is kept (the open one, and late updates of the ones before)."""

ADAPTIVE_TARGETS: tuple[str, ...] = ("equal_time",)
"""What ``choose_codecs`` equalises (``target``): the upload time of every site."""


@dataclass(kw_only=True, slots=True)
class AdaptiveUplinkConfig:
    """``[algorithm.adaptive_uplink]``: bounds of the per-site codec choice (module docstring)."""

    enabled: bool = False
    """Give each site its own uplink codec per round (off: every site uses ``uplink_codec``)."""
    target: Literal["equal_time"] = "equal_time"
    """What the choice equalises: ``"equal_time"``, every site's upload time."""
    min_density: float = 0.001
    """Smallest top-k density a slow site is given (its upload may then take longer)."""
    max_density: float = 0.5
    """Largest top-k density; a site that would need more sends the dense codec."""
    tolerance: float = 1.25
    """A site whose dense upload takes at most this multiple of the typical site's sends it."""
    smoothing: float = 0.5
    """Weight of the newest measurement in each site's throughput average (1: only the newest)."""
    min_upload_s: float = 0.01
    """Noise floor, seconds: the reference upload time is at least this, so a site whose dense
    upload takes no longer sends it (shorter times are timer and scheduling noise, and nothing
    worth saving; 0: no floor)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        require(
            self.target in ADAPTIVE_TARGETS, "target",
            f"got {self.target!r}; allowed values: {', '.join(ADAPTIVE_TARGETS)}",
        )
        require(
            math.isfinite(self.min_density) and 0 < self.min_density <= 1, "min_density",
            f"must be a top-k density in (0, 1], got {self.min_density}",
        )
        require(
            math.isfinite(self.max_density) and self.min_density <= self.max_density <= 1, "max_density",
            f"must be in [min_density, 1] = [{self.min_density}, 1], got {self.max_density}",
        )
        require(
            math.isfinite(self.tolerance) and self.tolerance >= 1, "tolerance",
            f"must be >= 1 (a multiple of the typical site's upload time), got {self.tolerance}",
        )
        require(
            math.isfinite(self.smoothing) and 0 < self.smoothing <= 1, "smoothing",
            f"must be in (0, 1], got {self.smoothing}",
        )
        require(
            math.isfinite(self.min_upload_s) and self.min_upload_s >= 0, "min_upload_s",
            f"must be a number of seconds >= 0 (0: no noise floor), got {self.min_upload_s}",
        )

    def check_base_codec(self, uplink_codec: str) -> str | None:
        """Why ``uplink_codec`` cannot be the dense end of the choice, or None when it can: the
        slow sites' codec is ``topk:D|<uplink_codec>``, so it must be a value codec alone."""
        try:
            codec = parse_codec(uplink_codec)
        except (CodecError, ValueError) as err:
            return str(err)
        if getattr(codec, "sparsifier", None) is not None:
            return (
                f"adaptive_uplink adds its own top-k stage; uplink_codec must be a value codec "
                f"alone (e.g. \"int8\", \"fp16\", \"none\"), got {uplink_codec!r}"
            )
        return None

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


def sparse_spec(density: float, base_codec: str) -> str:
    """The canonical spec of ``topk:density|base_codec`` (``"none"``: top-k alone)."""
    base = parse_codec(base_codec).spec
    text = f"topk:{density:.2g}" if base == "none" else f"topk:{density:.2g}|{base}"
    return parse_codec(text).spec


def codec_nbytes(spec: str, numel: int) -> int:
    """Wire bytes of one flat fp32 update of ``numel`` elements under ``spec``."""
    return parse_codec(spec).encoded_nbytes((numel,), torch.float32)


def _floor_2g(value: float) -> float:
    """``value`` rounded down to two significant digits (few distinct specs, never over budget)."""
    exponent = math.floor(math.log10(value)) - 1
    scale = 10.0**exponent
    return float(f"{math.floor(value / scale + 1e-9) * scale:.2g}")


def choose_codecs(
    throughputs: Mapping[str, float], sites: list[str], *, numel: int, base_codec: str,
    config: AdaptiveUplinkConfig, nbytes: Callable[[str, int], int] = codec_nbytes,
) -> dict[str, str]:
    """Each of ``sites``' uplink codec for the next round (module docstring for the rule).

    ``throughputs``: measured upload bytes per second per site (sites missing from it, or not
    finite and > 0, get ``base_codec``); ``nbytes(spec, numel)``: wire bytes of an update.
    """
    base = parse_codec(base_codec).spec
    measured = {s: throughputs[s] for s in sites if math.isfinite(throughputs.get(s, math.nan))
                and throughputs[s] > 0}
    if not measured:
        return dict.fromkeys(sites, base)
    dense_bytes = nbytes(base, numel)
    reference_s = max(dense_bytes / statistics.median_high(measured.values()), config.min_upload_s)
    codecs: dict[str, str] = {}
    for site in sites:
        rate = measured.get(site)
        if rate is None or dense_bytes / rate <= config.tolerance * reference_s:
            codecs[site] = base
            continue
        codecs[site] = _fitting_codec(rate * reference_s, base, numel, config, nbytes)
    return codecs


def _fitting_codec(
    budget_bytes: float, base: str, numel: int, config: AdaptiveUplinkConfig,
    nbytes: Callable[[str, int], int],
) -> str:
    """The densest ``topk:D|base`` within ``[min_density, max_density]`` whose payload fits in
    ``budget_bytes`` (``min_density`` when none fits; ``base`` when ``max_density`` fits and
    the dense payload fits too)."""
    low, high = config.min_density, config.max_density
    if nbytes(sparse_spec(low, base), numel) >= budget_bytes:
        return sparse_spec(low, base)
    if nbytes(sparse_spec(high, base), numel) <= budget_bytes:
        spec = sparse_spec(high, base)
        return base if nbytes(base, numel) <= budget_bytes else spec
    for _ in range(40):  # bisection on the density; sizes grow with it
        middle = (low + high) / 2
        if nbytes(sparse_spec(middle, base), numel) <= budget_bytes:
            low = middle
        else:
            high = middle
    density = float(f"{low:.2g}")  # the nearest two-digit density, unless it is over budget
    if density > config.max_density or nbytes(sparse_spec(density, base), numel) > budget_bytes:
        density = _floor_2g(low)
    return sparse_spec(max(config.min_density, density), base)


@dataclass(slots=True)
class LinkMeter:
    """Each site's measured upload throughput, bytes per second: an exponential average of the
    uploads seen, ``smoothing`` the newest one's weight. (Downloads are not measured: the rule
    chooses uplink codecs only.)"""

    smoothing: float = 0.5
    min_seconds: float = 1e-4
    """Shorter transfers are not measured (a clock tick says nothing about the link)."""
    up: dict[str, float] = field(default_factory=dict)

    def observe_up(self, site: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or not math.isfinite(seconds) or seconds < self.min_seconds:
            return
        rate = nbytes / seconds
        old = self.up.get(site)
        self.up[site] = rate if old is None else self.smoothing * rate + (1 - self.smoothing) * old


def switch_codec(
    encoder: UpdateEncoder, spec: str, *, error_feedback: bool, decay: float = 1.0
) -> UpdateEncoder:
    """``encoder`` with codec ``spec`` and the same error-feedback residual (itself when the
    codec is unchanged); ``error_feedback``/``decay``: the run's ``[algorithm]`` keys. A
    residual is never dropped: moving to the lossless codec keeps an error feedback around it,
    so the carried part is sent with the next update."""
    spec = parse_codec(spec).spec
    if spec == encoder.spec:
        return encoder
    residual = encoder.residual
    switched = UpdateEncoder(spec, error_feedback=error_feedback, decay=decay)
    if residual is not None:
        if switched.error_feedback is None:
            switched.error_feedback = ErrorFeedback(switched.codec, decay=decay)
        switched.error_feedback.residual = residual
    return switched


class CodecPlans:
    """Measured links and each round's per-site codec plan (module docstring); the
    coordinator calls it with its round lock held."""

    def __init__(self, config: AdaptiveUplinkConfig, base_codec: str) -> None:
        self.config = config
        self.base_codec = parse_codec(base_codec).spec
        self.meter = LinkMeter(smoothing=config.smoothing)
        self.plans: dict[int, dict[str, str]] = {}

    def observe_upload(self, site: str, nbytes: int, seconds: float) -> None:
        """One verified, admitted upload of ``nbytes`` that took ``seconds`` on the wire (module
        doc: what a host may report)."""
        self.meter.observe_up(site, nbytes, seconds)

    def plan(self, round_number: int, numel: int) -> dict[str, str]:
        """Round ``round_number``'s codec per measured site (made on the first call)."""
        plan = self.plans.get(round_number)
        if plan is None:
            plan = choose_codecs(
                self.meter.up, sorted(self.meter.up), numel=numel, base_codec=self.base_codec,
                config=self.config,
            )
            self.plans[round_number] = plan
            for old in [r for r in self.plans if r <= round_number - KEPT_PLANS]:
                del self.plans[old]
            if any(spec != self.base_codec for spec in plan.values()):
                logger.info("round %d: uplink codecs %s", round_number, plan)
        return plan

    def codec_for(self, site: str, round_number: int, numel: int) -> str:
        """The canonical codec ``site`` uploads round ``round_number`` with."""
        return self.plan(round_number, numel).get(site, self.base_codec)

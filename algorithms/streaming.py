"""Streaming DiLoCo: fragments synchronised on a staggered schedule, transfers overlapped with training.

Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a Distributed Free
Lunch", 2025.

Plain DiLoCo stops every site while its whole pseudo-gradient travels up and the new weights come
back. Streaming DiLoCo splits the global weights into ``P`` fragments (groups of layers) and
synchronises one fragment at a time:

* **Schedule.** One *round* is one fragment sync, every ``s = H / P`` inner steps; round ``r``
  (numbered from 0, as on the wire) syncs fragment ``r mod P``, so fragment
  ``p`` syncs every ``H`` steps, at cumulative steps ``(p + 1)·s, (p + 1)·s + H, ...``. The
  schedule is a function of the round counter only: every site and the coordinator agree on it
  without a message, and the wire protocol's existing round number carries it.
* **Sync.** At the end of round ``r`` site ``k`` uploads ``Δ_k = θ_g[p] − θ_k[p]`` for fragment
  ``p`` only (error feedback kept per fragment). The coordinator aggregates that fragment on its
  own (one aggregation, so one secure sum per fragment sync), steps that fragment's own outer
  optimizer and broadcasts the encoded change of fragment ``p`` (downlink error feedback per
  fragment). Only about ``1/P`` of the model is in flight at any time.
* **Overlap and merge.** The site does not wait: it runs ``τ`` more inner steps (``overlap_steps``)
  while the upload and the broadcast travel, then merges the fragment,
  ``θ_k[p] ← α·θ_k[p] + (1 − α)·θ_g[p]`` (``mix`` = α), and runs the remaining ``s − τ`` steps
  of the next round. ``τ ≤ s`` keeps at most one fragment per site in flight.

With ``P = 1``, ``τ = 0`` and ``α = 0`` every round is a plain DiLoCo round: the site replaces its
weights by the new global ones before its next step. The simulator and the real site agent call
the functions below, so both follow the same schedule and the same merge.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from geoloco.algorithms.config import config_to_dict, require
from geoloco.algorithms.diloco import UpdateEncoder
from geoloco.algorithms.params import ParamEntry, ParamLayout
from geoloco.compression import Encoded

__all__ = [
    "SPLITS",
    "Fragment",
    "FragmentPartition",
    "FragmentUplink",
    "StreamingConfig",
    "StreamingSchedule",
    "layer_key",
    "merge_fragment_",
]

SPLITS: tuple[str, ...] = ("strided", "contiguous")
"""How layers are dealt to fragments (``StreamingConfig.split``)."""

FRAGMENT_PREFIX = "fragment"
"""Prefix of per-fragment state tensors (``fragment0.outer.state.0.momentum_buffer``)."""


@dataclass(kw_only=True, slots=True)
class StreamingConfig:
    """Streaming DiLoCo settings (``[algorithm.streaming]`` in TOML files)."""

    enabled: bool = False
    """Synchronise fragments on a staggered schedule instead of the whole model every H steps."""
    fragments: int = 1
    """P: number of fragments; must divide ``inner_steps`` (a fragment syncs every H/P steps)
    and be at most the model's number of layer groups."""
    overlap_steps: int = 0
    """τ: inner steps a site keeps training while its fragment travels, before merging the
    broadcast (0 = wait for it, as plain DiLoCo); at most H/P."""
    mix: float = 0.0
    """α: share of the site's own fragment kept at the merge, ``α·local + (1 − α)·global``
    (0 = take the global fragment, as plain DiLoCo); in [0, 1)."""
    split: Literal["strided", "contiguous"] = "strided"
    """How layer groups become fragments: ``"strided"`` (layer i -> fragment i mod P, as in the
    paper) or ``"contiguous"`` (consecutive layers, balanced by parameter count)."""
    adaptive_overlap: bool = False
    """Each site chooses τ per round from its measured step time and fragment transfer times, so
    the transfer hides behind computation (``geoloco.algorithms.streaming_overlap``);
    ``overlap_steps`` is then τ until something is measured."""
    overlap_steps_min: int = 0
    """Adaptive τ is at least this."""
    overlap_steps_max: int = 0
    """Adaptive τ is at most this (0: at most the round's steps)."""
    interval_steps_max: int = 0
    """Adaptive cadence: a round may run up to this many steps (>= H/P) when H/P steps cannot
    hide a fragment's transfer (0: rounds stay H/P steps)."""
    overlap_margin: float = 0.1
    """Adaptive τ hides the measured transfer time times (1 + this)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        require(self.fragments >= 1, "fragments", f"must be an integer >= 1, got {self.fragments}")
        require(
            self.overlap_steps >= 0,
            "overlap_steps",
            f"must be an integer >= 0 (0 = no overlap), got {self.overlap_steps}",
        )
        require(
            0 <= self.mix < 1,
            "mix",
            f"must be in [0, 1) (0 = take the global fragment; 1 would ignore it), got {self.mix}",
        )
        require(
            self.split in SPLITS,
            "split",
            f"unknown split {self.split!r}; valid splits: {', '.join(SPLITS)}",
        )
        self._validate_adaptive()

    def _validate_adaptive(self) -> None:
        for key in ("overlap_steps_min", "overlap_steps_max", "interval_steps_max"):
            value = getattr(self, key)
            require(value >= 0, key, f"must be an integer >= 0 (0 = no bound), got {value}")
        require(
            math.isfinite(self.overlap_margin) and 0 <= self.overlap_margin <= 10,
            "overlap_margin",
            f"must be in [0, 10] (0.1 = hide 10 % more than the measured transfer), got {self.overlap_margin}",
        )
        if not self.adaptive_overlap:
            for key in ("overlap_steps_min", "overlap_steps_max", "interval_steps_max"):
                require(
                    getattr(self, key) == 0,
                    key,
                    "bounds the adaptive overlap; set adaptive_overlap = true or remove the key",
                )
            return
        if self.overlap_steps_max:
            require(
                self.overlap_steps_min <= self.overlap_steps_max,
                "overlap_steps_min",
                f"must be <= overlap_steps_max = {self.overlap_steps_max}, got {self.overlap_steps_min}",
            )
            require(
                self.overlap_steps_min <= self.overlap_steps <= self.overlap_steps_max,
                "overlap_steps",
                f"is the adaptive overlap's first value: must be in [overlap_steps_min, "
                f"overlap_steps_max] = [{self.overlap_steps_min}, {self.overlap_steps_max}], "
                f"got {self.overlap_steps}",
            )
        else:
            require(
                self.overlap_steps >= self.overlap_steps_min,
                "overlap_steps",
                f"is the adaptive overlap's first value: must be >= overlap_steps_min = "
                f"{self.overlap_steps_min}, got {self.overlap_steps}",
            )

    def check_inner_steps(self, inner_steps: int) -> None:
        """The checks that need H; keys are relative to this config (``fragments``, ...)."""
        if not self.enabled:
            return
        divisors = [d for d in range(1, inner_steps + 1) if inner_steps % d == 0]
        require(
            inner_steps % self.fragments == 0,
            "fragments",
            f"must divide inner_steps = {inner_steps} so each fragment syncs every H/P steps; "
            f"got {self.fragments}, allowed: {', '.join(map(str, divisors))}",
        )
        interval = inner_steps // self.fragments
        require(
            self.overlap_steps <= interval,
            "overlap_steps",
            f"must be <= inner_steps / fragments = {interval} (one fragment in flight per site), "
            f"got {self.overlap_steps}",
        )
        if self.interval_steps_max:
            require(
                self.interval_steps_max >= interval,
                "interval_steps_max",
                f"must be 0 (rounds of H/P steps) or >= inner_steps / fragments = {interval}, "
                f"got {self.interval_steps_max}",
            )
        most = max(interval, self.interval_steps_max)
        require(
            self.overlap_steps_min <= most,
            "overlap_steps_min",
            f"must be <= the most steps a round may run ({most}: inner_steps / fragments or "
            f"interval_steps_max), got {self.overlap_steps_min}",
        )

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


# --------------------------------------------------------------------------------------------
# Fragments


_INDEX = re.compile(r"^\d+$")


def layer_key(name: str) -> str:
    """The layer a parameter belongs to: its name up to the first numeric component.

    ``blocks.3.attn.qkv.weight`` -> ``blocks.3``, ``0.weight`` (``nn.Sequential``) -> ``0``;
    a name without an index belongs to its top-level module (``tok_emb.weight`` -> ``tok_emb``,
    ``pos_emb`` -> ``pos_emb``). Weights and biases of one layer thus travel together.
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if _INDEX.match(part):
            return ".".join(parts[: i + 1])
    return parts[0]


@dataclass(frozen=True, slots=True)
class Fragment:
    """One fragment: some layers' parameters, as slices ``(offset, numel)`` of the flat vector."""

    index: int
    """p, the fragment's number."""
    layers: tuple[str, ...]
    """Layer keys (``layer_key``) it holds, in layout order."""
    slices: tuple[tuple[int, int], ...]
    """``(offset, numel)`` of each contiguous run of its elements in the flat vector."""
    numel: int
    """Elements in the fragment."""

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """A new 1-D tensor of the fragment's elements of ``flat``, in layout order."""
        return torch.cat([flat[offset : offset + n] for offset, n in self.slices])

    def scatter_(self, flat: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Write ``values`` (a gathered fragment) into ``flat`` in place; returns ``flat``."""
        if values.numel() != self.numel:
            raise ValueError(
                f"fragment {self.index} holds {self.numel} elements; got {values.numel()}"
            )
        values = values.reshape(-1).to(flat.device, flat.dtype)
        start = 0
        with torch.no_grad():
            for offset, n in self.slices:
                flat[offset : offset + n].copy_(values[start : start + n])
                start += n
        return flat


@dataclass(frozen=True, slots=True)
class FragmentPartition:
    """The model's layers dealt into P fragments; every element is in exactly one fragment.

    Built from the ``ParamLayout`` alone (deterministic), so every site and the coordinator derive
    the same partition from the config without exchanging it.
    """

    fragments: tuple[Fragment, ...]
    numel: int

    @classmethod
    def from_layout(
        cls, layout: ParamLayout, fragments: int, split: str = "strided"
    ) -> FragmentPartition:
        groups: dict[str, list[ParamEntry]] = {}
        for entry in layout.entries:
            groups.setdefault(layer_key(entry.name), []).append(entry)
        layers = list(groups)
        if fragments < 1 or fragments > len(layers):
            raise ValueError(
                f"streaming.fragments = {fragments} but the model has {len(layers)} layer groups "
                f"({', '.join(layers[:8])}{', ...' if len(layers) > 8 else ''}); allowed: 1 to "
                f"{len(layers)}"
            )
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
        sizes = [sum(e.numel for e in groups[layer]) for layer in layers]
        if split == "strided":
            owner = [i % fragments for i in range(len(layers))]
        else:
            owner = _contiguous_owner(sizes, fragments)
        parts = []
        for p in range(fragments):
            mine = [layer for layer, o in zip(layers, owner, strict=True) if o == p]
            entries = sorted((e for layer in mine for e in groups[layer]), key=lambda e: e.offset)
            slices: list[tuple[int, int]] = []
            for e in entries:
                if slices and slices[-1][0] + slices[-1][1] == e.offset:
                    slices[-1] = (slices[-1][0], slices[-1][1] + e.numel)
                elif e.numel:
                    slices.append((e.offset, e.numel))
            parts.append(
                Fragment(
                    index=p,
                    layers=tuple(mine),
                    slices=tuple(slices),
                    numel=sum(n for _, n in slices),
                )
            )
        return cls(fragments=tuple(parts), numel=layout.numel)

    @classmethod
    def whole(cls, numel: int) -> FragmentPartition:
        """One fragment holding the whole model: plain DiLoCo, which needs no layout."""
        return cls(fragments=(Fragment(index=0, layers=(), slices=((0, numel),), numel=numel),), numel=numel)

    @property
    def is_whole(self) -> bool:
        """One fragment covering every element (gather and scatter are the identity)."""
        return len(self.fragments) == 1 and self.fragments[0].numel == self.numel

    def __len__(self) -> int:
        return len(self.fragments)

    def __getitem__(self, index: int) -> Fragment:
        return self.fragments[index]

    def to_dict(self) -> dict[str, Any]:
        return {
            "numel": self.numel,
            "fragments": [
                {"index": f.index, "layers": list(f.layers), "numel": f.numel}
                for f in self.fragments
            ],
        }


def _contiguous_owner(sizes: Sequence[int], fragments: int) -> list[int]:
    """Fragment of each layer for consecutive runs balanced by size, none empty."""
    total = sum(sizes)
    owner: list[int] = []
    p = 0
    cumulative = 0
    for i, size in enumerate(sizes):
        remaining_layers = len(sizes) - i
        remaining_fragments = fragments - p
        # Move on once this fragment has its share, or when every later layer is needed to give
        # each later fragment one.
        if owner and owner[-1] == p and p < fragments - 1 and (
            cumulative >= total * (p + 1) / fragments or remaining_layers < remaining_fragments
        ):
            p += 1
        owner.append(p)
        cumulative += size
    return owner


def merge_fragment_(
    local_flat: torch.Tensor, global_flat: torch.Tensor, fragment: Fragment, mix: float
) -> torch.Tensor:
    """``θ_k[p] ← α·θ_k[p] + (1 − α)·θ_g[p]`` in ``local_flat`` (in place); returns it.

    ``α = 0`` copies the global fragment exactly (no arithmetic), which is what makes
    ``P = 1, τ = 0`` bit-identical to plain DiLoCo.
    """
    global_part = fragment.gather(global_flat).to(local_flat.device, local_flat.dtype)
    if mix == 0:
        return fragment.scatter_(local_flat, global_part)
    local_part = fragment.gather(local_flat)
    return fragment.scatter_(local_flat, torch.lerp(global_part, local_part, mix))


# --------------------------------------------------------------------------------------------
# Schedule


@dataclass(frozen=True, slots=True)
class StreamingSchedule:
    """Which fragment syncs in which round, and where in the step count the syncs and merges fall.

    Rounds are numbered from 0, on the wire and everywhere else.
    """

    inner_steps: int
    """H: steps between two syncs of the same fragment."""
    fragments: int
    """P."""
    overlap_steps: int = 0
    """τ: steps between a sync and the merge of its broadcast."""

    def __post_init__(self) -> None:
        if self.fragments < 1 or self.inner_steps % self.fragments:
            raise ValueError(
                f"{self.fragments} fragments do not divide inner_steps = {self.inner_steps}"
            )
        if not 0 <= self.overlap_steps <= self.interval:
            raise ValueError(
                f"overlap_steps = {self.overlap_steps} must be in [0, {self.interval}] "
                "(inner_steps / fragments)"
            )

    @classmethod
    def from_config(cls, inner_steps: int, config: StreamingConfig) -> StreamingSchedule:
        return cls(inner_steps=inner_steps, fragments=config.fragments, overlap_steps=config.overlap_steps)

    @property
    def interval(self) -> int:
        """s = H / P: inner steps per round (between two consecutive fragment syncs)."""
        return self.inner_steps // self.fragments

    def fragment_for_round(self, round_index: int) -> int:
        """The fragment round ``round_index`` (>= 0) synchronises."""
        if round_index < 0:
            raise ValueError(f"rounds are numbered from 0, got {round_index}")
        return round_index % self.fragments

    def overlap_before_merge(self, round_index: int) -> int:
        """Inner steps of round ``round_index`` run before the previous round's broadcast is
        merged: ``τ``, except in round 0, which has nothing to merge."""
        return self.overlap_steps if round_index > 0 else 0


# --------------------------------------------------------------------------------------------
# Per-fragment encoders and the strategy


class FragmentUplink:
    """A site's uplink: one ``UpdateEncoder`` (own error-feedback residual) per fragment."""

    def __init__(self, encoders: Sequence[UpdateEncoder]) -> None:
        self.encoders = list(encoders)

    def encode(self, update: torch.Tensor, *, seed: int, fragment: int = 0) -> Encoded:
        return self.encoders[fragment].encode(update, seed=seed)

    def restore(self, encoded: Encoded, *, fragment: int = 0) -> None:
        """A late upload of ``fragment``: keep it in that fragment's residual."""
        self.encoders[fragment].restore(encoded)

"""Partial Parameter Updates (arXiv 2509.22418): each site trains a fixed subset of the weights.

During its local steps a site updates only the parameter tensors of its *group*; the rest are
frozen (``requires_grad`` off, so backward computes no weight gradients for them and the inner
optimizer never creates state for them), while the forward pass still runs the whole model and no
activations cross sites. Its pseudo-gradient is zero outside its group, so it uploads only its
group's coordinates: the subset, gathered in layout order, is encoded as one vector of its own
(``partial_numel`` values; the bytes counted are that encoding's), and the coordinator scatters
it back.

Assignment (``[algorithm.partial_updates]``), fixed for the whole run, site ``k`` training group
``k mod groups``, where ``k`` is the number a site's name ends with (the simulator's ``"0"`` ..
``"N-1"``; a real site named ``"site-3"`` is site 3), so the coordinator and every site derive
the same assignment from the name alone:

- ``mode = "blocks"``: the model's parameter tensors, in ``named_parameters()`` order, are cut
  into ``groups`` contiguous runs of whole tensors of about equal size (each run ends at the
  first tensor that takes it past ``numel / groups``).
- ``mode = "layers"``: a tensor whose name holds a layer number (the first integer component,
  ``blocks.3.attn.weight`` -> 3) belongs to group ``layer mod groups``; tensors outside the
  numbered layers (embeddings, final norm, output head) are trained by *every* site.

Aggregation: each coordinate is the weighted mean of the updates of the sites that trained it,
``Σ_{k trains i} w_k u_k[i] / Σ_{k trains i} w_k`` (the round's site weights, restricted to those
sites); a coordinate no site of the round trained gets 0 (with a momentum outer optimizer its
momentum still moves it). Every group needs a site, so a run needs at least ``groups`` sites.

The real system does the same over gRPC: a site freezes the tensors of the other groups
(``geoloco.site_agent.trainer.SiteTrainer.train_only``) and uploads its group's subset; the
coordinator expects an upload of exactly that many values from that site and averages with
``PartialMean``. Not combined with privacy, robust aggregation or streaming fragments. With a
data-parallel warm-up (``warmup_steps > 0``) every site starts from the warm-up's optimizer state
for all tensors, so frozen tensors then hold state they never use (the weights are still
untouched: a tensor without a gradient is skipped by the optimizer step).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from geoloco.algorithms.config import config_to_dict, require
from geoloco.algorithms.params import ParamLayout
from geoloco.compression import Encoded, decode

__all__ = ["PartialAssignment", "PartialMean", "PartialUpdatesConfig"]

PARTIAL_MODES = ("blocks", "layers")
_LAYER_NUMBER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")
_SITE_NUMBER = re.compile(r"(\d+)$")


@dataclass(kw_only=True, slots=True)
class PartialUpdatesConfig:
    """``[algorithm.partial_updates]``: which parameters each site trains (module docstring)."""

    enabled: bool = False
    """Train a per-site subset of the parameters (off: every site trains everything)."""
    groups: int = 2
    """Number of parameter groups; site ``k`` trains group ``k mod groups``."""
    mode: Literal["blocks", "layers"] = "blocks"
    """``"blocks"``: contiguous runs of whole tensors of about equal size; ``"layers"``: by the
    layer number in the tensor's name, tensors outside numbered layers trained by every site."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        require(self.groups >= 2, "groups", f"must be >= 2 (1 group is plain training), got {self.groups}")
        require(
            self.mode in PARTIAL_MODES, "mode", f"got {self.mode!r}; allowed values: {', '.join(PARTIAL_MODES)}"
        )

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


def _block_groups(layout: ParamLayout, groups: int) -> list[int | None]:
    """Contiguous runs of whole tensors, each closed once it reaches ``numel / groups``."""
    out: list[int | None] = []
    group, filled = 0, 0
    target = layout.numel / groups
    for entry in layout.entries:
        out.append(group)
        filled += entry.numel
        if filled >= target * (group + 1) and group < groups - 1:
            group += 1
    return out


def _layer_groups(layout: ParamLayout, groups: int) -> list[int | None]:
    out: list[int | None] = []
    for entry in layout.entries:
        match = _LAYER_NUMBER.search(entry.name)
        out.append(None if match is None else int(match.group(1)) % groups)
    return out


@dataclass(frozen=True, slots=True)
class PartialAssignment:
    """Which tensors each group trains, and the flat coordinates of each group's subset."""

    layout: ParamLayout
    groups: int
    tensor_group: tuple[int | None, ...]
    """Per layout entry: its group, or None for a tensor every site trains."""
    _index: dict[int, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, config: PartialUpdatesConfig, layout: ParamLayout) -> PartialAssignment:
        split = _block_groups if config.mode == "blocks" else _layer_groups
        tensor_group = tuple(split(layout, config.groups))
        assignment = cls(layout=layout, groups=config.groups, tensor_group=tensor_group)
        empty = [g for g in range(config.groups) if g not in tensor_group]
        require(
            not empty,
            "partial_updates.groups",
            f"mode {config.mode!r} leaves group(s) {empty} without a parameter tensor of their own "
            f"in this model ({len(layout.entries)} tensors); use fewer groups or the other mode",
        )
        return assignment

    def site_group(self, site: str) -> int:
        """The group site ``site`` trains: ``k mod groups``, ``k`` the number its name ends with."""
        match = _SITE_NUMBER.search(site)
        if match is None:
            raise ValueError(
                f"partial updates assign groups by the number a site's name ends with; site {site!r} "
                "has none (name sites '0', '1', ... or 'site-0', 'site-1', ...)"
            )
        return int(match.group(1)) % self.groups

    def trained(self, group: int) -> tuple[bool, ...]:
        """Per layout entry: whether a site of ``group`` trains it."""
        return tuple(g is None or g == group for g in self.tensor_group)

    def index(self, group: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Flat coordinates (int64, ascending) of the tensors ``group`` trains."""
        cached = self._index.get(group)
        if cached is None:
            parts = [
                torch.arange(e.offset, e.offset + e.numel, dtype=torch.int64)
                for e, on in zip(self.layout.entries, self.trained(group), strict=True)
                if on
            ]
            cached = torch.cat(parts)
            self._index[group] = cached
        return cached.to(device) if device is not None else cached

    def partial_numel(self, group: int) -> int:
        """Values a site of ``group`` uploads."""
        return sum(e.numel for e, on in zip(self.layout.entries, self.trained(group), strict=True) if on)

    def freeze(self, parameters: list[torch.nn.Parameter], group: int) -> None:
        """Turn ``requires_grad`` off for every tensor ``group`` does not train (``parameters``
        in layout order); ``unfreeze`` undoes it."""
        for p, on in zip(parameters, self.trained(group), strict=True):
            p.requires_grad_(on)

    @staticmethod
    def unfreeze(parameters: list[torch.nn.Parameter]) -> None:
        for p in parameters:
            p.requires_grad_(True)

    def gather(self, update: torch.Tensor, group: int) -> torch.Tensor:
        """The subset ``group`` uploads, in layout order."""
        return update.index_select(0, self.index(group, update.device))


class PartialMean:
    """A round's aggregation of partial updates: each coordinate averaged over the sites that
    trained it (the ``Aggregation`` protocol of ``geoloco.algorithms.aggregation``)."""

    def __init__(self, assignment: PartialAssignment, *, device: torch.device | str | None = None) -> None:
        self.assignment = assignment
        self.device = device
        self._sum = torch.zeros(assignment.layout.numel, dtype=torch.float32, device=device)
        self._weight = torch.zeros(assignment.layout.numel, dtype=torch.float32, device=device)
        self.sites: list[str] = []
        self.stale_sites: list[str] = []
        self.total_weight = 0.0
        self._taken = False

    @property
    def count(self) -> int:
        return len(self.sites)

    def add(self, update: Encoded | torch.Tensor, weight: float = 1.0, *, site: str, stale: bool = False) -> None:
        """Decode site ``site``'s subset and add ``weight`` times it where its group trains."""
        if self._taken:
            raise ValueError(f"site {site!r}: this round's mean was already taken (take_result)")
        added = self.stale_sites if stale else self.sites
        if site in added:
            raise ValueError(f"site {site!r} was already aggregated this round{' (late update)' if stale else ''}")
        if not weight > 0:
            raise ValueError(f"site {site!r}: aggregation weight must be > 0, got {weight}")
        group = self.assignment.site_group(site)
        index = self.assignment.index(group, self._sum.device)
        value = update if isinstance(update, torch.Tensor) else decode(update, device=self._sum.device)
        value = value.reshape(-1).to(self._sum)
        if value.numel() != index.numel():
            raise ValueError(
                f"site {site!r} sent {value.numel()} values; its group {group} trains {index.numel()}"
            )
        self._sum.index_add_(0, index, value, alpha=float(weight))
        self._weight.index_add_(0, index, torch.full_like(value, float(weight)))
        self.total_weight += float(weight)
        added.append(site)

    def take_result(self) -> torch.Tensor:
        """The per-coordinate mean (0 where no site of the round trained), handed over once."""
        if self._taken:
            raise ValueError("the round's mean was already taken")
        self._taken = True
        trained = self._weight > 0
        self._sum[trained] /= self._weight[trained]
        self._weight = torch.empty(0)
        return self._sum

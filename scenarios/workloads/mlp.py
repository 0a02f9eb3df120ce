"""A tiny classification workload for unit tests: an MLP student learns a fixed random teacher.

A train step costs about a millisecond, so tests of algorithms, compression and the simulator can
run many rounds over many sites. The data still has the property those tests care about: sites
are non-IID. Each site draws its inputs from a Gaussian shifted in its own direction
(``x ~ N(site_shift * u_site, I)``), so each sees a different slice of input space and a different
label mix; the held-out set is drawn from the unshifted ``N(0, I)``, which no site samples
directly — a model only does well on it by combining what the sites learned.

Labels come from a teacher network fixed by ``teacher_seed`` (independent of the run seed), so the
task is learnable to zero error and runs with different seeds or site counts solve the same task.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from geoloco.algorithms.params import derive_seed
from geoloco.scenarios.workloads._seeding import seeded_cpu_rng

TensorPair = tuple[torch.Tensor, torch.Tensor]
"""A batch: ``(inputs, labels)``."""

TEACHER_HIDDEN = 64
"""Width of the teacher's hidden layer: wide enough for curved decision boundaries."""


@dataclass(kw_only=True, slots=True)
class MLPWorkloadConfig:
    """Shape of the student MLP and of the synthetic data (one field per TOML option)."""

    input_dim: int = 16
    """Dimension of the inputs."""
    hidden_dim: int = 32
    """Width of the student's two hidden layers."""
    num_classes: int = 4
    """Number of classes the teacher assigns."""
    batch_size: int = 32
    """Samples per training batch."""
    eval_size: int = 1024
    """Samples in the fixed held-out set."""
    site_shift: float = 1.5
    """Distance of each site's input mean from the origin; 0 makes the sites IID."""
    teacher_seed: int = 0
    """Seed of the teacher network, the site directions and the held-out set (the task itself)."""

    def __post_init__(self) -> None:
        for field in ("input_dim", "hidden_dim", "batch_size", "eval_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {self.num_classes}")
        if self.site_shift < 0:
            raise ValueError(f"site_shift must be >= 0, got {self.site_shift}")


class MLPWorkload:
    """Synthetic teacher-student classification; batches are ``(inputs float32, labels int64)``."""

    name: str = "mlp"
    config_class: ClassVar[type[MLPWorkloadConfig]] = MLPWorkloadConfig

    def __init__(self, config: MLPWorkloadConfig | None = None) -> None:
        self.config = config if config is not None else MLPWorkloadConfig()
        generator = torch.Generator().manual_seed(derive_seed("mlp-teacher", self.config.teacher_seed))
        dim = self.config.input_dim
        self._teacher_w1 = torch.randn(dim, TEACHER_HIDDEN, generator=generator) / dim**0.5
        self._teacher_b1 = 0.5 * torch.randn(TEACHER_HIDDEN, generator=generator)
        self._teacher_w2 = torch.randn(TEACHER_HIDDEN, self.config.num_classes, generator=generator)
        eval_seed = derive_seed("mlp-eval", self.config.teacher_seed)
        eval_generator = torch.Generator().manual_seed(eval_seed)
        self.eval_inputs = torch.randn(self.config.eval_size, dim, generator=eval_generator)
        self.eval_labels = self.teacher_labels(self.eval_inputs)

    def teacher_labels(self, inputs: torch.Tensor) -> torch.Tensor:
        """The class the fixed teacher assigns to each row of ``inputs``."""
        hidden = torch.tanh(inputs @ self._teacher_w1 + self._teacher_b1)
        return (hidden @ self._teacher_w2).argmax(dim=1)

    def site_mean(self, site: int) -> torch.Tensor:
        """Mean of site ``site``'s inputs: a direction fixed by the task, not by the site count."""
        seed = derive_seed("mlp-site", self.config.teacher_seed, site)
        generator = torch.Generator().manual_seed(seed)
        direction = torch.randn(self.config.input_dim, generator=generator)
        return self.config.site_shift * direction / direction.norm()

    def build_model(self, seed: int) -> nn.Sequential:
        config = self.config
        with seeded_cpu_rng(derive_seed("mlp-init", seed)):
            return nn.Sequential(
                nn.Linear(config.input_dim, config.hidden_dim),
                nn.GELU(),
                nn.Linear(config.hidden_dim, config.hidden_dim),
                nn.GELU(),
                nn.Linear(config.hidden_dim, config.num_classes),
            )

    def site_batches(self, site: int, num_sites: int, seed: int) -> Iterator[TensorPair]:
        if not 0 <= site < num_sites:
            raise ValueError(f"site must be in [0, {num_sites}), got {site}")
        return self._stream(self.site_mean(site), derive_seed("mlp-batches", seed, site))

    def _stream(self, mean: torch.Tensor, seed: int) -> Iterator[TensorPair]:
        generator = torch.Generator().manual_seed(seed)
        shape = (self.config.batch_size, self.config.input_dim)
        while True:
            inputs = mean + torch.randn(shape, generator=generator)
            yield inputs, self.teacher_labels(inputs)

    def loss(self, model: nn.Module, batch: TensorPair) -> torch.Tensor:
        device = next(model.parameters()).device
        inputs, labels = (t.to(device, non_blocking=True) for t in batch)
        return F.cross_entropy(model(inputs), labels)

    def eval_loss(self, model: nn.Module) -> float:
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                return float(self.loss(model, (self.eval_inputs, self.eval_labels)))
        finally:
            model.train(was_training)

"""An example geoloco plug-in: an outer optimizer, a codec and a workload of your own, registered
by name when this module is imported (docs/how-to/plug-ins.md).

- outer optimizer ``signsgd``: ``θ' = θ − lr · sign(ĝ)`` on the averaged pseudo-gradient (signSGD,
  Bernstein et al. 2018, as the outer step);
- codec ``scaledsign``: one bit per value (its sign) and one float32 scale per tensor (the mean
  ``|x|``), a value codec that composes with the built-in sparsifiers (``"topk:0.1|scaledsign"``);
- workload ``sine``: a small ``nn.Module`` regressing a sine wave whose phase differs per site.

Name the module in a simulate config (``[research] plugins = ["signsgd_plugin"]``) or on the
command line, with its folder on ``PYTHONPATH``::

    PYTHONPATH=examples/plugins geoloco sweep base.toml --plugin signsgd_plugin \\
        --grid outer_optimizer.name=nesterov,signsgd --jobs 2 --out runs/signsgd
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from geoloco.algorithms import OuterOptimizerConfig, derive_seed, register_outer_optimizer
from geoloco.compression import register_codec
from geoloco.compression.bitpack import pack_uint, unpack_uint
from geoloco.compression.stages import ValueCodec
from geoloco.scenarios.workloads import register_workload

__version__ = "0.1.0"


# -- outer optimizer ---------------------------------------------------------------------------


class SignSGD(torch.optim.Optimizer):
    """``p ← p − lr · sign(p.grad)``: every weight moves by exactly ``lr`` (or not at all)."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad.sign(), alpha=-group["lr"])


def build_signsgd(config: OuterOptimizerConfig, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    assert config.lr is not None  # resolved: the default below when the config leaves it unset
    return SignSGD(params, lr=config.lr)


register_outer_optimizer("signsgd", build_signsgd, lr=1e-3)


# -- codec -------------------------------------------------------------------------------------


class ScaledSign(ValueCodec):
    """``scaledsign``: the sign of each value in one bit, times the tensor's mean ``|x|``."""

    name: ClassVar[str] = "scaledsign"
    summary: ClassVar[str] = "1 bit per value (its sign) times one float32 scale, the mean |x|"

    def payload_nbytes(self, numel: int, dtype: torch.dtype) -> int:
        return 4 + (numel + 7) // 8

    def encode_into(self, values: torch.Tensor, out: torch.Tensor, *, absmax: float | None) -> None:
        scale = values.abs().mean(dtype=torch.float32) if values.numel() else torch.zeros((), dtype=torch.float32)
        out[:4].copy_(scale.reshape(1).cpu().view(torch.uint8).to(out.device))
        pack_uint((values >= 0).to(torch.uint8), 1, out[4:])

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor, dtype: torch.dtype) -> None:
        scale = payload[:4].clone().view(torch.float32)
        signs = unpack_uint(payload[4:], out.numel(), 1).to(torch.float32) * 2 - 1
        out.copy_(signs * scale)


register_codec(ScaledSign)


# -- workload ----------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class SineConfig:
    """The options of ``[workload] name = "sine"``."""

    hidden_dim: int = 16
    """Width of the model's hidden layer."""
    batch_size: int = 16
    """Samples per training batch."""
    eval_size: int = 256
    """Samples in the fixed held-out set."""
    phase_shift: float = 0.5
    """How far apart (radians) the sites' sine waves are: 0 makes the sites IID."""


class SineRegressor(nn.Module):
    """Your own model: any ``nn.Module`` works, the simulator only sees its parameters."""

    def __init__(self, hidden_dim: int) -> None:
        super().__init__()
        self.hidden = nn.Linear(1, hidden_dim)
        self.out = nn.Linear(hidden_dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


class SineWorkload:
    """Regress ``sin(x + site phase)``; the held-out set is the unshifted wave."""

    name: str = "sine"
    config_class: ClassVar[type[SineConfig]] = SineConfig

    def __init__(self, config: SineConfig | None = None) -> None:
        self.config = config if config is not None else SineConfig()
        generator = torch.Generator().manual_seed(derive_seed("sine-eval"))
        self.eval_inputs = (torch.rand(self.config.eval_size, 1, generator=generator) * 2 - 1) * math.pi
        self.eval_targets = torch.sin(self.eval_inputs)

    def build_model(self, seed: int) -> nn.Module:
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(derive_seed("sine-init", seed))
        try:
            return SineRegressor(self.config.hidden_dim)
        finally:
            torch.random.set_rng_state(generator_state)

    def site_batches(self, site: int, num_sites: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(derive_seed("sine-batches", seed, site))
        phase = self.config.phase_shift * (site - (num_sites - 1) / 2)
        while True:
            inputs = (torch.rand(self.config.batch_size, 1, generator=generator) * 2 - 1) * math.pi
            yield inputs, torch.sin(inputs + phase)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        device = next(model.parameters()).device
        inputs, targets = (t.to(device) for t in batch)
        return nn.functional.mse_loss(model(inputs), targets)

    def eval_loss(self, model: nn.Module) -> float:
        with torch.no_grad():
            return float(self.loss(model, (self.eval_inputs, self.eval_targets)))


register_workload("sine", SineWorkload)

"""A tiny in-test workload (non-IID linear regression) so algorithm tests need no built-in workload."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn


class LinearRegressionWorkload:
    """``y = x·w* + 0.1·noise``; site ``k`` draws ``x`` around its own mean (non-IID)."""

    name = "linreg"

    def __init__(self, dim: int = 4, batch: int = 8, hidden: int = 0) -> None:
        self.dim = dim
        self.batch = batch
        self.hidden = hidden
        g = torch.Generator().manual_seed(1234)
        self.w_true = torch.randn(dim, 1, generator=g)
        self.eval_x = torch.randn(64, dim, generator=g)
        self.eval_y = self.eval_x @ self.w_true

    def build_model(self, seed: int) -> nn.Module:
        g = torch.Generator().manual_seed(seed)
        if self.hidden:
            model = nn.Sequential(nn.Linear(self.dim, self.hidden), nn.Tanh(), nn.Linear(self.hidden, 1))
        else:
            model = nn.Sequential(nn.Linear(self.dim, 1))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        return model

    def site_batches(self, site: int, num_sites: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed * 1000 + site)
        mean = torch.full((self.dim,), float(site) / max(num_sites, 1))
        while True:
            x = mean + torch.randn(self.batch, self.dim, generator=g)
            y = x @ self.w_true + 0.1 * torch.randn(self.batch, 1, generator=g)
            yield x, y

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        device = next(model.parameters()).device
        x, y = (t.to(device) for t in batch)
        return nn.functional.mse_loss(model(x), y)

    def eval_loss(self, model: nn.Module) -> float:
        with torch.no_grad():
            return float(self.loss(model, (self.eval_x, self.eval_y)))


@pytest.fixture
def make_workload() -> Callable[..., LinearRegressionWorkload]:
    return LinearRegressionWorkload

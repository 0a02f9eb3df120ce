"""FedAdam and FedYogi as Reddi et al. define them ("Adaptive Federated Optimization", 2021).

They differ from ``torch.optim.Adam`` on purpose: no bias correction (the first rounds' steps are
not inflated), and ``tau`` (about 1e-3) in place of Adam's 1e-8 epsilon, which bounds how far
one round can move a coordinate whose pseudo-gradient was near zero so far. With ``g`` the
averaged pseudo-gradient (``θ_t − mean θ_k``, the negative of the paper's ``Δ_t``):

    m ← β1·m + (1 − β1)·g
    v ← β2·v + (1 − β2)·g²                     (FedAdam)
    v ← v − (1 − β2)·g²·sign(v − g²)           (FedYogi)
    θ ← θ − lr · m / (√v + τ)

with ``m`` starting at 0 and ``v`` at ``τ²`` (the paper's ``v_{-1} ≥ τ²``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["ReddiAdaptive"]


class ReddiAdaptive(torch.optim.Optimizer):
    """The server optimizer of FedAdam (``yogi=False``) or FedYogi (``yogi=True``)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.99),
        tau: float = 1e-3,
        yogi: bool = False,
        weight_decay: float = 0.0,
    ) -> None:
        if lr <= 0 or tau <= 0 or not all(0 <= b < 1 for b in betas) or weight_decay < 0:
            raise ValueError(f"invalid FedAdam/FedYogi settings: lr={lr}, betas={betas}, tau={tau}")
        defaults: dict[str, Any] = {
            "lr": lr, "betas": tuple(betas), "tau": tau, "yogi": yogi, "weight_decay": weight_decay,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("the outer optimizer steps on a given pseudo-gradient, without a closure")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            tau = group["tau"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                if group["weight_decay"]:
                    grad = grad.add(param, alpha=group["weight_decay"])
                state = self.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.full_like(param, tau * tau)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                squared = grad * grad
                if group["yogi"]:
                    v.addcmul_(torch.sign(v - squared), squared, value=-(1 - beta2))
                else:
                    v.mul_(beta2).add_(squared, alpha=1 - beta2)
                del squared
                denominator = v.sqrt().add_(tau)
                param.addcdiv_(m, denominator, value=-group["lr"])

"""Inner and outer optimizers, and their state as safetensors-ready tensors plus JSON scalars.

The outer optimizer is a real ``torch.optim`` optimizer over the flat global weight vector, fed
with the averaged pseudo-gradient in ``.grad`` (as in torchft's DiLoCo): Nesterov momentum is
torch's, not hand-rolled. Checkpoints never pickle: ``optimizer_state_tensors`` splits a torch
optimizer's ``state_dict()`` into named tensors (for safetensors) and JSON-able metadata.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from geoloco.algorithms.adaptive_outer import ReddiAdaptive
from geoloco.algorithms.config import ConfigError, config_to_dict, require
from geoloco.algorithms.lr_schedule import LR_SCHEDULES, InnerLRSchedule, resolve_decay_steps

__all__ = [
    "INNER_OPTIMIZERS",
    "OUTER_OPTIMIZERS",
    "DelayedNesterov",
    "InnerOptimizerConfig",
    "OuterOptimizer",
    "OuterOptimizerConfig",
    "OuterOptimizerFactory",
    "OuterOptimizerSpec",
    "load_optimizer_state_",
    "optimizer_state_tensors",
    "register_outer_optimizer",
    "split_flat_optimizer_state",
]

Params = Iterable[torch.Tensor]


def _empty_parameter(device: torch.device | str | None) -> torch.nn.Parameter:
    """The outer optimizer's parameter between steps: no storage, fp32, on ``device``."""
    return torch.nn.Parameter(torch.empty(0, dtype=torch.float32, device=device))


# --------------------------------------------------------------------------------------------
# Inner optimizer (what each site runs for H steps)


def _build_adamw(config: InnerOptimizerConfig, params: Params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
    )


def _build_inner_sgd(config: InnerOptimizerConfig, params: Params) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        params,
        lr=config.lr,
        momentum=config.momentum,
        nesterov=config.nesterov,
        weight_decay=config.weight_decay,
    )


INNER_OPTIMIZERS: dict[str, Callable[[InnerOptimizerConfig, Params], torch.optim.Optimizer]] = {
    "adamw": _build_adamw,
    "sgd": _build_inner_sgd,
}
"""Inner optimizer name -> factory ``(config, params) -> torch.optim.Optimizer``."""


@dataclass(kw_only=True, slots=True)
class InnerOptimizerConfig:
    """The optimizer a site runs for its H inner steps (state kept across rounds)."""

    name: str = "adamw"
    """One of ``INNER_OPTIMIZERS``: ``"adamw"`` (DiLoCo's choice) or ``"sgd"``."""
    lr: float = 1e-3
    """Learning rate of every inner step."""
    weight_decay: float = 0.0
    """Decoupled weight decay for AdamW, L2 penalty for SGD."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's moment decay rates (0.95 for the second moment, as is usual for transformers)."""
    eps: float = 1e-8
    """AdamW's denominator epsilon."""
    momentum: float = 0.0
    """SGD momentum (0 = plain SGD)."""
    nesterov: bool = False
    """SGD: use Nesterov momentum (needs momentum > 0)."""
    grad_clip_norm: float | None = None
    """Clip each step's gradient to this global L2 norm; ``None`` disables clipping."""
    schedule: str = "constant"
    """Inner lr schedule over the site's cumulative inner steps (``geoloco.algorithms.lr_schedule``):
    ``"constant"``, ``"cosine"`` or ``"linear"`` decay to ``min_lr_ratio × lr``."""
    warmup_steps: int = 0
    """Linear warm-up from ``lr / warmup_steps`` to ``lr`` over the first this many inner steps."""
    decay_steps: int | None = None
    """Horizon of the decay in inner steps per site, warm-up included; unset = rounds ×
    inner_steps of the run (an error where the run length is unknown)."""
    min_lr_ratio: float = 0.0
    """Floor of the cosine/linear decay as a fraction of ``lr``."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        require(
            self.schedule in LR_SCHEDULES,
            "schedule",
            f"unknown lr schedule {self.schedule!r}; valid names: {', '.join(LR_SCHEDULES)}",
        )
        require(
            not isinstance(self.warmup_steps, bool) and self.warmup_steps >= 0,
            "warmup_steps",
            f"must be an integer >= 0, got {self.warmup_steps!r}",
        )
        require(
            self.decay_steps is None or self.decay_steps > self.warmup_steps,
            "decay_steps",
            f"must be > warmup_steps ({self.warmup_steps}) or unset, got {self.decay_steps}",
        )
        require(
            0 <= self.min_lr_ratio <= 1,
            "min_lr_ratio",
            f"must be in [0, 1], got {self.min_lr_ratio}",
        )
        require(
            self.name in INNER_OPTIMIZERS,
            "name",
            f"unknown inner optimizer {self.name!r}; valid names: {', '.join(INNER_OPTIMIZERS)}",
        )
        require(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        require(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        require(
            all(0 <= b < 1 for b in self.betas), "betas", f"each must be in [0, 1), got {self.betas}"
        )
        require(self.eps > 0, "eps", f"must be > 0, got {self.eps}")
        require(0 <= self.momentum < 1, "momentum", f"must be in [0, 1), got {self.momentum}")
        require(
            not self.nesterov or self.momentum > 0,
            "nesterov",
            "Nesterov SGD needs momentum > 0; set momentum (e.g. 0.9) or nesterov = false",
        )
        require(
            self.grad_clip_norm is None or self.grad_clip_norm > 0,
            "grad_clip_norm",
            f"must be > 0 or unset, got {self.grad_clip_norm}",
        )

    def build(self, params: Params) -> torch.optim.Optimizer:
        return INNER_OPTIMIZERS[self.name](self, params)

    @property
    def scheduled(self) -> bool:
        """True when the inner lr changes over the run (a decay or a warm-up)."""
        return self.schedule != "constant" or self.warmup_steps > 0

    def resolved_decay_steps(
        self, *, total_rounds: int | None, inner_steps: int | None
    ) -> int | None:
        """``decay_steps``, derived from the run length when unset (``ConfigError`` if it cannot be)."""
        return resolve_decay_steps(
            self.schedule, self.decay_steps, total_rounds=total_rounds, inner_steps=inner_steps
        )

    def build_schedule(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        total_rounds: int | None = None,
        inner_steps: int | None = None,
        start_step: int = 0,
    ) -> InnerLRSchedule | None:
        """The lr schedule over ``optimizer`` (built by ``build``), or None when the lr is constant.

        ``total_rounds × inner_steps`` is the decay horizon when ``decay_steps`` is unset.
        """
        if not self.scheduled:
            return None
        return InnerLRSchedule(
            optimizer,
            schedule=self.schedule,
            warmup_steps=self.warmup_steps,
            decay_steps=self.resolved_decay_steps(total_rounds=total_rounds, inner_steps=inner_steps),
            min_lr_ratio=self.min_lr_ratio,
            start_step=start_step,
        )

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


# --------------------------------------------------------------------------------------------
# Outer optimizer (what the coordinator applies to the averaged pseudo-gradient)


OuterOptimizerFactory = Callable[["OuterOptimizerConfig", Params], torch.optim.Optimizer]
"""Builds a ``torch.optim`` optimizer over the given parameters from a resolved config (``lr`` and
``momentum`` filled in; the other fields as the user set them)."""


@dataclass(frozen=True, slots=True)
class OuterOptimizerSpec:
    """An entry of ``OUTER_OPTIMIZERS``: how the optimizer is built, and its defaults."""

    factory: OuterOptimizerFactory
    """Called with the resolved config and the one flat parameter."""
    lr: float
    """Outer learning rate when ``outer_optimizer.lr`` is unset."""
    momentum: float
    """Momentum when ``outer_optimizer.momentum`` is unset (0 for optimizers without one)."""


def _resolved_lr_momentum(config: OuterOptimizerConfig) -> tuple[float, float]:
    """``lr`` and ``momentum`` of a config that went through ``OuterOptimizerConfig.resolved``."""
    if config.lr is None or config.momentum is None:
        raise ValueError("build the outer optimizer from config.resolved(), which fills lr and momentum")
    return config.lr, config.momentum


def _build_nesterov(config: OuterOptimizerConfig, params: Params) -> torch.optim.Optimizer:
    lr, momentum = _resolved_lr_momentum(config)
    if config.momentum_period > 1:  # Delayed Nesterov (Liu et al. 2024), for asynchronous merges
        return DelayedNesterov(
            params, lr=lr, momentum=momentum, period=config.momentum_period, weight_decay=config.weight_decay
        )
    # foreach: the Nesterov look-ahead ``g + μ·buf`` is computed in the gradient's own memory;
    # the single-tensor path (torch's CPU default) allocates a model-sized temporary for it.
    # Same operations in the same order: the result is bit-identical.
    return torch.optim.SGD(
        params, lr=lr, momentum=momentum, nesterov=True, weight_decay=config.weight_decay, foreach=True
    )


def _build_outer_sgd(config: OuterOptimizerConfig, params: Params) -> torch.optim.Optimizer:
    lr, momentum = _resolved_lr_momentum(config)
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=config.weight_decay, foreach=True)


def _build_adam(config: OuterOptimizerConfig, params: Params) -> torch.optim.Optimizer:
    lr, _ = _resolved_lr_momentum(config)
    return torch.optim.Adam(params, lr=lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay)


def _build_fedadam(config: OuterOptimizerConfig, params: Params) -> torch.optim.Optimizer:
    lr, _ = _resolved_lr_momentum(config)
    return ReddiAdaptive(params, lr=lr, betas=config.betas, tau=config.tau, weight_decay=config.weight_decay)


def _build_fedyogi(config: OuterOptimizerConfig, params: Params) -> torch.optim.Optimizer:
    lr, _ = _resolved_lr_momentum(config)
    return ReddiAdaptive(
        params, lr=lr, betas=config.betas, tau=config.tau, yogi=True, weight_decay=config.weight_decay
    )


class DelayedNesterov(torch.optim.Optimizer):
    """Delayed Nesterov (DN) momentum, Liu et al. 2024, "Asynchronous Local-SGD Training for
    Language Modeling" (arXiv 2401.09135), section on the outer optimizer under asynchrony:
    ``[outer_optimizer] name = "nesterov"`` with ``momentum_period`` N > 1 builds it.

    Why: with asynchronous merges every outer step sees the update of one site (or a few),
    computed from a model some versions old; plain Nesterov folds each such stale update into
    its momentum at once, and the momentum then keeps pushing in directions the newer model has
    already moved along, which is what makes naive asynchronous DiLoCo converge worse than the
    synchronous one. DN keeps the momentum fixed for ``N`` steps and folds in their average.

    What is implemented (the paper's algorithm as we read it; ``g_t`` the step's gradient, the
    averaged pseudo-gradient of the outer step, plus ``weight_decay · θ`` when set; ``m`` the
    momentum, ``b`` the buffer, both from 0; ``η`` lr, ``β`` momentum, ``N`` period)::

        b ← b + g_t
        if t is a multiple of N (t counts steps from 1):
            m ← β·m + b / N          # the momentum update, from the N buffered gradients
            θ ← θ − η·(g_t / N + β·m)  # Nesterov look-ahead; g_t / N as in between
            b ← 0
        else:
            θ ← θ − η·g_t / N        # a plain step: the gradient, no momentum

    Over one period of ``N`` equal gradients ``g`` the weights move ``η·g + η·β·m``: one
    synchronous Nesterov step's worth, spread over the ``N`` arrivals. With ``N = 1`` this is
    exactly torch's ``SGD(nesterov=True)`` (``m ← β·m + g``, ``θ ← θ − η·(g + β·m)``), the same
    operations in the same order, bit for bit (a test checks it; the config builds torch's own
    for ``momentum_period = 1``, so existing runs and checkpoints are unchanged).

    State per parameter: ``momentum_buffer`` and ``delay_buffer`` (two model-sized vectors, as
    Adam's two moments) and the step count ``step`` (an integer tensor, so checkpoints carry it
    with the buffers).
    """

    def __init__(
        self, params: Params, *, lr: float, momentum: float, period: int = 1, weight_decay: float = 0.0
    ) -> None:
        if not 0 < momentum < 1:
            raise ValueError(f"delayed Nesterov needs momentum in (0, 1), got {momentum}")
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"delayed Nesterov's period must be an integer >= 1, got {period!r}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "period": period, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, beta, period, decay = group["lr"], group["momentum"], group["period"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad if decay == 0 else param.grad.add(param, alpha=decay)
                state = self.state[param]
                if "delay_buffer" not in state:  # first step (a plain Nesterov state keeps its momentum)
                    state["step"] = torch.zeros((), dtype=torch.int64)
                    state.setdefault("momentum_buffer", torch.zeros_like(param))
                    state["delay_buffer"] = torch.zeros_like(param)
                state["step"] += 1
                buffer, momentum = state["delay_buffer"], state["momentum_buffer"]
                buffer.add_(grad)
                scaled = grad if period == 1 else grad.div(period)
                if int(state["step"].item()) % period == 0:
                    # The same calls torch's SGD(nesterov=True) makes, so N = 1 is bit-identical.
                    momentum.mul_(beta).add_(buffer if period == 1 else buffer.div(period))
                    update = torch.add(scaled, momentum, alpha=beta)
                    buffer.zero_()
                else:
                    update = scaled
                param.add_(update, alpha=-lr)
        return loss


OUTER_OPTIMIZERS: dict[str, OuterOptimizerSpec] = {
    # DiLoCo (Douillard et al. 2023): Nesterov momentum, lr 0.7, momentum 0.9.
    "nesterov": OuterOptimizerSpec(_build_nesterov, lr=0.7, momentum=0.9),
    # lr 1, no momentum: the average of the sites' weights, i.e. FedAvg / Local SGD.
    "sgd": OuterOptimizerSpec(_build_outer_sgd, lr=1.0, momentum=0.0),
    # FedAdam / FedYogi as Reddi et al. 2021 define them: no bias correction, tau instead of eps.
    "fedadam": OuterOptimizerSpec(_build_fedadam, lr=1e-2, momentum=0.0),
    "fedyogi": OuterOptimizerSpec(_build_fedyogi, lr=1e-2, momentum=0.0),
    # torch's Adam on the pseudo-gradient: bias-corrected, eps 1e-8 (not the paper's FedAdam).
    "adam": OuterOptimizerSpec(_build_adam, lr=1e-2, momentum=0.0),
}
"""Outer optimizer name -> factory and its default lr / momentum: the one registry, which
``register_outer_optimizer`` adds a plug-in's optimizer to."""


def register_outer_optimizer(
    name: str,
    factory: OuterOptimizerFactory,
    *,
    lr: float,
    momentum: float = 0.0,
    replace: bool = False,
) -> None:
    """Make ``outer_optimizer.name = NAME`` build ``factory(config, params)`` (a ``torch.optim``
    optimizer fed the averaged pseudo-gradient in ``.grad``), with ``lr`` and ``momentum`` as the
    defaults where the config leaves them unset.

    Registration is per process: a sweep's worker processes and Ray workers know the name only
    when the module that registers it is imported there too, which is what a config's
    ``[research] plugins`` list does (``geoloco.scenarios.research``). A name already taken raises
    ``ValueError`` unless ``replace``; registering the same factory again (a module imported
    twice) is a no-op."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"an outer optimizer name is an identifier such as 'signsgd', got {name!r}")
    if not callable(factory):
        raise TypeError(f"the factory of outer optimizer {name!r} must be callable, got {factory!r}")
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"default lr of outer optimizer {name!r} must be > 0, got {lr}")
    if not 0 <= momentum < 1:
        raise ValueError(f"default momentum of outer optimizer {name!r} must be in [0, 1), got {momentum}")
    known = OUTER_OPTIMIZERS.get(name)
    if known is not None and not replace and not _same_callable(known.factory, factory):
        raise ValueError(
            f"outer optimizer {name!r} is already registered (by {_where(known.factory)}); "
            "pick another name, or pass replace=True"
        )
    OUTER_OPTIMIZERS[name] = OuterOptimizerSpec(factory, lr=lr, momentum=momentum)


def _same_callable(a: Callable[..., Any], b: Callable[..., Any]) -> bool:
    """Whether ``b`` is ``a`` or the same function defined again (its module reloaded)."""
    return a is b or _where(a) == _where(b)


def _where(factory: Callable[..., Any]) -> str:
    return f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', repr(factory))}"


@dataclass(kw_only=True, slots=True)
class OuterOptimizerConfig:
    """The optimizer the coordinator applies to the averaged pseudo-gradient.

    ``name``, ``lr`` and ``momentum`` left unset take the algorithm's and the optimizer's defaults
    (``resolved()``): DiLoCo -> Nesterov lr 0.7 momentum 0.9, FedAvg -> SGD lr 1, FedOpt -> FedAdam.
    """

    name: str | None = None
    """One of ``OUTER_OPTIMIZERS``: ``"nesterov"`` (with ``momentum_period`` > 1: Delayed
    Nesterov), ``"sgd"``, ``"fedadam"`` / ``"fedyogi"`` (Reddi et al.: no bias correction,
    ``tau``) or ``"adam"`` (torch's bias-corrected Adam with ``eps``); unset = the algorithm's
    default."""
    lr: float | None = None
    """Outer learning rate; unset = the optimizer's default (nesterov 0.7, sgd 1.0, the Adam family 0.01)."""
    momentum: float | None = None
    """SGD/Nesterov momentum; unset = the optimizer's default (nesterov 0.9, sgd 0)."""
    betas: tuple[float, float] = (0.9, 0.99)
    """Adam's moment decay rates."""
    eps: float = 1e-8
    """``"adam"``'s denominator epsilon."""
    tau: float = 1e-3
    """``"fedadam"`` / ``"fedyogi"``'s adaptivity floor (Reddi et al. tune it in 1e-5..1e-1)."""
    weight_decay: float = 0.0
    """L2 penalty added by the outer optimizer (rarely wanted)."""
    momentum_period: int = 1
    """``"nesterov"`` only: > 1 makes it Delayed Nesterov (Liu et al. 2024, ``DelayedNesterov``):
    the momentum is updated every this many outer steps from their averaged updates, and the
    steps in between apply ``lr / N`` times the update without momentum; 1 is plain Nesterov.
    For asynchronous merges of ``q`` updates out of ``n`` sites, ``n / q`` moves the momentum
    once per synchronous round's worth of updates (the choice of benchmarks/bench_async.py)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        require(
            not isinstance(self.momentum_period, bool) and self.momentum_period >= 1,
            "momentum_period",
            f"must be an integer >= 1, got {self.momentum_period!r}",
        )
        require(
            self.momentum_period == 1 or self.name == "nesterov",
            "momentum_period",
            f"only Nesterov delays its momentum (Delayed Nesterov); outer optimizer {self.name or 'unset'!r} "
            "has no period: set name = \"nesterov\" or momentum_period = 1",
        )
        require(
            self.name is None or self.name in OUTER_OPTIMIZERS,
            "name",
            f"unknown outer optimizer {self.name!r}; valid names: {', '.join(OUTER_OPTIMIZERS)} (a "
            "plug-in's name exists once its module is imported: list it in [research] plugins)",
        )
        require(self.lr is None or self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        require(
            self.momentum is None or 0 <= self.momentum < 1,
            "momentum",
            f"must be in [0, 1), got {self.momentum}",
        )
        if self.name == "nesterov":
            require(
                self.momentum is None or self.momentum > 0,
                "momentum",
                "Nesterov needs momentum > 0; use name = \"sgd\" for momentum 0",
            )
        require(
            all(0 <= b < 1 for b in self.betas), "betas", f"each must be in [0, 1), got {self.betas}"
        )
        require(self.eps > 0, "eps", f"must be > 0, got {self.eps}")
        require(self.tau > 0, "tau", f"must be > 0, got {self.tau}")
        require(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")

    def resolved(self, default_name: str = "nesterov") -> OuterOptimizerConfig:
        """A copy with ``name``, ``lr`` and ``momentum`` filled in from the defaults."""
        name = self.name or default_name
        spec = OUTER_OPTIMIZERS[name]
        return OuterOptimizerConfig(
            name=name,
            lr=spec.lr if self.lr is None else self.lr,
            momentum=spec.momentum if self.momentum is None else self.momentum,
            betas=self.betas,
            eps=self.eps,
            tau=self.tau,
            weight_decay=self.weight_decay,
            momentum_period=self.momentum_period,
        )

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


class OuterOptimizer:
    """A torch optimizer whose one parameter is the flat global weight vector.

    ``step(global_flat, pseudo_gradient)`` loads a copy of ``θ_t`` into the parameter, puts the
    pseudo-gradient in ``.grad``, runs ``optimizer.step()`` and hands the stepped tensor ``θ'`` to
    the caller. The caller keeps ``θ_t``: with a lossy downlink the next global weights are
    ``θ_t + D(C(θ' − θ_t + e))``, not ``θ'``, so the parameter is reloaded from the caller's
    weights at every step while the optimizer's state (momentum, Adam moments) persists.

    Memory: the parameter holds weights only during ``step``; between steps it is empty, so the
    coordinator keeps one copy of the weights (its own) besides the optimizer state, and the copy
    made for a step becomes the returned ``θ'`` instead of being cloned again. DiLoCo's Nesterov
    step on a consumed gradient needs no copy at all: ``θ'`` is written into the gradient's memory
    (``_nesterov_in_gradient``, the same bits).

    ``from_inner`` builds one from an inner-optimizer config: the data-parallel baseline's single
    shared AdamW state, applied by the coordinator to the averaged gradient (with the inner
    config's gradient clipping, over the global norm of the flat vector).
    """

    def __init__(
        self,
        config: OuterOptimizerConfig,
        numel: int,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        if config.name is None or config.lr is None or config.momentum is None:
            config = config.resolved()
        self.config: OuterOptimizerConfig | InnerOptimizerConfig = config
        self.grad_clip_norm: float | None = None
        self.numel = numel
        self.param = _empty_parameter(device)
        self.optimizer = OUTER_OPTIMIZERS[config.name].factory(config, [self.param])  # type: ignore[index]

    @classmethod
    def from_inner(
        cls,
        config: InnerOptimizerConfig,
        numel: int,
        *,
        device: torch.device | str | None = None,
    ) -> OuterOptimizer:
        self = cls.__new__(cls)
        self.config = config
        self.grad_clip_norm = config.grad_clip_norm
        self.numel = numel
        self.param = _empty_parameter(device)
        self.optimizer = config.build([self.param])
        return self

    def step(
        self,
        global_flat: torch.Tensor,
        pseudo_gradient: torch.Tensor,
        *,
        consume_gradient: bool = False,
    ) -> torch.Tensor:
        """``θ' = OuterOpt(θ_t, ĝ)``; returns a new tensor, leaves ``global_flat`` untouched.

        ``consume_gradient=True`` lets the optimizer use ``pseudo_gradient`` itself as ``.grad``
        (no copy) when it is already an fp32 tensor on the optimizer's device; torch may then
        overwrite it (gradient clipping, foreach Nesterov), so pass it only for a tensor the
        caller drops afterwards, such as the aggregator's buffer.
        """
        if global_flat.shape != (self.numel,) or pseudo_gradient.shape != (self.numel,):
            raise ValueError(
                f"outer optimizer holds {self.numel} weights; got weights "
                f"{tuple(global_flat.shape)} and pseudo-gradient {tuple(pseudo_gradient.shape)}"
            )
        param = self.param
        if consume_gradient:
            stepped = self._nesterov_in_gradient(global_flat.detach(), pseudo_gradient.detach())
            if stepped is not None:
                return stepped
        with torch.no_grad():
            # The copy of θ_t this step works on; it becomes the returned θ'.
            param.set_(global_flat.detach().to(param.device, torch.float32, copy=True))  # type: ignore[call-overload]
        grad = pseudo_gradient.detach()
        same_layout = grad.dtype == param.dtype and grad.device == param.device
        param.grad = grad if consume_gradient and same_layout else grad.to(param, copy=True)
        del grad, pseudo_gradient
        try:
            if self.grad_clip_norm is not None:
                torch.nn.utils.clip_grad_norm_([param], self.grad_clip_norm)
            self.optimizer.step()
            new_flat = param.detach()
        finally:
            param.grad = None
            with torch.no_grad():
                param.set_(torch.empty(0, dtype=torch.float32, device=param.device))  # type: ignore[call-overload]
        return new_flat

    def _nesterov_in_gradient(self, global_flat: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
        """DiLoCo's outer step (Nesterov SGD without weight decay) with ``θ'`` written into the
        consumed gradient's memory: ``θ_t``, the momentum and the gradient are the only
        model-sized tensors, where ``optimizer.step()`` needs a fourth, the copy of ``θ_t`` it
        steps (the coordinator's aggregation peak). The calls are the ones torch's foreach SGD
        makes on CPU, element by element, so ``θ'`` and the momentum are bit-identical to it
        (``tests/algorithms/test_outer_in_place.py``). None where it does not apply: another
        optimizer or setting, or a gradient that is not an fp32 tensor beside the weights."""
        optimizer = self.optimizer
        if type(optimizer) is not torch.optim.SGD or self.grad_clip_norm is not None:
            return None
        group = optimizer.param_groups[0]
        momentum, lr = group["momentum"], group["lr"]
        if (
            not group["nesterov"] or group["weight_decay"] != 0 or group["dampening"] != 0 or group["maximize"]
            or isinstance(lr, torch.Tensor) or momentum == 0
        ):
            return None
        device = self.param.device
        if not (
            grad.dtype == global_flat.dtype == torch.float32 and grad.device == global_flat.device == device
            and grad.is_contiguous() and global_flat.is_contiguous() and not grad.requires_grad
        ):
            return None
        with torch.no_grad():
            state = optimizer.state[self.param]
            buffer = state.get("momentum_buffer")
            if buffer is None:  # torch's first step: the buffer starts as a copy of the gradient
                state["momentum_buffer"] = torch.clone(grad).detach()
                buffer = state["momentum_buffer"]
            else:
                buffer.mul_(momentum).add_(grad, alpha=1)
            grad.add_(buffer, alpha=momentum)  # the Nesterov look-ahead g + μ·buf
            return torch.add(global_flat, grad, alpha=-lr, out=grad)  # θ_t − lr·(g + μ·buf)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Optimizer state as named tensors (momentum buffer, Adam moments and step): the live
        buffers, not copies, so a checkpoint of a big model writes them without a model-sized
        clone. They change with the next ``step``; a caller that keeps them clones them."""
        return optimizer_state_tensors(self.optimizer, copy=False)[0]

    def state_meta(self) -> dict[str, Any]:
        """JSON-able part of the state: hyper-parameters per param group (read from the live
        buffers: a clone of the momentum here was the coordinator's peak while checkpointing)."""
        return optimizer_state_tensors(self.optimizer, copy=False)[1]

    def load_state(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Restore what ``state_tensors()`` / ``state_meta()`` returned."""
        load_optimizer_state_(self.optimizer, tensors, meta)


# --------------------------------------------------------------------------------------------
# State without pickle

_TUPLE_KEYS = frozenset({"betas"})
STATE_PREFIX: str = "state"


def optimizer_state_tensors(
    optimizer: torch.optim.Optimizer, *, copy: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``optimizer.state_dict()`` into tensors and JSON-able metadata.

    Tensors are named ``state.<param index>.<key>`` (e.g. ``state.0.momentum_buffer``), ready for
    ``safetensors.torch.save_file``; non-tensor per-parameter state and the param groups go into
    the metadata dict, ready for ``json.dumps``. ``copy=False`` returns the optimizer's own
    (contiguous) buffers instead of clones, valid until its next step.
    """
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                value = value.detach()
                tensors[f"{STATE_PREFIX}.{index}.{key}"] = value.clone().contiguous() if copy else value.contiguous()
            else:
                scalars.setdefault(str(index), {})[key] = value
    groups = [
        {k: list(v) if isinstance(v, tuple) else v for k, v in group.items()}
        for group in sd["param_groups"]
    ]
    return tensors, {"param_groups": groups, "scalar_state": scalars}


def load_optimizer_state_(
    optimizer: torch.optim.Optimizer,
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
) -> None:
    """Restore an optimizer from ``optimizer_state_tensors`` output (tensors moved to its device)."""
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        prefix, index, key = name.split(".", 2)
        if prefix != STATE_PREFIX:
            raise ConfigError(name, f"not an optimizer state tensor (expected '{STATE_PREFIX}.*')")
        # Clone: torch keeps tensors that already match the parameter's dtype/device as they are,
        # and two optimizers loaded from one dict must not share their moment buffers.
        state.setdefault(int(index), {})[key] = value.clone()
    for index, values in meta.get("scalar_state", {}).items():
        state.setdefault(int(index), {}).update(values)
    groups = [
        {k: tuple(v) if k in _TUPLE_KEYS and isinstance(v, list) else v for k, v in g.items()}
        for g in meta["param_groups"]
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})



def split_flat_optimizer_state(
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    entries: Sequence[tuple[int, tuple[int, ...]]],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Turn the state of an optimizer over one flat vector into one over per-tensor parameters.

    ``entries`` are ``(offset, shape)`` of each parameter in the flat vector (``ParamLayout``
    order). Vectors as long as the flat vector (momentum, Adam moments) are sliced and reshaped;
    anything else
    (Adam's step count) is copied to every parameter. Used to hand the shared state of the
    data-parallel warm-up to each site's inner optimizer, as if every site had run the warm-up.
    """
    sizes = [math.prod(shape) for _, shape in entries]
    total = sum(sizes)
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        prefix, index, key = name.split(".", 2)
        if index != "0":
            raise ValueError(f"flat optimizer state has more than one parameter ({name})")
        for i, ((offset, shape), numel) in enumerate(zip(entries, sizes, strict=True)):
            if value.dim() == 1 and value.numel() == total:
                out[f"{prefix}.{i}.{key}"] = value[offset : offset + numel].reshape(shape).clone()
            else:
                out[f"{prefix}.{i}.{key}"] = value.clone()
    scalar_state = {
        str(i): dict(meta.get("scalar_state", {}).get("0", {})) for i in range(len(entries))
    }
    groups = [dict(g, params=list(range(len(entries)))) for g in meta["param_groups"]]
    return out, {"param_groups": groups, "scalar_state": scalar_state}

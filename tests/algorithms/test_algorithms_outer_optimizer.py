"""Outer optimizers over the flat global vector, and optimizer state without pickle."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from geoloco.algorithms.config import ConfigError, config_from_dict
from geoloco.algorithms.optimizers import (
    InnerOptimizerConfig,
    OuterOptimizer,
    OuterOptimizerConfig,
    load_optimizer_state_,
    optimizer_state_tensors,
    split_flat_optimizer_state,
)


def test_nesterov_matches_hand_computed_formula() -> None:
    """DiLoCo's outer step: b ← μb + g, θ ← θ − lr(g + μb), with lr 0.7, μ 0.9 by default."""
    outer = OuterOptimizer(OuterOptimizerConfig(name="nesterov"), 3)
    assert outer.config.lr == 0.7 and outer.config.momentum == 0.9
    theta = torch.tensor([1.0, -2.0, 0.5])
    g1 = torch.tensor([0.1, 0.2, -0.3])
    g2 = torch.tensor([-0.05, 0.4, 0.1])
    lr, mu = 0.7, 0.9

    # The reference is computed in float64; fp32 results may differ by an ulp or two (~2.4e-7 at
    # magnitude 2), from torch rounding after each of its in-place operations.
    theta1 = outer.step(theta, g1)
    t64, g1d, g2d = theta.double(), g1.double(), g2.double()
    b1 = g1d
    expected1 = t64 - lr * (g1d + mu * b1)
    torch.testing.assert_close(theta1.double(), expected1, rtol=0, atol=5e-7)
    assert torch.equal(theta, torch.tensor([1.0, -2.0, 0.5])), "input weights must not change"

    theta2 = outer.step(theta1, g2)
    b2 = mu * b1 + g2d
    expected2 = expected1 - lr * (g2d + mu * b2)
    torch.testing.assert_close(theta2.double(), expected2, rtol=0, atol=5e-7)


def test_sgd_lr1_is_weight_averaging() -> None:
    """FedAvg: θ − 1·mean(θ − θ_k) = mean(θ_k)."""
    outer = OuterOptimizer(OuterOptimizerConfig(name="sgd"), 2)
    theta = torch.tensor([1.0, 1.0])
    locals_ = torch.tensor([[0.0, 2.0], [1.0, 4.0]])
    pseudo = (theta - locals_).mean(0)
    torch.testing.assert_close(outer.step(theta, pseudo), locals_.mean(0))


def test_adam_first_step_is_lr_times_sign() -> None:
    outer = OuterOptimizer(OuterOptimizerConfig(name="adam", lr=0.01), 3)
    out = outer.step(torch.zeros(3), torch.tensor([0.5, -2.0, 1e-3]))
    torch.testing.assert_close(out, torch.tensor([-0.01, 0.01, -0.01]), rtol=1e-3, atol=1e-6)


def _reddi_reference(
    grads: list[torch.Tensor], *, lr: float, beta1: float, beta2: float, tau: float, yogi: bool
) -> torch.Tensor:
    """Reddi et al. 2021, Algorithm 2 (server side), in float64: x ← x + lr·m/(√v + τ) with
    Δ = −g, m from 0, v from τ², no bias correction."""
    x = torch.zeros_like(grads[0], dtype=torch.float64)
    m = torch.zeros_like(x)
    v = torch.full_like(x, tau * tau)
    for g in grads:
        delta = -g.double()
        m = beta1 * m + (1 - beta1) * delta
        if yogi:
            v = v - (1 - beta2) * delta**2 * torch.sign(v - delta**2)
        else:
            v = beta2 * v + (1 - beta2) * delta**2
        x = x + lr * m / (v.sqrt() + tau)
    return x


@pytest.mark.parametrize("yogi", [False, True])
def test_fedadam_and_fedyogi_follow_reddi_et_al(yogi: bool) -> None:
    name = "fedyogi" if yogi else "fedadam"
    config = OuterOptimizerConfig(name=name, lr=0.05, betas=(0.9, 0.99), tau=1e-3)
    outer = OuterOptimizer(config, 4)
    grads = [
        torch.tensor([0.5, -2.0, 1e-3, 0.0]),
        torch.tensor([0.1, 0.3, -1e-3, 2.0]),
        torch.tensor([-0.4, 0.1, 0.0, 0.5]),
    ]
    theta = torch.zeros(4)
    for g in grads:
        theta = outer.step(theta, g)
    expected = _reddi_reference(grads, lr=0.05, beta1=0.9, beta2=0.99, tau=1e-3, yogi=yogi)
    torch.testing.assert_close(theta.double(), expected, rtol=1e-5, atol=1e-7)
    # Unlike torch's bias-corrected Adam, the first step is not lr·sign(g): it is damped by 1 − β1
    # over √(1 − β2) (about 1 for large g), and tau keeps a tiny g from taking a full step.
    first = OuterOptimizer(config, 4).step(torch.zeros(4), grads[0])
    assert abs(first[2].item()) < 0.05 * 0.5


def test_fedopt_defaults_to_fedadam_and_adam_keeps_its_name() -> None:
    from geoloco.algorithms.algorithm_config import DEFAULT_OUTER_OPTIMIZERS

    assert DEFAULT_OUTER_OPTIMIZERS["fedopt"] == "fedadam"
    resolved = OuterOptimizerConfig(name="adam").resolved()
    assert resolved.name == "adam" and resolved.eps == 1e-8
    with pytest.raises(ConfigError, match="tau: must be > 0"):
        OuterOptimizerConfig(name="fedadam", tau=0.0)


@pytest.mark.parametrize("name", ["nesterov", "adam", "fedadam", "fedyogi"])
def test_state_roundtrip_through_safetensors_and_json_continues_identically(tmp_path, name) -> None:
    torch.manual_seed(0)
    grads = [torch.randn(10) for _ in range(5)]
    a = OuterOptimizer(OuterOptimizerConfig(name=name), 10)
    theta = torch.randn(10)
    for g in grads[:3]:
        theta = a.step(theta, g)
    save_file(a.state_tensors(), tmp_path / "outer.safetensors")
    (tmp_path / "outer.json").write_text(json.dumps(a.state_meta()))

    b = OuterOptimizer(OuterOptimizerConfig(name=name), 10)
    b.load_state(load_file(tmp_path / "outer.safetensors"), json.loads((tmp_path / "outer.json").read_text()))
    first_b = b.step(theta.clone(), grads[3])
    ta = a.step(theta, grads[3])
    assert torch.equal(ta, first_b)
    tb = first_b
    for g in grads[4:]:
        ta, tb = a.step(ta, g), b.step(tb, g)
    assert torch.equal(ta, tb)
    # Without the loaded state the step differs, so the check above is not vacuous.
    fresh = OuterOptimizer(OuterOptimizerConfig(name=name), 10)
    assert not torch.allclose(fresh.step(theta, grads[3]), first_b)


def test_loading_state_does_not_share_buffers_between_optimizers() -> None:
    a = OuterOptimizer(OuterOptimizerConfig(name="nesterov"), 4)
    a.step(torch.zeros(4), torch.ones(4))
    tensors, meta = a.state_tensors(), a.state_meta()
    b = OuterOptimizer(OuterOptimizerConfig(name="nesterov"), 4)
    c = OuterOptimizer(OuterOptimizerConfig(name="nesterov"), 4)
    b.load_state(tensors, meta)
    c.load_state(tensors, meta)
    b.step(torch.zeros(4), torch.ones(4))
    assert torch.equal(c.state_tensors()["state.0.momentum_buffer"], torch.ones(4))


def test_split_flat_state_gives_each_parameter_its_slice() -> None:
    flat = torch.nn.Parameter(torch.zeros(5))
    opt = torch.optim.AdamW([flat], lr=0.1)
    flat.grad = torch.arange(5.0)
    opt.step()
    tensors, meta = optimizer_state_tensors(opt)
    json.dumps(meta)
    per, per_meta = split_flat_optimizer_state(tensors, meta, [(0, (2,)), (2, (3, 1))])
    p1, p2 = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3, 1))
    opt2 = torch.optim.AdamW([p1, p2], lr=0.1)
    load_optimizer_state_(opt2, per, per_meta)
    assert torch.equal(opt2.state[p2]["exp_avg"], opt.state[flat]["exp_avg"][2:].reshape(3, 1))
    assert float(opt2.state[p1]["step"]) == 1.0
    # Continuing both from the same weights and gradient gives the same weights.
    p1.grad, p2.grad = torch.ones(2), torch.ones(3, 1)
    flat.grad = torch.ones(5)
    with torch.no_grad():
        p1.copy_(flat[:2])
        p2.copy_(flat[2:].reshape(3, 1))
    opt.step()
    opt2.step()
    assert torch.equal(torch.cat([p1.detach(), p2.detach().reshape(-1)]), flat.detach())


def test_ddp_outer_from_inner_config_clips_global_norm() -> None:
    outer = OuterOptimizer.from_inner(InnerOptimizerConfig(name="sgd", lr=1.0, grad_clip_norm=1.0), 2)
    out = outer.step(torch.zeros(2), torch.tensor([3.0, 4.0]))
    torch.testing.assert_close(out, torch.tensor([-0.6, -0.8]))


@pytest.mark.parametrize(
    ("data", "key", "fragment"),
    [
        ({"name": "rmsprop"}, "outer_optimizer.name", "valid names: nesterov, sgd, fedadam, fedyogi, adam"),
        ({"lr": -1}, "outer_optimizer.lr", "must be > 0"),
        ({"lr": "fast"}, "outer_optimizer.lr", "expected a number (or leave the key out)"),
        ({"name": "nesterov", "momentum": 0.0}, "outer_optimizer.momentum", "Nesterov needs momentum > 0"),
        ({"betas": [0.9]}, "outer_optimizer.betas", "got 1 values"),
        ({"nesterov": True}, "outer_optimizer.nesterov", "unknown key; allowed keys"),
    ],
)
def test_outer_config_errors_name_key_and_allowed(data, key, fragment) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(OuterOptimizerConfig, data, prefix="outer_optimizer")
    assert info.value.key == key
    assert fragment in str(info.value)


def test_inner_config_errors() -> None:
    with pytest.raises(ConfigError, match="valid names: adamw, sgd"):
        InnerOptimizerConfig(name="lion")
    with pytest.raises(ConfigError, match="nesterov: Nesterov SGD needs momentum"):
        InnerOptimizerConfig(name="sgd", nesterov=True)
    cfg = config_from_dict(InnerOptimizerConfig, {"lr": 1, "betas": [0.9, 0.99]})
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.betas == (0.9, 0.99)
    assert json.loads(json.dumps(cfg.to_dict()))["betas"] == [0.9, 0.99]


def test_type_errors_speak_a_config_files_words_not_pythons() -> None:
    """``expected float | None`` read as Python; a TOML file has no None, only a key left out."""
    with pytest.raises(ConfigError) as info:
        config_from_dict(OuterOptimizerConfig, {"betas": "wide"}, prefix="outer_optimizer")
    message = str(info.value)
    assert "a list of 2 values (a number, a number)" in message, message
    assert "| None" not in message and "tuple[" not in message and "float" not in message

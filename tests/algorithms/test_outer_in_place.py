"""DiLoCo's outer step written into the consumed mean's memory: the same bits as torch's SGD
(Nesterov, foreach) stepping a copy of the weights, one model-sized tensor fewer."""

from __future__ import annotations

import torch

from geoloco.algorithms.optimizers import OuterOptimizer, OuterOptimizerConfig


def _torch_reference(
    weights: torch.Tensor, grads: list[torch.Tensor], lr: float, momentum: float
) -> list[torch.Tensor]:
    param = torch.nn.Parameter(weights.clone())
    optimizer = torch.optim.SGD([param], lr=lr, momentum=momentum, nesterov=True, foreach=True)
    out = []
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
        out.append(param.detach().clone())
    return out


def _grads(numel: int, steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    grads = [torch.randn(numel, generator=generator) * 10.0 ** -k for k in range(steps)]
    grads[0][:7] = -0.0  # signed zeros: the first step's buffer is a copy of the gradient, not 0·μ + g
    grads[1][3:9] = 0.0
    return grads


def test_the_in_place_nesterov_step_equals_torchs_sgd_bit_for_bit() -> None:
    numel, lr, momentum = 4099, 0.7, 0.9
    weights = torch.randn(numel, generator=torch.Generator().manual_seed(4))
    weights[:5] = 0.0
    grads = _grads(numel, 5)
    expected = _torch_reference(weights, grads, lr, momentum)
    outer = OuterOptimizer(OuterOptimizerConfig(name="nesterov", lr=lr, momentum=momentum), numel)
    current = weights.clone()
    for k, grad in enumerate(grads):
        mean = grad.clone()
        stepped = outer.step(current, mean, consume_gradient=True)
        assert stepped.data_ptr() == mean.data_ptr()  # θ' in the mean's memory: no fourth model
        assert torch.equal(stepped, expected[k]) and torch.equal(stepped.signbit(), expected[k].signbit())
        current = stepped.clone()


def test_a_kept_gradient_or_another_optimizer_takes_the_general_step() -> None:
    numel = 64
    weights = torch.randn(numel, generator=torch.Generator().manual_seed(6))
    grads = _grads(numel, 2)
    expected = _torch_reference(weights, grads, 0.7, 0.9)
    outer = OuterOptimizer(OuterOptimizerConfig(name="nesterov", lr=0.7, momentum=0.9), numel)
    current = weights.clone()
    for k, grad in enumerate(grads):
        kept = grad.clone()
        stepped = outer.step(current, kept)  # not consumed: the caller's gradient is left as it was
        assert torch.equal(kept, grad) and stepped.data_ptr() != kept.data_ptr()
        assert torch.equal(stepped, expected[k])
        current = stepped
    decayed = OuterOptimizer(OuterOptimizerConfig(name="nesterov", lr=0.7, momentum=0.9, weight_decay=0.1), numel)
    mean = grads[0].clone()
    assert decayed.step(weights, mean, consume_gradient=True).data_ptr() != mean.data_ptr()


def test_the_momentum_resumes_from_a_checkpoint_on_the_same_bits() -> None:
    numel, lr, momentum = 257, 0.5, 0.8
    weights = torch.randn(numel, generator=torch.Generator().manual_seed(7))
    grads = _grads(numel, 4)
    expected = _torch_reference(weights, grads, lr, momentum)
    config = OuterOptimizerConfig(name="nesterov", lr=lr, momentum=momentum)
    first = OuterOptimizer(config, numel)
    current = weights.clone()
    for grad in grads[:2]:
        current = first.step(current, grad.clone(), consume_gradient=True).clone()
    tensors = {k: v.clone() for k, v in first.state_tensors().items()}
    resumed = OuterOptimizer(config, numel)
    resumed.load_state(tensors, first.state_meta())
    for k, grad in enumerate(grads[2:], start=2):
        current = resumed.step(current, grad.clone(), consume_gradient=True).clone()
        assert torch.equal(current, expected[k])

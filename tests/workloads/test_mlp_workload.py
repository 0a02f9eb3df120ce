"""The MLP teacher-student workload: determinism, non-IID sites, fixed evaluation, learnability."""

from __future__ import annotations

import itertools

import pytest
import torch

from geoloco.algorithms.workload import Workload
from geoloco.scenarios.workloads import MLPWorkload, MLPWorkloadConfig


def eval_accuracy(workload: MLPWorkload, model: torch.nn.Module) -> float:
    """Share of held-out samples the model classifies as the teacher does."""
    with torch.no_grad():
        predictions = model(workload.eval_inputs).argmax(dim=1)
    return float((predictions == workload.eval_labels).float().mean())


def test_is_a_workload() -> None:
    workload = MLPWorkload()
    assert isinstance(workload, Workload)
    assert workload.name == "mlp"


def test_same_seed_same_init_and_batches() -> None:
    workload = MLPWorkload()
    first, second = workload.build_model(seed=3), MLPWorkload().build_model(seed=3)
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)
    other = workload.build_model(seed=4)
    assert not torch.equal(next(first.parameters()), next(other.parameters()))
    batches = list(itertools.islice(workload.site_batches(site=2, num_sites=3, seed=9), 3))
    again = list(itertools.islice(MLPWorkload().site_batches(site=2, num_sites=3, seed=9), 3))
    for (x1, y1), (x2, y2) in zip(batches, again, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert batches[0][0].shape == (32, 16) and batches[0][1].dtype == torch.int64
    assert not torch.equal(batches[0][0], batches[1][0])


def test_sites_draw_from_shifted_distributions() -> None:
    workload = MLPWorkload(MLPWorkloadConfig(batch_size=512, site_shift=2.0))
    means = []
    label_shares = []
    for site in range(3):
        inputs, labels = next(workload.site_batches(site=site, num_sites=3, seed=0))
        means.append(inputs.mean(dim=0))
        label_shares.append(torch.bincount(labels, minlength=4).float() / labels.numel())
        torch.testing.assert_close(inputs.mean(dim=0), workload.site_mean(site), atol=0.2, rtol=0)
        assert workload.site_mean(site).norm().item() == pytest.approx(2.0)
    for a, b in itertools.combinations(means, 2):
        assert (a - b).norm() > 1.0
    # Non-IID in labels too: some class share differs noticeably between two sites.
    assert max((a - b).abs().max().item() for a, b in itertools.combinations(label_shares, 2)) > 0.1
    # Labels are the teacher's: the task is the same for every site.
    inputs, labels = next(workload.site_batches(site=0, num_sites=3, seed=1))
    assert torch.equal(labels, workload.teacher_labels(inputs))


def test_site_distribution_independent_of_site_count() -> None:
    workload = MLPWorkload()
    x4, _ = next(workload.site_batches(site=1, num_sites=4, seed=0))
    x9, _ = next(workload.site_batches(site=1, num_sites=9, seed=0))
    assert torch.equal(x4, x9)


def test_eval_fixed_and_restores_mode() -> None:
    workload = MLPWorkload()
    model = workload.build_model(seed=0)
    loss = workload.eval_loss(model)
    assert model.training
    assert MLPWorkload().eval_loss(MLPWorkload().build_model(seed=0)) == loss
    assert torch.equal(workload.eval_inputs, MLPWorkload().eval_inputs)
    assert workload.eval_inputs.shape == (1024, 16)
    # All classes occur in the held-out set, so accuracy measures the whole task.
    assert torch.bincount(workload.eval_labels, minlength=4).min() > 0


def test_sgd_steps_reduce_loss_and_learn_the_teacher() -> None:
    workload = MLPWorkload()
    model = workload.build_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = workload.site_batches(site=0, num_sites=1, seed=0)
    fixed = next(batches)
    initial_fixed = workload.loss(model, fixed).item()
    initial_eval = workload.eval_loss(model)
    for batch in itertools.islice(batches, 200):
        optimizer.zero_grad()
        workload.loss(model, batch).backward()
        optimizer.step()
    assert workload.loss(model, fixed).item() < initial_fixed * 0.7
    plain = MLPWorkload(MLPWorkloadConfig(site_shift=0.0))
    iid_model = plain.build_model(seed=0)
    optimizer = torch.optim.AdamW(iid_model.parameters(), lr=1e-2)
    for batch in itertools.islice(plain.site_batches(site=0, num_sites=1, seed=0), 300):
        optimizer.zero_grad()
        plain.loss(iid_model, batch).backward()
        optimizer.step()
    assert plain.eval_loss(iid_model) < initial_eval * 0.5
    assert eval_accuracy(plain, iid_model) > 0.8


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_classes": 1}, "num_classes must be >= 2"),
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"site_shift": -1.0}, "site_shift must be >= 0"),
    ],
)
def test_config_validation(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MLPWorkloadConfig(**options)


def test_bad_site_rejected() -> None:
    with pytest.raises(ValueError, match=r"site must be in \[0, 2\)"):
        MLPWorkload().site_batches(site=-1, num_sites=2, seed=0)

"""Flat weight vectors, their layout, digests and derived seeds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from geoloco.algorithms.params import (
    ParamLayout,
    derive_seed,
    flatten_params,
    load_flat_,
    weights_digest,
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))


def test_layout_names_shapes_offsets_and_roundtrip() -> None:
    model = _model()
    layout = ParamLayout.from_model(model)
    assert [e.name for e in layout.entries] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert [e.shape for e in layout.entries] == [(5, 3), (5,), (2, 5), (2,)]
    assert [e.offset for e in layout.entries] == [0, 15, 20, 30]
    assert layout.numel == 32
    flat = flatten_params(model)
    assert flat.dtype == torch.float32 and flat.shape == (32,)
    assert torch.equal(flat[15:20], model[0].bias.detach())
    views = layout.split(flat)
    assert torch.equal(views["2.weight"], model[2].weight.detach())
    assert ParamLayout.from_dict(layout.to_dict()) == layout

    new = torch.arange(32, dtype=torch.float32)
    load_flat_(model, new)
    assert torch.equal(model[2].bias.detach(), torch.tensor([30.0, 31.0]))
    assert torch.equal(flatten_params(model), new)


def test_flat_vector_is_a_copy_not_a_view() -> None:
    model = _model()
    flat = flatten_params(model)
    flat.zero_()
    assert model[0].weight.abs().sum() > 0


def test_layout_rejects_wrong_length_and_other_model() -> None:
    model = _model()
    layout = ParamLayout.from_model(model)
    with pytest.raises(ValueError, match="1-D vector of 32 elements"):
        layout.load_(model, torch.zeros(31))
    with pytest.raises(ValueError, match="does not match layout entry"):
        layout.flatten(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)))


def test_grads_roundtrip() -> None:
    model = _model()
    layout = ParamLayout.from_model(model)
    g = torch.randn(layout.numel)
    for entry, param in zip(layout.entries, model.parameters(), strict=True):
        param.grad = g[entry.offset : entry.offset + entry.numel].view(entry.shape).clone()
    assert torch.equal(layout.flatten_grads(model), g)


def test_digest_is_sensitive_to_one_bit_and_stable() -> None:
    flat = torch.linspace(-1, 1, 1000)
    d1 = weights_digest(flat)
    assert d1 == weights_digest(flat.clone())
    assert len(d1) == 64
    bumped = flat.clone()
    bumped[500] = torch.nextafter(bumped[500], torch.tensor(2.0))
    assert weights_digest(bumped) != d1
    with pytest.raises(ValueError, match="fp32"):
        weights_digest(flat.double())


def test_derive_seed_differs_by_part_and_is_stable() -> None:
    assert derive_seed(0, "uplink", 1, 2) == derive_seed(0, "uplink", 1, 2)
    seeds = {derive_seed(0, "uplink", r, k) for r in range(20) for k in range(20)}
    assert len(seeds) == 400
    assert all(0 <= s < 2**63 for s in seeds)

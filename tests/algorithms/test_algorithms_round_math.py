"""The round's pure math: pseudo-gradients, error feedback, streaming aggregation, downlink."""

from __future__ import annotations

import pytest
import torch

from geoloco.algorithms.aggregation import RunningSum
from geoloco.algorithms.diloco import (
    UpdateEncoder,
    apply_downlink,
    encode_downlink,
    pseudo_gradient,
    rebase_local,
    run_inner_steps,
)
from geoloco.algorithms.optimizers import OuterOptimizer, OuterOptimizerConfig
from geoloco.algorithms.params import ParamLayout, weights_digest
from geoloco.compression import Encoded, decode, parse_codec


def test_pseudo_gradient_is_global_minus_local() -> None:
    g = pseudo_gradient(torch.tensor([1.0, 2.0]), torch.tensor([0.5, 3.0]))
    assert torch.equal(g, torch.tensor([0.5, -1.0]))
    with pytest.raises(ValueError, match="differ in shape"):
        pseudo_gradient(torch.zeros(2), torch.zeros(3))


def test_rebase_moves_the_local_model_by_the_merge_and_keeps_its_own_progress() -> None:
    """After ``rebase_local`` the pseudo-gradient from the new global model is the progress
    the local model had made from the old one (to rounding)."""
    torch.manual_seed(0)
    old, new = torch.randn(100), torch.randn(100)
    local = old - 0.01 * torch.randn(100)
    progress = pseudo_gradient(old, local)
    expected = local + (new - old)
    storage = local.data_ptr()
    rebase_local(local, old, new)
    assert local.data_ptr() == storage and torch.equal(local, expected)
    assert torch.allclose(pseudo_gradient(new, local), progress, atol=1e-6)


def test_streaming_aggregator_equals_batch_weighted_mean() -> None:
    torch.manual_seed(0)
    updates = [torch.randn(1000) for _ in range(7)]
    weights = [1.0, 2.0, 0.5, 3.0, 1.0, 4.0, 2.5]
    agg = RunningSum(numel=1000)
    for k, (u, w) in enumerate(zip(updates, weights)):
        agg.add(u, w, site=k)
    stacked = torch.stack(updates).double()
    w = torch.tensor(weights, dtype=torch.float64)
    expected = (stacked * w[:, None]).sum(0) / w.sum()
    # Sequential fp32 accumulation vs a float64 reference: a few ulps apart, not more.
    torch.testing.assert_close(agg.result().double(), expected, rtol=1e-6, atol=1e-6)
    assert agg.count == 7 and agg.total_weight == sum(weights) and agg.sites == list(range(7))


def test_uniform_mean_of_encoded_uploads_and_duplicate_rejected() -> None:
    codec = parse_codec("none")
    agg = RunningSum(numel=3)
    agg.add(codec.encode(torch.tensor([1.0, 2.0, 3.0])), site=0)
    agg.add(codec.encode(torch.tensor([3.0, 2.0, 1.0])), site=1)
    assert torch.equal(agg.result(), torch.tensor([2.0, 2.0, 2.0]))
    with pytest.raises(ValueError, match="already aggregated"):
        agg.add(torch.zeros(3), site=1)
    with pytest.raises(ValueError, match="sent 2 values; the model has 3"):
        agg.add(torch.zeros(2), site=2)
    with pytest.raises(ValueError, match="nothing"):
        RunningSum(numel=3).result()


def test_samples_weighting_favours_the_bigger_site() -> None:
    agg = RunningSum(numel=1)
    agg.add(torch.tensor([0.0]), 100.0, site=0)
    agg.add(torch.tensor([4.0]), 300.0, site=1)
    assert agg.result().item() == 3.0


def test_error_feedback_residual_is_what_the_codec_lost() -> None:
    torch.manual_seed(1)
    enc = UpdateEncoder("int8", error_feedback=True)
    x1, x2 = torch.randn(512), torch.randn(512)
    c1 = enc.encode(x1, seed=1)
    torch.testing.assert_close(enc.residual, x1 - decode(c1), rtol=0, atol=1e-6)
    assert enc.residual.abs().max() > 0
    e1 = enc.residual.clone()
    c2 = enc.encode(x2, seed=2)
    torch.testing.assert_close(enc.residual, (x2 + e1) - decode(c2), rtol=0, atol=1e-6)
    # Over two rounds, sent + residual == everything that was meant to be sent.
    torch.testing.assert_close(decode(c1) + decode(c2) + enc.residual, x1 + x2, rtol=0, atol=1e-5)


def test_no_error_feedback_for_lossless_codec() -> None:
    enc = UpdateEncoder("none", error_feedback=True)
    assert enc.error_feedback is None
    x = torch.randn(10)
    assert torch.equal(decode(enc.encode(x, seed=0)), x)


def test_restore_keeps_a_dropped_upload_in_the_residual() -> None:
    torch.manual_seed(2)
    enc = UpdateEncoder("topk:0.1|int8", error_feedback=True)
    enc.encode(torch.randn(1000), seed=0)
    e0 = enc.residual.clone()
    g = torch.randn(1000)
    dropped = enc.encode(g, seed=1)
    enc.restore(dropped)
    torch.testing.assert_close(enc.residual, g + e0, rtol=0, atol=1e-5)


def test_downlink_error_feedback_keeps_replicas_identical() -> None:
    """Coordinator θ_{t+1} = θ_t + D(d_t) exactly; a site applying the received bytes agrees bit for bit."""
    torch.manual_seed(3)
    outer = OuterOptimizer(OuterOptimizerConfig(name="nesterov"), 4096)
    down = UpdateEncoder("topk:0.05|int4", error_feedback=True)
    coordinator = torch.randn(4096)
    site = coordinator.clone()
    for t in range(4):
        e_before = down.residual.clone() if down.residual is not None else torch.zeros(4096)
        theta_prime = outer.step(coordinator, torch.randn(4096) * 0.01)
        encoded, new_coordinator = encode_downlink(down, coordinator, theta_prime, seed=t)
        assert torch.equal(new_coordinator, coordinator + decode(encoded))
        # e_down holds exactly what this broadcast left out of θ' − θ_t + e_down.
        torch.testing.assert_close(
            down.residual, theta_prime - coordinator + e_before - decode(encoded), rtol=0, atol=1e-6
        )
        wire = Encoded.from_bytes(encoded.to_bytes())
        site = apply_downlink(site, wire)
        coordinator = new_coordinator
        assert weights_digest(site) == weights_digest(coordinator)
    assert not torch.allclose(down.residual, torch.zeros(4096)), "the codec must have been lossy"


def test_run_inner_steps_reports_losses_and_samples(make_workload) -> None:
    workload = make_workload()
    model = workload.build_model(0)
    layout = ParamLayout.from_model(model)
    before = layout.flatten(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    result = run_inner_steps(model, opt, workload.site_batches(0, 2, 0), 20, workload.loss)
    assert len(result.losses) == 20 and result.samples == 20 * workload.batch
    assert result.losses[-1] < result.losses[0]
    assert not torch.equal(layout.flatten(model), before)


def test_restoring_an_update_after_the_residual_was_reset_drops_it() -> None:
    """An update encoded, then a later one refused or not finite (the site resets the
    fragment's encoder), then the first one's round aborts: there is no residual left to put it
    back into, and the reset dropped what was pending, so it is dropped too. It used to raise
    and stop the site (or the simulator) instead."""
    first = UpdateEncoder("int8")
    encoded = first.encode(torch.ones(64), seed=0)
    fresh = UpdateEncoder("int8")  # what the reset installs
    fresh.restore(encoded)
    assert fresh.residual is None
    first.restore(encoded)
    assert first.residual is not None and torch.allclose(first.residual, torch.ones(64))

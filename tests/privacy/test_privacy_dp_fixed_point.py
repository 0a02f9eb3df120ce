"""Fixed-point headroom, DP noise and accounting, composition rules, and the private round's accuracy."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import torch
from _privacy_helpers import identity_keys
from dp_accounting.rdp import rdp_privacy_accountant

from geoloco.algorithms.config import ConfigError, config_from_dict
from geoloco.algorithms.fixed_point import clip_l2, lift, pack, plan_fixed_point, stochastic_round, unpack
from geoloco.algorithms.privacy.private_aggregation import (
    PrivacyAccountant,
    PrivacyConfig,
    PrivateUpdateEncoder,
    add_central_noise,
    check_composition,
    effective_noise_multiplier,
    plan_secure_round,
    private_round_in_memory,
    skellam_noise,
)
from geoloco.algorithms.privacy.secagg_messages import SecAggAbort


def test_headroom_keeps_the_worst_case_sum_from_wrapping() -> None:
    n, clip = 7, 3.0
    fixed = plan_fixed_point(clip, n, modulus_bits=16)
    # Every site at +clip (or -clip) on one coordinate, rounded up: the extreme sums.
    for sign in (1, -1):
        ints = [fixed.quantize(torch.tensor([sign * clip, 0.0])) for _ in range(n)]
        total = sum(int(i[0]) for i in ints)
        wrapped = np.array([total & 0xFFFF], dtype="<u2")
        assert int(lift(wrapped, 16)[0]) == total
        assert abs(total) < 1 << 15


def test_too_coarse_encoding_is_refused_with_advice() -> None:
    with pytest.raises(ValueError, match="use modulus_bits=32"):
        plan_fixed_point(1.0, 200, modulus_bits=8)


def test_stochastic_rounding_is_unbiased() -> None:
    x = torch.full((200_000,), 0.3)
    rounded = stochastic_round(x, torch.Generator().manual_seed(0)).double()
    assert set(rounded.unique().tolist()) == {0.0, 1.0}
    assert abs(rounded.mean().item() - 0.3) < 0.005


def test_pack_uses_the_modulus_width() -> None:
    ints = np.array([-1, 0, 1, 70000], dtype=np.int64)
    data = pack(ints, 32)
    assert len(data) == 16
    assert unpack(data, 32).tolist() == [2**32 - 1, 0, 1, 70000]
    assert len(pack(ints, 16)) == 8


def test_clip_l2() -> None:
    clipped, norm = clip_l2(torch.tensor([3.0, 4.0]), 1.0)
    assert norm == pytest.approx(5.0)
    assert torch.allclose(clipped, torch.tensor([0.6, 0.8]))


def test_skellam_noise_is_accurate_at_the_largest_planned_variance() -> None:
    from geoloco.algorithms.privacy.private_aggregation import MAX_NOISE_STD_UNITS

    variance = MAX_NOISE_STD_UNITS**2 / 2  # per site with t = 2, the largest the planner allows
    noise = skellam_noise(400_000, variance, np.random.default_rng(2)).double()
    assert noise.var().item() == pytest.approx(variance, rel=0.015)


def test_skellam_noise_has_the_requested_variance() -> None:
    noise = skellam_noise(200_000, 400.0, np.random.default_rng(1))
    assert noise.dtype == torch.int64
    assert abs(noise.double().mean().item()) < 0.2
    assert noise.double().var().item() == pytest.approx(400.0, rel=0.03)


def test_central_noise_std() -> None:
    privacy = PrivacyConfig(dp="central", clip_norm=2.0, noise_multiplier=1.5)
    noised = add_central_noise(torch.zeros(100_000), privacy, torch.Generator().manual_seed(0))
    assert noised.std().item() == pytest.approx(3.0, rel=0.02)


def test_accountant_matches_dp_accounting_and_grows() -> None:
    accountant = PrivacyAccountant(delta=1e-5)
    assert accountant.epsilon() == 0.0
    eps = [accountant.step(1.1) for _ in range(5)]
    assert all(a < b for a, b in zip(eps, eps[1:]))
    reference = rdp_privacy_accountant.RdpAccountant()
    reference.compose(dp_accounting.GaussianDpEvent(1.1), 5)
    assert eps[-1] == pytest.approx(reference.get_epsilon(1e-5), rel=1e-9)
    assert accountant.epsilon_after(1.1) > eps[-1]
    assert accountant.allows(1.1, None)
    assert accountant.allows(1.1, accountant.epsilon_after(1.1))
    assert not accountant.allows(1.1, eps[-1])
    restored = PrivacyAccountant(delta=0.5)
    restored.load_state(accountant.state())
    assert restored.epsilon() == pytest.approx(eps[-1])


def test_effective_noise_multiplier_accounts_for_rounding() -> None:
    privacy = PrivacyConfig(secure_aggregation=True, dp="distributed", clip_norm=1.0, noise_multiplier=1.0)
    _, fixed = plan_secure_round(privacy, "none", numel=10_000, num_sites=4, session="s", round_index=0)
    z = effective_noise_multiplier(privacy, fixed, 10_000)
    assert 0.99 < z < 1.0


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"secure_aggregation": True}, "clip_norm"),
        ({"dp": "distributed", "clip_norm": 1.0}, "secure_aggregation"),
        ({"dp": "gaussian", "clip_norm": 1.0}, "allowed values"),
        ({"secure_aggregation": True, "clip_norm": 1.0, "threshold": 1}, "threshold"),
        ({"secure_aggregation": True, "clip_norm": 1.0, "colour": 1}, "unknown key"),
    ],
)
def test_bad_privacy_configs_are_named(data: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        config_from_dict(PrivacyConfig, data, prefix="privacy")


def test_topk_with_secure_aggregation_says_use_randk() -> None:
    privacy = PrivacyConfig(secure_aggregation=True, clip_norm=1.0)
    with pytest.raises(ValueError, match="cannot be combined with secure aggregation.*randk"):
        check_composition(privacy, "topk:0.01", 4)
    with pytest.raises(ValueError, match="fixed-point"):
        check_composition(privacy, "int8", 4)
    check_composition(privacy, "randk:0.1", 4)
    check_composition(PrivacyConfig(), "topk:0.01", 2)  # no secure aggregation: anything goes


def test_two_sites_with_secure_aggregation_is_an_error() -> None:
    privacy = PrivacyConfig(secure_aggregation=True, clip_norm=1.0)
    with pytest.raises(ValueError, match="at least 3 sites.*reveals"):
        check_composition(privacy, "none", 2)


def _updates(n: int, numel: int, seed: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {s: 0.01 * torch.randn(numel, generator=g) for s in range(n)}


@pytest.mark.parametrize("codec", ["none", "randk:0.25"])
def test_secure_mean_matches_plain_mean_within_the_rounding_bound(codec: str) -> None:
    n, numel = 5, 4000
    privacy = PrivacyConfig(secure_aggregation=True, clip_norm=10.0, chunk_size=1000)
    updates = _updates(n, numel, 0)
    encoders = {s: PrivateUpdateEncoder(privacy, codec) for s in range(n)}
    mean, survivors = private_round_in_memory(
        privacy, codec, updates, encoders, identity_keys(n),
        session="s", round_index=1, index_seed=77, drop_after_upload=(4,),
    )
    assert survivors == tuple(range(n))  # site 4 uploaded, then vanished: still in the sum
    plain = sum(updates.values()) / n
    _, fixed = plan_secure_round(privacy, codec, numel=numel, num_sites=n, session="s", round_index=1)
    sent = mean != 0
    if codec == "none":
        assert sent.all()
    else:
        assert sent.sum() == 1000
    # Per-value error of the mean: < 1/scale (rounding of one value is < 1 unit).
    assert (mean[sent] - plain[sent]).abs().max().item() <= 1.0 / fixed.scale
    # Error feedback: residual + what was sent = the update.
    for s in range(n):
        assert torch.allclose(encoders[s].residual + (updates[s] - encoders[s].residual), updates[s])
        assert encoders[s].residual.abs().max().item() < (0.02 if codec == "none" else 1.0)


def test_distributed_noise_in_the_sum_has_the_full_variance() -> None:
    n, numel, clip, z = 4, 20_000, 1.0, 0.5
    privacy = PrivacyConfig(secure_aggregation=True, dp="distributed", clip_norm=clip, noise_multiplier=z,
                            chunk_size=5000)
    zeros = {s: torch.zeros(numel) for s in range(n)}
    encoders = {s: PrivateUpdateEncoder(privacy, "none") for s in range(n)}
    mean, survivors = private_round_in_memory(
        privacy, "none", zeros, encoders, identity_keys(n), session="s", round_index=0, index_seed=0
    )
    t = math.ceil(2 * n / 3)
    expected_sum_std = z * clip * math.sqrt(n / t)  # each site carries sigma^2 / t
    assert (mean * n).std().item() == pytest.approx(expected_sum_std, rel=0.03)


def test_below_threshold_private_round_aborts() -> None:
    privacy = PrivacyConfig(secure_aggregation=True, clip_norm=1.0, threshold=4)
    encoders = {s: PrivateUpdateEncoder(privacy, "none") for s in range(4)}
    with pytest.raises(SecAggAbort):
        private_round_in_memory(
            privacy, "none", _updates(4, 100, 1), encoders, identity_keys(4),
            session="s", round_index=0, index_seed=0, drop_after_upload=(3,),
        )


@pytest.mark.parametrize("codec", ["none", "randk:0.25"])
def test_private_encoder_restore_and_keep_put_the_update_back(codec: str) -> None:
    """An update the secure sum did not include returns whole into the residual (``restore``
    after ``encode``; ``keep`` when it never reached ``encode``), as a plain straggler does."""
    from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig, PrivateUpdateEncoder, plan_secure_round

    privacy = PrivacyConfig(secure_aggregation=True, clip_norm=0.5)
    g = torch.Generator().manual_seed(0)
    first, second = torch.randn(64, generator=g), torch.randn(64, generator=g)
    context, fixed = plan_secure_round(privacy, codec, numel=64, num_sites=3, session="s", round_index=1)
    encoder = PrivateUpdateEncoder(privacy, codec)
    list(encoder.encode(first, fixed, context, index_seed=7, num_sites=3))
    kept = encoder.residual.clone()  # type: ignore[union-attr]
    # Clipping (norm ~8 to 0.5) kept most of ``first``; what was sent is not in the residual.
    assert float((kept - first).norm()) > 0.4
    list(encoder.encode(second, fixed, context, index_seed=8, num_sites=3))
    encoder.restore()
    assert torch.allclose(encoder.residual, second + kept, atol=1e-6)  # type: ignore[arg-type]
    encoder.restore()  # a second restore has nothing left to put back
    assert torch.allclose(encoder.residual, second + kept, atol=1e-6)  # type: ignore[arg-type]
    encoder.keep(first)
    assert torch.allclose(encoder.residual, second + kept + first, atol=1e-6)  # type: ignore[arg-type]

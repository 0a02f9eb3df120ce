"""A DiLoCo run with secure aggregation reaches the eval loss of the plain run (fixed-point error only)."""

from __future__ import annotations

import torch
from _privacy_helpers import identity_keys

from geoloco.algorithms.diloco import pseudo_gradient, run_inner_steps
from geoloco.algorithms.optimizers import InnerOptimizerConfig, OuterOptimizer, OuterOptimizerConfig
from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.privacy.private_aggregation import (
    PrivacyConfig,
    PrivateUpdateEncoder,
    plan_secure_round,
    private_round_in_memory,
)
from geoloco.scenarios.workloads.mlp import MLPWorkload

SITES, ROUNDS, INNER = 4, 4, 6


def _run(privacy: PrivacyConfig | None) -> tuple[float, float]:
    torch.manual_seed(0)
    workload = MLPWorkload()
    model = workload.build_model(0)
    layout = ParamLayout.from_model(model)
    global_flat = layout.flatten(model)
    initial = workload.eval_loss(model)
    outer = OuterOptimizer(OuterOptimizerConfig().resolved("nesterov"), layout.numel)
    optimizers = [InnerOptimizerConfig().build(model.parameters()) for _ in range(SITES)]
    batches = [workload.site_batches(k, SITES, 0) for k in range(SITES)]
    encoders = {k: PrivateUpdateEncoder(privacy, "none") for k in range(SITES)} if privacy else {}
    keys = identity_keys(SITES)
    for round_index in range(1, ROUNDS + 1):
        updates = {}
        for k in range(SITES):
            layout.load_(model, global_flat)
            run_inner_steps(model, optimizers[k], batches[k], INNER, workload.loss)
            updates[k] = pseudo_gradient(global_flat, layout.flatten(model))
        if privacy is None:
            mean = sum(updates.values()) / SITES
        else:
            mean, _ = private_round_in_memory(
                privacy, "none", updates, encoders, keys,
                session="diloco", round_index=round_index, index_seed=round_index,
                drop_after_upload=(3,) if round_index == 2 else (),
            )
        global_flat = outer.step(global_flat, mean)
    layout.load_(model, global_flat)
    return initial, workload.eval_loss(model)


def test_secure_diloco_matches_plain_diloco() -> None:
    privacy = PrivacyConfig(secure_aggregation=True, clip_norm=100.0, chunk_size=512)
    initial, plain = _run(None)
    _, secure = _run(privacy)
    assert plain < initial - 0.1  # it trains
    # The only difference is stochastic rounding: < 1 unit of 1/scale per value per round.
    _, fixed = plan_secure_round(privacy, "none", numel=1, num_sites=SITES, session="s", round_index=0)
    assert 1 / fixed.scale < 1e-6
    assert abs(secure - plain) < 1e-4, (plain, secure)

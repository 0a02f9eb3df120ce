"""The coordinator's privacy layer (coordinator.privacy_rounds) closing a round without a socket."""

from __future__ import annotations

import torch

from geoloco.algorithms.aggregation import CentralDPSum, new_aggregation
from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
from geoloco.algorithms.strategy import AlgorithmConfig, build_strategy
from geoloco.coordinator.privacy_rounds import PrivateRounds

NUMEL = 32


def test_a_central_dp_round_reports_the_names_of_the_sites_it_aggregated() -> None:
    # The outer step's RoundUpdate once carried (0, 1, ...) instead of the sites' names.
    privacy = PrivacyConfig(dp="central", clip_norm=1.0, noise_multiplier=0.5)
    rounds = PrivateRounds(privacy, "none", numel=NUMEL, session="s", stage_timeout_s=1.0)
    strategy = build_strategy(AlgorithmConfig(inner_steps=1), numel=NUMEL)
    contributors = ["beta", "alpha"]
    plan = strategy.configure_round(0, contributors)
    aggregation = new_aggregation(NUMEL, central_dp=privacy.unmasked_central_dp)
    for site in contributors:
        aggregation.add(torch.randn(NUMEL) * 10, site=site)

    update, counted, norm, info = rounds.finish_round(
        strategy, torch.zeros(NUMEL), aggregation, plan, contributors
    )

    assert isinstance(aggregation, CentralDPSum)
    assert all(n > 1.0 for n in aggregation.norms.values()), "updates above clip_norm were clipped"
    assert update.sites == ("beta", "alpha")
    assert counted == contributors
    assert norm > 0 and info["dp"] == "central" and info["epsilon"] > 0

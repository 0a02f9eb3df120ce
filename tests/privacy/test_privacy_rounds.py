"""The coordinator's privacy layer (coordinator.privacy_rounds) closing a round without a socket."""

from __future__ import annotations

import grpc
import pytest
import torch

from geoloco.algorithms.aggregation import CentralDPSum, new_aggregation
from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
from geoloco.algorithms.privacy.secagg_stages import (
    STAGE_ADVERTISE_KEYS,
    STAGE_CONSISTENCY,
    STAGE_UNMASK,
    STAGE_UNMASK_RESPONSE,
)
from geoloco.algorithms.strategy import AlgorithmConfig, build_strategy
from geoloco.coordinator.events import REQUEST_REJECTED, EventHub, RejectedRequestInterceptor
from geoloco.coordinator.privacy_rounds import PrivateRounds
from geoloco.protos.errors import LateStageAnswerError, WrongRoundError

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


def test_a_late_answer_after_the_upload_is_not_a_refused_input_but_a_late_key_stage_is() -> None:
    """The slowest sites' unmask answers arrive after their round finished without them: the
    usual case, answered as too late (FAILED_PRECONDITION, WRONG_ROUND, as before) but not
    counted as a rejected request. A key stage of a past round is a replay, and still is."""
    rounds = PrivateRounds(
        PrivacyConfig(secure_aggregation=True, clip_norm=1.0), "none", numel=NUMEL, session="s", stage_timeout_s=1.0
    )
    rounds.start_round(0, 11, 0.0)
    rounds.start_round(1, 12, 1.0)  # round 0 is over
    for stage in (STAGE_CONSISTENCY, STAGE_UNMASK, STAGE_UNMASK_RESPONSE):
        with pytest.raises(LateStageAnswerError, match="came after the round finished") as late:
            rounds.stage("a", 0, stage, None, {"a"}, 2.0)
        assert isinstance(late.value, WrongRoundError) and not late.value.refuses_input
    with pytest.raises(WrongRoundError, match="a replay or a late call is refused") as replay:
        rounds.stage("a", 0, STAGE_ADVERTISE_KEYS, None, {"a"}, 2.0)
    assert replay.value.refuses_input

    # The interceptor counts the replay, not the late answer.
    hub = EventHub()
    seen: list[str] = []
    hub.add_listener(lambda event: seen.append(event.kind))
    interceptor = RejectedRequestInterceptor(hub)
    for error in (late.value, replay.value):
        def refuse(request: object, context: object, error: Exception = error) -> None:
            raise error

        handler = interceptor.wrap(grpc.unary_unary_rpc_method_handler(refuse), "/geoloco.v1.Coordinator/SecureStage")
        with pytest.raises(WrongRoundError):
            handler.unary_unary(None, None)
    assert seen == [REQUEST_REJECTED]

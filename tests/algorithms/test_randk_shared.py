"""``randk:F`` (per-site coordinates) and ``randk:F,shared`` (the round's shared seed): one name
per estimator, and the seed every caller derives from it."""

from __future__ import annotations

import pytest
import torch

from geoloco.algorithms.algorithm_config import AlgorithmConfig
from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig, check_composition, secure_index_seed
from geoloco.algorithms.strategy import build_strategy, uplink_seed
from geoloco.compression import decode, parse_codec


def test_shared_is_a_flag_of_randk_and_part_of_the_canonical_spec() -> None:
    shared = parse_codec("randk:0.25,shared|int8")
    assert shared.spec == "randk:0.25,shared|int8:block=256"
    assert shared.shared_coordinates
    assert not parse_codec("randk:0.25|int8").shared_coordinates
    assert not parse_codec("topk:0.25").shared_coordinates
    assert parse_codec("randk:0.25,unbiased,shared").spec == "randk:0.25,unbiased,shared|none"
    # Same bytes on the wire: only the seed travels either way.
    assert shared.encoded_nbytes((1000,)) - parse_codec("randk:0.25|int8").encoded_nbytes((1000,)) == len(",shared")


def test_uplink_seed_is_per_site_by_default_and_the_round_seed_when_shared() -> None:
    per_site = {uplink_seed(11, site, "randk:0.1") for site in ("a", "b", "c")}
    assert len(per_site) == 3
    shared = {uplink_seed(11, site, "randk:0.1,shared") for site in ("a", "b", "c")}
    assert shared == {secure_index_seed(11)}
    assert uplink_seed(12, "a", "randk:0.1,shared") != uplink_seed(11, "a", "randk:0.1,shared")


def _kept_coordinates(codec: str) -> list[set[int]]:
    strategy = build_strategy(AlgorithmConfig(uplink_codec=codec, error_feedback=False), numel=400, seed=5)
    plan = strategy.configure_round(2, ["0", "1", "2"])
    kept = []
    for k, site in enumerate(plan.sites):
        update = torch.randn(400, generator=torch.Generator().manual_seed(k)) + 3.0  # no zeros
        encoded = strategy.build_uplink().encode(update, seed=plan.uplink_seed(site), fragment=0)
        kept.append(set(decode(encoded).nonzero().flatten().tolist()))
    return kept


def test_plain_round_randk_keeps_per_site_coordinates_and_shared_keeps_one_set() -> None:
    per_site = _kept_coordinates("randk:0.1")
    assert all(len(c) == 40 for c in per_site)
    assert per_site[0] != per_site[1] and per_site[1] != per_site[2]
    shared = _kept_coordinates("randk:0.1,shared")
    assert shared[0] == shared[1] == shared[2] and len(shared[0]) == 40


def test_private_round_reads_randk_as_shared_and_says_so_for_other_sparsifiers() -> None:
    privacy = PrivacyConfig(secure_aggregation=True, clip_norm=1.0)
    check_composition(privacy, "randk:0.1", 4)
    check_composition(privacy, "randk:0.1,shared", 4)
    with pytest.raises(ConfigError, match="randk:F,shared"):
        check_composition(privacy, "topk:0.1", 4)


@pytest.mark.parametrize("codec", ["randk:0.1", "randk:0.1,shared"])
def test_site_agent_encodes_with_the_simulators_seed(codec: str) -> None:
    from geoloco.site_agent.uplink import StrategyUplink

    strategy = build_strategy(AlgorithmConfig(uplink_codec=codec, error_feedback=False), numel=400, seed=5)
    plan = strategy.configure_round(3, ["dc-east", "dc-west"])
    update = torch.randn(400, generator=torch.Generator().manual_seed(0))
    for site in plan.sites:
        sent = StrategyUplink(strategy, site).encode(update, round_seed=plan.seed, fragment=0, samples=1)
        reference = strategy.build_uplink().encode(update, seed=plan.uplink_seed(site), fragment=0)
        assert sent.data == reference.to_bytes()
    east, west = (decode(StrategyUplink(strategy, s).encode(update, round_seed=plan.seed, fragment=0, samples=1).data)
                  for s in plan.sites)
    assert torch.equal(east.nonzero(), west.nonzero()) == codec.endswith("shared")


def test_a_secure_round_takes_randk_shared_and_sends_what_randk_sends(make_workload) -> None:
    from geoloco.algorithms.simulation.simulator import SimulatorConfig, simulate

    def run(codec: str) -> list[dict[str, int]]:
        config = SimulatorConfig.from_dict({
            "algorithm": {"inner_steps": 2, "uplink_codec": codec},
            "privacy": {"secure_aggregation": True, "clip_norm": 10.0},
            "sites": {"count": 3},
            "simulation": {"rounds": 2, "eval_every": 2, "device": "cpu", "step_time_s": 0.1},
        })
        return [dict(r.bytes_up) for r in simulate(config, make_workload(hidden=8))]

    assert run("randk:0.5,shared") == run("randk:0.5")

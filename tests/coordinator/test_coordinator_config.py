"""CoordinatorConfig: one validation place, errors that name the key and what is allowed."""

from __future__ import annotations

import pytest

from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.config import CoordinatorConfig


def test_file_shaped_dict_round_trips() -> None:
    config = CoordinatorConfig.from_dict(
        {
            "algorithm": {"name": "diloco", "inner_steps": 20, "uplink_codec": "topk:0.01|int4"},
            "outer_optimizer": {"lr": 0.5},
            "min_sites": 2,
            "round_deadline_s": 30,
            "insecure": True,
            "allowed_sites": ["dc-east", "dc-west"],
        }
    )
    assert config.algorithm.inner_steps == 20 and config.round_deadline_s == 30.0
    assert CoordinatorConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("data", "key", "hint"),
    [
        ({"insecure": True, "min_sites": 0}, "min_sites", ">= 1"),
        ({"insecure": True, "colour": "red"}, "colour", "allowed keys"),
        ({}, "certs_dir", "insecure = true"),
        ({"insecure": True, "certs_dir": "certs"}, "insecure", "mutually exclusive"),
        ({"insecure": True, "algorithm": {"name": "ddp"}}, "algorithm.name", "simulator"),
        ({"insecure": True, "algorithm": {"uplink_codec": "int3"}}, "algorithm.uplink_codec", "int8"),
        ({"insecure": True, "heartbeat_interval_s": 5, "heartbeat_timeout_s": 6}, "heartbeat_timeout_s", "twice"),
        ({"insecure": True, "allowed_sites": ["ok", "not ok"]}, "allowed_sites[1]", "letters"),
        ({"insecure": True, "allowed_sites": ["a"], "min_sites": 2}, "min_sites", "allowed_sites"),
        ({"insecure": True, "chunk_size": 0}, "chunk_size", "bytes"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(data: dict, key: str, hint: str) -> None:
    with pytest.raises(ConfigError) as info:
        CoordinatorConfig.from_dict(data)
    assert info.value.key == key
    assert hint in info.value.message


def test_configs_built_in_code_are_validated_too() -> None:
    with pytest.raises(ConfigError, match="warmup_steps"):
        CoordinatorConfig(insecure=True, algorithm=AlgorithmConfig(warmup_steps=10))

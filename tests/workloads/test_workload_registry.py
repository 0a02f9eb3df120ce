"""The workload registry: names, option mapping from TOML-like values, helpful errors."""

from __future__ import annotations

import dataclasses

import pytest

from geoloco.algorithms.workload import Workload
from geoloco.scenarios.workloads import (
    WORKLOADS,
    GPTWorkload,
    MLPWorkload,
    build_workload,
    workload_config,
)


def test_names_and_defaults() -> None:
    assert sorted(WORKLOADS) == ["gpt", "mlp"]
    for name in WORKLOADS:
        workload = build_workload(name)
        assert isinstance(workload, Workload)
        assert workload.name == name


def test_options_map_onto_config_fields() -> None:
    workload = build_workload("gpt", size="tiny", n_layer=3, seq_len=32, eval_fraction=0.1)
    assert isinstance(workload, GPTWorkload)
    assert workload.model_config.n_layer == 3
    assert workload.model_config.n_embd == 32  # from the preset
    assert workload.seq_len == 32
    assert dataclasses.asdict(workload.config)["eval_fraction"] == 0.1
    mlp = build_workload("mlp", site_shift=2, hidden_dim=8)  # an int is a fine float
    assert isinstance(mlp, MLPWorkload)
    assert mlp.config.site_shift == 2.0 and isinstance(mlp.config.site_shift, float)


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match=r"unknown workload 'bert'; valid workloads: \['gpt', 'mlp'\]"):
        build_workload("bert")


def test_unknown_option_lists_allowed_options() -> None:
    with pytest.raises(ValueError, match="unknown option 'layers' for workload 'gpt'") as error:
        build_workload("gpt", layers=4)
    message = str(error.value)
    for field in ("n_layer (int | None)", "size (str)", "eval_fraction (float)", "data_root (str)"):
        assert field in message


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("gpt", {"n_layer": "4"}, r"option 'n_layer' of workload 'gpt' must be int \| None, got str '4'"),
        ("gpt", {"batch_size": 2.5}, "option 'batch_size' of workload 'gpt' must be int, got float 2.5"),
        ("gpt", {"batch_size": True}, "must be int, got bool True"),
        ("gpt", {"size": 3}, "option 'size' of workload 'gpt' must be str, got int 3"),
        ("mlp", {"site_shift": "far"}, "option 'site_shift' of workload 'mlp' must be float"),
    ],
)
def test_wrong_types_are_named(name: str, options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_workload(name, **options)


def test_invalid_values_name_the_workload() -> None:
    with pytest.raises(ValueError, match=r"workload 'gpt': unknown GPT size 'xl'; valid sizes"):
        workload_config("gpt", size="xl")
    with pytest.raises(ValueError, match="workload 'mlp': num_classes must be >= 2"):
        build_workload("mlp", num_classes=1)

"""The coordinator's TensorBoard scalars (``tensorboard_dir``) after a real run over mutual TLS,
read back with TensorBoard's reader, equal the values of its metrics.jsonl."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from _agent_helpers import AgentThread, make_agent, make_certs, start_coordinator

from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.params import load_flat_
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.metrics import read_metrics
from geoloco.scenarios.workloads import build_workload

SITES = ["a", "b"]


def test_coordinator_tensorboard_scalars_equal_metrics_jsonl(
    require_extra: Callable[[str, str], ModuleType], tmp_path: Path
) -> None:
    require_extra("tensorboard", "tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    certs = make_certs(tmp_path / "certs", SITES)
    mlp = build_workload("mlp")

    def eval_fn(flat: torch.Tensor) -> float:
        model = mlp.build_model(0)
        load_flat_(model, flat)
        return float(mlp.eval_loss(model))

    metrics, board = tmp_path / "metrics.jsonl", tmp_path / "tb"
    server = start_coordinator(
        certs, mlp.build_model(0), algorithm=AlgorithmConfig(inner_steps=3, uplink_codec="int8"),
        total_rounds=2, min_sites=2, metrics_path=str(metrics), tensorboard_dir=str(board), eval_fn=eval_fn,
    )
    try:
        threads = [AgentThread(make_agent(mlp, server, certs, s, index=i, num_sites=2, seed=0))
                   for i, s in enumerate(SITES)]
        for t in threads:
            t.start()
        for t in threads:
            t.finish(120)
        assert server.wait_until_finished(30)
    finally:
        server.stop(grace=0)
    records = read_metrics(metrics)
    assert [r["round"] for r in records] == [0, 1]

    accumulator = EventAccumulator(str(board), size_guidance={"scalars": 0})
    accumulator.Reload()

    def series(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in accumulator.Scalars(tag)]

    def f32(value: Any) -> float:
        return float(np.float32(value))

    assert series("loss/eval") == [(r["round"], f32(r["eval_loss"])) for r in records]
    assert series("bytes/up_round") == [(r["round"], f32(sum(r["bytes_up"].values()))) for r in records]
    assert series("time/round_s") == [(r["round"], f32(r["round_time_s"])) for r in records]
    assert series("sites/participants") == [(r["round"], 2.0) for r in records]
    train = [[m["train_loss"] for m in r["site_metrics"].values()] for r in records]
    assert series("loss/train") == [(r["round"], f32(sum(t) / len(t))) for r, t in zip(records, train)]


def test_tensorboard_dir_needs_a_metrics_file() -> None:
    with pytest.raises(ConfigError) as info:
        CoordinatorConfig(insecure=True, tensorboard_dir="tb")
    assert info.value.key == "tensorboard_dir" and "metrics_path" in str(info.value)

"""The site agent's inner lr schedule: a site joining at round r resumes it at step r × H."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _agent_helpers import AgentThread, make_agent, make_certs, start_coordinator, wait_until

from geoloco.algorithms.lr_schedule import lr_multiplier
from geoloco.algorithms.optimizers import InnerOptimizerConfig
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.protos.transport_tls import TLSFiles
from geoloco.scenarios.site_cmd import SiteCommandError, _build_lr_schedule
from geoloco.scenarios.workloads import build_workload
from geoloco.site_agent.agent import SiteAgent
from geoloco.site_agent.config import SiteAgentConfig


def test_a_site_joining_at_round_two_resumes_the_schedule_at_two_h(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs", ["early", "late"])
    mlp = build_workload("mlp")
    inner_steps, total_rounds = 3, 4
    server = start_coordinator(
        certs, mlp.build_model(0), algorithm=AlgorithmConfig(inner_steps=inner_steps),
        total_rounds=total_rounds, min_sites=1, heartbeat_timeout_s=600.0,
    )
    inner = InnerOptimizerConfig(lr=0.01, schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    try:
        early_agent = make_agent(mlp, server, certs, "early", index=0, num_sites=2, seed=0)
        early = AgentThread(early_agent, max_rounds=2)
        early.start()
        early.finish()
        wait_until(lambda: server.rounds.round >= 2, server)

        model = mlp.build_model(0)
        optimizer = inner.build(model.parameters())
        schedule = inner.build_schedule(optimizer, total_rounds=total_rounds, inner_steps=inner_steps)
        seen: list[float] = []
        optimizer.register_step_pre_hook(lambda opt, a, k: seen.append(opt.param_groups[0]["lr"]))
        agent = SiteAgent(
            model, optimizer, mlp.site_batches(1, 2, 0), mlp.loss,
            coordinator=f"localhost:{server.port}", site="late", tls=TLSFiles.from_dir(certs, "late"),
            config=SiteAgentConfig(device="cpu", backoff_initial_s=0.05, backoff_max_s=0.5),
            lr_schedule=schedule,
        )
        late = AgentThread(agent)
        late.start()
        summary = late.finish()
        assert server.wait_until_finished(30)
    finally:
        server.stop(grace=0)
    assert summary.rounds_trained == 2
    horizon = total_rounds * inner_steps
    expected = [
        0.01 * lr_multiplier(s, schedule="cosine", warmup_steps=2, decay_steps=horizon, min_lr_ratio=0.1)
        for s in range(2 * inner_steps, horizon)
    ]
    assert seen == pytest.approx(expected)
    assert schedule.step_count == horizon


def test_geoloco_site_derives_the_horizon_from_the_coordinators_run() -> None:
    inner = InnerOptimizerConfig(lr=0.1, schedule="linear")
    optimizer = inner.build([torch.nn.Parameter(torch.zeros(2))])
    advertised: dict[str, Any] = {"total_rounds": 5, "algorithm": {"inner_steps": 8}}
    assert _build_lr_schedule(inner, optimizer, advertised).decay_steps == 40
    fragments = {"enabled": True, "fragments": 4}
    streaming = {"total_rounds": 5, "algorithm": {"inner_steps": 8, "streaming": fragments}}
    assert _build_lr_schedule(inner, optimizer, streaming).decay_steps == 10
    assert _build_lr_schedule(InnerOptimizerConfig(), optimizer, advertised) is None
    with pytest.raises(SiteCommandError, match="inner_optimizer.decay_steps"):
        _build_lr_schedule(inner, optimizer, {"total_rounds": 0, "algorithm": {"inner_steps": 8}})


def test_a_coordinator_running_until_stopped_needs_decay_steps_for_a_decay() -> None:
    from geoloco.algorithms.config import ConfigError, config_from_dict
    from geoloco.coordinator.config import CoordinatorConfig

    unbounded = {"total_rounds": 0, "insecure": True, "inner_optimizer": {"schedule": "cosine"}}
    with pytest.raises(ConfigError, match="set decay_steps") as err:
        config_from_dict(CoordinatorConfig, unbounded)
    assert err.value.key == "inner_optimizer.decay_steps"
    unbounded["inner_optimizer"] = {"schedule": "cosine", "decay_steps": 100}
    assert config_from_dict(CoordinatorConfig, unbounded).inner_optimizer.decay_steps == 100


def test_an_emulated_scenario_without_a_round_count_needs_decay_steps() -> None:
    import tomllib

    from geoloco.scenarios.scenario import ScenarioError, parse_scenario

    raw = tomllib.loads(
        (Path(__file__).parents[2] / "scenarios" / "quickstart.toml").read_text()
    )
    raw["run"] = {**raw.get("run", {}), "rounds": 0, "time_budget_s": 60.0}
    raw["inner_optimizer"] = {**raw.get("inner_optimizer", {}), "schedule": "linear"}
    with pytest.raises(ScenarioError, match="set decay_steps") as err:
        parse_scenario(raw)
    assert err.value.key == "inner_optimizer.decay_steps"
    raw["inner_optimizer"]["decay_steps"] = 500
    assert parse_scenario(raw).inner_optimizer.decay_steps == 500

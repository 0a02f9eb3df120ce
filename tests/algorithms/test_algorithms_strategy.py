"""Strategies: one interface, DiLoCo/FedAvg/FedOpt/DDP as configurations; the DDP equivalence."""

from __future__ import annotations

import json

import pytest
import torch

from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.diloco import apply_downlink, pseudo_gradient, run_inner_steps
from geoloco.algorithms.optimizers import InnerOptimizerConfig, OuterOptimizerConfig
from geoloco.algorithms.params import ParamLayout, weights_digest
from geoloco.algorithms.simulation.simulator import Simulator, SimulatorConfig
from geoloco.algorithms.strategy import (
    ALGORITHMS,
    AlgorithmConfig,
    DataParallel,
    Strategy,
    build_strategy,
)


def test_registry_and_default_outer_optimizers() -> None:
    assert set(ALGORITHMS) == {"diloco", "fedavg", "fedopt", "ddp", "sparseloco", "sparseloco-tiles"}
    cases = {"diloco": ("nesterov", 0.7, 0.9), "fedavg": ("sgd", 1.0, 0.0), "fedopt": ("fedadam", 0.01, 0.0)}
    for name, (opt, lr, momentum) in cases.items():
        s = build_strategy(AlgorithmConfig(name=name), numel=4)
        assert (s.outer_optimizer_config.name, s.outer_optimizer_config.lr,
                s.outer_optimizer_config.momentum) == (opt, lr, momentum)
    sparseloco = build_strategy(AlgorithmConfig.preset("sparseloco"), numel=4).outer_optimizer_config
    assert (sparseloco.name, sparseloco.lr, sparseloco.momentum) == ("sgd", 1.0, 0.0)
    # One class for every pseudo-gradient algorithm: the name sets the default outer optimizer.
    for name in ("diloco", "fedavg", "fedopt"):
        strategy = build_strategy(AlgorithmConfig(name=name), numel=1)
        assert type(strategy) is Strategy and strategy.name == name
    assert build_strategy(AlgorithmConfig.preset("sparseloco"), numel=1).name == "sparseloco"
    with pytest.raises(ConfigError, match="valid names: diloco, fedavg, fedopt, ddp"):
        AlgorithmConfig(name="scaffold")


def test_configure_round_seeds_differ_per_site_and_round() -> None:
    s = build_strategy(AlgorithmConfig(inner_steps=7), numel=4, seed=5)
    p1, p2 = s.configure_round(0, ["a", "b"]), s.configure_round(1, ["a", "b"])
    assert p1.inner_steps == 7 and p1.sites == ("a", "b") and p1.update_kind == "pseudo_gradient"
    seeds = {p.uplink_seed(k) for p in (p1, p2) for k in ("a", "b")} | {p1.downlink_seed, p2.downlink_seed}
    assert len(seeds) == 6
    assert build_strategy(AlgorithmConfig(inner_steps=7), numel=4, seed=5).configure_round(0, ["a"]).seed == p1.seed
    ddp = build_strategy(AlgorithmConfig(name="ddp", inner_steps=7), numel=4)
    assert isinstance(ddp, DataParallel) and ddp.configure_round(0, ["a"]).inner_steps == 1
    assert ddp.configure_round(0, ["a"]).update_kind == "gradient"


def test_site_weight_by_samples() -> None:
    assert build_strategy(AlgorithmConfig(weighting="samples"), numel=1).site_weight(96) == 96.0
    assert build_strategy(AlgorithmConfig(), numel=1).site_weight(96) == 1.0


def _sgd_simulator(make_workload, algorithm: str, steps: int) -> Simulator:
    config = SimulatorConfig.from_dict({
        "algorithm": {"name": algorithm, "inner_steps": 1},
        "inner_optimizer": {"name": "sgd", "lr": 0.05},
        "outer_optimizer": {"name": "sgd", "lr": 1.0, "momentum": 0.0},
        "sites": {"count": 3},
        "simulation": {"rounds": steps, "device": "cpu", "eval_every": 1000},
    })
    sim = Simulator(config, make_workload(hidden=8))
    for _ in sim.run():
        pass
    return sim


def test_diloco_h1_sgd_equals_synchronous_data_parallel_sgd(make_workload) -> None:
    """Inner SGD, H=1, no compression, outer SGD lr 1 momentum 0 == data-parallel SGD.

    DiLoCo computes θ − 1·mean_k(θ − (θ − η g_k)); DDP computes θ − η·mean_k(g_k). They agree up
    to fp32 rounding of the subtraction θ − θ_k (relative error ~1e-7 of |θ| per step), and the
    downlink addition θ_t + (θ' − θ_t); hence a tolerance of 1e-6 over ten steps, not equality.
    """
    steps = 10
    diloco = _sgd_simulator(make_workload, "diloco", steps)
    ddp = _sgd_simulator(make_workload, "ddp", steps)

    # Hand-rolled reference: average the three sites' gradients, one SGD step, in float64.
    workload = make_workload(hidden=8)
    model = workload.build_model(0)
    layout = ParamLayout.from_model(model)
    theta = layout.flatten(model).double()
    streams = [workload.site_batches(k, 3, 0) for k in range(3)]
    for _ in range(steps):
        grads = []
        for stream in streams:
            layout.load_(model, theta.float())
            model.zero_grad()
            workload.loss(model, next(stream)).backward()
            grads.append(layout.flatten_grads(model).double())
        theta = theta - 0.05 * torch.stack(grads).mean(0)

    assert not torch.allclose(diloco.global_flat, layout.flatten(workload.build_model(0)), atol=1e-3)
    torch.testing.assert_close(diloco.global_flat.double(), theta, rtol=0, atol=1e-6)
    torch.testing.assert_close(ddp.global_flat.double(), theta, rtol=0, atol=1e-6)
    torch.testing.assert_close(diloco.global_flat, ddp.global_flat, rtol=0, atol=1e-6)


def test_ddp_is_one_shared_adamw_step_not_averaged_site_steps(make_workload) -> None:
    """The baseline averages gradients then takes ONE AdamW step; averaging per-site AdamW steps differs."""
    config = SimulatorConfig.from_dict({
        "algorithm": {"name": "ddp", "inner_steps": 1},
        "inner_optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.0},
        "sites": {"count": 2},
        "simulation": {"rounds": 1, "device": "cpu"},
    })
    workload = make_workload()
    sim = Simulator(config, workload)
    records = list(sim.run())
    model = workload.build_model(0)
    layout = ParamLayout.from_model(model)
    theta = layout.flatten(model)
    grads = []
    for k in range(2):
        layout.load_(model, theta)
        model.zero_grad()
        workload.loss(model, next(workload.site_batches(k, 2, 0))).backward()
        grads.append(layout.flatten_grads(model))
    mean = torch.stack(grads).mean(0)
    # First AdamW step (bias-corrected): θ − lr · m̂/(√v̂ + eps) = θ − lr · g/(|g| + eps).
    expected = theta - 0.01 * mean / (mean.abs() + 1e-8)
    torch.testing.assert_close(sim.global_flat, expected, rtol=0, atol=1e-6)
    numel = layout.numel
    assert records[0].bytes_up == {"0": records[0].bytes_up["0"], "1": records[0].bytes_up["0"]}
    assert 4 * numel < records[0].bytes_up["0"] < 4 * numel + 64  # fp32 gradient + small header
    assert records[0].bytes_down["0"] == records[0].bytes_up["0"]


def test_strategy_state_roundtrip_continues_identically(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    cfg = AlgorithmConfig(downlink_codec="int8")
    a = build_strategy(cfg, numel=256)
    theta = torch.randn(256)

    def one_round(strategy, theta, round_index, g):
        agg = strategy.new_aggregator(round_index)
        agg.add(g, site="0")
        return strategy.aggregate_round(theta, agg, strategy.configure_round(round_index, [0]))

    grads = [torch.randn(256) * 0.1 for _ in range(4)]
    for t in range(2):
        theta = one_round(a, theta, t, grads[t]).global_flat
    save_file(a.state_tensors(), tmp_path / "s.safetensors")
    meta = json.loads(json.dumps(a.state_meta()))
    b = build_strategy(cfg, numel=256)
    b.load_state(load_file(tmp_path / "s.safetensors"), meta)
    ta = tb = theta
    for t in range(2, 4):
        ua, ub = one_round(a, ta, t, grads[t]), one_round(b, tb, t, grads[t])
        assert ua.digest == ub.digest
        ta, tb = ua.global_flat, ub.global_flat
    assert "outer.state.0.momentum_buffer" in a.state_tensors()
    assert any(k.startswith("downlink.") for k in a.state_tensors())
    with pytest.raises(ValueError, match="saved by algorithm 'diloco'"):
        build_strategy(AlgorithmConfig(name="fedavg"), numel=256).load_state({}, meta)


def test_site_side_round_against_coordinator(make_workload) -> None:
    """The functions a site agent and a coordinator would call give the coordinator's digest."""
    workload = make_workload(hidden=4)
    model = workload.build_model(0)
    layout = ParamLayout.from_model(model)
    theta = layout.flatten(model)
    strategy = build_strategy(
        AlgorithmConfig(inner_steps=5, uplink_codec="int8", downlink_codec="int8"), numel=layout.numel
    )
    plan = strategy.configure_round(0, ["0", "1"])
    agg = strategy.new_aggregator(0)
    for k in plan.sites:
        layout.load_(model, theta)
        opt = InnerOptimizerConfig(lr=0.01).build(model.parameters())
        result = run_inner_steps(model, opt, workload.site_batches(int(k), 2, 0), plan.inner_steps, workload.loss)
        upload = strategy.build_uplink().encode(
            pseudo_gradient(theta, layout.flatten(model)), seed=plan.uplink_seed(k)
        )
        agg.add(upload, strategy.site_weight(result.samples), site=k)
    update = strategy.aggregate_round(theta, agg, plan)
    assert update.sites == ("0", "1")
    assert weights_digest(apply_downlink(theta, update.downlink)) == update.digest
    assert update.digest != weights_digest(theta)


@pytest.mark.parametrize(
    ("data", "key", "fragment"),
    [
        ({"uplink_codec": "zip"}, "algorithm.uplink_codec", ""),
        ({"weighting": "tokens"}, "algorithm.weighting", "'uniform' | 'steps' | 'samples'"),
        ({"inner_steps": 0}, "algorithm.inner_steps", "must be >= 1"),
        ({"error_feedback_decay": 1.5}, "algorithm.error_feedback_decay", "(0, 1]"),
        ({"name": "ddp", "warmup_steps": 3}, "algorithm.warmup_steps", "data-parallel throughout"),
        ({"error_feedback": "yes"}, "algorithm.error_feedback", "true or false"),
    ],
)
def test_algorithm_config_errors(data, key, fragment) -> None:
    with pytest.raises(ConfigError) as info:
        SimulatorConfig.from_dict({"algorithm": data})
    assert info.value.key == key
    assert fragment in info.value.message


def test_outer_config_defaults_resolve_per_algorithm() -> None:
    cfg = OuterOptimizerConfig(lr=0.5)
    assert cfg.resolved("nesterov").momentum == 0.9 and cfg.resolved("nesterov").lr == 0.5


def _model_sized_storages(numel: int) -> set[int]:
    """Distinct storages of the live fp32 tensors of ``numel`` elements (a census by GC)."""
    import gc

    return {
        o.untyped_storage().data_ptr()
        for o in gc.get_objects()
        # type(), not isinstance: the latter reads __class__, which warns on deprecated objects.
        if issubclass(type(o), torch.Tensor) and o.numel() == numel
    }


def test_the_mean_and_theta_prime_are_freed_before_the_new_weights_are_built(monkeypatch) -> None:
    # The coordinator's peak is where the downlink builds θ_{t+1}: by then the round's mean and θ'
    # are dead, and no frame may keep them alive (each is a whole model at a billion parameters).
    import geoloco.algorithms.diloco as diloco

    # A size no other test uses: the census counts every live tensor of it in this process, and
    # an xdist worker may still hold one of an earlier test's (a CI run saw a third storage when
    # this was 1 << 15).
    numel = (1 << 15) + 13
    strategy = build_strategy(AlgorithmConfig(inner_steps=1), numel=numel)
    theta = torch.randn(numel)
    plan = strategy.configure_round(0, ["0", "1"])
    agg = strategy.new_aggregator(0)
    encoder = strategy.build_uplink()
    for k in plan.sites:
        agg.add(encoder.encode(torch.randn(numel), seed=plan.uplink_seed(k)), 1.0, site=k)
    seen: list[set[int]] = []
    original = diloco.apply_downlink

    def census_then_apply(global_flat: torch.Tensor, encoded):  # type: ignore[no-untyped-def]
        seen.append(_model_sized_storages(numel))
        return original(global_flat, encoded)

    monkeypatch.setattr(diloco, "apply_downlink", census_then_apply)
    update = strategy.aggregate_round(theta, agg, plan)
    momentum = strategy.fragments[0].outer.state_tensors()
    live = {t.untyped_storage().data_ptr() for t in momentum.values() if t.numel() == numel}
    assert seen and seen[0] == {theta.untyped_storage().data_ptr()} | live, (
        f"{len(seen[0])} model-sized storages alive while θ_(t+1) is built; expected θ_t and the "
        f"outer state ({1 + len(live)})"
    )
    assert update.global_flat.numel() == numel

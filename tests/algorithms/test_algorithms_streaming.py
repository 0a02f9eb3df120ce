"""Streaming DiLoCo: fragments, staggered schedule, merge, per-fragment strategy, simulator."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from geoloco.algorithms.config import ConfigError, config_from_dict
from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.simulation import streaming_sim
from geoloco.algorithms.simulation.simulator import Simulator, SimulatorConfig
from geoloco.algorithms.strategy import AlgorithmConfig, build_strategy
from geoloco.algorithms.streaming import (
    FragmentPartition,
    StreamingConfig,
    StreamingSchedule,
    layer_key,
    merge_fragment_,
)


def _deep_model(dim: int, seed: int) -> nn.Module:
    """A 4-layer MLP, so the model has several layer groups to split into fragments."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(dim, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
        nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return model


@pytest.fixture
def deep(make_workload):
    """The conftest's non-IID linear-regression task on ``_deep_model``."""

    class DeepWorkload(make_workload):
        def build_model(self, seed: int) -> nn.Module:
            return _deep_model(self.dim, seed)

    return DeepWorkload


def _layout() -> ParamLayout:
    return ParamLayout.from_model(_deep_model(4, 0))


# --------------------------------------------------------------------------------------------
# Fragments


def test_layer_key_groups_weights_and_biases_of_one_layer() -> None:
    assert layer_key("blocks.3.attn.qkv.weight") == "blocks.3"
    assert layer_key("0.weight") == "0" and layer_key("0.bias") == "0"
    assert layer_key("tok_emb.weight") == "tok_emb"
    assert layer_key("pos_emb") == "pos_emb"


@pytest.mark.parametrize("split", ["strided", "contiguous"])
@pytest.mark.parametrize("fragments", [1, 2, 3, 4])
def test_partition_covers_every_element_once(split: str, fragments: int) -> None:
    layout = _layout()
    partition = FragmentPartition.from_layout(layout, fragments, split)
    assert len(partition) == fragments
    owner = torch.full((layout.numel,), -1)
    for f in partition.fragments:
        assert f.numel > 0 and f.layers
        for offset, n in f.slices:
            assert bool((owner[offset : offset + n] == -1).all()), "element in two fragments"
            owner[offset : offset + n] = f.index
    assert bool((owner >= 0).all())
    assert sum(f.numel for f in partition.fragments) == layout.numel
    # A layer's weight and bias stay in one fragment.
    for entry in layout.entries:
        fragment_ids = set(owner[entry.offset : entry.offset + entry.numel].tolist())
        assert len(fragment_ids) == 1


def test_strided_and_contiguous_deal_layers_differently() -> None:
    layout = _layout()
    strided = FragmentPartition.from_layout(layout, 2, "strided")
    contiguous = FragmentPartition.from_layout(layout, 2, "contiguous")
    assert strided[0].layers == ("0", "4") and strided[1].layers == ("2", "6")
    assert contiguous[0].layers == ("0", "2") and contiguous[1].layers == ("4", "6")


def test_partition_refuses_more_fragments_than_layers() -> None:
    with pytest.raises(ValueError, match=r"4 layer groups.*allowed: 1 to 4"):
        FragmentPartition.from_layout(_layout(), 5)


def test_gather_scatter_round_trip() -> None:
    layout = _layout()
    partition = FragmentPartition.from_layout(layout, 3, "strided")
    flat = torch.randn(layout.numel)
    rebuilt = torch.zeros(layout.numel)
    for f in partition.fragments:
        part = f.gather(flat)
        assert part.numel() == f.numel
        f.scatter_(rebuilt, part)
    assert torch.equal(rebuilt, flat)
    with pytest.raises(ValueError, match="holds"):
        partition[0].scatter_(rebuilt, torch.zeros(partition[0].numel + 1))


# --------------------------------------------------------------------------------------------
# Schedule


def test_schedule_staggers_fragments_every_h_steps() -> None:
    schedule = StreamingSchedule(inner_steps=12, fragments=3, overlap_steps=2)
    assert schedule.interval == 4
    assert [schedule.fragment_for_round(r) for r in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    for p in range(3):
        # Fragment p syncs at the end of rounds p, p + 3, ...: every H = 12 inner steps.
        steps = [(r + 1) * schedule.interval for r in range(12) if schedule.fragment_for_round(r) == p]
        assert steps[0] == (p + 1) * 4
        assert all(b - a == 12 for a, b in zip(steps, steps[1:]))
    # Round 0 has no broadcast to merge; every later round merges after tau steps.
    assert [schedule.overlap_before_merge(r) for r in range(3)] == [0, 2, 2]
    with pytest.raises(ValueError, match="numbered from 0"):
        schedule.fragment_for_round(-1)
    with pytest.raises(ValueError, match="do not divide"):
        StreamingSchedule(inner_steps=10, fragments=3)
    with pytest.raises(ValueError, match="overlap_steps"):
        StreamingSchedule(inner_steps=10, fragments=2, overlap_steps=6)


def test_schedule_agrees_between_coordinator_and_sites() -> None:
    """Sites rebuild the algorithm config from the coordinator's JSON and get the same plan."""
    config = AlgorithmConfig(
        inner_steps=12, uplink_codec="int8",
        streaming=StreamingConfig(enabled=True, fragments=3, overlap_steps=2, split="contiguous"),
    )
    layout = _layout()
    coordinator = build_strategy(config, numel=layout.numel, layout=layout, seed=7)
    sites = [
        build_strategy(
            config_from_dict(AlgorithmConfig, config.to_dict()), numel=layout.numel,
            layout=ParamLayout.from_model(_deep_model(4, k)), seed=7,
        )
        for k in range(3)
    ]
    for site in sites:
        assert site.partition == coordinator.partition
        for r in range(40):
            assert site.fragment_for_round(r) == coordinator.fragment_for_round(r)
            assert site.configure_round(r, ["0"]).seed == coordinator.configure_round(r, ["0"]).seed


# --------------------------------------------------------------------------------------------
# Merge and config


def test_merge_mixes_only_the_fragment() -> None:
    layout = _layout()
    partition = FragmentPartition.from_layout(layout, 2, "strided")
    local, global_ = torch.randn(layout.numel), torch.randn(layout.numel)
    f0, f1 = partition[0], partition[1]
    exact = merge_fragment_(local.clone(), global_, f0, 0.0)
    assert torch.equal(f0.gather(exact), f0.gather(global_))
    assert torch.equal(f1.gather(exact), f1.gather(local))
    mixed = merge_fragment_(local.clone(), global_, f0, 0.25)
    expected = 0.25 * f0.gather(local) + 0.75 * f0.gather(global_)
    assert torch.allclose(f0.gather(mixed), expected, atol=1e-6)
    assert torch.equal(f1.gather(mixed), f1.gather(local))


@pytest.mark.parametrize(
    ("values", "key", "allowed"),
    [
        ({"inner_steps": 10, "streaming": {"enabled": True, "fragments": 3}},
         "algorithm.streaming.fragments", "allowed: 1, 2, 5, 10"),
        ({"inner_steps": 10, "streaming": {"enabled": True, "fragments": 2, "overlap_steps": 6}},
         "algorithm.streaming.overlap_steps", "<= inner_steps / fragments = 5"),
        ({"streaming": {"mix": 1.0}}, "algorithm.streaming.mix", "[0, 1)"),
        ({"streaming": {"split": "random"}}, "algorithm.streaming.split", "strided"),
        ({"streaming": {"fragments": 0}}, "algorithm.streaming.fragments", ">= 1"),
        ({"name": "ddp", "streaming": {"enabled": True}}, "algorithm.streaming.enabled", "diloco"),
        ({"round_time_budget_s": 2.0, "streaming": {"enabled": True}},
         "algorithm.round_time_budget_s", "unset round_time_budget_s"),
        ({"late_updates": "fold", "streaming": {"enabled": True}},
         "algorithm.late_updates", 'late_updates = "drop"'),
    ],
)
def test_config_errors_name_the_key_and_what_is_allowed(
    values: dict[str, Any], key: str, allowed: str
) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(AlgorithmConfig, values, prefix="algorithm")
    assert info.value.key == key
    assert allowed in info.value.message


def test_build_strategy_needs_the_layout_when_streaming() -> None:
    config = AlgorithmConfig(inner_steps=4, streaming=StreamingConfig(enabled=True, fragments=2))
    with pytest.raises(ValueError, match="layout="):
        build_strategy(config, numel=10)


# --------------------------------------------------------------------------------------------
# Strategy: P = 1 equals plain DiLoCo; per-fragment state survives a checkpoint


def _aggregate(strategy: Any, global_flat: torch.Tensor, round_index: int,
               updates: list[torch.Tensor]) -> Any:
    names = [str(k) for k in range(len(updates))]
    plan = strategy.configure_round(round_index, names)
    aggregator = strategy.new_aggregator(round_index)
    uplink = strategy.build_uplink()
    for name, u in zip(names, updates):
        encoded = uplink.encode(u, seed=plan.uplink_seed(name), fragment=plan.fragment)
        aggregator.add(encoded, 1.0, site=name)
    return strategy.aggregate_round(global_flat, aggregator, plan)


def test_one_fragment_strategy_equals_plain_strategy_bit_for_bit() -> None:
    layout = _layout()
    plain_config = AlgorithmConfig(inner_steps=4, uplink_codec="int8", downlink_codec="int4")
    stream_config = AlgorithmConfig(
        inner_steps=4, uplink_codec="int8", downlink_codec="int4",
        streaming=StreamingConfig(enabled=True, fragments=1),
    )
    plain = build_strategy(plain_config, numel=layout.numel, layout=layout, seed=3)
    stream = build_strategy(stream_config, numel=layout.numel, layout=layout, seed=3)
    g = torch.Generator().manual_seed(0)
    a = b = torch.randn(layout.numel, generator=g)
    for r in range(3):
        updates = [torch.randn(layout.numel, generator=g) * 0.1 for _ in range(3)]
        ua, ub = _aggregate(plain, a, r, updates), _aggregate(stream, b, r, updates)
        assert ua.downlink.to_bytes() == ub.downlink.to_bytes()
        assert ua.digest == ub.digest
        a, b = ua.global_flat, ub.global_flat
    assert torch.equal(a, b)


def test_fragment_rounds_change_only_their_fragment_and_state_round_trips() -> None:
    layout = _layout()
    config = AlgorithmConfig(
        inner_steps=6, uplink_codec="int8", downlink_codec="int8",
        streaming=StreamingConfig(enabled=True, fragments=3),
    )
    strategy = build_strategy(config, numel=layout.numel, layout=layout)
    assert strategy.inner_steps == 2
    g = torch.Generator().manual_seed(1)
    flat = torch.randn(layout.numel, generator=g)
    for r in range(4):
        fragment = strategy.fragment(r)
        updates = [torch.randn(fragment.numel, generator=g) for _ in range(2)]
        update = _aggregate(strategy, flat, r, updates)
        assert update.downlink.shape == (fragment.numel,)
        changed = (update.global_flat != flat).nonzero().flatten()
        inside = torch.zeros(layout.numel, dtype=torch.bool)
        for offset, n in fragment.slices:
            inside[offset : offset + n] = True
        assert changed.numel() > 0 and bool(inside[changed].all())
        # A site applies the broadcast to its own replica and gets the same weights.
        assert torch.equal(strategy.apply_downlink(flat, update.downlink, r), update.global_flat)
        flat = update.global_flat
    # Checkpoint: per-fragment outer state and downlink residuals restore exactly.
    restored = build_strategy(config, numel=layout.numel, layout=layout)
    restored.load_state(strategy.state_tensors(), strategy.state_meta())
    updates = [torch.randn(strategy.fragment(4).numel, generator=g) for _ in range(2)]
    assert torch.equal(
        _aggregate(strategy, flat, 4, updates).global_flat,
        _aggregate(restored, flat, 4, updates).global_flat,
    )
    other = build_strategy(
        AlgorithmConfig(inner_steps=6, streaming=StreamingConfig(enabled=True, fragments=2)),
        numel=layout.numel, layout=layout,
    )
    with pytest.raises(ValueError, match="3 fragments; this run streams 2"):
        other.load_state(strategy.state_tensors(), strategy.state_meta())


# --------------------------------------------------------------------------------------------
# Simulator


def _sim_config(streaming: dict[str, Any] | None = None, **sections: Any) -> SimulatorConfig:
    base: dict[str, Any] = {
        "algorithm": {"inner_steps": 4, "uplink_codec": "int8", "downlink_codec": "int8"},
        "inner_optimizer": {"lr": 0.02},
        "sites": [{"speed_factor": 1.0}, {"speed_factor": 0.4}, {}],
        "simulation": {"rounds": 4, "eval_every": 2, "device": "cpu", "step_time_s": 0.1},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values} if isinstance(values, dict) else values
    if streaming is not None:
        base["algorithm"] = {**base["algorithm"], "streaming": streaming}
    return SimulatorConfig.from_dict(base)


def test_simulator_one_fragment_no_overlap_equals_plain_diloco(deep) -> None:
    """P = 1, τ = 0: bit-identical weights, bytes and virtual clock, stragglers included."""
    sections = {"simulation": {"round_deadline_s": 0.75, "rounds": 5}}
    plain = Simulator(_sim_config(**sections), deep())
    stream = Simulator(_sim_config({"enabled": True}, **sections), deep())
    a, b = list(plain.run()), list(stream.run())
    assert any(r.excluded for r in a), "the deadline must leave a straggler out"
    assert [r.weights_digest for r in a] == [r.weights_digest for r in b]
    assert torch.equal(plain.global_flat, stream.global_flat)
    for ra, rb in zip(a, b):
        assert ra.bytes_up == rb.bytes_up and ra.bytes_down == rb.bytes_down
        assert ra.excluded == rb.excluded
        assert ra.eval_loss == rb.eval_loss and ra.train_loss == rb.train_loss
        assert ra.wall_clock_s == pytest.approx(rb.wall_clock_s, rel=1e-12)
        assert ra.peak_bytes_in_flight == rb.peak_bytes_in_flight
    assert [r.fragment for r in b] == [0] * 5


def test_simulator_merges_the_right_fragment_at_the_right_step(monkeypatch, deep) -> None:
    """Each site merges round r's fragment after exactly r·s + τ of its own inner steps."""
    tau, fragments, h = 1, 2, 4
    config = _sim_config({"enabled": True, "fragments": fragments, "overlap_steps": tau},
                         simulation={"rounds": 5})
    sim = Simulator(config, deep())
    steps_taken = [0] * len(sim.sites)
    current: dict[str, int] = {}
    for site in sim.sites:
        def counting(batches=site.batches, k=site.index):
            for batch in batches:
                steps_taken[k] += 1
                current["site"] = k  # with τ >= 1 a merge follows steps of the site merging
                yield batch
        site.batches = counting()
    merges: list[tuple[int, int, int]] = []
    real_merge = streaming_sim.merge_fragment_

    def spy(local, global_flat, fragment, mix):
        merges.append((current["site"], fragment.index, steps_taken[current["site"]]))
        return real_merge(local, global_flat, fragment, mix)

    monkeypatch.setattr(streaming_sim, "merge_fragment_", spy)
    records = list(sim.run())
    assert [r.fragment for r in records] == [0, 1, 0, 1, 0]
    interval = h // fragments
    for k in range(len(sim.sites)):
        mine = [(p, step) for site, p, step in merges if site == k]
        # Rounds 1..4 are merged during rounds 2..5 (round 5's broadcast is merged later).
        assert mine == [((r - 1) % fragments, r * interval + tau) for r in range(1, 5)]


def test_simulator_overlap_raises_utilization_and_cuts_bytes_in_flight(deep) -> None:
    slow = {"uplink_bps": 2e4, "downlink_bps": 2e4, "latency_s": 0.08}
    sections = {"sites": [slow, slow], "simulation": {"rounds": 8, "step_time_s": 0.1}}
    plain = list(Simulator(_sim_config(**sections), deep()).run())
    stream = list(
        Simulator(
            _sim_config(
                {"enabled": True, "fragments": 2, "overlap_steps": 2, "split": "contiguous"},
                **{**sections, "simulation": {"rounds": 16, "step_time_s": 0.1}},
            ),
            deep(),
        ).run()
    )
    # Same inner steps: 8 rounds of H = 4 against 16 rounds of s = 2.
    assert sum(max(r.inner_steps.values()) for r in plain) == sum(max(r.inner_steps.values()) for r in stream) == 32

    def utilization(records):
        compute = sum(sum(r.compute_s.values()) for r in records) / 2
        return compute / records[-1].wall_clock_s

    assert utilization(stream) > utilization(plain) + 0.1
    assert max(max(r.peak_bytes_in_flight.values()) for r in stream) < 0.7 * max(
        max(r.peak_bytes_in_flight.values()) for r in plain
    )
    assert stream[-1].eval_loss < stream[0].train_loss


def test_simulator_streaming_secure_aggregation_matches_plain_streaming(deep, monkeypatch) -> None:
    """Streaming DiLoCo with secure aggregation: every round is one secure sum over that round's
    fragment only, and the run equals streaming without it up to the fixed-point error.

    ``clip_norm = 10`` is far above the fragment updates' norms, so nothing is clipped, only
    rounded: with 3 sites and 32-bit integers the scale is about 2^20, so each fragment's mean
    update is within 1/scale ~ 1e-6 per coordinate of the plain mean (stochastic rounding error
    per site < 1 unit; error feedback sends it again next time the fragment syncs). Four rounds of
    outer Nesterov (lr 0.7, momentum 0.9) and the sites' training keep the weights within 1e-5.
    """
    streaming = {"enabled": True, "fragments": 2, "overlap_steps": 1, "mix": 0.25}
    sections: dict[str, Any] = {
        "algorithm": {"uplink_codec": "none", "downlink_codec": "none"},
        "simulation": {"rounds": 4, "eval_every": 4, "device": "cpu", "step_time_s": 0.1},
    }
    from geoloco.algorithms.privacy import secure_sum as secure_sum_module

    sums: list[int] = []
    real = secure_sum_module.private_round_in_memory

    def recording(privacy, codec, updates, encoders, *args, **kwargs):
        sums.append(next(iter(updates.values())).numel())
        return real(privacy, codec, updates, encoders, *args, **kwargs)

    monkeypatch.setattr(secure_sum_module, "private_round_in_memory", recording)
    plain = Simulator(_sim_config(streaming, **sections), deep())
    secure = Simulator(
        _sim_config(streaming, privacy={"secure_aggregation": True, "clip_norm": 10.0}, **sections),
        deep(),
    )
    a, b = list(plain.run()), list(secure.run())
    assert [r.fragment for r in b] == [0, 1, 0, 1] == [r.fragment for r in a]
    partition = secure.strategy.partition  # type: ignore[attr-defined]
    # One secure sum per round, each over that round's fragment (the two differ in size).
    assert sums == [partition[r.fragment].numel for r in b]
    assert partition[0].numel != partition[1].numel
    # Per-fragment error feedback: each site keeps one residual per fragment, of its size.
    for p, encoders in enumerate(secure.uplinks.encoders):  # type: ignore[attr-defined]
        assert {e.residual.numel() for e in encoders.values()} == {partition[p].numel}  # type: ignore[union-attr]
    difference = float((secure.global_flat - plain.global_flat).abs().max())
    assert 0 < difference < 1e-5, difference
    assert b[-1].eval_loss == pytest.approx(a[-1].eval_loss, rel=1e-5)
    assert b[-1].eval_loss < b[0].train_loss


def test_simulator_streaming_distributed_dp_accounts_one_release_per_fragment_sync(deep) -> None:
    """Each fragment sync is one DP release: epsilon after r rounds is the accountant's epsilon
    of r compositions of the fragment round's noise multiplier."""
    from geoloco.algorithms.privacy.private_aggregation import PrivacyAccountant

    config = _sim_config(
        {"enabled": True, "fragments": 2},
        algorithm={"uplink_codec": "none", "downlink_codec": "none"},
        privacy={"secure_aggregation": True, "clip_norm": 0.5, "dp": "distributed",
                 "noise_multiplier": 2.0},
        simulation={"rounds": 3, "eval_every": 3, "device": "cpu", "step_time_s": 0.1},
    )
    sim = Simulator(config, deep())
    records = list(sim.run())
    assert [r.fragment for r in records] == [0, 1, 0]
    accountant = PrivacyAccountant(config.privacy.delta)
    expected = []
    for r in records:
        expected.append(accountant.step(sim.round_noise_multiplier(r.round)))
    assert [r.epsilon for r in records] == pytest.approx(expected)
    assert 0 < records[0].epsilon < records[1].epsilon < records[2].epsilon  # type: ignore[operator]
    assert all(torch.isfinite(sim.global_flat))


def test_plain_strategy_refuses_streaming_state() -> None:
    layout = _layout()
    streaming = build_strategy(
        AlgorithmConfig(inner_steps=4, streaming=StreamingConfig(enabled=True, fragments=2)),
        numel=layout.numel, layout=layout,
    )
    plain = build_strategy(AlgorithmConfig(inner_steps=4), numel=layout.numel)
    with pytest.raises(ValueError, match="Streaming DiLoCo with 2 fragments"):
        plain.load_state(streaming.state_tensors(), streaming.state_meta())

"""A site's round without extra model-sized buffers (issue #13's site-memory target).

Each cut is shown twice: its result is bit for bit the one of the path it replaces, and the most
torch memory it held at once (from the torch profiler's allocation and free events, never timed)
stays well under one model where the replaced path held a whole model more.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _agent_helpers import AgentThread, make_agent, make_certs, start_coordinator
from torch.profiler import ProfilerActivity, profile

from geoloco.algorithms import strategy as strategy_module
from geoloco.algorithms.diloco import pseudo_gradient
from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.strategy import AlgorithmConfig, build_strategy
from geoloco.compression.casts import Lossless
from geoloco.scenarios.workloads import build_workload
from geoloco.site_agent.state import SiteState
from geoloco.site_agent.uplink import StrategyUplink, UplinkUpdate

NUMEL = 1 << 22
MODEL_BYTES = 4 * NUMEL


def _peak_bytes(fn: Callable[[], object]) -> int:
    """The most bytes of torch CPU memory allocated during ``fn`` and alive at once (an op's
    own allocations count at its start, frees where they happen)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("codec", ["none", "int8", "fp16"])
def test_a_broadcast_is_added_into_the_held_weights_without_a_decoded_copy(codec: str) -> None:
    algorithm = AlgorithmConfig(inner_steps=2, downlink_codec=codec)
    coordinator = build_strategy(algorithm, numel=NUMEL)
    start = torch.randn(NUMEL)
    plan = coordinator.configure_round(3, ["a"])
    update = coordinator.apply_mean_update(start.clone(), torch.randn(NUMEL) * 0.01, ("a",), plan)

    dense, in_place = SiteState(), SiteState()
    dense.adopt_weights(start.clone(), 3)
    in_place.adopt_weights(start.clone(), 3)
    assert dense.apply_broadcast(build_strategy(algorithm, numel=NUMEL), 3, update.downlink, update.digest)
    strategy = build_strategy(algorithm, numel=NUMEL)
    held = in_place.global_weights
    peak = _peak_bytes(
        lambda: in_place.apply_broadcast_in_place(strategy, 3, update.downlink, update.digest)
    )
    dense_peak = _peak_bytes(lambda: strategy.apply_downlink(start, update.downlink, 3))
    assert in_place.held_round == 4 and in_place.digest == update.digest == dense.digest
    assert in_place.global_weights is held  # the same memory, now θ_4
    assert torch.equal(in_place.global_weights, dense.global_weights)
    # The dense path decodes the whole delta into a new vector (one model); pieces stay small.
    assert dense_peak >= MODEL_BYTES and peak < MODEL_BYTES // 2, (peak, dense_peak)


def test_a_broadcast_whose_digest_differs_leaves_the_site_without_weights_to_fetch() -> None:
    algorithm = AlgorithmConfig(inner_steps=2, downlink_codec="int8")
    coordinator = build_strategy(algorithm, numel=NUMEL)
    start = torch.randn(NUMEL)
    plan = coordinator.configure_round(3, ["a"])
    update = coordinator.apply_mean_update(start.clone(), torch.randn(NUMEL), ("a",), plan)
    state = SiteState()
    state.adopt_weights(start.clone(), 3)
    assert not state.apply_broadcast_in_place(
        build_strategy(algorithm, numel=NUMEL), 3, update.downlink, "not the digest"
    )
    # Its weights were changed in place: nothing that could be mistaken for θ_3 is kept.
    assert not state.has_weights and state.digest is None and state.held_round == 3
    assert state.adopt_weights(update.global_flat.clone(), 4) is None


def _model_and_global() -> tuple[torch.nn.Module, ParamLayout, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 64))
    layout = ParamLayout.from_model(model)
    return model, layout, layout.flatten(model) + 0.01 * torch.randn(layout.numel)


def _pieces(
    model: torch.nn.Module, layout: ParamLayout, held: torch.Tensor
) -> Callable[[], Iterator[tuple[int, torch.Tensor]]]:
    def pieces() -> Iterator[tuple[int, torch.Tensor]]:
        for entry, param in layout.tensors(model):
            local = param.detach().reshape(-1)
            for start in range(0, entry.numel, 100_000):
                stop = min(entry.numel, start + 100_000)
                at = entry.offset + start
                yield at, torch.sub(held[at : at + stop - start], local[start:stop])

    return pieces


@pytest.mark.parametrize("codec", ["int8", "topk:0.05|int4"])
def test_the_pseudo_gradient_is_formed_in_the_residual_with_the_dense_paths_bytes(codec: str) -> None:
    model, layout, held = _model_and_global()
    strategy = build_strategy(AlgorithmConfig(inner_steps=2, uplink_codec=codec), numel=layout.numel)
    dense, pieced = StrategyUplink(strategy, "a"), StrategyUplink(strategy, "a")
    model_bytes = 4 * layout.numel
    for round_seed in (11, 12):  # the second round starts from a carried residual
        first = round_seed == 11
        out: dict[str, object] = {}

        def encode_dense() -> None:
            update = pseudo_gradient(held, layout.flatten(model))
            out["dense"] = dense.encode(update, round_seed=round_seed, fragment=0, samples=4)

        def encode_pieces() -> None:
            out["pieces"] = pieced.encode_added(
                _pieces(model, layout, held), layout.numel, device=held.device,
                round_seed=round_seed, fragment=0, samples=4,
            )

        dense_peak = _peak_bytes(encode_dense)
        peak = _peak_bytes(encode_pieces)
        expected, sent = out["dense"], out["pieces"]
        assert isinstance(sent, UplinkUpdate) and isinstance(expected, UplinkUpdate)
        assert sent.data == expected.data and sent.wire == expected.wire
        assert torch.equal(pieced.residual(0), dense.residual(0))  # type: ignore[arg-type]
        # The dense path holds the update (one model) beside what both hold: the residual (a
        # new one in the first round), the payload and the codec's pieces.
        assert peak + model_bytes // 2 < dense_peak, (peak, dense_peak)
        assert peak - (model_bytes if first else 0) < model_bytes * 3 // 4, peak


def test_pieces_the_codec_would_refuse_leave_the_residual_for_the_dense_path() -> None:
    model, layout, held = _model_and_global()
    strategy = build_strategy(AlgorithmConfig(inner_steps=2, uplink_codec="int8"), numel=layout.numel)
    uplink = StrategyUplink(strategy, "a")
    uplink.encode_added(_pieces(model, layout, held), layout.numel, device=held.device,
                        round_seed=1, fragment=0, samples=1)
    residual = uplink.residual(0)
    assert residual is not None
    before = residual.clone()
    held[5] = float("nan")
    assert uplink.encode_added(_pieces(model, layout, held), layout.numel, device=held.device,
                               round_seed=2, fragment=0, samples=1) is None
    assert torch.equal(residual, before)


def test_a_lossless_update_goes_to_bytes_without_a_payload_copy() -> None:
    strategy = build_strategy(AlgorithmConfig(inner_steps=2, uplink_codec="none"), numel=NUMEL)
    update = torch.randn(NUMEL)
    uplink = StrategyUplink(strategy, "a")
    reference = strategy.build_uplink().encode(update, seed=0, fragment=0).to_bytes()
    sent: list[UplinkUpdate] = []
    peak = _peak_bytes(lambda: sent.append(uplink.encode(update, round_seed=5, fragment=0, samples=2)))
    assert sent[0].data == reference
    # The codec's encode copies the update into a payload tensor (one model) before the bytes.
    assert peak < MODEL_BYTES // 2, peak


@pytest.mark.parametrize("codec", ["int8", "none"])
def test_a_real_sites_rounds_take_none_of_the_model_sized_copy_paths(
    codec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whole rounds over gRPC: the site thread never flattens the model with error feedback,
    never decodes a broadcast into a new vector, never copies a lossless update into a payload
    (each a model-sized buffer); it ends on the coordinator's weights."""
    calls: list[str] = []

    def on_site(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread().name.startswith("site-"):
                calls.append(name)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(ParamLayout, "flatten", on_site("flatten", ParamLayout.flatten))
    monkeypatch.setattr(
        strategy_module, "apply_downlink", on_site("apply_downlink", strategy_module.apply_downlink)
    )
    monkeypatch.setattr(Lossless, "encode_into", on_site("lossless payload", Lossless.encode_into))
    certs = make_certs(tmp_path / "certs", ["solo"])
    mlp = build_workload("mlp")
    server = start_coordinator(
        certs, mlp.build_model(0), total_rounds=2, min_sites=1,
        algorithm=AlgorithmConfig(inner_steps=2, uplink_codec=codec, downlink_codec=codec),
    )
    try:
        thread = AgentThread(make_agent(mlp, server, certs, "solo", index=0, num_sites=1, seed=0))
        thread.start()
        summary = thread.finish()
    finally:
        server.stop(grace=0)
    assert summary.weights_digest == server.rounds.digest_hex
    # ``none`` has no residual to form the update in: one flattened copy per round remains.
    assert calls == ([] if codec == "int8" else ["flatten", "flatten"]), calls

"""A site's uplink with adaptive codecs: it encodes with the round's assigned codec, keeps its
error-feedback residual across codec changes, and a saved state restores in the saved codec."""

from __future__ import annotations

import torch

from geoloco.algorithms.link_codec import AdaptiveUplinkConfig, sparse_spec
from geoloco.algorithms.strategy import AlgorithmConfig, build_strategy
from geoloco.compression import decode, parse_codec
from geoloco.site_agent.uplink import StrategyUplink

NUMEL = 4000


def _uplink() -> StrategyUplink:
    config = AlgorithmConfig(uplink_codec="int8", adaptive_uplink=AdaptiveUplinkConfig(enabled=True))
    return StrategyUplink(build_strategy(config, numel=NUMEL), "site-a")


def test_assigned_codec_is_used_and_nothing_is_lost_across_changes() -> None:
    uplink = _uplink()
    torch.manual_seed(0)
    updates = [torch.randn(NUMEL) for _ in range(3)]
    sparse = sparse_spec(0.01, "int8")
    sent = torch.zeros(NUMEL)
    for update, spec in zip(updates, ["int8", sparse, "int8"], strict=True):
        uplink.use_codec(spec)
        encoded = uplink.encode(update.clone(), round_seed=7, fragment=0, samples=1)
        assert encoded.wire["codec"] == parse_codec(spec).spec
        assert encoded.data  # the wire bytes, parsed back below
        sent += decode(encoded.encoded())
    residual = uplink.residual()
    assert residual is not None
    torch.testing.assert_close(sent + residual, torch.stack(updates).sum(0), rtol=0, atol=1e-4)


def test_saved_state_restores_in_the_codec_it_was_saved_with() -> None:
    uplink = _uplink()
    uplink.use_codec(sparse_spec(0.01, "int8"))
    uplink.encode(torch.randn(NUMEL), round_seed=1, fragment=0, samples=1)
    tensors, meta = uplink.state()
    restored = _uplink()
    restored.load_state(tensors, meta, torch.device("cpu"))
    assert restored.encoders.encoders[0].spec == sparse_spec(0.01, "int8")
    saved, loaded = uplink.residual(), restored.residual()
    assert saved is not None and loaded is not None and torch.equal(saved, loaded)

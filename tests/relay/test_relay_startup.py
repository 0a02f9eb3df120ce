"""A relay's first partial waits for the sites it lists: a listed site still starting would
otherwise find round 0 closed at the relay while the coordinator waits for its update (seen in
the emulator on a loaded machine: the run hung in round 0)."""

from __future__ import annotations

import torch

from geoloco.relay.config import RelayConfig
from geoloco.relay.hub import RelayHub
from geoloco.relay.upstream import Traffic


def test_the_first_partial_waits_for_a_listed_site_that_has_not_joined_yet() -> None:
    now = [0.0]
    config = RelayConfig(name="eu", coordinator="127.0.0.1:1", sites=["a", "b"], insecure=True, max_wait_s=30.0)
    hub = RelayHub(config, upstream=None, traffic=Traffic(), clock=lambda: now[0])  # type: ignore[arg-type]
    hub.members["a"] = 0.0  # "a" joined through the relay; "b" is still starting
    r = hub.round
    r.shape, r.first_upload_s = (4,), 0.0
    r.add("a", torch.ones(4), 1.0, inner_steps=1, upload_bytes=16)
    now[0] = 5.0
    assert hub.take_due() is None
    assert not r.forwarded

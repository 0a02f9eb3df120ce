"""A relay's first partial waits for the sites it lists: a listed site still starting would
otherwise find round 0 closed at the relay while the coordinator waits for its update (seen in
the emulator on a loaded machine: the run hung in round 0)."""

from __future__ import annotations

import torch

from geoloco.algorithms.aggregation import RunningSum
from geoloco.algorithms.engine import Screen
from geoloco.relay.config import RelayConfig
from geoloco.relay.hub import RelayHub
from geoloco.relay.partial import SiteUpdate
from geoloco.relay.upstream import Traffic


def test_the_first_partial_waits_for_a_listed_site_that_has_not_joined_yet() -> None:
    now = [0.0]
    config = RelayConfig(name="eu", coordinator="127.0.0.1:1", sites=["a", "b"], insecure=True, max_wait_s=30.0)
    hub = RelayHub(config, upstream=None, traffic=Traffic(), clock=lambda: now[0])  # type: ignore[arg-type]
    hub.members["a"] = 0.0  # "a" joined through the relay; "b" is still starting
    r = hub.round
    r.shape = (4,)
    r.core = hub.engine.open(r.number, RunningSum(numel=4), 0.0)
    assert hub.engine.maybe_start(r.core, 0.0, members=1)
    update = torch.ones(4)
    assert hub.engine.admit(r.core, "a", update, 1.0, screen=Screen.of(update), now=0.0).ok
    r.updates["a"] = SiteUpdate(weight=1.0, inner_steps=1, upload_bytes=16, metrics={})
    now[0] = 5.0
    assert hub.take_due() is None
    assert not r.forwarded
    # max_wait_s after the round's first upload, the relay's close rule lets it go without "b".
    assert not hub.engine.decide(r.core, now=29.9, expected={"a", "b"}).close
    assert hub.engine.decide(r.core, now=30.0, expected={"a", "b"}).deadline_hit

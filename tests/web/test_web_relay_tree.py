"""The status page's relay tree (``/api/status`` ``tree``): coordinator -> relays -> sites, with
the bytes on each coordinator <-> relay link and relays kept out of the site rows."""

from __future__ import annotations

from geoloco.coordinator import events as ev
from geoloco.coordinator.status_board import StatusBoard


def board(relays: dict[str, list[str]]) -> StatusBoard:
    return StatusBoard({"relays": relays}, heartbeat_interval_s=1.0, clock=lambda: 10.0, wall_clock=lambda: 1e9)


def feed(b: StatusBoard, kind: str, site: str, **data: object) -> None:
    b.on_event(ev.RoundEvent(kind=kind, time_s=9.0, site=site, round=0, data=data))


def test_the_tree_puts_sites_under_their_relay_with_the_relays_link_bytes() -> None:
    b = board({"us": ["u1"], "eu": ["e1", "e2"]})
    for site in ("e1", "e2", "u1", "flat"):
        feed(b, ev.SITE_JOINED, site)
    feed(b, ev.BYTES_RECEIVED, "relay:eu", nbytes=700)
    feed(b, ev.BYTES_RECEIVED, "relay:eu", nbytes=300)
    feed(b, ev.BYTES_SENT, "relay:eu", nbytes=2000)
    feed(b, ev.BYTES_SENT, "relay:us", nbytes=2000)
    feed(b, ev.BYTES_RECEIVED, "flat", nbytes=50)
    snap = b.snapshot(round_number=1, phase="training", session_id="s")
    # A relay is a link, not a site: its bytes are on the tree, not in the site rows.
    assert [s["name"] for s in snap["sites"]] == ["e1", "e2", "flat", "u1"]
    tree = snap["tree"]
    assert [r["name"] for r in tree["relays"]] == ["eu", "us"]
    eu, us = tree["relays"]
    assert eu["link"] == "relay:eu" and eu["sites"] == ["e1", "e2"]
    assert (eu["bytes_up"], eu["bytes_down"]) == (1000, 2000)
    assert (us["bytes_up"], us["bytes_down"]) == (0, 2000) and us["sites"] == ["u1"]
    assert eu["rate_up_bps"] > 0 and us["rate_up_bps"] == 0
    assert tree["direct"] == ["flat"]
    # Every site on the tree has its state there: the site table is paged, the tree is not.
    assert tree["states"] == {"e1": "joined", "e2": "joined", "u1": "joined", "flat": "joined"}


def test_a_relay_not_heard_from_yet_is_on_the_tree_with_no_bytes() -> None:
    snap = board({"eu": ["e1"]}).snapshot(round_number=0, phase="waiting", session_id="s")
    assert snap["tree"] == {
        "relays": [{"name": "eu", "link": "relay:eu", "bytes_up": 0, "bytes_down": 0, "rate_up_bps": 0.0,
                    "rate_down_bps": 0.0, "sites": ["e1"]}],
        "direct": [],
        "states": {},
    }


def test_without_relays_every_site_is_direct() -> None:
    b = board({})
    feed(b, ev.SITE_JOINED, "a")
    tree = b.snapshot(round_number=0, phase="waiting", session_id="s")["tree"]
    assert tree == {"relays": [], "direct": ["a"], "states": {}}

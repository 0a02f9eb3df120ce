"""The site table of ``/api/status`` in pages: with a thousand sites the page asks for one
screenful (``StatusQuery``), every site is still counted by state, the latest round's per-site
phases come for the page's sites only, and the answer's size does not grow with the sites or
the rounds. Over a real socket, a wrong query gets 400 naming the parameter and what it allows;
in a real headless Chromium the page pages, filters and counts."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from _browser import CHROMIUM, CHROMIUM_FLAGS, require_browser

from geoloco.coordinator import events as ev
from geoloco.coordinator.http_config import HTTPStatusConfig
from geoloco.coordinator.http_status import StatusHTTPServer
from geoloco.coordinator.prometheus import CoordinatorMetrics
from geoloco.coordinator.status_board import (
    DEFAULT_SITE_PAGE,
    MAX_EVENTS,
    MAX_SITE_PAGE,
    STATE_DOWN,
    StatusBoard,
    StatusQuery,
    natural_key,
)
from geoloco.protos.round_phases import SITE_PHASES

HEARTBEAT_S = 1.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fed_board(sites: int, rounds: int, *, clock: Clock | None = None) -> StatusBoard:
    """``sites`` sites named s1..sN that joined and heartbeat, ``rounds`` rounds aggregated with
    every site's phases in their records."""
    clock = clock or Clock()
    board = StatusBoard({"relays": {}}, heartbeat_interval_s=HEARTBEAT_S, clock=clock, wall_clock=lambda: 1e9)
    names = [f"s{i}" for i in range(1, sites + 1)]

    def feed(kind: str, site: str | None, round_number: int, **data: object) -> None:
        board.on_event(ev.RoundEvent(kind=kind, time_s=clock.now, site=site, round=round_number, data=data))

    for name in names:
        feed(ev.SITE_JOINED, name, 0)
    for r in range(rounds):
        for name in names:
            feed(ev.HEARTBEAT, name, r, phase="training")
            feed(ev.BYTES_RECEIVED, name, r, nbytes=1000)
        feed(
            ev.ROUND_AGGREGATED, None, r,
            round=r, participants=names, excluded=[], bytes_up=dict.fromkeys(names, 1000),
            site_metrics={n: {"train_loss": 1.0} for n in names}, phases_s={"receive": 0.1},
            site_phases_s={n: {p: 0.01 * (r + 1) for p in SITE_PHASES} for n in names},
        )
    return board


def snapshot(board: StatusBoard, query: StatusQuery | None = None) -> dict:
    return board.snapshot(round_number=0, phase="running", session_id="s", query=query)


def names(doc: dict) -> list[str]:
    return [row["name"] for row in doc["sites"]]


def test_the_first_page_by_default_in_natural_name_order_with_every_site_counted() -> None:
    doc = snapshot(fed_board(250, 2))
    assert names(doc) == [f"s{i}" for i in range(1, DEFAULT_SITE_PAGE + 1)]  # s2 before s10
    assert doc["site_page"] == {
        "offset": 0, "limit": DEFAULT_SITE_PAGE, "name": "", "state": "", "matched": 250, "total": 250,
    }
    assert doc["site_states"] == {"training": 250}


def test_pages_filters_and_states() -> None:
    clock = Clock()
    board = fed_board(250, 1, clock=clock)
    assert names(snapshot(board, StatusQuery(site_offset=200, site_limit=100))) == [f"s{i}" for i in range(201, 251)]
    assert snapshot(board, StatusQuery(site_offset=300))["sites"] == []
    named = snapshot(board, StatusQuery(site_name="s24", site_limit=5))
    assert names(named) == ["s24", "s240", "s241", "s242", "s243"]
    assert named["site_page"]["matched"] == 11  # s24, s240..s249
    # Everyone silent for 3 heartbeat intervals but s7, which heartbeats: 249 down.
    clock.now = 10.0
    board.on_event(ev.RoundEvent(kind=ev.HEARTBEAT, time_s=clock.now, site="s7", round=1, data={"phase": "waiting"}))
    down = snapshot(board, StatusQuery(site_state=STATE_DOWN, site_limit=3))
    assert names(down) == ["s1", "s2", "s3"] and down["site_page"]["matched"] == 249
    assert down["site_states"] == {STATE_DOWN: 249, "waiting": 1}
    assert names(snapshot(board, StatusQuery(site_state="waiting"))) == ["s7"]
    # Sites off the page were still seen going down, once each: asking again adds no event.
    faults = [e["site"] for e in down["events"] if e["kind"] == "fault"]
    assert len(faults) == min(249, MAX_EVENTS) and len(set(faults)) == len(faults) and "s7" not in faults
    assert snapshot(board, StatusQuery(site_limit=1))["events"] == down["events"]


def test_site_phases_are_the_latest_rounds_for_the_page_only() -> None:
    doc = snapshot(fed_board(30, 3), StatusQuery(site_offset=10, site_limit=5))
    assert doc["site_phases"]["round"] == 2
    assert list(doc["site_phases"]["sites"]) == ["s11", "s12", "s13", "s14", "s15"]
    assert doc["site_phases"]["sites"]["s11"]["train"] == pytest.approx(0.03)
    assert all("site_phases_s" not in r for r in doc["rounds"])


def test_the_answer_does_not_grow_with_sites_or_rounds() -> None:
    """A thousand sites over 200 rounds: the answer used to carry every site's row and every
    round's per-site phases (14 MB at 1,024 sites and 100 rounds); now a page's worth, and a
    poll that has seen the rounds gets only the new ones."""
    small = len(json.dumps(snapshot(fed_board(100, 20))))
    large_board = fed_board(1024, 200)
    large = len(json.dumps(snapshot(large_board)))
    per_round = 400  # one round's summary entry, bytes
    assert large < small + 200 * per_round + 12 * 1024, (small, large)
    polled = snapshot(large_board, StatusQuery(rounds_after=197))
    assert [r["round"] for r in polled["rounds"]] == [198, 199] and polled["rounds_after"] == 197
    assert snapshot(large_board, StatusQuery(rounds_after=199))["rounds"] == []
    assert len(json.dumps(polled)) < large - 190 * per_round // 2


@pytest.mark.parametrize(
    "params, message",
    [
        ({"site_limit": ["0"]}, f"site_limit must be between 1 and {MAX_SITE_PAGE}, got 0"),
        ({"site_limit": [str(MAX_SITE_PAGE + 1)]}, f"between 1 and {MAX_SITE_PAGE}"),
        ({"site_offset": ["-1"]}, "site_offset must be >= 0, got -1"),
        ({"site_offset": ["ten"]}, "site_offset must be a whole number, got 'ten'"),
        ({"site_state": ["asleep"]}, "site_state 'asleep' is not a state; one of"),
        (
            {"page": ["2"]},
            "unknown parameter(s) page; allowed: site_offset, site_limit, site_name, site_state, rounds_after",
        ),
        ({"site_name": ["a", "b"]}, "site_name given 2 times; give it once"),
        ({"rounds_after": ["1.5"]}, "rounds_after must be a whole number, got '1.5'"),
    ],
)
def test_a_wrong_query_names_the_parameter_and_what_it_allows(params: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        StatusQuery.from_params(params)
    assert message in str(info.value)


def test_natural_order() -> None:
    assert sorted(["s10", "s2", "b", "a1", "s1", "site-2-x", "site-10-x"], key=natural_key) == [
        "a1", "b", "s1", "s2", "s10", "site-2-x", "site-10-x",
    ]


@pytest.fixture
def served() -> Iterator[tuple[StatusBoard, Clock, int]]:
    """A board of 250 sites behind a real HTTP server on a free loopback port."""
    clock = Clock()
    board = fed_board(250, 1, clock=clock)

    def status(query: StatusQuery) -> dict:
        return board.snapshot(round_number=1, phase="running", session_id="s", query=query)

    server = StatusHTTPServer(HTTPStatusConfig(enabled=True, port=0), metrics=CoordinatorMetrics(), status=status)
    port = server.start()
    try:
        yield board, clock, port
    finally:
        server.stop()


def test_over_http_the_query_picks_the_page_and_a_wrong_one_gets_400(served) -> None:
    _, _, port = served
    base = f"http://127.0.0.1:{port}/api/status"
    with urllib.request.urlopen(base + "?site_offset=100&site_limit=50&site_name=s1", timeout=10) as response:
        doc = json.load(response)
    assert doc["site_page"]["matched"] == 111  # s1, s10..s19, s100..s199
    assert names(doc) == [f"s{i}" for i in range(189, 200)]
    with urllib.request.urlopen(base, timeout=10) as response:
        assert len(json.load(response)["sites"]) == DEFAULT_SITE_PAGE
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(base + "?site_limit=abc", timeout=10)
    assert info.value.code == 400
    assert info.value.read().decode() == "site_limit must be a whole number, got 'abc'\n"


def rows(page) -> list[str]:
    return page.eval_on_selector_all("#sites tbody tr", "trs => trs.map(tr => tr.dataset.site)")


def test_the_page_pages_filters_and_counts_in_a_browser(served, tmp_path) -> None:
    sync_playwright = require_browser()
    board, clock, port = served
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
        )
        try:
            page = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_function("() => document.querySelectorAll('#sites tbody tr').length === 100")
            assert rows(page) == [f"s{i}" for i in range(1, 101)]
            assert page.inner_text("#site-states") == "250 sites: 250 training"
            assert page.inner_text("#site-range") == "1–100 of 250"
            assert page.is_disabled("#site-prev") and not page.is_disabled("#site-next")
            page.click("#site-next")
            page.click("#site-next")
            page.wait_for_function("() => document.getElementById('site-range').textContent === '201–250 of 250'")
            assert rows(page) == [f"s{i}" for i in range(201, 251)]
            assert page.is_disabled("#site-next")
            # The per-site phase table follows the page.
            page.wait_for_function("() => document.querySelector('#site-phases tbody tr')?.dataset.site === 's201'")
            # A name filter starts again at its first page.
            page.fill("#site-name", "s24")
            page.wait_for_function("() => document.getElementById('site-range').textContent === '1–11 of 11'")
            assert rows(page) == ["s24", *(f"s{i}" for i in range(240, 250))]
            page.fill("#site-name", "")
            # Every site but one goes silent: the counts and the state filter show it.
            clock.now = 10.0
            board.on_event(ev.RoundEvent(kind=ev.HEARTBEAT, time_s=clock.now, site="s7", round=1,
                                         data={"phase": "waiting"}))
            page.wait_for_function(
                "() => document.getElementById('site-states').textContent === '250 sites: 249 down · 1 waiting'"
            )
            page.select_option("#site-state", "waiting")
            page.wait_for_function("() => document.getElementById('site-range').textContent === '1–1 of 1'")
            assert rows(page) == ["s7"]
            assert errors == [], errors
        finally:
            context.close()

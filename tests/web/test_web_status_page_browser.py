"""End to end in a real headless Chromium: a small emulation (real coordinator and site
processes, mutual TLS, shaped links, a site killed and restarted on schedule), its status page
opened in the browser, the site table, the live charts and the killed site going down and back.

Needs Debian's ``chromium`` (``apt-get install -y chromium``) and the ``playwright`` Python
package, which drives the system browser (``playwright install`` is never needed); without them
the test skips with what to install, and ``.ci/run`` (``GEOLOCO_REQUIRE_BROWSER=1``) requires them. The page's
screenshot is saved under the test's tmp folder; ``GEOLOCO_UPDATE_SCREENSHOT=1`` also copies it to
``docs/status-page.png`` (regenerated on purpose only, like a golden file).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from _browser import CHROMIUM, CHROMIUM_FLAGS, require_browser

from geoloco.scenarios.config_file import toml_text
from geoloco.scenarios.emulation import STATUS_PAGE_RE
from geoloco.scenarios.launcher import wait_for

DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "status-page.png"
KILLED = "lisbon"

SCENARIO = {
    "workload": {"name": "mlp"},
    "algorithm": {"name": "diloco", "inner_steps": 10, "uplink_codec": "int8", "downlink_codec": "int8"},
    "run": {
        "rounds": 0,
        "time_budget_s": 120.0,
        "timeout_s": 150.0,
        "min_sites": 1,
        "eval_every": 1,
        "heartbeat_interval_s": 0.5,
        "heartbeat_timeout_s": 4.0,
        "adaptive_deadline": {"enabled": True, "min_s": 5.0, "max_s": 60.0},
    },
    "sites": [
        {"name": "boston", "uplink_bps": 2e7, "downlink_bps": 4e7, "latency_s": 0.01},
        {"name": KILLED, "uplink_bps": 1e7, "downlink_bps": 2e7, "latency_s": 0.04},
        {"name": "osaka", "uplink_bps": 5e6, "downlink_bps": 1e7, "latency_s": 0.08},
    ],
    "faults": [{"kind": "kill_site", "site": KILLED, "at_round": 4, "after_s": 0.2, "down_s": 6.0}],
}


def scenario_toml(scenario: dict) -> str:
    """The scenario as a TOML file (``[[sites]]`` / ``[[faults]]`` for its lists of tables)."""
    return toml_text(scenario)


@pytest.fixture
def emulation(tmp_path: Path):
    """A running ``geoloco emulate`` and its status page URL; stopped with SIGTERM afterwards."""
    scenario = tmp_path / "page.toml"
    scenario.write_text(scenario_toml(SCENARIO))
    out = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "geoloco.scenarios.cli", "emulate", str(scenario), "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "emulate.log", "wb"),  # noqa: SIM115 - closed with the process
    )
    log = out / "logs" / "coordinator.log"

    def status_url() -> str | None:
        if process.poll() is not None:
            raise AssertionError(f"geoloco emulate exited early: {(tmp_path / 'emulate.log').read_text()[-3000:]}")
        match = STATUS_PAGE_RE.search(log.read_text(errors="replace")) if log.exists() else None
        return match["url"] if match else None

    try:
        url = wait_for(status_url, 60, what="the coordinator's status page line")
        yield url, out
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_status_page_shows_sites_charts_and_a_killed_site_coming_back(emulation, tmp_path: Path) -> None:
    sync_playwright = require_browser()
    url, out = emulation
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", url), url
    # /metrics of the same server, scraped while the run goes on.
    assert b"geoloco_coordinator_rounds_completed_total" in urllib.request.urlopen(url + "metrics", timeout=10).read()

    sites = [s["name"] for s in SCENARIO["sites"]]
    shot = tmp_path / "status-page.png"
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),  # a fresh profile
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 1100},
        )
        try:
            page = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.goto(url)
            # Every site in the table, and points on both charts.
            page.wait_for_function(
                """names => names.every(n => document.querySelector(`#sites tr[data-site="${n}"]`))
                   && +document.getElementById('loss-chart').dataset.points > 0
                   && +document.getElementById('bytes-chart').dataset.points > 0""",
                arg=sites,
                timeout=40_000,
            )
            assert page.inner_text("#connection") == "live"
            assert "diloco (H = 10)" in page.inner_text("#config")
            assert "adaptive, 5–60 s" in page.inner_text("#config")
            # The deadline in force, from the latest round (the first runs under max_s).
            page.wait_for_function(
                "() => /deadline \\d/.test(document.getElementById('live').textContent)", timeout=10_000
            )
            assert page.is_visible("#live")
            assert "fragment" not in page.inner_text("#live")  # streaming is off here
            # The emulator kills the site in round 4: the page shows it down...
            row = f'#sites tr[data-site="{KILLED}"]'
            page.wait_for_selector(f'{row}[data-state="down"]', timeout=30_000)
            # ...and back once its restarted process re-joined.
            page.wait_for_function(
                """sel => { const r = document.querySelector(sel);
                            return r && !['down', 'left'].includes(r.dataset.state); }""",
                arg=row,
                timeout=30_000,
            )
            page.wait_for_function(
                "() => [...document.querySelectorAll('#events li')].some(li => li.dataset.kind === 'recovery')",
                timeout=10_000,
            )
            # Let the charts show a few rounds after the recovery, then keep the picture.
            rounds_seen = int(page.get_attribute("#bytes-chart", "data-points") or 0)
            page.wait_for_function(
                "n => +document.getElementById('bytes-chart').dataset.points >= n",
                arg=rounds_seen + 3,
                timeout=20_000,
            )
            # Every site up at once. Waited for, not read at one instant: the page shows a live
            # site down after 3 heartbeat intervals (1.5 s here) without a sign of life, which a
            # loaded 2-core machine can cause for a moment (seen once in a CI run).
            page.wait_for_function(
                """names => names.every(n => {
                       const r = document.querySelector(`#sites tr[data-site="${n}"]`);
                       return r && !['down', 'left'].includes(r.dataset.state); })""",
                arg=sites,
                timeout=15_000,
            )
            page.screenshot(path=str(shot), full_page=True)
            assert errors == [], errors
        finally:
            context.close()
    assert shot.stat().st_size > 10_000
    if os.environ.get("GEOLOCO_UPDATE_SCREENSHOT") == "1":
        DOCS_SCREENSHOT.parent.mkdir(exist_ok=True)
        shutil.copyfile(shot, DOCS_SCREENSHOT)

"""Headless Chromium for the status page's browser tests: Debian's ``chromium`` driven by the
``playwright`` package (``playwright install`` is never needed). Without them a test skips with
what to install; ``.ci/run`` (``GEOLOCO_REQUIRE_BROWSER=1``) requires them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("GEOLOCO_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--no-sandbox",  # CI runs the browser as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
REQUIRED = os.environ.get("GEOLOCO_REQUIRE_BROWSER") == "1"
"""``.ci/run`` sets this: there a missing browser fails the test instead of skipping it."""


def _missing(reason: str) -> None:
    (pytest.fail if REQUIRED else pytest.skip)(reason)


def require_browser():
    """The Playwright module; without a browser the test skips with what to install (fails
    under ``GEOLOCO_REQUIRE_BROWSER=1``)."""
    if not Path(CHROMIUM).exists():
        _missing(
            f"Chromium not found at {CHROMIUM}: install Debian's browser with `apt-get install -y "
            "chromium` (or point GEOLOCO_CHROMIUM at a Chromium binary)"
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the `playwright` package is missing: `pip install playwright` (no `playwright install` needed)")
    return sync_playwright

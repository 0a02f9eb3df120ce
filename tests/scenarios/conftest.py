"""Fixtures of the research tools' tests."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from geoloco.algorithms.optimizers import OUTER_OPTIMIZERS
from geoloco.compression import CODECS
from geoloco.compression import codec as codec_module
from geoloco.scenarios.workloads import WORKLOADS

PLUGINS = Path(__file__).resolve().parents[2] / "examples" / "plugins"
PLUGIN = "signsgd_plugin"
"""examples/plugins/signsgd_plugin.py: a sign-SGD outer optimizer, a codec and a workload."""


@pytest.fixture
def example_plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The example plug-in's folder on ``sys.path`` (spawned workers inherit it; Ray workers get
    the module shipped), and after the test the registries and the module cache as they were:
    other tests list the built-in names exactly."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    saved = dict(OUTER_OPTIMIZERS), dict(CODECS), dict(WORKLOADS)
    yield PLUGINS
    for registry, before in zip((OUTER_OPTIMIZERS, CODECS, WORKLOADS), saved, strict=True):
        registry.clear()
        registry.update(before)  # type: ignore[attr-defined]
    codec_module._parse.cache_clear()
    sys.modules.pop(PLUGIN, None)

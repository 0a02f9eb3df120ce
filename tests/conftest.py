"""Fixtures every test folder may use."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from types import ModuleType

import pytest

REQUIRE_EXTRAS = os.environ.get("GEOLOCO_REQUIRE_EXTRAS") == "1"
"""``.ci/run`` sets this: there a missing optional extra fails its tests instead of skipping them."""


def import_extra(module: str, extra: str) -> ModuleType:
    """``module``, or skip the test saying which extra installs it (fail under
    ``GEOLOCO_REQUIRE_EXTRAS=1``)."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        reason = (
            f"the optional `{module}` package is missing ({err}): pip install 'geoloco[{extra}]' "
            "(GEOLOCO_REQUIRE_EXTRAS=1 turns this skip into a failure)"
        )
        if REQUIRE_EXTRAS:
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def require_extra() -> Callable[[str, str], ModuleType]:
    """``require_extra("ray", "ray")``: the module, or a skip (a failure in CI) naming the extra."""
    return import_extra

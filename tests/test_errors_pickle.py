"""Errors a user meets survive pickling: a sweep worker, a Ray task or a user's own
``multiprocessing`` pool sends them back to the parent, which must raise the same error, not a
``TypeError`` from rebuilding it (exceptions pickle as ``cls(*args)``)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from geoloco.algorithms.config import ConfigError
from geoloco.protos.folder_lock import FolderInUseError, LockHolder
from geoloco.protos.wire_buffers import IncompleteError
from geoloco.scenarios.config_file import ConfigFileError


@pytest.mark.parametrize(
    "error",
    [
        ConfigError("algorithm.inner_steps", "must be >= 1, got 0"),
        ConfigFileError("sweep.toml", "grid.lr", "expected a number"),
        IncompleteError("2 chunks missing", [(3, 5)]),
        FolderInUseError(Path("/tmp/ckpt"), LockHolder("pid 12 on host, since 2026-12-02")),
    ],
    ids=lambda e: type(e).__name__,
)
def test_an_error_pickles_to_the_same_error(error: Exception) -> None:
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
    assert vars(again) == vars(error)

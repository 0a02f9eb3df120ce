"""Shared by the web tests: the coordinator test helpers (fake clock, tiny model, uploads)."""

from __future__ import annotations

import sys
from pathlib import Path

# tests/coordinator/_round_helpers.py drives a RoundStateMachine without sockets.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "coordinator"))

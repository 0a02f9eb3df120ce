"""Where tensors live: one way to read a ``device`` config value, for every process."""

from __future__ import annotations

import torch

from geoloco.algorithms.config import ConfigError

__all__ = ["DEVICES", "resolve_device"]

DEVICES = ("cpu", "cuda", "auto")
"""Values a ``device`` setting accepts."""


def resolve_device(device: str, key: str = "device") -> torch.device:
    """``"auto"`` -> CUDA if available else the CPU; ``"cuda"`` without CUDA is an error.

    ``key``: the dotted config key the value came from (``"simulation.device"``), named in the
    ``ConfigError`` so the user knows which line to change.
    """
    if device not in DEVICES:
        allowed = ", ".join(repr(d) for d in DEVICES)
        raise ConfigError(key, f"got {device!r}; allowed values: {allowed}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(key, "'cuda' requested but CUDA is not available; use 'auto' or 'cpu'")
    return torch.device(device)

"""Where tensors live: one resolver for every config that names a device."""

from __future__ import annotations

import torch

from geoloco.algorithms.config import ConfigError

__all__ = ["DEVICES", "resolve_device"]

DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
"""Device names a config may give (``"cuda:1"`` style indices are accepted too)."""


def resolve_device(device: str, key: str = "device") -> torch.device:
    """``"auto"`` -> CUDA if available else CPU; ``"cuda"`` without CUDA is a config error that
    names ``key`` and the allowed values."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.split(":")[0] not in DEVICES:
        raise ConfigError(key, f"unknown device {device!r}; allowed: {', '.join(DEVICES)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(key, f"{device!r} requested but CUDA is not available; use \"auto\" or \"cpu\"")
    return torch.device(device)

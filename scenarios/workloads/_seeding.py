"""Seeding helpers of the built-in workloads.

Seeds come from ``geoloco.algorithms.params.derive_seed``, the one derivation of the project
(SHA-256 of the parts, so distinct (seed, site) pairs never collide and runs reproduce on any
machine); ``stable_rank`` orders items pseudo-randomly but identically everywhere.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def stable_rank(*parts: object) -> str:
    """A sort key that orders items pseudo-randomly but identically on every machine."""
    return hashlib.sha256("\x1f".join(str(part) for part in parts).encode()).hexdigest()


@contextmanager
def seeded_cpu_rng(seed: int) -> Iterator[None]:
    """Seed the CPU default generator for the block, then restore the caller's RNG state.

    ``nn.Module`` constructors draw their initial weights from the global generator; forking it
    makes ``build_model(seed)`` bit-identical for a seed without disturbing the caller's own
    random stream. Only the CPU generator is touched (models are built on the CPU, then moved),
    so no CUDA state changes either.
    """
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        yield

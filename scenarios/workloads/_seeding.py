"""Seed derivation shared by the built-in workloads.

Seeds are derived by hashing their parts (SHA-256) rather than by arithmetic such as
``seed * 1000 + site``: arithmetic mixing makes distinct (seed, site) pairs collide
(seed 0 / site 1000 vs seed 1 / site 0), and hashing is stable across Python and torch versions,
so a run is reproducible on any machine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def derive_seed(*parts: object) -> int:
    """A 63-bit seed that depends on every part (by ``str``); usable by ``torch.Generator``."""
    digest = hashlib.sha256("\x1f".join(str(part) for part in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


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

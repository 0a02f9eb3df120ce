"""glibc malloc tunables for chunk-sized buffers (measured with ``benchmarks/bench_transfer.py``).

gRPC allocates a new buffer per message; glibc serves allocations above its mmap threshold with
fresh mmaps, whose page faults cost more than the copy itself. ``MALLOC_TUNABLES`` keep
chunk-sized buffers on the heap. glibc reads ``GLIBC_TUNABLES`` only at process start, so
launchers pass ``recommended_env()`` to the processes they start and long-running CLI entry
points call ``reexec_with_malloc_tunables()`` first.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
from collections.abc import Mapping, Sequence

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Process environment (malloc tunables)
# ---------------------------------------------------------------------------------------------

MALLOC_TUNABLES = {
    # Serve allocations up to 32 MiB from the heap instead of fresh mmaps (page faults).
    "glibc.malloc.mmap_threshold": "33554432",
    # Do not give freed heap memory back to the kernel below 1 GiB, so it is reused warm.
    "glibc.malloc.trim_threshold": "1073741824",
}
_REEXEC_MARK = "GEOLOCO_MALLOC_REEXEC"


def is_glibc() -> bool:
    """Whether this interpreter runs on glibc (the only libc that reads ``GLIBC_TUNABLES``)."""
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def _merge_tunables(existing: str) -> str:
    """Add our tunables to a GLIBC_TUNABLES string, keeping any the user set explicitly."""
    items = [p for p in existing.split(":") if p]
    keys = {p.split("=", 1)[0] for p in items}
    items += [f"{k}={v}" for k, v in MALLOC_TUNABLES.items() if k not in keys]
    return ":".join(items)


def recommended_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: ``os.environ``) plus ``GLIBC_TUNABLES`` for fast chunk buffers.

    Pass it as ``env=`` to every coordinator/site process a launcher starts; it has no effect
    on an already running process. Harmless on non-glibc systems (the variable is ignored).
    """
    env = dict(os.environ if base is None else base)
    env["GLIBC_TUNABLES"] = _merge_tunables(env.get("GLIBC_TUNABLES", ""))
    return env


def return_free_heap() -> bool:
    """Give the heap memory freed so far back to the kernel (glibc's ``malloc_trim(0)``);
    whether it ran.

    ``trim_threshold`` keeps freed heap memory for reuse, which is right for chunk buffers but
    wrong for what a process frees once before it serves: a model built layer by layer (layers
    below the mmap threshold live on the heap) and dropped after flattening would stay resident
    for the whole run, or not, depending on where glibc happened to place it. Servers call this
    once when they start, so their memory does not depend on how the caller built the model."""
    if not is_glibc():
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def malloc_tunables_active() -> bool:
    """Whether this process was started with our tunables (or explicit values for them)."""
    current = os.environ.get("GLIBC_TUNABLES", "")
    keys = {p.split("=", 1)[0] for p in current.split(":") if p}
    return all(k in keys for k in MALLOC_TUNABLES)


def reexec_with_malloc_tunables(argv: Sequence[str] | None = None) -> None:
    """Re-execute this Python process with the malloc tunables set, once; returns only when
    nothing needs doing (already set, not glibc, or already re-executed).

    Call it first thing in the entry point of a long-running transfer process (before threads
    or gRPC start). ``GEOLOCO_NO_MALLOC_REEXEC=1`` disables it.
    """
    if (
        malloc_tunables_active()
        or not is_glibc()
        or os.environ.get(_REEXEC_MARK)
        or os.environ.get("GEOLOCO_NO_MALLOC_REEXEC")
    ):
        return
    env = recommended_env()
    env[_REEXEC_MARK] = "1"
    args = list(sys.orig_argv if argv is None else argv)
    logger.debug("re-executing with GLIBC_TUNABLES=%s", env["GLIBC_TUNABLES"])
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *args[1:]], env)

"""Buffers for the codecs: reusable per-thread workspaces and fast large allocations.

Why this exists: on the machines we measured, writing into freshly allocated host memory ran at
2-4 GB/s because every 4 KiB page faults on first touch, while writing into memory already mapped
ran at 10-20 GB/s. The codecs therefore (a) work through large tensors in cache-sized chunks whose
temporaries live in a reused workspace, and (b) ask the kernel for transparent huge pages on the
few large tensors they must allocate fresh (the payload they return, the tensor ``decode``
returns), which cuts the page faults 512-fold. Both are pure performance measures; results are
identical without them.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading

import torch

logger = logging.getLogger(__name__)

_HUGE_PAGE = 1 << 21
_MADV_HUGEPAGE = 14
_MIN_HUGE_NBYTES = 4 * _HUGE_PAGE


def _load_madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if sys.platform != "linux":
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _load_madvise()


def empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(numel)``, with transparent huge pages advised for large host tensors.

    The advice is given before the first write, on the 2 MiB-aligned interior of the new block;
    where the kernel ignores or refuses it the tensor is simply a normal one.
    """
    tensor = torch.empty(numel, dtype=dtype, device=device)
    nbytes = numel * tensor.element_size()
    if _madvise is not None and device.type == "cpu" and nbytes >= _MIN_HUGE_NBYTES:
        start = tensor.data_ptr()
        lo = (start + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
        hi = (start + nbytes) & ~(_HUGE_PAGE - 1)
        if hi > lo and _madvise(lo, hi - lo, _MADV_HUGEPAGE) != 0:
            logger.debug("madvise(MADV_HUGEPAGE) refused (errno %d); continuing without", ctypes.get_errno())
    return tensor


def zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Like :func:`empty`, filled with zeros."""
    return empty(numel, dtype, device).zero_()


class _Workspace(threading.local):
    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


_workspace = _Workspace()


def workspace(tag: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D scratch tensor of ``numel`` elements, reused across calls with the same tag.

    Per thread, so codecs may run concurrently in a thread pool. Contents are undefined. Callers
    keep sizes bounded (chunk-sized), so the cache stays small; two live buffers need two tags.
    """
    key = (tag, dtype, device)
    buffer = _workspace.buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = torch.empty(numel, dtype=dtype, device=device)
        _workspace.buffers[key] = buffer
    return buffer[:numel]

"""Whether a tensor holds only finite values, without a mask as large as the tensor.

``torch.isfinite(t).all()`` reads ``t`` and writes a boolean mask of ``t.numel()`` bytes (256 MB
of reads and 64 MB of writes for a 64M-parameter update) on every upload and every site round. A
reduction answers the same question for free in the common case: a NaN or an infinity makes
any sum or norm non-finite (``inf + finite = inf``, ``inf − inf = NaN``, NaN propagates, in any
order of summation), so a finite sum proves every value finite. Only a non-finite reduction,
which finite values can also produce by overflowing, needs the exact elementwise check.

A site whose pseudo-gradient is not finite sends nothing and says why (``WITHHELD_NON_FINITE``);
the round rejects it with ``withheld_reason``'s words, at the coordinator, at a relay and in the
simulator alike.
"""

from __future__ import annotations

import math

import torch

__all__ = ["MAX_WITHHELD_CHARS", "WITHHELD_NON_FINITE", "all_finite", "withheld_reason"]

WITHHELD_NON_FINITE = "its pseudo-gradient had NaN/Inf values (lower the inner lr if it happens again)"
"""What a site says when it withholds a non-finite update."""
MAX_WITHHELD_CHARS = 200
"""Characters of a site's reason for withholding its update kept for the log and the record."""


def withheld_reason(said: str) -> str:
    """The rejection reason for a site that sent no update and said why
    (``AwaitBroadcastRequest.withheld``)."""
    return f"the site sent no update: {said[:MAX_WITHHELD_CHARS]}"


def all_finite(tensor: torch.Tensor, reduction: float | None = None) -> bool:
    """True when every value of ``tensor`` is finite.

    ``reduction``: a sum or a norm of ``tensor`` the caller computed anyway (e.g. the update's
    L2 norm); without one, the tensor is summed.
    """
    if tensor.numel() == 0:
        return True
    value = float(tensor.sum()) if reduction is None else reduction
    if math.isfinite(value):
        return True
    return bool(torch.isfinite(tensor).all())

"""Which elements of the flat parameter vector one rank of a sharded (FSDP) site owns.

A sharded site's rank uploads only its own shard of the site's update, so the coordinator must
know where those elements sit in the flat vector (``ParamLayout`` order) without being told a
list of ranges: both sides compute them from the layout and the shard count with the rule the
manifest names. The one rule, ``"dim0"``, is FSDP2's (``torch.distributed.fsdp.fully_shard``
over a 1-D mesh): every parameter's dim 0 is split like ``torch.chunk(param, count, dim=0)``
(chunks of ``ceil(rows / count)`` rows, the last ones shorter or empty), so rank ``r``'s local
shard ``param.to_local()`` is a contiguous row range of the parameter, hence a contiguous range of
the flat vector; a rank's shard of the update is those ranges concatenated in layout order.

Pure arithmetic on shapes; no torch.distributed, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

__all__ = ["SHARD_SPLITS", "ShardRange", "shard_numel", "shard_ranges"]

DIM0: Final = "dim0"
SHARD_SPLITS: Final = (DIM0,)
"""The split rules a manifest may name (``UploadManifest.shard_split``)."""

ShardRange = tuple[int, int]
"""(offset in the flat vector, number of elements)."""


def shard_ranges(shapes: Sequence[Sequence[int]], index: int, count: int, split: str = DIM0) -> list[ShardRange]:
    """The flat-vector ranges shard ``index`` of ``count`` owns, in layout order (empty
    ranges left out); ``shapes`` are the layout's parameter shapes in order.

    A 0-dimensional parameter counts as one row (shard 0 owns it). Raises ``ValueError`` naming
    what is wrong for an unknown rule or an index outside ``0 .. count-1``.
    """
    if split not in SHARD_SPLITS:
        raise ValueError(f"shard split {split!r} is not known; the splits are {list(SHARD_SPLITS)}")
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard {index} of {count} does not exist; shards are numbered 0 .. count-1")
    ranges: list[ShardRange] = []
    offset = 0
    for shape in shapes:
        numel = math.prod(shape)
        rows = shape[0] if len(shape) > 0 else 1
        per_row = numel // rows if rows else 0
        chunk = -(-rows // count)
        start = min(rows, index * chunk)
        stop = min(rows, start + chunk)
        if stop > start and per_row:
            ranges.append((offset + start * per_row, (stop - start) * per_row))
        offset += numel
    return ranges


def shard_numel(shapes: Sequence[Sequence[int]], index: int, count: int, split: str = DIM0) -> int:
    """Elements of shard ``index`` of ``count`` (the length of that rank's upload)."""
    return sum(n for _, n in shard_ranges(shapes, index, count, split))

"""Exact sizes the training-time planner needs without a model: codec wire bytes from an element
count, and Streaming DiLoCo's fragment sizes."""

from __future__ import annotations

import torch

from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.streaming import FragmentPartition
from geoloco.compression import parse_codec

__all__ = ["PlanError", "encoded_nbytes", "fragment_numels"]


class PlanError(ValueError):
    """A configuration the planner cannot predict (the message says what to change)."""


def encoded_nbytes(spec: str, numel: int) -> int:
    """Wire bytes of one flat fp32 vector of ``numel`` elements under codec ``spec``: what the
    simulator's ``Encoded.nbytes`` is for an upload or a broadcast of that many elements."""
    return parse_codec(spec).encoded_nbytes((numel,), torch.float32)


def fragment_numels(
    numel: int, fragments: int, *, layout: ParamLayout | None = None, split: str = "strided"
) -> list[int]:
    """Elements per Streaming DiLoCo fragment: the layout's own partition when given (exactly the
    simulator's), else ``fragments`` near-equal shares of ``numel``."""
    if layout is not None:
        if layout.numel != numel:
            raise PlanError(f"layout has {layout.numel} elements but the plan was given {numel}")
        partition = FragmentPartition.from_layout(layout, fragments, split)
        return [f.numel for f in partition.fragments]
    if fragments > numel:
        raise PlanError(f"{fragments} fragments need at least as many parameters, got {numel}")
    base, extra = divmod(numel, fragments)
    return [base + (1 if p < extra else 0) for p in range(fragments)]

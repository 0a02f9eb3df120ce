"""Exact sizes the training-time planner needs without a model: codec wire bytes from an element
count, Streaming DiLoCo's fragment sizes, and a secure round's messages stage by stage."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from geoloco.algorithms.fixed_point import MODULUS_DTYPES
from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig, plan_secure_round
from geoloco.algorithms.privacy.secagg_in_memory import SiteTraffic, run_round_in_memory
from geoloco.algorithms.privacy.secagg_messages import SecAggAbort
from geoloco.algorithms.streaming import FragmentPartition
from geoloco.compression import parse_codec

__all__ = ["PlanError", "encoded_nbytes", "fragment_numels", "secure_traffic"]


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


def secure_traffic(
    privacy: PrivacyConfig, uplink_codec: str, *, numel: int, num_sites: int, session: str, round_index: int
) -> list[SiteTraffic]:
    """Each site's bytes in every stage of a secure round over ``num_sites`` sites, none dropping
    out: what the simulator's ``InMemorySecureSum`` counts for round ``round_index`` of session
    ``session``. No message but the masked vector depends on ``numel`` or on the values summed
    (keys, ciphertexts and signatures have fixed lengths), so the protocol runs once on a
    one-element vector and the masked vector is its ring length at the modulus width."""
    try:
        context, _ = plan_secure_round(
            privacy, uplink_codec, numel=numel, num_sites=num_sites, session=session, round_index=round_index
        )
        one = dataclasses.replace(context, numel=1)
        traffic: dict[int, SiteTraffic] = {}
        run_round_in_memory(
            one, {k: np.zeros(1, dtype=MODULUS_DTYPES[context.modulus_bits]) for k in range(num_sites)},
            {k: Ed25519PrivateKey.generate() for k in range(num_sites)}, traffic=traffic,
        )
    except (ValueError, SecAggAbort) as err:
        raise PlanError(f"secure aggregation over {num_sites} sites: {err}") from None
    masked = context.numel * context.modulus_bits // 8
    return [dataclasses.replace(traffic[k], masked_up=masked) for k in range(num_sites)]

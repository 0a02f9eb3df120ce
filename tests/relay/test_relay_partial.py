"""The relay's upward encoding (``geoloco.relay.partial.encode_partial``): lossless ``none`` sends
the mean itself; a lossy codec keeps what it dropped in a residual in sum space, so that over
rounds with different weights what the coordinator adds plus the residual is what the relay
received."""

from __future__ import annotations

import torch

from geoloco.compression import decode
from geoloco.relay.partial import encode_partial


def test_none_sends_the_mean_itself_and_keeps_no_residual() -> None:
    mean = torch.randn(100, generator=torch.Generator().manual_seed(0))
    encoded, residual = encode_partial(mean, 3.0, "none", None)
    assert residual is None
    assert torch.equal(decode(encoded), mean)


def test_int8_residual_carries_what_was_dropped_across_rounds_of_different_weight() -> None:
    g = torch.Generator().manual_seed(1)
    residual = None
    received = torch.zeros(1000, dtype=torch.float64)
    added = torch.zeros(1000, dtype=torch.float64)
    for weight in (2.0, 7.5, 1.25, 4.0):
        mean = torch.randn(1000, generator=g)
        encoded, residual = encode_partial(mean, weight, "int8", residual)
        assert residual is not None and float(residual.abs().max()) > 0
        received += weight * mean.double()
        added += weight * decode(encoded).double()
        # Everything received so far = everything sent so far + what the residual holds.
        torch.testing.assert_close(added + residual.double(), received, rtol=0, atol=1e-4)

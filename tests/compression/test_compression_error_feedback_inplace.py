"""Error feedback forms ``u``, encodes it and subtracts the message in its one residual buffer,
with the very numbers of the two-buffer form it replaces (issue #13: the downlink error-feedback
workspace beside its residual)."""

from __future__ import annotations

import pytest
import torch

from geoloco.compression import Codec, Encoded, ErrorFeedback, parse_codec


class TwoBufferFeedback:
    """The previous implementation: ``u`` in a workspace beside the residual."""

    def __init__(self, codec: Codec, decay: float) -> None:
        self.codec, self.decay = codec, decay
        self.residual: torch.Tensor | None = None

    def encode(self, tensor: torch.Tensor, seed: int) -> Encoded:
        residual = self.residual if self.residual is not None else torch.zeros_like(tensor)
        if self.decay == 1.0:
            corrected = torch.add(residual, tensor)
        else:
            corrected = torch.add(tensor, residual, alpha=self.decay)
        encoded = self.codec.encode(corrected, seed=seed)
        self.codec.decode(encoded, out=residual)
        self.residual = torch.sub(corrected, residual)
        return encoded


@pytest.mark.parametrize(
    "spec", ["int8", "int4:block=64,stochastic", "topk:0.05|int4", "randk:0.1,unbiased|int8", "bf16", "int1"]
)
@pytest.mark.parametrize("decay", [1.0, 0.9])
def test_in_place_feedback_is_bitwise_the_two_buffer_one(spec: str, decay: float) -> None:
    codec = parse_codec(spec)
    new, old = ErrorFeedback(codec, decay=decay), TwoBufferFeedback(codec, decay)
    generator = torch.Generator().manual_seed(7)
    numel = (1 << 20) + 3001  # several check pieces and a tail
    for step in range(3):
        tensor = torch.randn(numel, generator=generator) * 1e-2
        torch.manual_seed(step)  # stochastic rounding draws the same noise in both
        sent_new = new.encode(tensor, seed=step)
        torch.manual_seed(step)
        sent_old = old.encode(tensor, seed=step)
        assert sent_new == sent_old, (spec, step)
        assert new.residual is not None and old.residual is not None
        assert torch.equal(new.residual.view(torch.int32), old.residual.view(torch.int32)), (spec, step)


def test_feedback_holds_no_workspace_beside_its_residual() -> None:
    feedback = ErrorFeedback(parse_codec("topk:0.01|int4"))
    for seed in range(2):
        feedback.encode(torch.randn(50_000), seed=seed)
    held = [value for value in vars(feedback).values() if isinstance(value, torch.Tensor)]
    assert len(held) == 1 and held[0] is feedback.residual


def test_a_refused_sum_leaves_the_residual_unchanged() -> None:
    feedback = ErrorFeedback(parse_codec("topk:0.05|int8"))
    feedback.encode(torch.randn(4096), seed=0)
    assert feedback.residual is not None
    before = feedback.residual.clone()
    bad = torch.randn(4096)
    bad[17] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        feedback.encode(bad)
    assert torch.equal(feedback.residual, before)
    # A finite sum so close to float32's limit that no bfloat16 scale covers it: refused.
    scaled = ErrorFeedback(parse_codec("int1:stochastic"))
    scaled.encode(torch.randn(4096), seed=0)
    assert scaled.residual is not None
    before = scaled.residual.clone()
    with pytest.raises(ValueError, match="float32's limit"):
        scaled.encode(torch.full((4096,), torch.finfo(torch.float32).max))
    assert torch.equal(scaled.residual, before)


def test_sums_near_float32s_limit_take_the_two_buffer_path_with_the_same_numbers() -> None:
    codec = parse_codec("int8")
    new, old = ErrorFeedback(codec), TwoBufferFeedback(codec, 1.0)
    huge = torch.full((4096,), torch.finfo(torch.float32).max * 0.75)
    for step, tensor in enumerate((torch.randn(4096), huge)):
        assert new.encode(tensor, seed=step) == old.encode(tensor, seed=step)
        assert new.residual is not None and old.residual is not None
        assert torch.equal(new.residual, old.residual)

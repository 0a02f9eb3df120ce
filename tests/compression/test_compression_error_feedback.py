"""Error feedback loses nothing: decoded outputs plus the final residual sum to the inputs."""

from __future__ import annotations

import threading

import pytest
import torch

from geoloco.compression import ErrorFeedback, decode, parse_codec

LOSSY = ["int1", "int2:block=64,stochastic", "int4", "topk:0.05|int4:block=64", "topk:0.01", "randk:0.1|int8", "bf16"]


@pytest.mark.parametrize("spec", LOSSY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_decoded_sum_plus_residual_equals_input_sum(spec: str, dtype: torch.dtype) -> None:
    feedback = ErrorFeedback(parse_codec(spec))
    generator = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(37, 29, generator=generator) * scale).to(dtype) for scale in (1.0, 0.1, 3.0, 1e-3, 0.5, 2.0)]
    decoded_total = torch.zeros(37, 29, dtype=torch.float64)
    for step, x in enumerate(inputs):
        encoded = feedback.encode(x, seed=step)
        assert encoded.dtype == dtype
        decoded = decode(encoded.to_bytes())
        decoded_total += decoded.double()
    assert feedback.residual is not None
    input_total = sum(x.double() for x in inputs)
    scale = max(float(x.double().abs().max()) for x in inputs)
    torch.testing.assert_close(decoded_total + feedback.residual.double(), input_total, rtol=0, atol=1e-5 * scale)


def test_residual_follows_the_decay_recurrence() -> None:
    codec = parse_codec("topk:0.1|int8")
    feedback = ErrorFeedback(codec, decay=0.5)
    residual = torch.zeros(1000, dtype=torch.float64)
    for step in range(5):
        x = torch.randn(1000)
        decoded = codec.decode(feedback.encode(x, seed=step)).double()
        corrected = 0.5 * residual + x.double()
        residual = corrected - decoded
        assert feedback.residual is not None
        torch.testing.assert_close(feedback.residual.double(), residual, rtol=0, atol=1e-5)


def test_lossless_codec_leaves_no_residual() -> None:
    feedback = ErrorFeedback(parse_codec("none"))
    for _ in range(3):
        x = torch.randn(64)
        assert torch.equal(decode(feedback.encode(x)), x)
    assert feedback.residual is not None and bool((feedback.residual == 0).all())


def test_error_feedback_sends_what_it_dropped_later() -> None:
    # A constant input under top-1 of 4: each coordinate is sent in turn as its residual grows.
    feedback = ErrorFeedback(parse_codec("topk:0.25,chunk=4"))
    sent = torch.zeros(4)
    for _ in range(8):
        sent += decode(feedback.encode(torch.tensor([1.0, 1.1, 1.2, 1.3])))
    assert bool((sent > 0).all())


def test_state_dict_round_trip_continues_identically() -> None:
    codec = parse_codec("topk:0.2|int4:block=8")
    original = ErrorFeedback(codec)
    assert original.state_dict() == {}
    inputs = [torch.randn(100) for _ in range(4)]
    for x in inputs[:2]:
        original.encode(x)
    restored = ErrorFeedback(codec)
    restored.load_state_dict(original.state_dict())
    for x in inputs[2:]:
        assert original.encode(x) == restored.encode(x)
    assert torch.equal(original.state_dict()["residual"], restored.state_dict()["residual"])
    restored.reset()
    assert restored.residual is None and restored.state_dict() == {}


def test_bad_input_leaves_the_residual_unchanged() -> None:
    feedback = ErrorFeedback(parse_codec("int4"))
    feedback.encode(torch.randn(10))
    assert feedback.residual is not None
    before = feedback.residual.clone()
    bad = torch.randn(10)
    bad[3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        feedback.encode(bad)
    assert torch.equal(feedback.residual, before)
    with pytest.raises(ValueError, match="one ErrorFeedback per tensor"):
        feedback.encode(torch.randn(11))
    assert torch.equal(feedback.residual, before)


def test_invalid_arguments_are_rejected() -> None:
    codec = parse_codec("int8")
    for decay in (-0.1, 1.5):
        with pytest.raises(ValueError, match="decay"):
            ErrorFeedback(codec, decay=decay)
    feedback = ErrorFeedback(codec)
    with pytest.raises(ValueError, match="unknown keys"):
        feedback.load_state_dict({"residual": torch.zeros(2), "momentum": torch.zeros(2)})
    with pytest.raises(ValueError, match="float32 or float64"):
        feedback.load_state_dict({"residual": torch.zeros(2, dtype=torch.int64)})


def test_concurrent_encodes_match_serial_ones() -> None:
    codec = parse_codec("topk:0.05|int4")
    tensors = [torch.randn(300_000, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    serial = [codec.encode(x).to_bytes() for x in tensors]
    results: list[bytes | None] = [None] * len(tensors)

    def work(index: int) -> None:
        for _ in range(3):
            results[index] = codec.encode(tensors[index]).to_bytes()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(tensors))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive()
    assert results == serial


def test_decode_into_out_and_device() -> None:
    codec = parse_codec("int8")
    x = torch.randn(4, 300)
    encoded = codec.encode(x)
    out = torch.empty(4, 300)
    assert codec.decode(encoded, out=out) is out
    assert torch.equal(out, codec.decode(encoded, device="cpu"))
    wide = torch.empty(1200, dtype=torch.float64)
    codec.decode(encoded, out=wide)
    torch.testing.assert_close(wide.view(4, 300).float(), out)
    with pytest.raises(ValueError, match="out="):
        codec.decode(encoded, out=torch.empty(1199))
    with pytest.raises(ValueError, match="contiguous"):
        codec.decode(encoded, out=torch.empty(300, 4).t())


def test_non_contiguous_and_grad_tensors_encode() -> None:
    x = torch.randn(30, 40, requires_grad=True)
    view = x.t()
    y = decode(parse_codec("none").encode(view))
    assert torch.equal(y, view.detach())
    assert not y.requires_grad

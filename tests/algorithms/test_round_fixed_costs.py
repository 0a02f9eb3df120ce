"""The per-round fixed costs of a big model: finiteness without a mask, Nesterov without a
look-ahead temporary (allocations counted with the torch profiler, never timed)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from geoloco.algorithms.finite import all_finite
from geoloco.algorithms.optimizers import OuterOptimizer, OuterOptimizerConfig

N = 1_000_000


def _allocated_bytes(fn) -> int:  # type: ignore[no-untyped-def]
    """Bytes ``fn`` allocated on the CPU (each op's own allocations, summed)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(0, e.self_cpu_memory_usage) for e in prof.key_averages())


@pytest.mark.parametrize(
    ("values", "finite"),
    [
        ([1.0, -2.0, 3.0], True),
        ([3e38, 3e38, 3e38], True),  # finite values whose sum overflows: the exact check decides
        ([1.0, float("nan"), 2.0], False),
        ([1.0, float("inf")], False),
        ([float("-inf"), 2.0], False),
        ([float("inf"), float("-inf")], False),
        ([], True),
    ],
)
def test_all_finite_is_exact(values: list[float], finite: bool) -> None:
    tensor = torch.tensor(values, dtype=torch.float32)
    assert all_finite(tensor) is finite
    norm = float(torch.linalg.vector_norm(tensor)) if values else 0.0
    assert all_finite(tensor, norm) is finite


def test_all_finite_allocates_no_mask_the_size_of_the_tensor() -> None:
    tensor = torch.randn(N)
    assert _allocated_bytes(lambda: all_finite(tensor)) < N // 10
    assert _allocated_bytes(lambda: bool(torch.isfinite(tensor).all())) >= N  # what it replaces


def test_nesterov_outer_step_allocates_only_the_new_weights() -> None:
    """The step's own copy of θ_t (the returned θ') is the only model-sized allocation: the
    consumed gradient holds the Nesterov look-ahead (foreach), not a temporary beside it."""
    outer = OuterOptimizer(OuterOptimizerConfig(name="nesterov"), N)
    weights = torch.zeros(N)
    outer.step(weights, torch.ones(N), consume_gradient=True)  # the momentum buffer exists now
    gradient = torch.ones(N)
    allocated = _allocated_bytes(lambda: outer.step(weights, gradient, consume_gradient=True))
    assert allocated < 1.5 * 4 * N


@pytest.mark.parametrize("name", ["nesterov", "sgd"])
def test_foreach_outer_step_is_bit_identical_to_the_single_tensor_step(name: str) -> None:
    results = []
    for foreach in (False, True):
        outer = OuterOptimizer(OuterOptimizerConfig(name=name, momentum=0.9, weight_decay=0.01), 10_007)
        for group in outer.optimizer.param_groups:
            group["foreach"] = foreach
        generator = torch.Generator().manual_seed(0)
        weights = torch.randn(10_007, generator=generator)
        for _ in range(3):
            weights = outer.step(weights, torch.randn(10_007, generator=generator), consume_gradient=True)
        results.append(weights)
    assert torch.equal(results[0], results[1])


def test_outer_state_for_a_checkpoint_is_not_cloned() -> None:
    outer = OuterOptimizer(OuterOptimizerConfig(name="nesterov"), N)
    outer.step(torch.zeros(N), torch.ones(N), consume_gradient=True)
    assert _allocated_bytes(outer.state_tensors) < N // 10
    state = outer.state_tensors()
    assert torch.equal(state["state.0.momentum_buffer"], torch.ones(N))


def test_received_bytes_are_parsed_without_copying_the_payload() -> None:
    from geoloco.compression import Encoded, decode, parse_codec

    original = torch.randn(1000)
    wire = bytearray(parse_codec("none").encode(original, seed=0).to_bytes())  # a receive buffer is writable
    viewed = Encoded.from_bytes(memoryview(wire), copy=False)
    assert viewed.payload.data_ptr() == torch.frombuffer(wire, dtype=torch.uint8)[len(wire) - 4 - 4000:].data_ptr()
    assert torch.equal(decode(viewed), original)
    copied = Encoded.from_bytes(memoryview(wire))
    assert copied.payload.data_ptr() != viewed.payload.data_ptr() and torch.equal(decode(copied), original)
    frozen = Encoded.from_bytes(bytes(wire), copy=False)  # read-only data is still copied
    assert torch.equal(decode(frozen), original)


def test_site_pseudo_gradient_reuses_the_flattened_copy_and_matches_bit_for_bit() -> None:
    from geoloco.algorithms.diloco import pseudo_gradient, pseudo_gradient_into_local

    global_flat, local_flat = torch.randn(N), torch.randn(N)
    expected = pseudo_gradient(global_flat, local_flat)
    scratch = local_flat.clone()
    assert _allocated_bytes(lambda: pseudo_gradient_into_local(global_flat, scratch)) < N // 10
    assert torch.equal(pseudo_gradient_into_local(global_flat, local_flat.clone()), expected)
    half = local_flat.to(torch.bfloat16)  # another dtype: the plain function, same result
    assert torch.equal(pseudo_gradient_into_local(global_flat, half), pseudo_gradient(global_flat, half))


def test_lossless_payload_at_an_odd_offset_is_decoded_with_one_copy() -> None:
    """A received ``none`` update's payload starts 29 bytes into the buffer: misaligned for
    float32. Decoding copies its bytes straight into the result instead of first realigning
    them into a temporary as large as the model."""
    from geoloco.compression import Encoded, decode, parse_codec

    original = torch.randn(N)
    wire = bytearray(parse_codec("none").encode(original, seed=0).to_bytes())
    received = Encoded.from_bytes(memoryview(wire), copy=False)
    assert received.payload.data_ptr() % 4  # the case this is about
    decoded: list[torch.Tensor] = []
    allocated = _allocated_bytes(lambda: decoded.append(decode(received, device="cpu")))
    assert allocated < 1.5 * 4 * N
    assert torch.equal(decoded[0], original)
    half = torch.empty(N, dtype=torch.float64)  # out= of another dtype: converted, same values
    assert torch.equal(decode(received, device="cpu", out=half), original.double())
